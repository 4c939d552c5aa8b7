"""The ``per_document_head_tail`` layout's runs in closed form: every run of a row (documents and
padding alike) is cut into ``C`` chunks dealt serpentine-wise (:mod:`cpshard.layouts.serpentine`),
so rank ``r`` holds chunk ``k(r, t)`` of pass ``t`` of every run, and everything the needed-rows
planner asks of every rank's runs follows from the chunk table ``[runs, C]``: a rank's runs, its
key intervals per document, its token counts, how many intervals hold each of its positions, and
how many of its positions lie below a position (a binary search over the runs, then the chunks
of that run). O(runs x C + positions) whole-tensor work per step, instead of cutting, sorting
and searching every rank's pieces.

The table is the one the layout was planned from (``ShardLayout.planned_from``) when it
describes the step's documents, else made here and checked against the layout's positions: a
layout of that name whose positions are not the deal of these documents is planned from its
positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.batch.runs import DENSE_LOOKUPS, maximal_runs
from cpshard.layouts import ShardLayout
from cpshard.layouts.serpentine import ZigzagTable, chunk_ranks, owned_chunks, zigzag_table
from cpshard.planning.coverage import Coverage
from cpshard.planning.zigzag_deal import ZigzagDeal


@dataclass(frozen=True)
class ZigzagRuns:
    """The chunk table of a ``per_document_head_tail`` layout of ``world`` ranks over ``rows``
    rows of ``padded`` positions: every run's row, start, end, whether it is a document and
    its extras counter (``[R]``), each chunk's first position and size (``[R, C]``), the chunk
    ``owned[r, t]`` of
    rank ``r`` in pass ``t`` (``[W, C / W]``), the positions of every rank before each run of
    its row (:meth:`before_run`, ``[R, W]``) and every rank's positions ``[W, B, L]`` (the
    layout's)."""

    world: int
    padded: int
    rows: int
    run_row: torch.Tensor
    run_start: torch.Tensor
    run_end: torch.Tensor
    is_doc: torch.Tensor
    counter: torch.Tensor
    first: torch.Tensor
    size: torch.Tensor
    owned: torch.Tensor
    indices: torch.Tensor
    _made: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, layout: ShardLayout, documents: torch.Tensor) -> ZigzagRuns | None:
        """The table of ``layout`` for the padded document ids ``documents`` ``[B, P]``, or None
        when its positions are not the serpentine deal of these runs. The table the layout was
        planned from is taken when it was made for these ids (the same runs: one pass);
        otherwise it is made here and checked against the positions in full."""
        world, chunks, padded = layout.world_size, layout.num_chunks, layout.padded_seq_len
        idx = layout.local_token_global_indices
        rows = int(documents.shape[0])
        if chunks is None or not isinstance(idx, torch.Tensor) or documents.shape[1] != padded:
            return None
        idx = idx.view(world, 1, -1).expand(world, rows, -1) if idx.dim() == 2 else idx
        table = layout.planned_from
        if not (
            isinstance(table, ZigzagTable) and (table.world, table.chunks) == (world, chunks)
            and table.describes(documents)
        ):  # fmt: skip
            table = zigzag_table(documents, world, chunks)
            mine = table.indices()
            if idx.shape != mine.shape or not torch.equal(idx, mine):
                return None
        return cls(
            world, padded, rows, table.row, table.start, table.end, table.ids != 0,
            table.counter, table.first, table.size, owned_chunks(world, chunks), idx,
        )  # fmt: skip

    @property
    def doc_start(self) -> torch.Tensor:
        return self.run_start[self.is_doc]

    @property
    def doc_end(self) -> torch.Tensor:
        return self.run_end[self.is_doc]

    @property
    def local_len(self) -> int:
        return self.indices.shape[-1]

    def before_run(self) -> torch.Tensor:
        """``[R, W]``: every rank's positions of the run's row before each run (made once)."""

        def make() -> torch.Tensor:
            per_run = torch.zeros(self.size.shape[0], self.world, dtype=torch.int64)
            per_run.index_add_(1, chunk_ranks(self.world, self.size.shape[1]), self.size)
            before = torch.cumsum(per_run, 0).sub_(per_run)
            return before.sub_(self.run_row[:, None] * self.local_len)

        return self._cached("before run", make)

    def rank_before_run(self, rank: int) -> torch.Tensor:
        """``[R]``: :meth:`before_run` of one rank (its own chunks' sizes only)."""
        if "before run" in self._made:
            return self._made["before run"][:, rank]
        per_run = self.size[:, self.owned[rank]].sum(1)
        return torch.cumsum(per_run, 0).sub_(per_run).sub_(self.run_row * self.local_len)

    def serves(self, causal: bool, window: int | None) -> bool:
        """With a window: each rank's chunks give its intervals (without one, the exchange has
        a closed form of its own, :mod:`~cpshard.planning.zigzag_exchange`)."""
        return window is not None

    def _cached(self, name: str, make: Callable[[], Any]) -> Any:
        if name not in self._made:
            self._made[name] = make()
        return self._made[name]

    def doc_runs(self) -> torch.Tensor:
        """``[D]``: the table's document runs (not padding)."""
        return self._cached("docs", lambda: torch.nonzero(self.is_doc).flatten())

    def deal(self) -> ZigzagDeal:
        """Every run's deal in closed form (:class:`~cpshard.planning.zigzag_deal.ZigzagDeal`;
        padding runs deal nothing), made once."""

        def make() -> ZigzagDeal:
            length = (self.run_end - self.run_start) * self.is_doc
            return ZigzagDeal.of(length, self.counter, self.world, self.size.shape[1])

        return self._cached("deal", make)

    def rank_runs(self, rank: int, documents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rank ``rank``'s runs (row, local index, length, document start, first position,
        document end) in row and position order; ``documents`` unused (the table has them)."""
        d = self.doc_runs()
        k = self.owned[rank]
        begin, n = self.first[:, k][d], self.size[:, k][d]  # [D, C / W]
        q = torch.cumsum(n, 1).sub_(n).add_(self.rank_before_run(rank)[d][:, None])
        keep = n > 0
        doc = d[:, None].expand_as(n)[keep]
        cols = (
            torch.full_like(doc, rank), self.run_row[doc], q[keep], n[keep],
            self.run_start[doc], begin[keep], self.run_end[doc],
        )  # fmt: skip
        return maximal_runs(cols)[1:]  # chunks of one document that meet: one run

    def tokens(self) -> torch.Tensor:
        """``[W]``: every rank's document tokens."""
        return self.deal().tokens()

    def intervals(self, causal: bool, window: int) -> tuple[torch.Tensor, ...]:
        """Every rank's key intervals with a window, one per chunk from its first query's
        window, ordered by rank, row and start (overlapping or adjacent ones not yet merged)."""
        d = self.doc_runs()
        row, ds, de = self.run_row[d], self.run_start[d], self.run_end[d]
        begin, n = self.first[:, self.owned][d], self.size[:, self.owned][d]  # [D, W, C / W]
        keep = (n > 0).permute(1, 0, 2)  # [W, D, C / W]
        rank, doc, _ = torch.nonzero(keep, as_tuple=True)
        lo = torch.maximum(ds[doc], begin.permute(1, 0, 2)[keep] - window + 1)
        hi = (begin + n).permute(1, 0, 2)[keep] if causal else de[doc]
        return rank, row[doc], lo, hi

    def served(self, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """``[W]``: every rank's document tokens counted once per interval ``[lo, hi)`` of batch
        row ``row`` that holds them (intervals of document positions). Few chunks: the
        intervals' coverage read at the chunks' bounds
        (:class:`~cpshard.planning.coverage.Coverage`); about a chunk per few positions: how
        many intervals hold each position, summed by owner (O(positions) whatever the world
        size)."""
        b, padded = self.rows, self.padded
        d = self.doc_runs()
        if d.numel() * (self.size.shape[1] + 1) * DENSE_LOOKUPS <= b * padded:
            bounds = torch.cat([self.first[d], self.run_end[d][:, None]], 1)  # [D, C + 1]
            covered = Coverage(row, lo, hi, b, padded, bounds.numel())
            below = covered.below(self.run_row[d][:, None].expand_as(bounds), bounds)
            return self._by_rank(torch.diff(below, dim=1).sum(0))
        delta = torch.zeros(b * (padded + 1), dtype=torch.int64)
        delta.index_add_(0, row * (padded + 1) + lo, torch.ones_like(lo))
        delta.index_add_(0, row * (padded + 1) + hi, torch.full_like(hi, -1))
        held = torch.cumsum(delta, 0).view(b, padded + 1)[:, :padded]
        owner = torch.empty(b, padded, dtype=torch.int64)
        length = self.local_len
        ranks = torch.arange(self.world).repeat_interleave(length).expand(b, -1)
        owner.scatter_(1, self.indices.permute(1, 0, 2).reshape(b, -1), ranks)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(
            0, owner.view(-1), held.reshape(-1)
        )

    def _by_rank(self, per_chunk: torch.Tensor) -> torch.Tensor:
        """``[W]``: per-chunk sums ``[C]`` (over the runs) summed by the chunks' owners."""
        ranks = chunk_ranks(self.world, per_chunk.numel())
        return torch.zeros(self.world, dtype=torch.int64).index_add_(0, ranks, per_chunk)

    def position(self, rank: torch.Tensor, row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The global position of ``rank``'s local index ``slot`` in batch row ``row``."""
        return self.indices[rank, row, slot]

    def prefix(self) -> ZigzagPrefix:
        return ZigzagPrefix(self)


@dataclass(frozen=True)
class ZigzagPrefix:
    """:class:`~cpshard.planning.positions.RankPrefix`'s answers from the chunk table: the run
    holding a position, the rank's positions before that run, and its chunks of the run below
    the position."""

    table: ZigzagRuns

    def _run(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        span = self.table.padded + 1
        keys = self.table.run_row * span + self.table.run_start
        return torch.searchsorted(keys, row * span + position, right=True) - 1

    def before(self, rank: torch.Tensor, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Positions of ``rank`` in ``row`` that are ``< position`` (elementwise)."""
        t = self.table
        j = self._run(row, position)
        k = t.owned[rank]  # [N, C / W]
        within = (position[:, None] - t.first[j[:, None], k]).clamp_(min=0)
        return t.before_run()[j, rank] + torch.minimum(within, t.size[j[:, None], k]).sum(1)

    def every_before(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """``[W, N]``: :meth:`before` for every rank at each position (one search per
        position, then the chunks of its run, summed by rank)."""
        t = self.table
        j = self._run(row, position)
        first, size = t.first[j], t.size[j]  # [N, C]
        within = torch.minimum((position[:, None] - first).clamp_(min=0), size)
        ranks = chunk_ranks(t.world, size.shape[1])
        return t.before_run()[j].index_add_(1, ranks, within).T

    def before_on(self, rank: int, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """:meth:`before` for one ``rank``: with a lookup for every few positions, from the
        running count of its positions over every row (one pass), else as :meth:`before`."""
        t = self.table
        span = t.padded + 1
        if position.numel() * DENSE_LOOKUPS <= t.rows * span:
            return self.before(torch.full_like(position, rank), row, position)
        mine = t.indices[rank] + 1 + torch.arange(t.rows)[:, None] * span  # [B, L]
        count = torch.zeros(t.rows * span, dtype=torch.int64)
        count.index_fill_(0, mine.reshape(-1), 1)
        return torch.cumsum(count, 0)[row * span + position] - row * t.local_len

