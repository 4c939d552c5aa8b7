"""The step's host planners: pure functions of a layout, the batch's document ids and the sizes
(no collectives, no device, no global state), which the step's entry points, a DataLoader worker
and the ``cpshard plan`` simulator all call. Each costs a rank O(P + runs) whole-tensor work,
never a pass over the sequence per rank, so adding ranks never makes a rank's planning slower.

* :mod:`~cpshard.planning.spans`: the unit of a step's attention (a query run and its keys);
* :mod:`~cpshard.planning.positions`: every rank's positions at once, prefix counts over them;
* :mod:`~cpshard.planning.runs`: every rank's runs of the step's documents, once per step;
* :mod:`~cpshard.planning.needed_rows`: the needed-rows K/V exchange of any layout;
* :mod:`~cpshard.planning.halo`: the multi-hop halo of contiguous shards.
"""

from cpshard.planning.halo import HaloPlan, plan_halo
from cpshard.planning.needed_rows import NeededRowsPlan, plan_needed_rows
from cpshard.planning.positions import RankPrefix, all_positions
from cpshard.planning.runs import LayoutRuns, layout_runs
from cpshard.planning.spans import Span

__all__ = [
    "HaloPlan",
    "LayoutRuns",
    "NeededRowsPlan",
    "RankPrefix",
    "Span",
    "all_positions",
    "layout_runs",
    "plan_halo",
    "plan_needed_rows",
]
