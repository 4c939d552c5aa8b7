"""Runs of queries cut at a mask description's segments: for each piece, the key interval its
queries reach and the rule each query's keys follow — what a planner turns into exchanged rows
and spans. O(runs + segments), whole-tensor (a binary search per run)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.masks.description import MaskDescription
from cpshard.ranges import ragged_arange


@dataclass(frozen=True, eq=False)
class MaskPieces:
    """Pieces of runs, each inside one segment, ordered like the runs and by position: the run
    ``run`` it comes from, batch row ``row``, queries ``[begin, begin + n)``. Query ``q`` sees
    the keys ``[max(lo, q - back), min(hi, q + 1 + ahead))``; ``[lo, hi)`` is the union of
    every query's keys (the first query's first key to the last query's end; a superset only
    where some query sees nothing): the rows a planner needs for the piece. ``ahead == 0``: causal within ``[lo, hi)`` (query ``q`` sees
    up to itself); ``ahead`` >= :data:`~cpshard.masks.description.INF`: every query sees up to
    ``hi``; ``back`` < INF: a sliding window's start."""

    run: torch.Tensor
    row: torch.Tensor
    begin: torch.Tensor
    n: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    back: torch.Tensor
    ahead: torch.Tensor

    @property
    def causal(self) -> torch.Tensor:
        """Per piece: its queries see their keys causally (each up to itself)."""
        return self.ahead == 0

    def query_ranges(self) -> tuple[torch.Tensor, ...]:
        """Every query of every piece: batch row, position, first key and one past its last."""
        at = torch.arange(self.n.numel()).repeat_interleave(self.n)
        q = ragged_arange(self.begin, self.n)
        first = torch.maximum(self.lo[at], q - self.back[at])
        end = torch.minimum(self.hi[at], q + 1 + self.ahead[at])
        return self.row[at], q, first, end


def cut_runs(
    mask: MaskDescription,
    row: torch.Tensor,
    begin: torch.Tensor,
    n: torch.Tensor,
    doc_start: torch.Tensor,
    doc_end: torch.Tensor,
) -> MaskPieces:
    """The runs (batch row, first global position, length, document start and end: int64
    vectors; each run inside one document) cut at ``mask``'s segments. Raises ``ValueError``
    when a run is not covered by segments of its document (a description of other documents)."""
    row, begin, n, doc_start, doc_end = (
        t.to("cpu", torch.int64) for t in (row, begin, n, doc_start, doc_end)
    )
    run = torch.nonzero(n > 0).flatten()
    row, begin, n, doc_start, doc_end = (t[run] for t in (row, begin, n, doc_start, doc_end))
    span = mask.length + 1
    keys = mask.row * span + mask.start
    first = torch.searchsorted(keys, row * span + begin, right=True) - 1
    last = torch.searchsorted(keys, row * span + begin + n - 1, right=True) - 1
    count = last - first + 1
    ok = (first >= 0) & (count >= 1)
    if not bool(ok.all()):
        raise ValueError("a run lies outside the mask description's documents")
    at = ragged_arange(first, count)
    piece_run = torch.arange(run.numel()).repeat_interleave(count)
    prow, pbegin, pend = row[piece_run], begin[piece_run], (begin + n)[piece_run]
    start = torch.maximum(pbegin, mask.start[at])
    end = torch.minimum(pend, mask.end[at])
    same = (mask.row[at] == prow) & (mask.doc_start[at] == doc_start[piece_run])
    same &= mask.doc_end[at] == doc_end[piece_run]
    if not bool(same.all()) or int((end - start).clamp(min=0).sum()) != int(n.sum()):
        raise ValueError("a run is not covered by the mask description's segments of its document")
    lo = mask.first_key(start, at)
    hi = mask.end_key(end - 1, at)
    return MaskPieces(
        run[piece_run], prow, start, end - start, lo, hi, mask.back[at], mask.ahead[at]
    )
