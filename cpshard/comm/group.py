"""Group resolution: what every CP function accepts as ``group``, resolved once per call."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

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

    @property
    def name(self) -> str:
        """The process group's registered name: the key the transport custom ops take, so a
        traced graph names its group by a string (as torch's functional collectives do)."""
        if self.pg is None:
            raise RuntimeError(
                f"cpshard: rank {self.rank} of {self.world}: this CP group has no process group "
                "(torch.distributed is not initialized), so no collective can run over it"
            )
        return self.pg.group_name


def resolve_group(group: GroupLike, what: str) -> Group:
    """``group`` (ProcessGroup | 1-D DeviceMesh | None, or a :class:`Group` already resolved,
    returned as is) as a :class:`Group`."""
    if group is None:
        return Group(None, 0, 1)
    if isinstance(group, Group):
        return group
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"{what}: group must be a 1-D DeviceMesh, got a {group.ndim}-D mesh")
        group = group.get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{what}: group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}"
        )
    return Group(group, dist.get_rank(group), dist.get_world_size(group))


def group_from_name(name: str) -> Group:
    """The :class:`Group` registered under ``name`` (inside the transport custom ops)."""
    pg = dist.distributed_c10d._resolve_process_group(name)
    return Group(pg, dist.get_rank(pg), dist.get_world_size(pg))


def global_ranks(group: Group) -> tuple[list[int], int]:
    """``(the group's members as global ranks, this process's global rank)``."""
    if group.pg is None:
        return [0], 0
    return dist.get_process_group_ranks(group.pg), dist.get_rank()


def split_cp_mesh(
    group: GroupLike, what: str
) -> tuple[GroupLike, tuple[Group, Group] | None]:
    """A 2-D DeviceMesh ``(inter, intra)`` as its flattening (the CP group: rank ``inter *
    intra_size + intra``) and its dims' groups; any other ``group`` as is, with None."""
    if not isinstance(group, DeviceMesh) or group.ndim != 2:
        return group, None
    if not group.mesh_dim_names:
        raise ValueError(
            f"{what}: a 2-D CP mesh needs mesh_dim_names (e.g. ('inter', 'intra')) to be "
            "flattened into the CP group"
        )
    flat = group._flatten()
    inter, intra = (resolve_group(group.get_group(d), what) for d in (0, 1))
    rank = dist.get_rank(flat.get_group())
    if rank != inter.rank * intra.world + intra.rank:
        raise ValueError(
            f"{what}: rank {rank}: the flattened CP mesh numbers its ranks {rank}, not inter "
            f"{inter.rank} x {intra.world} + intra {intra.rank}"
        )
    return flat, (inter, intra)
