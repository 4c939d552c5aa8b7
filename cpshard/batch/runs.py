"""Runs of one id: where a maximal run of one id begins, a row's runs, and the runs every rank's
tokens form under a layout (host tensors, no loop over tokens or ranks)."""

from __future__ import annotations

import torch

from cpshard.ranges import ragged_arange


def run_starts(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` True where a run of equal ``ids`` begins among the ``valid`` tokens (a row's
    first valid token and the first after padding always begin one)."""
    starts = valid.clone()
    starts[:, 1:] &= ~((ids[:, 1:] == ids[:, :-1]) & valid[:, :-1])
    return starts


def document_runs(row: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of one id in a 1-D row: ``(start, length, id)`` in position order."""
    row = row.detach().to("cpu", torch.int64)
    n = row.numel()
    if n == 0:
        return []
    starts = torch.nonzero(run_starts(row[None], torch.ones(1, n, dtype=torch.bool))[0]).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return list(zip(starts.tolist(), (ends - starts).tolist(), row[starts].tolist(), strict=True))


def all_rank_runs(idx: torch.Tensor, doc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The runs of every rank's global positions ``idx`` ``[W, B, L]`` (ascending per rank and
    row) over the document ids ``doc`` ``[B, P]`` (0 = pad): maximal stretches of consecutive
    positions of one document on one rank. One pass over the padded sequence, whatever ``W``.
    Returns rank, row, first local index, length, document start, first global position and
    document end (one past its last token) of each run (int64 vectors, ordered by rank, row and
    local index; pad tokens form no run)."""
    world, b, length = idx.shape
    if idx.numel() == 0:
        return (torch.zeros(0, dtype=torch.int64),) * 7
    padded = doc.shape[1]
    boundary = run_starts(doc, torch.ones_like(doc, dtype=torch.bool))  # a document starts
    by_row = idx.permute(1, 0, 2).reshape(b, world * length)  # every rank's, row by row
    cut = boundary.gather(1, by_row).view(b, world, length).transpose(0, 1).reshape(-1, length)
    flat_idx = idx.reshape(-1, length)
    new = torch.ones_like(cut)
    new[:, 1:] = (flat_idx[:, 1:] != flat_idx[:, :-1] + 1) | cut[:, 1:]
    heads = torch.nonzero(new.reshape(-1)).flatten()
    n = torch.diff(heads, append=heads.new_tensor([new.numel()]))
    rank_row, q = heads // length, heads % length
    row, begin = rank_row % b, flat_idx.reshape(-1)[heads]
    keep = doc[row, begin] != 0
    rank_row, row, q, n, begin = (t[keep] for t in (rank_row, row, q, n, begin))
    # The documents' bounds, flattened over rows: every row's start is one.
    bounds = torch.nonzero(boundary.reshape(-1)).flatten()
    at = torch.searchsorted(bounds, row * padded + begin, right=True)
    doc_start = bounds[at - 1] - row * padded
    doc_end = torch.cat([bounds, bounds.new_tensor([b * padded])])[at] - row * padded
    return rank_row // b, row, q, n, doc_start, begin, doc_end


def contiguous_runs(world: int, doc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """:func:`all_rank_runs` of contiguous equal shards (rank r holds ``[r L, (r + 1) L)`` of
    every row): each rank's one stretch per row cut at the documents' bounds."""
    b, padded = doc.shape
    if doc.numel() == 0:
        return (torch.zeros(0, dtype=torch.int64),) * 7
    length = padded // world
    rank = torch.arange(world).repeat_interleave(b)
    row = torch.arange(b).repeat(world)
    begin = rank * length
    return _document_runs_of(rank, row, torch.zeros_like(rank), begin, torch.full_like(rank, length), doc)


def _document_runs_of(
    rank: torch.Tensor,
    row: torch.Tensor,
    q: torch.Tensor,
    begin: torch.Tensor,
    n: torch.Tensor,
    doc: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Stretches of consecutive global positions ``[begin, begin + n)`` of batch rows ``row``
    (rank ``rank``'s, from its local index ``q``; ordered; a few: a binary search each) cut at
    the bounds of the documents of ``doc`` ``[B, P]``, pad pieces dropped:
    :func:`all_rank_runs`'s seven vectors."""
    b, padded = doc.shape
    starts = run_starts(doc, torch.ones_like(doc, dtype=torch.bool)).reshape(-1)
    bounds = torch.nonzero(starts).flatten()  # flat; every row's first position is one
    after = torch.cat([bounds[1:], bounds.new_tensor([doc.numel()])])
    lo = row * padded + begin
    first = torch.searchsorted(bounds, lo, right=True) - 1
    pieces = torch.searchsorted(bounds, lo + n - 1, right=True) - first
    which = torch.repeat_interleave(torch.arange(n.numel()), pieces)
    j = ragged_arange(first, pieces)  # each piece's document
    lo, row = lo[which], row[which]
    piece_lo = torch.maximum(lo, bounds[j])
    piece_hi = torch.minimum(lo + n[which], after[j])
    keep = torch.nonzero(doc.reshape(-1)[bounds[j]]).flatten()  # not padding
    origin = row * padded
    cols = (
        rank[which], row, q[which] + piece_lo - lo, piece_hi - piece_lo,
        bounds[j] - origin, piece_lo - origin, after[j] - origin,
    )  # fmt: skip
    return tuple(t[keep] for t in cols)
