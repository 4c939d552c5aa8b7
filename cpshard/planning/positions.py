"""Every rank's positions of a layout at once, and where a position falls among a rank's: the
inputs the step's planners share (host tensors, one pass over the padded sequence)."""

from __future__ import annotations

import torch

from cpshard.layouts import ShardLayout
from cpshard.layouts.closed_form import check_closed_form

# With more than one lookup per DENSE_LOOKUPS positions, a running count over every position
# beats a binary search per lookup (the planners' choice between the two exact ways to count).
DENSE_LOOKUPS = 8


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


class RankPrefix:
    """How many of a rank's positions (of one batch row) lie before a global position: a binary
    search over every rank's sorted positions flattened with disjoint offsets, so that one call
    answers for any mix of ranks, rows and positions."""

    def __init__(self, positions: torch.Tensor, padded: int) -> None:
        world, rows, length = positions.shape
        self.rows, self.length, self.span = rows, length, padded + 1
        blocks = torch.arange(world * rows).view(world, rows, 1)
        self.keys = (blocks * self.span + positions).reshape(-1)
        self._running: dict[int, torch.Tensor] = {}  # rank -> its running count (before_on)

    def before(self, rank: torch.Tensor, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Positions of ``rank`` in ``row`` that are ``< position`` (elementwise, int64)."""
        block = rank * self.rows + row
        return torch.searchsorted(self.keys, block * self.span + position) - block * self.length

    def before_on(self, rank: int, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """:meth:`before` for one ``rank``: a search of its own positions only, or, for many
        lookups (:data:`DENSE_LOOKUPS`), a read of its running count at every position (made
        once)."""
        first = rank * self.rows * self.length
        mine = self.keys[first : first + self.rows * self.length]  # row * span + position
        if row.numel() * DENSE_LOOKUPS > self.rows * self.span:
            counts = self._running.get(rank)
            if counts is None:
                counts = torch.zeros(self.rows * self.span + 1, dtype=torch.int64)
                counts[mine - first // self.length * self.span + 1] = 1
                counts = self._running[rank] = counts.cumsum_(0)  # its positions before each
            return counts[row * self.span + position] - row * self.length
        return torch.searchsorted(mine, (rank * self.rows + row) * self.span + position) - (
            row * self.length
        )
