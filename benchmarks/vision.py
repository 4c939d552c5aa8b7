"""Vision frame sharding: the optimal planner, and the distributed vision tower against the
replicated one.

* ``run_planner_bench()``: the time to plan 100 000 frame units over 1 024 ranks (optimal
  :func:`cpshard.vision.plan_contiguous` next to the seed's prefix-quantile cut), and the plan
  quality over random image/video packs: the largest rank cost of the quantile cut relative to
  the optimum (1.0 = optimal), and the optimum relative to the trivial lower bound
  ``max(total / W, largest frame)``.
* ``run_tower_bench(world)``: one fwd+bwd of a small frame-independent ViT on a pack of images
  and videos, replicated on every rank (what a CP recipe does without frame sharding) against
  ``maybe_distribute_visual`` (each rank runs its frames, one fused ragged gather), on gloo.

    python benchmarks/vision.py                     # planner + tower at W = 2 and 4
    python benchmarks/vision.py --worlds 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cpshard.vision import (  # noqa: E402
    CpVisionFrameShardingConfig,
    cp_vision_group,
    frame_costs,
    maybe_distribute_visual,
    plan_contiguous,
    plan_prefix_quantile,
    plan_vision_frames,
    rank_costs,
)

ALPHA = 3 * 1280  # a Qwen2.5-VL-sized tower: auto alpha = 3 x vision width


# --------------------------------------------------------------------------- planner


def random_pack_units(rng: random.Random, units: int) -> list[int]:
    """Patch rows of ``units`` frame units from a random mix of images (one large frame each,
    16x16 .. 128x128 patches) and videos (4 .. 256 frames of 8x8 .. 32x32 patches)."""
    rows: list[int] = []
    while len(rows) < units:
        if rng.random() < 0.35:
            side = rng.choice([16, 24, 32, 48, 64, 96, 128])
            rows.append(side * rng.choice([side // 2, side]) if side > 16 else side * side)
        else:
            side = rng.choice([8, 12, 16, 24, 32])
            rows.extend([side * side] * rng.randint(4, 256))
    return rows[:units]


def _time_ms(fn, repeats: int, clock=time.perf_counter) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        out.append((clock() - t0) * 1e3)
    return out


def python_calibration_ms() -> float:
    """Wall time of a fixed pure-Python workload (``sum(range(10**6))``, best of 5): scales the
    planner's figures between machines (and shows how busy this one was)."""
    return min(_time_ms(lambda: sum(range(10**6)), 5))


def run_planner_bench(entries: int = 100_000, world: int = 1024, repeats: int = 7, trials: int = 200,
                      seed: int = 0) -> dict:
    rng = random.Random(seed)
    timing = []
    for name, costs in [
        ("image/video mix", frame_costs(random_pack_units(rng, entries), ALPHA)),
        ("uniform 1..1e7", [rng.randint(1, 10**7) for _ in range(entries)]),
    ]:
        opt = _time_ms(lambda c=costs: plan_contiguous(c, world), repeats)
        opt_cpu = _time_ms(lambda c=costs: plan_contiguous(c, world), repeats, time.process_time)
        quant = _time_ms(lambda c=costs: plan_prefix_quantile(c, world), repeats)
        o, q = plan_contiguous(costs, world), plan_prefix_quantile(costs, world)
        timing.append({
            "costs": name, "entries": entries, "world": world,
            "optimal_ms_median": statistics.median(opt), "optimal_ms_min": min(opt),
            "optimal_cpu_ms_median": statistics.median(opt_cpu),
            "quantile_ms_median": statistics.median(quant),
            "quantile_over_optimal": max(rank_costs(costs, q)) / max(rank_costs(costs, o)),
        })
    quality = []
    for w in (2, 4, 8, 16, 64):
        ratios, tight = [], []
        for _ in range(trials):
            units = rng.randint(w, 12 * w)
            costs = frame_costs(random_pack_units(rng, units), ALPHA)
            best = max(rank_costs(costs, plan_contiguous(costs, w)))
            ratios.append(max(rank_costs(costs, plan_prefix_quantile(costs, w))) / best)
            tight.append(best / max(sum(costs) / w, max(costs)))
        ratios.sort()
        quality.append({
            "world": w, "packs": trials,
            "quantile_over_optimal_mean": statistics.fmean(ratios),
            "quantile_over_optimal_p95": ratios[int(0.95 * (len(ratios) - 1))],
            "quantile_over_optimal_max": ratios[-1],
            "optimal_over_lower_bound_mean": statistics.fmean(tight),
        })
    return {"timing": timing, "quality": quality, "python_calibration_ms": python_calibration_ms()}


