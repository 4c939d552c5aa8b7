"""The host-side channel: the per-step consensus rounds run here, never on a CUDA stream.

A group whose CPU backend is gloo (a gloo group, or a ``"cpu:gloo,cuda:nccl"`` group) is its
own host channel: one all-to-all of a tiny CPU vector. Any other group (NCCL only) exchanges
through the store its ranks rendezvoused with, at a cost that does not grow with the group:
every rank appends its framed payload to one key per round, counts itself in, and reads the one
key back once every rank has (see :class:`StoreChannel`). That costs no device->host sync, no
pageable copy and nothing on a GPU stream, and it creates no extra process group (whose lazy
creation from only a CP group's ranks cannot be made safe next to the application's own groups).
"""

from __future__ import annotations

import struct
import weakref
from typing import Protocol

import torch
import torch.distributed as dist

from cpshard.comm.backend_name import device_backend
from cpshard.comm.group import Group

_PREFIX = "cpshard/host"
_FRAME = struct.Struct("<II")  # (rank, payload length) before each payload in a round's key


class StoreLike(Protocol):
    """The part of ``torch.distributed.Store`` the channel uses."""

    def append(self, key: str, value: bytes) -> None: ...
    def add(self, key: str, value: int) -> int: ...
    def set(self, key: str, value: bytes) -> None: ...
    def wait(self, keys: list[str]) -> None: ...
    def get(self, key: str) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...


class StoreChannel:
    """All-gathers of bytes over a store in O(1) requests per rank and round, whatever W.

    Round n, on every rank: ``append`` ``(rank, len, payload)`` to the round's data key, ``add``
    1 to its counter; the rank whose ``add`` returns W ``set``s the round's done key; every rank
    ``wait``s for that key and ``get``s the data key (all W payloads in one reply). Four requests
    per rank (five for the last to arrive), plus three deletes on rank 0: in round n it removes
    round n - 2's keys, which every rank has read by then (each appended in round n - 1, which
    rank 0 has seen complete, after reading round n - 2). Every rank of the group calls
    :meth:`all_gather` the same number of times (consensus is collective), so round numbers
    agree."""

    def __init__(self, store: StoreLike, rank: int, world: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"cpshard host channel: rank {rank} out of range for world {world}")
        self.store, self.rank, self.world = store, rank, world
        self.round = 0

    def _keys(self, n: int) -> tuple[str, str, str]:
        base = f"{_PREFIX}/{n}"
        return f"{base}/data", f"{base}/count", f"{base}/done"

    def all_gather(self, payload: bytes) -> list[bytes]:
        """Every rank's ``payload`` of this round, in rank order."""
        n, self.round = self.round, self.round + 1
        data, count, done = self._keys(n)
        self.store.append(data, _FRAME.pack(self.rank, len(payload)) + bytes(payload))
        if int(self.store.add(count, 1)) == self.world:
            self.store.set(done, b"1")
        self.store.wait([done])
        out = self._parse(bytes(self.store.get(data)), n)
        if n >= 2 and self.rank == 0:
            for key in self._keys(n - 2):
                self.store.delete_key(key)
        return out

    def _parse(self, blob: bytes, n: int) -> list[bytes]:
        parts: list[bytes | None] = [None] * self.world
        at = 0
        while at < len(blob):
            if len(blob) - at < _FRAME.size:
                raise RuntimeError(f"cpshard host channel: round {n} holds a truncated frame")
            rank, size = _FRAME.unpack_from(blob, at)
            at += _FRAME.size
            if rank >= self.world or parts[rank] is not None or at + size > len(blob):
                raise RuntimeError(
                    f"cpshard host channel: round {n} holds a bad frame (rank {rank} of "
                    f"{self.world}, {size} bytes): two groups share one store prefix?"
                )
            parts[rank] = blob[at : at + size]
            at += size
        missing = [r for r, p in enumerate(parts) if p is None]
        if missing:
            raise RuntimeError(f"cpshard host channel: round {n} lacks ranks {missing}")
        return [p for p in parts if p is not None]


_channels: weakref.WeakKeyDictionary[dist.ProcessGroup, StoreChannel] = weakref.WeakKeyDictionary()


def _store_of(pg: dist.ProcessGroup) -> StoreLike:
    """The store ``pg``'s ranks rendezvoused with (prefixed per group by torch)."""
    return dist.distributed_c10d._world.pg_map[pg][1]


def all_gather_bytes(payload: bytes, group: Group) -> list[bytes]:
    """Every rank's ``payload``, in rank order, over the group's store (any backend)."""
    assert group.pg is not None
    channel = _channels.get(group.pg)
    if channel is None:
        channel = _channels[group.pg] = StoreChannel(_store_of(group.pg), group.rank, group.world)
    return channel.all_gather(payload)


def all_gather_small(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's copy of a small int64 CPU vector, stacked ``[W, n]`` (consensus checks)."""
    assert group.pg is not None
    local = local.to(device="cpu", dtype=torch.int64).contiguous()
    if device_backend(group.backend, group.pg, "cpu") == "gloo":
        out = local.new_empty(group.world * local.numel())
        # gloo's all-to-all of a tiny vector is faster than its all-gather (one round, no ring).
        dist.all_to_all_single(out, local.repeat(group.world), group=group.pg)
        return out.view(group.world, -1)
    rows = all_gather_bytes(local.numpy().tobytes(), group)
    return torch.stack([torch.frombuffer(bytearray(r), dtype=torch.int64) for r in rows])
