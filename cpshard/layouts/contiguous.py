"""The ``contiguous`` layout (alias ``sequential``): rank ``r`` holds ``[r L, (r+1) L)``.

Closed form; the padded length is a multiple of ``W``. The rank-major concatenation of the
shards is global order, and every rank's causal keys from earlier ranks are a halo just before
its run, which the attention exchanges instead of needed rows.
"""

from __future__ import annotations

import torch

from cpshard.layouts.base import Device, LayoutStrategy

__all__ = ["CONTIGUOUS"]


def _indices(rank: int, world: int, padded: int, chunks: None, device: Device) -> torch.Tensor:
    length = padded // world
    return torch.arange(rank * length, (rank + 1) * length, device=device)


def _inverse(world: int, padded: int, chunks: None, device: Device) -> torch.Tensor:
    return torch.arange(padded, device=device)


CONTIGUOUS = LayoutStrategy(
    "contiguous",
    ("sequential",),
    local_indices=_indices,
    rank_major_inverse=_inverse,
    rank_major_is_global_order=True,
    contiguous_shards=True,
)
