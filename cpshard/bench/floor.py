"""The wire floor: bare transfers of exactly the useful bytes between preallocated buffers — no
autograd, no consensus, no staging copies, no padding. An op's time over its floor is what its
bookkeeping, copies, reductions and transfer strategy cost.

Like the baselines, these call ``torch.distributed`` directly: they measure the backend itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from cpshard.bench.runtime import Runtime
from cpshard.comm import offsets
from cpshard.comm.torch_compat import all_gather_single

Transfer = Callable[[], None]


def p2p_exchange(
    pg: dist.ProcessGroup,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
) -> None:
    """One batch of isend/irecv (empty tensors skipped), waited for: a bare transfer."""
    ops = [
        dist.P2POp(dist.isend, t, dist.get_global_rank(pg, r), pg) for r, t in sends if t.numel()
    ]
    ops += [
        dist.P2POp(dist.irecv, t, dist.get_global_rank(pg, r), pg) for r, t in recvs if t.numel()
    ]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def gather_floors(
    rt: Runtime, sizes: Sequence[int]
) -> tuple[dict[str, Transfer], dict[str, Transfer]]:
    """Bare all-gather-v (forward) and reduce-scatter-v (backward) of ``sizes[r]`` elements per
    rank: ``({name: transfer}, {name: transfer})``, each by point-to-point and by
    ``all_to_all_single`` (and by ``all_gather_single`` when the sizes are equal)."""
    pg, me, world = rt.pg, rt.rank, rt.world
    sizes = list(sizes)
    offs, n = offsets(sizes), sizes[me]
    peers = [r for r in range(world) if r != me]
    kw = {"dtype": rt.dtype, "device": rt.device}
    out = torch.zeros(offs[-1], **kw)
    local = torch.zeros(n, **kw)
    repeated = torch.zeros(world * n, **kw)  # what all_to_all_single sends for a gather
    full = torch.zeros(offs[-1], **kw)  # the gradient of the gathered tensor
    stage = torch.zeros(world * n, **kw)  # one slot per source rank

    def fwd_p2p() -> None:
        p2p_exchange(
            pg, [(r, local) for r in peers], [(r, out[offs[r] : offs[r + 1]]) for r in peers]
        )

    def fwd_a2a() -> None:
        dist.all_to_all_single(
            out, repeated, output_split_sizes=sizes, input_split_sizes=[n] * world, group=pg
        )

    def fwd_all_gather() -> None:
        all_gather_single(out, local, group=pg)

    def bwd_p2p() -> None:
        p2p_exchange(
            pg,
            [(r, full[offs[r] : offs[r + 1]]) for r in peers],
            [(r, stage[r * n : (r + 1) * n]) for r in peers],
        )

    def bwd_a2a() -> None:
        dist.all_to_all_single(
            stage, full, output_split_sizes=[n] * world, input_split_sizes=sizes, group=pg
        )

    fwd: dict[str, Transfer] = {"p2p": fwd_p2p, "all_to_all": fwd_a2a}
    if len(set(sizes)) == 1:
        fwd["all_gather"] = fwd_all_gather
    return fwd, {"p2p": bwd_p2p, "all_to_all": bwd_a2a}


def exchange_floor(
    rt: Runtime, sends: Sequence[tuple[int, int]], recvs: Sequence[tuple[int, int]]
) -> Transfer:
    """Bare point-to-point exchange: ``sends``/``recvs`` are (peer, elements) pairs."""
    kw = {"dtype": rt.dtype, "device": rt.device}
    send_bufs = [(r, torch.zeros(k, **kw)) for r, k in sends]
    recv_bufs = [(r, torch.zeros(k, **kw)) for r, k in recvs]
    return lambda: p2p_exchange(rt.pg, send_bufs, recv_bufs)
