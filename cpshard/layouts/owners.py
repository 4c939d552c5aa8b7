"""Pieces and owner ranks, the currencies of the planned layouts: a plan is, per batch row, the
*pieces* ``(start, length, rank)`` that tile the row in position order, with exactly ``P / W``
positions of the row on every rank (equivalently the owner rank of every padded position,
``[B, P]`` int64). :func:`pieces_to_indices` and :func:`owner_to_indices` turn either into the
per-rank positions a :class:`~cpshard.layouts.ShardLayout` carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from cpshard.ranges import ragged_arange
from cpshard.validation import is_int

if TYPE_CHECKING:
    from cpshard.layouts.record import ShardLayout

__all__ = [
    "Piece",
    "RowPieces",
    "check_doc_ids",
    "flat_pieces",
    "owner_of_pieces",
    "owner_ranks",
    "owner_row",
    "owner_to_indices",
    "pieces_to_indices",
    "rank_major_pieces",
]

Piece = tuple[int, int, int]  # (start, length, rank)
# A row's pieces: start, length and rank int64 vectors in position order (empty pieces allowed)
RowPieces = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def check_doc_ids(doc_ids: torch.Tensor, world: int, what: str) -> None:
    """``doc_ids`` must be an integer ``[B, P]`` tensor with ``P`` a multiple of ``world``."""
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"{what}: doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if doc_ids.dim() != 2:
        raise ValueError(f"{what}: doc_ids must be [B, P], got shape {tuple(doc_ids.shape)}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex:
        raise TypeError(f"{what}: doc_ids must hold integers or bools, got {doc_ids.dtype}")
    if not is_int(world) or world < 1:
        raise ValueError(f"{what}: world must be a positive int, got {world!r}")
    if doc_ids.shape[1] % world:
        raise ValueError(
            f"{what}: the padded length P = {doc_ids.shape[1]} is not a multiple of world = {world}"
        )


def owner_row(
    starts: torch.Tensor, lengths: torch.Tensor, ranks: torch.Tensor, length: int
) -> torch.Tensor:
    """The owner rank of every position of a row of ``length`` tiled by the pieces
    ``(starts, lengths, ranks)`` (int64 vectors in position order; an empty piece may come
    just before the piece at its start, or at the end)."""
    assert int(lengths.sum()) == length, "internal error: pieces do not tile the row"
    # Rank deltas at piece starts, then a running sum: a position gets the rank of the last
    # piece starting at or before it (empty pieces' deltas cancel out). One slot past the end
    # takes the deltas of empty pieces there.
    delta = torch.empty_like(ranks)
    delta[:1] = ranks[:1]
    torch.sub(ranks[1:], ranks[:-1], out=delta[1:])
    owner = torch.zeros(length + 1, dtype=torch.int64).scatter_add_(0, starts, delta)[:length]
    return owner.cumsum_(0)


def flat_pieces(rows: Sequence[RowPieces]) -> tuple[torch.Tensor, ...]:
    """The rows' pieces as one list: row, start, length, rank (ordered by row and start)."""
    if not rows:
        return (torch.zeros(0, dtype=torch.int64),) * 4
    row = torch.cat([torch.full_like(p[0], i) for i, p in enumerate(rows)])
    if len(rows) == 1:  # no copy
        return row, *rows[0]
    start, length, rank = (torch.cat(cols) for cols in zip(*rows, strict=True))
    return row, start, length, rank


def owner_of_pieces(rows: Sequence[RowPieces], shape: Sequence[int]) -> torch.Tensor:
    """The owner ranks ``[B, P]`` of ``shape`` the rows' pieces give."""
    b, padded = shape
    if b == 0 or padded == 0:
        return torch.zeros(tuple(shape), dtype=torch.int64)
    row, start, length, rank = flat_pieces(rows)
    return owner_row(row * padded + start, length, rank, b * padded).view(b, padded)


