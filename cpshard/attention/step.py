"""A step's CP attention states, from this rank's plan of the step (:mod:`cpshard.planning`):
host work, once per step, or none when the plan was made ahead (in a DataLoader worker).

Every rank derives the same plan from the same padded document ids and layout. A step has a
causal state (what causal layers attend) and its bidirectional twin (``is_causal=False``,
planned at the step's setup once some layer has attended bidirectionally, else on first use): the
contiguous layout's causal state builds its key buffer with the multi-hop halo
(:mod:`cpshard.attention.halo`: a few rows from the preceding ranks), every other state with the
needed-rows all-to-all-v (:mod:`cpshard.attention.needed_rows`; the rows after a run that
bidirectional attention reaches are not a halo). A sliding window gets the causal state's
plan with each run's keys starting at its first query's window (at most ``window - 1`` rows
before the run), made once per window and step: at the setup for the windows earlier steps'
layers used, else when a layer first asks for it. A mask description
(:class:`~cpshard.masks.MaskDescription`) gets its own state when a layer first passes it: the
halo when its pieces are all causal on contiguous shards, else the needed rows, each piece's
queries seeing the keys its rule says.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpshard.attention import state as states
from cpshard.attention.halo import HaloExchange, halo_spans
from cpshard.attention.head_plan import head_parallel_states
from cpshard.attention.needed_rows import NeededRowsExchange
from cpshard.attention.state import AttentionState, HeadParallel
from cpshard.comm import Group
from cpshard.layouts import ShardLayout
from cpshard.masks import MaskDescription
from cpshard.planning import (
    HaloPlan,
    NeededRowsPlan,
    StepPlan,
    plan_halo,
    plan_needed_rows,
    plan_step,
)
from cpshard.planning.collector import collector_paused


def _state(
    group: Group,
    plan: StepPlan,
    exchange: NeededRowsPlan | HaloPlan,
    window: int | None = None,
    plan_twin: Callable[[], AttentionState] | None = None,
    plan_window: Callable[[int], AttentionState] | None = None,
    head_parallel: tuple[HeadParallel, ...] = (),
    mask: MaskDescription | None = None,
    plan_mask: Callable[[MaskDescription], AttentionState] | None = None,
) -> AttentionState:
    """The state of one exchange plan of the step: causal when it is given how to plan its
    bidirectional twin (``plan_twin``), ``mask``'s when given the description it executes;
    the halo's spans over the halo-extended buffer."""
    b, padded = plan.documents.shape
    local = padded // group.world
    rules = None
    if isinstance(exchange, HaloPlan):
        kv = HaloExchange(group, group.rank * local, local, b, exchange.halos)
        spans = halo_spans(kv, exchange.runs, window, exchange.firsts)
        if mask is not None:  # causal pieces, each with its sliding start (or none)
            assert exchange.backs is not None, "a mask's halo plan has its pieces' starts"
            back = torch.tensor(exchange.backs, dtype=torch.int64)
            zero = torch.zeros_like(back)
            rules = torch.stack((spans[:, 4] + spans[:, 2], back, zero), 1)
    else:
        kv, spans = NeededRowsExchange.from_plan(group, exchange), exchange.spans
        rules = exchange.rules
    return AttentionState(
        group=group,
        layout=plan.layout.name,
        local_len=local,
        batch_size=b,
        reach=exchange.reach,
        causal=plan_twin is not None,
        span_table=spans,
        exchange=kv,
        plan_twin=plan_twin,
        window=window,
        plan_window=plan_window,
        mask=mask,
        rules=rules,
        plan_mask=plan_mask,
        documents=plan.documents,
        shard_layout=plan.layout,
        runs=plan.runs,
        strategy=plan.strategy,
        head_parallel=head_parallel,
    )


