"""The halo plan of contiguous shards: how far each rank's first documents reach back before its
first token, from one pass over every rank's runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.planning.runs import LayoutRuns


@dataclass(frozen=True)
class HaloPlan:
    """``halos[r]``: rows before rank r's first token its runs reach back to (the most over
    batch rows; at most ``window - 1`` with a window); ``runs``: this rank's runs ``(row,
    begin, length, doc_start)`` in global positions; ``reach``: the most keys a query of the
    step attends without a window."""

    halos: tuple[int, ...]
    runs: tuple[tuple[int, int, int, int], ...]
    reach: int


def plan_halo(rank: int, runs: LayoutRuns, window: int | None = None) -> HaloPlan:
    """Rank ``rank``'s halo plan from the step's :class:`~cpshard.planning.runs.LayoutRuns` of
    contiguous shards (causal attention within documents)."""
    first = runs.q == 0  # runs holding their rank's first token
    r = runs.rank[first]
    back = torch.zeros(runs.world, dtype=torch.int64).scatter_reduce_(
        0, r, r * runs.local_len - runs.doc_start[first], "amax"
    )
    if window is not None:
        back = back.clamp(max=window - 1)
    k = runs.rank == rank
    cols = (runs.row, runs.begin, runs.n, runs.doc_start)
    mine = tuple(zip(*(t[k].tolist() for t in cols), strict=True))
    return HaloPlan(tuple(back.tolist()), mine, runs.reach(True))
