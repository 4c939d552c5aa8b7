"""The ``stripe`` layout: rank ``r`` holds the positions ``i`` with ``i % W == r``.

Closed form; the padded length is a multiple of ``W``. Every rank sees every part of the
sequence, which balances causal cost token by token, at the price of no two neighbours on one
rank.
"""

from __future__ import annotations

import torch

from cpshard.layouts.base import Device, LayoutStrategy

__all__ = ["STRIPE"]


def _indices(rank: int, world: int, padded: int, chunks: None, device: Device) -> torch.Tensor:
    return torch.arange(padded // world, device=device) * world + rank


def _inverse(world: int, padded: int, chunks: None, device: Device) -> torch.Tensor:
    length = padded // world  # position j W + r is slot r L + j
    slots = torch.arange(world, device=device) * length
    return (torch.arange(length, device=device)[:, None] + slots).reshape(-1)


STRIPE = LayoutStrategy("stripe", local_indices=_indices, rank_major_inverse=_inverse)
