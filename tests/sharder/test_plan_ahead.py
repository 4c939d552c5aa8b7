"""A step planned ahead (``sharder.plan(batch)``, in a ``DataLoader`` worker) and handed to
``sharder.shard(batch, plan=...)``: the same sharded batch and the same attention (forward and
float64 gradients) as a step planned inline, at W = 1-4 on gloo, every layout and strategy; a
plan made for another batch, layout, rank, world size or strategy raises on every rank."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.sharder import ContextParallelSharder
from tests.helpers import assert_no_mismatches

WORLDS = [1, 2, 3, 4]
LAYOUTS = ("contiguous", "head_tail", "stripe", "per_document_head_tail", "balanced")


def _batch(seed: int, lengths: tuple[int, ...] = (9, 14, 1, 6), pad: int = 3) -> dict:
    ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(pad)])
    doc = ids.long()[None].repeat(2, 1)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 100, doc.shape, generator=gen) * (doc != 0)
    return {"input_ids": tokens, "labels": tokens.masked_fill(doc == 0, -100), "_packed_seq_ids": doc}


def _attention(ctx, sharded: dict, seed: int) -> tuple[torch.Tensor, ...]:
    """One causal and one bidirectional CP attention call over this rank's tokens."""
    gen = torch.Generator().manual_seed(seed)
    b, n = sharded["input_ids"].shape
    q, k, v = (torch.randn(b, 4, n, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    with ctx():
        pos = sharded["position_ids"]
        out = cpshard.cp_attention(q, k, v, is_causal=True, position_ids=pos)
        out = out + cpshard.cp_attention(q, k, v, is_causal=False, position_ids=pos)
    out.square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


class _PlanningCollate:
    """A collate function a spawned worker can run: the batch and its plan by the sharder's
    picklable planner."""

    def __init__(self, planner) -> None:
        self.planner = planner

    def __call__(self, items: list[dict]) -> tuple[dict, object]:
        return items[0], self.planner(items[0])


def _run_plan_ahead(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    g = dist.group.WORLD
    for layout in LAYOUTS:
        for strategy in ("needed_rows", "heads", "auto"):
            sharder = ContextParallelSharder(g, layout, strategy=strategy)
            batch = _batch(3)
            planner = pickle.loads(pickle.dumps(sharder.planner()))  # crosses processes
            plans = {
                "plan": pickle.loads(pickle.dumps(sharder.plan(batch))),
                "planner": pickle.loads(pickle.dumps(planner(batch))),
            }
            ctx_b, b = sharder.shard(batch)
            want = _attention(ctx_b, b, 5)
            for how, plan in plans.items():
                ctx_a, a = sharder.shard(batch, plan=plan)
                tag = f"{layout}/{strategy} by {how}"
                for key, value in b.items():
                    if isinstance(value, torch.Tensor) and not torch.equal(a[key], value):
                        bad.append(f"{tag}: {key} differs")
                if a.targets.labels is None or not torch.equal(a.targets.labels, b.targets.labels):
                    bad.append(f"{tag}: labels differ")
                got = _attention(ctx_a, a, 5)
                if any(not torch.equal(x, y) for x, y in zip(got, want, strict=True)):
                    bad.append(f"{tag}: attention or its gradients differ")
    return bad


def _expect_every_rank(bad: list[str], tag: str, fn, *needles: str) -> None:
    try:
        fn()
    except (ValueError, TypeError) as e:
        missing = [n for n in needles if n not in str(e)]
        if missing:
            bad.append(f"{tag}: {str(e)!r} lacks {missing}")
    else:
        bad.append(f"{tag}: did not raise")


def _run_wrong_plans(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    g = dist.group.WORLD
    last = world - 1
    sharder = ContextParallelSharder(g, "balanced")
    batch, other = _batch(1), _batch(1, (10, 13, 1, 6))
    plan = sharder.plan(batch)
    # another batch's plan, on the last rank only: every rank raises, naming it
    given = sharder.plan(other) if rank == last else plan
    needles = ("another batch",) if rank == last else (f"rank {last}",)
    _expect_every_rank(bad, "another batch", lambda: sharder.shard(batch, plan=given), *needles)
    other_layout = ContextParallelSharder(g, "head_tail").plan(batch)
    _expect_every_rank(bad, "another layout", lambda: sharder.shard(batch, plan=other_layout), "layout")
    other_strategy = ContextParallelSharder(g, "balanced", strategy="heads").plan(batch)
    _expect_every_rank(bad, "another strategy", lambda: sharder.shard(batch, plan=other_strategy), "strategy")
    _expect_every_rank(bad, "not a plan", lambda: sharder.shard(batch, plan="plan"), "StepPlan")
    if world > 1:  # the plan of the next rank
        from cpshard.planning import plan_step

        stolen = plan_step((rank + 1) % world, plan.layout, plan.documents, plan.strategy)
        _expect_every_rank(bad, "another rank", lambda: sharder.shard(batch, plan=stolen), "rank")
    ok = sharder.shard(batch, plan=plan)[1]  # still in lockstep
    if ok["input_ids"].shape[1] * world != plan.layout.padded_seq_len:
        bad.append("shard after the errors")
    return bad


@pytest.mark.parametrize("world", WORLDS)
def test_a_step_planned_ahead_equals_one_planned_inline(pools, world):
    assert_no_mismatches(pools(world).run(_run_plan_ahead, timeout=300))


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_dataloader_worker_makes_the_plan(start: str):
    """A worker process (forked, or spawned: the planner crosses by pickle) plans each batch in
    its collate function; the training loop shards with it (one rank: the pool's ranks cannot
    start worker processes)."""
    sharder = ContextParallelSharder(None, "balanced")
    loader = torch.utils.data.DataLoader(
        [_batch(s) for s in range(3)], batch_size=1, num_workers=1,
        collate_fn=_PlanningCollate(sharder.planner()), multiprocessing_context=start,
    )  # fmt: skip
    for i, (batch, plan) in enumerate(loader):
        ctx_a, a = sharder.shard(batch, plan=plan)
        ctx_b, b = sharder.shard(batch)
        assert torch.equal(a["input_ids"], b["input_ids"])
        for x, y in zip(_attention(ctx_a, a, i), _attention(ctx_b, b, i), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("world", WORLDS)
def test_a_plan_for_something_else_raises_on_every_rank(pools, world):
    assert_no_mismatches(pools(world).run(_run_wrong_plans, timeout=120))


def test_the_plan_ahead_example_trains(tmp_path):
    """``examples/cp_plan_ahead.py`` under torchrun on 2 CPU ranks: every step prints a loss."""
    import os
    import subprocess
    import sys

    from tests.helpers import EXAMPLES

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(EXAMPLES / "cp_plan_ahead.py"), "--steps", "2", "--seq-len", "64"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line.split(":")[0] for line in run.stdout.splitlines()] == ["step 0", "step 1"]
