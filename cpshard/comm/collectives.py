"""The transport verbs as ``torch.library`` custom ops keyed by group name.

Like torch's functional collectives (and vLLM's ``torch.ops.vllm.*``), each verb is an op with a
schema, a fake kernel and an autograd formula whose backward is the dual verb, and it names its
process group by the registered group name (a string): ``torch.compile(fullgraph=True)`` traces
a call as one opaque node, forward and backward, with no graph break. Each op issues its data
transfer and nothing else (no consensus, no host read of tensor data); outputs are fresh
allocations, flat for the gathers so that callers view them in their own layout for free.

* ``cpshard::all_gather_v(local, group, sizes, key)`` -> every rank's ``sizes[r]`` elements back
  to back in rank order; backward: ``reduce_scatter_v`` of the gradient.
* ``cpshard::reduce_scatter_v(full, group, sizes, key)`` -> this rank's ``sizes[rank]`` elements
  of the sum over ranks; backward: ``all_gather_v`` of the gradient.
* ``cpshard::all_to_all_v(x, group, send_sizes, recv_sizes, key)`` -> the parts every rank
  sent this one (``recv_sizes[r]`` elements from rank r) back to back in rank order, from ``x``
  holding this rank's ``send_sizes[r]`` elements for each rank r; backward: the reverse
  exchange (sizes swapped).
* ``cpshard::halo_exchange(x, group, halos, left_padding, dim, key)`` -> ``x`` with the preceding
  ``min(r*L, halos[r])`` tokens (from as many ranks as they span) and ``left_padding`` zeros in
  front along ``dim``; backward: ``cpshard::halo_return``, each halo row's gradient sent back to
  its owner and added there.

``key`` is the caller's fingerprint of the arguments every rank must agree on; on gloo it is the
messages' tag, so ranks that disagree never match (:meth:`cpshard.comm.TorchTransport.send_recv`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard.comm import verbs
from cpshard.comm.group import group_from_name
from cpshard.comm.hugepages import new_buffer
from cpshard.comm.nvtx import nvtx_range
from cpshard.comm.select import transport_for

# ------------------------------------------------------------------ gathers / reduce-scatters


@torch.library.custom_op("cpshard::all_gather_v", mutates_args=())
def all_gather_v(local: torch.Tensor, group_name: str, sizes: Sequence[int], key: int) -> torch.Tensor:
    """Every rank's flat part (``sizes[r]`` elements) back to back in rank order."""
    group = group_from_name(group_name)
    out = new_buffer(local, sum(sizes))
    comm = transport_for(group, local)
    with nvtx_range("cpshard.all_gather_v", local):
        if all(s == sizes[0] for s in sizes):
            comm.all_gather(out, local.contiguous().view(-1), key)
        else:
            comm.all_gather_v(out, local.contiguous().view(-1), sizes, key)
    return out


@all_gather_v.register_fake
def _all_gather_v_fake(local: torch.Tensor, group_name: str, sizes: Sequence[int], key: int) -> torch.Tensor:
    return local.new_empty(sum(sizes))


@torch.library.custom_op("cpshard::reduce_scatter_v", mutates_args=())
def reduce_scatter_v(full: torch.Tensor, group_name: str, sizes: Sequence[int], key: int) -> torch.Tensor:
    """This rank's part (``sizes[rank]`` elements) of the sum over ranks of ``full``."""
    group = group_from_name(group_name)
    out = new_buffer(full, sizes[group.rank])
    comm = transport_for(group, full)
    with nvtx_range("cpshard.reduce_scatter_v", full):
        if all(s == sizes[0] for s in sizes):
            comm.reduce_scatter(out, full.contiguous().view(-1))
        else:
            comm.reduce_scatter_v(out, full.contiguous().view(-1), sizes)
    return out


@reduce_scatter_v.register_fake
def _reduce_scatter_v_fake(full: torch.Tensor, group_name: str, sizes: Sequence[int], key: int) -> torch.Tensor:
    return full.new_empty(sizes[group_from_name(group_name).rank])


def _keep_group_and_sizes(ctx, inputs, output) -> None:
    first, ctx.group_name, ctx.sizes, ctx.key = inputs
    ctx.shape = first.shape


