"""Layout benchmark: per-rank causal-attention balance of every layout, and the time of
``ContextParallelSharder.gather_token_tensor`` against the usual un-shard.

(a) Balance (single process, pure): packed rows of random documents (exponential lengths with a
given mean, the row's tail padded); for each layout, each rank's causal-attention cost (the sum
over its tokens of the keys each attends to inside its document) and the row's max/mean over
ranks. Reported: the mean and the worst max/mean over the rows, and the planning time per row of
the data-dependent layouts.

(b) Un-shard time (W gloo ranks, spawned locally): ``gather_token_tensor(shard, trim=True)``
against the baseline that does not know the layout in closed form: all-gather every rank's
index tensor, all-gather the shards, argsort the gathered indices, index, slice. Medians over
``repeats`` (each iteration starts after a barrier), for per-token values (``[B, S]`` fp32, e.g.
log-probs) and hidden states (``[1, S, H]`` fp32).

    python benchmarks/layouts.py                 # W = 4, the default sizes
    python benchmarks/layouts.py --world 2 --json out.json

``run_layout_bench(world, ...) -> dict`` is the entry point ``cpshard bench`` calls.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpshard import balance  # noqa: E402
from cpshard.layout import CLOSED_FORM_LAYOUTS, LAYOUTS, make_layout, token_owner  # noqa: E402

__all__ = ["balance_figures", "run_layout_bench", "time_gather"]


def random_row(rng: random.Random, seq_len: int, mean: float, pad_max: int = 0) -> list[int]:
    """Document ids of one packed row: exponential document lengths (>= 1) with mean ``mean``,
    then up to ``pad_max`` padding tokens (id 0)."""
    pad = rng.randrange(pad_max + 1) if pad_max else 0
    ids, doc = [], 1
    while len(ids) < seq_len - pad:
        ids += [doc] * max(1, int(rng.expovariate(1.0 / mean)))
        doc += 1
    return ids[: seq_len - pad] + [0] * pad


def _owner(name: str, world: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(owner [1, P], padded ids [1, P], planning seconds) of one row under ``name``."""
    seq_len = ids.shape[1]
    t0 = time.perf_counter()
    lay = make_layout(name, world, seq_len, doc_ids=ids)
    if name in CLOSED_FORM_LAYOUTS:
        owner = token_owner(lay, world, lay.padded_seq_len)[None]
    else:
        owner = torch.empty(1, lay.padded_seq_len, dtype=torch.int64)
        for r in range(world):
            owner[0, lay.local_token_global_indices[r, 0]] = r
    dt = time.perf_counter() - t0
    padded = torch.cat([ids, ids.new_zeros(1, lay.padded_seq_len - seq_len)], dim=1)
    return owner, padded, dt


def balance_figures(
    world: int,
    *,
    seq_len: int = 8192,
    means: tuple[float, ...] = (64.0, 512.0, 2048.0, 8192.0),
    rows: int = 24,
    seed: int = 0,
) -> list[dict]:
    """Per (document-length mean, layout): mean / worst per-row max-over-mean causal cost."""
    rng = random.Random(seed)
    out = []
    for mean in means:
        packs = [
            torch.tensor([random_row(rng, seq_len, mean, pad_max=world - 1)]) for _ in range(rows)
        ]
        for name in LAYOUTS:
            ratios, plan_s = [], []
            for ids in packs:
                owner, padded, dt = _owner(name, world, ids)
                costs = balance.rank_costs(padded, owner, world).double()
                ratios.append(float(costs.max() / costs.mean()) if costs.sum() > 0 else 1.0)
                plan_s.append(dt)
            out.append(
                {
                    "world": world,
                    "seq_len": seq_len,
                    "mean_doc_len": mean,
                    "layout": name,
                    "mean_max_over_mean": statistics.mean(ratios),
                    "worst_max_over_mean": max(ratios),
                    "plan_ms_per_row": 1e3 * statistics.median(plan_s),
                }
            )
    return out


# ---------------------------------------------------------------------------------- timing


