"""The partition a :class:`~cpshard.sharder.ContextParallelSharder` follows: the current shard
layout (closed-form or carrying indices) and/or the caller's indices callable, this rank's
positions, the per-layout cache of derived index tensors, and the index gathers that apply
them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from cpshard import ops
from cpshard.comm import Group, GroupLike, resolve_group
from cpshard.layouts import ShardLayout, is_closed_form, local_token_global_indices
from cpshard.validation import Problem

_T = TypeVar("_T")


def take(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` along the last dim, either being 1-D (shared by all rows) or ``[B, n]``;
    negative entries of ``src`` stay negative."""
    if src.dim() == 1:
        return src[idx]
    if idx.dim() == 1:
        return src[:, idx]
    if src.shape[0] != idx.shape[0]:
        raise Problem(
            f"the position map has {src.shape[0]} rows but the layout has {idx.shape[0]}"
        )
    return torch.gather(src, 1, idx)


def gather_rows(t: torch.Tensor, dim: int, index: torch.Tensor, fill: Any) -> torch.Tensor:
    """``index_gather`` along ``dim`` with a 1-D index (every row alike) or a per-row ``[B, n]``
    index (the batch dim is ``dim - 1``; a batch of 1 is broadcast)."""
    if index.dim() == 2 and index.shape[0] == 1:
        index = index[0]
    if index.dim() == 1:
        return ops.index_gather(t, index, dim, fill)
    rows, n = index.shape
    if dim == 0 or t.shape[dim - 1] not in (rows, 1):
        raise Problem(
            f"the layout differs between the {rows} rows of the batch, so the tensor needs its "
            f"batch dim (of size {rows}) right before seq_dim={dim}; got shape {tuple(t.shape)}"
        )
    if t.shape[dim - 1] == 1 and rows > 1:
        t = t.expand(*t.shape[: dim - 1], rows, *t.shape[dim:])
    length = t.shape[dim]
    flat = t.flatten(dim - 1, dim)
    offsets = torch.arange(rows, device=index.device).unsqueeze(1) * length
    flat_index = torch.where(index >= 0, index + offsets, torch.full_like(index, -1)).reshape(-1)
    return ops.index_gather(flat, flat_index, dim - 1, fill).unflatten(dim - 1, (rows, n))


