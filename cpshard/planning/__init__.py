"""The step's host planners: pure functions of a layout, the batch's document ids and the sizes
(no collectives, no device, no global state), which the step's entry points, a DataLoader worker
and the ``cpshard plan`` simulator all call. Each costs a rank O(P + runs) whole-tensor work,
never a pass over the sequence per rank, so adding ranks never makes a rank's planning slower.

* :mod:`~cpshard.planning.spans`: the unit of a step's attention (a query run and its keys);
* :mod:`~cpshard.planning.positions`: every rank's positions at once, prefix counts over them;
* :mod:`~cpshard.planning.runs`: every rank's runs of the step's documents, once per step;
* :mod:`~cpshard.planning.needed_rows`: the needed-rows K/V exchange of any layout;
* :mod:`~cpshard.planning.halo`: the multi-hop halo of contiguous shards;
* :mod:`~cpshard.planning.head_parallel`: the node unions and orders of head-parallel CP;
* :mod:`~cpshard.planning.step`: one rank's whole plan of a step (picklable).
"""

from cpshard.planning.halo import HaloPlan, plan_halo
from cpshard.planning.head_parallel import head_parallel_kinds, node_layout
from cpshard.planning.needed_rows import (
    NeededRowsPlan,
    plan_needed_intervals,
    plan_needed_rows,
)
from cpshard.planning.positions import RankPrefix, all_positions
from cpshard.planning.runs import LayoutRuns, layout_runs
from cpshard.planning.spans import Span
from cpshard.planning.step import HeadParallelPlan, StepPlan, plan_step

__all__ = [
    "HaloPlan",
    "HeadParallelPlan",
    "LayoutRuns",
    "NeededRowsPlan",
    "RankPrefix",
    "Span",
    "StepPlan",
    "all_positions",
    "head_parallel_kinds",
    "layout_runs",
    "node_layout",
    "plan_halo",
    "plan_needed_intervals",
    "plan_needed_rows",
    "plan_step",
]
