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


def _cp_group(
    world: int, mesh: tuple[int, int] | None, dp: int
) -> dist.ProcessGroup | DeviceMesh:
    """The CP group of the first data-parallel replica (ranks ``0 .. world - 1``)."""
    if mesh is None:
        if dp == 1:
            return dist.group.WORLD
        return init_device_mesh("cpu", (dp, world), mesh_dim_names=("dp", "cp"))["cp"].get_group()
    if dp == 1:
        return init_device_mesh("cpu", mesh, mesh_dim_names=("inter", "intra"))
    every = init_device_mesh("cpu", (dp, *mesh), mesh_dim_names=("dp", "inter", "intra"))
    return every["inter", "intra"]


@contextmanager
def simulated_rank(
    rank: int, world: int, mesh: tuple[int, int] | None = None, dp: int = 1
) -> Iterator[dist.ProcessGroup | DeviceMesh]:
    """Inside the block this process is CP rank ``rank`` of ``world`` on the fake backend, in
    the first of ``dp`` data-parallel replicas (the fake world has ``dp * world`` ranks, this one
    ``rank``); yields the CP group (the default group when ``dp`` is 1) or, for
    ``mesh=(inter, intra)``, the 2-D ``DeviceMesh`` with dims ``("inter", "intra")``. The groups
    are destroyed on exit. Refuses to run in a process that already has a default group (it
    would be lost)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

    if not 0 <= rank < world:
        raise ValueError(f"rank: {rank} is out of range for world {world}")
    if mesh is not None and mesh[0] * mesh[1] != world:
        raise ValueError(f"mesh: {mesh[0]}x{mesh[1]} does not have {world} ranks")
    if dp < 1:
        raise ValueError(f"dp: must be >= 1, got {dp}")
    if dist.is_initialized():
        raise RuntimeError(
            "simulated_rank: this process already has a default process group; simulate in a "
            "process of its own"
        )
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=dp * world)
    try:
        # torch's Python stores cannot take StoreChannel's ``append`` through the group's
        # PrefixStore, so the channel is handed the echo store directly.
        with mock.patch.object(host, "_store_of", _echo_store_of):
            yield _cp_group(world, mesh, dp)
    finally:
        dist.destroy_process_group()

