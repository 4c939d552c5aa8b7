"""The argument checks every closed-form query shares, before it applies the strategy's formula
(:attr:`~cpshard.layouts.base.LayoutStrategy.local_indices` or
:attr:`~cpshard.layouts.base.LayoutStrategy.rank_major_inverse`)."""

from __future__ import annotations

from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.registry import layout_strategy
from cpshard.layouts.sizes import resolve_num_chunks
from cpshard.validation import check_int

__all__ = ["check_closed_form"]


def check_closed_form(
    name: object, world: int, padded: int, num_chunks: int | None, rank: int | None, what: str
) -> tuple[LayoutStrategy, int, int, int | None]:
    """Validated (strategy, world, P, C) of the closed-form layout ``name``: data-dependent
    layouts, a rank out of range and a length that is not a multiple of the layout's unit
    raise."""
    strategy = layout_strategy(name, what)
    if not strategy.closed_form:
        raise ValueError(
            f"{what}: layout {strategy.name!r} is data-dependent: its indices come with the "
            "ShardLayout that make_layout / ContextParallelSharder.shard computes from the "
            "batch's documents"
        )
    world = check_int(world, "world", what, low=1)
    padded = check_int(padded, "padded_seq_len", what, 0)
    if rank is not None:
        rank = check_int(rank, "rank", what, 0)
        if rank >= world:
            raise ValueError(f"{what}: rank = {rank} is out of range for world = {world}")
    chunks = resolve_num_chunks(strategy.name, world, num_chunks, what)
    multiple = strategy.pad_unit(world, chunks)
    if padded % multiple:
        raise ValueError(
            f"{what}: padded_seq_len = {padded} is not a multiple of {multiple} (layout "
            f"{strategy.name!r}, world {world}{f', num_chunks {chunks}' if chunks else ''})"
        )
    return strategy, world, padded, chunks
