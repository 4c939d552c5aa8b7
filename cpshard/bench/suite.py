"""The order of a run: every requested gather op at every size, the strategy sweep, then the
other sections (planner, vision, layouts, blockdiag) in ``--ops`` order."""

from __future__ import annotations

from cpshard.bench.cases import run_case
from cpshard.bench.config import GATHER_OPS, SECTION_OPS
from cpshard.bench.runtime import Runtime
from cpshard.bench.sections import section
from cpshard.bench.strategies import run_strategies
from cpshard.byte_units import human_bytes

PATTERNS = ("uneven", "even")


def run_suite(rt: Runtime) -> dict:
    cfg = rt.cfg
    sizes = sorted(cfg.sizes)
    ops = [op for op in cfg.ops if op in GATHER_OPS]
    strategies = "strategies" in cfg.ops
    sections = {name: section(name) for name in cfg.ops if name in SECTION_OPS}
    rt.total_steps = (
        len(ops) * len(sizes)
        + (len(PATTERNS) * len(sizes) if strategies else 0)
        + sum(s.steps(rt) for s in sections.values())
    )
    elem = {"float32": 4, "float64": 8}.get(cfg.dtype, 2)

    def size(tokens: int) -> str:
        return f"tokens={tokens} ({human_bytes(tokens * cfg.hidden * elem)}/rank)"

    rows, strategy_rows = [], []
    if ops:
        rt.section(f"transport ({', '.join(ops)})", len(ops) * len(sizes))
    for op in ops:
        for tokens in sizes:
            rt.progress(f"{op} {size(tokens)}")
            rows.append(run_case(rt, op, tokens))
    if strategies:
        rt.section("transport strategies", len(PATTERNS) * len(sizes))
        for pattern in PATTERNS:
            for tokens in sizes:
                rt.progress(f"strategies {pattern} {size(tokens)}")
                strategy_rows.extend(run_strategies(rt, pattern, tokens))
    results = {"ops": rows, "strategies": strategy_rows}
    for name, sec in sections.items():
        rt.section(name, sec.steps(rt))
        results[name] = sec.run(rt)
    return results
