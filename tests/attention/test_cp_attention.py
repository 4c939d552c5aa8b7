"""CP attention for every sharder layout against a single-process dense reference.

Every rank shards full q/k/v (``[B, H, S, D]``, float64) with the sharder of the layout under
test, attends inside the sharder's context with ``cpshard.cp_attention`` and back-propagates its
share of a weighted sum; the gathered outputs and the summed gradients of the full q/k/v must
equal dense per-document causal attention (:func:`tests.helpers.dense_attention`).
"""

from __future__ import annotations

import pytest
import torch

from cpshard.attention import active_state
from cpshard.layouts import LAYOUTS
from tests.helpers import (
    D,
    compare_compiled,
    dense_attention,
    kernel_path,
    packed_doc_ids,
    record_host_reads,
)


def _batch(name: str, b: int, s: int, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Document ids, full q/k/v and the upstream weight of a case."""
    doc = packed_doc_ids(name, b, s)
    g = torch.Generator().manual_seed(1000 * b + s)
    q, k, v, w = (
        torch.randn(b, h, s, D, dtype=torch.float64, generator=g)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    return doc, q, k, v, w


# packing, B, S, heads, kv heads (S not a multiple of W: trailing padding)
CASES = [
    ("short_docs", 1, 24, 2, 2),
    ("short_docs", 2, 26, 4, 2),
    ("one_doc", 2, 23, 2, 2),
    ("interior_pad", 2, 30, 2, 1),
    ("random", 1, 37, 4, 2),
    ("reused_ids", 2, 19, 2, 2),
]


def _sharded(sharder, t: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> this rank's ``[B, H, L, D]`` (the batch dim before the token dim, as
    per-row layouts need)."""
    return sharder.shard_token_tensor(t.transpose(1, 2), seq_dim=1, fill=0.0).transpose(1, 2)


def _distributed(
    rank: int, world: int, layouts: list[str], path: str, causal: bool = True
) -> list[tuple]:
    """Per (layout, case): the gathered output and this rank's gradients of the full q/k/v."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention

    results = []
    with kernel_path(path):
        for layout in layouts:
            for name, b, s, heads, kv_heads in CASES:
                doc, *full = _batch(name, b, s, heads, kv_heads)
                q, k, v = (t.requires_grad_() for t in full[:3])
                # the step's own exchange (the head-parallel strategies: test_strategies.py)
                sharder = ContextParallelSharder(dist.group.WORLD, layout, strategy="needed_rows")
                ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
                with ctx():
                    out = cp_attention(
                        *(_sharded(sharder, t) for t in (q, k, v)),
                        is_causal=causal,
                        enable_gqa=heads != kv_heads,
                    )
                    assert active_state().layout == layout
                assert active_state() is None
                (out * _sharded(sharder, full[3])).sum().backward()
                gathered = sharder.gather_token_tensor(out.detach().transpose(1, 2), 1, trim=True)
                results.append((gathered.transpose(1, 2), q.grad, k.grad, v.grad))
    return results


def _check(got: list[list[tuple]], layouts: list[str], world: int, causal: bool = True) -> None:
    at = 0
    for layout in layouts:
        for case in CASES:
            doc, q, k, v, w = _batch(*case)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            want = dense_attention(*leaves, doc, causal)
            grads = torch.autograd.grad((want * w).sum(), leaves)
            where = f"{layout} W={world} {case} causal={causal}"
            for r in range(world):
                torch.testing.assert_close(
                    got[r][at][0], want, rtol=0, atol=1e-12, msg=f"{where} output on rank {r}"
                )
            for j, name in enumerate("qkv"):
                total = sum(got[r][at][1 + j] for r in range(world))
                torch.testing.assert_close(
                    total, grads[j], rtol=0, atol=1e-10, msg=f"{where} grad {name}"
                )
            at += 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_matches_dense_reference(pools, world: int) -> None:
    layouts = list(LAYOUTS)
    got = pools(world).run(_distributed, layouts, "per_segment", timeout=600)
    _check(got, layouts, world)


@pytest.mark.parametrize("path", ["varlen", "math"])
def test_kernel_paths_match_dense_reference(pools, path: str) -> None:
    """The one-launch varlen path (its CPU stand-in) and the explicit part kernel, W = 3."""
    layouts = ["head_tail", "stripe", "balanced"]
    _check(pools(3).run(_distributed, layouts, path, timeout=600), layouts, 3)


def _in_tiles(rank: int, world: int, layouts: list[str], path: str) -> list[tuple]:
    """:func:`_distributed` with tiles of at most 3 queries (and keys): every long span of the
    loop in tiles, its keys before the causal square in pieces."""
    from cpshard.attention import engine

    saved = engine.TILES, engine.TILE_ROWS
    engine.TILES, engine.TILE_ROWS = 64, 3
    try:
        return _distributed(rank, world, layouts, path)
    finally:
        engine.TILES, engine.TILE_ROWS = saved


@pytest.mark.parametrize("path", ["per_segment", "math"])
@pytest.mark.parametrize("world", [2, 3])
def test_long_spans_in_tiles_match_dense_reference(pools, world: int, path: str) -> None:
    """The loop's tiles (what bounds a long document's memory) are exact, with the CPU flash
    kernels and the explicit part kernel."""
    layouts = ["contiguous", "head_tail", "balanced"]
    _check(pools(world).run(_in_tiles, layouts, path, timeout=600), layouts, world)


@pytest.mark.parametrize("path", ["per_segment", "varlen", "math"])
@pytest.mark.parametrize("world", [2, 3])
def test_bidirectional_within_documents(pools, world: int, path: str) -> None:
    """``is_causal=False``: every query sees its whole document, every layout and kernel path."""
    layouts = list(LAYOUTS)
    got = pools(world).run(_distributed, layouts, path, False, timeout=600)
    _check(got, layouts, world, causal=False)


def _refusals(rank: int, world: int, kind: str) -> None:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention

    doc, q, k, v, _ = _batch("short_docs", 1, 24, 2, 2)  # documents of 3 tokens
    sharder = ContextParallelSharder(dist.group.WORLD, "stripe")
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    q, k, v = (_sharded(sharder, t) for t in (q, k, v))
    with ctx():
        full = cp_attention(q, k, v)
        if kind == "window_covers":  # a window no document outgrows: exactly causal
            assert torch.equal(cp_attention(q, k, v, window=3), full)
        elif kind == "sinks":
            cp_attention(q, k, v, sinks=torch.zeros(3, dtype=torch.float64))
        elif kind == "bidirectional_window":
            cp_attention(q, k, v, is_causal=False, window=5)


REFUSALS = {
    "sinks": "sinks must be [query heads] = [2]",
    "bidirectional_window": "window needs is_causal=True",
}


def _blockdiag_bidirectional(rank: int, world: int) -> list[torch.Tensor]:
    """``is_causal=False`` under the block-diagonal context: this rank's output and the
    gradients of its q, k, v shards, and the same under the contiguous sharder's context."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention, make_cp_blockdiag_batch_and_ctx

    doc, q, k, v, _ = _batch("random", 2, 37, 4, 2)
    sharder = ContextParallelSharder(dist.group.WORLD, "contiguous")
    contiguous, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    blockdiag, _ = make_cp_blockdiag_batch_and_ctx(
        dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    local = [_sharded(sharder, t).detach().requires_grad_() for t in (q, k, v)]
    results = []
    for ctx in (blockdiag, contiguous):
        with ctx():
            out = cp_attention(*local, is_causal=False, enable_gqa=True)
        results += [out.detach(), *torch.autograd.grad((out * out).sum(), local)]
    return results


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_bidirectional_window_and_bad_sinks_raise_on_every_rank(pools, kind: str) -> None:
    """The refusals depend on the step alone, so every rank raises (default check mode)."""
    outcomes = pools(2).run_collect(_refusals, kind, timeout=60)
    assert all(not o.ok and o.error_type == "ValueError" for o in outcomes), outcomes
    expect = REFUSALS[kind]
    assert all(expect in o.error_message for o in outcomes), outcomes
    assert all(f"rank {o.rank}" in o.error_message for o in outcomes), outcomes


@pytest.mark.parametrize("world", [1, 2, 3])
def test_blockdiag_bidirectional_matches_the_contiguous_layout(pools, world: int) -> None:
    """The block-diagonal batch is the contiguous layout: ``is_causal=False`` under its context
    gives exactly the contiguous sharder's bidirectional attention (checked against the dense
    reference above), forward and backward."""
    for rank, got in enumerate(pools(world).run(_blockdiag_bidirectional, timeout=120)):
        half = len(got) // 2
        for j, (a, b) in enumerate(zip(got[:half], got[half:], strict=True)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=f"rank {rank} result {j}")


def test_window_that_covers_every_document_is_exact(pools) -> None:
    pools(2).run(_refusals, "window_covers", timeout=60)


def test_plain_sdpa_outside_a_context() -> None:
    """No active state: SDPA; a window becomes a causal band mask."""
    import torch.nn.functional as F

    from cpshard import cp_attention

    q, k, v = (torch.randn(2, 4, 9, D, dtype=torch.float64) for _ in range(3))
    kv = k[:, :2], v[:, :2]
    torch.testing.assert_close(
        cp_attention(q, *kv, enable_gqa=True),
        F.scaled_dot_product_attention(q, *kv, is_causal=True, enable_gqa=True),
    )
    i, j = torch.arange(9)[:, None], torch.arange(9)[None, :]
    band = (j <= i) & (i - j < 4)
    torch.testing.assert_close(
        cp_attention(q, k, v, window=4), F.scaled_dot_product_attention(q, k, v, attn_mask=band)
    )
    with pytest.raises(ValueError, match="window must be >= 1"):
        cp_attention(q, k, v, window=0)


def test_other_layouts_tokens_raise() -> None:
    """Tokens of another length than the state's shard, and a context of another layout entered
    inside an active one, raise naming the layouts."""
    from cpshard import ContextParallelSharder, cp_attention, make_cp_blockdiag_batch_and_ctx

    doc = packed_doc_ids("short_docs", 1, 24)
    ctx, _ = ContextParallelSharder(None, "stripe").shard({"input_ids": doc.clone()})
    q = torch.randn(1, 2, 23, D, dtype=torch.float64)
    expect = "rank 0: .*23/23/23 tokens .* 'stripe' layout has 24"
    with ctx(), pytest.raises(ValueError, match=expect):
        cp_attention(q, q, q)
    blockdiag, _ = make_cp_blockdiag_batch_and_ctx(None, None, {"input_ids": doc.clone()})
    with blockdiag(), pytest.raises(ValueError, match="'stripe' attention context .* 'contiguous'"):
        with ctx():
            pass
    assert active_state() is None


def _transfers(rank: int, world: int) -> dict[str, list[int]]:
    """Per check mode, for one cp_attention call forward + backward: the consensus rounds and
    the all-to-all-v exchanges it issued."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, check_mode, consensus, cp_attention
    from cpshard.attention import needed_rows as exchange

    counts = {"rounds": 0, "exchanges": 0}

    def counting(name: str, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    real = consensus.all_gather_small, exchange.all_to_all_v
    consensus.all_gather_small = counting("rounds", real[0])
    exchange.all_to_all_v = counting("exchanges", real[1])
    try:
        doc = packed_doc_ids("pad_rank", 1, 40)
        sharder = ContextParallelSharder(dist.group.WORLD, "balanced")
        ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
        got = {}
        for mode in ("step", "call"):
            counts.update(dict.fromkeys(counts, 0))
            q = torch.randn(1, 2, 40 // world, D, dtype=torch.float64, requires_grad=True)
            with check_mode(mode), ctx():
                out = cp_attention(q, q, q)
            out.sum().backward()
            got[mode] = [counts["rounds"], counts["exchanges"]]
    finally:
        consensus.all_gather_small, exchange.all_to_all_v = real
    return got


def test_default_mode_issues_only_the_exchange_and_its_reverse(pools) -> None:
    """By default a call issues its all-to-all-v in the forward, and in the backward the same
    one again (only this rank's K/V are saved) and the reverse one, nothing else, on every
    rank; checked mode adds one consensus round."""
    for got in pools(4).run(_transfers, timeout=60):
        assert got == {"step": [0, 3], "call": [1, 3]}, got


def _compiled_vs_eager(rank: int, world: int, layout: str, causal: bool) -> list[int]:
    """cp_attention (``is_causal=causal``: the step's causal state or its bidirectional twin)
    compiled once (fullgraph) over two batches with different documents: outputs and gradients
    equal eager; returns the compile counts."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    from cpshard import ContextParallelSharder, cp_attention

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_attention(q, k, v, is_causal=causal, enable_gqa=True) * 2

    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    plans = set()
    for name in ("short_docs", "random"):
        doc, *full = _batch(name, 2, 24, 4, 2)
        sharder = ContextParallelSharder(dist.group.WORLD, layout)
        ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
        q, k, v, w = (_sharded(sharder, t) for t in full)
        compare_compiled(compiled, attend, ctx, (q, k, v), w, name)
        with ctx():
            plans.add(active_state().exchange.plan)
    assert len(plans) == 2, plans  # the batches exchange different rows
    return [counter.frame_count, counter.op_count]


@pytest.mark.parametrize(
    ("layout", "causal"), [("head_tail", True), ("balanced", True), ("stripe", False)]
)
def test_compiled_does_not_recompile_per_batch(pools, layout: str, causal: bool) -> None:
    """The step's plan is data behind its key, not a guard: one compile for both batches (the
    bidirectional twin's too)."""
    counts = pools(2).run(_compiled_vs_eager, layout, causal, timeout=400)
    assert all(frames == 1 for frames, _ in counts), counts


def _opcheck_exchange(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder
    from cpshard.attention.needed_rows import kv_needed_rows as layout_exchange
    from cpshard.attention.needed_rows import kv_needed_rows_return as layout_exchange_return

    doc = packed_doc_ids("random", 2, 37)
    sharder = ContextParallelSharder(dist.group.WORLD, "head_tail")
    ctx, batch = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    with ctx():
        state = active_state()
    local = batch["input_ids"].shape[1]
    kv = torch.randn(2, 2, local, 2 * D, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(layout_exchange, (kv, state.key))
    grad = torch.randn(2, 2, state.exchange.key_len, 2 * D, dtype=torch.float64)
    torch.library.opcheck(layout_exchange_return, (grad, state.key, local))


def test_opcheck_exchange_ops(pools) -> None:
    """The layout exchange custom ops pass torch.library.opcheck on every rank."""
    pools(2).run(_opcheck_exchange, timeout=120)


def _all_to_all(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r sends ``(r + 1) * (q + 1)`` values ``100 r + q`` to rank q (q == r: kept)."""
    import torch.distributed as dist

    from cpshard.comm.collectives import all_to_all_v

    send = [(rank + 1) * (q + 1) for q in range(world)]
    recv = [(q + 1) * (rank + 1) for q in range(world)]
    x = torch.cat([torch.full((n,), 100.0 * rank + q) for q, n in enumerate(send)])
    x.requires_grad_()
    out = all_to_all_v(x, dist.group.WORLD.group_name, send, recv, 7)
    (out * torch.arange(out.numel())).sum().backward()
    return out.detach(), x.grad


def test_all_to_all_v_and_its_reverse(pools) -> None:
    """Uneven parts land in rank order; the backward sends each gradient part back."""
    world = 3
    got = pools(world).run(_all_to_all, timeout=60)
    for r, (out, grad) in enumerate(got):
        want = torch.cat([torch.full(((q + 1) * (r + 1),), 100.0 * q + r) for q in range(world)])
        assert torch.equal(out, want)
        parts = []
        for q in range(world):  # the part r sent to q: q's received block from r
            at = sum((p + 1) * (q + 1) for p in range(r))
            parts.append(torch.arange(at, at + (r + 1) * (q + 1), dtype=torch.float32))
        assert torch.equal(grad, torch.cat(parts))


def _host_reads(rank: int, world: int, path: str) -> list[str]:
    """Host reads of tensor data inside cp_attention and its backward (after the step's setup)
    under a per-row layout in a model's second step (the first one's calls tell the setup what
    to make), and whether the kernel was handed the packing built at setup."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention

    doc, q, k, v, _ = _batch("random", 2, 37, 4, 2)
    sharder = ContextParallelSharder(dist.group.WORLD, "balanced")
    reads = []
    for _ in range(2):  # two steps
        ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
        qkv = tuple(_sharded(sharder, t).detach().requires_grad_() for t in (q, k, v))
        reads = record_host_reads(ctx, cp_attention, qkv, path)
    return reads


@pytest.mark.parametrize("path", ["per_segment", "varlen"])
def test_hot_path_reads_no_tensor_data_on_host(pools, path: str) -> None:
    """The exchange and the attention, forward and backward, read no tensor data on the host
    and rebuild no metadata (the step's tables and packing were built at shard time)."""
    assert pools(2).run(_host_reads, path, timeout=120) == [[], []]


def _tables_made(rank: int, world: int, strategy: str) -> list[tuple[bool, bool]]:
    """Per step of two: whether the needed-rows exchange's tables existed after the step's
    setup, and after a layer's forward and backward."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention
    from cpshard.attention import state as states

    states.seen_views.discard("needed_rows")  # as in a fresh process
    doc, q, k, v, _ = _batch("random", 2, 37, 4, 2)
    sharder = ContextParallelSharder(dist.group.WORLD, "stripe", strategy=strategy)
    made = []
    for _ in range(2):
        ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
        with ctx():
            exchange = active_state().exchange
        setup = bool(exchange._host)
        qkv = tuple(_sharded(sharder, t).requires_grad_() for t in (q, k, v))
        with ctx():
            cp_attention(*qkv, enable_gqa=True).sum().backward()
        made.append((setup, bool(exchange._host)))
    return made


def test_needed_rows_tables_are_made_only_when_a_call_uses_them(pools) -> None:
    """The needed-rows exchange's row tables (as long as the rows a rank moves) are made by the
    first call that exchanges needed rows, then at later steps' setups; a step whose calls
    attend head-parallel never makes them."""
    used = [(False, True), (True, True)]  # made by the first call, then at the setup
    assert pools(2).run(_tables_made, "needed_rows", timeout=60) == [used] * 2
    never = [(False, False), (False, False)]
    assert pools(2).run(_tables_made, "heads", timeout=60) == [never] * 2


def _saved_rows(rank: int, world: int, layout: str) -> list[int]:
    """This rank's shard length, its key buffer's rows, and the largest token dim among the
    tensors one cp_attention call saves for backward."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention

    doc, q, k, v, _ = _batch("one_doc", 1, 48, 4, 2)
    sharder = ContextParallelSharder(dist.group.WORLD, layout, strategy="needed_rows")
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    qkv = tuple(_sharded(sharder, t).requires_grad_() for t in (q, k, v))
    saved: list[int] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape[2] if t.dim() == 4 else 0)
        return t

    with ctx(), torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        state = active_state()
        cp_attention(*qkv, enable_gqa=True).sum().backward()
    return [qkv[0].shape[2], state.exchange.key_len, max(saved)]


@pytest.mark.parametrize("layout", ["stripe", "contiguous"])
def test_backward_keeps_only_the_ranks_own_kv(pools, layout: str) -> None:
    """A layer saves its own K/V rows for backward, not the exchanged key buffer (up to W times
    larger: one document, W = 4); the backward exchanges again."""
    got = pools(4).run(_saved_rows, layout, timeout=60)
    assert max(rows for _, rows, _ in got) > 2 * got[0][0], got  # the buffer is large
    assert all(most == local for local, _, most in got), got


def _scaled(rank: int, world: int) -> torch.Tensor:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention

    doc, q, k, v, _ = _batch("random", 2, 37, 4, 2)
    sharder = ContextParallelSharder(dist.group.WORLD, "stripe")
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    with ctx():
        out = cp_attention(*(_sharded(sharder, t) for t in (q, k, v)), scale=0.3, enable_gqa=True)
    return sharder.gather_token_tensor(out.transpose(1, 2), 1, trim=True).transpose(1, 2)


def test_scale(pools) -> None:
    """``scale`` replaces 1/sqrt(D): the same as queries scaled by ``scale * sqrt(D)``."""
    doc, q, k, v, _ = _batch("random", 2, 37, 4, 2)
    want = dense_attention(q * 0.3 * D**0.5, k, v, doc)
    for got in pools(2).run(_scaled, timeout=60):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
