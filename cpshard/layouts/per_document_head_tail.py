"""The ``per_document_head_tail`` layout: the serpentine zig-zag inside every run of a packed
row (documents and padding runs alike), planned from the batch's document ids with whole-tensor
work over the runs of a row: the runs' chunk table
(:class:`~cpshard.layouts.serpentine.ZigzagTable`), from which every rank's positions are listed
rank by rank (the table kept on the record for the step's planners), or the rows' pieces.

A run of ``n`` tokens is cut into ``C`` chunks (default ``2W``) of ``n // C`` tokens, chunk
``k`` owned by rank ``k`` on even passes of ``W`` chunks and by ``W - 1 - k % W`` on odd ones
(for ``C = 2W``: rank ``r`` owns chunks ``r`` and ``2W - 1 - r``). The ``n % C`` remaining
tokens are dealt one each to ranks ``c, c+1, ...`` (mod ``W``), ``c`` a counter running along
the row, each extra token widening that rank's next chunk of the run. Documents shorter than
``C`` are thus spread over consecutive ranks without being padded, and because the extras are
dealt cyclically along the row, every rank ends with exactly ``P / W`` tokens. The padded
length is a multiple of ``W``.
"""

from __future__ import annotations

import torch

from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.owners import RowPieces, check_doc_ids, owner_of_pieces
from cpshard.layouts.serpentine import (
    ZigzagTable,
    default_num_chunks,
    zigzag_table,
)
from cpshard.validation import is_int

__all__ = [
    "PER_DOCUMENT_HEAD_TAIL",
    "per_document_head_tail_table",
    "per_document_head_tail_pieces",
    "plan_per_document_head_tail",
]


def plan_per_document_head_tail(
    doc_ids: torch.Tensor, world: int, num_chunks: int | None = None
) -> torch.Tensor:
    """Owner rank ``[B, P]`` of every position under ``per_document_head_tail`` (module doc)."""
    return owner_of_pieces(per_document_head_tail_pieces(doc_ids, world, num_chunks), doc_ids.shape)


def _checked_chunks(doc_ids: torch.Tensor, world: int, num_chunks: int | None) -> int:
    what = "cpshard.layouts.plan_per_document_head_tail"
    check_doc_ids(doc_ids, world, what)
    chunks = default_num_chunks(world) if num_chunks is None else num_chunks
    if not is_int(chunks) or chunks < 1 or chunks % world:
        raise ValueError(
            f"{what}: num_chunks must be a positive multiple of world = {world}, got {num_chunks!r}"
        )
    return chunks


def per_document_head_tail_table(
    doc_ids: torch.Tensor, world: int, num_chunks: int | None = None
) -> ZigzagTable:
    """The runs' chunk table under ``per_document_head_tail`` (module doc), from which every
    rank's positions are listed rank by rank (no sort over the pieces)."""
    chunks = _checked_chunks(doc_ids, world, num_chunks)
    return zigzag_table(doc_ids.detach().to("cpu", torch.int64), world, chunks)


def per_document_head_tail_pieces(
    doc_ids: torch.Tensor, world: int, num_chunks: int | None = None
) -> list[RowPieces]:
    """Every row's pieces under ``per_document_head_tail`` (module doc)."""
    chunks = _checked_chunks(doc_ids, world, num_chunks)
    return zigzag_table(doc_ids.detach().to("cpu", torch.int64), world, chunks).row_pieces()


PER_DOCUMENT_HEAD_TAIL = LayoutStrategy(
    "per_document_head_tail",
    plan_pieces=lambda doc_ids, world, chunks, tolerance: per_document_head_tail_pieces(
        doc_ids, world, chunks
    ),
    plan_table=lambda doc_ids, world, chunks, tolerance: per_document_head_tail_table(
        doc_ids, world, chunks
    ),
    default_num_chunks=default_num_chunks,
)
