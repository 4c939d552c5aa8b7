""":func:`make_layout`: the :class:`~cpshard.layouts.ShardLayout` of a built-in layout for a
batch, from its sizes (closed form) or planned from its document ids by the layout's strategy."""

from __future__ import annotations

import torch

from cpshard.layouts.record import ShardLayout
from cpshard.layouts.registry import layout_strategy
from cpshard.layouts.sizes import padded_seq_len, resolve_num_chunks
from cpshard.validation import check_int

__all__ = ["make_layout"]


def make_layout(
    layout: str,
    world: int,
    seq_len: int,
    *,
    doc_ids: torch.Tensor | None = None,
    num_chunks: int | None = None,
    tolerance: float = 0.02,
    rank_multiple: int = 1,
) -> ShardLayout:
    """The :class:`ShardLayout` of a built-in layout for sequences of ``seq_len`` tokens.

    Closed-form layouts need only the sizes. Data-dependent ones need ``doc_ids`` ``[B, S]``
    (0 = padding, a document = a maximal run of one non-zero id); their per-row indices
    ``[W, B, L]`` are planned here, identically on every rank that passes the same ids.
    ``rank_multiple``: pad further so that every rank's shard length is a multiple of it."""
    what = "cpshard.make_layout"
    strategy = layout_strategy(layout, what)
    name = strategy.name
    world = check_int(world, "world", what, low=1)
    seq_len = check_int(seq_len, "seq_len", what, 0)
    chunks = resolve_num_chunks(name, world, num_chunks, what)
    padded = padded_seq_len(seq_len, name, world, num_chunks, rank_multiple)
    if strategy.closed_form:
        return ShardLayout(name, world, seq_len, padded, num_chunks=chunks)
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.shape[1] != seq_len:
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(
            f"{what}: layout {name!r} is data-dependent and needs doc_ids [B, {seq_len}], got {got}"
        )
    ids = doc_ids.detach().to("cpu", torch.int64)
    ids = torch.cat([ids, ids.new_zeros(ids.shape[0], padded - seq_len)], dim=1)
    if strategy.plan_table is not None:
        table = strategy.plan_table(ids, world, chunks, tolerance)
        return ShardLayout(name, world, seq_len, padded, num_chunks=chunks, planned_from=table)
    pieces = tuple(strategy.plan_pieces(ids, world, chunks, tolerance))
    return ShardLayout(name, world, seq_len, padded, num_chunks=chunks, owner_pieces=pieces)
