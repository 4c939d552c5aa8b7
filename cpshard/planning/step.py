"""One rank's host plan of a step's CP attention: every table its states need, planned from the
layout and the padded document ids alone (pure, picklable), so that it can be made off the
step's critical path (in a ``DataLoader`` worker) and handed to the step's entry point.

The plan holds the causal exchange (the halo on contiguous shards, else the needed rows), the
runs every other state of the step plans from on first use (its bidirectional twin, its sliding
windows), and the head-parallel plans its strategy may use, each with its own inner plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.layouts import ShardLayout
from cpshard.planning.collector import collector_paused
from cpshard.planning.halo import HaloPlan, plan_halo
from cpshard.planning.head_parallel import head_parallel_kinds, node_layout
from cpshard.planning.needed_rows import NeededRowsPlan, plan_needed_rows
from cpshard.planning.runs import LayoutRuns, layout_runs


@dataclass(frozen=True)
class HeadParallelPlan:
    """A head-parallel plan: ``kind`` (``"heads"`` over the whole group, ``"hierarchical"``
    inside each node of a 2-D mesh), the ``inner`` plan of the ranks that hold the same heads,
    and ``order``: where each token of this rank's gathered shards goes in global order (None:
    they already are)."""

    kind: str
    inner: StepPlan
    order: torch.Tensor | None


@dataclass(frozen=True)
class StepPlan:
    """Rank ``rank``'s plan of a step under ``layout`` for the padded document ids
    ``documents`` ``[B, P]`` (host int64), for ``strategy`` on a group (or a 2-D mesh of
    ``(nodes, ranks per node)``)."""

    rank: int
    layout: ShardLayout
    documents: torch.Tensor
    strategy: str
    mesh: tuple[int, int] | None
    runs: LayoutRuns
    causal: NeededRowsPlan | HaloPlan
    head_parallel: tuple[HeadParallelPlan, ...]

    @property
    def world(self) -> int:
        return self.layout.world_size


def plan_step(
    rank: int,
    layout: ShardLayout,
    documents: torch.Tensor,
    strategy: str = "needed_rows",
    mesh: tuple[int, int] | None = None,
) -> StepPlan:
    """Rank ``rank``'s :class:`StepPlan` (every rank plans alike from the same layout and
    documents; nothing is exchanged). ``mesh``: ``(nodes, ranks per node)`` of a 2-D CP mesh,
    whose flattening numbers rank ``node * ranks_per_node + i``."""
    if strategy == "hierarchical" and mesh is None:
        raise ValueError(
            f"cpshard CP attention: rank {rank}: strategy='hierarchical' needs a 2-D CP mesh "
            "(inter, intra)"
        )
    doc = documents.to("cpu", torch.int64)
    with collector_paused():
        runs = layout_runs(layout, doc)
        if layout.contiguous_shards:
            causal = plan_halo(rank, runs)
        else:
            causal = plan_needed_rows(rank, runs, True)
        head_parallel = []
        for kind in head_parallel_kinds(strategy, mesh):
            nodes, per_node = (1, layout.world_size) if kind == "heads" else mesh
            merged, orders = node_layout(layout, nodes, per_node)
            node = rank // per_node
            inner = plan_step(node, merged, doc)
            head_parallel.append(HeadParallelPlan(kind, inner, orders[node]))
    return StepPlan(rank, layout, doc, strategy, mesh, runs, causal, tuple(head_parallel))
