"""Vision frame planner: :func:`cpshard.vision.plan_contiguous` next to the usual prefix-quantile
cut (:func:`cpshard.bench.baselines.plan_prefix_quantile`).

* Time to plan 100 000 frame units over 1 024 ranks (the goal: well under 100 ms),
  for two cost sets: an image/video mix (cost ``p * (p + alpha)`` per frame unit of ``p`` patch
  rows, ``alpha`` = 3 x a Qwen2.5-VL-sized vision width) and uniform random costs; with the
  quantile cut's largest rank cost over the optimum on the same costs.
* Plan quality over random image/video packs at several world sizes: the quantile cut's largest
  rank cost over the optimum (1.0 = optimal), and the optimum over the trivial lower bound
  ``max(total / W, largest frame)`` (how much room any planner has left).

Pure single-process work: rank 0 computes while the other ranks wait at a barrier (so that they
take no CPU from it). A pure-Python calibration figure puts the times in scale across machines.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from cpshard.bench.baselines import plan_prefix_quantile
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_calls
from cpshard.vision import frame_costs, plan_contiguous, rank_costs

ALPHA = 3 * 1280  # a Qwen2.5-VL-sized tower: auto alpha = 3 x vision width
QUALITY_WORLDS = (2, 4, 8, 16, 64)
COST_SETS = ("image/video mix", "uniform 1..1e7")
SEED = 0


@dataclass(frozen=True)
class Sizes:
    entries: int  # frame units in each timed plan
    world: int  # ranks of each timed plan
    packs: int  # random packs per world size for the quality figures


FULL, QUICK = Sizes(100_000, 1024, 200), Sizes(2_000, 64, 10)


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


def cost_set(name: str, rng: random.Random, entries: int) -> list[int]:
    """The costs of one of :data:`COST_SETS`."""
    if name == COST_SETS[0]:
        return frame_costs(random_pack_units(rng, entries), ALPHA)
    return [rng.randint(1, 10**7) for _ in range(entries)]


def lower_bound(costs: list[int], world: int) -> float:
    """No contiguous plan's largest rank cost is below ``max(total / world, largest cost)``."""
    return max(sum(costs) / world, max(costs))


def quality(costs: list[int], world: int) -> tuple[float, float]:
    """(quantile cut's largest rank cost / the optimum's, the optimum's / :func:`lower_bound`)."""
    best = max(rank_costs(costs, plan_contiguous(costs, world)))
    quantile = max(rank_costs(costs, plan_prefix_quantile(costs, world)))
    return quantile / best, best / lower_bound(costs, world)


def clock_ms(
    fn: Callable[[], object], warmup: int, repeats: int
) -> tuple[list[float], list[float]]:
    """Wall and CPU milliseconds of each of ``repeats`` calls of ``fn``, after ``warmup`` calls."""
    calls = time_calls(fn, repeats, warmup)
    return [t * 1e3 for t in calls.wall_s], [t * 1e3 for t in calls.cpu_s]


def python_calibration_ms() -> float:
    """Wall time of a fixed pure-Python workload (``sum(range(10**6))``, best of 5): scales the
    planner's times between machines (and shows how busy this one was)."""
    return min(clock_ms(lambda: sum(range(10**6)), 0, 5)[0])


def timing_row(name: str, costs: list[int], world: int, warmup: int, repeats: int) -> dict:
    """Planning time of both planners on ``costs`` and the quantile cut's quality there."""
    opt_wall, opt_cpu = clock_ms(lambda: plan_contiguous(costs, world), warmup, repeats)
    quant_wall, _ = clock_ms(lambda: plan_prefix_quantile(costs, world), warmup, repeats)
    over_opt, opt_over_lb = quality(costs, world)
    return {
        "costs": name,
        "entries": len(costs),
        "world": world,
        "repeats": repeats,
        "optimal_ms_median": statistics.median(opt_wall),
        "optimal_ms_min": min(opt_wall),
        "optimal_cpu_ms_median": statistics.median(opt_cpu),
        "optimal_ms_repeats": opt_wall,
        "quantile_ms_median": statistics.median(quant_wall),
        "quantile_over_optimal": over_opt,
        "optimal_over_lower_bound": opt_over_lb,
    }


