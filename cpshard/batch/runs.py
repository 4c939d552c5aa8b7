"""The runs of one document: where a maximal run of one id begins, the document start of every
token, and the runs a rank's tokens form (host tensors, no loop over tokens)."""

from __future__ import annotations

import torch


def run_starts(ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` True where a run of equal ``ids`` begins among the ``valid`` tokens (a row's
    first valid token and the first after padding always begin one)."""
    starts = valid.clone()
    starts[:, 1:] &= ~((ids[:, 1:] == ids[:, :-1]) & valid[:, :-1])
    return starts


def document_starts(doc: torch.Tensor) -> torch.Tensor:
    """``[B, P]``: the position where each token's run of one id (its document) starts."""
    new = run_starts(doc, torch.ones_like(doc, dtype=torch.bool))
    pos = torch.arange(doc.shape[1]).expand_as(doc)
    return torch.cummax(torch.where(new, pos, 0), dim=1).values


def document_runs(row: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs of one id in a 1-D row: ``(start, length, id)`` in position order."""
    row = row.detach().to("cpu", torch.int64)
    n = row.numel()
    if n == 0:
        return []
    starts = torch.nonzero(run_starts(row[None], torch.ones(1, n, dtype=torch.bool))[0]).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return list(zip(starts.tolist(), (ends - starts).tolist(), row[starts].tolist(), strict=True))


def rank_runs(
    idx: torch.Tensor, doc: torch.Tensor, starts: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The runs of a rank's global positions ``idx`` ``[B, L]`` (ascending per row) over the
    document ids ``doc`` ``[B, P]`` (0 = pad) with their :func:`document_starts`: consecutive
    positions of one document. Returns row, first local index, length, document start and first
    global position of each (int64 vectors, row-major; pad tokens form no run)."""
    return _runs(idx, starts.gather(1, idx), doc.gather(1, idx) != 0)


def all_rank_runs(
    idx: torch.Tensor, doc: torch.Tensor, starts: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """:func:`rank_runs` of every rank at once, from every rank's positions ``idx`` ``[W, B, L]``
    (one pass over the padded sequence, whatever ``W``). Returns rank, row, first local index,
    length, document start and first global position of each run, ordered by rank, row and
    local index."""
    world, b, length = idx.shape
    if idx.numel() == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return (empty,) * 6
    by_row = idx.permute(1, 0, 2).reshape(b, world * length)  # [B, P]: every rank's, row by row

    def per_rank(values: torch.Tensor) -> torch.Tensor:
        return values.gather(1, by_row).view(b, world, length).transpose(0, 1).reshape(-1, length)

    row, q, n, ds, begin = _runs(idx.reshape(-1, length), per_rank(starts), per_rank(doc) != 0)
    return row // max(b, 1), row % max(b, 1), q, n, ds, begin


def _runs(
    idx: torch.Tensor, st: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """The runs of positions ``idx`` ``[R, L]`` (ascending per row) whose document starts are
    ``st`` and which are document tokens where ``valid``: row, first local index, length,
    document start and first global position of each (row-major)."""
    rows, length = idx.shape
    new = torch.ones_like(idx, dtype=torch.bool)
    new[:, 1:] = (idx[:, 1:] != idx[:, :-1] + 1) | (st[:, 1:] != st[:, :-1])
    head = torch.cummax(torch.where(new, torch.arange(length), 0), dim=1).values
    flat = (torch.arange(rows)[:, None] * length + head)[valid]
    heads, n = torch.unique_consecutive(flat, return_counts=True)
    row, q = heads // length, heads % length
    return row, q, n, st[row, q], idx[row, q]
