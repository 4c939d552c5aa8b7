"""The ``head_tail`` layout (aliases ``zigzag``, ``round_robin``): the sequence is cut into
``C`` chunks of ``P / C`` tokens (default ``C = 2W``) dealt over the ranks in a serpentine
(:mod:`cpshard.layouts.serpentine`): with the default, rank ``r`` holds chunks ``r`` and
``2W - 1 - r``.

Closed form; the padded length is a multiple of ``C``. Ranks hold whole chunks, so un-sharding
reorders chunks rather than tokens.
"""

from __future__ import annotations

import torch

from cpshard.layouts.base import Device, LayoutStrategy
from cpshard.layouts.serpentine import default_num_chunks

__all__ = ["HEAD_TAIL"]


def _indices(rank: int, world: int, padded: int, chunks: int, device: Device) -> torch.Tensor:
    size = padded // chunks
    passes = torch.arange(chunks // world, device=device)
    chunk = passes * world + torch.where(passes % 2 == 0, rank, world - 1 - rank)
    return (chunk[:, None] * size + torch.arange(size, device=device)).reshape(-1)


def _inverse(world: int, padded: int, chunks: int, device: Device) -> torch.Tensor:
    size = padded // chunks
    k = torch.arange(chunks, device=device)  # chunk by chunk: its first slot, then consecutive
    t, i = k // world, k % world
    rank = torch.where(t % 2 == 0, i, world - 1 - i)
    first = rank * (padded // world) + t * size
    return (first[:, None] + torch.arange(size, device=device)).reshape(-1)


def _chunk_unit(world: int, chunks: int) -> int:
    return chunks  # whole chunks: P is a multiple of C (itself a multiple of W)


HEAD_TAIL = LayoutStrategy(
    "head_tail",
    ("zigzag", "round_robin"),
    local_indices=_indices,
    rank_major_inverse=_inverse,
    default_num_chunks=default_num_chunks,
    pad_unit=_chunk_unit,
    moves_whole_chunks=True,
)
