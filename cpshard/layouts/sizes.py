"""Sizes a layout fixes: its chunk count and the multiple a sequence is padded to."""

from __future__ import annotations

import math

from cpshard.layouts.registry import STRATEGIES, WHAT, canonical_layout_name, layout_strategy
from cpshard.validation import check_int

__all__ = ["pad_multiple", "padded_seq_len", "resolve_num_chunks"]


def resolve_num_chunks(
    layout: str, world: int, num_chunks: int | None, what: str = WHAT
) -> int | None:
    """``num_chunks`` checked for ``layout`` (its default where it takes one, None elsewhere)."""
    strategy = layout_strategy(layout, what)
    world = check_int(world, "world", what, low=1)
    if not strategy.takes_num_chunks:
        if num_chunks is not None:
            chunked = " and ".join(n for n, s in STRATEGIES.items() if s.takes_num_chunks)
            raise ValueError(
                f"{what}: num_chunks applies to {chunked} only, not to {strategy.name!r}"
            )
        return None
    if num_chunks is None:
        return strategy.default_num_chunks(world)
    num_chunks = check_int(num_chunks, "num_chunks", what, low=1)
    if num_chunks % world:
        raise ValueError(
            f"{what}: num_chunks = {num_chunks} must be a positive multiple of world = {world}"
        )
    return num_chunks


def pad_multiple(
    layout: str, world: int, num_chunks: int | None = None, rank_multiple: int = 1
) -> int:
    """The multiple the sequence is padded to for ``layout``, such that every rank's shard
    length is also a multiple of ``rank_multiple`` (e.g. a model's compression ratio)."""
    name = canonical_layout_name(layout)
    chunks = resolve_num_chunks(name, world, num_chunks)
    rank_multiple = check_int(rank_multiple, "rank_multiple", WHAT, low=1)
    return math.lcm(STRATEGIES[name].pad_unit(world, chunks), world * rank_multiple)


def padded_seq_len(
    seq_len: int, layout: str, world: int, num_chunks: int | None = None, rank_multiple: int = 1
) -> int:
    """``seq_len`` rounded up to :func:`pad_multiple`."""
    seq_len = check_int(seq_len, "seq_len", WHAT, 0)
    m = pad_multiple(layout, world, num_chunks, rank_multiple)
    return -(-seq_len // m) * m
