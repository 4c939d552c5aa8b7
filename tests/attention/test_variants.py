"""CP attention's variants — sliding windows of any size, logit soft-capping, attention sinks,
a value head size unlike the query/key one — against the dense single-process reference
(:func:`tests.helpers.variant_attention`), every sharder layout and the block-diagonal batch,
W = 1..4, every kernel path, forward and float64 backward (the sinks' gradient included).
Outside a CP context, soft-capping and sinks (with windows, masks, GQA, no causality) against
:func:`tests.helpers.masked_attention`, attention stated head by head."""

from __future__ import annotations

import pytest
import torch

from cpshard.layouts import LAYOUTS
from tests.helpers import assert_variant_results, kernel_path, packed_doc_ids, step_context

D = 8

# (name, packing, B, S, heads, kv heads, d_v, window, softcap, sinks)
CASES = [
    ("window 1", "one_doc", 1, 23, 2, 2, D, 1, None, False),
    ("window 3", "interior_pad", 2, 30, 2, 1, D, 3, None, False),
    ("window 5 GQA", "random", 1, 37, 4, 2, D, 5, None, False),
    ("window 9 short docs", "short_docs", 2, 26, 4, 2, D, 9, None, False),  # covers every doc
    ("window 40 long runs", "one_doc", 1, 160, 2, 1, D, 40, None, False),  # tiles of a long run
    ("softcap", "random", 2, 29, 4, 2, D, None, 0.7, False),
    ("sinks", "interior_pad", 2, 30, 4, 2, D, None, None, True),
    ("sinks window softcap", "reused_ids", 2, 19, 2, 2, D, 2, 1.5, True),
    ("sinks window", "random", 2, 29, 4, 2, D, 4, None, True),
    ("value dim 12", "random", 1, 37, 4, 2, 12, None, None, False),
    ("value dim 4 window", "interior_pad", 2, 30, 2, 2, 4, 6, None, False),
]


def _case(case: tuple) -> tuple[torch.Tensor, ...]:
    _, packing, b, s, heads, kv_heads, d_v, *_ = case
    doc = packed_doc_ids(packing, b, s)
    g = torch.Generator().manual_seed(31 * b + s + d_v)
    q = torch.randn(b, heads, s, D, dtype=torch.float64, generator=g)
    k = torch.randn(b, kv_heads, s, D, dtype=torch.float64, generator=g)
    v = torch.randn(b, kv_heads, s, d_v, dtype=torch.float64, generator=g)
    w = torch.randn(b, heads, s, d_v, dtype=torch.float64, generator=g)
    sinks = torch.randn(heads, dtype=torch.float64, generator=g)
    return doc, q, k, v, w, sinks


def _sharded(sharder, t: torch.Tensor) -> torch.Tensor:
    return sharder.shard_token_tensor(t.transpose(1, 2), seq_dim=1, fill=0.0).transpose(1, 2)


def _distributed(rank: int, world: int, layouts: list[str], path: str) -> list[tuple]:
    """Per (layout, case): the gathered output and this rank's gradients of q, k, v, sinks."""
    from cpshard import cp_attention

    results = []
    with kernel_path(path):
        for layout in layouts:
            for case in CASES:
                *_, window, softcap, with_sinks = case
                doc, *full, sinks = _case(case)
                q, k, v = (t.requires_grad_() for t in full[:3])
                sinks.requires_grad_()
                ctx, sharder = step_context(layout, doc)
                with ctx():
                    out = cp_attention(
                        *(_sharded(sharder, t) for t in (q, k, v)),
                        enable_gqa=q.shape[1] != k.shape[1],
                        window=window,
                        softcap=softcap,
                        sinks=sinks if with_sinks else None,
                    )
                (out * _sharded(sharder, full[3])).sum().backward()
                gathered = sharder.gather_token_tensor(out.detach().transpose(1, 2), 1, trim=True)
                grads = (q.grad, k.grad, v.grad, sinks.grad if with_sinks else None)
                results.append((gathered.transpose(1, 2), *grads))
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_and_the_blockdiag_batch(pools, world: int) -> None:
    layouts = [*LAYOUTS, "blockdiag"]
    got = pools(world).run(_distributed, layouts, "per_segment", timeout=600)
    assert_variant_results(got, layouts, world, CASES, _case)


