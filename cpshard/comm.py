"""Group resolution and the collective verbs the transport layer is built from.

This is the only module that calls ``torch.distributed`` collectives or the native NCCL
communicator. Every verb takes flat, contiguous 1-D tensors of elements (the callers own the
layout), so a transport needs no knowledge of shapes or autograd. Two transports implement the
verbs: :class:`TorchTransport` (``torch.distributed``: gloo on CPU, NCCL through torch as a
fallback) and, in the CUDA build, the native NCCL communicator (``cpshard._nccl``).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpshard._build import build_info

GroupLike = dist.ProcessGroup | DeviceMesh | None


@dataclass(frozen=True)
class Group:
    """A resolved CP group: the process group (None for a single rank), this rank, the size."""

    pg: dist.ProcessGroup | None
    rank: int
    world: int

    @property
    def backend(self) -> str:
        return "none" if self.pg is None else str(dist.get_backend(self.pg))


def resolve_group(group: GroupLike, what: str) -> Group:
    """``group`` (ProcessGroup | 1-D DeviceMesh | None) as a :class:`Group`."""
    if group is None:
        return Group(None, 0, 1)
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{what}: group must be a 1-D DeviceMesh, got a {group.ndim}-D mesh")
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{what}: group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}"
        )
    return Group(group, dist.get_rank(group), dist.get_world_size(group))


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor (gloo silently corrupts non-contiguous tensors)."""
    return t.contiguous().view(-1)


class Transport(Protocol):
    """The collective verbs, all on flat contiguous tensors of one dtype.

    ``sizes[r]`` is rank r's number of elements; ``out``/``full`` hold every rank's part back to
    back in rank order (exact offsets, no padding).
    """

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None: ...
    def all_gather_v(self, out: torch.Tensor, local: torch.Tensor, sizes: Sequence[int]) -> None: ...
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None: ...
    def reduce_scatter_v(self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]) -> None: ...
    def send_recv(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None: ...


def _offsets(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


class TorchTransport:
    """The verbs on ``torch.distributed``.

    Strategy (measured on gloo over loopback, where bytes on the wire dominate; see README):
    uneven gathers go by batched point-to-point straight into each rank's slot of the output
    (no padding, no staging); uneven reduce-scatters by one ``all_to_all_single`` with exact
    splits into a ``[W, n_rank]`` staging buffer, summed in rank order (deterministic). Equal
    reduce-scatters on gloo take the same all-to-all route, since gloo emulates
    ``reduce_scatter_tensor`` with a full all-reduce (twice the traffic).
    """

    def __init__(self, group: Group) -> None:
        assert group.pg is not None
        self.group = group
        self.pg = group.pg
        self.is_gloo = group.backend == "gloo"

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.pg, rank)

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        dist.all_gather_single(out, _flat(local), group=self.pg)

    def all_gather_v(self, out: torch.Tensor, local: torch.Tensor, sizes: Sequence[int]) -> None:
        offs = _offsets(sizes)
        me = self.group.rank
        out[offs[me] : offs[me + 1]].copy_(_flat(local))
        if self.is_gloo or len(set(sizes)) > 1:
            peers = [r for r in range(self.group.world) if r != me]
            self.send_recv(
                [(r, out[offs[me] : offs[me + 1]]) for r in peers if sizes[me]],
                [(r, out[offs[r] : offs[r + 1]]) for r in peers if sizes[r]],
            )
        else:
            # In place: this rank's slot is the input (NCCL reads it before writing others).
            dist.all_gather_single(out, out[offs[me] : offs[me + 1]], group=self.pg)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        if self.is_gloo:
            self.reduce_scatter_v(out, full, [out.numel()] * self.group.world)
        else:
            dist.reduce_scatter_single(out, _flat(full), group=self.pg)

    def reduce_scatter_v(self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]) -> None:
        world, me = self.group.world, self.group.rank
        n = sizes[me]
        stage = full.new_empty(world * n)
        dist.all_to_all_single(
            stage, _flat(full), output_split_sizes=[n] * world, input_split_sizes=list(sizes), group=self.pg
        )
        torch.sum(stage.view(world, n), dim=0, out=out.view(n))

    def send_recv(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        ops = [dist.P2POp(dist.isend, _flat(t), self._peer(r), self.pg) for r, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._peer(r), self.pg) for r, t in recvs]
        for r, t in recvs:
            if not t.is_contiguous():
                raise RuntimeError(f"send_recv: receive buffer from rank {r} must be contiguous")
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def transport_for(group: Group, like: torch.Tensor) -> Transport:
    """The native NCCL communicator for CUDA tensors when built with it, else torch.distributed."""
    assert group.pg is not None
    if like.is_cuda and group.backend == "nccl" and build_info().nccl:
        from cpshard import _nccl

        return _nccl.communicator(group)
    return TorchTransport(group)


def all_gather_small(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's copy of a small int64 vector, stacked ``[W, n]`` (for consensus checks)."""
    assert group.pg is not None
    device = torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")
    local = local.to(device=device, dtype=torch.int64).contiguous()
    out = local.new_empty(group.world * local.numel())
    dist.all_gather_single(out, local, group=group.pg)
    return out.view(group.world, -1).cpu()


@contextmanager
def nvtx_range(name: str, like: torch.Tensor) -> Iterator[None]:
    """An NVTX range around a collective on CUDA tensors; nothing on CPU."""
    ctx = torch.cuda.nvtx.range(name) if like.is_cuda else nullcontext()
    with ctx:
        yield
