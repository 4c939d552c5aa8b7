"""ContextParallelSharder: shard a training batch over a CP group and move token tensors in and
out of the same layout (seed: context_parallel_sharder).

Shard = one index gather along the sequence dim with this rank's positions (``fill`` at padded
positions, so padding is never materialised). Un-shard (:meth:`gather_token_tensor`) = one equal
all-gather of the shards in rank order (:func:`cpshard.gather_sequence`; ``gather_ragged`` for
layouts whose ranks hold different counts) followed by ONE reorder with the inverse permutation,
computed locally -- in closed form for ``contiguous`` / ``head_tail`` / ``stripe``, from the
indices carried in the :class:`~cpshard.layout.ShardLayout` for data-dependent layouts. The
reorder is one fused index gather of tokens into the output, except for ``head_tail``, which
moves whole chunks: its reorder moves chunks (one index gather of whole chunks; a token index
costs a lookup per token, which dominates for per-token values), and when nothing precedes the
token dim (``[1, S, ...]``: hidden states, one row of per-token values) a chunk is one contiguous
run in both orders, so the all-gathered buffer is put in global order in place, cycle by cycle.
That un-shard allocates its output only (the all-gather writes into it): half the memory of
gather + index, and on CPU no first touches of a second output-sized buffer, which cost as much
as the copy itself. No index tensor is ever all-gathered, except in the direct form when the
caller supplies only a ``local_token_global_indices`` callable (it knows this rank's positions
only). Both directions are differentiable: the backward of an index gather is its scatter-add
adjoint, that of the in-place chunk reorder the inverse chunk gather, that of the all-gather a
reduce-scatter.

Padding follows :mod:`cpshard.batch_padding` (the conventions every sharder shares).

This module never calls ``torch.distributed``: ranks come from :func:`cpshard.comm.resolve_group`,
communication from :mod:`cpshard.transport`. ``shard`` (once per step) checks across ranks with
:func:`cpshard.consensus.agree`, so every rank raises; the per-call token verbs check locally,
across ranks only in checked mode (:func:`cpshard.consensus.check_call`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from cpshard import ops
from cpshard.batch_padding import pad_sequence, pad_value
from cpshard.comm import GroupLike, resolve_group
from cpshard.consensus import agree, check_call, digest
from cpshard.layout import (
    CLOSED_FORM_LAYOUTS,
    ShardLayout,
    canonical_layout_name,
    local_token_global_indices,
    make_layout,
    rank_major_inverse,
    resolve_num_chunks,
)
from cpshard.transport import gather_metadata, gather_ragged, gather_sequence

__all__ = ["ContextParallelSharder"]

_T = TypeVar("_T")

# Keys the sharder handles itself (extra_seq_buffers may not name them).
_KNOWN_KEYS = (
    "input_ids",
    "inputs_embeds",
    "labels",
    "position_ids",
    "loss_mask",
    "padding_mask",
    "_packed_seq_ids",
    "attention_mask",
)


class _Problem(Exception):
    """A local check failed; raised on every rank through consensus (or locally)."""

    def __init__(self, message: str, kind: type[Exception] = ValueError) -> None:
        super().__init__(message)
        self.kind = kind


def _dim(t: torch.Tensor, dim: object, name: str = "seq_dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise _Problem(f"{name} must be an int, got {type(dim).__name__}", TypeError)
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise _Problem(f"{name}={dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def _tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _Problem(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    return t


def _take(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]`` along the last dim, either being 1-D (shared by all rows) or ``[B, n]``;
    negative entries of ``src`` stay negative."""
    if src.dim() == 1:
        return src[idx]
    if idx.dim() == 1:
        return src[:, idx]
    if src.shape[0] != idx.shape[0]:
        raise _Problem(
            f"the position map has {src.shape[0]} rows but the layout has {idx.shape[0]}"
        )
    return torch.gather(src, 1, idx)


