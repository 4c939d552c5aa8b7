"""Collectives named as the newest supported torch names them, on every supported torch.

torch 2.13 added ``all_gather_single`` / ``reduce_scatter_single`` and deprecated
``all_gather_into_tensor`` / ``reduce_scatter_tensor``; torch 2.11 and 2.12 have only the old
names. Same arguments, same semantics (flat output of ``world * local`` elements)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(
    out: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """``out`` <- every rank's ``local``, back to back in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def reduce_scatter_single(
    out: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None = None
) -> None:
    """``out`` <- the sum over ranks of their ``full``'s slice for this rank."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, full, group=group)
