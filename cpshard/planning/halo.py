"""The halo plan of contiguous shards: how far each rank's first documents reach back before its
first token, from one pass over every rank's runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.masks import MaskDescription
from cpshard.planning.runs import LayoutRuns, mask_runs


@dataclass(frozen=True)
class HaloPlan:
    """``halos[r]``: rows before rank r's first token its runs reach back to (the most over
    batch rows; at most ``window - 1`` with a window); ``runs``: this rank's runs ``(row,
    begin, length, doc_start)`` in global positions; ``reach``: the most keys a query of the
    step attends without a window; ``firsts``: each run's first key (None: its document's
    start, or its window's), a mask description's pieces in ``runs``; ``backs``: each piece's
    sliding start (its queries see from ``max(first, p - back)``; None: no mask)."""

    halos: tuple[int, ...]
    runs: tuple[tuple[int, int, int, int], ...]
    reach: int
    firsts: tuple[int, ...] | None = None
    backs: tuple[int, ...] | None = None


def plan_halo(
    rank: int, runs: LayoutRuns, window: int | None = None, mask: MaskDescription | None = None
) -> HaloPlan:
    """Rank ``rank``'s halo plan from the step's :class:`~cpshard.planning.runs.LayoutRuns` of
    contiguous shards (causal attention within documents). Or, with ``mask`` instead of a
    ``window`` (a description of the padded batch whose pieces are all causal, sliding windows
    among them), the runs cut at its segments, each reaching back to its piece's ``lo``."""
    if mask is not None:
        if window is not None:
            raise ValueError("plan_halo takes a window or a mask description, not both")
        pieces = mask_runs(runs, mask)
        if not bool(pieces.causal.all()):
            raise ValueError("the halo serves causal pieces only: plan the needed rows")
        r, lo, firsts, backs = pieces.rank, pieces.lo, pieces.lo, pieces.back
        cols = (pieces.row, pieces.begin, pieces.n, pieces.doc_start)
        mine_rank, reach = pieces.rank, pieces.reach()
    else:
        first = runs.q == 0  # runs holding their rank's first token
        r, lo, firsts, backs = runs.rank[first], runs.doc_start[first], None, None
        cols = (runs.row, runs.begin, runs.n, runs.doc_start)
        mine_rank, reach = runs.rank, runs.reach(True)
    back = torch.zeros(runs.world, dtype=torch.int64).scatter_reduce_(
        0, r, r * runs.local_len - lo, "amax"
    )
    if window is not None:
        back = back.clamp(max=window - 1)
    k = mine_rank == rank
    mine = tuple(zip(*(t[k].tolist() for t in cols), strict=True))
    if firsts is None or backs is None:
        return HaloPlan(tuple(back.tolist()), mine, reach)
    return HaloPlan(
        tuple(back.tolist()), mine, reach, tuple(firsts[k].tolist()), tuple(backs[k].tolist())
    )
