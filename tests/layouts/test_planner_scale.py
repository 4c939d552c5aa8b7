"""The vectorized data-dependent planners (``balanced``, ``per_document_head_tail``) against
their former token-loop implementations, kept here verbatim as references: every fuzzed batch
(long-tailed document lengths, padding runs anywhere, small and large ``W``, chunk counts,
tolerances) and every degenerate one must give the same owner ranks, bit for bit.
"""

from __future__ import annotations

import random

import pytest
import torch

from cpshard.batch.runs import document_runs
from cpshard.layouts import serpentine
from cpshard.layouts.balanced import plan_balanced
from cpshard.layouts.costs import attended_pairs, piece_cost
from cpshard.layouts.owners import owner_to_indices
from cpshard.layouts.per_document_head_tail import plan_per_document_head_tail

# --------------------------------------------------------------------------- references

_Piece = tuple[int, int, int]


def _reference_chunk_rank(k: int, world: int) -> int:
    p, i = divmod(k, world)
    return i if p % 2 == 0 else world - 1 - i


def _reference_zigzag_run(
    start: int, n: int, world: int, chunks: int, counter: int
) -> tuple[list[_Piece], int]:
    q, m = divmod(n, chunks)
    sizes = [q] * chunks
    for i in range(m):
        rank = (counter + i) % world
        t = i // world
        sizes[t * world + (rank if t % 2 == 0 else world - 1 - rank)] += 1
    pieces, pos = [], start
    for k, size in enumerate(sizes):
        if size:
            pieces.append((pos, size, _reference_chunk_rank(k, world)))
            pos += size
    return pieces, counter + m


def _reference_owner_row(pieces: list[_Piece], length: int) -> torch.Tensor:
    pieces = sorted(pieces)
    assert sum(p[1] for p in pieces) == length
    owner = torch.zeros(length, dtype=torch.int64)
    if pieces:
        starts = torch.tensor([p[0] for p in pieces], dtype=torch.int64)
        ranks = torch.tensor([p[2] for p in pieces], dtype=torch.int64)
        delta = ranks.clone()
        delta[1:] -= ranks[:-1]
        owner[starts] = delta
        owner = owner.cumsum(0)
    return owner


