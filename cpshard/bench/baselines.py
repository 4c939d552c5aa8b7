"""The straightforward implementations a user writes by hand, as the bench's baselines.

The collectives call ``torch.distributed`` directly on purpose: they stand for user code, not
for the library (whose collectives all go through :mod:`cpshard.comm`). ``all_gather_single``
and ``reduce_scatter_single`` are the 2.13 names of ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` (same collectives, without the deprecation warning).
:func:`plan_prefix_quantile` is the planner baseline: the usual prefix-quantile cut that
:func:`cpshard.vision.plan_contiguous` beats.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cpshard.comm.torch_compat import all_gather_single, reduce_scatter_single


def plan_prefix_quantile(costs: Sequence[int], world: int) -> list[int] | None:
    """The prefix-quantile cut: cut ``r`` after the last entry whose cumulative cost is
    ``<= total * r / world`` (exact for the integer costs :func:`cpshard.vision.frame_costs`
    returns), clamped so that every rank keeps >= 1 entry. Up to ~2x worse than
    :func:`cpshard.vision.plan_contiguous` in its largest rank cost; the same cut points
    (``world + 1`` of them), or ``None`` when there are fewer entries than ranks."""
    if world < 1:
        raise ValueError(f"plan_prefix_quantile: world must be >= 1, got {world}")
    n = len(costs)
    if n < world:
        return None
    prefix = list(itertools.accumulate(costs, initial=0))
    total = prefix[n]
    cuts = [0]
    for r in range(1, world):
        j = bisect_right(prefix, (total * r) // world) - 1
        cuts.append(max(cuts[-1] + 1, min(j, n - (world - r))))
    cuts.append(n)
    return cuts


class PadAllGatherRagged(torch.autograd.Function):
    """Ragged blocks ``[n_r, ...]`` -> ``[sum n_r, ...]`` the way NeMo-style code does it: pad
    every block to the largest count, all-gather the padded blocks, slice each rank's rows and
    concatenate. Backward: pad the gradient rows back into ``[W, max_n, ...]`` and
    reduce-scatter it, keeping this rank's first ``n_r`` rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: dist.ProcessGroup, counts: list[int]) -> torch.Tensor:
        ctx.pg, ctx.counts = pg, counts
        m, world = max(counts), len(counts)
        padded = x.new_zeros((m, *x.shape[1:]))
        padded[: x.shape[0]] = x
        gathered = x.new_empty((world * m, *x.shape[1:]))
        all_gather_single(gathered.view(-1), padded.view(-1), group=pg)  # flat: gloo
        return torch.cat([gathered[r * m : r * m + c] for r, c in enumerate(counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, pg = ctx.counts, ctx.pg
        m, world, rank = max(counts), len(counts), dist.get_rank(pg)
        padded = grad.new_zeros((world, m, *grad.shape[1:]))
        for r, block in enumerate(grad.split(counts)):
            padded[r, : counts[r]] = block
        out = grad.new_empty((m, *grad.shape[1:]))
        reduce_scatter_single(out.view(-1), padded.view(-1), group=pg)
        return out[: counts[rank]], None, None


class ListAllGatherCat(torch.autograd.Function):
    """Equal shards -> full sequence by the list all-gather + ``torch.cat`` along ``dim``;
    backward: split the gradient into contiguous chunks and reduce-scatter them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.pg, ctx.dim = pg, dim
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(pg))]
        dist.all_gather(parts, x, group=pg)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.pg)
        chunks = [c.contiguous() for c in grad.chunk(world, dim=ctx.dim)]
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter(out, chunks, group=ctx.pg)
        return out, None, None


class AllGatherTailsHalo(torch.autograd.Function):
    """Halo by all-gather: every rank all-gathers the last ``min(halo, L)`` tokens of every
    shard (the whole shards when the window spans several ranks), and rank r prepends the last
    ``min(halo, r*L)`` tokens that precede its shard. Backward: the halo rows' gradient goes
    back into a ``[W, T, ...]`` buffer (zeros elsewhere) that is reduce-scattered and added to
    the shard's last ``T`` rows. ``x`` is ``[B, L, ...]`` with the sequence on ``dim``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: dist.ProcessGroup, halo: int, dim: int) -> torch.Tensor:
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        length = x.shape[dim]
        tail = min(halo, length)
        h = min(halo, rank * length)
        ctx.pg, ctx.dim, ctx.tail, ctx.h = pg, dim, tail, h
        mine = x.narrow(dim, length - tail, tail).contiguous()
        gathered = x.new_empty((world, *mine.shape))
        all_gather_single(gathered.view(-1), mine.view(-1), group=pg)  # flat: gloo
        before = (
            torch.cat(list(gathered[:rank].unbind(0)), dim=dim) if rank else x.narrow(dim, 0, 0)
        )
        return torch.cat([before.narrow(dim, before.shape[dim] - h, h), x], dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        pg, dim, tail, h = ctx.pg, ctx.dim, ctx.tail, ctx.h
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        grad_x = grad.narrow(dim, h, grad.shape[dim] - h).clone()
        shape = list(grad_x.shape)
        shape[dim] = tail
        buf = grad.new_zeros((world, *shape))
        if h:
            # the window's rows, last row first: rank r-1's tail, then r-2's, ...
            window = grad.narrow(dim, 0, h)
            for k, q in enumerate(range(rank - 1, -1, -1)):
                end = h - k * tail
                if end <= 0:
                    break
                take = min(tail, end)
                buf[q].narrow(dim, tail - take, take).copy_(window.narrow(dim, end - take, take))
        mine = grad.new_empty(shape)
        reduce_scatter_single(mine.view(-1), buf.view(-1), group=pg)
        grad_x.narrow(dim, grad_x.shape[dim] - tail, tail).add_(mine)
        return grad_x, None, None, None
