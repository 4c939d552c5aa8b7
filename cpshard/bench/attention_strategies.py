"""The attention section's strategy grid: CP attention under each exchange strategy
(:mod:`cpshard.attention.strategy`) for MHA and GQA heads, against the all-gather baseline.

A case is one layout's shards and one head shape; every cpshard configuration of the case
shares its inputs and its baseline (the expensive part on CPU), and all are timed side by side:
``needed_rows``, ``heads`` and ``auto`` in the sharder's context on the flat group, the same
three through :func:`cpshard.make_cp_blockdiag_batch_and_ctx` on the ``contiguous`` case (its
shards), and on a 4-rank group ``hierarchical`` and ``auto`` on a 2 x 2 ``(inter, intra)`` mesh
for :data:`MESH_LAYOUTS`. Bytes moved are the cost model's (the busiest rank's, forward and
backward); ``auto`` reports the strategy it picked and every planned strategy's bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpshard import (
    ContextParallelSharder,
    cp_attention,
    cp_blockdiag_sdpa,
    make_cp_blockdiag_batch_and_ctx,
)
from cpshard.attention import active_state
from cpshard.attention.strategy import chosen_strategy, strategy_bytes, strategy_memory
from cpshard.bench.blockdiag import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    all_gather_baseline,
    check_output,
    dense_mask,
    fwd_bwd_timings,
    random_qkv,
)
from cpshard.bench.memory import saved_bytes
from cpshard.bench.runtime import Runtime

HEAD_SHAPES = {"MHA": (HEADS, HEADS), "GQA": (HEADS, KV_HEADS)}  # query heads, KV heads
GRID_LAYOUTS = ("contiguous", "head_tail", "stripe", "balanced")
MESH_LAYOUTS = ("contiguous", "balanced")
FLAT_STRATEGIES = ("needed_rows", "heads", "auto")
MESH_STRATEGIES = ("hierarchical", "auto")
BLOCKDIAG = "blockdiag"  # the block-diagonal batch's entry point (contiguous shards)


@dataclass(frozen=True)
class Config:
    """One cpshard configuration of a case: ``entry`` (a layout name, or :data:`BLOCKDIAG`),
    its ``strategy``, on the 2 x 2 mesh or the flat group."""

    entry: str
    strategy: str
    mesh: bool

    @property
    def label(self) -> str:
        return f"{self.entry}/{self.strategy}{'/mesh' if self.mesh else ''}"


def cases() -> list[tuple[str, str]]:
    """(layout, head shape) of every case, in run order."""
    return [(layout, heads) for heads in HEAD_SHAPES for layout in GRID_LAYOUTS]


def cp_mesh(rt: Runtime) -> DeviceMesh | None:
    """The 2 x 2 ``(inter, intra)`` mesh over the bench's group when it is the whole 4-rank
    world (every rank calls this: building the mesh is collective), else None."""
    if rt.world != 4 or rt.world != dist.get_world_size():
        return None
    return init_device_mesh(rt.device.type, (2, 2), mesh_dim_names=("inter", "intra"))


def configs(layout: str, mesh: DeviceMesh | None) -> list[Config]:
    entries = (layout, BLOCKDIAG) if layout == "contiguous" else (layout,)
    out = [Config(e, s, False) for e in entries for s in FLAT_STRATEGIES]
    if mesh is not None and layout in MESH_LAYOUTS:
        out += [Config(layout, s, True) for s in MESH_STRATEGIES]
    return out


def _context(rt: Runtime, cfg: Config, doc: torch.Tensor, mesh: DeviceMesh | None):
    """The step's context factory and attention function of ``cfg`` for the batch ``doc``."""
    group = mesh if cfg.mesh else rt.pg
    if cfg.entry == BLOCKDIAG:
        batch = {"inputs_embeds": torch.zeros(1, doc.shape[1], 1), "_packed_seq_ids": doc}
        ctx, _ = make_cp_blockdiag_batch_and_ctx(group, None, batch, strategy=cfg.strategy)
        return ctx, cp_blockdiag_sdpa
    sharder = ContextParallelSharder(group, cfg.entry, strategy=cfg.strategy)
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    return ctx, cp_attention