@pytest.mark.parametrize("path", ["varlen", "math"])
def test_kernel_paths(pools, path: str) -> None:
    """The one-launch varlen path (its CPU stand-in honouring the window) and the explicit
    part kernel (CUDA fp32/fp64), W = 3."""
    layouts = ["contiguous", "stripe", "balanced", "blockdiag"]
    got = pools(3).run(_distributed, layouts, path, timeout=600)
    assert_variant_results(got, layouts, 3, CASES, _case, path)


# --------------------------------------------------------------------------- per-step plans


class _Layers(torch.nn.Module):
    """Two attention layers over the same q/k/v: a sliding window of 3 keys, then global."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from cpshard import cp_attention

        windowed = cp_attention(q, k, v, enable_gqa=True, window=3)
        return cp_attention(windowed, k, v, enable_gqa=True) * 2


def _compiled_vs_eager(rank: int, world: int, layout: str) -> list[int]:
    """The windowed + global model compiled once (fullgraph) over two batches with different
    documents: outputs and gradients equal eager; returns the compile counts."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx
    from cpshard.attention import active_state
    from tests.helpers import compare_compiled

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    model = _Layers()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    plans = set()
    for packing in ("one_doc", "random"):
        doc = packed_doc_ids(packing, 2, 24)
        batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
        sharder = ContextParallelSharder(dist.group.WORLD, "contiguous" if layout == "blockdiag" else layout)
        ctx, _ = sharder.shard(dict(batch))
        if layout == "blockdiag":
            ctx, _ = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
        g = torch.Generator().manual_seed(len(packing))
        q, k, v, w = (
            _sharded(sharder, torch.randn(2, h, 24, D, dtype=torch.float64, generator=g))
            for h in (4, 2, 2, 4)
        )
        compare_compiled(compiled, model, ctx, (q, k, v), w, packing)
        with ctx():
            plans.add(active_state().windowed(3).spans)
    assert world == 1 or len(plans) == 2, plans  # the batches' windowed spans differ
    return [counter.frame_count, counter.op_count]


@pytest.mark.parametrize("layout", ["contiguous", "balanced", "blockdiag"])
def test_windowed_and_global_layers_compile_once(pools, layout: str) -> None:
    counts = pools(2).run(_compiled_vs_eager, layout, timeout=400)
    assert all(frames == 1 for frames, _ in counts), counts


