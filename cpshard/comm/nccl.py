"""The native NCCL communicator as a :class:`cpshard.comm.Transport` (CUDA builds only).

One communicator per torch process group, created on first use: rank 0 makes a NCCL unique id
and broadcasts it over the torch group; every rank then builds its communicator on its current
CUDA device. Calls run on torch's current CUDA stream.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from cpshard.comm.group import Group
from cpshard.comm.verbs import all_to_all_parts

_cache: weakref.WeakKeyDictionary[dist.ProcessGroup, NcclTransport] = weakref.WeakKeyDictionary()


class NcclTransport:
    """The transport verbs on a native ``cpshard::NcclCommunicator``."""

    def __init__(self, group: Group) -> None:
        assert group.pg is not None
        device = torch.cuda.current_device()
        uid = torch.ops.cpshard.NcclCommunicator.unique_id() if group.rank == 0 else torch.empty(0)
        box = [uid.tolist()]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group.pg, 0), group=group.pg)
        unique_id = torch.tensor(box[0], dtype=torch.uint8)
        self.comm = torch.classes.cpshard.NcclCommunicator(unique_id, group.rank, group.world, device)
        self.rank = group.rank

    def all_gather(self, out: torch.Tensor, local: torch.Tensor) -> None:
        self.comm.all_gather(out, local.contiguous().view(-1))

    def all_gather_v(self, out: torch.Tensor, local: torch.Tensor, sizes: Sequence[int]) -> None:
        self.comm.all_gather_v(out, local.contiguous().view(-1), list(sizes))

    def all_to_all_v(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        send_sizes: Sequence[int],
        recv_sizes: Sequence[int],
        key: int | None = None,
    ) -> None:
        """Own part copied, the others in one grouped send/recv (``key`` is not swapped here)."""
        x = x.contiguous().view(-1)
        self.send_recv(*all_to_all_parts(self.rank, out, x, send_sizes, recv_sizes))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.reduce_scatter(out, full.contiguous().view(-1))

    def reduce_scatter_v(self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]) -> None:
        self.comm.reduce_scatter_v(out, full.contiguous().view(-1), list(sizes))

    def send_recv(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        self.comm.send_recv(
            [t.contiguous().view(-1) for _, t in sends],
            [r for r, _ in sends],
            [t for _, t in recvs],
            [r for r, _ in recvs],
        )


def communicator(group: Group, device: torch.device) -> NcclTransport:
    """The cached communicator of ``group``'s process group (created collectively on first use)."""
    assert group.pg is not None
    found = _cache.get(group.pg)
    if found is None:
        found = _cache[group.pg] = NcclTransport(group)
    return found
