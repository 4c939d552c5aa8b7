"""Multi-process tests of ``maybe_distribute_visual`` (``cpshard.vision``) on gloo, W = 1..4.

The vision tower is written here: a small frame-independent ViT (patch embedding, learned
spatial position tables indexed through ``grid_thw``, attention within each frame, a 2x2 patch
merger, deepstack taps), float64. Each rank builds the same tower and pack from fixed seeds and
compares the distributed call with the replicated call it makes itself (no collectives):

* forward: ``pooler_output`` and every ``deepstack_features`` level equal the replicated ones;
* backward: rank r back-propagates its own upstream gradient ``U_r`` through the distributed
  output; the SUM over ranks of every parameter's gradient (and of ``pixel_values``' gradient)
  equals the replicated gradient for the upstream ``sum_r U_r`` — what CP training computes.

Fallbacks check that the tower received the full, untouched input; error cases fail on ONE
rank and check that EVERY rank raised (none hangs) and that the group still works afterwards.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cpshard.vision.distribute as distribute_mod
from cpshard.vision import (
    CpVisionFrameShardingConfig,
    cp_vision_frame_sharding_active,
    cp_vision_group,
    current_cp_vision_scope,
    maybe_distribute_visual,
    plan_vision_frames,
    reset_cp_vision_group,
    resolve_cost_alpha,
    set_cp_vision_group,
)

F64 = torch.float64
ATOL = 1e-10
PATCH_DIM = 6

# --------------------------------------------------------------------------- the test tower


@dataclasses.dataclass
class TowerOutput:
    last_hidden_state: torch.Tensor | None
    pooler_output: torch.Tensor | None
    deepstack_features: list[torch.Tensor] | None = None


@dataclasses.dataclass(frozen=True)
class FrozenTowerOutput:
    last_hidden_state: torch.Tensor | None
    pooler_output: torch.Tensor | None
    deepstack_features: list[torch.Tensor] | None = None


class Block(nn.Module):
    """Pre-norm transformer block; attention is computed within each frame only."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, frame_rows: list[int]) -> torch.Tensor:
        dim = x.shape[1]
        qkv = self.qkv(self.norm1(x))
        outs = []
        for frame in qkv.split(frame_rows):
            n = frame.shape[0]
            q, k, v = frame.view(n, 3, self.heads, dim // self.heads).permute(1, 2, 0, 3)
            outs.append(F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, dim))
        attn = torch.cat(outs) if outs else torch.zeros_like(x)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyTower(nn.Module):
    """A frame-independent vision tower in the Qwen-VL mould.

    Patch rows arrive frame by frame, each frame's rows in 2x2 merge-window order; the merger
    turns every 4 consecutive rows into one token. ``output`` picks the output object's type;
    the keyword flags make it misbehave (for the error tests).
    """

    def __init__(self, *, deepstack: bool = True, output: str = "dataclass", merge_on_config: bool = False,
                 hidden: int = 8, out_hidden: int = 6, heads: int = 2, depth: int = 3, max_side: int = 16,
                 seed: int = 0, merge: int | None = 2) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.config = SimpleNamespace(hidden_size=hidden)
        if merge is not None:
            if merge_on_config:
                self.config.spatial_merge_size = merge
            else:
                self.spatial_merge_size = merge
        self.m = merge or 2
        self.hidden, self.output = hidden, output
        self.embed = nn.Linear(PATCH_DIM, hidden)
        self.pos_h = nn.Parameter(0.1 * torch.randn(max_side, hidden))
        self.pos_w = nn.Parameter(0.1 * torch.randn(max_side, hidden))
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(depth))
        width = hidden * self.m * self.m
        self.merger = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, out_hidden))
        self.taps = (0, 1) if deepstack else ()
        self.deepstack_mergers = nn.ModuleList(nn.Linear(width, out_hidden) for _ in self.taps)
        self.to(F64)
        self.calls: list[dict] = []

    def _positions(self, grid: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.m
        ys, xs = [], []
        for t, h, w in grid:
            ar = lambda k: torch.arange(k, device=device)  # noqa: E731
            y = (ar(h // m).view(-1, 1, 1, 1) * m + ar(m).view(1, 1, -1, 1)).expand(h // m, w // m, m, m)
            x = (ar(w // m).view(1, -1, 1, 1) * m + ar(m).view(1, 1, 1, -1)).expand(h // m, w // m, m, m)
            ys.append(y.reshape(-1).repeat(t))
            xs.append(x.reshape(-1).repeat(t))
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return (torch.cat(ys) if ys else empty), (torch.cat(xs) if xs else empty)

    def forward(self, pixel_values, grid_thw, return_dict=True, *, drop_token=False, drop_level=False,
                short_level=False, explode=False, as_f32=False):
        self.calls.append({
            "rows": None if pixel_values is None else pixel_values.shape[0],
            "grid": grid_thw,
            "grid_type": type(grid_thw),
            "grid_on_pixel_device": grid_thw is None or grid_thw.device == pixel_values.device,
            "return_dict": return_dict,
        })
        if explode:
            raise RuntimeError("the tower exploded")
        if pixel_values is None:
            return TowerOutput(None, None, None)
        grid = torch.Tensor.tolist(grid_thw)
        ys, xs = self._positions(grid, grid_thw.device)
        x = self.embed(pixel_values) + self.pos_h[ys] + self.pos_w[xs]
        frame_rows = [h * w for t, h, w in grid for _ in range(t)]
        deep = []
        width = self.hidden * self.m * self.m
        for k, block in enumerate(self.blocks):
            x = block(x, frame_rows)
            if k in self.taps:
                deep.append(self.deepstack_mergers[self.taps.index(k)](x.reshape(-1, width)))
        pooler = self.merger(x.reshape(-1, width))
        if drop_token:
            pooler = pooler[:-1]
        if drop_level:
            deep = deep[:-1]
        if short_level:
            deep[-1] = deep[-1][:-1]
        if as_f32:
            pooler, deep = pooler.float(), [d.float() for d in deep]
        deep_out = deep if self.taps else None
        if self.output == "frozen":
            return FrozenTowerOutput(x, pooler, deep_out)
        if self.output == "namespace":
            return SimpleNamespace(last_hidden_state=x, pooler_output=pooler) if deep_out is None else \
                SimpleNamespace(last_hidden_state=x, pooler_output=pooler, deepstack_features=deep_out)
        if self.output == "dict":
            return {"last_hidden_state": x, "pooler_output": pooler, "deepstack_features": deep_out}
        return TowerOutput(x, pooler, deep_out)


def levels_of(out) -> list[torch.Tensor]:
    get = out.get if isinstance(out, dict) else lambda k: getattr(out, k, None)
    return [get("pooler_output"), *(get("deepstack_features") or [])]


def make_pack(grid: list[list[int]], seed: int, requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rows = sum(t * h * w for t, h, w in grid)
    gen = torch.Generator().manual_seed(seed)
    pv = torch.randn(rows, PATCH_DIM, generator=gen, dtype=F64).requires_grad_(requires_grad)
    return pv, torch.tensor(grid, dtype=torch.long).reshape(-1, 3)


def upstream(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


PACKS = {
    "images": [[1, 4, 6], [1, 2, 2], [1, 8, 4], [1, 6, 6], [1, 2, 4], [1, 4, 4]],
    "videos": [[3, 4, 4], [5, 2, 6], [2, 6, 2]],
    "mixed": [[1, 8, 8], [4, 2, 2], [1, 2, 6], [6, 4, 2], [1, 6, 4]],
    "one_video": [[3, 4, 4]],  # 3 frames: a dummy frame on W = 4
    "one_image": [[1, 6, 6]],  # 1 frame: dummy frames on every other rank
}
# tower kwargs, config kwargs, pixel_values.requires_grad
VARIANTS = {
    "deepstack": ({}, {"min_local_patch_rows": 0}, True),
    "plain_namespace": ({"deepstack": False, "output": "namespace", "merge_on_config": True},
                        {"min_local_patch_rows": 24, "cost_alpha": 0}, False),
    "frozen_floor": ({"output": "frozen"}, {"cost_alpha": 5}, False),  # default floor: 96 rows
    "dict": ({"output": "dict"}, {"min_local_patch_rows": 40, "cost_alpha": None}, True),
}
EQUIV_CASES = [  # every pack twice, every variant on a pack with dummy frames
    ("images", "deepstack"), ("images", "dict"),
    ("videos", "plain_namespace"), ("videos", "frozen_floor"),
    ("mixed", "deepstack"), ("mixed", "frozen_floor"),
    ("one_video", "dict"), ("one_video", "plain_namespace"),
    ("one_image", "deepstack"), ("one_image", "frozen_floor"),
]


def _sharding_config(**kw) -> CpVisionFrameShardingConfig:
    return CpVisionFrameShardingConfig(**{"enabled": True, "min_tokens": 0, "min_frames": 0, **kw})


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone().contiguous()
    dist.all_reduce(t)
    return t


# --------------------------------------------------------------------------- equivalence


def _equivalence(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    gathers = Counter()
    real_gather = distribute_mod.gather_ragged

    def counting_gather(*args, **kwargs):
        gathers["n"] += 1
        return real_gather(*args, **kwargs)

    distribute_mod.gather_ragged = counting_gather
    try:
        for case, (pack, variant) in enumerate(EQUIV_CASES):
            tower_kw, cfg_kw, pixel_grad = VARIANTS[variant]
            tag = f"W={world} rank={rank} {pack}/{variant}"
            grid = PACKS[pack]
            ref_tower, tower = TinyTower(**tower_kw), TinyTower(**tower_kw)
            ref_pv, grid_thw = make_pack(grid, seed=case, requires_grad=pixel_grad)
            pv = ref_pv.detach().clone().requires_grad_(pixel_grad)

            ref_out = ref_tower(ref_pv, grid_thw=grid_thw, return_dict=True)
            ref_levels = levels_of(ref_out)
            ups = [[upstream(t.shape, 1000 * case + 10 * q + k) for k, t in enumerate(ref_levels)] for q in range(world)]
            sum(
                (lvl * sum(u[k] for u in ups)).sum() for k, lvl in enumerate(ref_levels)
            ).backward()

            cfg = _sharding_config(**cfg_kw)
            gathers["n"] = 0
            with cp_vision_group(dist.group.WORLD, config=cfg):
                assert cp_vision_frame_sharding_active() == (world > 1)
                out = maybe_distribute_visual(tower, pv, grid_thw)
            levels = levels_of(out)
            if type(out) is not type(ref_out):
                bad.append(f"{tag}: output type {type(out).__name__} != {type(ref_out).__name__}")
            if len(levels) != len(ref_levels):
                bad.append(f"{tag}: {len(levels)} levels, expected {len(ref_levels)}")
                continue
            for k, (a, b) in enumerate(zip(levels, ref_levels)):
                if a.shape != b.shape or not torch.allclose(a, b, rtol=0, atol=ATOL):
                    bad.append(f"{tag}: level {k} forward differs")
            sum((lvl * ups[rank][k]).sum() for k, lvl in enumerate(levels)).backward()

            names, mine, refs = [], [], []
            for (name, p), (_, rp) in zip(tower.named_parameters(), ref_tower.named_parameters()):
                if (p.grad is None) != (rp.grad is None):  # every rank runs the tower's backward
                    bad.append(f"{tag}: grad of {name} is {'None' if p.grad is None else 'set'} on this rank")
                elif p.grad is not None:
                    names.append(name), mine.append(p.grad), refs.append(rp.grad)
            if pixel_grad:
                names.append("pixel_values"), mine.append(pv.grad), refs.append(ref_pv.grad)
            summed = _all_reduce(torch.cat([g.reshape(-1) for g in mine])).split([g.numel() for g in mine])
            for name, a, b in zip(names, summed, refs):
                if not torch.allclose(a.view_as(b), b, rtol=0, atol=ATOL):
                    bad.append(f"{tag}: summed grad of {name} differs")

            # this rank ran the tower once, on its own frames (+ its pad frame), grid on the
            # pixel device; every frame ran on exactly one rank; ONE gather for all levels
            calls = tower.calls
            if world == 1:
                if len(calls) != 1 or calls[0]["grid"] is not grid_thw or gathers["n"] != 0:
                    bad.append(f"{tag}: W=1 must be the exact replicated call")
                continue
            plan = plan_vision_frames(grid, world, spatial_merge_size=2,
                                      cost_alpha=resolve_cost_alpha(cfg.cost_alpha, tower),
                                      min_local_patch_rows=cfg.min_local_patch_rows)
            p0, p1 = plan.row_bounds[rank]
            if len(calls) != 1:
                bad.append(f"{tag}: the tower ran {len(calls)} times")
                continue
            call = calls[0]
            if call["rows"] != p1 - p0 + plan.pad_rows(rank) or not call["grid_on_pixel_device"]:
                bad.append(f"{tag}: local call had {call['rows']} rows, expected {p1 - p0} + pad {plan.pad_rows(rank)}")
            if call["rows"] < cfg.min_local_patch_rows:
                bad.append(f"{tag}: local call below the floor")
            real = _all_reduce(torch.tensor([p1 - p0]))
            if int(real) != ref_pv.shape[0]:
                bad.append(f"{tag}: ranks ran {int(real)} real rows in all, expected {ref_pv.shape[0]}")
            if gathers["n"] != 1:
                bad.append(f"{tag}: {gathers['n']} gathers, expected one fused gather")
    finally:
        distribute_mod.gather_ragged = real_gather
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_distributed_equals_replicated(pools, world):
    results = pools(world).run(_equivalence, timeout=240)
    assert [b for r in results for b in r] == []


# --------------------------------------------------------------------------- fallbacks


class CountingGrid(torch.Tensor):
    """Counts the calls that read a tensor's values on the host."""

    reads: Counter = Counter()
    HOST_READS = {"tolist", "item", "numpy", "__getitem__", "__iter__", "__int__", "__index__", "__bool__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls.HOST_READS:
            cls.reads[name] += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def _exact_replicated(tower, pv, grid_thw, expect_rows) -> bool:
    return (len(tower.calls) == 1 and tower.calls[0]["rows"] == expect_rows
            and tower.calls[0]["grid"] is grid_thw and tower.calls[0]["return_dict"] is True)


def _fallbacks(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    grid = PACKS["mixed"]
    pv, grid_thw = make_pack(grid, seed=3)
    rows = pv.shape[0]
    tokens, frames = rows // 4, sum(t for t, _, _ in grid)
    ref = levels_of(TinyTower()(pv, grid_thw=grid_thw))

    def run(name, cfg=None, scope=True, pv=pv, grid_thw=grid_thw, expect_rows=rows, sharded=False,
            tower=None, spans_only_cp=True, no_grad=False):
        tower = tower or TinyTower()
        token = set_cp_vision_group(dist.group.WORLD, config=cfg, spans_only_cp=spans_only_cp) if scope else None
        try:
            with torch.no_grad() if no_grad else torch.enable_grad():
                out = maybe_distribute_visual(tower, pv, grid_thw)
        finally:
            if token is not None:
                reset_cp_vision_group(token)
        tag = f"W={world} rank={rank} {name}"
        if sharded and world > 1:
            if len(tower.calls) != 1 or tower.calls[0]["rows"] >= rows:
                bad.append(f"{tag}: expected the sharded path")
        elif not _exact_replicated(tower, pv, grid_thw, expect_rows):
            bad.append(f"{tag}: expected the exact replicated call, got {tower.calls}")
        return out

    def same(name, out):
        if not all(torch.allclose(a, b, rtol=0, atol=ATOL) for a, b in zip(levels_of(out), ref, strict=True)):
            bad.append(f"W={world} rank={rank} {name}: output differs")

    same("no scope", run("no scope", scope=False))
    same("disabled", run("disabled", cfg=CpVisionFrameShardingConfig(enabled=False, min_tokens=0, min_frames=0)))
    with cp_vision_group(None):
        same("scope None", run("scope None", scope=False))
    out = run("no media", cfg=_sharding_config(), pv=None, grid_thw=None, expect_rows=None)
    if out.pooler_output is not None:
        bad.append("no media: the tower's own output must come back")
    empty_pv, empty_grid = pv[:0], grid_thw[:0]
    run("no frames", cfg=_sharding_config(), pv=empty_pv, grid_thw=empty_grid, expect_rows=0)
    big = 10**6
    same("small pack", run("small pack", cfg=_sharding_config(min_tokens=tokens + 1, min_frames=frames + 1)))
    same("min_frames reached", run("min_frames reached", cfg=_sharding_config(min_tokens=big, min_frames=frames),
                                   sharded=True))
    same("min_tokens reached", run("min_tokens reached", cfg=_sharding_config(min_tokens=tokens, min_frames=big),
                                   sharded=True))
    same("default thresholds", run("default thresholds", cfg=None))  # 41 tokens, 13 frames: replicated

    frozen = TinyTower().requires_grad_(False)
    same("frozen over CP x TP", run("frozen over CP x TP", cfg=_sharding_config(), tower=frozen,
                                    spans_only_cp=False, sharded=True))
    same("no_grad over CP x TP", run("no_grad over CP x TP", cfg=_sharding_config(), spans_only_cp=False,
                                     no_grad=True, sharded=True))

    # host metadata is read once, explicitly; the tower gets a fresh grid on the pixel device
    CountingGrid.reads.clear()
    counting = grid_thw.clone().as_subclass(CountingGrid)
    tower = TinyTower()
    with cp_vision_group(dist.group.WORLD, config=_sharding_config()):
        same("counting grid", maybe_distribute_visual(tower, pv, counting))
    if world > 1:
        if dict(CountingGrid.reads) != {"tolist": 1}:
            bad.append(f"W={world} rank={rank}: host reads of grid_thw {dict(CountingGrid.reads)}, expected one tolist")
        if tower.calls[0]["grid_type"] is not torch.Tensor or not tower.calls[0]["grid_on_pixel_device"]:
            bad.append(f"W={world} rank={rank}: the tower must get a plain grid on the pixel device")

    # kwargs reach the tower on the sharded path; the output keeps the local last_hidden_state
    with cp_vision_group(dist.group.WORLD, config=_sharding_config()):
        out = maybe_distribute_visual(TinyTower(), pv, grid_thw, drop_level=False)
    if world > 1 and out.last_hidden_state.shape[0] >= rows:
        bad.append("last_hidden_state should be this rank's local frames")
    return bad


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_fallback_paths(pools, world):
    results = pools(world).run(_fallbacks, timeout=240)
    assert [b for r in results for b in r] == []


# --------------------------------------------------------------------------- errors on one rank


def _error_cases(world: int) -> dict:
    """name -> (what rank r does, fragment the failing ranks' error has, fragment of the others,
    exception type name on the failing ranks)."""
    last = world - 1
    return {
        "trainable over CP x TP": ("all", "spans_only_cp=False", "spans_only_cp=False", "ValueError"),
        "token count": (1, "for this rank's frames, but the plan expects", "rank 1 failed", "ValueError"),
        "deepstack level missing": (last, "deepstack levels differs", "deepstack levels differs", "ValueError"),
        "deepstack level short": (0, "deepstack_features[1] has", "rank 0 failed", "ValueError"),
        "tower raises": (last, "the tower exploded", f"rank {last} failed", "RuntimeError"),
        "grid differs": (1, "grid_thw differs on rank 1", "grid_thw differs on rank 1", "ValueError"),
        "pixel rows": (0, "pixel_values has 119 patch rows but grid_thw describes 120", "rank 0 failed", "ValueError"),
        "h not a merge multiple": ("all", "multiples of the tower's spatial_merge_size", "", "ValueError"),
        "float grid": (last, "grid_thw must be an integer tensor", f"rank {last} failed", "ValueError"),
        "config differs": (1, "config differs on rank 1", "config differs on rank 1", "ValueError"),
        "no merge factor": ("all", "spatial merge factor", "", "ValueError"),
        "return_dict=False": ("all", "return_dict=False is not supported", "", "ValueError"),
        "output dtype differs": (last, "level dtypes and shapes differs", "level dtypes and shapes differs", "ValueError"),
    }


def _errors(rank: int, world: int) -> dict:
    grid = [[1, 8, 8], [2, 4, 4], [1, 4, 6]]  # 120 rows
    outcomes = {}
    for name, (who, *_rest) in _error_cases(world).items():
        me = who == "all" or who == rank
        cfg = _sharding_config()
        tower = TinyTower()
        pv, grid_thw = make_pack(grid, seed=5)
        kwargs: dict = {}
        spans_only_cp = True
        if name == "trainable over CP x TP":
            spans_only_cp = False
        elif name == "token count" and me:
            kwargs["drop_token"] = True
        elif name == "deepstack level missing" and me:
            kwargs["drop_level"] = True
        elif name == "deepstack level short" and me:
            kwargs["short_level"] = True
        elif name == "tower raises" and me:
            kwargs["explode"] = True
        elif name == "grid differs" and me:
            pv, grid_thw = make_pack([[1, 8, 8], [2, 4, 4], [1, 6, 4]], seed=5)
        elif name == "pixel rows" and me:
            pv = pv[:-1]
        elif name == "h not a merge multiple":
            pv, grid_thw = make_pack([[1, 8, 8], [2, 3, 4]], seed=5)
        elif name == "float grid" and me:
            grid_thw = grid_thw.double()
        elif name == "config differs" and me:
            cfg = _sharding_config(min_tokens=1)
        elif name == "no merge factor":
            tower = TinyTower(merge=None)
        elif name == "return_dict=False":
            kwargs["return_dict"] = False
        elif name == "output dtype differs" and me:
            kwargs["as_f32"] = True
        try:
            with cp_vision_group(dist.group.WORLD, config=cfg, spans_only_cp=spans_only_cp):
                maybe_distribute_visual(tower, pv, grid_thw, **kwargs)
            outcomes[name] = None
        except Exception as exc:
            outcomes[name] = (type(exc).__name__, str(exc))
    # the group is still in step: a collective and a good sharded call work after all that
    ok = _all_reduce(torch.ones(1))
    pv, grid_thw = make_pack(grid, seed=5)
    with cp_vision_group(dist.group.WORLD, config=_sharding_config()):
        out = maybe_distribute_visual(TinyTower(), pv, grid_thw)
    ref = TinyTower()(pv, grid_thw=grid_thw)
    outcomes["after"] = (int(ok), bool(torch.allclose(out.pooler_output, ref.pooler_output, rtol=0, atol=ATOL)))
    return outcomes


@pytest.mark.parametrize("world", [2, 3, 4])
def test_error_on_one_rank_raises_on_every_rank(pools, world):
    results = pools(world).run(_errors, timeout=240)
    for name, (who, mine, others, exc_type) in _error_cases(world).items():
        for rank, outcome in enumerate(results):
            assert outcome[name] is not None, f"{name}: rank {rank} did not raise"
            etype, msg = outcome[name]
            failing = who == "all" or who == rank
            assert etype == (exc_type if failing else "ValueError"), (name, rank, etype, msg)
            assert (mine if failing else others) in msg, (name, rank, msg)
    assert all(r["after"] == (world, True) for r in results)


# --------------------------------------------------------------------------- scope with groups


def _scope_in_worker(rank: int, world: int) -> None:
    """With a real (size-1) process group: tokens nest; out-of-order resets raise."""
    cfg = _sharding_config()
    outer = set_cp_vision_group(dist.group.WORLD, config=cfg)
    s_outer = current_cp_vision_scope()
    assert s_outer.group.world == 1 and s_outer.config is cfg and s_outer.spans_only_cp
    assert not cp_vision_frame_sharding_active()  # one rank: nothing to shard
    inner = set_cp_vision_group(dist.group.WORLD, spans_only_cp=False)
    s_inner = current_cp_vision_scope()
    assert s_inner.config.enabled and not s_inner.spans_only_cp  # config=None: enabled defaults
    try:
        reset_cp_vision_group(outer)
        raise AssertionError("an out-of-order reset must raise")
    except RuntimeError as exc:
        assert "reverse order" in str(exc)
    assert current_cp_vision_scope() is s_inner  # unchanged by the failed reset
    reset_cp_vision_group(inner)
    assert current_cp_vision_scope() is s_outer
    with cp_vision_group(None):
        assert current_cp_vision_scope() is None
    assert current_cp_vision_scope() is s_outer
    reset_cp_vision_group(outer)
    assert current_cp_vision_scope() is None


def test_scope_tokens_with_a_process_group(pool1):
    pool1.run(_scope_in_worker)


def _device_mesh(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    bad = []
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    pv, grid_thw = make_pack(PACKS["mixed"], seed=9)
    ref = levels_of(TinyTower()(pv, grid_thw=grid_thw))
    for dims, spans_only_cp, frozen, size in [(("cp",), True, False, 2), (("cp", "tp"), False, True, 4)]:
        tower = TinyTower().requires_grad_(not frozen)
        with cp_vision_group(mesh, config=_sharding_config(mesh_dims=dims), spans_only_cp=spans_only_cp) as scope:
            if scope.group.world != size:
                bad.append(f"{dims}: group of {scope.group.world} ranks, expected {size}")
            out = maybe_distribute_visual(tower, pv, grid_thw)
        if not all(torch.allclose(a, b, rtol=0, atol=ATOL) for a, b in zip(levels_of(out), ref, strict=True)):
            bad.append(f"{dims}: output differs")
        if tower.calls[0]["rows"] >= pv.shape[0]:
            bad.append(f"{dims}: not sharded")
    try:
        set_cp_vision_group(mesh, config=_sharding_config(mesh_dims=("dp",)))
        bad.append("an unknown mesh dim must raise")
    except ValueError as exc:
        if "dp" not in str(exc):
            bad.append(str(exc))
    return bad


def test_multi_dim_device_mesh(pool4):
    assert [b for r in pool4.run(_device_mesh, timeout=120) for b in r] == []