def rank_major_pieces(
    rows: Sequence[RowPieces], world: int, padded: int
) -> tuple[torch.Tensor, ...]:
    """The rows' pieces, which must tile each row of ``padded`` positions and give every rank
    ``P / W`` of each (checked on the pieces), sorted by rank, row and start, empty ones
    dropped: rank, row, start, length and the local index ``q`` of each piece's first
    position on its rank (int64 vectors)."""
    what = "cpshard.layouts.pieces_to_indices"
    row, start, length, rank = flat_pieces(rows)
    tiled = int(length.sum()) == len(rows) * padded and bool((length >= 0).all())
    if not tiled or not torch.equal(row * padded + start, torch.cumsum(length, 0) - length):
        raise ValueError(f"{what}: the pieces must tile every row of {padded} positions in order")
    return _rank_major(row, start, length, rank, world, len(rows), padded // max(world, 1), what)


def pieces_to_indices(rows: Sequence[RowPieces], world: int, padded: int) -> torch.Tensor:
    """``[W, B, P/W]``: every rank's positions of every row, ascending, from the rows' pieces
    (:func:`rank_major_pieces`: no pass over the positions to check them)."""
    _, _, start, length, _ = rank_major_pieces(rows, world, padded)
    return ragged_arange(start, length).view(world, len(rows), padded // max(world, 1))


def owner_to_indices(owner: torch.Tensor, world: int) -> torch.Tensor:
    """``[W, B, P/W]``: every rank's positions of every row, ascending, from owner ranks
    ``[B, P]`` (each rank must own exactly ``P / W`` positions of every row)."""
    what = "cpshard.layouts.owner_to_indices"
    if owner.dim() != 2 or owner.shape[1] % world:
        raise ValueError(f"{what}: owner must be [B, P] with P a multiple of world = {world}")
    rows, length = owner.shape
    # Runs of one owner (few for planned layouts; a row's first position starts one).
    new = torch.ones_like(owner, dtype=torch.bool)
    new[:, 1:] = owner[:, 1:] != owner[:, :-1]
    starts = torch.nonzero(new.reshape(-1)).flatten()
    sizes = torch.diff(starts, append=starts.new_tensor([owner.numel()]))
    row, rank = starts // max(length, 1), owner.reshape(-1)[starts]
    per_rank = length // world
    pieces = _rank_major(row, starts - row * length, sizes, rank, world, rows, per_rank, what)
    return ragged_arange(pieces[2], pieces[3]).view(world, rows, per_rank)


def _rank_major(
    row: torch.Tensor, start: torch.Tensor, length: torch.Tensor, rank: torch.Tensor,
    world: int, rows: int, per_rank: int, what: str,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The pieces (in row and position order; every rank's ``per_rank`` positions per row
    checked) sorted by rank and row, empty ones dropped: rank, row, start, length, ``q``."""
    if rank.numel() and (int(rank.min()) < 0 or int(rank.max()) >= world):
        raise ValueError(f"{what}: owner ranks must lie in [0, world = {world})")
    block = rank * rows + row
    counts = torch.zeros(world * rows, dtype=torch.int64).index_add_(0, block, length)
    if not bool((counts == per_rank).all()):
        raise ValueError(f"{what}: every rank must own exactly {per_rank} positions of every row")
    # one stable sort by (rank, row), empty pieces keyed past every block and cut off
    key = torch.where(length > 0, block, world * rows).to(torch.int32)  # W B < 2^31
    order = torch.argsort(key, stable=True)[: int(torch.count_nonzero(length))]
    row, start, length, rank = (t[order] for t in (row, start, length, rank))
    q = torch.cumsum(length, 0).sub_(length).sub_((rank * rows + row) * per_rank)
    return rank, row, start, length, q  # every (rank, row) holds per_rank: q restarts each


def owner_ranks(lay: ShardLayout) -> torch.Tensor:
    """``[P]`` or ``[B, P]``: the rank that holds each position of ``lay`` (from its rank-major
    inverse)."""
    return lay.rank_major_inverse() // max(1, lay.padded_seq_len // lay.world_size)
