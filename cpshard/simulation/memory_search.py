"""``cpshard plan --memory --max-seq-len``: the largest sequence whose predicted step fits a
device, found by bisection over the predictions (:class:`~cpshard.simulation.step_memory.
Predictor`): doubling from a start until a step does not fit, then halving the gap down to a
granularity."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cpshard.simulation.documents import document_ids, document_lengths
from cpshard.simulation.step_memory import Predictor, RankMemory


@dataclass(frozen=True)
class Search:
    """The result: the largest fitting S (None: not even the smallest tried), its worst rank's
    peak, and every S tried with its worst peak."""

    seq_len: int | None
    peak_bytes: int | None
    tried: dict[int, int]


def largest_fitting(
    predictor: Predictor,
    world: int,
    ranks: list[int],
    layout: str,
    strategy: str,
    docs: str,
    budget: int,
    granularity: int,
    limit: int,
    mesh: tuple[int, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
    jobs: int = 1,
) -> Search:
    """The largest S, a multiple of ``granularity`` up to ``limit``, whose worst rank among
    ``ranks`` is predicted to fit ``budget`` bytes with documents ``docs`` (a ``--docs``
    spec: ``pareto:N`` keeps N documents at every S). ``progress(S, worst peak)`` per try;
    ``jobs``: ranks traced in that many processes at once."""
    if granularity < 1 or limit < granularity:
        raise ValueError(f"--max-seq-len: needs a limit >= {granularity}, got {limit}")
    limit = limit // granularity * granularity
    tried: dict[int, int] = {}

    def peak(seq: int) -> int:
        if seq not in tried:
            ids = document_ids(document_lengths(docs, seq), seq)
            found: list[RankMemory] = predictor.ranks(
                world, ranks, layout, strategy, ids, mesh, jobs=jobs
            )
            tried[seq] = max(m.peak_bytes for m in found)
            if progress is not None:
                progress(seq, tried[seq])
        return tried[seq]

    low, high = 0, granularity  # low fits (0: nothing yet), high is the next to try
    while high <= limit and peak(high) <= budget:
        low, high = high, min(2 * high, limit) if high < limit else limit + granularity
    high = min(high, limit + granularity)
    while high - low > granularity:
        mid = (low + high) // 2 // granularity * granularity
        if peak(mid) <= budget:
            low = mid
        else:
            high = mid
    return Search(low or None, tried.get(low), dict(sorted(tried.items())))