def _gather_rows(t: torch.Tensor, dim: int, index: torch.Tensor, fill: Any) -> torch.Tensor:
    """``index_gather`` along ``dim`` with a 1-D index (every row alike) or a per-row ``[B, n]``
    index (the batch dim is ``dim - 1``; a batch of 1 is broadcast)."""
    if index.dim() == 2 and index.shape[0] == 1:
        index = index[0]
    if index.dim() == 1:
        return ops.index_gather(t, index, dim, fill)
    rows, n = index.shape
    if dim == 0 or t.shape[dim - 1] not in (rows, 1):
        raise _Problem(
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


class ContextParallelSharder:
    """Shard batches over a CP group and move token-aligned tensors in and out of the layout.

    Args:
        group_or_mesh: the CP group (``ProcessGroup``, 1-D ``DeviceMesh`` or ``None``).
        layout: ``"head_tail"`` (default; aliases ``zigzag``, ``round_robin``), ``"contiguous"``
            (``sequential``), ``"stripe"``, ``"per_document_head_tail"`` or ``"balanced"`` (see
            :mod:`cpshard.layout`). In the direct form, the closed-form layout the caller's
            ``shard_batch`` follows (used when it reports no layout), or ``None``.
        padding_token_id: the ``input_ids`` value of padded positions.
        loss_mask: a ``[B, S]`` loss mask, sharded into ``batch["loss_mask"]`` (padded with 0);
            overrides one in the batch.
        extra_seq_buffers: ``{key: seq_dim}`` of further sequence-aligned batch entries to shard
            (padded with 0 / False); keys absent from a batch are skipped.
        num_chunks: chunks of ``head_tail`` (per document for ``per_document_head_tail``), a
            multiple of the world size; default ``2W``.
        pad_multiple: every rank's shard length is padded to a multiple of it (e.g. a model's
            compression ratio); default 1.
        extra_pad_values: ``{key: value}`` pad values of ``extra_seq_buffers`` entries (default 0).
        tp_mesh: passed through to a caller-supplied ``shard_batch``.
        shard_batch: direct form: ``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id)
            -> (ctx_factory, batch, ShardLayout | None)``.
        local_token_global_indices: direct form: ``(cp_mesh, padded_seq_len, device) ->
            LongTensor`` of this rank's global positions.
        shard_layout: a layout to start from (e.g. the one a previous sharder reported).

    Padding (the same for every layout): ``input_ids`` = ``padding_token_id``, ``labels`` =
    -100, ``position_ids`` continue (last + 1, + 2, ...; created as ``arange`` when absent),
    ``loss_mask`` = 0, ``padding_mask`` = True, ``_packed_seq_ids`` = 0, ``inputs_embeds`` and
    extra buffers = 0. ``attention_mask`` is consumed (its padding goes into ``padding_mask``, a
    4-D block-causal mask's documents into the data-dependent layouts' plan) and dropped.
    """

    def __init__(
        self,
        group_or_mesh: GroupLike = None,
        layout: str | None = "head_tail",
        *,
        padding_token_id: int = 0,
        loss_mask: torch.Tensor | None = None,
        extra_seq_buffers: Mapping[str, int] | None = None,
        num_chunks: int | None = None,
        tp_mesh: Any = None,
        shard_batch: Callable[..., tuple] | None = None,
        local_token_global_indices: Callable[..., torch.Tensor] | None = None,
        shard_layout: ShardLayout | None = None,
        pad_multiple: int = 1,
        extra_pad_values: Mapping[str, Any] | None = None,
    ) -> None:
        what = "cpshard.ContextParallelSharder"
        self._group = resolve_group(group_or_mesh, what)
        rank, world = self._group.rank, self._group.world
        where = f"{what}: rank {rank}"
        if layout is None:
            if shard_batch is None:
                raise ValueError(
                    f"{where}: layout=None needs a shard_batch function (the direct form)"
                )
            self.layout, self.num_chunks = None, num_chunks
        else:
            self.layout = canonical_layout_name(layout, where)
            self.num_chunks = resolve_num_chunks(self.layout, world, num_chunks, where)
        if isinstance(padding_token_id, bool) or not isinstance(padding_token_id, int):
            raise TypeError(
                f"{where}: padding_token_id must be an int, got {type(padding_token_id).__name__}"
            )
        if loss_mask is not None and not isinstance(loss_mask, torch.Tensor):
            raise TypeError(
                f"{where}: loss_mask must be a tensor or None, got {type(loss_mask).__name__}"
            )
        extras = dict(extra_seq_buffers or {})
        if extra_seq_buffers is not None and not isinstance(extra_seq_buffers, Mapping):
            raise TypeError(f"{where}: extra_seq_buffers must map batch keys to their seq dim")
        for key, d in extras.items():
            if not isinstance(key, str) or isinstance(d, bool) or not isinstance(d, int):
                raise TypeError(
                    f"{where}: extra_seq_buffers must map str keys to int seq dims, got {key!r}: "
                    f"{d!r}"
                )
            if key in _KNOWN_KEYS:
                raise ValueError(
                    f"{where}: extra_seq_buffers names {key!r}, which the sharder shards itself"
                )
        if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ValueError(f"{where}: pad_multiple must be an int >= 1, got {pad_multiple!r}")
        pad_values = dict(extra_pad_values or {})
        if extra_pad_values is not None and not isinstance(extra_pad_values, Mapping):
            raise TypeError(f"{where}: extra_pad_values must map extra_seq_buffers keys to pad values")
        unknown = sorted(set(pad_values) - set(extras), key=str)
        if unknown:
            raise ValueError(
                f"{where}: extra_pad_values names {unknown}, which extra_seq_buffers does not"
            )
        for name, fn in (
            ("shard_batch", shard_batch),
            ("local_token_global_indices", local_token_global_indices),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"{where}: {name} must be callable, got {type(fn).__name__}")
        if shard_layout is not None:
            if not isinstance(shard_layout, ShardLayout):
                raise TypeError(
                    f"{where}: shard_layout must be a ShardLayout, got "
                    f"{type(shard_layout).__name__}"
                )
            if shard_layout.world_size != world:
                raise ValueError(
                    f"{where}: shard_layout is for world size {shard_layout.world_size}, the "
                    f"group has {world}"
                )
        self._cp_mesh = group_or_mesh
        self._tp_mesh = tp_mesh
        self._loss_mask = loss_mask
        self._padding_token_id = padding_token_id
        self.extra_seq_buffers = extras
        self.extra_pad_values = pad_values
        self.pad_multiple = pad_multiple
        self._user_indices = local_token_global_indices
        self._direct = shard_batch is not None
        self.shard_batch = shard_batch if shard_batch is not None else self._builtin_shard_batch
        if local_token_global_indices is not None:
            self.local_token_global_indices = local_token_global_indices
        elif self.layout in CLOSED_FORM_LAYOUTS:
            self.local_token_global_indices = self._closed_form_indices
        else:
            self.local_token_global_indices = None
        self.shard_layout = shard_layout
        self._cache: dict[tuple, Any] = {}
        self._cache_owner: ShardLayout | None = None

    # ------------------------------------------------------------------ properties / helpers

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def world_size(self) -> int:
        return self._group.world

    def _where(self, what: str) -> str:
        return f"cpshard.ContextParallelSharder.{what}: rank {self.rank}"

    def _closed_form_indices(
        self, cp_mesh: GroupLike, padded_seq_len: int, device=None
    ) -> torch.Tensor:
        """The seed's ``local_token_global_indices`` callable of the built-in closed-form layout."""
        g = resolve_group(cp_mesh, "ContextParallelSharder.local_token_global_indices")
        return local_token_global_indices(
            self.layout, g.rank, g.world, padded_seq_len, num_chunks=self.num_chunks, device=device
        )

    def _source(self) -> tuple[ShardLayout | None, Callable | None]:
        """The current partition: a layout (carrying indices or closed-form), and/or the caller's
        callable; raises before the first shard of a data-dependent layout."""
        lay = self.shard_layout
        if lay is not None:
            if lay.local_token_global_indices is not None or lay.closed_form:
                return lay, None
            if self._user_indices is not None:
                return lay, self._user_indices
            if self.layout in CLOSED_FORM_LAYOUTS:
                return _retarget(lay, self.layout, self.num_chunks), None
            raise _Problem(
                f"the shard layout {lay.name!r} carries no local_token_global_indices and no "
                "local_token_global_indices callable was given"
            )
        if self._user_indices is not None:
            return None, self._user_indices
        if self.layout in CLOSED_FORM_LAYOUTS:
            return None, None
        which = f"layout {self.layout!r}" if self.layout else "the custom shard_batch's layout"
        raise _Problem(
            f"{which} is data-dependent: its partition is computed from the batch, so call "
            "shard(batch) before the token verbs"
        )

    def _virtual(self, padded: int) -> ShardLayout:
        """A closed-form layout of the sharder's layout for ``padded`` tokens (no shard yet)."""
        try:
            return ShardLayout(
                self.layout, self.world_size, padded, padded, num_chunks=self.num_chunks
            )
        except ValueError as exc:
            raise _Problem(
                f"{exc} (no shard layout yet, so the tensor must be at the padded length)"
            ) from None

    def _user_index(self, padded: int, device: torch.device) -> torch.Tensor:
        idx = self._user_indices(self._cp_mesh, padded, device)
        if (
            not isinstance(idx, torch.Tensor)
            or idx.dim() != 1
            or idx.dtype not in (torch.int64, torch.int32)
        ):
            raise _Problem(
                "the local_token_global_indices callable must return a 1-D integer tensor"
            )
        if idx.numel() * self.world_size != padded:
            raise _Problem(
                f"the local_token_global_indices callable returned {idx.numel()} positions for "
                f"padded_seq_len {padded} and world size {self.world_size}"
            )
        return idx.to(device=device, dtype=torch.int64)

    def _cached(self, key: tuple, make: Callable[[], _T]) -> _T:
        """Index tensors (and plans) derived from the current shard layout, per device."""
        if self._cache_owner is not self.shard_layout:  # a new layout (also if assigned directly)
            self._cache.clear()
            self._cache_owner = self.shard_layout
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _indices(self, padded_seq_len: int, device) -> torch.Tensor:
        """This rank's global positions for ``padded_seq_len`` (``[L]``, or ``[B, L]`` per row)."""
        try:
            lay, fn = self._source()
            if fn is not None:
                return self._user_index(padded_seq_len, torch.device(device or "cpu"))
            if lay is None or lay.padded_seq_len != padded_seq_len:
                if lay is not None and not lay.closed_form:
                    raise _Problem(
                        f"padded_seq_len = {padded_seq_len} but the shard layout partitions "
                        f"{lay.padded_seq_len}"
                    )
                lay = (
                    self._virtual(padded_seq_len)
                    if lay is None
                    else _retarget(lay, lay.name, lay.num_chunks, padded_seq_len)
                )
            return lay.indices(self.rank, device)
        except _Problem as p:
            raise p.kind(f"{self._where('_indices')}: {p}") from None

    # ------------------------------------------------------------------ shard

    def shard(
        self, batch: dict[str, Any]
    ) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any]]:
        """Shard ``batch`` (pad, shard every sequence-aligned tensor) and keep its layout in
        :attr:`shard_layout` for the token verbs. Returns ``(ctx_factory, sharded_batch)``; the
        input batch is not modified."""
        result = self.shard_batch(
            self._cp_mesh,
            self._tp_mesh,
            batch,
            loss_mask=self._loss_mask,
            padding_token_id=self._padding_token_id,
        )
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(
                f"{self._where('shard')}: shard_batch must return (ctx_factory, batch, "
                "ShardLayout | None)"
            )
        ctx, out, layout = result
        if layout is not None:
            if not isinstance(layout, ShardLayout):
                raise TypeError(
                    f"{self._where('shard')}: shard_batch reported a {type(layout).__name__}, not "
                    "a ShardLayout"
                )
            if layout.world_size != self.world_size:
                raise ValueError(
                    f"{self._where('shard')}: shard_batch reported a layout for world size "
                    f"{layout.world_size}, the group has {self.world_size}"
                )
        self.shard_layout = layout
        self._cache.clear()
        return ctx, out

    def _builtin_shard_batch(
        self,
        cp_mesh: GroupLike,
        tp_mesh: Any,
        batch: dict[str, Any],
        *,
        loss_mask: torch.Tensor | None = None,
        padding_token_id: int = 0,
    ) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any], ShardLayout]:
        """The built-in ``shard_batch`` of the sharder's layout (the seed's signature)."""
        what = "cpshard.ContextParallelSharder.shard"
        g = resolve_group(cp_mesh, what)
        problem, plan = None, None
        try:
            plan = self._plan_batch(batch, loss_mask, padding_token_id, g.world)
        except _Problem as p:
            problem = str(p)
        fields = {
            "batch size": [plan.rows if plan else 0],
            "sequence length": [plan.seq_len if plan else 0],
            "padded length": [plan.layout.padded_seq_len if plan else 0],
            "partition": digest(plan.layout.local_token_global_indices if plan else None),
        }
        # One small all-gather: every rank raises if any rank's batch is bad, and ranks whose
        # batches (hence data-dependent partitions) differ are named instead of silently mixed.
        agree(g, what, problem, fields)
        return contextlib.nullcontext, plan.apply(g.rank), plan.layout

    def _plan_batch(
        self, batch: object, loss_mask, padding_token_id: int, world: int
    ) -> _BatchPlan:
        if not isinstance(batch, Mapping):
            raise _Problem(
                f"batch must be a dict of tensors, got {type(batch).__name__}", TypeError
            )
        if self.layout is None:
            raise _Problem("the sharder has no built-in layout (layout=None)")
        ref = next(
            (k for k in ("input_ids", "inputs_embeds", "labels") if batch.get(k) is not None), None
        )
        if ref is None:
            raise _Problem(
                "batch has none of input_ids, inputs_embeds, labels: nothing gives the sequence "
                "length"
            )
        ref_t = _tensor(batch[ref], f"batch[{ref!r}]")
        if ref_t.dim() < 2:
            raise _Problem(f"batch[{ref!r}] must be [B, S, ...], got shape {tuple(ref_t.shape)}")
        rows, seq_len = int(ref_t.shape[0]), int(ref_t.shape[1])
        plan = _BatchPlan(batch, rows, seq_len, ref_t.device)

        def add(
            key: str, t: object, seq_dim: int, min_dim: int = 2, max_dim: int | None = 2
        ) -> None:
            t = _tensor(t, f"batch[{key!r}]" if key != "loss_mask" else "loss_mask")
            if t.dim() < min_dim or (max_dim is not None and t.dim() > max_dim):
                raise _Problem(
                    f"{key} must be [B, S{', ...' if max_dim is None else ''}], got shape "
                    f"{tuple(t.shape)}"
                )
            d = _dim(t, seq_dim, f"the seq dim of {key}")
            if t.shape[d] != seq_len:
                raise _Problem(
                    f"{key} has {t.shape[d]} positions along dim {d}, but {ref} has {seq_len}"
                )
            if d > 0 and key in _KNOWN_KEYS and t.shape[d - 1] not in (rows, 1):
                raise _Problem(f"{key} has batch size {t.shape[d - 1]}, but {ref} has {rows}")
            fill = self.extra_pad_values.get(key, 0) if key in self.extra_seq_buffers else None
            plan.items.append((key, t, d, pad_value(key, padding_token_id) if fill is None else fill))

        if batch.get("input_ids") is not None:
            add("input_ids", batch["input_ids"], 1)
        if batch.get("inputs_embeds") is not None:
            add("inputs_embeds", batch["inputs_embeds"], 1, max_dim=None)
        if batch.get("labels") is not None:
            add("labels", batch["labels"], 1)
        mask = loss_mask if loss_mask is not None else batch.get("loss_mask")
        if mask is not None:
            add("loss_mask", mask, 1)
        if batch.get("_packed_seq_ids") is not None:
            add("_packed_seq_ids", batch["_packed_seq_ids"], 1)
        for key, d in self.extra_seq_buffers.items():
            if batch.get(key) is not None:
                add(key, batch[key], d, min_dim=1, max_dim=None)

        pos = batch.get("position_ids")
        if pos is not None:
            pos = _tensor(pos, "batch['position_ids']")
            if (
                pos.dim() not in (1, 2, 3)
                or pos.shape[-1] != seq_len
                or (pos.dim() > 1 and pos.shape[-2] not in (rows, 1))
            ):
                raise _Problem(
                    f"position_ids must be [B, S] or [3, B, S] (mRoPE) with S = {seq_len}, got "
                    f"shape {tuple(pos.shape)}"
                )
            if pos.dtype.is_floating_point or pos.dtype == torch.bool:
                raise _Problem(f"position_ids must hold integers, got {pos.dtype}", TypeError)
        plan.positions = pos[None] if pos is not None and pos.dim() == 1 else pos

        pad = self._padding(batch, rows, seq_len, ref_t.device)
        plan.padding = pad
        doc_ids = None
        if self.layout not in CLOSED_FORM_LAYOUTS:
            doc_ids = self._document_ids(batch, rows, seq_len, pad)
        try:
            plan.layout = make_layout(
                self.layout, world, seq_len, doc_ids=doc_ids, num_chunks=self.num_chunks,
                rank_multiple=self.pad_multiple,
            )
        except (TypeError, ValueError) as exc:
            raise _Problem(str(exc)) from None
        return plan

    @staticmethod
    def _attend(mask: torch.Tensor) -> torch.Tensor:
        """A mask as booleans 'attends' (bool / int: nonzero; float: additive, 0 = attend)."""
        if mask.dtype.is_floating_point:
            return mask == 0
        return mask.bool()

    def _padding(self, batch: Mapping, rows: int, seq_len: int, device) -> torch.Tensor:
        """``[B, S]`` bool, True at pad positions, from padding_mask / attention_mask / doc ids."""
        pad = torch.zeros(rows, seq_len, dtype=torch.bool, device=device)
        given = batch.get("padding_mask")
        if given is not None:
            given = _tensor(given, "batch['padding_mask']")
            if given.dim() != 2 or given.shape[1] != seq_len or given.shape[0] not in (rows, 1):
                raise _Problem(
                    f"padding_mask must be [B, S] = [{rows}, {seq_len}], got shape "
                    f"{tuple(given.shape)}"
                )
            pad = pad | given.to(device).bool()
        am = batch.get("attention_mask")
        if am is not None:
            am = _tensor(am, "batch['attention_mask']")
            if am.dim() == 2 and am.shape[1] == seq_len and am.shape[0] in (rows, 1):
                pad = pad | ~self._attend(am).to(device)
            elif am.dim() == 4 and am.shape[0] in (rows, 1) and am.shape[2:] == (seq_len, seq_len):
                pad = pad | ~torch.diagonal(self._attend(am[:, 0]), dim1=-2, dim2=-1).to(device)
            else:
                raise _Problem(
                    f"attention_mask must be [B, S] or [B, 1, S, S] with B = {rows}, S = "
                    f"{seq_len}, got shape {tuple(am.shape)}"
                )
        ids = batch.get("_packed_seq_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == seq_len:
            pad = pad | (ids.to(device) == 0)
        return pad

    def _document_ids(
        self, batch: Mapping, rows: int, seq_len: int, pad: torch.Tensor
    ) -> torch.Tensor:
        """``[B, S]`` int64 document ids (0 = pad) for the data-dependent layouts' planner."""
        pad = pad.cpu()
        ids = batch.get("_packed_seq_ids")
        if ids is not None:
            if ids.dtype.is_floating_point or ids.dtype.is_complex:
                raise _Problem(f"_packed_seq_ids must hold integers, got {ids.dtype}", TypeError)
            return (ids.detach().cpu().to(torch.int64).expand(rows, seq_len)) * ~pad
        am = batch.get("attention_mask")
        if isinstance(am, torch.Tensor) and am.dim() == 4 and seq_len > 0:
            attend = self._attend(am[:, 0].detach().cpu()).expand(rows, seq_len, seq_len)
            valid = ~pad
            follows = torch.zeros_like(valid)  # token i attends to token i - 1 (same document)
            follows[:, 1:] = torch.diagonal(attend, offset=-1, dim1=-2, dim2=-1) & valid[:, :-1]
            starts = valid & ~follows
            return torch.cumsum(starts.to(torch.int64), dim=1) * valid
        return (~pad).to(torch.int64)

    # ------------------------------------------------------------------ token verbs

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        """Shard a full-length token-aligned tensor exactly like the model inputs (differentiably).

        Accepted lengths along ``seq_dim`` (anything else raises): with a shard layout,
        ``[B, S_in]`` rows of a repositioned-row layout (scattered into the padded rows, ``fill``
        in the pad slots); ``[.., B, S, ..]`` matching a THD layout's ``input_row_shape``
        (flattened first; the shard is ``[.., 1, L, ..]``, the model's stream coordinate);
        ``original_seq_len`` (right-padded with ``fill``); ``padded_seq_len`` (sharded as is).
        Before the first shard (closed-form layouts only) the tensor must be at a padded length.
        ``fill`` must be given whenever padded positions have to be filled."""
        try:
            t = _tensor(tensor, "tensor")
            d = _dim(t, seq_dim)
            index, needs_fill = self._shard_index(t, d)
            if needs_fill and fill is None:
                raise _Problem(
                    f"the tensor ({t.shape[d]} positions along seq_dim) must be padded to the "
                    f"layout's {self.shard_layout.padded_seq_len} positions: pass fill= (e.g. "
                    "-100 for labels, 0 for masks)"
                )
            t = self._flatten_rows(t, d)
            return _gather_rows(t, d, index, fill if fill is not None else 0)
        except _Problem as p:
            raise p.kind(f"{self._where('shard_token_tensor')}: {p}") from None

    def _flatten_rows(self, t: torch.Tensor, d: int) -> torch.Tensor:
        """``[.., B, S, ..]`` in a THD layout's input rows -> ``[.., 1, B*S, ..]``."""
        lay = self.shard_layout
        if lay is not None and lay.input_row_shape is not None and _is_thd_rows(t, d, lay):
            return t.flatten(d - 1, d).unsqueeze(d - 1)
        return t

    def _shard_index(self, t: torch.Tensor, d: int) -> tuple[torch.Tensor, bool]:
        """The positions of ``t`` (along d) this rank takes (-1: fill), and whether any padded
        position needs a fill on any rank."""
        lay, fn = self._source()
        n = t.shape[d]
        if lay is None:
            if fn is not None:
                return self._user_index(n, t.device), False
            return self._virtual(n).indices(self.rank, t.device), False
        padded = lay.padded_seq_len
        mine = self._cached(
            ("mine", str(t.device)),
            lambda: (
                self._user_index(padded, t.device)
                if fn is not None
                else lay.indices(self.rank, t.device)
            ),
        )
        if lay.position_map is not None and n == lay.original_seq_len:
            pm = lay.position_map
            if pm.dim() == 2 and d > 0 and t.shape[d - 1] not in (pm.shape[0], 1):
                raise _Problem(
                    f"the tensor has batch size {t.shape[d - 1]}, the position map {pm.shape[0]}"
                )
            src = self._cached(
                ("src", str(t.device)), lambda: _invert_position_map(pm, padded).to(t.device)
            )
            needs = bool((src < 0).any())
            return _take(src, mine), needs
        if lay.input_row_shape is not None and _is_thd_rows(t, d, lay):
            n = lay.original_seq_len
        if n == padded:
            return mine, False
        if n == lay.original_seq_len and lay.position_map is None:
            return torch.where(mine < n, mine, torch.full_like(mine, -1)), True
        accepted = [f"padded_seq_len = {padded}"]
        if lay.position_map is not None:
            accepted.insert(0, f"the position map's input length {lay.original_seq_len}")
        else:
            accepted.insert(0, f"original_seq_len = {lay.original_seq_len}")
        if lay.input_row_shape is not None:
            accepted.insert(0, f"input rows {lay.input_row_shape} at (seq_dim - 1, seq_dim)")
        raise _Problem(
            f"the tensor has {n} positions along seq_dim={d} (shape {tuple(t.shape)}); the shard "
            f"layout {lay.name!r} accepts {' or '.join(accepted)}"
        )

    def gather_token_tensor(
        self,
        tensor: torch.Tensor,
        seq_dim: int = 1,
        trim: bool = False,
        fill: float | int | None = None,
    ) -> torch.Tensor:
        """Differentiably gather a token-aligned local shard to global order.

        Without ``trim`` the result has the padded length. With ``trim=True`` it is returned in
        the caller's original coordinates using the shard layout: sliced back to
        ``original_seq_len``, un-flattened to ``input_row_shape`` (THD), or mapped through the
        position map (``fill`` for input positions whose tokens were dropped; required then).
        Raises when no layout is present (nothing to trim to). One all-gather of the shards and
        one reorder (an index gather, or whole chunks in place: see the module doc); closed-form
        layouts never all-gather index tensors."""
        what = "cpshard.ContextParallelSharder.gather_token_tensor"
        problem, plan = None, None
        try:
            plan = self._gather_plan(tensor, seq_dim, trim, fill)
        except _Problem as p:
            problem = str(p)
        if problem is not None:
            # A per-call function: the problem raises here alone by default; in checked mode
            # every transport call below opens with exactly one consensus round, which a rank
            # whose checks failed joins here with its failure flag, so every rank raises and none
            # blocks. A rank that passed spends no extra round on this call's own checks.
            check_call(self._group, what, problem)
        t, d = tensor, plan.dim
        fill_value = fill if fill is not None else 0
        if plan.counts is not None:  # ranks hold different counts: all-gather-v, rank order
            full = gather_ragged(t, self._cp_mesh, plan.counts, dim=d)
            index = plan.trim(plan.inverse)
            out = full if index is None else _gather_rows(full, d, index, fill_value)
        elif plan.chunks is not None or (
            plan.inverse is None and plan.user_index is None and not plan.needs_index
        ):
            if plan.chunks is None:  # the rank-major concatenation already is global order
                out = gather_sequence(t, self._cp_mesh, seq_dim=d)
            else:  # [W, *t.shape] straight from the all-gather, then reordered by whole chunks
                stage = gather_sequence(t.unsqueeze(0), self._cp_mesh, seq_dim=0)
                out = self._chunks_to_global_order(stage, plan.chunks, d)
            if plan.narrow is not None:
                out = out.narrow(d, 0, plan.narrow)
        else:
            # [W, *t.shape] straight from the all-gather (no interleave), then ONE index gather
            # that both interleaves and un-permutes: out[.., p, ..] = stage[rank(p), .., j(p), ..]
            stage = gather_sequence(t.unsqueeze(0), self._cp_mesh, seq_dim=0)
            if plan.user_index is not None:  # direct form: this rank knows its own indices only
                every = gather_metadata(plan.user_index, self._cp_mesh, seq_dim=0)
                inverse = torch.argsort(every)
                if not torch.equal(
                    every[inverse], torch.arange(every.numel(), device=every.device)
                ):
                    raise ValueError(
                        f"{what}: rank {self.rank}: the ranks' local_token_global_indices do not "
                        f"partition 0..{every.numel() - 1}"
                    )
                index = _stage_index(plan.trim(inverse), tuple(t.shape), d)
            else:
                key = ("stage", tuple(t.shape), d, trim, str(t.device))
                index = self._cached(
                    key, lambda: _stage_index(plan.trim(plan.inverse), tuple(t.shape), d)
                )
            rows = stage.shape[0]
            for size in t.shape[: d + 1]:
                rows *= size
            out = ops.index_gather(
                stage.reshape(rows, *t.shape[d + 1 :]), index.reshape(-1), 0, fill_value
            )
            out = out.view(*t.shape[:d], index.shape[-1], *t.shape[d + 1 :])
        if plan.rows is not None:
            out = _unflatten_rows(out, d, plan.rows)
        return out

    def _chunk_order(self, lay: ShardLayout, t: torch.Tensor) -> tuple[int, ...] | None:
        """The rank-major chunk that holds every global chunk, when the un-shard of ``t`` can
        reorder whole chunks instead of tokens: a closed-form layout that moves whole chunks
        (``head_tail``) over more than one rank, and data to move. None otherwise (the token
        index gather does it)."""
        if not lay.closed_form or lay.name != "head_tail" or lay.world_size == 1 or not t.numel():
            return None
        chunks, world = lay.num_chunks, lay.world_size

        def order() -> tuple[int, ...]:  # the layout's inverse with one token per chunk
            return tuple(rank_major_inverse(lay.name, world, chunks, num_chunks=chunks).tolist())

        return self._cached(("chunk order", chunks), order)

    def _chunks_to_global_order(
        self, stage: torch.Tensor, src: tuple[int, ...], d: int
    ) -> torch.Tensor:
        """The all-gathered ``[W, *shape]`` (token dim ``d`` of ``shape``) in global order
        ``[*shape[:d], W * L, *shape[d + 1:]]`` for a layout that moves whole chunks (``src[k]``:
        the rank-major chunk that global chunk ``k`` is). With nothing before the token dim a
        chunk is one contiguous run in both orders, so the stage is reordered in place; otherwise
        one index gather of whole chunks (not of tokens) builds the output."""
        shape = stage.shape[1:]
        pre = math.prod(shape[:d])
        if pre == 1:
            out = _ChunksToGlobalOrder.apply(stage, src)
        else:
            per_rank = len(src) // stage.shape[0]
            index = self._cached(
                ("chunks", tuple(shape[:d]), d, str(stage.device)),
                lambda: _stage_index(
                    torch.tensor(src, device=stage.device), (*shape[:d], per_rank), d
                ).reshape(-1),
            )
            out = ops.index_gather(stage.view(index.numel(), -1), index, 0)
        return out.view(*shape[:d], stage.shape[0] * shape[d], *shape[d + 1 :])

    def _gather_plan(
        self, tensor: object, seq_dim: object, trim: object, fill: object
    ) -> _GatherPlan:
        """Every local check of gather_token_tensor, and the inverse permutation (no comm)."""
        t = _tensor(tensor, "tensor")
        d = _dim(t, seq_dim)
        if not isinstance(trim, bool):
            raise _Problem(f"trim must be a bool, got {type(trim).__name__}", TypeError)
        lay, fn = self._source()
        n = t.shape[d]
        plan = _GatherPlan(d)
        if lay is None:
            if trim:
                raise _Problem(
                    "trim=True needs a shard layout (nothing to trim to before the first shard)"
                )
            padded = n * self.world_size
            if fn is not None:
                plan.user_index = self._user_index(padded, t.device)
                return plan
            virtual = self._virtual(padded)
            if not self._identity(virtual):
                plan.inverse = virtual.rank_major_inverse(t.device)
                plan.chunks = self._chunk_order(virtual, t)
            return plan
        counts = lay.counts
        if n != counts[self.rank]:
            raise _Problem(
                f"the local shard has {n} positions along seq_dim={d} (shape {tuple(t.shape)}), "
                f"but rank {self.rank} holds {counts[self.rank]} tokens of the shard layout "
                f"{lay.name!r}"
            )
        if len(set(counts)) > 1:
            plan.counts = counts
        if lay.per_row:
            rows = lay.local_token_global_indices.shape[1]
            if d == 0 or t.shape[d - 1] != rows:
                raise _Problem(
                    f"the shard layout differs between the {rows} rows of the batch: the local "
                    f"shard needs its batch dim (of size {rows}) right before seq_dim={d}, got "
                    f"shape {tuple(t.shape)}"
                )
        if fn is not None:
            plan.user_index = self._cached(
                ("mine", str(t.device)), lambda: self._user_index(lay.padded_seq_len, t.device)
            )
        elif not self._identity(lay):
            plan.inverse = self._cached(
                ("inv", str(t.device)), lambda: lay.rank_major_inverse(t.device)
            )
            plan.chunks = self._chunk_order(lay, t)
        padded = lay.padded_seq_len
        arange = lambda: torch.arange(padded, device=t.device)  # noqa: E731  (identity inverse)
        if not trim:
            return plan
        if lay.position_map is not None:
            pm = lay.position_map.to(t.device)
            if bool((pm < 0).any()) and fill is None:
                raise _Problem("the position map drops input positions: pass fill= for them")
            if pm.dim() == 2 and pm.shape[0] > 1 and (d == 0 or t.shape[d - 1] != pm.shape[0]):
                raise _Problem(
                    f"the position map has {pm.shape[0]} rows: the local shard needs its batch "
                    f"dim (of that size) right before seq_dim={d}, got shape {tuple(t.shape)}"
                )
            plan.trim = lambda inv: torch.where(
                pm >= 0,
                _take(arange() if inv is None else inv, pm.clamp(min=0)),
                torch.full_like(pm, -1),
            )
            plan.needs_index = True
            plan.chunks = None
            return plan
        keep = lay.original_seq_len
        if lay.input_row_shape is not None:
            if lay.per_row:
                raise _Problem("a THD layout must partition one stream, not per-row")
            plan.rows = lay.input_row_shape
        if keep != padded:
            plan.trim = lambda inv: (arange() if inv is None else inv)[..., :keep]
            plan.narrow = keep
        return plan

    def _identity(self, lay: ShardLayout) -> bool:
        """True when the rank-major concatenation already is global order."""
        if lay.closed_form:
            return lay.name == "contiguous" or lay.world_size == 1
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


# ---------------------------------------------------------------------- plans (local, no comm)


class _BatchPlan:
    """A validated batch and its layout; :meth:`apply` shards it for one rank (no communication)."""

    def __init__(self, batch: Mapping, rows: int, seq_len: int, device: torch.device) -> None:
        self.batch, self.rows, self.seq_len, self.device = batch, rows, seq_len, device
        self.items: list[tuple[str, torch.Tensor, int, Any]] = []
        self.positions: torch.Tensor | None = None
        self.padding: torch.Tensor | None = None
        self.layout: ShardLayout | None = None

    def apply(self, rank: int) -> dict[str, Any]:
        lay = self.layout
        padded, n = lay.padded_seq_len, self.seq_len
        by_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def index(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            key = str(device)
            if key not in by_device:
                mine = lay.indices(rank, device)
                by_device[key] = (mine, torch.where(mine < n, mine, torch.full_like(mine, -1)))
            return by_device[key]

        out = {k: v for k, v in self.batch.items() if k != "attention_mask"}
        for key, t, d, fill in self.items:
            out[key] = _gather_rows(t, d, index(t.device)[1], fill)
        pos = self.positions
        if pos is None:
            pos = torch.arange(padded, device=self.device).expand(self.rows, padded)
        else:
            pos = pad_sequence("position_ids", pos, pos.dim() - 1, padded)
        out["position_ids"] = _gather_rows(pos, pos.dim() - 1, index(pos.device)[0], 0)
        out["padding_mask"] = _gather_rows(
            self.padding, 1, index(self.padding.device)[1], pad_value("padding_mask", 0)
        )
        return out


class _GatherPlan:
    """What :meth:`ContextParallelSharder.gather_token_tensor` does around the all-gather."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.counts: list[int] | None = None  # ranks hold different counts: per-rank counts
        self.inverse: torch.Tensor | None = None  # [P] or [B, P] rank-major slots; None = identity
        self.user_index: torch.Tensor | None = None  # direct form: this rank's positions
        # inverse (None = identity) -> the rank-major slot of every output position (-1: fill),
        # [n] or [B, n]; None = no index gather needed
        self.trim: Callable[[torch.Tensor | None], torch.Tensor | None] = lambda inv: inv
        self.needs_index = False  # the trim needs an index gather even for an identity layout
        # a layout that moves whole chunks: the rank-major chunk of every global chunk (the
        # un-shard reorders chunks, not tokens)
        self.chunks: tuple[int, ...] | None = None
        self.narrow: int | None = None  # identity / chunk reorder + plain trim: a narrow
        self.rows: tuple[int, int] | None = None  # THD: un-flatten the stream to (B, S)


def _permute_chunks_(chunks: torch.Tensor, src: Sequence[int]) -> None:
    """``chunks[k] = chunks[src[k]]`` (old contents) for every ``k``, in place along dim 0: the
    cycles of the permutation are walked one after the other with one chunk of scratch."""
    done = [False] * len(src)
    saved = None
    for start in range(len(src)):
        if done[start] or src[start] == start:
            continue
        if saved is None:
            saved = torch.empty_like(chunks[start])
        saved.copy_(chunks[start])
        k = start
        while src[k] != start:
            chunks[k].copy_(chunks[src[k]])
            done[k] = True
            k = src[k]
        chunks[k].copy_(saved)
        done[k] = True


class _ChunksToGlobalOrder(torch.autograd.Function):
    """The all-gathered ``[W, ...]`` buffer, viewed as chunks in rank-major order, put in global
    order in place (``src[k]``: the rank-major chunk that global chunk ``k`` is); backward: the
    gradient's chunks back to rank-major order (one gather of whole chunks)."""

    @staticmethod
    def forward(ctx, stage: torch.Tensor, src: tuple[int, ...]) -> torch.Tensor:
        ctx.src = src
        _permute_chunks_(stage.view(len(src), -1), src)
        ctx.mark_dirty(stage)
        return stage

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = [0] * len(ctx.src)
        for k, s in enumerate(ctx.src):
            back[s] = k
        index = torch.tensor(back, dtype=torch.int64, device=grad.device)
        chunks = ops.index_gather(grad.reshape(len(back), -1), index, 0)
        return chunks.view(grad.shape), None


def _stage_index(slots: torch.Tensor, shape: tuple[int, ...], d: int) -> torch.Tensor:
    """Flat index into the all-gathered ``[W, *shape]`` stage, viewed as ``[W * pre * L, post]``
    (``pre`` = the sizes before the seq dim ``d``, ``L = shape[d]``), for every (pre, output
    position): ``rank * pre * L + q * L + j`` where ``slots = rank * L + j`` (-1 stays -1).
    ``slots`` is ``[n]`` (every row alike) or ``[B, n]`` (per row; B = ``shape[d - 1]``)."""
    length = shape[d]
    pre = 1
    for s in shape[:d]:
        pre *= s
    q = torch.arange(pre, device=slots.device)
    if slots.dim() == 1:
        slots = slots.unsqueeze(0)  # [1, n], broadcast over q
    else:
        slots = slots[q % slots.shape[0]]  # the batch dim is the innermost of pre
    safe = slots.clamp(min=0)
    flat = (
        (safe // max(length, 1)) * (pre * length) + q.unsqueeze(1) * length + safe % max(length, 1)
    )
    return torch.where(slots >= 0, flat, torch.full_like(flat, -1)).expand(pre, flat.shape[1])


def _invert_position_map(pm: torch.Tensor, padded: int) -> torch.Tensor:
    """``[B, P]`` (or ``[P]``): the input position of every padded position (-1: a pad slot)."""
    rows = pm.reshape(1, -1) if pm.dim() == 1 else pm
    out = torch.full((rows.shape[0], padded), -1, dtype=torch.int64, device=pm.device)
    r, c = torch.nonzero(rows >= 0, as_tuple=True)
    out[r, rows[r, c]] = c
    return out[0] if pm.dim() == 1 else out


def _is_thd_rows(t: torch.Tensor, d: int, lay: ShardLayout) -> bool:
    rows, cols = lay.input_row_shape
    return d > 0 and rows != 1 and tuple(t.shape[d - 1 : d + 1]) == (rows, cols)


def _unflatten_rows(full: torch.Tensor, d: int, rows: tuple[int, int]) -> torch.Tensor:
    """A THD stream ``[.., 1, B*S, ..]`` (or ``[.., B*S, ..]``) back to ``[.., B, S, ..]``."""
    if d > 0 and full.shape[d - 1] == 1:
        return full.flatten(d - 1, d).unflatten(d - 1, rows)
    return full.unflatten(d, rows)


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
