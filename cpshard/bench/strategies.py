"""The transfer strategies for the ragged gather (all-gather-v) and its backward
(reduce-scatter-v SUM), measured as complete implementations — allocation, staging copies and
the summation included, no autograd — so that the transport can pick one per case by a rule.

Forward, ``x = [n_r, H]`` -> ``out = [sum n, H]``:
  * ``pad_all_gather``: pad x to ``[max_n, H]``, ``all_gather_single``, compact with
    :func:`cpshard.unpack_ragged` (equal counts: gather straight into ``out``).
  * ``all_to_all``: ``all_to_all_single`` with uneven output splits; the input is this rank's
    block repeated W times.
  * ``p2p``: the transport's route (:meth:`cpshard.comm.TorchTransport.all_gather_v`): local
    block copied into its slot, batched ``isend``/``irecv`` straight into the other slots.
Backward, ``g = [sum n, H]`` -> ``[n_r, H]``:
  * ``pad_reduce_scatter``: :func:`cpshard.pack_ragged` padded to ``[W, max_n, H]``,
    ``reduce_scatter_single``, first ``n_r`` rows (equal counts: reduce-scatter ``g`` itself).
  * ``all_to_all``: the route :meth:`cpshard.comm.TorchTransport.reduce_scatter_v` takes below
    16 MiB of staging: ``all_to_all_single`` with exact splits into ``[W, n_r, H]``, summed.
  * ``p2p``: batched ``isend`` of each rank's rows to it, ``irecv`` into ``[W, n_r, H]``, summed.
  * ``p2p_pipelined``: its route above that: the same bytes in rounds of pieces that fit two
    alternating ``[W, piece]`` buffers of 8 MiB, each round's sum overlapping the next round's
    transfer.

The transport's two routes are measured by calling them directly (the transport's private
methods: the bench is part of the package, and times exactly the code the transport runs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

import cpshard
from cpshard.bench.cases import ragged_counts
from cpshard.bench.floor import p2p_exchange
from cpshard.bench.memory import peak_extra_bytes
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps
from cpshard.comm import Group, TorchTransport, offsets
from cpshard.comm.torch_compat import all_gather_single, reduce_scatter_single

FORWARD = ("pad_all_gather", "all_to_all", "p2p")
BACKWARD = ("pad_reduce_scatter", "all_to_all", "p2p", "p2p_pipelined")


def forward_strategies(
    rt: Runtime, counts: list[int]
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    pg, world, me, m = rt.pg, rt.world, rt.rank, max(counts)
    even = len(set(counts)) == 1
    offs = offsets(counts)
    transport = TorchTransport(Group(pg, me, world))

    def pad_all_gather(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[1:]
        if even:
            out = x.new_empty((offs[-1], *h))
            all_gather_single(out.view(-1), x.reshape(-1), group=pg)
            return out
        padded = x.new_zeros((m, *h))
        padded[: x.shape[0]] = x
        stage = x.new_empty(world * padded.numel())
        all_gather_single(stage, padded.view(-1), group=pg)
        return cpshard.unpack_ragged(stage, counts, [offs[-1], *h], 0, pad_to=m)

    def all_to_all(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[1:]
        row = int(torch.Size(h).numel())
        out = x.new_empty((offs[-1], *h))
        rep = x.reshape(1, -1).expand(world, -1).contiguous().view(-1)
        dist.all_to_all_single(
            out.view(-1),
            rep,
            output_split_sizes=[c * row for c in counts],
            input_split_sizes=[counts[me] * row] * world,
            group=pg,
        )
        return out

    def p2p(x: torch.Tensor) -> torch.Tensor:  # the transport's route
        out = x.new_empty((offs[-1], *x.shape[1:]))
        row = int(torch.Size(x.shape[1:]).numel())
        transport.all_gather_v(out.view(-1), x, [c * row for c in counts])
        return out

    return {"pad_all_gather": pad_all_gather, "all_to_all": all_to_all, "p2p": p2p}


def backward_strategies(
    rt: Runtime, counts: list[int]
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    pg, world, me, m = rt.pg, rt.world, rt.rank, max(counts)
    even = len(set(counts)) == 1
    n = counts[me]
    offs = offsets(counts)
    peers = [r for r in range(world) if r != me]

    def pad_reduce_scatter(g: torch.Tensor) -> torch.Tensor:
        h = g.shape[1:]
        full = g if even else cpshard.pack_ragged(g, counts, 0, pad_to=m)
        out = g.new_empty((m, *h))
        reduce_scatter_single(out.view(-1), full.reshape(-1), group=pg)
        return out[:n]

    transport = TorchTransport(Group(pg, me, world))

    def routed(
        route: Callable[[torch.Tensor, torch.Tensor, list[int]], None],
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(g: torch.Tensor) -> torch.Tensor:
            row = int(torch.Size(g.shape[1:]).numel())
            out = g.new_empty((n, *g.shape[1:]))
            route(out.view(-1), g.reshape(-1), [c * row for c in counts])
            return out

        return run

    all_to_all = routed(transport._reduce_scatter_all_to_all)
    p2p_pipelined = routed(transport._reduce_scatter_pipelined)

    def p2p(g: torch.Tensor) -> torch.Tensor:
        stage = g.new_empty((world, n, *g.shape[1:]))
        stage[me].copy_(g[offs[me] : offs[me + 1]])
        p2p_exchange(
            pg, [(r, g[offs[r] : offs[r + 1]]) for r in peers], [(r, stage[r]) for r in peers]
        )
        return stage.sum(0)

    return {
        "pad_reduce_scatter": pad_reduce_scatter,
        "all_to_all": all_to_all,
        "p2p": p2p,
        "p2p_pipelined": p2p_pipelined,
    }


def run_strategies(rt: Runtime, pattern: str, tokens: int) -> list[dict]:
    """One row per (direction, strategy) at ``tokens`` per rank, ``pattern`` uneven | even."""
    cfg, world, hidden = rt.cfg, rt.world, rt.cfg.hidden
    counts = ragged_counts(tokens, world) if pattern == "uneven" else [tokens] * world
    gen = torch.Generator().manual_seed(99 + rt.rank)
    x = torch.randn(counts[rt.rank], hidden, generator=gen).to(device=rt.device, dtype=rt.dtype)
    g = torch.randn(sum(counts), hidden, generator=gen).to(device=rt.device, dtype=rt.dtype)
    timing = {
        "warmup": cfg.warmup,
        "repeats": cfg.repeats,
        "iters": cfg.iters,
        "target_s": cfg.target_s,
    }
    rows = []
    for direction, impls, arg in (
        ("fwd", forward_strategies(rt, counts), x),
        ("bwd", backward_strategies(rt, counts), g),
    ):
        results = {name: fn(arg) for name, fn in impls.items()}
        ref = next(iter(results.values()))
        tol = 1e-4 if rt.dtype in (torch.float32, torch.float64) else 5e-2
        for name, res in results.items():  # every strategy must compute the same thing
            if res.shape != ref.shape or not torch.allclose(res, ref, rtol=tol, atol=tol):
                raise AssertionError(f"rank {rt.rank}: strategy {direction}/{name} disagrees")
        steps = {name: (lambda fn=fn, arg=arg: fn(arg)) for name, fn in impls.items()}
        timings = time_steps(rt, steps, **timing)
        for name, t in timings.items():
            rows.append(
                {
                    "direction": direction,
                    "strategy": name,
                    "pattern": pattern,
                    "tokens": tokens,
                    "counts": counts,
                    "world": world,
                    "time_s": t.median_s,
                    "min_s": t.min_s,
                    "cpu_s": t.cpu_s,
                    "minor_faults": t.minor_faults,
                    "repeats_s": list(t.repeats_s),
                    "iters": t.iters,
                    "peak_bytes": peak_extra_bytes(rt, steps[name]) if cfg.memory else None,
                }
            )
    return rows
