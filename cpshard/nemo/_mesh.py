"""NeMo's duck-typed CP meshes: objects with ``get_group()`` and ``size()`` (and usually
``get_local_rank()``), as NeMo Automodel's components accept them, resolved to the
:class:`cpshard.comm.Group` that cpshard's functions take."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpshard.comm import Group
from cpshard.validation import is_int


def is_duck_mesh(mesh: Any) -> bool:
    """An object that is not a DeviceMesh / ProcessGroup / :class:`Group` but has callable
    ``get_group`` and ``size``."""
    if mesh is None or isinstance(mesh, (DeviceMesh, dist.ProcessGroup, Group)):
        return False
    return callable(getattr(mesh, "get_group", None)) and callable(getattr(mesh, "size", None))


def cp_group(mesh: Any, what: str, arg: str) -> Any:
    """``mesh`` as cpshard takes it: a duck-typed mesh becomes a :class:`Group` of its
    ``size()`` ranks (this rank from ``get_local_rank()``, else from its process group) over
    ``get_group()``; anything else is returned unchanged (cpshard checks it).

    A duck mesh of one rank is ``None`` (no CP). One of several ranks gives its process group
    (``ValueError`` when the group's size is not ``size()``; the group itself is checked when it
    is first used for a collective). ``get_group()`` may return None only while
    ``torch.distributed`` is not initialized (an offline mesh, as in single-process tests): the
    layout-only verbs work with its rank and size, and any collective raises. With
    ``torch.distributed`` initialized it raises ``TypeError`` (a collective would otherwise run
    over the default group).
    """
    if not is_duck_mesh(mesh):
        return mesh
    world = mesh.size()
    if not is_int(world) or world < 1:
        raise TypeError(f"{what}: {arg}.size() must return an int >= 1, got {world!r}")
    local = getattr(mesh, "get_local_rank", None)
    rank = local() if callable(local) else None
    if world == 1:
        return None
    pg = mesh.get_group()
    if pg is None:
        where = "" if rank is None else f"rank {rank}: "
        if rank is None or (dist.is_available() and dist.is_initialized()):
            raise TypeError(
                f"{what}: {where}{arg}.get_group() returned None but {arg}.size() is {world}: a CP "
                "mesh of more than one rank must give its process group (and get_local_rank())"
            )
    if rank is None:
        rank = dist.get_rank(pg)
    if not is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"{what}: {arg}.get_local_rank() must be in [0, {world}), got {rank!r}")
    offline = not (dist.is_available() and dist.is_initialized())
    if pg is None or (offline and not isinstance(pg, dist.ProcessGroup)):
        # offline (torch.distributed is not initialized): no collective can run, so the group
        # is this rank and the size alone; the per-step agreement is local (see consensus.agree)
        return Group(None, rank, world)
    group_world = dist.get_world_size(pg)
    if group_world != world:
        raise ValueError(
            f"{what}: rank {rank}: {arg}.get_group() has {group_world} ranks but {arg}.size() is "
            f"{world}: the CP sub-group is mis-resolved"
        )
    return Group(pg, rank, world)
