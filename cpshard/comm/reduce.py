"""Sum reductions over a CP group: the global token count of a loss and parameter gradients."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cpshard.comm.group import Group


def all_reduce_sum_(tensors: Sequence[torch.Tensor], group: Group) -> None:
    """Sum ``tensors`` over the group in place, in as few collectives as there are
    (dtype, device) pairs: same-kind tensors travel flattened in one buffer."""
    if group.world == 1 or not tensors:
        return
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for same in buckets.values():
        if len(same) == 1 and same[0].is_contiguous():  # reduced in place, nothing to copy back
            dist.all_reduce(same[0], op=dist.ReduceOp.SUM, group=group.pg)
            continue
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group.pg)
        at = 0
        for t in same:
            n = t.numel()
            t.copy_(flat[at : at + n].view_as(t))
            at += n
