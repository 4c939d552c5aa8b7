"""The ``balanced`` layout: documents split only as much as balancing the per-rank causal cost
(:mod:`cpshard.layouts.costs`) needs, planned from the batch's document ids.

Whole documents are placed greedily (largest first, on the rank with the most cost budget left
that still has room for them); documents that fit nowhere are cut across the ranks that have
room (cheap heads to the ranks with the least budget left); padding fills what remains. If the
result is not within ``tolerance`` of the mean cost, the largest documents are zig-zagged
(:mod:`cpshard.layouts.serpentine`; 1, 2, 4, ... of them, finally all), which
balances them on their own, and the rest is placed again. The plan with the fewest zig-zagged
documents within tolerance is kept, else the most balanced. Every rank holds exactly ``P / W``
positions of every row; the padded length is a multiple of ``W``.

An attempt costs ``O(D log W + W log W)`` for ``D`` documents: the greedy keeps the ranks with
room in a heap ordered by the placement key, the cut documents take the ranks in one order of
budget, and the zig-zagged documents' costs are whole-tensor sums per chunk. An attempt stops as
soon as a rank's cost is over the tolerance; the zig-zagged pieces and the padding are laid out
for the kept plan only.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

import torch

from cpshard.batch.runs import document_runs
from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.costs import attended_pairs, piece_cost
from cpshard.layouts.owners import Piece, RowPieces, check_doc_ids, owner_of_pieces
from cpshard.layouts.serpentine import (
    chunk_ranks,
    default_num_chunks,
    zigzag_pieces,
    zigzag_sizes,
)

__all__ = ["BALANCED", "balanced_pieces", "plan_balanced"]


class _Placement(NamedTuple):
    """One attempt at placing a row with the ``zigzagged`` largest documents zig-zagged: the
    max per-rank cost over the mean (exact if ``complete``, else only known to be over the
    limit), per-rank token counts and the pieces of the documents placed whole or cut (the
    zig-zagged ones and padding are not listed)."""

    zigzagged: int
    ratio: float
    complete: bool
    count: list[int]
    pieces: list[Piece]


class _Row:
    """The documents and padding runs of one row and the attempts at placing them."""

    def __init__(self, runs: list[tuple[int, int, int]], world: int, per_rank: int) -> None:
        self.world, self.per_rank = world, per_rank
        docs = [(s, n) for s, n, d in runs if d != 0]
        self.pads = [(s, n) for s, n, d in runs if d == 0]
        self.target = sum(attended_pairs(n) for _, n in docs) / world
        by_size = sorted(range(len(docs)), key=lambda i: (-docs[i][1], i))
        self.by_size = by_size
        # (start, length, cost) of the documents, largest first
        self.ordered = [(*docs[i], attended_pairs(docs[i][1])) for i in by_size]
        self.starts, self.lengths = torch.tensor(docs, dtype=torch.int64).reshape(-1, 2).T

    def stop_cost(self, limit: float) -> float:
        """The least per-rank cost ``c`` with ``c / target > limit`` (the ratio, computed as
        for the result, grows with ``c``); infinity (never stop) for no documents or a bound
        too large to search."""
        target = self.target
        bound = limit * target * 2 + 2
        if target <= 0 or not bound < 2**62:
            return math.inf
        lo, hi = 0, int(bound)  # lo / target <= limit < hi / target
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if mid / target > limit else (mid, hi)
        return hi

    def _zig(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Starts and lengths of the ``j`` largest documents, in position order."""
        zig = torch.tensor(sorted(self.by_size[:j]), dtype=torch.int64)
        return self.starts[zig], self.lengths[zig]

    def _zigzagged(self, j: int) -> tuple[list[int], list[int]]:
        """Per-rank token counts and costs of the ``j`` largest documents zig-zagged (in
        position order, the counter running along them)."""
        world = self.world
        if not j:
            return [0] * world, [0] * world
        chunks = default_num_chunks(world)
        count = torch.zeros(chunks, dtype=torch.int64)
        twice_cost = torch.zeros(chunks, dtype=torch.int64)
        for _, sizes in zigzag_sizes(self._zig(j)[1], world, chunks):
            # n tokens ending at e of their document cost n (2 e - n + 1) / 2 (piece_cost)
            ends = torch.cumsum(sizes, 1)
            count += sizes.sum(0)
            twice_cost += (sizes * (2 * ends - sizes + 1)).sum(0)
        ranks = chunk_ranks(world, chunks)
        zeros = torch.zeros(world, dtype=torch.int64)
        return zeros.index_add(0, ranks, count).tolist(), (
            zeros.index_add(0, ranks, twice_cost) // 2
        ).tolist()

    def place(self, j: int, stop_cost: float) -> _Placement:
        """Place the row with the ``j`` largest documents zig-zagged (module doc), stopping as
        soon as a rank's cost reaches ``stop_cost`` (:meth:`stop_cost`; infinity: never)."""
        world, per_rank, target = self.world, self.per_rank, self.target
        count, cost = self._zigzagged(j)
        pieces: list[Piece] = []

        def stop(c: int) -> _Placement:
            return _Placement(j, c / target, False, count, pieces)

        if max(cost) >= stop_cost:
            return stop(max(cost))
        # Whole documents, largest first, on the rank of largest key (target - cost,
        # per_rank - count, -r) among those with room: a heap of the negated keys
        # (cost - target == -(target - cost) exactly) of the ranks with room. Ranks too full
        # for the current document wait aside (least full first) until the documents,
        # decreasing, fit them again.
        heap = [(cost[r] - target, count[r] - per_rank, r) for r in range(world)]
        heap = [e for e in heap if e[1] < 0]
        heapq.heapify(heap)
        aside: list[tuple[int, tuple[float, int, int]]] = []
        deferred = []
        push, pop, replace = heapq.heappush, heapq.heappop, heapq.heapreplace
        for start, n, pairs in self.ordered[j:]:
            if aside and aside[0][0] <= -n:
                while aside and aside[0][0] <= -n:
                    push(heap, pop(aside)[1])
            while heap and heap[0][1] + n > 0:
                e = pop(heap)
                push(aside, (e[1], e))
            if not heap:
                deferred.append((start, n))
                continue
            _, room, r = heap[0]
            c = cost[r] + pairs
            cost[r] = c
            count[r] += n
            if room + n < 0:
                replace(heap, (c - target, room + n, r))
            else:
                pop(heap)
            pieces.append((start, n, r))
            if c >= stop_cost:
                return stop(c)
        # Cut across the ranks with room, the cheap head to the least budget left: ranks in
        # order of (target - cost, r), each taken whole but the last; that one keeps the
        # least budget, so the order (of the others, unchanged) holds for the next document.
        by_budget = sorted((target - cost[r], r) for r in range(world) if count[r] < per_rank)
        first = 0
        for start, n in deferred:
            done = 0
            while done < n:
                assert first < len(by_budget), "internal error: no room left for a document"
                r = by_budget[first][1]
                k = min(per_rank - count[r], n - done)
                count[r] += k
                cost[r] += piece_cost(done, k)
                pieces.append((start + done, k, r))
                done += k
                if cost[r] >= stop_cost:
                    return stop(cost[r])
                if count[r] == per_rank:
                    first += 1
        ratio = max(cost) / target if target > 0 else 1.0
        return _Placement(j, ratio, True, count, pieces)

    def pieces(self, placed: _Placement) -> RowPieces:
        """The row's pieces under a complete placement, padding filling what is left (ranks in
        order, at no cost)."""
        per_rank, count, pieces = self.per_rank, list(placed.count), list(placed.pieces)
        r = 0
        for start, n in self.pads:
            done = 0
            while done < n:
                while r < self.world and count[r] == per_rank:
                    r += 1
                assert r < self.world, "internal error: no room left for padding"
                k = min(per_rank - count[r], n - done)
                count[r] += k
                pieces.append((start + done, k, r))
                done += k
        starts, sizes, ranks = torch.tensor(pieces, dtype=torch.int64).reshape(-1, 3).T
        world = self.world
        zigzagged = zigzag_pieces(*self._zig(placed.zigzagged), world, default_num_chunks(world))
        keep = zigzagged[1] > 0  # no empty pieces: the order by start must be unambiguous
        starts, sizes, ranks = (
            torch.cat([x[keep], y]) for x, y in zip(zigzagged, (starts, sizes, ranks), strict=True)
        )
        order = torch.argsort(starts)
        return starts[order], sizes[order], ranks[order]


