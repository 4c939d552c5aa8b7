"""The needed-rows plan of any layout: which K/V rows each rank needs, who sends them, and the
spans each query run attends, by interval arithmetic (no per-rank pass over the sequence).

For every run of a rank's tokens (consecutive global positions inside one document, in a batch
row) its queries attend the document's keys from the document start to the run's end (or to the
document's end: bidirectional; from the window's start of its first query with a window). The
rows a rank needs are the union of those ranges per batch row: a few intervals. Every rank's
intervals come from one pass over the runs of every rank; what a rank exchanges with rank q is
the intersection of intervals with q's positions, counted by binary search over the sorted
positions of each rank. This rank's own tables are then listed exactly (their size is what it
moves), everything else is counted: O(P + runs x log P) per rank, whatever ``W``.

:func:`plan_needed_intervals` plans the same exchange from key intervals a caller states for
every rank (a ``mask_mod``'s reach). The buffer a rank attends holds its needed rows in global
order per batch row; the rows arrive grouped by source rank (each source's in global order), and
a rank's own rows are a local copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpshard.masks import INF, MaskDescription
from cpshard.planning.coverage import Coverage
from cpshard.planning.row_tables import ClosedExchange, received_rows
from cpshard.planning.runs import LayoutRuns, mask_runs
from cpshard.planning.stripe_exchange import StripeRowTables, stripe_exchange
from cpshard.planning.zigzag_exchange import ZigzagRowTables, zigzag_exchange
from cpshard.planning.zigzag_runs import ZigzagRuns
from cpshard.ranges import ragged_arange


@dataclass(frozen=True)
class _TableRecipe:
    """What :class:`NeededRowsPlan`'s row tables are made from, a range list each: received,
    for every (source, buffer interval), ``count`` positions of the source from its local index
    ``first`` on, going to buffer row ``base`` + position of batch row ``row``; sent, its local
    indices ``[send_first, send_first + send_count)`` per (destination, interval)."""

    runs: LayoutRuns
    width: int
    source: torch.Tensor
    row: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    base: torch.Tensor
    send_first: torch.Tensor
    send_count: torch.Tensor

    def send_rows(self) -> torch.Tensor:
        return ragged_arange(self.send_first, self.send_count)

    def recv_rows(self) -> torch.Tensor:
        cols = (self.first, self.count, self.source, self.row, self.base)
        return received_rows(*cols, self.width, self.runs.position)


@dataclass(frozen=True)
class NeededRowsPlan:
    """One rank's needed-rows plan for one attention mask.

    ``spans``: this rank's query runs over its key buffer of ``buffer_len`` rows per batch row
    (a span table, :func:`~cpshard.planning.spans.span_table`).
    ``send_rows``: rows of this rank's flattened ``[B * L]`` K/V it sends, grouped by
    destination rank (``send_counts[r]`` to rank r, its own included). ``recv_rows``: where the
    received rows go in its flattened ``[B * buffer_len]`` buffer, grouped by source
    (``recv_counts[q]`` from rank q). ``received[r]`` / ``sent[r]``: rows every rank receives
    from / sends to the others (alike on every rank). ``reach``: the most keys a query of the
    step attends without a window. ``causal``: per span, whether its queries see their keys
    causally (a mask description's plan mixes kinds; None: every span as the state says);
    ``rules``: a mask description's per-span ``(end, back, ahead)`` in buffer rows
    (:func:`~cpshard.planning.spans.query_keys`: which keys each query sees; None: the state's
    kind). The
    two row tables, as long as the rows the rank moves, are made when first read (a step whose
    calls attend head-parallel never reads them)."""

    spans: torch.Tensor
    buffer_len: int
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    received: tuple[int, ...]
    sent: tuple[int, ...]
    reach: int
    recipe: _TableRecipe | ZigzagRowTables | StripeRowTables = field(repr=False, compare=False)
    causal: torch.Tensor | None = None
    rules: torch.Tensor | None = None
    _made: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    @property
    def send_rows(self) -> torch.Tensor:
        if "send" not in self._made:
            self._made["send"] = self.recipe.send_rows()
        return self._made["send"]

    @property
    def recv_rows(self) -> torch.Tensor:
        if "recv" not in self._made:
            self._made["recv"] = self.recipe.recv_rows()
        return self._made["recv"]


def _merge(
    rank: torch.Tensor, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Union of the ranges ``[lo, hi)`` per (rank, row), given sorted by rank, row and ``lo``
    with ``hi`` non-decreasing within each: disjoint intervals (rank, row, lo, hi), sorted."""
    if lo.numel() == 0:
        return rank, row, lo, hi
    new = torch.ones_like(lo, dtype=torch.bool)
    new[1:] = (rank[1:] != rank[:-1]) | (row[1:] != row[:-1]) | (lo[1:] > hi[:-1])
    first = torch.nonzero(new).flatten()
    last = torch.cat([first[1:] - 1, first.new_tensor([lo.numel() - 1])])
    return rank[first], row[first], lo[first], hi[last]


def _sorted_for_merge(
    rank: torch.Tensor, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, rows: int,
    padded: int,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Ranges ``[lo, hi)`` in any order, sorted by rank, row and ``lo`` with ``hi`` replaced by
    its running maximum within each (rank, row) (what :func:`_merge` takes; same union)."""
    group = rank * rows + row
    order = torch.sort(group * (padded + 1) + lo, stable=True).indices
    rank, row, lo, hi, group = (t[order] for t in (rank, row, lo, hi, group))
    hi = torch.cummax(group * (padded + 1) + hi, 0).values - group * (padded + 1)
    return rank, row, lo, hi


def _per_rank(world: int, rank: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.zeros(world, dtype=torch.int64).index_add_(0, rank, values)


def plan_needed_rows(
    rank: int,
    runs: LayoutRuns,
    causal: bool | None = None,
    window: int | None = None,
    mask: MaskDescription | None = None,
) -> NeededRowsPlan:
    """Rank ``rank``'s plan from the step's :class:`~cpshard.planning.runs.LayoutRuns`: each
    run reaches its document's keys from the document start to the run's end (``causal``) or
    to the document's end; with a (causal) ``window``, from the window's start of its first
    query, at most ``window - 1`` rows before the run. Or, with ``mask`` instead of ``causal``
    and ``window`` (a description of the padded batch), the runs cut at its segments
    (:func:`~cpshard.planning.runs.mask_runs`): each piece reaches its ``[lo, hi)``, and its
    span's rule (:attr:`NeededRowsPlan.rules`) says which of those keys each query sees."""
    b, padded = runs.rows, runs.padded
    if (mask is None) == (causal is None) or (mask is not None and window is not None):
        raise ValueError("plan_needed_rows takes causal (and a window) or a mask description")
    exchange: _IntervalExchange | ClosedExchange
    if causal is not None and window is None and runs.closed is not None:
        closed = runs.closed
        if isinstance(closed, ZigzagRuns):
            exchange = zigzag_exchange(closed, rank, causal)
        else:
            exchange = stripe_exchange(closed, rank, causal)
        reach = runs.reach(causal)
    else:
        if causal is not None:
            intervals, reach = runs.intervals(causal, window), runs.reach(causal)
        else:
            pieces = mask_runs(runs, mask)
            intervals = _sorted_for_merge(*pieces.intervals(), b, padded)
            reach = pieces.reach()
        exchange = _interval_exchange(rank, runs, _merge(*intervals))
    rows = _buffer_rows(runs, exchange.mine)
    buffer_row = rows.buffer_row

    flags = rules = None
    if mask is None:
        row, q, n, ds, begin, de = runs.of_rank(rank)
        end = begin + n if causal else de
        lo = ds if window is None else torch.maximum(ds, begin - window + 1)
        split = buffer_row(row, begin) if causal else buffer_row(row, end - 1) + 1
    else:
        row, q, n, ds, begin, lo, hi, back, ahead = pieces.of_rank(rank)
        flags = ahead == 0
        # one past the buffer row of hi - 1 (the rows of [lo, hi) are consecutive in the buffer)
        last = buffer_row(row, hi - 1) + 1
        visible = (back >= INF) & (ahead >= INF)  # every key of [lo, hi): split is its end
        split = torch.where(visible, last, buffer_row(row, begin))
        rules = torch.stack((last, back, ahead), 1)
    spans = torch.stack((row, q, n, buffer_row(row, lo), split, ds), 1)
    return _plan(exchange, rows, spans, reach, flags, rules)


def plan_needed_intervals(
    rank: int, runs: LayoutRuns, intervals: tuple[torch.Tensor, ...], reach: int
) -> NeededRowsPlan:
    """Rank ``rank``'s exchange of explicit key intervals: ``intervals`` ``(rank, row, lo, hi)``
    of every rank (int64, sorted by rank, row and ``lo``, disjoint) are the rows each rank's
    buffer holds, in global order per batch row; each rank's must hold all its own document
    tokens (they are copied locally, not counted as received). The plan has no spans (the
    caller says which buffer rows each query sees); ``reach``: the most keys a query sees."""
    exchange = _interval_exchange(rank, runs, intervals)
    rows = _buffer_rows(runs, exchange.mine)
    return _plan(exchange, rows, torch.zeros(0, 6, dtype=torch.int64), reach)


@dataclass(frozen=True)
class _BufferRows:
    """One rank's key buffer: its intervals back to back per batch row, ``width`` rows each
    (``keys``: their sorted row-and-start keys, ``offset``: each one's first buffer row,
    ``ilo``: its start)."""

    padded: int
    width: int
    keys: torch.Tensor
    offset: torch.Tensor
    ilo: torch.Tensor

    def buffer_row(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Buffer rows of the needed positions ``position`` of batch rows ``row``."""
        j = torch.searchsorted(self.keys, row * (self.padded + 1) + position, right=True) - 1
        return self.offset[j] + position - self.ilo[j]


def _buffer_rows(runs: LayoutRuns, mine: tuple[torch.Tensor, ...]) -> _BufferRows:
    """The buffer of this rank's intervals ``mine`` (row, lo, hi; in row and position order,
    disjoint; adjacent ones are merged here)."""
    irow, ilo, ihi = _merge(torch.zeros_like(mine[0]), *mine)[1:]
    size = ihi - ilo
    per_row = _per_rank(runs.rows, irow, size)
    width = int(per_row.max()) if runs.rows else 0
    # buffer row of each interval's first position: the rows of the row's earlier intervals
    offset = torch.cumsum(size, 0) - size - (torch.cumsum(per_row, 0) - per_row)[irow]
    return _BufferRows(runs.padded, width, irow * (runs.padded + 1) + ilo, offset, ilo)


def _plan(
    exchange: _IntervalExchange | ClosedExchange, rows: _BufferRows, spans: torch.Tensor,
    reach: int, causal: torch.Tensor | None = None, rules: torch.Tensor | None = None,
) -> NeededRowsPlan:  # fmt: skip
    """The :class:`NeededRowsPlan` of an exchange into the buffer ``rows`` with the given spans
    and their kinds."""
    e = exchange
    counts = (e.send_counts, e.recv_counts, e.received, e.sent)
    return NeededRowsPlan(
        spans, rows.width, *(tuple(c.tolist()) for c in counts), reach, e.tables(rows),
        causal, rules,
    )  # fmt: skip


@dataclass(frozen=True)
class _IntervalExchange:
    """Rank ``rank``'s exchange of every rank's merged intervals: rows every rank receives from
    and sends to the others (``received``, ``sent``), what this rank receives from and sends to
    each (``recv_counts``, ``send_counts``), its own intervals ``mine`` (row, lo, hi) and the
    ranges its row tables are made from (:class:`_TableRecipe`)."""

    runs: LayoutRuns
    received: torch.Tensor
    sent: torch.Tensor
    recv_counts: torch.Tensor
    send_counts: torch.Tensor
    mine: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    source: torch.Tensor
    first: torch.Tensor
    count: torch.Tensor
    send_first: torch.Tensor
    send_count: torch.Tensor

    def tables(self, rows: _BufferRows) -> _TableRecipe:
        world = self.runs.world
        irow = self.mine[0]
        return _TableRecipe(
            self.runs, rows.width, self.source, irow.repeat(world), self.first, self.count,
            (rows.offset - rows.ilo).repeat(world), self.send_first, self.send_count,
        )  # fmt: skip


def _interval_exchange(
    rank: int, runs: LayoutRuns, merged: tuple[torch.Tensor, ...]
) -> _IntervalExchange:
    """Rank ``rank``'s :class:`_IntervalExchange` of every rank's disjoint intervals ``merged``
    (rank, row, lo, hi; sorted), each rank's holding its own document tokens."""
    world, length = runs.world, runs.local_len
    mr, mrow, mlo, mhi = merged

    # Counted for every rank: rows needed, of them its own, and its rows counted once per rank
    # that needs them (over its runs: padding is never needed).
    needed = _per_rank(world, mr, mhi - mlo)
    # Its own rows among them: all its document tokens (each run lies in its own interval, and
    # the intervals hold document positions only).
    own = runs.tokens()
    received, sent = needed - own, _served(runs, mrow, mlo, mhi) - own

    lo_i, hi_i = torch.searchsorted(mr, torch.tensor([rank, rank + 1])).tolist()
    irow, ilo, ihi = mrow[lo_i:hi_i], mlo[lo_i:hi_i], mhi[lo_i:hi_i]

    # Received: every source's positions inside its intervals, by source, row and position.
    prefix = runs.prefix
    sources = torch.arange(world).repeat_interleave(irow.numel())
    first, last = prefix.every_before(irow.repeat(2), torch.cat((ilo, ihi))).chunk(2, 1)
    first = first.reshape(-1)
    count = last.reshape(-1) - first
    recv_counts = _per_rank(world, sources, count)

    # What it sends: its positions inside every rank's intervals, a range of its slots each.
    send_first, send_last = prefix.before_on(rank, mrow.repeat(2), torch.cat((mlo, mhi))).chunk(2)
    send_count = send_last - send_first
    send_counts = _per_rank(world, mr, send_count)
    return _IntervalExchange(
        runs, received, sent, recv_counts, send_counts, (irow, ilo, ihi), sources, first, count,
        mrow * length + send_first, send_count,
    )  # fmt: skip


def _served(
    runs: LayoutRuns, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """``[W]``: every rank's document tokens counted once per interval ``[lo, hi)`` (of batch
    rows ``row``; intervals of document positions) that holds them."""
    if runs.closed is not None:
        return runs.closed.served(row, lo, hi)
    covered = Coverage(row, lo, hi, runs.rows, runs.padded, runs.n.numel())
    start = runs.begin
    counts = covered.below(runs.row, start + runs.n) - covered.below(runs.row, start)
    return _per_rank(runs.world, runs.rank, counts)
