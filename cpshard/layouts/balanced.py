"""The ``balanced`` layout: documents split only as much as balancing the per-rank causal cost
(:mod:`cpshard.layouts.costs`) needs, planned from the batch's document ids.

Whole documents are placed greedily (largest first, on the rank with the most cost budget left
that still has room for them); documents that fit nowhere are cut across the ranks that have
room (cheap heads to the ranks with the least budget left); padding fills what remains. If the
result is not within ``tolerance`` of the mean cost, the largest documents are zig-zagged
(:func:`~cpshard.layouts.serpentine.zigzag_run`; 1, 2, 4, ... of them, finally all), which
balances them on their own, and the rest is placed again. The plan with the fewest zig-zagged
documents within tolerance is kept, else the most balanced. Every rank holds exactly ``P / W``
positions of every row; the padded length is a multiple of ``W``.
"""

from __future__ import annotations

import torch

from cpshard.batch.runs import document_runs
from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.costs import attended_pairs, piece_cost
from cpshard.layouts.owners import Piece, check_doc_ids, owner_row, stack_rows
from cpshard.layouts.serpentine import default_num_chunks, zigzag_run

__all__ = ["BALANCED", "plan_balanced"]


class _Attempt:
    """One placement of a row: pieces, per-rank token counts and costs."""

    def __init__(self, world: int, per_rank: int) -> None:
        self.world, self.cap = world, per_rank
        self.count = [0] * world
        self.cost = [0] * world
        self.pieces: list[Piece] = []

    def put(self, start: int, offset: int, n: int, rank: int, costly: bool = True) -> None:
        self.pieces.append((start, n, rank))
        self.count[rank] += n
        if costly:
            self.cost[rank] += piece_cost(offset, n)


def _balanced_attempt(
    docs: list[tuple[int, int]],
    pads: list[tuple[int, int]],
    zig: set[int],
    world: int,
    per_rank: int,
    target: float,
) -> _Attempt:
    a = _Attempt(world, per_rank)
    counter = 0
    for i in sorted(zig):  # zig-zagged documents, in position order (the counter runs along)
        start, n = docs[i]
        ps, counter = zigzag_run(start, n, world, default_num_chunks(world), counter)
        for s, k, r in ps:
            a.put(s, s - start, k, r)
    rest = sorted(
        (i for i in range(len(docs)) if i not in zig), key=lambda i: (-docs[i][1], docs[i][0])
    )
    deferred = []
    for i in rest:  # whole documents: most budget left among the ranks with room
        start, n = docs[i]
        best, key = -1, None
        for r in range(world):
            if a.count[r] + n <= per_rank:
                k = (target - a.cost[r], per_rank - a.count[r], -r)
                if key is None or k > key:
                    best, key = r, k
        if best < 0:
            deferred.append(i)
        else:
            a.put(start, 0, n, best)
    for i in deferred:  # cut across the ranks with room: the cheap head to the least budget
        start, n = docs[i]
        done = 0
        for r in sorted(range(world), key=lambda r: (target - a.cost[r], r)):
            room = per_rank - a.count[r]
            if room <= 0 or done == n:
                continue
            k = min(room, n - done)
            a.put(start + done, done, k, r)
            done += k
        assert done == n, "internal error: no room left for a document"
    for start, n in pads:  # padding fills what is left, at no cost
        done = 0
        for r in range(world):
            room = per_rank - a.count[r]
            if room > 0 and done < n:
                k = min(room, n - done)
                a.put(start + done, 0, k, r, costly=False)
                done += k
        assert done == n, "internal error: no room left for padding"
    return a


def _balanced_row(row: torch.Tensor, world: int, tolerance: float) -> torch.Tensor:
    length = row.numel()
    per_rank = length // world
    runs = document_runs(row)
    docs = [(s, n) for s, n, d in runs if d != 0]
    pads = [(s, n) for s, n, d in runs if d == 0]
    if world == 1:
        return torch.zeros(length, dtype=torch.int64)
    target = sum(attended_pairs(n) for _, n in docs) / world
    by_size = sorted(range(len(docs)), key=lambda i: (-docs[i][1], docs[i][0]))
    found: dict[int, tuple[float, _Attempt]] = {}

    def attempt(j: int) -> bool:
        """Place the row with the ``j`` largest documents zig-zagged; True if within tolerance."""
        if j not in found:
            a = _balanced_attempt(docs, pads, set(by_size[:j]), world, per_rank, target)
            found[j] = (max(a.cost) / target if target > 0 else 1.0, a)
        return found[j][0] <= 1.0 + tolerance

    # 0, 1, 2, 4, ... zig-zagged documents, finally all; then the fewest that pass in between.
    lo, j = -1, 0
    while not attempt(j) and j < len(docs):
        lo, j = j, min(len(docs), 1 if j == 0 else 2 * j)
    if found[j][0] <= 1.0 + tolerance:
        hi = j
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if attempt(mid) else (mid, hi)
        return owner_row(found[hi][1].pieces, length)
    best = min(found, key=lambda k: (found[k][0], k))
    return owner_row(found[best][1].pieces, length)


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