def _balanced_row(row: torch.Tensor, world: int, tolerance: float) -> RowPieces:
    length = row.numel()
    if world == 1:
        zero = torch.zeros(1, dtype=torch.int64)
        return zero, torch.tensor([length]), zero
    plan = _Row(document_runs(row), world, length // world)
    limit = 1.0 + tolerance
    stop_cost = plan.stop_cost(limit)
    found: dict[int, _Placement] = {}

    def attempt(j: int) -> bool:
        """Place the row with the ``j`` largest documents zig-zagged; True if within tolerance."""
        if j not in found:
            found[j] = plan.place(j, stop_cost)
        return found[j].ratio <= limit

    # 0, 1, 2, 4, ... zig-zagged documents, finally all; then the fewest that pass in between.
    docs = len(plan.ordered)
    lo, j = -1, 0
    while not attempt(j) and j < docs:
        lo, j = j, min(docs, 1 if j == 0 else 2 * j)
    if found[j].ratio <= limit:
        hi = j
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if attempt(mid) else (mid, hi)
        return plan.pieces(found[hi])
    # None passed: the most balanced, each attempt placed to the end.
    exact = {k: p if p.complete else plan.place(k, math.inf) for k, p in found.items()}
    return plan.pieces(exact[min(exact, key=lambda k: (exact[k].ratio, k))])


def plan_balanced(doc_ids: torch.Tensor, world: int, tolerance: float = 0.02) -> torch.Tensor:
    """Owner rank ``[B, P]`` of every position under ``balanced`` (module doc): equal token
    counts per rank and row, per-rank causal cost within ``1 + tolerance`` of the mean where the
    packing allows, documents split as little as that needs."""
    return owner_of_pieces(balanced_pieces(doc_ids, world, tolerance), doc_ids.shape)


def balanced_pieces(
    doc_ids: torch.Tensor, world: int, tolerance: float = 0.02
) -> list[RowPieces]:
    """Every row's pieces under ``balanced`` (:func:`plan_balanced`)."""
    what = "cpshard.layouts.plan_balanced"
    check_doc_ids(doc_ids, world, what)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ValueError(f"{what}: tolerance must be a number >= 0, got {tolerance!r}")
    return [_balanced_row(row, world, float(tolerance)) for row in doc_ids]


BALANCED = LayoutStrategy(
    "balanced",
    plan_pieces=lambda doc_ids, world, chunks, tolerance: balanced_pieces(
        doc_ids, world, tolerance
    ),
)