class Partition:
    """The sharder's partition and its index caches.

    ``layout`` / ``num_chunks``: the sharder's built-in layout (None in the direct form);
    ``user_indices``: the caller's ``local_token_global_indices`` callable, if any;
    :attr:`shard_layout`: the layout of the last shard (or one given to start from)."""

    def __init__(
        self,
        group: Group,
        cp_mesh: GroupLike,
        layout: str | None,
        num_chunks: int | None,
        user_indices: Callable[..., torch.Tensor] | None,
        shard_layout: ShardLayout | None,
    ) -> None:
        self.group, self.cp_mesh = group, cp_mesh
        self.layout, self.num_chunks = layout, num_chunks
        self.user_indices = user_indices
        self._cache: dict[tuple, Any] = {}
        self.shard_layout = shard_layout

    @property
    def shard_layout(self) -> ShardLayout | None:
        return self._shard_layout

    @shard_layout.setter
    def shard_layout(self, layout: ShardLayout | None) -> None:
        """A new partition (every shard sets one, even the same object: a caller's indices
        callable may answer differently per step): the derived index tensors are dropped."""
        self._shard_layout = layout
        self._cache.clear()

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world

    def where(self, what: str) -> str:
        return f"cpshard.ContextParallelSharder.{what}: rank {self.rank}"

    def closed_form_indices(
        self, cp_mesh: GroupLike, padded_seq_len: int, device=None
    ) -> torch.Tensor:
        """The ``local_token_global_indices`` callable of the built-in closed-form layout."""
        g = resolve_group(cp_mesh, "ContextParallelSharder.local_token_global_indices")
        return local_token_global_indices(
            self.layout, g.rank, g.world, padded_seq_len, num_chunks=self.num_chunks, device=device
        )

    def source(self) -> tuple[ShardLayout | None, Callable | None]:
        """The current partition: a layout (carrying indices or closed-form), and/or the caller's
        callable; raises before the first shard of a data-dependent layout."""
        lay = self.shard_layout
        if lay is not None:
            if lay.local_token_global_indices is not None or lay.closed_form:
                return lay, None
            if self.user_indices is not None:
                return lay, self.user_indices
            if is_closed_form(self.layout):
                return _retarget(lay, self.layout, self.num_chunks), None
            raise Problem(
                f"the shard layout {lay.name!r} carries no local_token_global_indices and no "
                "local_token_global_indices callable was given"
            )
        if self.user_indices is not None:
            return None, self.user_indices
        if is_closed_form(self.layout):
            return None, None
        which = f"layout {self.layout!r}" if self.layout else "the custom shard_batch's layout"
        raise Problem(
            f"{which} is data-dependent: its partition is computed from the batch, so call "
            "shard(batch) before the token verbs"
        )

    def virtual(self, padded: int) -> ShardLayout:
        """A closed-form layout of the sharder's layout for ``padded`` tokens (no shard yet)."""
        try:
            return ShardLayout(
                self.layout, self.world_size, padded, padded, num_chunks=self.num_chunks
            )
        except ValueError as exc:
            raise Problem(
                f"{exc} (no shard layout yet, so the tensor must be at the padded length)"
            ) from None

    def user_index(self, padded: int, device: torch.device) -> torch.Tensor:
        idx = self.user_indices(self.cp_mesh, padded, device)
        if (
            not isinstance(idx, torch.Tensor)
            or idx.dim() != 1
            or idx.dtype not in (torch.int64, torch.int32)
        ):
            raise Problem(
                "the local_token_global_indices callable must return a 1-D integer tensor"
            )
        if idx.numel() * self.world_size != padded:
            raise Problem(
                f"the local_token_global_indices callable returned {idx.numel()} positions for "
                f"padded_seq_len {padded} and world size {self.world_size}"
            )
        return idx.to(device=device, dtype=torch.int64)

    def cached(self, key: tuple, make: Callable[[], _T]) -> _T:
        """Index tensors (and plans) derived from the current shard layout, per device."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def indices(self, padded_seq_len: int, device) -> torch.Tensor:
        """This rank's global positions for ``padded_seq_len`` (``[L]``, or ``[B, L]`` per row)."""
        try:
            lay, fn = self.source()
            if fn is not None:
                return self.user_index(padded_seq_len, torch.device(device or "cpu"))
            if lay is None or lay.padded_seq_len != padded_seq_len:
                if lay is not None and not lay.closed_form:
                    raise Problem(
                        f"padded_seq_len = {padded_seq_len} but the shard layout partitions "
                        f"{lay.padded_seq_len}"
                    )
                lay = (
                    self.virtual(padded_seq_len)
                    if lay is None
                    else _retarget(lay, lay.name, lay.num_chunks, padded_seq_len)
                )
            return lay.indices(self.rank, device)
        except Problem as p:
            raise p.kind(f"{self.where('_indices')}: {p}") from None

    def identity(self, lay: ShardLayout) -> bool:
        """True when the rank-major concatenation already is global order."""
        if lay.closed_form:
            return lay.rank_major_is_global_order
        return (
            lay.world_size == 1
            and lay.input_row_shape is None
            and not lay.per_row
            and (
                isinstance(lay.local_token_global_indices, torch.Tensor)
                and torch.equal(
                    lay.local_token_global_indices.reshape(-1), torch.arange(lay.padded_seq_len)
                )
            )
        )


def invert_position_map(pm: torch.Tensor, padded: int) -> torch.Tensor:
    """``[B, P]`` (or ``[P]``): the input position of every padded position (-1: a pad slot)."""
    rows = pm.reshape(1, -1) if pm.dim() == 1 else pm
    out = torch.full((rows.shape[0], padded), -1, dtype=torch.int64, device=pm.device)
    r, c = torch.nonzero(rows >= 0, as_tuple=True)
    out[r, rows[r, c]] = c
    return out[0] if pm.dim() == 1 else out


def _retarget(
    lay: ShardLayout, name: str, num_chunks: int | None, padded: int | None = None
) -> ShardLayout:
    """``lay``'s lengths under the closed-form layout ``name`` (for a reported layout that
    carries no indices, e.g. from a custom shard_batch following a closed-form layout)."""
    p = lay.padded_seq_len if padded is None else padded
    return ShardLayout(
        name,
        lay.world_size,
        lay.original_seq_len if padded is None else p,
        p,
        input_row_shape=lay.input_row_shape if padded is None else None,
        position_map=lay.position_map if padded is None else None,
        num_chunks=num_chunks,
    )
