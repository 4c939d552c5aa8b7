"""The :class:`ShardLayout` record: how a batch was sharded, so that token-aligned tensors can
follow it. A built-in closed-form layout is recorded by its name and sizes; a planned or custom
one carries every rank's positions, checked here to partition the padded rows."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard.layouts.base import LayoutStrategy, PlannedPartition
from cpshard.layouts.closed_form import check_closed_form
from cpshard.layouts.owners import RowPieces, rank_major_pieces
from cpshard.layouts.registry import is_closed_form, lookup
from cpshard.ranges import ragged_arange
from cpshard.validation import check_int

__all__ = ["Indices", "ShardLayout"]

Indices = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """How a batch was sharded, so that token-aligned tensors can follow it.

    Attributes:
        name: the layout's name (a built-in layout or any name a custom ``shard_batch`` reports).
        world_size: the CP world size it was computed for.
        original_seq_len: the sequence length of the caller's tensors before padding (for a flat
            THD stream, the stream's length ``B * S``; with a position map, ``S_in``).
        padded_seq_len: ``P``, the length the ranks' shards partition.
        local_token_global_indices: ``None`` for closed-form layouts; otherwise every rank's
            global positions, ascending: ``[W, L]`` (the same for every row), ``[W, B, L]``
            (per row), or a tuple of ``W`` 1-D tensors when ranks hold different counts.
        input_row_shape: ``(B, S)`` of the caller's rows when they were flattened into one
            stream (THD) before padding; the model's tensors are then ``[1, T]`` streams.
        position_map: ``[B, S_in]`` or ``[S_in]`` int64: the padded position of every input
            position (``-1``: the token was dropped) for layouts that reposition rows.
        num_chunks: the chunk count of ``head_tail`` / ``per_document_head_tail``.
        owner_pieces: instead of ``local_token_global_indices``, a planned layout's pieces:
            per batch row, ``(start, length, rank)`` int64 vectors tiling the row in position
            order. The record checks them (no pass over the positions), makes the ``[W, B,
            L]`` indices from them, and keeps them for planners that work on pieces.
        planned_from: instead of either, the table a built-in planner lists every rank's
            positions from (a :class:`~cpshard.layouts.base.PlannedPartition`, e.g.
            ``per_document_head_tail``'s chunk table): the record checks the table, makes the
            ``[W, B, L]`` indices from it and keeps it for the step's planners (which check it
            against their documents) and the ranks' consensus.
    """

    name: str
    world_size: int
    original_seq_len: int
    padded_seq_len: int
    local_token_global_indices: Indices | None = None
    input_row_shape: tuple[int, int] | None = None
    position_map: torch.Tensor | None = None
    num_chunks: int | None = None
    owner_pieces: tuple[RowPieces, ...] | None = None
    planned_from: PlannedPartition | None = None

    def __post_init__(self) -> None:
        what = "cpshard.ShardLayout"
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{what}: name must be a non-empty str, got {self.name!r}")
        world = check_int(self.world_size, "world_size", what, low=1)
        original = check_int(self.original_seq_len, "original_seq_len", what, 0)
        padded = check_int(self.padded_seq_len, "padded_seq_len", what, 0)
        if self.num_chunks is not None:
            check_int(self.num_chunks, "num_chunks", what, low=1)
        if self.input_row_shape is not None and self.position_map is not None:
            raise ValueError(f"{what}: give input_row_shape (THD) or position_map, not both")
        if self.input_row_shape is not None:
            shape = self.input_row_shape
            if not isinstance(shape, Sequence) or len(shape) != 2:
                raise ValueError(f"{what}: input_row_shape must be (B, S), got {shape!r}")
            rows, cols = (check_int(v, "input_row_shape", what, 0) for v in shape)
            object.__setattr__(self, "input_row_shape", (rows, cols))
            if rows * cols != original:
                raise ValueError(
                    f"{what}: input_row_shape {(rows, cols)} flattens to {rows * cols} tokens but "
                    f"original_seq_len = {original}"
                )
        if self.position_map is not None:
            self._check_position_map(what, original, padded)
        elif original > padded:
            raise ValueError(
                f"{what}: original_seq_len = {original} exceeds padded_seq_len = {padded}"
            )
        if self.planned_from is not None:
            self._take_table(what, world, padded)
            return
        if self.owner_pieces is not None:
            self._take_pieces(what, world, padded)
            return
        idx = self.local_token_global_indices
        if idx is None:
            if self.closed_form:
                check_closed_form(self.name, world, padded, self.num_chunks, None, what)
            return
        if isinstance(idx, torch.Tensor):
            self._check_equal_indices(idx, what, world, padded)
        elif isinstance(idx, Sequence) and not isinstance(idx, str):
            self._check_ragged_indices(tuple(idx), what, world, padded)
        else:
            raise TypeError(
                f"{what}: local_token_global_indices must be a tensor, a tuple of tensors or None"
            )

    def _take_table(self, what: str, world: int, padded: int) -> None:
        if self.local_token_global_indices is not None or self.owner_pieces is not None:
            raise ValueError(
                f"{what}: give planned_from alone, not with local_token_global_indices or "
                "owner_pieces"
            )
        try:
            self.planned_from.check(world, padded)
        except ValueError as err:
            raise ValueError(f"{what}: planned_from: {err}") from None
        object.__setattr__(self, "local_token_global_indices", self.planned_from.indices())

    def _take_pieces(self, what: str, world: int, padded: int) -> None:
        pieces = self.owner_pieces
        if self.local_token_global_indices is not None:
            raise ValueError(f"{what}: give local_token_global_indices or owner_pieces, not both")
        if not isinstance(pieces, Sequence) or not all(
            isinstance(row, Sequence) and len(row) == 3 and all(
                isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int64
                for t in row
            )
            for row in pieces
        ):
            raise TypeError(
                f"{what}: owner_pieces must hold, per batch row, (start, length, rank) 1-D int64 "
                "tensors"
            )
        pieces = tuple(tuple(t.cpu() for t in row) for row in pieces)
        try:
            by_rank = rank_major_pieces(pieces, world, padded)
        except ValueError as err:
            raise ValueError(f"{what}: owner_pieces: {err}") from None
        idx = ragged_arange(by_rank[2], by_rank[3]).view(world, len(pieces), padded // world)
        object.__setattr__(self, "owner_pieces", pieces)
        object.__setattr__(self, "local_token_global_indices", idx)
        self.__dict__["rank_major_pieces"] = by_rank  # the cached property, made here

    def _check_position_map(self, what: str, original: int, padded: int) -> None:
        pm = self.position_map
        if (
            not isinstance(pm, torch.Tensor)
            or pm.dtype not in (torch.int64, torch.int32)
            or pm.dim() not in (1, 2)
        ):
            raise TypeError(f"{what}: position_map must be an int64 tensor [B, S_in] or [S_in]")
        if pm.shape[-1] != original:
            raise ValueError(
                f"{what}: position_map has {pm.shape[-1]} input positions but original_seq_len = "
                f"{original}"
            )
        pm = pm.detach().to("cpu", torch.int64)
        rows = pm.reshape(-1, original) if pm.dim() == 2 else pm.reshape(1, -1)
        if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) >= padded):
            raise ValueError(
                f"{what}: position_map values must lie in [-1, padded_seq_len = {padded})"
            )
        for r, row in enumerate(rows):
            kept = row[row >= 0]
            if kept.numel() != torch.unique(kept).numel():
                raise ValueError(
                    f"{what}: position_map row {r} maps two input positions to one padded position"
                )
        object.__setattr__(self, "position_map", self.position_map.to(torch.int64))

    def _check_equal_indices(self, idx: torch.Tensor, what: str, world: int, padded: int) -> None:
        if (
            idx.dtype not in (torch.int64, torch.int32)
            or idx.dim() not in (2, 3)
            or idx.shape[0] != world
        ):
            raise ValueError(
                f"{what}: local_token_global_indices must be an integer tensor [W, L] or [W, B, "
                f"L] with W = world_size = {world}, got {idx.dtype} {tuple(idx.shape)}"
            )
        if idx.shape[-1] * world != padded:
            raise ValueError(
                f"{what}: local_token_global_indices hold {idx.shape[-1]} positions per rank, but "
                f"padded_seq_len / world_size = {padded} / {world}"
            )
        idx = idx.detach().to(torch.int64)
        rows = idx.reshape(world, 1, -1) if idx.dim() == 2 else idx
        _check_partition(rows.permute(1, 0, 2).reshape(rows.shape[1], -1), padded, what)
        object.__setattr__(self, "local_token_global_indices", idx)

    def _check_ragged_indices(self, idx: tuple, what: str, world: int, padded: int) -> None:
        if len(idx) != world or not all(
            isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype in (torch.int64, torch.int32)
            for t in idx
        ):
            raise ValueError(
                f"{what}: local_token_global_indices must hold {world} 1-D integer tensors, one "
                "per rank"
            )
        idx = tuple(t.detach().to(torch.int64) for t in idx)
        _check_partition(torch.cat([t.cpu() for t in idx]).reshape(1, -1), padded, what)
        object.__setattr__(self, "local_token_global_indices", idx)

    # -- queries ---------------------------------------------------------------------------

    @functools.cached_property
    def rank_major_pieces(self) -> tuple[torch.Tensor, ...] | None:
        """A planned layout's pieces sorted by rank, row and start (empty ones dropped): rank,
        row, start, length and the rank's local index of each piece's first position (None
        without ``owner_pieces``)."""
        if self.owner_pieces is None:
            return None
        return rank_major_pieces(self.owner_pieces, self.world_size, self.padded_seq_len)

    def partition_key(self) -> Indices | None:
        """What names the partition in the ranks' consensus: the key of the table it was
        listed from (far smaller than the positions), else its positions (None: closed
        form)."""
        if self.planned_from is not None:
            return self.planned_from.key()
        return self.local_token_global_indices

    @property
    def strategy(self) -> LayoutStrategy | None:
        """The built-in strategy ``name`` refers to (None for a custom layout's name)."""
        return lookup(self.name)

    @property
    def closed_form(self) -> bool:
        """True when the partition follows from the sizes alone (no indices carried)."""
        return self.local_token_global_indices is None and is_closed_form(self.name)

    @property
    def moves_whole_chunks(self) -> bool:
        """True when the partition is closed-form and every rank holds whole chunks of
        ``P / num_chunks`` tokens, so un-sharding can reorder chunks instead of tokens."""
        return self.closed_form and self.strategy.moves_whole_chunks

    @property
    def rank_major_is_global_order(self) -> bool:
        """True when the partition is closed-form and the rank-major concatenation of the
        shards already is global order (un-sharding needs no reorder)."""
        return self.closed_form and (
            self.strategy.rank_major_is_global_order or self.world_size == 1
        )

    @property
    def contiguous_shards(self) -> bool:
        """True when the partition is closed-form and every rank holds one contiguous run of
        positions (its causal keys from earlier ranks are a halo just before the run)."""
        return self.closed_form and self.strategy.contiguous_shards

    @property
    def counts(self) -> list[int]:
        """Tokens (per row) every rank holds."""
        idx = self.local_token_global_indices
        if isinstance(idx, tuple):
            return [t.numel() for t in idx]
        return [self.padded_seq_len // self.world_size] * self.world_size

    @property
    def per_row(self) -> bool:
        """True when the partition differs between batch rows (indices ``[W, B, L]``, B > 1)."""
        idx = self.local_token_global_indices
        return isinstance(idx, torch.Tensor) and idx.dim() == 3 and idx.shape[1] > 1

    def _closed_form_sizes(
        self, rank: int | None, what: str
    ) -> tuple[LayoutStrategy, int, int, int | None]:
        """Validated (strategy, world, P, C) of this record's name as a closed-form layout
        (errors name ``what``, the public query the record answers for)."""
        return check_closed_form(
            self.name, self.world_size, self.padded_seq_len, self.num_chunks, rank, what
        )

    def indices(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``rank``'s global positions: ``[L]``, or ``[B, L]`` for a per-row layout."""
        what = "cpshard.ShardLayout.indices"
        rank = check_int(rank, "rank", what, 0)
        if rank >= self.world_size:
            raise ValueError(
                f"{what}: rank = {rank} is out of range for world_size = {self.world_size}"
            )
        idx = self.local_token_global_indices
        if idx is None:
            strategy, world, padded, chunks = self._closed_form_sizes(
                rank, "cpshard.local_token_global_indices"
            )
            return strategy.local_indices(rank, world, padded, chunks, device)
        out = idx[rank]
        if out.dim() == 2 and out.shape[0] == 1:
            out = out[0]
        return out.to(device) if device is not None else out

    def rank_major_inverse(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[P]`` (or ``[B, P]`` per row): each global position's slot in the rank-major
        concatenation of the ranks' shards. Computed locally (closed form or from the carried
        indices): no communication."""
        idx = self.local_token_global_indices
        if idx is None:
            strategy, world, padded, chunks = self._closed_form_sizes(
                None, "cpshard.rank_major_inverse"
            )
            return strategy.rank_major_inverse(world, padded, chunks, device)
        if isinstance(idx, tuple):
            flat = torch.cat([t.to(idx[0].device) for t in idx])
        elif idx.dim() == 2:  # [W, L] -> [W*L]
            flat = idx.reshape(-1)
        else:  # [W, B, L] -> [B, W*L]
            flat = idx.permute(1, 0, 2).reshape(idx.shape[1], -1)
            if flat.shape[0] == 1:
                flat = flat[0]
        flat = flat.to(device) if device is not None else flat
        inv = torch.empty_like(flat)
        src = torch.arange(flat.shape[-1], device=flat.device).expand_as(flat)
        return inv.scatter_(-1, flat, src)


def _check_partition(rows: torch.Tensor, padded: int, what: str) -> None:
    """Every row of ``rows`` [R, P] must be a permutation of 0..P-1 (``rows`` may be a view:
    its P values per row are marked in a bitmap, which they cover only if none repeats)."""
    rows = rows.cpu()
    if rows.numel() == 0:
        if padded != 0:
            raise ValueError(
                f"{what}: local_token_global_indices are empty but padded_seq_len = {padded}"
            )
        return
    if rows.shape[1] != padded or int(rows.min()) < 0 or int(rows.max()) >= padded:
        raise ValueError(
            f"{what}: local_token_global_indices must lie in [0, padded_seq_len = {padded})"
        )
    seen = torch.zeros(rows.shape[0], padded, dtype=torch.bool)
    seen.scatter_(1, rows, True)
    if not bool(seen.all()):
        raise ValueError(
            f"{what}: local_token_global_indices must hold every position 0..{padded - 1} of "
            "every row exactly once"
        )
