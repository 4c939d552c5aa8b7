"""The host-side channel: the per-step consensus rounds run here, never on a CUDA stream.

A gloo group is its own host channel (one all-to-all of a tiny CPU vector). Any other group
(NCCL) exchanges through the store its ranks rendezvoused with: every rank writes its payload
under a per-round key and reads everyone's. That costs no device->host sync, no pageable copy
and nothing on a GPU stream, and it creates no extra process group (whose lazy creation from
only a CP group's ranks cannot be made safe next to the application's own groups).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from cpshard.comm.group import Group

_PREFIX = "cpshard/host"


class _StoreChannel:
    """All-gathers of bytes over a process group's store, one key per rank and round.

    Every rank of the group calls :meth:`all_gather` the same number of times (consensus is
    collective), so round numbers agree. A rank deletes its key of round n - 2 in round n: every
    rank has read it by then (it wrote its round n - 1 key after reading round n - 2's)."""

    def __init__(self, pg: dist.ProcessGroup, rank: int, world: int) -> None:
        self.store = dist.distributed_c10d._world.pg_map[pg][1]
        self.rank, self.world = rank, world
        self.round = 0

    def _key(self, n: int, rank: int) -> str:
        return f"{_PREFIX}/{n}/{rank}"

    def all_gather(self, payload: bytes) -> list[bytes]:
        n, self.round = self.round, self.round + 1
        self.store.set(self._key(n, self.rank), payload)
        keys = [self._key(n, r) for r in range(self.world)]
        self.store.wait(keys)
        out = [self.store.get(k) for k in keys]
        if n >= 2:
            self.store.delete_key(self._key(n - 2, self.rank))
        return out


_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, _StoreChannel] = weakref.WeakKeyDictionary()


def all_gather_bytes(payload: bytes, group: Group) -> list[bytes]:
    """Every rank's ``payload``, in rank order, over the group's store (any backend)."""
    assert group.pg is not None
    channel = _channels.get(group.pg)
    if channel is None:
        channel = _channels[group.pg] = _StoreChannel(group.pg, group.rank, group.world)
    return channel.all_gather(payload)


def all_gather_small(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's copy of a small int64 CPU vector, stacked ``[W, n]`` (consensus checks)."""
    assert group.pg is not None
    local = local.to(device="cpu", dtype=torch.int64).contiguous()
    if group.backend == "gloo":
        out = local.new_empty(group.world * local.numel())
        # gloo's all-to-all of a tiny vector is faster than its all-gather (one round, no ring).
        dist.all_to_all_single(out, local.repeat(group.world), group=group.pg)
        return out.view(group.world, -1)
    rows = all_gather_bytes(local.numpy().tobytes(), group)
    return torch.stack([torch.frombuffer(bytearray(r), dtype=torch.int64) for r in rows])
