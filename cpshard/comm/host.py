"""The host-side channel: the per-step consensus rounds run here, never on a CUDA stream.

A gloo group is its own host channel. For any other backend (NCCL) a gloo group over the same
ranks shadows it, created once per group (with local synchronisation, so only the group's own
ranks take part) and reused every step: a consensus round then costs no device->host sync, no
pageable copy and nothing on the GPU stream the model's kernels run on.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from cpshard.comm.group import Group

_shadows: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def host_group(group: Group) -> dist.ProcessGroup:
    """The gloo process group that carries ``group``'s host-side traffic."""
    assert group.pg is not None
    if group.backend == "gloo":
        return group.pg
    shadow = _shadows.get(group.pg)
    if shadow is None:
        ranks = dist.get_process_group_ranks(group.pg)
        shadow = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        _shadows[group.pg] = shadow
    return shadow


def all_gather_small(local: torch.Tensor, group: Group) -> torch.Tensor:
    """Every rank's copy of a small int64 CPU vector, stacked ``[W, n]`` (consensus checks)."""
    pg = host_group(group)
    local = local.to(device="cpu", dtype=torch.int64).contiguous()
    out = local.new_empty(group.world * local.numel())
    # gloo's all-to-all of a tiny vector is faster than its all-gather (one round, no ring).
    dist.all_to_all_single(out, local.repeat(group.world), group=pg)
    return out.view(group.world, -1)
