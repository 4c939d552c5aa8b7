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

from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.batch.runs import DENSE_LOOKUPS, maximal_runs
from cpshard.layouts import ShardLayout
from cpshard.layouts.serpentine import ZigzagTable, chunk_ranks, owned_chunks, zigzag_table
from cpshard.planning.coverage import Coverage


@dataclass(frozen=True)
class ZigzagRuns:
    """The chunk table of a ``per_document_head_tail`` layout of ``world`` ranks over ``rows``
    rows of ``padded`` positions: every run's row, start, end and whether it is a document
    (``[R]``), each chunk's first position and size (``[R, C]``), the chunk ``owned[r, t]`` of
    rank ``r`` in pass ``t`` (``[W, C / W]``), the positions of every rank before each run of
    its row (``[R, W]``) and every rank's positions ``[W, B, L]`` (the layout's)."""

    world: int
    padded: int
    rows: int
    run_row: torch.Tensor
    run_start: torch.Tensor
    run_end: torch.Tensor
    is_doc: torch.Tensor
    first: torch.Tensor
    size: torch.Tensor
    owned: torch.Tensor
    before_run: torch.Tensor
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
        size = table.size
        per_run = torch.zeros(size.shape[0], world, dtype=torch.int64)
        per_run.index_add_(1, chunk_ranks(world, chunks), size)
        before_run = torch.cumsum(per_run, 0).sub_(per_run).sub_(table.row[:, None] * idx.shape[-1])
        return cls(
            world, padded, rows, table.row, table.start, table.end, table.ids != 0, table.first,
            size, owned_chunks(world, chunks), before_run, idx,
        )  # fmt: skip

    @property
    def doc_start(self) -> torch.Tensor:
        return self.run_start[self.is_doc]

    @property
    def doc_end(self) -> torch.Tensor:
        return self.run_end[self.is_doc]

    def serves(self, causal: bool, window: int | None) -> bool:
        """Every mask of the runs: each rank's chunks give its intervals."""
        return True

    def rank_runs(self, rank: int, documents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rank ``rank``'s runs (row, local index, length, document start, first position,
        document end) in row and position order; ``documents`` unused (the table has them)."""
        d = torch.nonzero(self.is_doc).flatten()
        k = self.owned[rank]
        begin, n = self.first[d][:, k], self.size[d][:, k]  # [D, C / W]
        q = torch.cumsum(n, 1).sub_(n).add_(self.before_run[d, rank][:, None])
        keep = n > 0
        doc = d[:, None].expand_as(n)[keep]
        cols = (
            torch.full_like(doc, rank), self.run_row[doc], q[keep], n[keep],
            self.run_start[doc], begin[keep], self.run_end[doc],
        )  # fmt: skip
        return maximal_runs(cols)[1:]  # chunks of one document that meet: one run

    def tokens(self) -> torch.Tensor:
        """``[W]``: every rank's document tokens."""
        return self._by_rank(self.size[self.is_doc].sum(0))

    def _last_chunks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The document runs and, per (document, rank), the index of the rank's last non-empty
        chunk of it (-1: none): what the intervals and served counts without a window need
        (made once per step)."""
        if "last" not in self._made:
            d = torch.nonzero(self.is_doc).flatten()
            size = self.size[d]  # [D, C]
            ranks = chunk_ranks(self.world, size.shape[1]).expand_as(size)
            index = torch.arange(size.shape[1]).expand_as(size)
            last = torch.full((d.numel(), self.world), -1, dtype=torch.int64)
            last.scatter_reduce_(1, ranks, torch.where(size > 0, index, -1), "amax")
            self._made["last"] = (d, last)
        return self._made["last"]

    def intervals(self, causal: bool, window: int | None) -> tuple[torch.Tensor, ...]:
        """Every rank's key intervals, ordered by rank, row and start (overlapping or adjacent
        ones not yet merged): without a window one per (rank, document it holds a token of),
        from the document's start to its last chunk's end (or the document's); with one, one
        per chunk, from its first query's window."""
        if window is None:
            d, last = self._last_chunks()
            last = last.T.contiguous()  # [W, D]
            held = last >= 0
            rank, doc = torch.nonzero(held, as_tuple=True)
            run = d[doc]
            if causal:
                at = run * self.size.shape[1] + last[held]
                hi = self.first.view(-1)[at] + self.size.view(-1)[at]
            else:
                hi = self.run_end[run]
            return rank, self.run_row[run], self.run_start[run], hi
        d = torch.nonzero(self.is_doc).flatten()
        row, ds, de = self.run_row[d], self.run_start[d], self.run_end[d]
        begin, n = self.first[d][:, self.owned], self.size[d][:, self.owned]  # [D, W, C / W]
        keep = (n > 0).permute(1, 0, 2)  # [W, D, C / W]
        rank, doc, _ = torch.nonzero(keep, as_tuple=True)
        lo = torch.maximum(ds[doc], begin.permute(1, 0, 2)[keep] - window + 1)
        hi = (begin + n).permute(1, 0, 2)[keep] if causal else de[doc]
        return rank, row[doc], lo, hi

    def served(
        self, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
        rule: tuple[bool, int | None] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """``[W]``: every rank's document tokens counted once per interval ``[lo, hi)`` of batch
        row ``row`` that holds them. Intervals of :meth:`intervals` without a window (``rule``
        ``(causal, None)``): counted per chunk from the ranks that need it. Otherwise, few
        chunks: the intervals' coverage read at the chunks' bounds
        (:class:`~cpshard.planning.coverage.Coverage`); about a chunk per few positions: how
        many intervals hold each position, summed by owner (O(positions) whatever the world
        size; the intervals hold document positions only)."""
        if rule is not None and rule[1] is None:
            return self._served_by_chunk(rule[0])
        b, padded = self.rows, self.padded
        d = torch.nonzero(self.is_doc).flatten()
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
        length = self.indices.shape[-1]
        ranks = torch.arange(self.world).repeat_interleave(length).expand(b, -1)
        owner.scatter_(1, self.indices.permute(1, 0, 2).reshape(b, -1), ranks)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(
            0, owner.view(-1), held.reshape(-1)
        )

    def _served_by_chunk(self, causal: bool) -> torch.Tensor:
        """:meth:`served` of the intervals without a window: rank ``r'`` needs a document from
        its start to the end of its last chunk (causal) or to the document's end, so chunk
        ``j`` is served once to every rank whose last chunk is ``j`` or later (causal) or that
        holds a token of the document."""
        d, last = self._last_chunks()
        size = self.size[d]  # [D, C]
        chunks = size.shape[1]
        if causal:  # needers[:, j]: ranks whose last chunk is j or later
            ends = torch.zeros(d.numel(), chunks + 1, dtype=torch.int64)
            ends.scatter_add_(1, last + 1, torch.ones_like(last))  # column 0: holds none
            needers = ends[:, 1:].flip(1).cumsum(1).flip(1)
        else:
            needers = (last >= 0).sum(1, keepdim=True)
        return self._by_rank((size * needers).sum(0))

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
        return t.before_run[j, rank] + torch.minimum(within, t.size[j[:, None], k]).sum(1)

    def every_before(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """``[W, N]``: :meth:`before` for every rank at each position (one search per
        position, then the chunks of its run, summed by rank)."""
        t = self.table
        j = self._run(row, position)
        first, size = t.first[j], t.size[j]  # [N, C]
        within = torch.minimum((position[:, None] - first).clamp_(min=0), size)
        ranks = chunk_ranks(t.world, size.shape[1])
        return t.before_run[j].index_add_(1, ranks, within).T

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
        return torch.cumsum(count, 0)[row * span + position] - row * t.indices.shape[-1]
