"""Every rank's runs of a step's documents under one layout: what every plan of the step (the
causal and bidirectional states, each window, the halo) is computed from, once per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.batch.runs import document_bounds, document_runs_of
from cpshard.layouts import ShardLayout
from cpshard.masks import MaskDescription, cut_runs
from cpshard.planning.positions import RankPrefix, all_positions, layout_pieces
from cpshard.planning.stripe_runs import StripePrefix, StripeRuns
from cpshard.planning.zigzag_runs import ZigzagPrefix, ZigzagRuns


@dataclass(frozen=True)
class LayoutRuns:
    """The runs of every rank (consecutive global positions of one document on one rank, in one
    batch row) of the padded document ids ``documents`` ``[B, P]`` under ``layout``, ordered by
    rank, row and position: ``rank``, ``row``, first local index ``q``, length ``n``, document
    start ``doc_start`` and first global position ``begin`` (int64 vectors) and its document's
    end ``doc_end`` (one past its last token). What the planners ask of them (a rank's own runs,
    every rank's key intervals and token counts, how intervals cover the runs) is answered from
    these columns, or in closed form where the layout has one (:mod:`stripe_runs`,
    :mod:`zigzag_runs`), so the
    columns, :attr:`positions` ``[W, B, L]`` and :attr:`prefix` are made when first read."""

    world: int
    rows: int
    padded: int
    layout: ShardLayout
    documents: torch.Tensor
    closed: StripeRuns | ZigzagRuns | None = None
    _made: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def _get(self, name: str, make: Callable[[], object]) -> Any:
        if name not in self._made:
            self._made[name] = make()
        return self._made[name]

    @property
    def columns(self) -> tuple[torch.Tensor, ...]:
        """The seven run columns (module doc), every rank's."""

        def make() -> tuple[torch.Tensor, ...]:
            rank, row, start, size, q = self.pieces
            return document_runs_of(rank, row, q, start, size, self.documents)

        return self._get("columns", make)

    rank = property(lambda self: self.columns[0])
    row = property(lambda self: self.columns[1])
    q = property(lambda self: self.columns[2])
    n = property(lambda self: self.columns[3])
    doc_start = property(lambda self: self.columns[4])
    begin = property(lambda self: self.columns[5])
    doc_end = property(lambda self: self.columns[6])

    @property
    def pieces(self) -> tuple[torch.Tensor, ...]:
        """Every rank's pieces: rank, row, start, length, first local index
        (:func:`layout_pieces`)."""
        return self._get("pieces", lambda: layout_pieces(self.layout, self.rows))

    @property
    def positions(self) -> torch.Tensor:
        """``[W, B, L]``: every rank's positions (:func:`all_positions`)."""
        return self._get("positions", lambda: all_positions(self.layout, self.rows))

    @property
    def prefix(self) -> RankPrefix | StripePrefix | ZigzagPrefix:
        """Counts of every rank's positions below a position (:class:`RankPrefix`, or its
        closed form)."""
        if self.closed is not None:
            return self.closed.prefix()
        return self._get(
            "prefix", lambda: RankPrefix(self.pieces, self.world, self.rows, self.padded)
        )

    def position(self, rank: torch.Tensor, row: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The global position of ``rank``'s local index ``slot`` in batch row ``row``."""
        if self.closed is not None:
            return self.closed.position(rank, row, slot)
        return self.positions[rank, row, slot]

    @property
    def local_len(self) -> int:
        return self.padded // max(self.world, 1)

    def of_rank(self, rank: int) -> tuple[torch.Tensor, ...]:
        """Rank ``rank``'s runs: row, ``q``, ``n``, document start, ``begin``, document end."""
        if self.closed is not None and "columns" not in self._made:
            return self.closed.rank_runs(rank, self.documents)
        lo, hi = torch.searchsorted(self.rank, torch.tensor([rank, rank + 1])).tolist()
        return tuple(t[lo:hi] for t in self.columns[1:])

    def tokens(self) -> torch.Tensor:
        """``[W]``: every rank's document tokens (the lengths of its runs)."""
        if self.closed is not None:
            return self.closed.tokens()
        return torch.zeros(self.world, dtype=torch.int64).index_add_(0, self.rank, self.n)

    def intervals(self, causal: bool, window: int | None) -> tuple[torch.Tensor, ...]:
        """Every rank's key ranges: for each of its runs, from its document's start (or its
        first query's window's start) to one past its last key (:meth:`ends`); rank, row,
        start and end, ordered by rank, row and start (adjacent or overlapping ones may
        follow each other: the caller merges them)."""
        if self.closed is not None and self.closed.serves(causal, window):
            return self.closed.intervals(causal, window)
        return self.rank, self.row, self.starts(window), self.ends(causal)

    def ends(self, causal: bool) -> torch.Tensor:
        """One past each run's last visible key: its own end (causal) or its document's."""
        return self.begin + self.n if causal else self.doc_end

    def starts(self, window: int | None) -> torch.Tensor:
        """Each run's first visible key: its document's start, or its first query's window's."""
        if window is None:
            return self.doc_start
        return torch.maximum(self.doc_start, self.begin - window + 1)

    def reach(self, causal: bool) -> int:
        """The most keys a query attends without a window (0: no runs): the longest document
        (a run reaches its document's start, and the run holding its last token its end)."""
        if self.closed is not None:
            lengths = self.closed.doc_end - self.closed.doc_start
            return int(lengths.max()) if lengths.numel() else 0
        return int((self.ends(causal) - self.doc_start).max()) if self.n.numel() else 0


@dataclass(frozen=True)
class MaskRuns:
    """Every rank's runs cut at a mask description's segments (ordered like the runs: by rank,
    row and position), each piece's queries reaching the keys ``[lo, hi)`` of their batch row
    (the union of its queries' keys, each query seeing itself), query ``p`` seeing
    ``[max(lo, p - back), min(hi, p + 1 + ahead))``: ``rank``, ``row``, first local index
    ``q``, length ``n``, document start ``doc_start``, first global position ``begin``, ``lo``,
    ``hi``, ``back``, ``ahead`` (int64). ``causal`` (``ahead == 0``): query ``p`` sees up to
    itself, ``hi`` one past the piece's last query."""

    rank: torch.Tensor
    row: torch.Tensor
    q: torch.Tensor
    n: torch.Tensor
    doc_start: torch.Tensor
    begin: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    back: torch.Tensor
    ahead: torch.Tensor

    @property
    def causal(self) -> torch.Tensor:
        """Per piece: its queries see their keys causally (each up to itself)."""
        return self.ahead == 0

    def of_rank(self, rank: int) -> tuple[torch.Tensor, ...]:
        """Rank ``rank``'s pieces: row, ``q``, ``n``, document start, ``begin``, ``lo``, ``hi``,
        ``back``, ``ahead``."""
        lo, hi = torch.searchsorted(self.rank, torch.tensor([rank, rank + 1])).tolist()
        cols = (self.row, self.q, self.n, self.doc_start, self.begin, self.lo, self.hi)
        return tuple(t[lo:hi] for t in (*cols, self.back, self.ahead))

    def intervals(self) -> tuple[torch.Tensor, ...]:
        """Every rank's key ranges, one per piece: rank, row, start, end."""
        return self.rank, self.row, self.lo, self.hi

    def reach(self) -> int:
        """The most keys a query attends (0: no pieces): each piece's count of keys per query
        is concave in the query (a minimum of lines less a maximum of lines), so its largest
        is at an end of the piece or where a bound changes form."""
        if not self.n.numel():
            return 0
        first, last = self.begin, self.begin + self.n - 1
        turns = (first, last, self.lo + self.back, self.hi - 1 - self.ahead)
        q = torch.stack([torch.minimum(torch.maximum(t, first), last) for t in turns])
        end = torch.minimum(self.hi, q + 1 + self.ahead)
        return int((end - torch.maximum(self.lo, q - self.back)).max())


def mask_runs(runs: LayoutRuns, mask: MaskDescription) -> MaskRuns:
    """Every rank's runs of ``runs`` cut at ``mask``'s segments (:func:`~cpshard.masks.cut_runs`,
    O(runs + segments)). Raises ``ValueError`` for a mask the attention cannot execute: a
    query that does not see itself (no key at all, or keys that skip it: a pad-like query of a
    document), or a description of other documents."""
    if (mask.rows, mask.length) != tuple(runs.documents.shape):
        raise ValueError(
            f"the mask describes a [{mask.rows}, {mask.length}] batch, the step's padded "
            f"documents are {list(runs.documents.shape)}"
        )
    cols = runs.columns
    rank, row, q, n, doc_start, begin, doc_end = cols
    pieces = cut_runs(mask, row, begin, n, doc_start, doc_end)
    at = pieces.run
    end = pieces.begin + pieces.n
    # every query sees itself: the piece's keys start at or before its first query and end at
    # or after its last (back, ahead >= 0 then put each query inside its own interval)
    own = (pieces.lo <= pieces.begin) & (pieces.hi >= end)
    if not bool(own.all()):
        i = int(torch.nonzero(~own)[0])
        raise ValueError(
            f"the mask has a query that does not see itself (batch row {int(pieces.row[i])}, "
            f"queries from position {int(pieces.begin[i])}): CP attention does not implement it"
        )
    return MaskRuns(
        rank[at], pieces.row, q[at] + pieces.begin - begin[at], pieces.n, doc_start[at],
        pieces.begin, pieces.lo, pieces.hi, pieces.back, pieces.ahead,
    )  # fmt: skip


def layout_runs(layout: ShardLayout, doc: torch.Tensor) -> LayoutRuns:
    """The :class:`LayoutRuns` of the padded document ids ``doc`` ``[B, P]`` (host int64, 0 =
    pad) under ``layout`` (equal shards): its columns made on first use (one pass over the
    sequence whatever the world size; for contiguous shards, from the documents' bounds alone),
    the stripe layout's answers in closed form from the documents' bounds, the per-document
    zig-zag's from its chunk table."""
    b, padded = doc.shape
    world = layout.world_size
    closed: StripeRuns | ZigzagRuns | None = None
    if layout.closed_form and layout.name == "stripe" and world > 1:
        row, start, end = document_bounds(doc)
        closed = StripeRuns(world, padded, row, start, end)
    elif layout.name == "per_document_head_tail":
        closed = ZigzagRuns.of(layout, doc)
    return LayoutRuns(world, b, padded, layout, doc, closed)
