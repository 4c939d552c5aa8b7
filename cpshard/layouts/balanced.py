"""The ``balanced`` layout: documents split only as much as balancing the per-rank causal cost
(:mod:`cpshard.layouts.costs`) needs, planned from the batch's document ids.

Whole documents are placed greedily (largest first, on the rank with the most cost budget left
that still has room for them); documents that fit nowhere are cut across the ranks that have
room (cheap heads to the ranks with the least budget left); padding fills what remains. If the
result is not within ``tolerance`` of the mean cost, the largest documents are zig-zagged
(:func:`~cpshard.layouts.serpentine.zigzag_pieces`; 1, 2, 4, ... of them, finally all), which
balances them on their own, and the rest is placed again. The plan with the fewest zig-zagged
documents within tolerance is kept, else the most balanced. Every rank holds exactly ``P / W``
positions of every row; the padded length is a multiple of ``W``.

The greedy keeps the ranks with room in a heap ordered by the placement key, so a row costs
``O(D log W)`` per attempt for ``D`` documents; an attempt stops as soon as a rank's cost is
over the tolerance, and only the kept plan records its pieces.
"""

from __future__ import annotations

import heapq

import torch

from cpshard.batch.runs import document_runs
from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.costs import attended_pairs, piece_cost
from cpshard.layouts.owners import Piece, check_doc_ids, owner_row, stack_rows
from cpshard.layouts.serpentine import default_num_chunks, zigzag_pieces

__all__ = ["BALANCED", "plan_balanced"]


