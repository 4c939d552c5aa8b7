"""The ``per_document_head_tail`` layout's runs in closed form: every run of a row (documents and
padding alike) is cut into ``C`` chunks dealt serpentine-wise (:mod:`cpshard.layouts.serpentine`),
so rank ``r`` holds chunk ``k(r, t)`` of pass ``t`` of every run, and everything the needed-rows
planner asks of every rank's runs follows from the chunk table ``[runs, C]``: a rank's runs, its
key intervals per document, its token counts, the intervals' coverage of its chunks, and how many
of its positions lie below a position (a binary search over the runs, then its ``C / W`` chunks
of that run). O(runs x C) whole-tensor work per step (at most about the padded tokens), instead
of cutting, sorting and searching every rank's pieces.

The table is made from the documents and checked against the layout's own pieces (a layout of
that name whose pieces are not the deal of these documents is planned from its pieces).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.batch.runs import DENSE_LOOKUPS, id_runs, maximal_runs
from cpshard.layouts import ShardLayout
from cpshard.layouts.serpentine import chunk_ranks, zigzag_sizes
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

    @classmethod
    def of(cls, layout: ShardLayout, documents: torch.Tensor) -> ZigzagRuns | None:
        """The table of ``layout`` for the padded document ids ``documents`` ``[B, P]``, or None
        when its pieces are not the serpentine deal of these runs."""
        world, chunks, padded = layout.world_size, layout.num_chunks, layout.padded_seq_len
        pieces, idx = layout.owner_pieces, layout.local_token_global_indices
        if chunks is None or pieces is None or not isinstance(idx, torch.Tensor):
            return None
        row, start, end, ids = id_runs(documents)
        lengths = end - start
        m = lengths % chunks
        running = torch.cumsum(m, 0) - m
        row_first = torch.searchsorted(row, row)  # each run's row's first run
        counter = (running - running[row_first]) % world  # the counter restarts every row
        size = torch.cat(
            [s for _, s in zigzag_sizes(lengths, world, chunks, counter)]
            or [torch.zeros(0, chunks, dtype=torch.int64)]
        )
        ranks = chunk_ranks(world, chunks)
        if len(pieces) != documents.shape[0] or documents.shape[1] != padded:
            return None
        theirs_size = torch.cat([p[1] for p in pieces]) if pieces else size.new_zeros(0)
        theirs_rank = torch.cat([p[2] for p in pieces]) if pieces else size.new_zeros(0)
        theirs = (theirs_size * world + theirs_rank)[theirs_size > 0]
        if not torch.equal((size * world + ranks)[size > 0], theirs):
            return None  # the layout's non-empty pieces in order: not this deal
        first = torch.cumsum(size, 1).sub_(size).add_(start[:, None])
        owned = torch.argsort(ranks, stable=True).view(world, chunks // world)
        per_run = torch.zeros(size.shape[0], world, dtype=torch.int64).index_add_(1, ranks, size)
        before_run = torch.cumsum(per_run, 0).sub_(per_run).sub_(row[:, None] * idx.shape[-1])
        return cls(
            world, padded, int(documents.shape[0]), row, start, end, ids != 0, first, size,
            owned, before_run, idx,
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
        per_chunk = self.size[self.is_doc].sum(0)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(
            0, chunk_ranks(self.world, per_chunk.numel()), per_chunk
        )

    def intervals(self, causal: bool, window: int | None) -> tuple[torch.Tensor, ...]:
        """Every rank's key intervals, ordered by rank, row and start (overlapping or adjacent
        ones not yet merged): without a window one per (rank, document it holds a token of),
        from the document's start to its last chunk's end (or the document's); with one, one
        per chunk, from its first query's window."""
        d = torch.nonzero(self.is_doc).flatten()
        row, ds, de = self.run_row[d], self.run_start[d], self.run_end[d]
        size = self.size[d]
        end = (self.first[d] + size).mul_(size > 0)  # [D, C]; 0: an empty chunk
        if window is None:
            ranks = chunk_ranks(self.world, size.shape[1]).expand_as(size)
            last = torch.zeros(d.numel(), self.world, dtype=torch.int64)
            last.scatter_reduce_(1, ranks, end, "amax")  # each rank's last chunk's end
            held = (last > 0).T  # [W, D]
            rank, doc = torch.nonzero(held, as_tuple=True)
            hi = last.T[held] if causal else de[doc]
            return rank, row[doc], ds[doc], hi
        begin, n = self.first[d][:, self.owned], size[:, self.owned]  # [D, W, C / W]
        keep = (n > 0).permute(1, 0, 2)  # [W, D, C / W]
        rank, doc, _ = torch.nonzero(keep, as_tuple=True)
        lo = torch.maximum(ds[doc], begin.permute(1, 0, 2)[keep] - window + 1)
        hi = (begin + n).permute(1, 0, 2)[keep] if causal else de[doc]
        return rank, row[doc], lo, hi

    def served(self, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """``[W]``: every rank's document tokens counted once per interval ``[lo, hi)`` of batch
        row ``row`` that holds them (each chunk's share from the coverage at its bounds)."""
        d = torch.nonzero(self.is_doc).flatten()
        bounds = torch.cat([self.first[d], self.run_end[d][:, None]], 1)  # [D, C + 1]
        covered = Coverage(row, lo, hi, self.rows, self.padded, bounds.numel())
        below = covered.below(self.run_row[d][:, None].expand_as(bounds), bounds)
        per_chunk = torch.diff(below, dim=1).sum(0)
        return torch.zeros(self.world, dtype=torch.int64).index_add_(
            0, chunk_ranks(self.world, per_chunk.numel()), per_chunk
        )

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
