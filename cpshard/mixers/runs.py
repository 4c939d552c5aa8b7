"""The runs of a step's documents on every rank, and how a recurrence's state travels along them
(host work, once per step, identical on every rank).

A run is a maximal stretch of one document's consecutive positions on one rank (in one batch
row). A recurrence (linear attention, a state-space scan) starts each document from a zero state;
a run that does not begin its document must start from the state the document's previous run
(on some rank) leaves, and that run from the one before it, back to the document's start. Runs
that end before their document does are *exported*: their end states (and, when they do not
begin their document, their transitions) are what the other ranks need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpshard.attention.state import AttentionState
from cpshard.layouts import ShardLayout
from cpshard.planning import LayoutRuns, layout_runs

# The most runs of one document a rank may hold: the carry moves one transition operator per
# run that neither begins nor ends its document, so a layout that deals documents out token by
# token (``stripe``) would move one per token.
MAX_RUNS_PER_DOCUMENT = 2


@dataclass(frozen=True)
class Run:
    """One run: batch ``row``, local positions ``[q, q + n)``, global first position
    ``begin``, its document's ``doc_start`` and ``doc_end`` (global)."""

    row: int
    q: int
    n: int
    begin: int
    doc_start: int
    doc_end: int

    @property
    def incoming(self) -> bool:
        """True when the run continues its document (needs the previous run's state)."""
        return self.begin != self.doc_start

    @property
    def exported(self) -> bool:
        """True when its document goes on after it (the next run needs its end state)."""
        return self.begin + self.n < self.doc_end


@dataclass(frozen=True)
class RecurrenceRuns:
    """Every rank's runs of one step (``runs[r]``, row-major, position order) and this rank's.

    ``exported[r]``: rank r's exported runs (indices into ``runs[r]``), the order their states
    travel in. ``source[(row, position)]``: the ``(rank, index into exported[rank])`` of the
    exported run that ends just before global ``position`` of ``row``."""

    rank: int
    local_len: int
    batch_size: int
    runs: tuple[tuple[Run, ...], ...]
    exported: tuple[tuple[int, ...], ...]
    source: dict[tuple[int, int], tuple[int, int]]
    _tables: dict[object, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def mine(self) -> tuple[Run, ...]:
        return self.runs[self.rank]

    @property
    def world(self) -> int:
        return len(self.runs)

    @property
    def carries(self) -> bool:
        """True when some document of the step continues from one rank onto another (the
        carry's all-gather runs); the same on every rank."""
        return any(run.incoming for rs in self.runs for run in rs)

    def previous(self, run: Run) -> tuple[int, int]:
        """``(rank, slot)`` of the exported run whose end state ``run`` starts from."""
        return self.source[(run.row, run.begin)]


def plan_recurrence_runs(
    rank: int, world: int, layout: ShardLayout, doc: torch.Tensor, what: str
) -> RecurrenceRuns:
    """The step's :class:`RecurrenceRuns` from its padded document ids ``doc`` ``[B, P]`` (host,
    0 = padding: pad tokens form no run) and ``layout``. Raises ``ValueError`` (naming ``what``
    and the layout) when a rank holds more than :data:`MAX_RUNS_PER_DOCUMENT` runs of one
    document."""
    return _recurrence_runs(rank, layout, layout_runs(layout, doc), what)


def _recurrence_runs(
    rank: int, layout: ShardLayout, every: LayoutRuns, what: str
) -> RecurrenceRuns:
    """:func:`plan_recurrence_runs` from the step's runs of every rank."""
    world = every.world
    cols = (every.rank, every.row, every.q, every.n, every.begin, every.doc_start, every.doc_end)
    runs: list[list[Run]] = [[] for _ in range(world)]
    per_doc: dict[tuple[int, int, int], int] = {}
    for r, *fields in zip(*(t.tolist() for t in cols), strict=True):
        run = Run(*fields)
        runs[r].append(run)
        key = (r, run.row, run.doc_start)
        per_doc[key] = per_doc.get(key, 0) + 1
        if per_doc[key] > MAX_RUNS_PER_DOCUMENT:
            raise ValueError(
                f"{what}: rank {rank}: the {layout.name!r} layout gives rank {r} more than "
                f"{MAX_RUNS_PER_DOCUMENT} separate pieces of the document at position "
                f"{run.doc_start} (row {run.row}); a recurrence would carry its state "
                "through every piece. Shard models with recurrent or convolutional token "
                "mixers with a layout that keeps documents in few pieces per rank "
                "('contiguous', 'balanced', 'head_tail', 'per_document_head_tail' or the "
                "block-diagonal batch)"
            )
    runs = [tuple(rs) for rs in runs]
    exported = tuple(tuple(i for i, run in enumerate(rs) if run.exported) for rs in runs)
    source = {
        (rs[i].row, rs[i].begin + rs[i].n): (r, slot)
        for r, (rs, ex) in enumerate(zip(runs, exported, strict=True))
        for slot, i in enumerate(ex)
    }
    return RecurrenceRuns(rank, every.local_len, every.rows, tuple(runs), exported, source)


def recurrence_runs(state: AttentionState, what: str) -> RecurrenceRuns:
    """The step's :class:`RecurrenceRuns`, planned on first use and kept in the state."""
    runs = state.derived.get("recurrence runs")
    if runs is None:
        if state.runs is None or state.shard_layout is None:
            raise ValueError(
                f"{what}: rank {state.group.rank}: this CP attention state carries no documents "
                "or layout to plan a recurrence from"
            )
        runs = _recurrence_runs(state.group.rank, state.shard_layout, state.runs, what)
        state.derived["recurrence runs"] = runs
    assert isinstance(runs, RecurrenceRuns)
    return runs