def _max(rt: Runtime, values: list[int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.pg)
    return t.tolist()


def _cost(
    rt: Runtime, q_heads: int, kv_heads: int
) -> tuple[str, dict[str, int], dict[str, int], int]:
    """In a step's context: the strategy its calls use, each planned strategy's bytes moved and
    bytes held at its peak (max over ranks: what ``auto`` weighs) and the K/V rows this rank's
    needed-rows exchange receives."""
    state = active_state()
    size = torch.empty((), dtype=rt.dtype).element_size()
    args = (state, None, q_heads, kv_heads, HEAD_DIM, HEAD_DIM, size)
    costs = strategy_bytes(*args)
    held = strategy_memory(*args)
    maxima = _max(rt, [*costs.values(), *held.values()])  # one all-reduce for both
    return (
        chosen_strategy(*args),
        dict(zip(costs, maxima[: len(costs)])),
        dict(zip(held, maxima[len(costs) :])),
        state.exchange.received_rows,
    )


def run_case(
    rt: Runtime, layout: str, heads: str, doc: torch.Tensor, mesh: DeviceMesh | None
) -> list[dict]:
    """One row per configuration of the case (``layout``'s shards, ``heads`` of
    :data:`HEAD_SHAPES`), each checked against and timed beside the all-gather baseline."""
    q_heads, kv_heads = HEAD_SHAPES[heads]
    sharder = ContextParallelSharder(rt.pg, layout, strategy="needed_rows")
    sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    lay = sharder.shard_layout
    mine = lay.indices(rt.rank)
    keys = torch.cat([lay.indices(r) for r in range(rt.world)])  # the gathered keys' positions
    q, k, v, grad = random_qkv(rt, mine.numel(), q_heads, kv_heads)
    base = all_gather_baseline(rt, dense_mask(doc, mine, keys).to(rt.device))
    impls: dict[str, Callable] = {}
    rows = []
    for cfg in configs(layout, mesh):
        ctx, attend = _context(rt, cfg, doc, mesh)

        def ours(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx=ctx, attend=attend
        ) -> torch.Tensor:
            with ctx():
                return attend(q, k, v, enable_gqa=True)

        check_output(rt, ours, base, (q, k, v), f"attention {cfg.label} {heads}")
        with ctx():
            picked, costs, held, received = _cost(rt, q_heads, kv_heads)
        (received_max,) = _max(rt, [received])
        impls[cfg.label] = ours
        rows.append(
            {
                "layout": cfg.entry,
                "heads": heads,
                "q_heads": q_heads,
                "kv_heads": kv_heads,
                "head_dim": HEAD_DIM,
                "strategy": cfg.strategy,
                "mesh": "2x2" if cfg.mesh else None,
                "picked": picked,
                "bytes_moved_max": costs[picked],
                "strategy_bytes": costs,
                "strategy_held_bytes": held,
                "kv_rows_received_max": received_max if picked == "needed_rows" else None,
                "base_kv_rows_received": mine.numel() * (rt.world - 1),
                "seq_len": doc.shape[1],
                "world": rt.world,
                "documents": int(doc.max()),
                "dtype": rt.cfg.dtype,
                "saved_bytes": saved_bytes(rt, lambda ours=ours: ours(q, k, v), (q, k, v)),
            }
        )
    base_saved = saved_bytes(rt, lambda: base(q, k, v), (q, k, v))
    figures = fwd_bwd_timings(rt, {**impls, "base": base}, (q, k, v), grad)
    for row, label in zip(rows, impls, strict=True):
        row.update(figures[label])
        row.update({f"base_{k}": v for k, v in figures["base"].items()})
        row["base_saved_bytes"] = base_saved
        row["speedup"] = row["base_fwd_bwd_s"] / row["fwd_bwd_s"]
    return rows
