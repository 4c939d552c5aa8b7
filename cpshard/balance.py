"""Planners of the data-dependent layouts (pure functions of sizes and document ids).

Both planners work on the padded document ids of a batch, ``doc_ids`` ``[B, P]`` (0 = padding;
a *document* is a maximal run of one non-zero id, as everywhere in cpshard), and return the
owner rank of every position, ``[B, P]`` int64, with **exactly** ``P / W`` positions of every row
on every rank (so every rank holds ``[B, P/W]`` tokens and un-sharding is one equal all-gather).

The cost model is causal attention inside documents: a token at offset ``t`` of its document
attends to ``t + 1`` keys; a rank's cost is the sum over its tokens (padding costs nothing).
A piece ``[a, b)`` of a document (offsets) costs ``pairs(b) - pairs(a)`` with
``pairs(n) = n (n + 1) / 2``.

* ``per_document_head_tail``: zig-zag inside every run (documents and padding runs alike). A run
  of ``n`` tokens is cut into ``C`` chunks (default ``2W``) of ``n // C`` tokens, chunk ``k``
  owned by rank ``k`` on even passes of ``W`` chunks and by ``W - 1 - k % W`` on odd ones (for
  ``C = 2W``: rank ``r`` owns chunks ``r`` and ``2W - 1 - r``). The ``n % C`` remaining tokens
  are dealt one each to ranks ``c, c+1, ...`` (mod ``W``), ``c`` a counter running along the
  row, each extra token widening that rank's next chunk of the run. Documents shorter than
  ``C`` are thus spread over consecutive ranks without being padded, and because the extras
  are dealt cyclically along the row, every rank ends with exactly ``P / W`` tokens.
* ``balanced``: split documents only as much as needed. Whole documents are placed greedily
  (largest first, on the rank with the most cost budget left that still has room for them);
  documents that fit nowhere are cut across the ranks that have room (cheap heads to the ranks
  with the least budget left); padding fills what remains. If the result is not within
  ``tolerance`` of the mean cost, the largest documents are zig-zagged as above (1, 2, 4, ...
  of them, finally all), which balances them on their own, and the rest is placed again. The
  plan with the fewest zig-zagged documents within tolerance is kept, else the most balanced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpshard.batch.runs import document_runs
from cpshard.validation import is_int

__all__ = [
    "attended_pairs",
    "document_runs",
    "owner_to_indices",
    "plan_balanced",
    "plan_per_document_head_tail",
    "rank_costs",
    "token_costs",
]

Piece = tuple[int, int, int]  # (start, length, rank)


def attended_pairs(n: int) -> int:
    """Causal (query, key) pairs of a document of ``n`` tokens: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


