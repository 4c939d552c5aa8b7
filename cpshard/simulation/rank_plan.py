"""One simulated rank's plan of a step: what its ``shard()`` computes and what the step would
cost it (tokens, attention cost, K/V rows and bytes per strategy, key-buffer memory, planning
time), from the same state a real rank builds (:mod:`cpshard.simulation.fake_rank`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpshard import layouts
from cpshard.attention import state as states
from cpshard.attention.halo import HaloExchange
from cpshard.attention.head_split import split_heads
from cpshard.attention.needed_rows import NeededRowsExchange
from cpshard.attention.state import AttentionState, HeadParallel, active_state
from cpshard.attention.strategy import chosen_strategy, strategy_bytes
from cpshard.layouts import ShardLayout
from cpshard.layouts.owners import owner_ranks
from cpshard.planning.head_parallel import head_parallel_kinds
from cpshard.sharder import ContextParallelSharder
from cpshard.simulation.fake_rank import simulated_rank
from cpshard.simulation.head_shape import HeadShape


@dataclass(frozen=True)
class RankPlan:
    """Rank ``rank``'s figures. Rows count every batch row; bytes are a forward and backward of
    one layer (the strategy cost model's: received rows twice, sent rows once, for K and V);
    ``strategy_bytes``: this rank's, ``busiest_bytes``: the busiest rank's (alike on every
    rank); ``key_buffer_bytes``: the needed-rows key buffer's K and V over ``layers``."""

    rank: int
    tokens: int  # real (non-padding) tokens this rank holds
    local_len: int  # tokens per rank, padding included
    cost: int  # causal (query, key) pairs this rank attends
    cost_over_mean: float
    rows_received: int
    rows_sent: int
    key_rows: int
    key_buffer_bytes: int
    strategy_bytes: dict[str, int]
    busiest_bytes: dict[str, int]
    strategy: str  # the one the step's calls use (auto: the fewest busiest-rank bytes)
    plan_ms: float  # wall time of shard()


# The attention shape a step is costed for when none is given: a Llama-3-8B layer.
DEFAULT_SHAPE = HeadShape(heads=32, kv_heads=8, head_dim=128)


def plan_step(
    group: dist.ProcessGroup | DeviceMesh, layout: str, strategy: str, doc_ids: torch.Tensor,
    shape: HeadShape = DEFAULT_SHAPE,
) -> tuple[AttentionState, ShardLayout, float]:  # fmt: skip
    """Shard one ``[1, S]`` batch of ``doc_ids`` as this rank: its causal attention state, the
    layout and the milliseconds the step's setup took, as in a CPU training loop's later steps:
    ``shard()`` with the loop's blocks and every head-parallel plan the strategy may use made at
    the setup, plus the needed-rows exchange's tables when the strategy the calls of a layer of
    ``shape`` use is the needed-rows exchange (the setup then makes them)."""
    states.seen_views.add("blocks")
    states.seen_views.update(head_parallel_kinds(strategy, _mesh_dims(group)))
    sharder = ContextParallelSharder(group, layout, strategy=strategy)
    tokens = torch.arange(doc_ids.shape[1]).view(1, -1)
    batch = {"input_ids": tokens, "labels": tokens, "_packed_seq_ids": doc_ids}
    start = time.perf_counter()
    ctx, _ = sharder.shard(batch)
    with ctx():
        state = active_state()
    assert state is not None and sharder.shard_layout is not None
    args = (shape.window, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim)
    exchange = state.windowed(shape.window).exchange
    if chosen_strategy(state, *args, shape.dtype_bytes) == "needed_rows" and isinstance(
        exchange, NeededRowsExchange
    ):
        exchange.tables  # noqa: B018 -- made as the setup makes them
    ms = (time.perf_counter() - start) * 1e3
    return state, sharder.shard_layout, ms


def _mesh_dims(group: dist.ProcessGroup | DeviceMesh) -> tuple[int, int] | None:
    """``(nodes, ranks per node)`` of a 2-D mesh, else None."""
    return tuple(group.shape) if isinstance(group, DeviceMesh) else None  # type: ignore[return-value]


def rows_moved(exchange: object) -> tuple[int, int]:
    """(rows this rank receives, rows it sends to the other ranks) in ``exchange``."""
    if isinstance(exchange, HaloExchange):
        rank, length = exchange.group.rank, exchange.local_len
        lo, hi = rank * length, (rank + 1) * length
        sent = sum(  # rows of this rank's shard in the other ranks' halos
            max(0, min(hi, q * length) - max(lo, q * length - min(h, q * length)))
            for q, h in enumerate(exchange.halos)
            if q != rank
        )
        return exchange.received_rows, sent * exchange.batch_size
    counts = exchange.send_counts  # type: ignore[attr-defined]
    return exchange.received_rows, sum(counts) - counts[exchange.group.rank]  # type: ignore[attr-defined]


def _head_parallel_bytes(
    plan: HeadParallel, state: AttentionState, shape: HeadShape
) -> int:
    """This rank's bytes under ``plan`` (the per-rank form of
    :func:`cpshard.attention.strategy.head_parallel_bytes`)."""
    world, rank = plan.group.world, plan.group.rank
    split = split_heads(shape.heads, shape.kv_heads, world)
    width = 2 * shape.head_dim
    held = [(qc + kc) * width for (_, qc), (_, kc) in zip(split.q, split.kv, strict=True)]
    tokens = state.batch_size * state.local_len
    inner = plan.inner if state.causal else plan.inner.bidirectional()
    received, sent = rows_moved(inner.windowed(shape.window).exchange)
    kv_count = split.kv[rank][1]
    moved = tokens * ((world - 1) * held[rank] + sum(held) - held[rank])
    return (moved + (2 * received + sent) * kv_count * width) * shape.dtype_bytes


# The last job's per-rank costs: (its document ids, layout key) -> costs. Every rank of a job
# plans the same layout from the same ids, so the simulated ranks share them.
_last_job: list[tuple[torch.Tensor, tuple, torch.Tensor]] = []


def _job_costs(doc_ids: torch.Tensor, shard_layout: ShardLayout) -> torch.Tensor:
    """Every rank's causal attention cost under ``shard_layout`` (one pass over the sequence per
    job, not per simulated rank)."""
    lay = shard_layout
    key = (lay.name, lay.world_size, lay.original_seq_len, lay.padded_seq_len, lay.num_chunks)
    if _last_job and _last_job[0][0] is doc_ids and _last_job[0][1] == key:
        return _last_job[0][2]
    padded = torch.cat([doc_ids, doc_ids.new_zeros(1, lay.padded_seq_len - doc_ids.shape[1])], 1)
    costs = layouts.rank_costs(padded, owner_ranks(lay).view(1, -1), lay.world_size)
    _last_job[:] = [(doc_ids, key, costs)]
    return costs


def _own_tokens(state: AttentionState) -> int:
    """The real (document) tokens this rank holds: the lengths of its runs."""
    runs = state.runs
    assert runs is not None
    return int(runs.tokens()[state.group.rank])


def rank_plan(
    state: AttentionState, shard_layout: ShardLayout, doc_ids: torch.Tensor, shape: HeadShape,
    plan_ms: float,
) -> RankPlan:  # fmt: skip
    """The figures of this rank's ``state`` for a model of ``shape``."""
    rank, world = state.group.rank, state.group.world
    costs = _job_costs(doc_ids, shard_layout)
    mean = float(costs.double().mean())
    windowed = state.windowed(shape.window)
    received, sent = rows_moved(windowed.exchange)
    row_bytes = shape.kv_heads * 2 * shape.head_dim * shape.dtype_bytes
    mine = {"needed_rows": (2 * received + sent) * row_bytes}
    for plan in state.head_parallel:
        mine[plan.kind] = _head_parallel_bytes(plan, state, shape)
    args = (shape.window, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim)
    key_rows = windowed.exchange.key_len * state.batch_size
    return RankPlan(
        rank=rank,
        tokens=_own_tokens(state),
        local_len=state.local_len,
        cost=int(costs[rank]),
        cost_over_mean=float(costs[rank]) / mean if mean > 0 else 1.0,
        rows_received=received,
        rows_sent=sent,
        key_rows=key_rows,
        key_buffer_bytes=key_rows * row_bytes * (shape.layers or 1),
        strategy_bytes=mine,
        busiest_bytes=strategy_bytes(state, *args, shape.dtype_bytes),
        strategy=chosen_strategy(state, *args, shape.dtype_bytes),
        plan_ms=plan_ms,
    )


def simulate_rank(
    rank: int, world: int, layout: str, strategy: str, doc_ids: torch.Tensor, shape: HeadShape,
    mesh: tuple[int, int] | None = None,
) -> RankPlan:  # fmt: skip
    """Plan the step of ``doc_ids`` as rank ``rank`` of ``world`` (one process) and report it."""
    with simulated_rank(rank, world, mesh) as group:
        state, shard_layout, ms = plan_step(group, layout, strategy, doc_ids, shape)
        return rank_plan(state, shard_layout, doc_ids, shape, ms)
