"""A step's CP attention states, from its layout and documents (host work, once per step).

Every rank derives the same plan from the same padded document ids and layout. A step has a
causal state (what causal layers attend) and its bidirectional twin (``is_causal=False``,
planned at the step's setup once some layer has attended bidirectionally, else on first use): the
contiguous layout's causal state builds its key buffer with the multi-hop halo
(:mod:`cpshard.attention.halo`: a few rows from the preceding ranks), every other state with the
needed-rows all-to-all-v (:mod:`cpshard.attention.needed_rows`; the rows after a run that
bidirectional attention reaches are not a halo). A sliding window gets the causal state's
plan with each run's keys starting at its first query's window (at most ``window - 1`` rows
before the run), made once per window and step: at the setup for the windows earlier steps'
layers used, else when a layer first asks for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpshard.attention.halo import HaloExchange, halo_spans
from cpshard.attention.head_plan import head_parallel_plans
from cpshard.attention.needed_rows import NeededRowsExchange
from cpshard.attention import state as states
from cpshard.attention.state import AttentionState, HeadParallel
from cpshard.comm import Group
from cpshard.layouts import ShardLayout
from cpshard.planning import LayoutRuns, layout_runs, plan_halo, plan_needed_rows


def _state(
    group: Group,
    layout: ShardLayout,
    doc: torch.Tensor,
    runs: LayoutRuns,
    twin: AttentionState | None,
    window: int | None = None,
    plan_window: Callable[[int], AttentionState] | None = None,
    strategy: str = "needed_rows",
    head_parallel: tuple[HeadParallel, ...] = (),
    plan_twin: Callable[[], AttentionState] | None = None,
) -> AttentionState:
    """The needed-rows state (causal when it is given the bidirectional ``twin`` or how to
    plan it, ``plan_twin``)."""
    plan = plan_needed_rows(group.rank, runs, twin is not None or plan_twin is not None, window)
    b, padded = doc.shape
    return AttentionState(
        group=group,
        layout=layout.name,
        local_len=padded // group.world,
        batch_size=b,
        reach=plan.reach,
        causal=twin is not None or plan_twin is not None,
        spans=plan.spans,
        exchange=NeededRowsExchange.from_plan(group, plan),
        twin=twin,
        plan_twin=plan_twin,
        window=window,
        plan_window=plan_window,
        documents=doc,
        shard_layout=layout,
        strategy=strategy,
        head_parallel=head_parallel,
    )


def _halo_state(
    group: Group,
    layout: ShardLayout,
    doc: torch.Tensor,
    runs: LayoutRuns,
    twin: AttentionState | None,
    window: int | None = None,
    plan_window: Callable[[int], AttentionState] | None = None,
    strategy: str = "needed_rows",
    head_parallel: tuple[HeadParallel, ...] = (),
    plan_twin: Callable[[], AttentionState] | None = None,
) -> AttentionState:
    """The causal state of a layout whose ranks hold contiguous runs (``contiguous``): each
    rank's runs see their document from its start (or their ``window``), over its K/V with the
    halo its first tokens' documents (windows) reach back to in front."""
    b, padded = doc.shape
    local = padded // group.world
    plan = plan_halo(group.rank, runs, window)
    exchange = HaloExchange(group, group.rank * local, local, b, plan.halos)
    return AttentionState(
        group=group,
        layout=layout.name,
        local_len=local,
        batch_size=b,
        reach=plan.reach,
        causal=True,
        spans=halo_spans(exchange, plan.runs, window),
        exchange=exchange,
        twin=twin,
        plan_twin=plan_twin,
        window=window,
        plan_window=plan_window,
        documents=doc,
        shard_layout=layout,
        strategy=strategy,
        head_parallel=head_parallel,
    )


def step_state(
    group: Group,
    layout: ShardLayout,
    doc_ids: torch.Tensor,
    device: torch.device | None = None,
    strategy: str = "needed_rows",
    mesh: tuple[Group, Group] | None = None,
) -> AttentionState:
    """The step's causal :class:`AttentionState` for this rank (its bidirectional twin from
    ``.bidirectional()``, planned at the setup once a layer has attended bidirectionally, else
    on first use), from the batch's document ids ``[B, P]`` (padded length, host, 0 = padding; a
    document = a maximal run of one non-zero id). Every rank passes the same ids and layout (the
    entry point agreed on them). ``device``: where the step's metadata goes once (the batch's
    device). ``strategy``: how the step's calls exchange (``"needed_rows"``, ``"heads"``,
    ``"hierarchical"`` or ``"auto"``: :mod:`cpshard.attention.strategy`); ``mesh``: the
    ``(inter, intra)`` groups of a 2-D CP mesh whose flattening is ``group`` (hierarchical)."""
    doc = doc_ids.to("cpu", torch.int64)
    plans = head_parallel_plans(group, layout, doc, device, strategy, mesh, step_state)
    routes = {"strategy": strategy, "head_parallel": plans}  # the step's, not its windows'
    runs = layout_runs(layout, doc)  # what every state and window of the step plans from
    planned: list[AttentionState] = []

    def plan_twin() -> AttentionState:  # the bidirectional state, planned once per step
        if not planned:
            planned.append(_state(group, layout, doc, runs, None, **routes))
            if device is not None:
                planned[0].place_on(device)
        return planned[0]

    causal = _halo_state if layout.contiguous_shards else _state

    def plan_window(window: int) -> AttentionState:
        state = causal(group, layout, doc, runs, None, window, plan_twin=plan_twin)
        if device is not None:
            state.place_on(device)
        return state

    state = causal(
        group, layout, doc, runs, None, plan_window=plan_window, plan_twin=plan_twin, **routes
    )
    if device is not None:  # the attention's metadata on the batch's device, once per step
        state.place_on(device)
    if states.seen_bidirectional:  # layers of earlier steps attended bidirectionally
        state.bidirectional()
    for window in sorted(states.seen_windows):  # the windows earlier steps' layers used
        state.windowed(window)
    return state