# --------------------------------------------------------------------------- tower


class BenchBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, frame_rows: list[int]) -> torch.Tensor:
        dim = x.shape[1]
        qkv = self.qkv(self.norm1(x))
        outs = []
        for frame in qkv.split(frame_rows):  # attention within each frame
            n = frame.shape[0]
            q, k, v = frame.view(n, 3, self.heads, dim // self.heads).permute(1, 2, 0, 3)
            outs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, dim))
        x = x + self.proj(torch.cat(outs))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class BenchTower(nn.Module):
    """A small Qwen-VL-like tower: patch embedding, spatial position tables, per-frame
    attention, a 2x2 merger, two deepstack taps."""

    def __init__(self, patch_dim: int = 192, hidden: int = 64, out_hidden: int = 128, heads: int = 2,
                 depth: int = 3, max_side: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.spatial_merge_size = 2
        self.config = type("Cfg", (), {"hidden_size": hidden})()
        self.embed = nn.Linear(patch_dim, hidden)
        self.pos_h = nn.Parameter(0.02 * torch.randn(max_side, hidden))
        self.pos_w = nn.Parameter(0.02 * torch.randn(max_side, hidden))
        self.blocks = nn.ModuleList(BenchBlock(hidden, heads) for _ in range(depth))
        self.merger = nn.Linear(4 * hidden, out_hidden)
        self.taps = (1, 2)
        self.deepstack = nn.ModuleList(nn.Linear(4 * hidden, out_hidden) for _ in self.taps)

    def forward(self, pixel_values, grid_thw, return_dict=True):
        grid = grid_thw.tolist()
        ys, xs = [], []
        for t, h, w in grid:
            y = (torch.arange(h // 2).view(-1, 1, 1, 1) * 2 + torch.arange(2).view(1, 1, -1, 1)).expand(h // 2, w // 2, 2, 2)
            x = (torch.arange(w // 2).view(1, -1, 1, 1) * 2 + torch.arange(2).view(1, 1, 1, -1)).expand(h // 2, w // 2, 2, 2)
            ys.append(y.reshape(-1).repeat(t))
            xs.append(x.reshape(-1).repeat(t))
        x = self.embed(pixel_values) + self.pos_h[torch.cat(ys)] + self.pos_w[torch.cat(xs)]
        frame_rows = [h * w for t, h, w in grid for _ in range(t)]
        deep = []
        for k, block in enumerate(self.blocks):
            x = block(x, frame_rows)
            if k in self.taps:
                deep.append(self.deepstack[self.taps.index(k)](x.reshape(-1, 4 * x.shape[1])))
        return _Out(x, self.merger(x.reshape(-1, 4 * x.shape[1])), deep)


class _Out:
    def __init__(self, last_hidden_state, pooler_output, deepstack_features):
        self.last_hidden_state = last_hidden_state
        self.pooler_output = pooler_output
        self.deepstack_features = deepstack_features


BENCH_PACK = [[1, 24, 24], [4, 12, 12], [1, 16, 24], [8, 8, 8], [1, 20, 20], [3, 16, 12]]


def _tower_worker(rank: int, world: int, repeats: int) -> dict:
    import torch.distributed as dist

    tower = BenchTower()
    grid_thw = torch.tensor(BENCH_PACK)
    rows = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
    pv = torch.randn(rows, 192, generator=torch.Generator().manual_seed(1))
    cfg = CpVisionFrameShardingConfig(enabled=True, min_tokens=0, min_frames=0)

    def step(distributed: bool):
        tower.zero_grad(set_to_none=True)
        if distributed:
            with cp_vision_group(dist.group.WORLD, config=cfg):
                out = maybe_distribute_visual(tower, pv, grid_thw)
        else:
            out = tower(pv, grid_thw=grid_thw, return_dict=True)
        loss = out.pooler_output.square().mean() + sum(d.square().mean() for d in out.deepstack_features)
        loss.backward()

    result = {}
    for name, distributed in (("replicated", False), ("distributed", True)):
        times = []
        step(distributed)
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            step(distributed)
            dist.barrier()  # the slowest rank sets the step time
            times.append((time.perf_counter() - t0) * 1e3)
        result[name] = times
    plan = plan_vision_frames(BENCH_PACK, world, spatial_merge_size=2, cost_alpha=3 * 64,
                              min_local_patch_rows=cfg.min_local_patch_rows)
    p0, p1 = plan.row_bounds[rank]
    result["local_rows"] = p1 - p0
    result["rows"] = rows
    return result


def run_tower_bench(world: int, repeats: int = 5) -> dict:
    from cpshard.testing import RankPool

    with RankPool(world, pg_timeout=300) as pool:
        per_rank = pool.run(_tower_worker, repeats, timeout=1800)
    rep = statistics.median(per_rank[0]["replicated"])
    dst = statistics.median(per_rank[0]["distributed"])
    return {
        "world": world,
        "patch_rows": per_rank[0]["rows"],
        "local_rows_per_rank": [r["local_rows"] for r in per_rank],
        "replicated_ms_median": rep,
        "distributed_ms_median": dst,
        "speedup": rep / dst,
    }


# --------------------------------------------------------------------------- main


def _machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"load average {load:.1f}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="*", default=[2, 4], help="tower bench world sizes (none: skip)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"# machine: {_machine()}")
    planner = run_planner_bench()
    print("\n## planner: time to plan (ms), and the quantile cut's largest rank cost over the optimum")
    print(f"# python calibration: sum(range(10**6)) takes {planner['python_calibration_ms']:.1f} ms here")
    print(f"{'costs':<18} {'entries':>8} {'world':>6} {'optimal ms':>11} {'(min)':>7} {'(cpu)':>7} "
          f"{'quantile ms':>12} {'quant/opt':>10}")
    for r in planner["timing"]:
        print(f"{r['costs']:<18} {r['entries']:>8} {r['world']:>6} {r['optimal_ms_median']:>11.1f} "
              f"{r['optimal_ms_min']:>7.1f} {r['optimal_cpu_ms_median']:>7.1f} {r['quantile_ms_median']:>12.1f} "
              f"{r['quantile_over_optimal']:>10.3f}")
    print("\n## plan quality over random image/video packs (cost p*(p+3*1280) per frame unit)")
    print(f"{'world':>6} {'packs':>6} {'quant/opt mean':>15} {'p95':>7} {'max':>7} {'opt/lower bound':>16}")
    for r in planner["quality"]:
        print(f"{r['world']:>6} {r['packs']:>6} {r['quantile_over_optimal_mean']:>15.3f} "
              f"{r['quantile_over_optimal_p95']:>7.3f} {r['quantile_over_optimal_max']:>7.3f} "
              f"{r['optimal_over_lower_bound_mean']:>16.3f}")
    towers = []
    if args.worlds:
        print("\n## vision tower fwd+bwd on gloo: replicated on every rank vs maybe_distribute_visual")
        print(f"{'world':>6} {'rows':>6} {'local rows per rank':>28} {'replicated ms':>14} {'distributed ms':>15} {'speedup':>8}")
        for w in args.worlds:
            r = run_tower_bench(w, args.repeats)
            towers.append(r)
            print(f"{w:>6} {r['patch_rows']:>6} {str(r['local_rows_per_rank']):>28} {r['replicated_ms_median']:>14.1f} "
                  f"{r['distributed_ms_median']:>15.1f} {r['speedup']:>8.2f}")
    result = {"machine": _machine(), "planner": planner, "tower": towers}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
