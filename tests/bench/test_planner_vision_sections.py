"""The ``planner`` and ``vision`` sections of ``cpshard bench``: a quick end-to-end run on two
spawned ranks (JSON and rendered blocks), and unit checks of the sections' pure helpers."""

from __future__ import annotations

import random

import torch

from cpshard.bench import planner, vision
from cpshard.vision import frame_costs, plan_contiguous, rank_costs

EXACT = 1 - 1e-12


def test_quick_run_reports_both_sections(run_bench):
    proc, data = run_bench(
        *"--world 2 --ops planner,vision --quick --repeats 2 --warmup 0 --iters 1".split()
    )
    steps = len(planner.COST_SETS) + len(planner.QUALITY_WORLDS) + 1
    assert f"[{steps}/{steps}]" in proc.stderr  # the progress counter covers both sections
    assert "# planner:" in proc.stdout and "# vision:" in proc.stdout

    plan = data["planner"]
    assert plan["python_calibration_ms"] > 0
    assert [r["costs"] for r in plan["timing"]] == list(planner.COST_SETS)
    for r in plan["timing"]:
        assert (r["entries"], r["world"]) == (planner.QUICK.entries, planner.QUICK.world)
        assert len(r["optimal_ms_repeats"]) == 2
        assert 0 < r["optimal_ms_min"] <= r["optimal_ms_median"]
        assert r["optimal_cpu_ms_median"] > 0 and r["quantile_ms_median"] > 0
        assert r["quantile_over_optimal"] >= EXACT and r["optimal_over_lower_bound"] >= EXACT
    assert [r["world"] for r in plan["quality"]] == list(planner.QUALITY_WORLDS)
    for r in plan["quality"]:
        assert r["packs"] == planner.QUICK.packs
        assert EXACT <= r["quantile_over_optimal_mean"] <= r["quantile_over_optimal_max"]
        assert r["quantile_over_optimal_p95"] >= EXACT
        assert EXACT <= r["optimal_over_lower_bound_mean"] <= r["optimal_over_lower_bound_max"]

    tower = data["vision"]
    assert tower["world"] == 2
    assert tower["patch_rows"] == sum(t * h * w for t, h, w in vision.QUICK_PACK)
    assert sum(tower["local_rows_per_rank"]) == tower["patch_rows"]
    assert all(r > 0 for r in tower["local_rows_per_rank"])
    assert all(
        ran >= max(own, vision.SHARDING.min_local_patch_rows)
        for own, ran in zip(tower["local_rows_per_rank"], tower["tower_rows_per_rank"], strict=True)
    )
    for who in ("distributed", "replicated"):
        assert tower[who]["fwd_bwd_s"] > 0 and len(tower[who]["fwd_bwd_repeats_s"]) == 2
        assert tower[who]["peak_bytes"] > 0
    assert tower["speedup"] > 0


def test_random_pack_units_are_deterministic_image_and_video_frames():
    units = planner.random_pack_units(random.Random(3), 500)
    assert units == planner.random_pack_units(random.Random(3), 500)
    assert len(units) == 500 and all(isinstance(p, int) and p > 0 for p in units)
    assert max(units) <= 128 * 128 and min(units) >= 8 * 8


def test_quality_ratios():
    # one dominant entry alone on a rank: the lower bound is tight; wedged between others: not
    assert planner.lower_bound([100, 1, 1], 2) == 100
    assert planner.quality([100, 1, 1], 2)[1] == 1
    assert planner.quality([1, 1, 100, 1, 1], 2)[1] == 102 / 100
    # the quantile cut is never better than the optimum
    rng = random.Random(5)
    for _ in range(20):
        costs = frame_costs(planner.random_pack_units(rng, rng.randint(4, 60)), planner.ALPHA)
        world = rng.randint(1, 4)
        over_opt, opt_over_lb = planner.quality(costs, world)
        assert over_opt >= EXACT and opt_over_lb >= EXACT
        best = max(rank_costs(costs, plan_contiguous(costs, world)))
        assert best >= planner.lower_bound(costs, world)
    assert all(c > 0 for c in planner.cost_set(planner.COST_SETS[1], rng, 50))


def test_tower_is_frame_independent_and_plan_covers_the_pack():
    tower = vision.Tower()
    pack = vision.QUICK_PACK
    rows = sum(t * h * w for t, h, w in pack)
    pv = torch.randn(rows, vision.PATCH_DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = tower(pv, grid_thw=torch.tensor(pack))
        parts, start = [], 0
        for t, h, w in pack:  # entry by entry
            n = t * h * w
            parts.append(tower(pv[start : start + n], grid_thw=torch.tensor([[t, h, w]])))
            start += n
    for k, (_, level) in enumerate(vision._levels(full)):
        pieces = torch.cat([vision._levels(p)[k][1] for p in parts])
        torch.testing.assert_close(level, pieces, rtol=1e-5, atol=1e-5)
    assert full.pooler_output.shape[0] == rows // vision.Tower.spatial_merge_size**2
    plan = vision.frame_plan(tower, pack, 2)
    assert plan.row_bounds[0][0] == 0 and plan.row_bounds[-1][1] == rows
    assert vision.Tower().state_dict().keys() == tower.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(vision.Tower().parameters(), tower.parameters()))
