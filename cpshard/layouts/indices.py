"""The public closed-form queries: which global positions a rank holds, where each position
sits in the rank-major concatenation of the shards, and which rank owns it. ``layout`` is a
layout name (aliases accepted) or a closed-form :class:`~cpshard.layouts.ShardLayout`;
data-dependent layouts raise (their indices travel in their ShardLayout)."""

from __future__ import annotations

import torch

from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.closed_form import check_closed_form
from cpshard.layouts.record import ShardLayout
from cpshard.layouts.registry import is_closed_form

__all__ = ["local_token_global_indices", "rank_major_inverse", "token_owner"]


def _checked(
    layout: object, world: int, padded: int, num_chunks: int | None, rank: int | None, what: str
) -> tuple[LayoutStrategy, int, int, int | None]:
    """Validated (strategy, world, P, C) of ``layout``, a name or a closed-form ShardLayout."""
    if isinstance(layout, ShardLayout):
        if layout.local_token_global_indices is not None or not is_closed_form(layout.name):
            raise ValueError(
                f"{what}: layout {layout.name!r} is not closed-form; use its "
                "local_token_global_indices"
            )
        num_chunks = layout.num_chunks if num_chunks is None else num_chunks
        layout = layout.name
    return check_closed_form(layout, world, padded, num_chunks, rank, what)


def local_token_global_indices(
    layout: str | ShardLayout,
    rank: int,
    world: int,
    padded_seq_len: int,
    *,
    num_chunks: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global positions (int64, ascending) that ``rank`` holds under a closed-form layout.

    ``layout`` is a layout name (``contiguous``, ``head_tail``/``zigzag``/``round_robin``,
    ``stripe``) or a closed-form :class:`ShardLayout`. Data-dependent layouts raise: their
    indices are in their ShardLayout (:meth:`ShardLayout.indices`)."""
    what = "cpshard.local_token_global_indices"
    strategy, world, padded, chunks = _checked(
        layout, world, padded_seq_len, num_chunks, rank, what
    )
    return strategy.local_indices(rank, world, padded, chunks, device)


def rank_major_inverse(
    layout: str | ShardLayout,
    world: int,
    padded_seq_len: int,
    *,
    num_chunks: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``inv`` ``[P]``: where global position ``p`` sits in the rank-major concatenation of all
    ranks' local shards (rank 0's ``L`` tokens, then rank 1's, ...), in closed form; so
    ``full = gathered[inv]``."""
    what = "cpshard.rank_major_inverse"
    strategy, world, padded, chunks = _checked(
        layout, world, padded_seq_len, num_chunks, None, what
    )
    return strategy.rank_major_inverse(world, padded, chunks, device)


def token_owner(
    layout: str | ShardLayout,
    world: int,
    padded_seq_len: int,
    *,
    num_chunks: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[P]``: the rank that holds each global position under a closed-form layout."""
    inv = rank_major_inverse(layout, world, padded_seq_len, num_chunks=num_chunks, device=device)
    return inv // max(1, inv.numel() // world)