def _all_gather_v_backward(ctx, grad: torch.Tensor):
    return reduce_scatter_v(grad, ctx.group_name, ctx.sizes, ctx.key).view(ctx.shape), None, None, None


def _reduce_scatter_v_backward(ctx, grad: torch.Tensor):
    return all_gather_v(grad, ctx.group_name, ctx.sizes, ctx.key).view(ctx.shape), None, None, None


all_gather_v.register_autograd(_all_gather_v_backward, setup_context=_keep_group_and_sizes)
reduce_scatter_v.register_autograd(_reduce_scatter_v_backward, setup_context=_keep_group_and_sizes)


# ------------------------------------------------------------------ all-to-all-v


@torch.library.custom_op("cpshard::all_to_all_v", mutates_args=())
def all_to_all_v(
    x: torch.Tensor,
    group_name: str,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    key: int,
) -> torch.Tensor:
    """``x`` flat, ``send_sizes[r]`` elements for rank r back to back -> the ``recv_sizes[r]``
    elements every rank r sent this one, back to back in rank order."""
    group = group_from_name(group_name)
    out = new_buffer(x, sum(recv_sizes))
    with nvtx_range("cpshard.all_to_all_v", x):
        verbs.all_to_all_v(transport_for(group, x), group.rank, out, x, send_sizes, recv_sizes, key)
    return out


@all_to_all_v.register_fake
def _all_to_all_v_fake(
    x: torch.Tensor, group_name: str, send_sizes: Sequence[int], recv_sizes: Sequence[int], key: int
) -> torch.Tensor:
    return x.new_empty(sum(recv_sizes))


def _keep_all_to_all_args(ctx, inputs, output) -> None:
    x, ctx.group_name, ctx.send_sizes, ctx.recv_sizes, ctx.key = inputs
    ctx.shape = x.shape


def _all_to_all_v_backward(ctx, grad: torch.Tensor):
    back = all_to_all_v(grad, ctx.group_name, ctx.recv_sizes, ctx.send_sizes, ctx.key)
    return back.view(ctx.shape), None, None, None, None


all_to_all_v.register_autograd(_all_to_all_v_backward, setup_context=_keep_all_to_all_args)


# ------------------------------------------------------------------ halo exchange


@dataclass(frozen=True)
class HaloPlan:
    """Who sends which rows to whom, derived identically on every rank.

    ``recvs``: (source rank, lo, hi, halo offset): rows [lo, hi) of the source's shard land in
    this rank's halo at the offset; ``sends``: (dest rank, lo, hi): rows [lo, hi) of this
    shard go to that rank.
    """

    halo: int  # tokens this rank receives
    recvs: tuple[tuple[int, int, int, int], ...]
    sends: tuple[tuple[int, int, int], ...]


def halo_plan(rank: int, world: int, length: int, halos: Sequence[int]) -> HaloPlan:
    """The plan of ``rank`` when every rank holds ``length`` tokens and rank r receives the
    ``min(r * length, halos[r])`` tokens before its shard."""

    def window(r: int) -> tuple[int, int]:
        h = min(r * length, halos[r])
        return r * length - h, r * length

    begin, end = window(rank)
    recvs = []
    for q in range(world):
        lo, hi = max(begin, q * length), min(end, (q + 1) * length)
        if lo < hi:
            recvs.append((q, lo - q * length, hi - q * length, lo - begin))
    sends = []
    mine = (rank * length, (rank + 1) * length)
    for r in range(world):
        b, e = window(r)
        lo, hi = max(b, mine[0]), min(e, mine[1])
        if r != rank and lo < hi:
            sends.append((r, lo - mine[0], hi - mine[0]))
    return HaloPlan(end - begin, tuple(recvs), tuple(sends))


def _halo_len(group_name: str, halos: Sequence[int], length: int) -> int:
    group = group_from_name(group_name)
    return min(group.rank * length, halos[group.rank])