def _host_reads(rank: int, world: int, path: str) -> list[str]:
    """Host reads inside the windowed + global layers (forward and backward) in a step after a
    first one: the windows' plans were made at the step's setup."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder
    from cpshard.attention import active_state
    from tests.helpers import recording_host_reads

    model = _Layers()
    reads: list[str] = []
    for step, packing in enumerate(("random", "interior_pad")):
        doc = packed_doc_ids(packing, 2, 37)
        sharder = ContextParallelSharder(dist.group.WORLD, "balanced")
        ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
        g = torch.Generator().manual_seed(5)
        qkv = tuple(
            _sharded(sharder, torch.randn(2, h, 37, D, dtype=torch.float64, generator=g))
            .requires_grad_()
            for h in (4, 2, 2)
        )
        with ctx():
            state = active_state()
        keys = (state.key, state.windowed(3).key) if step else ()
        with kernel_path(path) as kernel, recording_host_reads(reads if step else [], keys):
            with ctx():
                out = model(*qkv)
            out.sum().backward()
        if kernel is not None and step:  # handed the packings the step's setup built
            built = (*state.packing.packings, *state.windowed(3).packing.packings)
            assert {id(p) for p in kernel.packings} == {id(p) for p in built}
    return reads


@pytest.mark.parametrize("path", ["per_segment", "varlen"])
def test_windowed_layers_read_no_tensor_data_on_host(pools, path: str) -> None:
    assert pools(2).run(_host_reads, path, timeout=120) == [[], []]


def test_varlen_kernel_window_arguments() -> None:
    """The varlen kernels get the window as their left window, and a packing of single-query
    spans a left window covering every key (never FlashAttention-2's head-group swap)."""
    from cpshard.attention.kernels import TorchFlashVarlen
    from cpshard.attention.packing import Packing

    def packing(max_q: int, window: int | None) -> Packing:
        e = torch.zeros(0, dtype=torch.int64)
        return Packing(e, e, e.int(), e.int(), max_q, 9, False, True, window)

    args = TorchFlashVarlen._window
    assert args(packing(4, None)) == {"window_size_left": None, "window_size_right": None}
    assert args(packing(4, 3)) == {"window_size_left": 2, "window_size_right": 0}
    assert args(packing(1, None)) == {"window_size_left": 9, "window_size_right": 0}
    assert args(packing(1, 5)) == {"window_size_left": 4, "window_size_right": 0}


# (name, is_causal, window, softcap, sinks, attn_mask: None / "bool" / "float", scale, d_v)
OUTSIDE_CASES = [
    ("softcap", True, None, 0.7, False, None, None, D),
    ("sinks", True, None, None, True, None, None, D),
    ("softcap sinks scale d_v 6", True, None, 1.5, True, None, 0.3, 6),
    ("sinks window 3", True, 3, None, True, None, None, D),
    ("softcap window 4", True, 4, 0.9, False, None, None, D),
    ("softcap sinks bidirectional", False, None, 0.8, True, None, None, D),
    ("softcap sinks causal bool mask", True, None, 1.1, True, "bool", None, D),
    ("softcap float mask bidirectional", False, None, 0.6, False, "float", None, D),
]


@pytest.mark.parametrize("case", OUTSIDE_CASES, ids=[c[0] for c in OUTSIDE_CASES])
def test_outside_a_context_softcap_and_sinks_match_the_statement(case: tuple) -> None:
    """No active CP context: ``cp_attention`` with soft-capping and sinks (SDPA has neither) is
    plain PyTorch attention; float64 forward and backward (sinks' gradient included) against
    :func:`tests.helpers.masked_attention`, head by head over the same visibility."""
    from cpshard import cp_attention
    from tests.helpers import masked_attention

    _, causal, window, softcap, with_sinks, mask_kind, scale, d_v = case
    b, heads, kv_heads, s = 2, 4, 2, 11
    g = torch.Generator().manual_seed(s + d_v + len(case[0]))
    q = torch.randn(b, heads, s, D, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(b, kv_heads, s, D, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(b, kv_heads, s, d_v, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(b, heads, s, d_v, dtype=torch.float64, generator=g)
    sinks = torch.randn(heads, dtype=torch.float64, generator=g).requires_grad_()
    sinks = sinks if with_sinks else None
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = torch.ones(b, s, s, dtype=torch.bool)
    if causal:
        visible &= j <= i
    if window is not None:
        visible &= i - j < window
    attn_mask = None
    if mask_kind is not None:  # keys 3, 4 of row 0 and the last three of row 1 hidden
        keys = torch.ones(b, s, dtype=torch.bool)
        keys[0, 3:5] = False
        keys[1, -3:] = False
        visible &= keys[:, None, :]
        hidden = ~keys[:, None, None, :].expand(b, 1, s, s)
        additive = torch.zeros(b, 1, s, s, dtype=torch.float64).masked_fill(hidden, float("-inf"))
        attn_mask = ~hidden if mask_kind == "bool" else additive
    leaves = [q, k, v] + ([sinks] if sinks is not None else [])
    got = cp_attention(
        q, k, v, attn_mask, is_causal=causal, scale=scale, enable_gqa=True, window=window,
        softcap=softcap, sinks=sinks,
    )  # fmt: skip
    want = masked_attention(q, k, v, visible, scale or D**-0.5, softcap, sinks)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    for name, a, e in zip(
        "qkvs"[: len(leaves)], torch.autograd.grad((got * w).sum(), leaves),
        torch.autograd.grad((want * w).sum(), leaves), strict=True,
    ):  # fmt: skip
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12, msg=f"{case[0]}: d{name}")
