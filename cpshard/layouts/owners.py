"""Owner ranks, the common currency of the planned layouts: a plan is the owner rank of every
padded position, ``[B, P]`` int64, built from *pieces* ``(start, length, rank)`` that tile a
row, with exactly ``P / W`` positions of every row on every rank; :func:`owner_to_indices`
turns it into the per-rank positions a :class:`~cpshard.layouts.ShardLayout` carries.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpshard.ranges import ragged_arange
from cpshard.validation import is_int

__all__ = ["Piece", "check_doc_ids", "owner_row", "owner_to_indices", "stack_rows"]

Piece = tuple[int, int, int]  # (start, length, rank)


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


def stack_rows(rows: list[torch.Tensor], shape: Sequence[int]) -> torch.Tensor:
    """The rows' owners as one ``[B, P]`` tensor (empty of ``shape`` for no rows)."""
    if not rows:
        return torch.empty(tuple(shape), dtype=torch.int64)
    if len(rows) == 1:
        return rows[0][None]  # no copy
    return torch.stack(rows)


def owner_to_indices(owner: torch.Tensor, world: int) -> torch.Tensor:
    """``[W, B, P/W]``: every rank's positions of every row, ascending, from owner ranks
    ``[B, P]`` (each rank must own exactly ``P / W`` positions of every row)."""
    what = "cpshard.layouts.owner_to_indices"
    if owner.dim() != 2 or owner.shape[1] % world:
        raise ValueError(f"{what}: owner must be [B, P] with P a multiple of world = {world}")
    rows, length = owner.shape
    per_rank = length // world
    if owner.numel() and (int(owner.min()) < 0 or int(owner.max()) >= world):
        raise ValueError(f"{what}: owner ranks must lie in [0, world = {world})")
    # Runs of one owner (few for planned layouts; a row's first position starts one), sorted by
    # rank and row: their positions back to back are every rank's positions, rank-major.
    new = torch.ones_like(owner, dtype=torch.bool)
    new[:, 1:] = owner[:, 1:] != owner[:, :-1]
    starts = torch.nonzero(new.reshape(-1)).flatten()
    sizes = torch.diff(starts, append=starts.new_tensor([owner.numel()]))
    row, rank = starts // max(length, 1), owner.reshape(-1)[starts]
    counts = torch.zeros(world * rows, dtype=torch.int64).index_add_(0, rank * rows + row, sizes)
    if not bool((counts == per_rank).all()):
        raise ValueError(f"{what}: every rank must own exactly {per_rank} positions of every row")
    order = torch.argsort(rank * rows + row, stable=True)
    starts, sizes, row = starts[order], sizes[order], row[order]
    return ragged_arange(starts - row * length, sizes).view(world, rows, per_rank)
