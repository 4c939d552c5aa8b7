"""Vision frame sharding: one fwd+bwd step of a small frame-independent ViT-like tower on a pack
of images and videos, replicated on every rank (what a CP recipe does without frame sharding)
vs :func:`cpshard.vision.maybe_distribute_visual` under :func:`cpshard.vision.cp_vision_group`
(each rank runs its contiguous frames of the optimal plan, one fused ragged gather rebuilds the
full ``pooler_output`` and deepstack levels everywhere).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cpshard.bench.memory import peak_extra_bytes
from cpshard.bench.report import mib
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps
from cpshard.vision import (
    CpVisionFrameShardingConfig,
    VisionFramePlan,
    cp_vision_group,
    maybe_distribute_visual,
    plan_vision_frames,
    resolve_cost_alpha,
)

PATCH_DIM = 192
# (t, h, w) patch grids: 3 024 patch rows over 18 frame units (h, w multiples of the merge size 2)
PACK = ((1, 24, 24), (4, 12, 12), (1, 16, 24), (8, 8, 8), (1, 20, 20), (3, 16, 12))
QUICK_PACK = ((1, 8, 8), (2, 8, 4), (1, 4, 8))
# shard every pack, however small (the defaults would leave these replicated)
SHARDING = CpVisionFrameShardingConfig(enabled=True, min_tokens=0, min_frames=0)


class Block(nn.Module):
    """A pre-norm transformer block whose attention stays within each frame; the equal frames of
    one entry (a video's ``t`` frames) attend as one batch."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, entries: list[tuple[int, int]]) -> torch.Tensor:
        """``entries``: (frames, rows per frame) of each entry, in row order."""
        dim = x.shape[1]
        sizes = [t * rows for t, rows in entries]
        outs = []
        for (t, rows), part in zip(entries, self.qkv(self.norm1(x)).split(sizes), strict=True):
            qkv = part.view(t, rows, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [t, heads, rows, d]
            outs.append(attn.transpose(1, 2).reshape(t * rows, dim))
        x = x + self.proj(torch.cat(outs))
        return x + self.mlp(self.norm2(x))


@dataclasses.dataclass
class TowerOutput:
    last_hidden_state: torch.Tensor
    pooler_output: torch.Tensor
    deepstack_features: list[torch.Tensor]


class Tower(nn.Module):
    """A small Qwen-VL-like vision tower: patch embedding, spatial position tables, per-frame
    attention, a 2x2 merger and two deepstack taps. Frames are independent, so running a
    subset of them gives those frames' rows of the full call. Seeded: identical on every rank."""

    spatial_merge_size = 2

    def __init__(
        self,
        hidden: int = 64,
        out_hidden: int = 128,
        heads: int = 2,
        depth: int = 3,
        max_side: int = 64,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.config = types.SimpleNamespace(hidden_size=hidden)  # "auto" alpha: 3 x hidden
            self.embed = nn.Linear(PATCH_DIM, hidden)
            self.pos_h = nn.Parameter(0.02 * torch.randn(max_side, hidden))
            self.pos_w = nn.Parameter(0.02 * torch.randn(max_side, hidden))
            self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(depth))
            self.merger = nn.Linear(4 * hidden, out_hidden)
            self.taps = (1, 2)
            self.deepstack = nn.ModuleList(nn.Linear(4 * hidden, out_hidden) for _ in self.taps)

    def _positions(
        self, grid: list[list[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column of every patch, in merge-window order (2x2 windows contiguous)."""
        m = self.spatial_merge_size
        ys, xs = [], []
        for t, h, w in grid:
            win = torch.arange(m, device=device)
            y = torch.arange(h // m, device=device).view(-1, 1, 1, 1) * m + win.view(1, 1, -1, 1)
            x = torch.arange(w // m, device=device).view(1, -1, 1, 1) * m + win.view(1, 1, 1, -1)
            shape = (h // m, w // m, m, m)
            ys.append(y.expand(shape).reshape(-1).repeat(t))
            xs.append(x.expand(shape).reshape(-1).repeat(t))
        return torch.cat(ys), torch.cat(xs)

    def forward(
        self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_dict: bool = True
    ) -> TowerOutput:
        """The frames of ``grid_thw``'s entries (``return_dict`` is the drop-in's flag: ignored)."""
        grid = grid_thw.tolist()
        ys, xs = self._positions(grid, pixel_values.device)
        x = self.embed(pixel_values) + self.pos_h[ys] + self.pos_w[xs]
        entries = [(t, h * w) for t, h, w in grid]
        merged = 4 * x.shape[1]
        deep = []
        for k, block in enumerate(self.blocks):
            x = block(x, entries)
            if k in self.taps:
                deep.append(self.deepstack[self.taps.index(k)](x.reshape(-1, merged)))
        return TowerOutput(x, self.merger(x.reshape(-1, merged)), deep)


def frame_plan(tower: Tower, pack: Sequence[Sequence[int]], world: int) -> VisionFramePlan:
    """The plan :func:`maybe_distribute_visual` makes for ``pack`` under :data:`SHARDING`."""
    return plan_vision_frames(
        pack,
        world,
        spatial_merge_size=tower.spatial_merge_size,
        cost_alpha=resolve_cost_alpha(SHARDING.cost_alpha, tower),
        min_local_patch_rows=SHARDING.min_local_patch_rows,
    )


def steps(rt: Runtime) -> int:
    return 1


def _levels(out: TowerOutput) -> list[tuple[str, torch.Tensor]]:
    return [("pooler_output", out.pooler_output)] + [
        (f"deepstack_features[{k}]", d) for k, d in enumerate(out.deepstack_features)
    ]


def _check_same(rt: Runtime, want: TowerOutput, got: TowerOutput) -> None:
    """Raise, naming this rank, unless the distributed call's full outputs match the replicated."""
    tol = 1e-4 if rt.dtype in (torch.float32, torch.float64) else 3e-2
    for (name, a), (_, b) in zip(_levels(want), _levels(got), strict=True):
        if a.shape != b.shape or not torch.allclose(a, b, rtol=tol, atol=tol):
            raise AssertionError(
                f"rank {rt.rank}: vision: the distributed {name} differs from the replicated one"
            )


def _gather_ints(rt: Runtime, values: list[int]) -> list[list[int]]:
    """Every rank's ``values`` (same length everywhere), in rank order."""
    t = torch.tensor(values, dtype=torch.int64, device=rt.device)
    parts = [torch.empty_like(t) for _ in range(rt.world)]
    dist.all_gather(parts, t, group=rt.pg)
    return [p.tolist() for p in parts]


def run(rt: Runtime) -> dict:
    """Check, then time (and measure) both ways of running the tower on ``rt``'s group."""
    cfg = rt.cfg
    pack = QUICK_PACK if cfg.quick else PACK
    rt.progress(f"vision tower fwd+bwd on {len(pack)} entries over {rt.world} ranks")
    tower = Tower().to(device=rt.device, dtype=rt.dtype)
    grid_thw = torch.tensor(pack, device=rt.device)
    rows = sum(t * h * w for t, h, w in pack)
    gen = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(rows, PATCH_DIM, generator=gen).to(device=rt.device, dtype=rt.dtype)

    def replicated() -> TowerOutput:
        return tower(pixel_values, grid_thw=grid_thw, return_dict=True)

    def distributed() -> TowerOutput:
        with cp_vision_group(rt.pg, config=SHARDING):
            return maybe_distribute_visual(tower, pixel_values, grid_thw)

    def drop_grads() -> None:
        tower.zero_grad(set_to_none=True)

    def fwd_bwd(call: Callable[[], TowerOutput]) -> Callable[[], None]:
        def step() -> None:
            drop_grads()
            out = call()
            sum(level.float().square().mean() for _, level in _levels(out)).backward()

        return step

    with torch.no_grad():
        want, got = replicated(), distributed()
    _check_same(rt, want, got)
    # this rank's patch rows of the pack (its frames in the plan the call made) and the rows its
    # tower call ran (the distributed output's last_hidden_state: its frames + padding)
    p0, p1 = frame_plan(tower, pack, rt.world).row_bounds[rt.rank]
    local = _gather_ints(rt, [p1 - p0, got.last_hidden_state.shape[0]])
    runs = {"distributed": fwd_bwd(distributed), "replicated": fwd_bwd(replicated)}
    timings = time_steps(
        rt, runs, warmup=cfg.warmup, repeats=cfg.repeats, iters=cfg.iters, target_s=cfg.target_s
    )
    result = {
        "world": rt.world,
        "dtype": cfg.dtype,
        "pack": [list(e) for e in pack],
        "patch_rows": rows,
        "local_rows_per_rank": [r for r, _ in local],
        "tower_rows_per_rank": [r for _, r in local],
    }
    for who, step in runs.items():
        timing = timings[who]
        peak = peak_extra_bytes(rt, step, reset=drop_grads) if cfg.memory else None
        result[who] = {
            "fwd_bwd_s": timing.median_s,
            "fwd_bwd_min_s": timing.min_s,
            "fwd_bwd_repeats_s": list(timing.repeats_s),
            "fwd_bwd_cpu_s": timing.cpu_s,
            "peak_bytes": peak,
        }
    result["speedup"] = result["replicated"]["fwd_bwd_s"] / result["distributed"]["fwd_bwd_s"]
    return result


def render(result: dict) -> str:
    ms = {who: result[who]["fwd_bwd_s"] * 1e3 for who in ("distributed", "replicated")}
    peak = {who: result[who]["peak_bytes"] for who in ("distributed", "replicated")}
    local = ",".join(map(str, result["local_rows_per_rank"]))
    ran = ",".join(map(str, result["tower_rows_per_rank"]))
    return "\n".join(
        [
            "# vision: ViT-like tower fwd+bwd (per-frame attention, 2x2 merger, 2 deepstack",
            f"#   taps) on a pack of {len(result['pack'])} images/videos: replicated on every rank"
            "  vs",
            "#   maybe_distribute_visual (each rank runs its frames, one fused ragged gather);",
            "#   median ms (max over ranks) / peak extra MiB; local rows = each rank's patch rows",
            "#   of the pack, tower rows = the rows its tower call ran (with min_local_patch_rows",
            "#   padding)",
            f"#{'world':>6} {'rows':>6} {'local rows':>24} {'tower rows':>24} {'dist ms':>9} "
            f"{'repl ms':>9} {'speedup':>8} {'dist MiB':>9} {'repl MiB':>9}",
            f" {result['world']:>6} {result['patch_rows']:>6} {local:>24} {ran:>24} "
            f"{ms['distributed']:>9.1f} {ms['replicated']:>9.1f} {result['speedup']:>8.2f} "
            f"{mib(peak['distributed']):>9} {mib(peak['replicated']):>9}",
        ]
    )
