"""The order of a run: every requested gather op at every size, then the strategy sweep."""

from __future__ import annotations

from cpshard.bench.cases import GATHER_OPS, run_case
from cpshard.bench.runtime import Runtime
from cpshard.bench.strategies import run_strategies

PATTERNS = ("uneven", "even")


def run_suite(rt: Runtime) -> dict:
    cfg = rt.cfg
    sizes = sorted(cfg.sizes)
    ops = [op for op in cfg.ops if op in GATHER_OPS]
    strategies = "strategies" in cfg.ops
    rt.total_steps = len(ops) * len(sizes) + (len(PATTERNS) * len(sizes) if strategies else 0)
    elem = {"float32": 4, "float64": 8}.get(cfg.dtype, 2)
    mib = lambda tokens: tokens * cfg.hidden * elem / 2**20  # noqa: E731
    rows, strategy_rows = [], []
    for op in ops:
        for tokens in sizes:
            rt.progress(f"{op} tokens={tokens} ({mib(tokens):.1f} MiB/rank)")
            rows.append(run_case(rt, op, tokens))
    if strategies:
        for pattern in PATTERNS:
            for tokens in sizes:
                rt.progress(f"strategies {pattern} tokens={tokens} ({mib(tokens):.1f} MiB/rank)")
                strategy_rows.extend(run_strategies(rt, pattern, tokens))
    return {"ops": rows, "strategies": strategy_rows}
