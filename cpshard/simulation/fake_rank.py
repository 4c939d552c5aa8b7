"""Make this process "rank r of a W-rank job" on torch's fake backend, so one process can plan
any rank's step exactly as that rank would.

Every collective of the ``fake`` backend is a no-op. cpshard's per-step consensus all-gathers a
few bytes over the group's store (:class:`cpshard.comm.host.StoreChannel`); here that store is
an :class:`EchoStore`, which answers as if every rank had sent the same bytes as this one: the
ranks of a real job agree (they plan from the same batch), so each check passes as it would.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpshard.comm import host

_FRAME = struct.Struct("<II")  # (rank, length) in front of each payload, as StoreChannel frames


class EchoStore:
    """The store operations :class:`~cpshard.comm.host.StoreChannel` uses, answered for a group
    of ``world`` ranks that all sent this rank's payload: ``add`` returns ``world`` (every rank
    arrived), ``get`` returns the round's payload framed once per rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.data: dict[str, bytes] = {}

    def append(self, key: str, value: bytes) -> None:
        self.data[key] = bytes(value)

    def add(self, key: str, value: int) -> int:
        return self.world

    def set(self, key: str, value: bytes) -> None:
        pass

    def wait(self, keys: list[str], *timeout: object) -> None:
        pass

    def get(self, key: str) -> bytes:
        blob = self.data[key]
        _, size = _FRAME.unpack_from(blob)
        payload = blob[_FRAME.size :]
        return b"".join(_FRAME.pack(r, size) + payload for r in range(self.world))

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None


def _echo_store_of(pg: dist.ProcessGroup) -> EchoStore:
    return EchoStore(pg.size())


@contextmanager
def simulated_rank(
    rank: int, world: int, mesh: tuple[int, int] | None = None
) -> Iterator[dist.ProcessGroup | DeviceMesh]:
    """Inside the block this process is rank ``rank`` of ``world`` on the fake backend; yields
    the CP group (the default group) or, for ``mesh=(inter, intra)``, the 2-D ``DeviceMesh``
    with dims ``("inter", "intra")``. The group is destroyed on exit. Refuses to run in a
    process that already has a default group (it would be lost)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is out of range for world {world}")
    if mesh is not None and mesh[0] * mesh[1] != world:
        raise ValueError(f"mesh: {mesh[0]}x{mesh[1]} does not have {world} ranks")
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_rank: this process already has a default process group; simulate in a "
            "process of its own"
        )
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    try:
        # torch's Python stores cannot take StoreChannel's ``append`` through the group's
        # PrefixStore, so the channel is handed the echo store directly.
        with mock.patch.object(host, "_store_of", _echo_store_of):
            if mesh is None:
                yield dist.group.WORLD
            else:
                yield init_device_mesh("cpu", mesh, mesh_dim_names=("inter", "intra"))
    finally:
        dist.destroy_process_group()