def _baseline_unshard(local: torch.Tensor, mine: torch.Tensor, seq_len: int, group) -> torch.Tensor:
    """The un-shard without a closed form: all-gather every rank's index tensor and the shards,
    argsort the indices, index, slice (``local`` [B, L, ...], ``mine`` [L] or [B, L])."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rows = local.shape[0]
    every = torch.empty(world * mine.numel(), dtype=mine.dtype)
    dist.all_gather_single(every, mine.view(-1), group=group)
    data = torch.empty(world * local.numel(), dtype=local.dtype)
    dist.all_gather_single(data, local.view(-1), group=group)
    data = data.view(world, *local.shape).movedim(0, 1)
    data = data.reshape(rows, world * local.shape[1], *local.shape[2:])
    every = every.view(world, *mine.shape)
    if mine.dim() == 1:
        out = data.index_select(1, torch.argsort(every.reshape(-1)))
    else:  # per-row indices: [W, B, L] -> [B, W*L]
        order = torch.argsort(every.permute(1, 0, 2).reshape(rows, -1), dim=1)
        idx = order.view(*order.shape, *([1] * (data.dim() - 2)))
        out = torch.gather(data, 1, idx.expand(rows, order.shape[1], *data.shape[2:]))
    return out[:, :seq_len]


def _time_case(rank: int, world: int, case: dict, repeats: int, warmup: int) -> dict:
    import torch.distributed as dist

    from cpshard.sharder import ContextParallelSharder

    g = dist.group.WORLD
    rows, seq_len, hidden = case["rows"], case["seq_len"], case["hidden"]
    rng = random.Random(1)
    docs = torch.tensor([random_row(rng, seq_len, case["mean_doc_len"]) for _ in range(rows)])
    sh = ContextParallelSharder(g, case["layout"])
    ids = torch.ones(rows, seq_len, dtype=torch.int64)
    sh.shard({"input_ids": ids, "_packed_seq_ids": docs})
    full = torch.randn((rows, seq_len) if hidden == 0 else (rows, seq_len, hidden))
    local = sh.shard_token_tensor(full, fill=0.0).contiguous()
    mine = sh._indices(sh.shard_layout.padded_seq_len, "cpu").contiguous()  # [L] or [B, L]
    runs = {
        "cpshard": lambda: sh.gather_token_tensor(local, trim=True),
        "baseline": lambda: _baseline_unshard(local, mine, seq_len, g),
    }
    if not (torch.equal(runs["cpshard"](), full) and torch.equal(runs["baseline"](), full)):
        raise AssertionError(f"rank {rank}: un-shard mismatch for {case}")
    times: dict[str, list[float]] = {"cpshard": [], "baseline": []}
    for i in range(warmup + repeats):  # alternate, so that drift hits both alike
        for name, fn in runs.items():
            dist.barrier(group=g)
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {**case, "world": world, "cpshard_s": times["cpshard"], "baseline_s": times["baseline"]}


def _time_worker(rank: int, world: int, cases: list[dict], repeats: int, warmup: int) -> list[dict]:
    torch.manual_seed(0)
    return [_time_case(rank, world, case, repeats, warmup) for case in cases]


def time_gather(world: int, cases: list[dict], *, repeats: int = 15, warmup: int = 3) -> list[dict]:
    """Median un-shard times (the slowest rank's per iteration) for each case at ``world``."""
    from cpshard.testing import run_ranks

    per_rank = run_ranks(_time_worker, world, cases, repeats, warmup, timeout=900)
    out = []
    for k, case in enumerate(cases):
        ours = [max(r[k]["cpshard_s"][i] for r in per_rank) for i in range(repeats)]
        base = [max(r[k]["baseline_s"][i] for r in per_rank) for i in range(repeats)]
        o, b = statistics.median(ours), statistics.median(base)
        out.append(
            {
                **case,
                "world": world,
                "cpshard_ms": 1e3 * o,
                "baseline_ms": 1e3 * b,
                "speedup": b / o,
            }
        )
    return out


DEFAULT_CASES = [
    # per-token values (log-probs, losses): one long row, and 8 rows (per-row indices for balanced)
    {"layout": "head_tail", "rows": 1, "seq_len": 131072, "hidden": 0, "mean_doc_len": 2048.0},
    {"layout": "balanced", "rows": 1, "seq_len": 131072, "hidden": 0, "mean_doc_len": 2048.0},
    {"layout": "head_tail", "rows": 8, "seq_len": 32768, "hidden": 0, "mean_doc_len": 2048.0},
    {"layout": "balanced", "rows": 8, "seq_len": 32768, "hidden": 0, "mean_doc_len": 2048.0},
    # hidden states
    {"layout": "head_tail", "rows": 1, "seq_len": 16384, "hidden": 256, "mean_doc_len": 2048.0},
    {"layout": "balanced", "rows": 1, "seq_len": 16384, "hidden": 256, "mean_doc_len": 2048.0},
]


def run_layout_bench(
    world: int = 4,
    *,
    seq_len: int = 8192,
    rows: int = 24,
    cases: list[dict] | None = None,
    repeats: int = 21,
    timing: bool = True,
) -> dict:
    """Balance figures at ``world`` (and timing figures unless ``timing=False``)."""
    t0 = time.perf_counter()
    result = {
        "machine": _machine(),
        "balance": balance_figures(world, seq_len=seq_len, rows=rows),
    }
    if timing:
        result["timing"] = time_gather(world, cases or DEFAULT_CASES, repeats=repeats)
    result["elapsed_s"] = time.perf_counter() - t0
    return result


def _machine() -> str:
    import os
    import platform

    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, gloo"


def _print(result: dict) -> None:
    print(f"# layouts benchmark ({result['machine']})")
    print("\n## per-rank causal-attention cost, max/mean over ranks (mean over rows / worst row)")
    rows = result["balance"]
    means = sorted({r["mean_doc_len"] for r in rows})
    print(
        f"{'layout':<24}"
        + "".join(f"{'doc ~' + str(int(m)):>20}" for m in means)
        + f"{'plan ms/row':>13}"
    )
    for name in LAYOUTS:
        cells = [
            next(r for r in rows if r["layout"] == name and r["mean_doc_len"] == m) for m in means
        ]
        plan = max(c["plan_ms_per_row"] for c in cells)
        print(
            f"{name:<24}"
            + "".join(
                f"{c['mean_max_over_mean']:>11.3f} / {c['worst_max_over_mean']:<6.3f}"
                for c in cells
            )
            + f"{plan:>13.2f}"
        )
    if "timing" in result:
        print("\n## gather_token_tensor(trim=True) vs index all-gather + argsort (median ms)")
        print(
            f"{'layout':<12}{'shape':>18}{'world':>7}{'cpshard':>10}{'baseline':>10}{'speedup':>9}"
        )
        for r in result["timing"]:
            shape = f"[{r['rows']}, {r['seq_len']}" + (f", {r['hidden']}]" if r["hidden"] else "]")
            print(
                f"{r['layout']:<12}{shape:>18}{r['world']:>7}{r['cpshard_ms']:>10.2f}{r['baseline_ms']:>10.2f}{r['speedup']:>8.2f}x"
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=8192, help="row length of the balance figures")
    ap.add_argument("--rows", type=int, default=24, help="random rows per document-length mean")
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    result = run_layout_bench(
        args.world,
        seq_len=args.seq_len,
        rows=args.rows,
        repeats=args.repeats,
        timing=not args.no_timing,
    )
    _print(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
