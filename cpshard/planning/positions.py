"""Every rank's positions and pieces of a layout at once, and where a position falls among a
rank's: the inputs the step's planners share (host tensors; a planned layout's from its pieces,
no pass over the padded sequence)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpshard.layouts import ShardLayout, rank_major_inverse
from cpshard.layouts.closed_form import check_closed_form


def all_positions(layout: ShardLayout, rows: int) -> torch.Tensor:
    """``[W, B, L]`` int64: every rank's global positions of every batch row (ascending), for a
    layout whose ranks hold equal shards (closed-form layouts: their formula per rank; planned
    ones: the positions they carry)."""
    world, padded = layout.world_size, layout.padded_seq_len
    length = padded // world
    idx = layout.local_token_global_indices
    if idx is None:  # closed form: each rank's formula (checked once), O(L) each
        what = "cpshard planning"
        strategy, world, padded, chunks = check_closed_form(
            layout.name, world, padded, layout.num_chunks, None, what
        )
        formula = strategy.local_indices
        every = torch.stack([formula(r, world, padded, chunks, None) for r in range(world)])
        return every.to(torch.int64).view(world, 1, length).expand(world, rows, length)
    if isinstance(idx, tuple):
        raise ValueError(
            f"cpshard planning: layout {layout.name!r} gives the ranks shards of different "
            "lengths; CP attention plans equal shards"
        )
    idx = idx.to("cpu", torch.int64)
    if idx.dim() == 2:
        return idx[:, None, :].expand(world, rows, length)
    return idx.expand(world, rows, length)


def layout_pieces(layout: ShardLayout, rows: int) -> tuple[torch.Tensor, ...]:
    """Every rank's pieces of every row (runs of consecutive positions on one rank, maximal or
    not): rank, row, start, length and first local index ``q`` (int64 vectors ordered by rank,
    row and start; none empty). A planned layout's are the pieces it carries; contiguous
    shards' and whole chunks' follow from the sizes; any other's are read from its positions."""
    world, padded = layout.world_size, layout.padded_seq_len
    length = padded // max(world, 1)
    if layout.rank_major_pieces is not None:
        return layout.rank_major_pieces
    if layout.moves_whole_chunks and padded:  # closed-form whole chunks: C pieces a row
        chunks = layout.num_chunks
        assert chunks is not None
        size, per = padded // chunks, chunks // world
        slot = rank_major_inverse(layout.name, world, chunks, num_chunks=chunks)
        chunk = torch.argsort(slot).view(world, 1, per)  # each rank's chunks, ascending
        shape = (world, rows, per)
        cols = (
            torch.arange(world).view(world, 1, 1), torch.arange(rows).view(1, rows, 1),
            chunk * size, torch.full((1, 1, 1), size), torch.arange(per).view(1, 1, per) * size,
        )  # fmt: skip
        return tuple(t.expand(shape).reshape(-1) for t in cols)
    if layout.contiguous_shards:
        rank = torch.arange(world).repeat_interleave(rows)
        size = torch.full_like(rank, length)
        keep = torch.nonzero(size).flatten()
        return tuple(
            t[keep] for t in (rank, torch.arange(rows).repeat(world), rank * length, size,
                              torch.zeros_like(rank))
        )  # fmt: skip
    positions = all_positions(layout, rows).reshape(world * rows, length)
    new = torch.ones_like(positions, dtype=torch.bool)
    new[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    heads = torch.nonzero(new.reshape(-1)).flatten()
    size = torch.diff(heads, append=heads.new_tensor([positions.numel()]))
    block, q = heads // max(length, 1), heads % max(length, 1)
    return block // rows, block % rows, positions.reshape(-1)[heads], size, q


class RankPrefix:
    """How many of a rank's positions (of one batch row) lie before a global position: a binary
    search over every rank's pieces (:func:`layout_pieces`), keyed by rank, row and start, so
    that one call answers for any mix of ranks, rows and positions."""

    def __init__(
        self, pieces: tuple[torch.Tensor, ...], world: int, rows: int, padded: int
    ) -> None:
        rank, row, self.start, self.size, self.q = pieces
        self.world, self.rows, self.span = world, rows, padded + 1
        self.keys = (rank * rows + row) * self.span + self.start

    def before(self, rank: torch.Tensor, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Positions of ``rank`` in ``row`` that are ``< position`` (elementwise, int64)."""
        base = (rank * self.rows + row) * self.span
        return _below(self.keys, self.start, self.size, self.q, base, position)

    def every_before(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """``[W, N]``: :meth:`before` for every rank at each position."""
        return every_rank_before(self.before, self.world, row, position)

    def before_on(self, rank: int, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """:meth:`before` for one ``rank``: a search of its own pieces only (a table that
        stays in cache however many lookups)."""
        block = torch.tensor([rank * self.rows, (rank + 1) * self.rows])
        lo, hi = torch.searchsorted(self.keys, block * self.span).tolist()
        own = (t[lo:hi] for t in (self.keys, self.start, self.size, self.q))
        return _below(*own, (rank * self.rows + row) * self.span, position)


def _below(
    keys: torch.Tensor, start: torch.Tensor, size: torch.Tensor, q: torch.Tensor,
    base: torch.Tensor, position: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Per lookup: the local index of the last piece of its (rank, row) block (keys ``base``
    + start) starting below ``position``, plus the piece's part below it (0: none)."""
    if not keys.numel():
        return torch.zeros_like(position)
    j = torch.searchsorted(keys, base + position) - 1
    at = j.clamp(min=0)
    held = (j >= 0) & (keys[at] >= base)
    return torch.where(held, q[at] + torch.minimum(position - start[at], size[at]), 0)


def every_rank_before(
    before: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    world: int, row: torch.Tensor, position: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``[W, N]``: a prefix's elementwise ``before(rank, row, position)`` for every rank at each
    of the ``N`` positions (one call over the repeated lookups)."""
    ranks = torch.arange(world).repeat_interleave(position.numel())
    return before(ranks, row.repeat(world), position.repeat(world)).view(world, -1)