def _reference_stack(rows: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
    return torch.stack(rows) if rows else torch.empty(tuple(shape), dtype=torch.int64)


def _reference_per_document_head_tail(
    doc_ids: torch.Tensor, world: int, num_chunks: int | None = None
) -> torch.Tensor:
    chunks = 2 * world if num_chunks is None else num_chunks
    rows = []
    for row in doc_ids:
        counter, pieces = 0, []
        for start, n, _ in document_runs(row):
            ps, counter = _reference_zigzag_run(start, n, world, chunks, counter)
            pieces.extend(ps)
        rows.append(_reference_owner_row(pieces, row.numel()))
    return _reference_stack(rows, doc_ids.shape)


class _Attempt:
    def __init__(self, world: int, per_rank: int) -> None:
        self.world, self.cap = world, per_rank
        self.count = [0] * world
        self.cost = [0] * world
        self.pieces: list[_Piece] = []

    def put(self, start: int, offset: int, n: int, rank: int, costly: bool = True) -> None:
        self.pieces.append((start, n, rank))
        self.count[rank] += n
        if costly:
            self.cost[rank] += piece_cost(offset, n)


def _reference_balanced_attempt(
    docs: list[tuple[int, int]],
    pads: list[tuple[int, int]],
    zig: set[int],
    world: int,
    per_rank: int,
    target: float,
) -> _Attempt:
    a = _Attempt(world, per_rank)
    counter = 0
    for i in sorted(zig):
        start, n = docs[i]
        ps, counter = _reference_zigzag_run(start, n, world, 2 * world, counter)
        for s, k, r in ps:
            a.put(s, s - start, k, r)
    rest = sorted(
        (i for i in range(len(docs)) if i not in zig), key=lambda i: (-docs[i][1], docs[i][0])
    )
    deferred = []
    for i in rest:
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
    for i in deferred:
        start, n = docs[i]
        done = 0
        for r in sorted(range(world), key=lambda r: (target - a.cost[r], r)):
            room = per_rank - a.count[r]
            if room <= 0 or done == n:
                continue
            k = min(room, n - done)
            a.put(start + done, done, k, r)
            done += k
        assert done == n
    for start, n in pads:
        done = 0
        for r in range(world):
            room = per_rank - a.count[r]
            if room > 0 and done < n:
                k = min(room, n - done)
                a.put(start + done, 0, k, r, costly=False)
                done += k
        assert done == n
    return a


def _reference_balanced_row(row: torch.Tensor, world: int, tolerance: float) -> torch.Tensor:
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
        if j not in found:
            a = _reference_balanced_attempt(docs, pads, set(by_size[:j]), world, per_rank, target)
            found[j] = (max(a.cost) / target if target > 0 else 1.0, a)
        return found[j][0] <= 1.0 + tolerance

    lo, j = -1, 0
    while not attempt(j) and j < len(docs):
        lo, j = j, min(len(docs), 1 if j == 0 else 2 * j)
    if found[j][0] <= 1.0 + tolerance:
        hi = j
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if attempt(mid) else (mid, hi)
        return _reference_owner_row(found[hi][1].pieces, length)
    best = min(found, key=lambda k: (found[k][0], k))
    return _reference_owner_row(found[best][1].pieces, length)


def _reference_balanced(doc_ids: torch.Tensor, world: int, tolerance: float = 0.02) -> torch.Tensor:
    rows = [_reference_balanced_row(row, world, float(tolerance)) for row in doc_ids]
    return _reference_stack(rows, doc_ids.shape)


# --------------------------------------------------------------------------- batches


def _row(rng: random.Random, length: int, tail: float, pad: float) -> list[int]:
    """A packed row of ``length`` ids: documents of Pareto(``tail``) lengths, each run preceded
    by padding with probability ``pad`` (so padding lands at the start, middle and end)."""
    ids: list[int] = []
    doc = 0
    while len(ids) < length:
        n = max(1, int(rng.paretovariate(tail) * rng.choice((1, 2, 8, 40))))
        if rng.random() < pad:
            ids += [0] * n
        else:
            doc += 1
            ids += [doc] * n
    return ids[:length]


def _batch(rng: random.Random, world: int, rows: int, per_rank: int) -> torch.Tensor:
    length = world * per_rank
    tail, pad = rng.choice((0.8, 1.2, 2.0, 5.0)), rng.choice((0.0, 0.1, 0.3))
    return torch.tensor([_row(rng, length, tail, pad) for _ in range(rows)], dtype=torch.int64)


SMALL = [(w, seed) for w in range(1, 9) for seed in range(12)]
LARGE = [(w, seed) for w in (16, 32, 64, 128) for seed in range(3)]


def _check(doc_ids: torch.Tensor, world: int) -> None:
    for tolerance in (0.0, 0.02, 0.3):
        got, want = plan_balanced(doc_ids, world, tolerance), _reference_balanced(
            doc_ids, world, tolerance
        )
        assert torch.equal(got, want), ("balanced", world, tolerance, doc_ids.tolist())
    for chunks in (None, world, 3 * world):
        got = plan_per_document_head_tail(doc_ids, world, chunks)
        want = _reference_per_document_head_tail(doc_ids, world, chunks)
        assert torch.equal(got, want), ("per_document_head_tail", world, chunks, doc_ids.tolist())


@pytest.mark.parametrize(("world", "seed"), SMALL)
def test_small_worlds_match_reference(world: int, seed: int) -> None:
    rng = random.Random(seed * 131 + world)
    _check(_batch(rng, world, rng.randint(1, 3), rng.choice((1, 2, 5, 16, 60))), world)


@pytest.mark.parametrize(("world", "seed"), LARGE)
def test_large_worlds_match_reference(world: int, seed: int) -> None:
    rng = random.Random(seed * 131 + world)
    _check(_batch(rng, world, rng.randint(1, 2), rng.choice((1, 3, 12))), world)


@pytest.mark.parametrize("world", [1, 2, 3, 8, 32])
def test_degenerate_rows_match_reference(world: int) -> None:
    cases = [
        torch.zeros(2, 4 * world, dtype=torch.int64),  # all padding
        torch.arange(1, 4 * world + 1)[None],  # one-token documents
        torch.arange(1, world + 1)[None],  # P == W
        torch.ones(1, 4 * world, dtype=torch.int64),  # one document
        torch.tensor([[0] * world + [5] * world]),  # padding then one document
        torch.tensor([[1, 0] * world, [0, 1] * world]),  # alternating one-token runs
        torch.zeros(0, 2 * world, dtype=torch.int64),  # no rows
        torch.zeros(2, 0, dtype=torch.int64),  # empty rows
        torch.ones(2, 2 * world, dtype=torch.bool),  # bool ids
    ]
    for doc_ids in cases:
        _check(doc_ids, world)


@pytest.mark.parametrize("world", [2, 5, 16])
def test_small_blocks_match_reference(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs zig-zagged a few at a time (blocks joined, sparse blocks filtered) agree too."""
    monkeypatch.setattr(serpentine, "BLOCK_ELEMENTS", 3 * 3 * world)
    rng = random.Random(world)
    for _ in range(4):
        _check(_batch(rng, world, 2, rng.choice((3, 12, 40))), world)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_owner_to_indices_equals_a_stable_sort_by_owner(world: int) -> None:
    """Every rank's positions from owner ranks: the same as sorting the positions by owner."""
    gen = torch.Generator().manual_seed(world)
    for rows, per_rank in ((1, 1), (2, 5), (3, 17)):
        for shuffle in (True, False):  # scattered owners, and owners in long runs
            base = torch.arange(world).repeat_interleave(per_rank)
            owner = torch.stack([
                base[torch.randperm(base.numel(), generator=gen)] if shuffle else base.roll(r)
                for r in range(rows)
            ])  # fmt: skip
            want = torch.argsort(owner, dim=1, stable=True).view(rows, world, per_rank)
            assert torch.equal(owner_to_indices(owner, world), want.permute(1, 0, 2))