def _check_doc_ids(doc_ids: torch.Tensor, world: int, what: str) -> None:
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"{what}: doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if doc_ids.dim() != 2:
        raise ValueError(f"{what}: doc_ids must be [B, P], got shape {tuple(doc_ids.shape)}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex:
        raise TypeError(f"{what}: doc_ids must hold integers or bools, got {doc_ids.dtype}")
    if not is_int(world) or world < 1:
        raise ValueError(f"{what}: world must be a positive int, got {world!r}")
    if doc_ids.shape[1] % world:
        raise ValueError(
            f"{what}: the padded length P = {doc_ids.shape[1]} is not a multiple of world = {world}"
        )


def _chunk_rank(k: int, world: int) -> int:
    """Owner of chunk ``k`` in a serpentine deal of chunks over ``world`` ranks."""
    p, i = divmod(k, world)
    return i if p % 2 == 0 else world - 1 - i


def _zigzag(start: int, n: int, world: int, chunks: int, counter: int) -> tuple[list[Piece], int]:
    """Pieces of a run of ``n`` tokens at ``start``, zig-zagged over ``chunks`` chunks, and the
    counter after dealing the run's ``n % chunks`` extra tokens."""
    q, m = divmod(n, chunks)
    sizes = [q] * chunks
    for i in range(m):
        rank = (counter + i) % world
        t = i // world  # this rank's t-th extra token in the run -> its t-th chunk
        sizes[t * world + (rank if t % 2 == 0 else world - 1 - rank)] += 1
    pieces, pos = [], start
    for k, size in enumerate(sizes):
        if size:
            pieces.append((pos, size, _chunk_rank(k, world)))
            pos += size
    return pieces, counter + m


def _owner_row(pieces: list[Piece], length: int) -> torch.Tensor:
    pieces = sorted(pieces)
    assert sum(p[1] for p in pieces) == length, "internal error: pieces do not tile the row"
    owner = torch.zeros(length, dtype=torch.int64)
    if pieces:
        # Rank deltas at piece starts, then a running sum (repeat_interleave, but cheap on a
        # busy machine: it is multi-threaded even for tiny inputs).
        starts = torch.tensor([p[0] for p in pieces], dtype=torch.int64)
        ranks = torch.tensor([p[2] for p in pieces], dtype=torch.int64)
        delta = ranks.clone()
        delta[1:] -= ranks[:-1]
        owner[starts] = delta
        owner = owner.cumsum(0)
    return owner


def plan_per_document_head_tail(
    doc_ids: torch.Tensor, world: int, num_chunks: int | None = None
) -> torch.Tensor:
    """Owner rank ``[B, P]`` of every position under ``per_document_head_tail`` (module doc)."""
    what = "cpshard.balance.plan_per_document_head_tail"
    _check_doc_ids(doc_ids, world, what)
    chunks = 2 * world if num_chunks is None else num_chunks
    if not is_int(chunks) or chunks < 1 or chunks % world:
        raise ValueError(
            f"{what}: num_chunks must be a positive multiple of world = {world}, got {num_chunks!r}"
        )
    rows = []
    for row in doc_ids:
        counter, pieces = 0, []
        for start, n, _ in document_runs(row):
            ps, counter = _zigzag(start, n, world, chunks, counter)
            pieces.extend(ps)
        rows.append(_owner_row(pieces, row.numel()))
    return _stack(rows, doc_ids.shape)


def _stack(rows: list[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    if not rows:
        return torch.empty(tuple(shape), dtype=torch.int64)
    return torch.stack(rows)


def _piece_cost(offset: int, n: int) -> int:
    return attended_pairs(offset + n) - attended_pairs(offset)


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
            self.cost[rank] += _piece_cost(offset, n)


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
        ps, counter = _zigzag(start, n, world, 2 * world, counter)
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
        return _owner_row(found[hi][1].pieces, length)
    best = min(found, key=lambda k: (found[k][0], k))
    return _owner_row(found[best][1].pieces, length)


def plan_balanced(doc_ids: torch.Tensor, world: int, tolerance: float = 0.02) -> torch.Tensor:
    """Owner rank ``[B, P]`` of every position under ``balanced`` (module doc): equal token
    counts per rank and row, per-rank causal cost within ``1 + tolerance`` of the mean where the
    packing allows, documents split as little as that needs."""
    what = "cpshard.balance.plan_balanced"
    _check_doc_ids(doc_ids, world, what)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ValueError(f"{what}: tolerance must be a number >= 0, got {tolerance!r}")
    rows = [_balanced_row(row, world, float(tolerance)) for row in doc_ids]
    return _stack(rows, doc_ids.shape)


def owner_to_indices(owner: torch.Tensor, world: int) -> torch.Tensor:
    """``[W, B, P/W]``: every rank's positions of every row, ascending, from owner ranks
    ``[B, P]`` (each rank must own exactly ``P / W`` positions of every row)."""
    what = "cpshard.balance.owner_to_indices"
    if owner.dim() != 2 or owner.shape[1] % world:
        raise ValueError(f"{what}: owner must be [B, P] with P a multiple of world = {world}")
    rows, length = owner.shape
    per_rank = length // world
    counts = torch.zeros(rows, world, dtype=torch.int64).scatter_add_(
        1, owner, torch.ones_like(owner)
    )
    if not bool((counts == per_rank).all()):
        raise ValueError(f"{what}: every rank must own exactly {per_rank} positions of every row")
    order = torch.argsort(owner, dim=1, stable=True)  # by rank, ascending position within a rank
    return order.view(rows, world, per_rank).permute(1, 0, 2).contiguous()


def token_costs(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, P]`` int64: the keys each token attends to (its offset in its document + 1; 0 for
    padding)."""
    ids = doc_ids.to(torch.int64)
    rows, length = ids.shape
    if length == 0:
        return torch.zeros_like(ids)
    pos = torch.arange(length).expand(rows, length)
    change = torch.ones_like(ids, dtype=torch.bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run_start = torch.cummax(torch.where(change, pos, torch.zeros_like(pos)), dim=1).values
    return (pos - run_start + 1) * (ids != 0)


def rank_costs(doc_ids: torch.Tensor, owner: torch.Tensor, world: int) -> torch.Tensor:
    """``[W]`` int64: every rank's causal-attention cost (sum of its tokens' attended keys)."""
    return torch.zeros(world, dtype=torch.int64).scatter_add_(
        0, owner.reshape(-1).to(torch.int64), token_costs(doc_ids).reshape(-1)
    )
