"""The benchmarked ops: cpshard's gather next to its hand-written baseline and its wire floor.

* ``ragged``: :func:`cpshard.gather_ragged` of ``[n_r, H]`` blocks with uneven counts
  (max/mean = 1.6) vs pad-to-max + all-gather + slice + cat (:class:`PadAllGatherRagged`).
* ``ragged_even``: the same with equal counts.
* ``sequence``: :func:`cpshard.gather_sequence` of ``[1, L, H]`` (``seq_dim=1``) vs list
  all-gather + cat (:class:`ListAllGatherCat`).
* ``halo``: :func:`cpshard.gather_halo` of ``[1, L, H]`` with ``halo = L/2`` vs an all-gather of
  every shard's tail (:class:`AllGatherTailsHalo`).

Each is measured forward + backward (``y = op(x); y.backward(g)``) and forward only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import cpshard
from cpshard.bench.baselines import AllGatherTailsHalo, ListAllGatherCat, PadAllGatherRagged
from cpshard.bench.floor import Transfer, exchange_floor, gather_floors
from cpshard.bench.memory import peak_extra_bytes
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps

# Uneven counts: proportions of the mean, max/mean = 1.6 (world 4: a load-imbalanced packing).
_PROPORTIONS_4 = (1.6, 0.8, 0.4, 1.2)


def ragged_counts(mean: int, world: int) -> list[int]:
    """Per-rank counts with mean ``mean`` and max/mean ~ 1.6: ``mean x (1.6, 0.8, 0.4, 1.2)`` for
    4 ranks, else ``mean x`` a descending linear ramp from 1.6 to 0.4."""
    if world == 4:
        props = list(_PROPORTIONS_4)
    else:
        props = [1.6 - 1.2 * r / (world - 1) for r in range(world)]
    counts = [round(mean * p) for p in props]
    counts[counts.index(max(counts))] += mean * world - sum(counts)
    return counts


def halo_windows(world: int, length: int, halo: int) -> list[tuple[int, int]]:
    """Rank r's halo window ``[begin, end)`` in global token positions."""
    return [(r * length - min(halo, r * length), r * length) for r in range(world)]


@dataclass
class OpCase:
    op: str
    tokens: int  # the size parameter: tokens per rank (the mean for ragged counts)
    counts: list[int]  # tokens per rank
    x_shape: list[int]  # this rank's input
    out_shape: list[int]  # this rank's output
    moved_bytes: int  # bytes one forward moves, for algbw (see report)
    bus_factor: float  # busbw = algbw * bus_factor
    ours: Callable[[torch.Tensor], torch.Tensor]
    base: Callable[[torch.Tensor], torch.Tensor]
    floor_fwd: dict[str, Transfer]
    floor_bwd: dict[str, Transfer]
    detail: dict = field(default_factory=dict)


def make_case(rt: Runtime, op: str, tokens: int) -> OpCase:
    world, rank, pg, hidden = rt.world, rt.rank, rt.pg, rt.cfg.hidden
    elem = torch.empty((), dtype=rt.dtype).element_size()
    if op in ("ragged", "ragged_even"):
        counts = ragged_counts(tokens, world) if op == "ragged" else [tokens] * world
        fwd, bwd = gather_floors(rt, [c * hidden for c in counts])
        return OpCase(
            op,
            tokens,
            counts,
            [counts[rank], hidden],
            [sum(counts), hidden],
            moved_bytes=sum(counts) * hidden * elem,
            bus_factor=(world - 1) / world,
            ours=lambda x: cpshard.gather_ragged(x, pg, counts, dim=0),
            base=lambda x: PadAllGatherRagged.apply(x, pg, counts),
            floor_fwd=fwd,
            floor_bwd=bwd,
            detail={"max_over_mean": max(counts) * world / sum(counts)},
        )
    if op == "sequence":
        counts = [tokens] * world
        fwd, bwd = gather_floors(rt, [c * hidden for c in counts])
        return OpCase(
            op,
            tokens,
            counts,
            [1, tokens, hidden],
            [1, world * tokens, hidden],
            moved_bytes=world * tokens * hidden * elem,
            bus_factor=(world - 1) / world,
            ours=lambda x: cpshard.gather_sequence(x, pg, seq_dim=1),
            base=lambda x: ListAllGatherCat.apply(x, pg, 1),
            floor_fwd=fwd,
            floor_bwd=bwd,
        )
    if op == "halo":
        halo = tokens // 2
        windows = halo_windows(world, tokens, halo)
        mine = (rank * tokens, (rank + 1) * tokens)

        def overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
            return max(0, min(a[1], b[1]) - max(a[0], b[0]))

        recvs = [
            (q, overlap(windows[rank], (q * tokens, (q + 1) * tokens)) * hidden)
            for q in range(world)
        ]
        sends = [(r, overlap(windows[r], mine) * hidden) for r in range(world) if r != rank]
        recvs = [(q, k) for q, k in recvs if k]
        sends = [(r, k) for r, k in sends if k]
        got = windows[rank][1] - windows[rank][0]
        return OpCase(
            op,
            tokens,
            [tokens] * world,
            [1, tokens, hidden],
            [1, got + tokens, hidden],
            moved_bytes=halo * hidden * elem,
            bus_factor=1.0,
            ours=lambda x: cpshard.gather_halo(x, pg, halo, seq_dim=1),
            base=lambda x: AllGatherTailsHalo.apply(x, pg, halo, 1),
            floor_fwd={"p2p": exchange_floor(rt, sends, recvs)},
            floor_bwd={"p2p": exchange_floor(rt, recvs, sends)},
            detail={"halo": halo},
        )
    raise ValueError(f"unknown op {op!r}")