class _Row:
    """The documents and padding runs of one row and the attempts at placing them."""

    def __init__(self, runs: list[tuple[int, int, int]], world: int, per_rank: int) -> None:
        self.world, self.per_rank = world, per_rank
        self.docs = [(s, n) for s, n, d in runs if d != 0]
        self.pads = [(s, n) for s, n, d in runs if d == 0]
        self.pairs = [attended_pairs(n) for _, n in self.docs]
        self.target = sum(self.pairs) / world
        self.by_size = sorted(range(len(self.docs)), key=lambda i: (-self.docs[i][1], i))
        doc_tensor = torch.tensor(self.docs, dtype=torch.int64).reshape(-1, 2)
        self.starts, self.lengths = doc_tensor.unbind(1)

    def ratio(self, j: int, limit: float | None) -> float:
        """Max per-rank cost over the mean with the ``j`` largest documents zig-zagged; with a
        ``limit``, a value over it as soon as one is reached (the attempt fails anyway)."""
        return self._place(j, limit, None)

    def owner(self, j: int, length: int) -> torch.Tensor:
        """Owner ranks of the row placed with the ``j`` largest documents zig-zagged."""
        pieces: list[Piece] = []
        zig_starts, zig_sizes, zig_ranks = self._zigzagged(j)[2]
        self._place(j, None, pieces)
        starts, sizes, ranks = torch.tensor(pieces, dtype=torch.int64).reshape(-1, 3).unbind(1)
        return owner_row(
            torch.cat([zig_starts, starts]),
            torch.cat([zig_sizes, sizes]),
            torch.cat([zig_ranks, ranks]),
            length,
        )

    def _zigzagged(
        self, j: int
    ) -> tuple[list[int], list[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per-rank token counts and costs of the ``j`` largest documents zig-zagged (in
        position order, the counter running along them), and their pieces."""
        zig = torch.tensor(sorted(self.by_size[:j]), dtype=torch.int64)
        run, offsets, sizes, ranks, _ = zigzag_pieces(
            self.lengths[zig], self.world, default_num_chunks(self.world)
        )
        ends = offsets + sizes
        costs = ends * (ends + 1) // 2 - offsets * (offsets + 1) // 2  # piece_cost, elementwise
        zeros = torch.zeros(self.world, dtype=torch.int64)
        count = zeros.index_add(0, ranks, sizes).tolist()
        cost = zeros.index_add(0, ranks, costs).tolist()
        return count, cost, (self.starts[zig][run] + offsets, sizes, ranks)

    def _place(self, j: int, limit: float | None, pieces: list[Piece] | None) -> float:
        """Place the row with the ``j`` largest documents zig-zagged (module doc); returns the
        max per-rank cost over the mean (see :meth:`ratio`), records the pieces other than the
        zig-zagged ones into ``pieces`` (padding included) if given."""
        world, per_rank, target = self.world, self.per_rank, self.target
        count, cost, _ = self._zigzagged(j)
        if limit is not None and j and max(cost) / target > limit:
            return max(cost) / target
        # Whole documents, largest first, on the rank of largest key (target - cost,
        # per_rank - count, -r) among those with room: a heap of the negated keys of the ranks
        # with room; ranks too full for the current document wait aside (by room) until the
        # documents, decreasing, fit them again.
        heap = [(-(target - cost[r]), count[r] - per_rank, r) for r in range(world)]
        heap = [e for e in heap if e[1] < 0]
        heapq.heapify(heap)
        aside: list[tuple[int, tuple[float, int, int]]] = []
        deferred = []
        for i in self.by_size[j:]:
            start, n = self.docs[i]
            while aside and aside[0][0] <= -n:
                heapq.heappush(heap, heapq.heappop(aside)[1])
            while heap:
                e = heapq.heappop(heap)
                if e[1] + n <= 0:
                    break
                heapq.heappush(aside, (e[1], e))
            else:
                deferred.append(i)
                continue
            r = e[2]
            count[r] += n
            cost[r] += self.pairs[i]
            if count[r] < per_rank:
                heapq.heappush(heap, (-(target - cost[r]), count[r] - per_rank, r))
            if pieces is not None:
                pieces.append((start, n, r))
            if limit is not None and cost[r] / target > limit:
                return cost[r] / target
        for i in deferred:  # cut across the ranks with room: the cheap head to the least budget
            start, n = self.docs[i]
            done = 0
            room = (r for r in range(world) if count[r] < per_rank)
            for r in sorted(room, key=lambda r: (target - cost[r], r)):
                k = min(per_rank - count[r], n - done)
                count[r] += k
                cost[r] += piece_cost(done, k)
                if pieces is not None:
                    pieces.append((start + done, k, r))
                done += k
                if limit is not None and cost[r] / target > limit:
                    return cost[r] / target
                if done == n:
                    break
            assert done == n, "internal error: no room left for a document"
        if pieces is not None:  # padding fills what is left, ranks in order, at no cost
            r = 0
            for start, n in self.pads:
                done = 0
                while done < n:
                    while r < world and count[r] == per_rank:
                        r += 1
                    assert r < world, "internal error: no room left for padding"
                    k = min(per_rank - count[r], n - done)
                    count[r] += k
                    pieces.append((start + done, k, r))
                    done += k
        return max(cost) / target if target > 0 else 1.0


def _balanced_row(row: torch.Tensor, world: int, tolerance: float) -> torch.Tensor:
    length = row.numel()
    if world == 1:
        return torch.zeros(length, dtype=torch.int64)
    plan = _Row(document_runs(row), world, length // world)
    limit = 1.0 + tolerance
    found: dict[int, float] = {}

    def attempt(j: int) -> bool:
        """Place the row with the ``j`` largest documents zig-zagged; True if within tolerance
        (``found[j]`` is then exact, else only known to be over the limit)."""
        if j not in found:
            found[j] = plan.ratio(j, limit)
        return found[j] <= limit

    # 0, 1, 2, 4, ... zig-zagged documents, finally all; then the fewest that pass in between.
    docs = len(plan.docs)
    lo, j = -1, 0
    while not attempt(j) and j < docs:
        lo, j = j, min(docs, 1 if j == 0 else 2 * j)
    if found[j] <= limit:
        hi = j
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if attempt(mid) else (mid, hi)
        return plan.owner(hi, length)
    exact = {k: plan.ratio(k, None) for k in found}  # none passed: the most balanced
    return plan.owner(min(exact, key=lambda k: (exact[k], k)), length)


def plan_balanced(doc_ids: torch.Tensor, world: int, tolerance: float = 0.02) -> torch.Tensor:
    """Owner rank ``[B, P]`` of every position under ``balanced`` (module doc): equal token
    counts per rank and row, per-rank causal cost within ``1 + tolerance`` of the mean where the
    packing allows, documents split as little as that needs."""
    what = "cpshard.layouts.plan_balanced"
    check_doc_ids(doc_ids, world, what)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ValueError(f"{what}: tolerance must be a number >= 0, got {tolerance!r}")
    rows = [_balanced_row(row, world, float(tolerance)) for row in doc_ids]
    return stack_rows(rows, doc_ids.shape)


BALANCED = LayoutStrategy(
    "balanced",
    plan_owner=lambda doc_ids, world, chunks, tolerance: plan_balanced(doc_ids, world, tolerance),
)
