"""Single-process tests of vision frame sharding's pure parts (``cpshard.vision``): the config, the
optimal contiguous planner (against brute force and an independent DP), the cost model, the
frame plan and the group-scope API.

The planner's optimality is checked by hypothesis against an exhaustive enumeration of every
contiguous partition (small instances) and an O(n^2 W) dynamic program (medium ones); its
tie-break is checked against a brute-force restatement of the documented rule.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import FrozenInstanceError
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from cpshard.bench.baselines import plan_prefix_quantile
from cpshard.vision import (
    CpVisionFrameShardingConfig,
    cp_vision_frame_sharding_active,
    cp_vision_group,
    current_cp_vision_scope,
    frame_costs,
    plan_contiguous,
    plan_vision_frames,
    rank_costs,
    reset_cp_vision_group,
    resolve_cost_alpha,
    set_cp_vision_group,
    spatial_merge_size,
    vision_hidden_size,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- references


def all_partitions(n: int, world: int):
    """Every contiguous partition of n entries over world ranks, each rank >= 1 entry."""
    for inner in itertools.combinations(range(1, n), world - 1):
        yield [0, *inner, n]


def bottleneck(costs, cuts) -> Fraction:
    return max(sum((Fraction(c) for c in costs[a:b]), Fraction(0)) for a, b in itertools.pairwise(cuts))


def brute_optimum(costs, world) -> Fraction:
    return min(bottleneck(costs, cuts) for cuts in all_partitions(len(costs), world))


def dp_optimum(costs, world) -> int:
    """min over partitions of the max rank cost by dynamic programming, O(n^2 W)."""
    n = len(costs)
    prefix = list(itertools.accumulate(costs, initial=0))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(world + 1)]  # best[r][j]: first j entries on r ranks
    best[0][0] = 0
    for r in range(1, world + 1):
        for j in range(r, n + 1):
            best[r][j] = min(max(best[r - 1][i], prefix[j] - prefix[i]) for i in range(r - 1, j))
    return best[world][n]


def rule_choice(costs, world) -> list[int]:
    """The documented tie-break, restated by brute force: among the optimal partitions, fix cuts
    in rank order, each the available value whose prefix cost is nearest total*r/world (ties
    to the smaller index)."""
    opt = brute_optimum(costs, world)
    pool = [c for c in all_partitions(len(costs), world) if bottleneck(costs, c) == opt]
    prefix = list(itertools.accumulate((Fraction(c) for c in costs), initial=Fraction(0)))
    total = prefix[-1]
    for r in range(1, world):
        target = total * r / world
        x = min({c[r] for c in pool}, key=lambda v: (abs(prefix[v] - target), v))
        pool = [c for c in pool if c[r] == x]
    assert len(pool) == 1
    return pool[0]


def check_valid(cuts, n, world):
    assert cuts is not None and len(cuts) == world + 1
    assert cuts[0] == 0 and cuts[-1] == n
    assert all(a < b for a, b in itertools.pairwise(cuts)), cuts


small_costs = st.lists(
    st.one_of(st.integers(1, 5), st.integers(1, 10**6), st.sampled_from([1, 4, 16, 64, 1024])), min_size=1, max_size=9
)

# --------------------------------------------------------------------------- planner


@SETTINGS
@given(costs=small_costs, world=st.integers(1, 6))
@example(costs=[1, 1, 1, 1], world=2)
@example(costs=[5, 1, 1, 1, 1, 1], world=3)
@example(costs=[1, 2, 3], world=3)
@example(costs=[7], world=2)
def test_planner_is_optimal_and_follows_the_tie_break(costs, world):
    cuts = plan_contiguous(costs, world)
    if len(costs) < world:
        assert cuts is None
        return
    check_valid(cuts, len(costs), world)
    assert bottleneck(costs, cuts) == brute_optimum(costs, world)
    assert cuts == rule_choice(costs, world)
    assert plan_contiguous(list(costs), world) == cuts  # deterministic
    assert plan_contiguous(torch.tensor(costs), world) == cuts  # tensor input, same plan


@SETTINGS
@given(
    costs=st.lists(st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False), min_size=1, max_size=8),
    world=st.integers(1, 5),
)
def test_planner_is_exactly_optimal_for_float_costs(costs, world):
    cuts = plan_contiguous(costs, world)
    if len(costs) < world:
        assert cuts is None
        return
    check_valid(cuts, len(costs), world)
    assert bottleneck(costs, cuts) == brute_optimum(costs, world)  # exact rational arithmetic


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 10**4), min_size=1, max_size=60),
    world=st.integers(1, 12),
)
def test_planner_matches_dp_on_medium_instances(costs, world):
    cuts = plan_contiguous(costs, world)
    if len(costs) < world:
        assert cuts is None
        return
    check_valid(cuts, len(costs), world)
    assert max(rank_costs(costs, cuts)) == dp_optimum(costs, world)


def test_planner_large_instance_matches_dp_and_beats_quantile():
    gen = torch.Generator().manual_seed(7)
    side = torch.randint(2, 40, (400,), generator=gen)
    costs = frame_costs((side * side).tolist(), 3 * 64)
    world = 16
    cuts = plan_contiguous(costs, world)
    check_valid(cuts, len(costs), world)
    assert max(rank_costs(costs, cuts)) == dp_optimum(costs, world)
    assert max(rank_costs(costs, cuts)) <= max(rank_costs(costs, plan_prefix_quantile(costs, world)))


@pytest.mark.parametrize("world, reps", [(2, 1), (4, 2), (8, 4)])
def test_prefix_quantile_is_nearly_twice_as_bad_where_the_planner_is_optimal(world, reps):
    # each quantile cut lands before a heavy entry that crosses its target, stranding it with
    # the next one; the optimum pairs the heavy entry with the light one before it
    costs = [1, 101, 99] * reps
    q, o = plan_prefix_quantile(costs, world), plan_contiguous(costs, world)
    check_valid(q, len(costs), world)
    assert max(rank_costs(costs, q)) == 200
    assert max(rank_costs(costs, o)) == 102 == dp_optimum(costs, world)


def test_planner_degenerate_cases():
    assert plan_contiguous([], 1) is None
    assert plan_contiguous([3], 1) == [0, 1]
    assert plan_contiguous([3, 4], 3) is None
    assert plan_contiguous([3, 4, 5], 3) == [0, 1, 2, 3]
    assert plan_contiguous([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert plan_contiguous([2**70, 1, 2**70], 2) in ([0, 1, 3], [0, 2, 3])  # big ints stay exact
    assert plan_contiguous((c for c in [1, 2, 3, 4]), 2) == [0, 3, 4]  # any iterable


@pytest.mark.parametrize(
    "costs, world, exc, match",
    [
        ([1, 0, 2], 2, ValueError, r"costs\[1\] = 0"),
        ([1, -3], 1, ValueError, r"costs\[1\] = -3"),
        ([1.0, float("nan")], 1, ValueError, r"costs\[1\] = nan is not finite"),
        ([1.0, float("inf")], 1, ValueError, "not finite"),
        ([1, True], 1, TypeError, r"costs\[1\] must be a real number"),
        ([1, "2"], 1, TypeError, r"costs\[1\]"),
        ("123", 1, TypeError, "costs must be a sequence"),
        (5, 1, TypeError, "costs must be a sequence"),
        (torch.ones(2, 2), 1, ValueError, "costs must be 1-D"),
        (torch.ones(3, dtype=torch.bool), 1, TypeError, "costs must be real"),
        ([1, 2], 0, ValueError, "world must be >= 1"),
        ([1, 2], 1.5, TypeError, "world must be an int"),
        ([1, 2], True, TypeError, "world must be an int"),
    ],
)
def test_planner_rejects_bad_input(costs, world, exc, match):
    with pytest.raises(exc, match=match):
        plan_contiguous(costs, world)


# --------------------------------------------------------------------------- cost model


def test_frame_costs():
    assert frame_costs([4, 16], 0) == [16, 256]
    assert frame_costs([4, 16], 3) == [28, 304]
    with pytest.raises(ValueError, match="alpha"):
        frame_costs([4], -1)
    with pytest.raises(ValueError, match=r"patch_rows\[1\]"):
        frame_costs([4, 0], 0)


def test_vision_hidden_size_discovery():
    ns = SimpleNamespace
    # Qwen: the tower's own config.hidden_size (the tower is the root)
    qwen_tower = torch.nn.Module()
    qwen_tower.config = ns(hidden_size=1280, out_hidden_size=3584)
    assert vision_hidden_size(qwen_tower) == 1280
    # a whole VLM: the nested visual tower wins over the root (text) hidden_size
    vlm = torch.nn.Module()
    vlm.visual = qwen_tower
    vlm.config = ns(hidden_size=4096)
    assert vision_hidden_size(vlm) == 1280
    # nested vision_config before root hidden_size, also through .config and in mappings
    assert vision_hidden_size(ns(config=ns(hidden_size=4096, vision_config=ns(hidden_size=1152)))) == 1152
    assert vision_hidden_size({"hidden_size": 4096, "vision_config": {"hidden_size": 1024}}) == 1024
    # Nemotron Omni / RADIO fields
    assert vision_hidden_size(ns(config=ns(hidden_size=5120, vit_hidden_size=1280))) == 1280
    assert vision_hidden_size(ns(hidden_size=4096, radio_model=ns(embed_dim=1536))) == 1536
    # wrappers (DDP .module, torch.compile ._orig_mod)
    assert vision_hidden_size(ns(module=ns(_orig_mod=ns(vision_tower=ns(hidden_size=768))))) == 768
    # only a root width: used as the last resort
    assert vision_hidden_size(ns(hidden_size=640)) == 640
    assert vision_hidden_size(ns(config=ns(d_model=512))) == 512
    # nothing, bools, non-positive, cycles
    assert vision_hidden_size(ns(foo=1)) is None
    assert vision_hidden_size(None) is None
    assert vision_hidden_size(ns(vit_hidden_size=True, hidden_size=0)) is None
    cyc = ns(hidden_size=None)
    cyc.config = cyc
    cyc.model = ns(config=cyc)
    assert vision_hidden_size(cyc) is None


def test_resolve_cost_alpha():
    tower = SimpleNamespace(config=SimpleNamespace(hidden_size=1280))
    assert resolve_cost_alpha("auto", tower) == 3 * 1280
    assert resolve_cost_alpha(None, tower) == 3 * 1280
    assert resolve_cost_alpha("auto", SimpleNamespace()) == 0
    assert resolve_cost_alpha("auto") == 0
    assert resolve_cost_alpha(0, tower) == 0
    assert resolve_cost_alpha(17, tower) == 17
    with pytest.raises(ValueError, match="cost_alpha"):
        resolve_cost_alpha(-1)
    with pytest.raises(TypeError, match="cost_alpha"):
        resolve_cost_alpha("fast")
    with pytest.raises(TypeError, match="cost_alpha"):
        resolve_cost_alpha(True)


def test_spatial_merge_size_lookup():
    ns = SimpleNamespace
    assert spatial_merge_size(ns(spatial_merge_size=2)) == 2
    assert spatial_merge_size(ns(config=ns(spatial_merge_size=4))) == 4
    assert spatial_merge_size(ns(module=ns(config={"spatial_merge_size": 3}))) == 3
    assert spatial_merge_size(ns()) is None
    assert spatial_merge_size(ns(spatial_merge_size=0)) is None


# --------------------------------------------------------------------------- frame plan


def test_frame_plan_images_and_videos():
    grid = [[1, 4, 4], [3, 2, 4], [1, 2, 2], [2, 4, 2]]  # 16, 3x8, 4, 2x8 rows
    plan = plan_vision_frames(grid, 3, spatial_merge_size=2, cost_alpha=0)
    assert plan.unit_rows == (16, 8, 8, 8, 4, 8, 8)
    assert plan.unit_entry == (0, 1, 1, 1, 2, 3, 3)
    cuts = plan_contiguous(frame_costs(plan.unit_rows, 0), 3)
    assert list(plan.cuts) == cuts
    assert sum(plan.token_counts) == 60 // 4
    assert plan.row_bounds[0][0] == 0 and plan.row_bounds[-1][1] == 60
    assert all(a[1] == b[0] for a, b in itertools.pairwise(plan.row_bounds))
    assert all(p is None for p in plan.pad_frames)
    # consecutive frames of one entry coalesce into one grid row, per rank
    rows = [plan.local_grid(r) for r in range(3)]
    flat = [(t, h, w) for rr in rows for t, h, w in rr]
    assert sum(t * h * w for t, h, w in flat) == 60
    for r in range(3):
        entries = plan.unit_entry[plan.cuts[r] : plan.cuts[r + 1]]
        assert len(plan.local_grid(r)) == len(set(entries))


def test_frame_plan_dummy_frames_and_floor():
    # 2 frames, 4 ranks: ranks 2 and 3 run one minimal dummy frame, no real tokens
    plan = plan_vision_frames([[2, 4, 4]], 4, spatial_merge_size=2)
    assert plan.cuts == (0, 1, 2, 2, 2)
    assert plan.token_counts == (4, 4, 0, 0)
    assert plan.pad_frames == (None, None, (2, 2), (2, 2))
    assert plan.dummy_ranks == 2
    assert plan.local_grid(0) == [[1, 4, 4]] and plan.local_grid(3) == [[1, 2, 2]]
    assert plan.local_tokens(3) == 1 and plan.local_tokens(0) == 4
    # a floor of 40 rows: every rank below it appends a near-square zero frame to reach it
    plan = plan_vision_frames([[2, 4, 4]], 4, spatial_merge_size=2, min_local_patch_rows=40)
    for r in range(4):
        real = plan.row_bounds[r][1] - plan.row_bounds[r][0]
        assert real + plan.pad_rows(r) >= 40
        assert plan.pad_rows(r) - max(0, 40 - real) < 4 * 3  # near-minimal: < one column of tokens
        h, w = plan.pad_frames[r]
        assert h % 2 == 0 and w % 2 == 0
        assert plan.local_grid(r)[-1] == [1, h, w]
    assert plan.token_counts == (4, 4, 0, 0)  # the pad never changes the real token counts
    # a floor below every rank's rows changes nothing
    plan = plan_vision_frames([[4, 4, 4]], 2, spatial_merge_size=2, min_local_patch_rows=32)
    assert plan.pad_frames == (None, None)


@pytest.mark.parametrize(
    "grid, match",
    [
        ([[1, 3, 4]], "multiples of the tower's spatial_merge_size 2"),
        ([[0, 4, 4]], "must be >= 1"),
        ([[1, 4]], "expected"),
        ([], "no frames"),
    ],
)
def test_frame_plan_rejects_bad_grids(grid, match):
    with pytest.raises(ValueError, match=match):
        plan_vision_frames(grid, 2, spatial_merge_size=2)


# --------------------------------------------------------------------------- config


def test_config_defaults_and_normalisation():
    cfg = CpVisionFrameShardingConfig()
    assert (cfg.enabled, cfg.min_tokens, cfg.min_frames, cfg.min_local_patch_rows, cfg.cost_alpha, cfg.mesh_dims) == (
        False, 2048, 32, 96, "auto", ("cp",)
    )
    assert CpVisionFrameShardingConfig(mesh_dims=["cp", "tp"]).mesh_dims == ("cp", "tp")
    # NeMo Automodel's field order: enabled, mesh_dims, min_tokens, min_frames,
    # min_local_patch_rows, cost_alpha
    positional = CpVisionFrameShardingConfig(True, ("cp",), 1, 2, 3, 4)
    assert (positional.min_tokens, positional.min_frames, positional.min_local_patch_rows) == (1, 2, 3)
    assert positional.cost_alpha == 4
    assert CpVisionFrameShardingConfig(cost_alpha=None).cost_alpha is None
    assert CpVisionFrameShardingConfig(cost_alpha=0).cost_alpha == 0
    with pytest.raises(FrozenInstanceError):
        cfg.enabled = True


@pytest.mark.parametrize(
    "kwargs, exc, field",
    [
        ({"enabled": 1}, TypeError, "enabled"),
        ({"enabled": "yes"}, TypeError, "enabled"),
        ({"min_tokens": -1}, ValueError, "min_tokens"),
        ({"min_tokens": 2.0}, ValueError, "min_tokens"),
        ({"min_tokens": True}, ValueError, "min_tokens"),
        ({"min_frames": -2}, ValueError, "min_frames"),
        ({"min_frames": "32"}, ValueError, "min_frames"),
        ({"min_local_patch_rows": -1}, ValueError, "min_local_patch_rows"),
        ({"min_local_patch_rows": None}, ValueError, "min_local_patch_rows"),
        ({"cost_alpha": -5}, ValueError, "cost_alpha"),
        ({"cost_alpha": "fast"}, ValueError, "cost_alpha"),
        ({"cost_alpha": 1.5}, ValueError, "cost_alpha"),
        ({"cost_alpha": False}, ValueError, "cost_alpha"),
        ({"mesh_dims": "cp"}, TypeError, "mesh_dims"),
        ({"mesh_dims": ()}, ValueError, "mesh_dims"),
        ({"mesh_dims": ("cp", "")}, TypeError, "mesh_dims"),
        ({"mesh_dims": ("cp", 1)}, TypeError, "mesh_dims"),
        ({"mesh_dims": ("cp", "cp")}, ValueError, "mesh_dims"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, exc, field):
    with pytest.raises(exc, match=rf"CpVisionFrameShardingConfig\.{field}"):
        CpVisionFrameShardingConfig(**kwargs)


# --------------------------------------------------------------------------- scope (no group)


def test_scope_tokens_nest_and_restore():
    assert current_cp_vision_scope() is None and not cp_vision_frame_sharding_active()
    t1 = set_cp_vision_group(None)
    assert current_cp_vision_scope() is None
    reset_cp_vision_group(t1)
    with pytest.raises(RuntimeError, match="already been used"):
        reset_cp_vision_group(t1)
    with pytest.raises(TypeError, match="token"):
        reset_cp_vision_group(None)
    with pytest.raises(TypeError, match="config"):
        set_cp_vision_group(None, config={"enabled": True})
    with pytest.raises(TypeError, match="spans_only_cp"):
        set_cp_vision_group(None, spans_only_cp=1)
    with pytest.raises(TypeError, match="group"):
        set_cp_vision_group("cp")
    with pytest.raises(RuntimeError, match="boom"), cp_vision_group(None) as scope:
        assert scope is None
        raise RuntimeError("boom")
    assert current_cp_vision_scope() is None


def test_float_costs_are_scaled_exactly():
    # 0.1 + 0.2 != 0.3 in floats, but the planner compares exact rationals of the given floats
    costs = [0.1, 0.2, 0.3]
    cuts = plan_contiguous(costs, 2)
    assert cuts == [0, 2, 3]
    assert bottleneck(costs, cuts) == max(Fraction(0.1) + Fraction(0.2), Fraction(0.3))
    assert math.isclose(max(rank_costs(costs, cuts)), 0.3)