def _check_same(rt: Runtime, case: OpCase, x: torch.Tensor, g: torch.Tensor) -> None:
    """cpshard and the baseline must agree (output and gradient) before either is timed."""
    results = []
    for impl in (case.ours, case.base):
        xg = x.detach().clone().requires_grad_(True)
        y = impl(xg)
        y.backward(g)
        results.append((y.detach(), xg.grad))
    (y0, g0), (y1, g1) = results
    # gradients are sums over ranks, added in a different order: allow for the rounding
    eps = 1e-5 if rt.dtype in (torch.float32, torch.float64) else 2e-2
    tol = {"rtol": eps, "atol": eps * rt.world}
    if y0.shape != y1.shape or not torch.equal(y0, y1):
        raise AssertionError(
            f"rank {rt.rank}: {case.op}: cpshard's output differs from the baseline's"
        )
    if not torch.allclose(g0, g1, **tol):
        raise AssertionError(
            f"rank {rt.rank}: {case.op}: cpshard's gradient differs from the baseline's"
        )


def run_case(rt: Runtime, op: str, tokens: int) -> dict:
    """Every figure of one op at one size (identical on every rank)."""
    cfg = rt.cfg
    case = make_case(rt, op, tokens)
    gen = torch.Generator().manual_seed(1234 + rt.rank)
    x = torch.randn(case.x_shape, generator=gen).to(device=rt.device, dtype=rt.dtype)
    g = torch.randn(case.out_shape, generator=gen).to(device=rt.device, dtype=rt.dtype)
    _check_same(rt, case, x, g)
    xg = x.clone().requires_grad_(True)

    def drop_grad() -> None:
        xg.grad = None

    def fwd_bwd(impl: Callable) -> Callable[[], None]:
        def step() -> None:
            drop_grad()
            impl(xg).backward(g)

        return step

    def fwd(impl: Callable) -> Callable[[], None]:
        def step() -> None:
            with torch.no_grad():
                impl(x)

        return step

    steps: dict[str, Callable[[], object]] = {}
    for who, impl in (("ours", case.ours), ("base", case.base)):
        steps[f"{who}_fwd_bwd"] = fwd_bwd(impl)
        steps[f"{who}_fwd"] = fwd(impl)
    floors = {"fwd": case.floor_fwd, "bwd": case.floor_bwd}
    for direction, transfers in floors.items():
        for name, fn in transfers.items():
            steps[f"floor_{direction}_{name}"] = fn
    timings = time_steps(
        rt, steps, warmup=cfg.warmup, repeats=cfg.repeats, iters=cfg.iters, target_s=cfg.target_s
    )

    elem = torch.empty((), dtype=rt.dtype).element_size()
    out: dict = {
        "op": op,
        "tokens": tokens,
        "counts": case.counts,
        "world": rt.world,
        "bytes_per_rank": tokens * cfg.hidden * elem,
        "moved_bytes": case.moved_bytes,
        "bus_factor": case.bus_factor,
        **case.detail,
    }
    for who in ("ours", "base"):
        for mode in ("fwd_bwd", "fwd"):
            t = timings[f"{who}_{mode}"]
            out[f"{who}_{mode}_s"] = t.median_s
            out[f"{who}_{mode}_min_s"] = t.min_s
            out[f"{who}_{mode}_cpu_s"] = t.cpu_s
            out[f"{who}_{mode}_minor_faults"] = t.minor_faults
            out[f"{who}_{mode}_repeats_s"] = list(t.repeats_s)
            out[f"{who}_{mode}_iters"] = t.iters
            if cfg.memory:
                out[f"{who}_{mode}_peak_bytes"] = peak_extra_bytes(
                    rt, steps[f"{who}_{mode}"], reset=drop_grad
                )
    drop_grad()
    # the floor of a direction is its fastest bare transfer
    for direction, transfers in floors.items():
        by = {name: timings[f"floor_{direction}_{name}"] for name in transfers}
        best = min(by, key=lambda name: by[name].median_s)
        out[f"floor_{direction}_by"] = {name: t.median_s for name, t in by.items()}
        out[f"floor_{direction}_kind"] = best
        out[f"floor_{direction}_s"] = by[best].median_s
        out[f"floor_{direction}_min_s"] = by[best].min_s
        out[f"floor_{direction}_cpu_s"] = by[best].cpu_s
    out["floor_fwd_bwd_s"] = out["floor_fwd_s"] + out["floor_bwd_s"]
    out["floor_fwd_bwd_cpu_s"] = out["floor_fwd_cpu_s"] + out["floor_bwd_cpu_s"]
    return out
