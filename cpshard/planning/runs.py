"""Every rank's runs of a step's documents under one layout: what every plan of the step (the
causal and bidirectional states, each window, the halo) is computed from, once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpshard.batch.runs import all_rank_runs, contiguous_runs
from cpshard.layouts import ShardLayout
from cpshard.planning.positions import RankPrefix, all_positions


@dataclass(frozen=True)
class LayoutRuns:
    """The runs of every rank (consecutive global positions of one document on one rank, in one
    batch row), ordered by rank, row and position: ``rank``, ``row``, first local index ``q``,
    length ``n``, document start ``doc_start`` and first global position ``begin`` (int64
    vectors) and its document's end ``doc_end`` (one past its last token). :attr:`positions`
    ``[W, B, L]`` are every rank's positions under ``layout`` and :attr:`prefix` counts them
    below a position (made when a plan first asks: the halo of contiguous shards never does)."""

    world: int
    rows: int
    padded: int
    layout: ShardLayout
    rank: torch.Tensor
    row: torch.Tensor
    q: torch.Tensor
    n: torch.Tensor
    doc_start: torch.Tensor
    begin: torch.Tensor
    doc_end: torch.Tensor
    _made: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    @property
    def positions(self) -> torch.Tensor:
        """``[W, B, L]``: every rank's positions (:func:`all_positions`)."""
        if "positions" not in self._made:
            self._made["positions"] = all_positions(self.layout, self.rows)
        return self._made["positions"]  # type: ignore[return-value]

    @property
    def prefix(self) -> RankPrefix:
        """Counts of every rank's positions below a position (:class:`RankPrefix`)."""
        if "prefix" not in self._made:
            self._made["prefix"] = RankPrefix(self.positions, self.padded)
        return self._made["prefix"]  # type: ignore[return-value]

    @property
    def local_len(self) -> int:
        return self.padded // max(self.world, 1)

    def ends(self, causal: bool) -> torch.Tensor:
        """One past each run's last visible key: its own end (causal) or its document's."""
        return self.begin + self.n if causal else self.doc_end

    def starts(self, window: int | None) -> torch.Tensor:
        """Each run's first visible key: its document's start, or its first query's window's."""
        if window is None:
            return self.doc_start
        return torch.maximum(self.doc_start, self.begin - window + 1)

    def reach(self, causal: bool) -> int:
        """The most keys a query attends without a window (0: no runs)."""
        return int((self.ends(causal) - self.doc_start).max()) if self.n.numel() else 0


def layout_runs(layout: ShardLayout, doc: torch.Tensor) -> LayoutRuns:
    """The :class:`LayoutRuns` of the padded document ids ``doc`` ``[B, P]`` (host int64, 0 =
    pad) under ``layout`` (equal shards): one pass over the sequence, whatever the world size;
    for contiguous shards, from the documents' bounds alone."""
    b, padded = doc.shape
    made: dict[str, object] = {}
    if layout.contiguous_shards:
        runs = contiguous_runs(layout.world_size, doc)
    else:
        made["positions"] = all_positions(layout, b)
        runs = all_rank_runs(made["positions"], doc)  # type: ignore[arg-type]
    return LayoutRuns(layout.world_size, b, padded, layout, *runs, _made=made)