def state_from_plan(
    group: Group,
    plan: StepPlan,
    device: torch.device | None = None,
    mesh: tuple[Group, Group] | None = None,
) -> AttentionState:
    """The step's causal :class:`AttentionState` for this rank from its ``plan`` (made for this
    rank, group size and strategy); its twin and windows are planned from the plan's runs when
    first used. ``device``: where the step's metadata goes once; ``mesh``: the ``(inter,
    intra)`` groups of a 2-D CP mesh whose flattening is ``group``."""
    with collector_paused():
        return _states(group, plan, device, mesh)


def _states(
    group: Group, plan: StepPlan, device: torch.device | None, mesh: tuple[Group, Group] | None
) -> AttentionState:
    """:func:`state_from_plan`'s work (the collector paused by the caller)."""
    plans = head_parallel_states(group, plan, device, mesh, state_from_plan)
    runs, rank = plan.runs, group.rank
    routes = {"head_parallel": plans}  # the step's, not its windows'
    twins: list[AttentionState] = []

    def place(state: AttentionState) -> AttentionState:
        if device is not None:
            state.place_on(device)
        return state

    def plan_twin() -> AttentionState:  # the bidirectional state, planned once per step
        if not twins:
            with collector_paused():
                exchange = plan_needed_rows(rank, runs, False)
                twins.append(place(_state(group, plan, exchange, **routes)))
        return twins[0]

    def plan_window(window: int) -> AttentionState:
        with collector_paused():
            if plan.layout.contiguous_shards:
                exchange = plan_halo(rank, runs, window)
            else:
                exchange = plan_needed_rows(rank, runs, True, window)
            return place(_state(group, plan, exchange, window, plan_twin))

    def plan_mask(mask: MaskDescription) -> AttentionState:  # once per description and step
        padded = plan.documents.shape[1]
        with collector_paused():
            try:
                if mask.rows != plan.documents.shape[0] or mask.length > padded:
                    raise ValueError(
                        f"the mask describes a [{mask.rows}, {mask.length}] batch, the step's "
                        f"documents are {list(plan.documents.shape)} (padded)"
                    )
                full = mask.padded_to(padded)
                if plan.layout.contiguous_shards and bool((full.ahead == 0).all()):
                    exchange: NeededRowsPlan | HaloPlan = plan_halo(rank, runs, mask=full)
                else:
                    exchange = plan_needed_rows(rank, runs, mask=full)
            except ValueError as e:
                raise ValueError(f"mask: {e}") from None
            return place(_state(group, plan, exchange, mask=mask, **routes))

    state = place(
        _state(
            group, plan, plan.causal, None, plan_twin, plan_window, plan_mask=plan_mask, **routes
        )
    )
    if states.seen_bidirectional:  # layers of earlier steps attended bidirectionally
        state.bidirectional()
    for window in sorted(states.seen_windows):  # the windows earlier steps' layers used
        state.windowed(window)
    return state


def step_state(
    group: Group,
    layout: ShardLayout,
    doc_ids: torch.Tensor,
    device: torch.device | None = None,
    strategy: str = "needed_rows",
    mesh: tuple[Group, Group] | None = None,
) -> AttentionState:
    """The step's causal :class:`AttentionState` for this rank (its bidirectional twin from
    ``.bidirectional()``), planned here from the batch's document ids ``[B, P]`` (padded
    length, host, 0 = padding; a document = a maximal run of one non-zero id). Every rank
    passes the same ids and layout (the entry point agreed on them). ``strategy``: how the
    step's calls exchange (``"needed_rows"``, ``"heads"``, ``"hierarchical"`` or ``"auto"``:
    :mod:`cpshard.attention.strategy`); ``mesh``: the ``(inter, intra)`` groups of a 2-D CP
    mesh whose flattening is ``group`` (hierarchical)."""
    dims = None if mesh is None else (mesh[0].world, mesh[1].world)
    plan = plan_step(group.rank, layout, doc_ids, strategy, dims)
    return state_from_plan(group, plan, device, mesh)
