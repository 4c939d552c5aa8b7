"""Runs of one id: where a maximal run of one id begins, a row's runs, and the runs every rank's
tokens form under a layout (host tensors, no loop over tokens or ranks)."""

from __future__ import annotations

import torch

from cpshard.ranges import ragged_arange

# With more than one lookup per DENSE_LOOKUPS positions, a running count over every position
# beats a binary search per lookup (the planners' choice between two exact ways to count).
DENSE_LOOKUPS = 8


def run_starts(ids: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, S]`` True where a run of equal ``ids`` begins among the ``valid`` tokens (a row's
    first valid token and the first after padding always begin one; None: every token is
    valid, one pass)."""
    if valid is None:
        starts = torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
        starts[:, :1] = True
        torch.ne(ids[:, 1:], ids[:, :-1], out=starts[:, 1:])
        return starts
    starts = valid.clone()
    starts[:, 1:] &= ~((ids[:, 1:] == ids[:, :-1]) & valid[:, :-1])
    return starts


def document_runs(row: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of one id in a 1-D row: ``(start, length, id)`` in position order."""
    row = row.detach().to("cpu", torch.int64)
    n = row.numel()
    if n == 0:
        return []
    starts = torch.nonzero(run_starts(row[None])[0]).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return list(zip(starts.tolist(), (ends - starts).tolist(), row[starts].tolist(), strict=True))


def id_runs(doc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every maximal run of one id of ``doc`` ``[B, P]``, padding runs included: row, start,
    end (one past the last token) and id, int64 vectors ordered by row and start."""
    padded = doc.shape[1]
    bounds = torch.nonzero(run_starts(doc).reshape(-1))
    bounds = bounds.flatten()  # every row's first position starts a run
    after = torch.cat([bounds[1:], bounds.new_tensor([doc.numel()])])
    row = bounds // max(padded, 1)
    # a run never crosses a row: the next row's first position starts one
    return row, bounds - row * padded, after - row * padded, doc.reshape(-1)[bounds]


def document_bounds(doc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The documents (maximal runs of one non-zero id) of ``doc`` ``[B, P]``: row, start and
    end (one past the last token) int64 vectors, ordered by row and start."""
    row, start, end, ids = id_runs(doc)
    keep = ids != 0
    return row[keep], start[keep], end[keep]


def document_runs_of(
    rank: torch.Tensor,
    row: torch.Tensor,
    q: torch.Tensor,
    begin: torch.Tensor,
    n: torch.Tensor,
    doc: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """The runs of every rank: its stretches of consecutive global positions ``[begin, begin +
    n)`` of batch rows ``row`` (rank ``rank``'s, from its local index ``q``; ordered by rank,
    row and position; a binary search each) cut at the bounds of the documents of ``doc``
    ``[B, P]`` (0 = pad), pad pieces dropped, pieces that meet merged. Returns rank, row,
    first local index, length, document start, first global position and document end (one
    past its last token) of each run (int64 vectors, in that order)."""
    b, padded = doc.shape
    starts = run_starts(doc).reshape(-1)
    bounds = torch.nonzero(starts).flatten()  # flat; every row's first position is one
    after = torch.cat([bounds[1:], bounds.new_tensor([doc.numel()])])
    lo = row * padded + begin
    if n.numel() * DENSE_LOOKUPS > doc.numel():  # many: read each position's document
        at = torch.cumsum(starts, 0) - 1
        first, last = at[lo], at[lo + n - 1]
    else:
        first = torch.searchsorted(bounds, lo, right=True) - 1
        last = torch.searchsorted(bounds, lo + n - 1, right=True) - 1
    if torch.equal(first, last):  # no stretch crosses a bound (a planner cut at documents)
        j, piece_lo, piece_hi = first, lo, lo + n
    else:
        pieces = last - first + 1
        which = torch.repeat_interleave(torch.arange(n.numel()), pieces)
        j = ragged_arange(first, pieces)  # each piece's document
        lo, row, rank, n, q = lo[which], row[which], rank[which], n[which], q[which]
        piece_lo = torch.maximum(lo, bounds[j])
        piece_hi = torch.minimum(lo + n, after[j])
    origin = row * padded
    cols = (
        rank, row, q + piece_lo - lo, piece_hi - piece_lo,
        bounds[j] - origin, piece_lo - origin, after[j] - origin,
    )  # fmt: skip
    real = doc.reshape(-1)[bounds[j]] != 0
    if not bool(real.all()):
        keep = torch.nonzero(real).flatten()  # not padding
        cols = tuple(t[keep] for t in cols)
    return maximal_runs(cols)


def maximal_runs(cols: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Runs that meet (one rank's consecutive pieces of one document, e.g. two chunks a
    serpentine deal gives it in a row) merged into one."""
    rank, row, q, n, start, begin, end = cols
    new = torch.ones_like(rank, dtype=torch.bool)
    new[1:] = (rank[1:] != rank[:-1]) | (row[1:] != row[:-1]) | (begin[1:] != begin[:-1] + n[:-1])
    new[1:] |= start[1:] != start[:-1]
    if bool(new.all()):
        return cols
    heads = torch.nonzero(new).flatten()
    last = torch.cat([heads[1:], heads.new_tensor([rank.numel()])]) - 1
    merged = begin[last] + n[last] - begin[heads]
    return rank[heads], row[heads], q[heads], merged, start[heads], begin[heads], end[heads]
