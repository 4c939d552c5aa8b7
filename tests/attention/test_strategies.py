"""CP attention under each exchange strategy against a single-process dense reference.

Every rank shards full q/k/v (float64) with the sharder of a layout (or the block-diagonal
batch), attends inside the step's context with the strategy under test and back-propagates its
share of a weighted sum; the gathered output and the summed gradients of the full q/k/v (and
of the sinks) must equal dense per-document attention (:func:`tests.helpers.variant_attention`).
``heads`` runs at W = 1-4; ``hierarchical`` (and ``auto`` with its choices) on a 2 x 2 mesh.
The cost model's bytes are checked against the bytes the transport really receives, and
``auto`` against the strategy that moves the fewest.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

from cpshard.layouts import LAYOUTS
from tests.helpers import (
    D,
    counting_collectives,
    cp_mesh,
    kernel_path,
    packed_doc_ids,
    variant_attention,
)

LAYOUTS_AND_BATCH = [*LAYOUTS, "blockdiag"]
# packing, B, S, query heads, KV heads: MHA, GQA, KV heads < W, heads not divisible by W
CASES = [
    ("random", 2, 37, 4, 2),
    ("short_docs", 1, 24, 3, 3),
    ("one_doc", 1, 23, 4, 1),
    ("interior_pad", 2, 30, 6, 3),
]
VARIANTS = [  # (window, softcap, sinks)
    (5, None, False),
    (None, 30.0, False),
    (None, None, True),
    (4, 20.0, True),
]


def _full(case: tuple, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Document ids, full q/k/v, the upstream weight and the sinks of a case."""
    name, b, s, heads, kv_heads = case
    g = torch.Generator().manual_seed(1000 * b + s + seed)
    q, k, v, w = (
        torch.randn(b, h, s, D, dtype=torch.float64, generator=g)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    sinks = torch.randn(heads, dtype=torch.float64, generator=g)
    return packed_doc_ids(name, b, s), q, k, v, w, sinks


def _group(world: int, mesh: bool):
    return cp_mesh(2, world // 2) if mesh else dist.group.WORLD


def _step(layout: str, doc: torch.Tensor, group, strategy: str):
    """``(context factory, sharder)`` of a step under ``strategy``."""
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    if layout == "blockdiag":
        ctx, _ = make_cp_blockdiag_batch_and_ctx(group, None, batch, strategy=strategy)
        sharder = ContextParallelSharder(group, "contiguous", strategy=strategy)
        sharder.shard(dict(batch))  # the test's own token verbs (they shard alike)
        return ctx, sharder
    sharder = ContextParallelSharder(group, layout, strategy=strategy)
    ctx, _ = sharder.shard(batch)
    return ctx, sharder


def _sharded(sharder, t: torch.Tensor) -> torch.Tensor:
    return sharder.shard_token_tensor(t.transpose(1, 2), seq_dim=1, fill=0.0).transpose(1, 2)


def _distributed(
    rank: int, world: int, strategy: str, mesh: bool, layouts: list[str], cases: list,
    variants: list, causal: bool, path: str = "per_segment",
) -> list[tuple]:  # fmt: skip
    """Per (layout, case, variant): the gathered output and this rank's gradients (through the
    kernel ``path``: :func:`tests.helpers.kernel_path`)."""
    with kernel_path(path):
        return _cases(world, strategy, mesh, layouts, cases, variants, causal)


def _cases(
    world: int, strategy: str, mesh: bool, layouts: list[str], cases: list, variants: list,
    causal: bool,
) -> list[tuple]:  # fmt: skip
    from cpshard import cp_attention
    from cpshard.attention import active_state

    group = _group(world, mesh)
    results = []
    for layout in layouts:
        for case in cases:
            for window, softcap, with_sinks in variants:
                doc, *full, w, sinks = _full(case)
                q, k, v = (t.requires_grad_() for t in full)
                sinks.requires_grad_()
                ctx, sharder = _step(layout, doc, group, strategy)
                with ctx():
                    assert active_state().strategy == strategy
                    out = cp_attention(
                        *(_sharded(sharder, t) for t in (q, k, v)),
                        is_causal=causal,
                        enable_gqa=case[3] != case[4],
                        window=window,
                        softcap=softcap,
                        sinks=sinks if with_sinks else None,
                    )
                (out * _sharded(sharder, w)).sum().backward()
                gathered = sharder.gather_token_tensor(out.detach().transpose(1, 2), 1, trim=True)
                grads = (q.grad, k.grad, v.grad, sinks.grad)
                results.append((gathered.transpose(1, 2), *grads))
    return results


def _check(
    got: list[list[tuple]], world: int, layouts: list[str], cases: list, variants: list,
    causal: bool, where: str,
) -> None:  # fmt: skip
    at = 0
    for layout in layouts:
        for case in cases:
            for window, softcap, with_sinks in variants:
                doc, q, k, v, w, sinks = _full(case)
                leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
                want = variant_attention(
                    q, k, v, doc, causal, window, softcap, sinks if with_sinks else None
                )
                grads = torch.autograd.grad((want * w).sum(), leaves, allow_unused=True)
                name = f"{where} W={world} {layout} {case} {(window, softcap, with_sinks)}"
                for r in range(world):
                    torch.testing.assert_close(
                        got[r][at][0], want, rtol=0, atol=1e-12, msg=f"{name} output, rank {r}"
                    )
                for j, label in enumerate(("q", "k", "v", "sinks")):
                    if grads[j] is None or (label == "sinks" and not with_sinks):
                        continue
                    # the sinks: each rank's copy gets its own heads' (heads) or tokens' share
                    total = sum(got[r][at][1 + j] for r in range(world))
                    torch.testing.assert_close(
                        total, grads[j], rtol=0, atol=1e-10, msg=f"{name} grad {label}"
                    )
                at += 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_heads_every_layout(pools, world: int, causal: bool) -> None:
    """``heads``: every layout and the block-diagonal batch, MHA and GQA (KV heads < W, heads
    not divisible by W), causal and bidirectional."""
    args = ("heads", False, LAYOUTS_AND_BATCH, CASES, [(None, None, False)], causal)
    got = pools(world).run(_distributed, *args, timeout=600)
    _check(got, world, *args[2:], where="heads")


@pytest.mark.parametrize("causal", [True, False])
def test_hierarchical_every_layout(pool4, causal: bool) -> None:
    """``hierarchical`` on a 2 x 2 mesh: every layout and the block-diagonal batch."""
    args = ("hierarchical", True, LAYOUTS_AND_BATCH, CASES, [(None, None, False)], causal)
    _check(pool4.run(_distributed, *args, timeout=600), 4, *args[2:], where="hierarchical")


@pytest.mark.parametrize("path", ["varlen", "math"])
def test_heads_kernel_paths(pool3, path: str) -> None:
    """The inner attention through the one-launch varlen path (its CPU stand-in) and the
    explicit part kernel, W = 3."""
    args = ("heads", False, ["head_tail", "stripe", "blockdiag"], CASES, [(None, None, False)],
            True, path)  # fmt: skip
    _check(pool3.run(_distributed, *args, timeout=600), 3, *args[2:-1], where=f"heads {path}")


@pytest.mark.parametrize(("strategy", "world"), [("heads", 3), ("hierarchical", 4)])
def test_variants(pools, strategy: str, world: int) -> None:
    """Sliding windows, soft-capping and sinks (and all three) under the head-parallel
    strategies: the inner attention windows its gathered tokens, each rank's sinks are its
    heads'."""
    args = (strategy, strategy == "hierarchical", ["head_tail", "stripe", "blockdiag"],
            CASES[::2], VARIANTS, True)  # fmt: skip
    _check(pools(world).run(_distributed, *args, timeout=600), world, *args[2:], where=strategy)


# ------------------------------------------------------------------ the cost model and auto

# (auto's pick, the fewest bytes, layout, packing, S, query heads, KV heads): ``hierarchical``
# moves the fewest bytes of the third step but holds its gathered heads (kept from the
# forward); the needed rows of the last move the fewest and the least bytes moved plus held,
# but hold more than ``heads`` (a long document's four K/V heads): memory first
WINNERS = [
    ("needed_rows", "needed_rows", "contiguous", "short_docs", 48, 8, 2),
    ("heads", "heads", "stripe", "one_doc", 48, 8, 8),
    ("needed_rows", "hierarchical", "stripe", "one_doc", 96, 8, 2),
    ("heads", "needed_rows", "contiguous", "one_doc", 48, 16, 4),
]


def _measured(rank: int, world: int, layout: str, packing: str, s: int, heads: int, kv: int):
    """Per strategy: the bytes this rank received over one forward and backward, the cost
    model's figures, auto's choice and the collectives one layer issues."""
    from cpshard import cp_attention
    from cpshard.attention import active_state
    from cpshard.attention.strategy import chosen_strategy, strategy_bytes, strategy_memory
    from cpshard.comm.torch_backend import TorchTransport

    received = Counter()
    original = TorchTransport.send_recv

    def counted(self, sends, recvs, key=None):
        received["bytes"] += sum(t.numel() * t.element_size() for _, t in recvs)
        return original(self, sends, recvs, key)

    group = _group(world, True)
    doc = packed_doc_ids(packing, 1, s)
    g = torch.Generator().manual_seed(3)
    full = [torch.randn(1, h, s, D, dtype=torch.float64, generator=g) for h in (heads, kv, kv)]
    out = {}
    for strategy in ("needed_rows", "heads", "hierarchical", "auto"):
        ctx, sharder = _step(layout, doc, group, strategy)
        q, k, v = (_sharded(sharder, t).requires_grad_() for t in full)
        received.clear()
        TorchTransport.send_recv = counted
        try:
            with ctx(), counting_collectives() as calls:
                y = cp_attention(q, k, v, enable_gqa=heads != kv)
                forward = sum(calls.values())
                y.sum().backward()
        finally:
            TorchTransport.send_recv = original
        with ctx():
            state = active_state()
            costs = strategy_bytes(state, None, heads, kv, D, D, 8)
            held = strategy_memory(state, None, heads, kv, D, D, 8)
            picked = chosen_strategy(state, None, heads, kv, D, D, 8)
        out[strategy] = (received["bytes"], costs, picked, forward, sum(calls.values()), held)
    return out


@pytest.mark.parametrize("winner", WINNERS, ids=[f"{w[0]}-{w[1]}" for w in WINNERS])
def test_auto_picks_within_heads_memory_the_least_bytes_moved_and_held(
    pool4, winner: tuple
) -> None:
    """For steps built so that each strategy wins: the bytes every strategy's fwd+bwd really
    receives (busiest rank) equal the cost model's, and ``auto`` picks, of the strategies whose
    modelled bytes held are at most ``heads``', the least of those plus the bytes held (alike
    on every rank)."""
    name, fewest, *step = winner
    got = pool4.run(_measured, *step, timeout=600)
    busiest = {s: max(r[s][0] for r in got) for s in ("needed_rows", "heads", "hierarchical")}
    costs, held = got[0]["auto"][1], got[0]["auto"][5]
    assert busiest == costs, (busiest, costs)
    assert all(r["auto"][5] == held for r in got)
    assert min(busiest, key=busiest.__getitem__) == fewest, busiest
    fits = [s for s in busiest if held[s] <= held["heads"]]
    assert min(fits, key=lambda s: busiest[s] + held[s]) == name, (busiest, held)
    assert all(r["auto"][2] == name for r in got)
    assert max(r["auto"][0] for r in got) == busiest[name]


def test_heads_moves_one_head_at_a_time(pool4) -> None:
    """``heads``: per K/V head of each rank, one transfer of it (K and V together) and, per
    query head it serves, one of that query head and one of its output in the forward; the
    backward gathers the same again (the query head with its output and their gradient in one
    transfer), sends each query head's gradient back, and the K/V head's gradients (together)
    after them."""
    got = pool4.run(_measured, "stripe", "one_doc", 48, 8, 2, timeout=600)
    for r in got:
        _, _, _, forward, total, _ = r["heads"]  # 8 / 2 heads over 4 ranks: one K/V head, 2 queries
        assert (forward, total) == (1 + 2 * 2, 2 * (1 + 2 * 2) + 1), (forward, total)


def _compiled(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager and the ``fullgraph`` compiled head-parallel layer's output and q gradient."""
    from cpshard import cp_attention

    doc = packed_doc_ids("random", 1, 40)
    ctx, sharder = _step("head_tail", doc, dist.group.WORLD, "heads")
    g = torch.Generator().manual_seed(9)
    full = [torch.randn(1, h, 40, D, dtype=torch.float64, generator=g) for h in (4, 2, 2)]

    def layer(q, k, v):
        return cp_attention(q, k, v, enable_gqa=True)

    outs = []
    for fn in (layer, torch.compile(layer, fullgraph=True, backend="aot_eager")):
        q, k, v = (_sharded(sharder, t).requires_grad_() for t in full)
        with ctx():
            y = fn(q, k, v)
        y.sum().backward()
        outs.append((y.detach(), q.grad))
    return outs


def test_compile_fullgraph_traces_the_head_parallel_layer(pool2) -> None:
    for eager, compiled in pool2.run(_compiled, timeout=600):
        torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-12)


def _host_reads(rank: int, world: int, strategy: str) -> list[str]:
    """Host reads of tensor data inside two head-parallel layers and their backward (after the
    step's setup); the step's CPU keys (its own and the inner states') are no tensor data."""
    from cpshard import cp_attention
    from cpshard.attention import active_state
    from tests.helpers import recording_host_reads

    doc = packed_doc_ids("random", 2, 37)
    ctx, sharder = _step("balanced", doc, _group(world, strategy == "hierarchical"), strategy)
    g = torch.Generator().manual_seed(4)
    full = [torch.randn(2, h, 37, D, dtype=torch.float64, generator=g) for h in (4, 2, 2)]
    qkv = [_sharded(sharder, t).requires_grad_() for t in full]
    with ctx():
        (plan,) = active_state().head_parallel
        keys = (active_state().key, plan.inner.key, plan.inner.bidirectional().key)
    reads: list[str] = []
    with recording_host_reads(reads, keys):
        for causal in (True, False):
            with ctx():
                out = cp_attention(*qkv, is_causal=causal, enable_gqa=True)
            out.sum().backward()
    return reads


@pytest.mark.parametrize("strategy", ["heads", "hierarchical"])
def test_hot_path_reads_no_tensor_data_on_host(pool4, strategy: str) -> None:
    """The all-to-alls and the inner attention, forward and backward, read no tensor data on
    the host and rebuild no metadata (the plans were made at shard time)."""
    assert pool4.run(_host_reads, strategy, timeout=120) == [[]] * 4


def test_bad_strategy_raises() -> None:
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    with pytest.raises(ValueError, match="strategy must be one of"):
        ContextParallelSharder(None, "head_tail", strategy="ulysses")
    with pytest.raises(ValueError, match="needs a 2-D CP DeviceMesh"):
        ContextParallelSharder(None, "head_tail", strategy="hierarchical")
    doc = packed_doc_ids("random", 1, 8)
    with pytest.raises(ValueError, match="rank 0: strategy must be one of"):
        make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": doc}, strategy="rings")


def _disagreeing(rank: int, world: int) -> str:
    from cpshard import ContextParallelSharder

    doc = packed_doc_ids("random", 1, 16)
    sharder = ContextParallelSharder(dist.group.WORLD, "stripe", strategy=("heads", "auto")[rank])
    try:
        sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    except ValueError as e:
        return str(e)
    return ""


def test_ranks_on_other_strategies_raise(pool2) -> None:
    """A step whose ranks were given different strategies raises on every rank (they would
    issue different collectives)."""
    for message in pool2.run(_disagreeing, timeout=120):
        assert "attention strategy" in message, message


def test_halo_most_rows_moved_equals_the_pairwise_count() -> None:
    """The halo's busiest rank (the cost model's figure, one sweep over the halos' bounds)
    equals counting every rank's shard rows in every other rank's halo, pair by pair."""
    import dataclasses
    import random

    from cpshard.attention.halo import HaloExchange

    rng = random.Random(5)
    names = {f.name for f in dataclasses.fields(HaloExchange)}
    for _ in range(300):
        world, length, rows = rng.randint(1, 12), rng.randint(0, 9), rng.randint(1, 3)
        halos = tuple(rng.randint(0, world * length + 3) for _ in range(world))
        spans = [(r * length - min(h, r * length), r * length) for r, h in enumerate(halos)]

        def sent(r: int) -> int:
            return sum(max(0, min((r + 1) * length, e) - max(r * length, b)) for b, e in spans)

        want = max(2 * (e - b) + sent(r) for r, (b, e) in enumerate(spans)) * rows
        exchange = object.__new__(HaloExchange)
        for name, value in (("halos", halos), ("local_len", length), ("batch_size", rows)):
            assert name in names
            object.__setattr__(exchange, name, value)
        assert exchange.most_rows_moved == want, (world, length, halos)