@torch.library.custom_op("cpshard::halo_exchange", mutates_args=())
def halo_exchange(
    x: torch.Tensor, group_name: str, halos: Sequence[int], left_padding: int, dim: int, key: int
) -> torch.Tensor:
    """``[left_padding zeros, halo rows from the preceding ranks, x]`` along ``dim``."""
    group = group_from_name(group_name)
    plan = halo_plan(group.rank, group.world, x.shape[dim], halos)
    out_shape = list(x.shape)
    out_shape[dim] = left_padding + plan.halo + x.shape[dim]
    out = new_buffer(x, out_shape)
    out.narrow(dim, 0, left_padding).zero_()
    out.narrow(dim, left_padding + plan.halo, x.shape[dim]).copy_(x)
    direct = all(s == 1 for s in out_shape[:dim])  # a rank's slot is contiguous
    recvs, copies = [], []
    for q, lo, hi, at in plan.recvs:
        slot = out.narrow(dim, left_padding + at, hi - lo)
        buf = slot if direct else x.new_empty(slot.shape)
        recvs.append((q, buf))
        if not direct:
            copies.append((slot, buf))
    sends = [(r, x.narrow(dim, lo, hi - lo)) for r, lo, hi in plan.sends]
    with nvtx_range("cpshard.halo_exchange", x):
        transport_for(group, x).send_recv(sends, recvs, key)
    for slot, buf in copies:
        slot.copy_(buf)
    return out


@halo_exchange.register_fake
def _halo_exchange_fake(
    x: torch.Tensor, group_name: str, halos: Sequence[int], left_padding: int, dim: int, key: int
) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = left_padding + _halo_len(group_name, halos, x.shape[dim]) + x.shape[dim]
    return x.new_empty(shape)


@torch.library.custom_op("cpshard::halo_return", mutates_args=())
def halo_return(
    grad: torch.Tensor, group_name: str, halos: Sequence[int], left_padding: int, dim: int, key: int
) -> torch.Tensor:
    """Adjoint of :func:`halo_exchange`: the gradient of ``x``, each halo row's gradient added
    by the rank that owns the row."""
    group = group_from_name(group_name)
    length = _shard_len(group.rank, grad.shape[dim] - left_padding, halos)
    plan = halo_plan(group.rank, group.world, length, halos)
    lp = left_padding
    grad_x = grad.narrow(dim, lp + plan.halo, length).clone(memory_format=torch.contiguous_format)
    sends = [(q, grad.narrow(dim, lp + at, hi - lo)) for q, lo, hi, at in plan.recvs]
    recvs = [(r, grad.new_empty(grad_x.narrow(dim, lo, hi - lo).shape)) for r, lo, hi in plan.sends]
    with nvtx_range("cpshard.halo_return", grad):
        # No fingerprint: the forward exchange matched on the same arguments (whether a backward
        # follows included), so the return cannot mismatch; ``key`` serves its own backward.
        transport_for(group, grad).send_recv(sends, recvs)
    for (_, lo, hi), (_, buf) in zip(plan.sends, recvs):
        grad_x.narrow(dim, lo, hi - lo).add_(buf)
    return grad_x


def _shard_len(rank: int, extended: int, halos: Sequence[int]) -> int:
    """L from ``halo + L`` (``min(rank * L, halos[rank]) + L``), solved for L."""
    if rank * extended <= (rank + 1) * halos[rank]:  # the halo is the whole prefix: (r+1) L
        return extended // (rank + 1)
    return extended - halos[rank]


@halo_return.register_fake
def _halo_return_fake(
    grad: torch.Tensor, group_name: str, halos: Sequence[int], left_padding: int, dim: int, key: int
) -> torch.Tensor:
    rank = group_from_name(group_name).rank
    shape = list(grad.shape)
    shape[dim] = _shard_len(rank, grad.shape[dim] - left_padding, halos)
    return grad.new_empty(shape)


def _keep_halo_args(ctx, inputs, output) -> None:
    _, ctx.group_name, ctx.halos, ctx.left_padding, ctx.dim, ctx.key = inputs


def _halo_exchange_backward(ctx, grad: torch.Tensor):
    args = (ctx.group_name, ctx.halos, ctx.left_padding, ctx.dim, ctx.key)
    return halo_return(grad, *args), None, None, None, None, None


def _halo_return_backward(ctx, grad: torch.Tensor):
    args = (ctx.group_name, ctx.halos, ctx.left_padding, ctx.dim, ctx.key)
    return halo_exchange(grad, *args), None, None, None, None, None


halo_exchange.register_autograd(_halo_exchange_backward, setup_context=_keep_halo_args)
halo_return.register_autograd(_halo_return_backward, setup_context=_keep_halo_args)
