"""What a layout strategy answers: the one record every built-in layout is.

A *layout* maps the positions ``0 .. P-1`` of a padded sequence to the CP ranks, every rank
holding the same number ``L = P / W`` of positions (of every row) in ascending order. Each
built-in layout is one :class:`LayoutStrategy`, composed in its own module from that layout's
formulas or planner and registered by name in :mod:`cpshard.layouts.registry`; the rest of
cpshard asks the strategy (or a property of :class:`~cpshard.layouts.ShardLayout` that asks it)
instead of comparing layout names.

There are two kinds: *closed-form* strategies compute every rank's positions from the sizes
alone (``local_indices`` and ``rank_major_inverse``); *planned* strategies cut every row of a
batch's document ids into pieces, each owned by one rank (``plan_pieces``), identically on every
rank, and the result travels in the :class:`~cpshard.layouts.ShardLayout`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Device", "LayoutStrategy", "PlannedPartition"]

Device = torch.device | str | None

# (rank, world, padded, num_chunks, device) -> the P / W positions (int64, ascending) of rank
IndicesFormula = Callable[[int, int, int, "int | None", Device], torch.Tensor]
# (world, padded, num_chunks, device) -> [P]: each position's slot in the rank-major order
InverseFormula = Callable[[int, int, "int | None", Device], torch.Tensor]
# (doc_ids [B, P], world, num_chunks, tolerance) -> every row's pieces (start, length, rank),
# tiling the row in position order, P / W positions per rank and row
Planner = Callable[[torch.Tensor, int, "int | None", float], list[tuple[torch.Tensor, ...]]]
# (doc_ids [B, P], world, num_chunks, tolerance) -> the table every rank's positions are
# listed from (a PlannedPartition: the record checks it and keeps it for the step's planners)
TablePlanner = Callable[[torch.Tensor, int, "int | None", float], "PlannedPartition"]


class PlannedPartition(Protocol):
    """What a planner that lists every rank's positions rank by rank planned them from (e.g.
    ``per_document_head_tail``'s chunk table): far smaller than the positions, so the record
    checks it instead of them and the ranks' consensus compares it."""

    def check(self, world: int, padded: int) -> None:
        """Raise ``ValueError`` unless it partitions every padded row of ``padded`` positions
        into ``world`` equal shards."""

    def indices(self) -> torch.Tensor:
        """``[W, B, P / W]``: every rank's positions, ascending."""

    def key(self) -> torch.Tensor:
        """An int64 vector equal on two ranks iff their partitions are."""


def per_rank_unit(world: int, num_chunks: int | None) -> int:
    """The pad unit of a layout that needs only an equal share per rank: ``W``."""
    return world


@dataclass(frozen=True, eq=False)
class LayoutStrategy:
    """One layout's answers.

    Attributes:
        name: the canonical name (what :class:`~cpshard.layouts.ShardLayout` records).
        aliases: other accepted spellings of ``name``.
        local_indices: closed form only: the formula of a rank's positions. Its arguments
            arrive validated (``padded`` a multiple of :attr:`pad_unit`, ``rank`` in range).
        rank_major_inverse: closed form only: the formula of every position's slot in the
            concatenation of the ranks' shards (rank 0's, then rank 1's, ...).
        plan_pieces: planned only: every row's pieces ``(start, length, rank)`` (int64 vectors
            tiling the row in position order) of padded document ids ``[B, P]`` (0 =
            padding); ``tolerance`` is the allowed excess of the most loaded
            rank's cost over the mean, for planners that balance cost.
        plan_table: planned only, optional: a :class:`PlannedPartition` of the same ids, for a
            planner that lists every rank's positions rank by rank from a table of its own
            without sorting its pieces (:func:`~cpshard.layouts.make_layout` records the table
            as the record's :attr:`~cpshard.layouts.ShardLayout.planned_from` instead of the
            pieces).
        default_num_chunks: the chunk count used when none is given, for a layout
            parameterised by a chunk count ``C``; None for a layout that takes none.
        pad_unit: ``(world, num_chunks) -> multiple`` the padded length must be (before a
            per-rank multiple is folded in).
        moves_whole_chunks: every rank holds whole chunks of ``P / C`` tokens, so un-sharding
            can reorder chunks (the inverse at one token per chunk) instead of single tokens.
        rank_major_is_global_order: the rank-major concatenation of the shards already is
            global order, for every world size, so un-sharding needs no reorder.
        contiguous_shards: every rank holds one contiguous run of positions, so its causal keys
            from earlier ranks are a halo of the rows just before its run.
    """

    name: str
    aliases: tuple[str, ...] = ()
    local_indices: IndicesFormula | None = None
    rank_major_inverse: InverseFormula | None = None
    plan_pieces: Planner | None = None
    plan_table: TablePlanner | None = None
    default_num_chunks: Callable[[int], int] | None = None
    pad_unit: Callable[[int, int | None], int] = per_rank_unit
    moves_whole_chunks: bool = False
    rank_major_is_global_order: bool = False
    contiguous_shards: bool = False

    def __post_init__(self) -> None:
        formulas = (self.local_indices, self.rank_major_inverse)
        if (self.plan_pieces is None) == any(f is None for f in formulas):
            raise TypeError(
                f"layout strategy {self.name!r}: give both closed-form formulas or a planner"
            )
        if self.plan_table is not None and self.plan_pieces is None:
            raise TypeError(f"layout strategy {self.name!r}: plan_table needs plan_pieces")

    @property
    def closed_form(self) -> bool:
        """True when the partition follows from the sizes alone (no planner)."""
        return self.plan_pieces is None

    @property
    def takes_num_chunks(self) -> bool:
        """True when the layout is parameterised by a chunk count."""
        return self.default_num_chunks is not None