def quality_row(rng: random.Random, world: int, packs: int) -> dict:
    """Plan quality over ``packs`` random image/video packs of ``world`` .. ``12 * world`` units."""
    ratios, tight = [], []
    for _ in range(packs):
        costs = frame_costs(random_pack_units(rng, rng.randint(world, 12 * world)), ALPHA)
        over_opt, opt_over_lb = quality(costs, world)
        ratios.append(over_opt)
        tight.append(opt_over_lb)
    ratios.sort()
    return {
        "world": world,
        "packs": packs,
        "quantile_over_optimal_mean": statistics.fmean(ratios),
        "quantile_over_optimal_p95": ratios[int(0.95 * (len(ratios) - 1))],
        "quantile_over_optimal_max": ratios[-1],
        "optimal_over_lower_bound_mean": statistics.fmean(tight),
        "optimal_over_lower_bound_max": max(tight),
    }


def steps(rt: Runtime) -> int:
    return len(COST_SETS) + len(QUALITY_WORLDS)


def run(rt: Runtime) -> dict | None:
    """Every figure, computed on rank 0 (the other ranks count the steps and wait)."""
    size = QUICK if rt.cfg.quick else FULL
    lead = rt.rank == 0
    rng = random.Random(SEED)
    timing, packs = [], []
    for name in COST_SETS:
        rt.progress(f"planner: {size.entries} {name} costs over {size.world} ranks")
        if lead:
            costs = cost_set(name, rng, size.entries)
            timing.append(timing_row(name, costs, size.world, rt.cfg.warmup, rt.cfg.repeats))
    for world in QUALITY_WORLDS:
        rt.progress(f"planner: plan quality over {size.packs} packs at W={world}")
        if lead:
            packs.append(quality_row(rng, world, size.packs))
    result = None
    if lead:
        calibration = python_calibration_ms()
        result = {
            "alpha": ALPHA,
            "python_calibration_ms": calibration,
            "timing": timing,
            "quality": packs,
        }
    dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    return result


def render(result: dict) -> str:
    out = [
        "# planner: optimal contiguous plan (plan_contiguous) vs the usual prefix-quantile",
        f"#   cut (plan_prefix_quantile); frame-unit cost p*(p+{result['alpha']}); one process;",
        "#   time = median wall ms over repeats (min, CPU ms); quant/opt = the quantile cut's",
        "#   largest rank cost over the optimum's; python calibration: sum(range(10**6)) takes",
        f"#   {result['python_calibration_ms']:.1f} ms here",
        f"#{'costs':<17} {'entries':>8} {'world':>6} {'optimal ms':>11} {'(min)':>7} {'(cpu)':>7} "
        f"{'quantile ms':>12} {'quant/opt':>10}",
    ]
    for r in result["timing"]:
        out.append(
            f" {r['costs']:<17} {r['entries']:>8} {r['world']:>6} {r['optimal_ms_median']:>11.1f} "
            f"{r['optimal_ms_min']:>7.1f} {r['optimal_cpu_ms_median']:>7.1f} "
            f"{r['quantile_ms_median']:>12.1f} {r['quantile_over_optimal']:>10.3f}"
        )
    out += [
        "#   plan quality over random image/video packs (W .. 12W frame units each): quant/opt,",
        "#   and the optimum over the lower bound max(total/W, largest unit)",
        f"#{'world':>6} {'packs':>6} {'quant/opt mean':>15} {'p95':>7} {'max':>7} "
        f"{'opt/bound mean':>15} {'max':>7}",
    ]
    for r in result["quality"]:
        out.append(
            f" {r['world']:>6} {r['packs']:>6} {r['quantile_over_optimal_mean']:>15.3f} "
            f"{r['quantile_over_optimal_p95']:>7.3f} {r['quantile_over_optimal_max']:>7.3f} "
            f"{r['optimal_over_lower_bound_mean']:>15.3f} {r['optimal_over_lower_bound_max']:>7.3f}"
        )
    return "\n".join(out)
