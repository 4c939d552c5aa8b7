"""``run_parity``: every case of a parity check on spawned gloo ranks, against the
single-process reference computed once per data-parallel width in this process."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.parity.batches import make_batch
from cpshard.parity.config import DEFAULT_LAYOUTS, Case, Setup
from cpshard.parity.models import build_model, vocab_size
from cpshard.parity.reference import Reference, reference
from cpshard.parity.step import run_case
from cpshard.parity.verdict import CRASHED, EXACT, CaseResult, judge
from cpshard.testing import RankPool


@dataclass
class ParityReport:
    """The results of a parity check, the setup it ran and how long it took."""

    setup: Setup
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exact(self) -> bool:
        """True when every case is exact (the command's exit code 0)."""
        return bool(self.results) and all(r.verdict == EXACT for r in self.results)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": f"{self.setup.model.kind}:{self.setup.model.value}",
            "exact": self.exact,
            "seconds": self.seconds,
            "cases": [r.as_dict() for r in self.results],
        }


def default_cases(
    worlds: tuple[int, ...] = (2, 4), layouts: tuple[str, ...] = DEFAULT_LAYOUTS
) -> list[Case]:
    """Every layout at every world size, no mesh."""
    return [Case(layout, world) for world in worlds for layout in layouts]


@contextmanager
def _pool(world: int, pools: Callable[[int], RankPool] | None) -> Iterator[RankPool]:
    """The caller's pool of ``world`` ranks, else one spawned for the block."""
    if pools is not None:
        yield pools(world)
        return
    with RankPool(world) as pool:
        yield pool


def _reference(setup: Setup, dp: int, cp: int) -> Reference:
    torch.manual_seed(setup.model.seed)
    model = build_model(setup.model)
    batches = [make_batch(setup.batch, vocab_size(model), d) for d in range(dp)]
    return reference(model, setup.model, batches, cp)


def run_parity(
    setup: Setup,
    cases: list[Case] | None = None,
    timeout: float = 300.0,
    pools: Callable[[int], RankPool] | None = None,
) -> ParityReport:
    """Run ``cases`` (default: four layouts at W = 2 and 4) of ``setup``: one CP step each on
    spawned gloo ranks (CPU, float64), each compared with the single-process model run on every
    document alone. Returns the report; :attr:`ParityReport.exact` says whether all agree.
    ``pools(world)``: running :class:`~cpshard.testing.RankPool` s to use (default: one spawned
    per world size and shut down after its cases)."""
    cases = default_cases() if cases is None else list(cases)
    if not cases:
        raise ValueError("cases: empty")
    start = time.perf_counter()
    report = ParityReport(setup)
    try:
        refs = {key: _reference(setup, *key) for key in sorted({(c.dp, c.cp) for c in cases})}
    except Exception as exc:  # noqa: BLE001 - the model fails in one process: nothing to compare
        text = f"the single-process reference raised {type(exc).__name__}: {exc}"
        report.results = [CaseResult(c.name, c.world, CRASHED, text) for c in cases]
        report.seconds = time.perf_counter() - start
        return report
    for world in sorted({c.world for c in cases}):
        with _pool(world, pools) as pool:
            for case in (c for c in cases if c.world == world):
                ref = refs[(case.dp, case.cp)]
                outcomes = pool.run_collect(run_case, setup, case, ref, timeout=timeout)
                dead = [o for o in outcomes if not o.ok]
                if dead:
                    o = dead[0]
                    text = "timed out" if o.timed_out else f"{o.error_type}: {o.error_message}"
                    report.results.append(
                        CaseResult(case.name, world, CRASHED, f"rank {o.rank}: {text}")
                    )
                    continue
                report.results.append(judge(case, [o.value for o in outcomes], setup.tol))
    report.seconds = time.perf_counter() - start
    return report
