"""The ``stripe`` layout's runs in closed form: rank ``r`` holds the positions ``p`` with
``p % W == r`` of every row, so for ``W >= 2`` each of its document tokens is a run of one, and
what the needed-rows planner asks of every rank's runs (their merged key intervals, their token
counts, the intervals' coverage of them) follows per (rank, document) and per residue mod ``W``:
O(W x documents + P / W) per rank instead of a pass over every rank's ``P`` one-token runs.

The intervals hold where a rank's runs of one document reach one interval with a window: causal
windows of at least ``W`` keys (consecutive runs of a rank are ``W`` apart, so their windows
chain). Without a window the exchange has a closed form of its own, O(documents + W)
(:mod:`~cpshard.planning.stripe_exchange`); anything else is planned from the runs themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.planning.positions import every_rank_before


def below_on_rank(x: torch.Tensor, rank: torch.Tensor | int, world: int) -> torch.Tensor:
    """Positions ``p < x`` with ``p % world == rank`` (``x >= 0``)."""
    return torch.div(x + world - 1 - rank, world, rounding_mode="floor")


def _per_residue(world: int, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """``[W]``: for every rank ``r``, the positions ``p % W == r`` in all ranges ``[lo, hi)``:
    ``sum(hi // W - lo // W)`` plus the ranges whose ``hi % W`` exceeds ``r``, minus those whose
    ``lo % W`` does."""
    base = int((hi // world - lo // world).sum())
    above = torch.zeros(world, dtype=torch.int64)
    for bound, sign in ((hi, 1), (lo, -1)):
        counts = torch.bincount(bound % world, minlength=world)
        above += sign * (counts.sum() - torch.cumsum(counts, 0))  # bounds with residue > r
    return above + base


@dataclass(frozen=True)
class StripeRuns:
    """The closed forms over the documents ``(row, start, end)`` (non-padding, ordered by row
    and start) of a stripe layout of ``world >= 2`` ranks and ``padded`` positions per row."""

    world: int
    padded: int
    doc_row: torch.Tensor
    doc_start: torch.Tensor
    doc_end: torch.Tensor

    def serves(self, causal: bool, window: int | None) -> bool:
        """Whether every rank's runs of one document reach one key interval of a window."""
        return causal and window is not None and window >= self.world

    def rank_runs(self, rank: int, documents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rank ``rank``'s runs (row, local index, length, document start, first position,
        document end), its document tokens in row and position order, from the padded ids
        ``documents`` ``[B, P]``."""
        length = self.padded // self.world
        begin = torch.arange(length) * self.world + rank
        row, q = torch.nonzero(documents[:, begin] != 0, as_tuple=True)
        begin = begin[q]
        keys = self.doc_row * (self.padded + 1) + self.doc_start
        doc = torch.searchsorted(keys, row * (self.padded + 1) + begin, right=True) - 1
        return row, q, torch.ones_like(q), self.doc_start[doc], begin, self.doc_end[doc]

    def tokens(self) -> torch.Tensor:
        """``[W]``: every rank's document tokens."""
        return _per_residue(self.world, self.doc_start, self.doc_end)

    def intervals(self, causal: bool, window: int) -> tuple[torch.Tensor, ...]:
        """Every rank's causal key intervals with a window of at least ``W`` keys, one per
        (rank, document it holds a token of): rank, row, start, end, ordered by rank, row and
        start (adjacent ones not yet merged)."""
        world = self.world
        rank = torch.arange(world)[:, None]
        start, end = self.doc_start[None], self.doc_end[None]
        first = start + (rank - start) % world  # the rank's first position at or after start
        last = end - 1 - (end - 1 - rank) % world  # its last position before end
        held = first < end
        hi = last + 1
        lo = torch.maximum(start, first - window + 1)
        rank = rank.expand_as(first)
        row = self.doc_row[None].expand_as(first)
        return tuple(t[held] for t in (rank, row, lo, hi))

    def position(self, rank: torch.Tensor, row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The global position of ``rank``'s local index ``slot`` (the same in every row)."""
        return slot * self.world + rank

    def served(self, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """``[W]``: every rank's positions inside the ranges ``[lo, hi)`` (document positions,
        counted once per range; the same in every row)."""
        return _per_residue(self.world, lo, hi)

    def prefix(self) -> StripePrefix:
        return StripePrefix(self.world)


@dataclass(frozen=True)
class StripePrefix:
    """:class:`~cpshard.planning.positions.RankPrefix`'s answers for a stripe layout, in closed
    form (the same in every row)."""

    world: int

    def before(self, rank: torch.Tensor, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Positions of ``rank`` that are ``< position`` (elementwise)."""
        return below_on_rank(position, rank, self.world)

    def every_before(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """``[W, N]``: :meth:`before` for every rank at each position."""
        return every_rank_before(self.before, self.world, row, position)

    def before_on(self, rank: int, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """:meth:`before` for one ``rank``."""
        return below_on_rank(position, rank, self.world)

