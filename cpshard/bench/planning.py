"""Planning time of a step's ``shard()`` per rank at large world sizes, simulated in one process
(:mod:`cpshard.simulation`): W x S x documents (long-tailed: S/1024 of them; one document)
for every layout; per cell the median of :data:`REPEATS` plans on each of a few sampled ranks,
and the worst of those ranks.

The bench's ranks already belong to a real process group, and a simulated rank needs the fake
backend as its default group: rank 0 runs each cell in a fresh Python process while the other
ranks wait at a barrier (raise ``--timeout`` for the full grid: a cell can take minutes).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass

import torch.distributed as dist

from cpshard.bench.child import run_in_child
from cpshard.bench.runtime import Runtime
from cpshard.layouts import LAYOUTS

REPEATS = 3
STRATEGY = "auto"


@dataclass(frozen=True)
class Grid:
    worlds: tuple[int, ...]
    seq_lens: tuple[int, ...]


FULL = Grid((8, 32, 128, 256), (128 * 1024, 1024**2, 4 * 1024**2))
QUICK = Grid((8, 32), (16 * 1024,))


def docs_specs(seq_len: int) -> tuple[str, str]:
    """The two document mixes of a cell: long-tailed (S/1024 documents) and one document."""
    return f"pareto:{max(1, seq_len // 1024)}", "one"


def sampled_ranks(world: int) -> list[int]:
    """The ranks timed in a cell: the first, the middle and the last."""
    return sorted({0, world // 2, world - 1})


def measure(world: int, seq_len: int, docs: str) -> list[dict]:
    """Every layout's shard() times (ms) on :func:`sampled_ranks` for one cell (in a process
    without a default group)."""
    from cpshard.simulation import document_ids, document_lengths, plan_step, simulated_rank

    ids = document_ids(document_lengths(docs, seq_len), seq_len)
    rows = []
    for layout in LAYOUTS:
        per_rank = {}
        for rank in sampled_ranks(world):
            with simulated_rank(rank, world) as group:
                times = [plan_step(group, layout, STRATEGY, ids)[2] for _ in range(REPEATS)]
            per_rank[rank] = statistics.median(times)
        worst = max(per_rank, key=per_rank.__getitem__)
        rows.append({
            "world": world, "seq_len": seq_len, "docs": docs, "layout": layout,
            "ms_by_rank": per_rank, "worst_ms": per_rank[worst], "worst_rank": worst,
        })  # fmt: skip
    return rows


def _cells(rt: Runtime) -> list[tuple[int, int, str]]:
    grid = QUICK if rt.cfg.quick else FULL
    return [(w, s, d) for w in grid.worlds for s in grid.seq_lens for d in docs_specs(s)]


def steps(rt: Runtime) -> int:
    return len(_cells(rt))


def run(rt: Runtime) -> list[dict] | None:
    """Every cell, measured by rank 0 (the other ranks count the steps and wait)."""
    rows: list[dict] = []
    for world, seq_len, docs in _cells(rt):
        rt.progress(f"planning: W={world} S={seq_len} docs {docs}, {len(LAYOUTS)} layouts")
        if rt.rank == 0:
            rows.extend(run_in_child("cpshard.bench.planning", str(world), str(seq_len), docs))
        dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    return rows if rt.rank == 0 else None


def render(rows: list[dict]) -> str:
    out = [
        f"# planning: shard() wall ms per rank, simulated in one process (strategy {STRATEGY} for a",
        "#   Llama-3-8B layer: 32 heads, 8 KV heads, dim 128; the needed-rows tables included",
        "#   where it picks that exchange);",
        f"#   median of {REPEATS} plans per rank, worst of ranks 0, W/2, W-1",
        f"#{'world':>6} {'seq_len':>9} {'docs':>12} " + " ".join(f"{n:>22}" for n in LAYOUTS),
    ]
    cells: dict[tuple, dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["world"], r["seq_len"], r["docs"]), {})[r["layout"]] = r["worst_ms"]
    for (world, seq_len, docs), ms in cells.items():
        out.append(
            f" {world:>6} {seq_len:>9} {docs:>12} "
            + " ".join(f"{ms[n]:>22.1f}" for n in LAYOUTS)
        )
    return "\n".join(out)


if __name__ == "__main__":
    w, s, d, path = sys.argv[1:]
    result = measure(int(w), int(s), d)
    with open(path, "w") as f:
        json.dump(result, f)
