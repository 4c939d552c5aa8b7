"""The flash packages' kernels CP attention calls on GPUs — FlashAttention-3
(:mod:`cpshard.attention.fa3`, varlen and per-span parts, soft-cap in the kernel) and the
flash-attn package's soft-capped FA2 varlen kernel (:mod:`cpshard.attention.flash_attn2`) —
entered on CPU through plain-PyTorch stand-ins of their ops (:mod:`tests.flash_standin`) with
only the device predicates patched: the real selection picks the kernel classes, which call the
stand-ins with the packages' argument lists.

The stand-ins are first checked against autograd on an independent dense reference (forward,
backward from the output and log-sum-exp given, and the per-span loop's merged-parts contract),
then cpshard's CP attention runs through them at W = 1..4 against the dense single-process
reference, forward and float64 backward: GQA, windows, soft-capping, sinks, documents, every
layout kind (the varlen path, the loop's parts and its masked blocks), and which kernel ran is
asserted (:func:`cpshard.attention_kernel`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests import flash_standin
from tests.helpers import assert_variant_results, packed_doc_ids, step_context

D = 8


@contextmanager
def flash_on_cpu(package: str) -> Iterator[None]:
    """The selection's device predicates report a GPU the package runs on (``"fa3"``: sm 9.x
    with FlashAttention-3; ``"flash_attn"``: sm80+ with the flash-attn package), and the
    package's ops are the stand-ins'."""
    from cpshard.attention import fa3, flash_attn2

    saved = fa3.runs_fa3, fa3.fa3_ops, flash_attn2.runs_flash_attn, flash_attn2.flash_attn_ops
    try:
        if package == "fa3":
            fa3.runs_fa3 = lambda q: True
            fa3.fa3_ops = lambda: flash_standin.fa3_ops
        else:
            flash_attn2.runs_flash_attn = lambda q: True
            flash_attn2.flash_attn_ops = lambda: flash_standin.fa2_ops
        yield
    finally:
        fa3.runs_fa3, fa3.fa3_ops, flash_attn2.runs_flash_attn, flash_attn2.flash_attn_ops = saved


# --------------------------------------------------------------------- the stand-ins themselves


def _reference(q, k, v, lengths, causal, left, softcap, scale):
    """Packed ``[tokens, H, D]`` attention by autograd-able dense masking, sequence by sequence
    (bottom-right causal, a left window), GQA by repeating heads: output and log-sum-exp."""
    rep = q.shape[1] // k.shape[1]
    outs, lses = [], []
    at_q = at_k = 0
    for n, m in lengths:
        qs = q[at_q : at_q + n].transpose(0, 1)
        ks, vs = (t[at_k : at_k + m].transpose(0, 1).repeat_interleave(rep, 0) for t in (k, v))
        logits = qs @ ks.transpose(-1, -2) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        i, j = torch.arange(n)[:, None] + m - n, torch.arange(m)[None, :]
        visible = (j <= i) if causal else torch.ones(n, m, dtype=torch.bool)
        if left >= 0:
            visible = visible & (j >= i - left)
        logits = logits.masked_fill(~visible, float("-inf"))
        outs.append((torch.softmax(logits, -1) @ vs).transpose(0, 1))
        lses.append(torch.logsumexp(logits, -1))
        at_q, at_k = at_q + n, at_k + m
    return torch.cat(outs), torch.cat(lses, 1)


def _cumulative(lengths: list[int]) -> torch.Tensor:
    """int32 ``[0, l0, l0 + l1, ...]``: the kernels' ``cu_seqlens``."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


# (query, key) lengths per sequence, causal, left window, softcap, heads, kv heads
STANDIN_CASES = [
    ([(5, 5), (3, 9), (1, 4)], True, -1, 0.0, 4, 2),
    ([(7, 7), (2, 6)], True, 2, 0.0, 2, 2),
    ([(4, 6), (6, 6)], False, -1, 1.3, 4, 1),
    ([(8, 8), (3, 5)], True, 3, 0.9, 4, 2),
]


@pytest.mark.parametrize("case", STANDIN_CASES)
def test_the_fa3_standin_equals_autograd_on_dense_masking(case: tuple) -> None:
    lengths, causal, left, softcap, heads, kv_heads = case
    g = torch.Generator().manual_seed(len(lengths) + heads)
    tq, tk = sum(n for n, _ in lengths), sum(m for _, m in lengths)
    q = torch.randn(tq, heads, D, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (
        torch.randn(tk, kv_heads, D, dtype=torch.float64, generator=g).requires_grad_()
        for _ in "kv"
    )
    dout = torch.randn(tq, heads, D, dtype=torch.float64, generator=g)
    q_lens, k_lens = ([x[i] for x in lengths] for i in (0, 1))
    args = {
        "cu_seqlens_q": _cumulative(q_lens),
        "cu_seqlens_k": _cumulative(k_lens),
        "max_seqlen_q": max(q_lens),
        "max_seqlen_k": max(k_lens),
        "softmax_scale": 0.4,
        "is_causal": causal,
        "window_size_left": left,
        "window_size_right": -1,
        "softcap": softcap,
    }
    out, lse, *_ = flash_standin.fa3_ops.fwd(q.detach(), k.detach(), v.detach(), **args)
    want_out, want_lse = _reference(q, k, v, lengths, causal, left, softcap, 0.4)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    want = torch.autograd.grad((want_out * dout).sum(), (q, k, v))
    got = [torch.empty_like(t) for t in (q, k, v)]
    flash_standin.fa3_ops.bwd(dout, q.detach(), k.detach(), v.detach(), out, lse, *got, **args)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


@pytest.mark.parametrize("softcap", [None, 1.1])
def test_fa3_parts_backward_from_the_merged_output_is_each_parts_share(softcap) -> None:
    """The loop's contract: a query's keys in two parts (a prefix seen whole, a causal square),
    each through :class:`Fa3Part`, merged by log-sum-exp; each part's backward given the MERGED
    output and log-sum-exp, summed, is the gradient of attention over all the keys."""
    from cpshard.attention.fa3 import Fa3Part

    g = torch.Generator().manual_seed(3)
    n, prefix = 6, 5
    q = torch.randn(1, 4, n, D, dtype=torch.float64, generator=g).requires_grad_()
    k, v = (
        torch.randn(1, 2, prefix + n, D, dtype=torch.float64, generator=g).requires_grad_()
        for _ in "kv"
    )
    dout = torch.randn(1, 4, n, D, dtype=torch.float64, generator=g)
    kern, parts = (
        Fa3Part(flash_standin.fa3_ops, softcap),
        [(slice(0, prefix), False), (slice(prefix, None), True)],
    )
    results = [
        kern.forward(q.detach(), k[:, :, at].detach(), v[:, :, at].detach(), how, 0.35)
        for at, how in parts
    ]
    lse = torch.logsumexp(torch.stack([r[1] for r in results]), 0)
    out = sum(o * torch.exp(part_lse - lse)[..., None] for o, part_lse in results)
    flat = lambda t: t[0].transpose(0, 1)  # noqa: E731  [1, H, n, D] -> [n, H, D]
    want_out, want_lse = _reference(
        flat(q), flat(k), flat(v), [(n, prefix + n)], True, -1, softcap, 0.35
    )
    torch.testing.assert_close(flat(out), want_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[0], want_lse, rtol=0, atol=1e-12)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for at, how in parts:
        dqs, dks, dvs = kern.backward(
            dout, q.detach(), k[:, :, at].detach(), v[:, :, at].detach(), out, lse, how, 0.35
        )
        dq += dqs
        dk[:, :, at] += dks
        dv[:, :, at] += dvs
    want = torch.autograd.grad((want_out * flat(dout)).sum(), (q, k, v))
    for a, b in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_a_wrong_standin_is_caught() -> None:
    """The reference above tells a stand-in whose causal mask is top-left aligned from the real
    one: the check can fail."""
    lengths = [(3, 9)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(9 if t != "q" else 3, 2, D, dtype=torch.float64, generator=g) for t in "qkv"
    )
    top_left, _ = _reference(q, k, v, [(3, 3)], True, -1, 0.0, 0.5)  # keys 0..2 only
    out, *_ = flash_standin.fa3_ops.fwd(
        q, k, v, cu_seqlens_q=_cumulative([3]), cu_seqlens_k=_cumulative([9]),
        max_seqlen_q=3, max_seqlen_k=9, softmax_scale=0.5, is_causal=True,
    )  # fmt: skip
    assert not torch.allclose(out, top_left)
    torch.testing.assert_close(
        out, _reference(q, k, v, lengths, True, -1, 0.0, 0.5)[0], rtol=0, atol=1e-12
    )


# ------------------------------------------------------------------- CP attention through them

# (name, packing, B, S, heads, kv heads, window, softcap, sinks)
CASES = [
    ("plain GQA", "random", 2, 29, 4, 2, None, None, False),
    ("softcap GQA", "interior_pad", 2, 30, 4, 2, None, 0.8, False),
    ("window softcap", "random", 1, 37, 4, 2, 5, 1.3, False),
    ("window 9 short docs", "short_docs", 2, 26, 4, 2, 9, None, False),
    ("sinks softcap window", "reused_ids", 2, 19, 2, 2, 2, 1.5, True),
    ("one document softcap", "one_doc", 1, 23, 4, 2, None, 0.7, False),
]


def _case(case: tuple) -> tuple[torch.Tensor, ...]:
    _, packing, b, s, heads, kv_heads, *_ = case
    doc = packed_doc_ids(packing, b, s)
    g = torch.Generator().manual_seed(7 * b + s)
    q = torch.randn(b, heads, s, D, dtype=torch.float64, generator=g)
    k, v = (torch.randn(b, kv_heads, s, D, dtype=torch.float64, generator=g) for _ in "kv")
    w = torch.randn(b, heads, s, D, dtype=torch.float64, generator=g)
    return doc, q, k, v, w, torch.randn(heads, dtype=torch.float64, generator=g)


def _sharded(sharder, t: torch.Tensor) -> torch.Tensor:
    return sharder.shard_token_tensor(t.transpose(1, 2), seq_dim=1, fill=0.0).transpose(1, 2)


def _distributed(
    rank: int, world: int, layouts: list[str], package: str, loop: bool = False
) -> list[tuple]:
    """Per (layout, case): the gathered output, this rank's gradients of q, k, v, sinks, the
    kernels the forward and the backward ran, and the stand-in's calls. ``loop``: no step gets
    a varlen packing (the per-span loop's parts, prefix and causal square, and its blocks)."""
    import cpshard
    from cpshard.attention import packing

    results = []
    keys_per_row = packing.PACKED_KEYS_PER_ROW
    packing.PACKED_KEYS_PER_ROW = 0 if loop else keys_per_row
    with flash_on_cpu(package):
        for layout in layouts:
            for case in CASES:
                *_, window, softcap, with_sinks = case
                doc, *full, sinks = _case(case)
                q, k, v = (t.requires_grad_() for t in full[:3])
                sinks.requires_grad_()
                ctx, sharder = step_context(layout, doc)
                before = dict(flash_standin.calls)
                with ctx():
                    out = cpshard.cp_attention(
                        *(_sharded(sharder, t) for t in (q, k, v)), enable_gqa=True,
                        window=window, softcap=softcap, sinks=sinks if with_sinks else None,
                    )  # fmt: skip
                ran = [cpshard.attention_kernel()]
                (out * _sharded(sharder, full[3])).sum().backward()
                ran.append(cpshard.attention_kernel())
                calls = {d: flash_standin.calls[d] - before[d] for d in before}
                gathered = sharder.gather_token_tensor(out.detach().transpose(1, 2), 1, trim=True)
                grads = (q.grad, k.grad, v.grad, sinks.grad if with_sinks else None)
                results.append((gathered.transpose(1, 2), *grads, ran, calls))
    packing.PACKED_KEYS_PER_ROW = keys_per_row
    return results


def _check(got: list[list[tuple]], layouts: list[str], world: int, expect) -> None:
    """The results against the plain reference, and on every rank ``expect(layout, softcap,
    ran, calls)`` of the kernels it ran and the stand-in's calls."""

    def ran_as_expected(where: str, layout: str, case: tuple, result: tuple) -> None:
        ran, calls = result[5], result[6]
        assert expect(layout, case[-2], ran, calls), (where, ran, calls)

    assert_variant_results(got, layouts, world, CASES, _case, on_rank=ran_as_expected)


def _fa3_ran(layout: str, softcap, ran: list, calls: dict) -> bool:
    """FA3 served every call, forward and backward (its varlen kernel, or its part kernel in the
    loop a layout of many short runs takes), the same kernel both ways."""
    return all("fa3" in name for name in ran) and len(set(ran)) == 1


@pytest.mark.parametrize("loop", [False, True], ids=["varlen", "loop"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_cp_attention_through_fa3(pools, world: int, loop: bool) -> None:
    layouts = ["contiguous", "balanced", "stripe", "blockdiag"]
    got = pools(world).run(_distributed, layouts, "fa3", loop, timeout=600)
    _check(got, layouts, world, _fa3_ran)
    ran = {name for rank in got for result in rank for name in result[5]}
    assert ran == {"fa3_part"} if loop else "fa3_varlen" in ran, ran
    calls = [sum(result[6]["fwd"] for result in rank) for rank in got]
    assert all(c > 0 for c in calls), calls  # the stand-in computed, not a fallback


def _in_tiles(rank: int, world: int, layouts: list[str]) -> list[tuple]:
    """:func:`_distributed` through FA3's part kernel in the loop, every long span in tiles of
    at most 3 queries (and keys)."""
    from cpshard.attention import engine

    saved = engine.TILES, engine.TILE_ROWS
    engine.TILES, engine.TILE_ROWS = 64, 3
    try:
        return _distributed(rank, world, layouts, "fa3", True)
    finally:
        engine.TILES, engine.TILE_ROWS = saved


def test_cp_attention_through_fa3_parts_in_tiles(pools) -> None:
    """The loop's tiles hand FA3's part kernel views of the queries and output and a tile's
    output gradient: exact, W = 3."""
    layouts = ["contiguous", "balanced"]
    got = pools(3).run(_in_tiles, layouts, timeout=600)
    _check(got, layouts, 3, _fa3_ran)
    assert {name for rank in got for result in rank for name in result[5]} == {"fa3_part"}


def _flash_attn_ran(layout: str, softcap, ran: list, calls: dict) -> bool:
    """Soft-capped logits on the varlen path ran the flash-attn package's kernel (the loop,
    which no package kernel serves, the explicit one); plain logits kept torch's CPU flash."""
    if softcap is None:
        return all("flash_attn" not in name for name in ran)
    on_varlen = [name.startswith("flash_attn_varlen") for name in ran]
    return all(v or name == "math_part" for v, name in zip(on_varlen, ran, strict=True)) and (
        layout == "stripe" or all(on_varlen)
    )


@pytest.mark.parametrize("world", [1, 3])
def test_soft_capped_cp_attention_through_the_flash_attn_package(pools, world: int) -> None:
    layouts = ["contiguous", "balanced", "stripe"]
    got = pools(world).run(_distributed, layouts, "flash_attn", timeout=600)
    _check(got, layouts, world, _flash_attn_ran)
    calls = [sum(result[6]["fwd"] for result in rank) for rank in got]
    assert all(c > 0 for c in calls), calls


def test_fa3_is_left_alone_where_it_cannot_serve() -> None:
    """No global switch: on a CPU without the predicates patched, and for head dims FA3 does
    not take, the selection never picks it."""
    from cpshard.attention import choice

    q = torch.randn(1, 2, 4, D)
    assert choice.varlen_kernel(q, D, D) is None
    assert type(choice.part_kernel(q)).__name__ == "CpuFlash"
    with flash_on_cpu("fa3"):
        assert choice.varlen_kernel(q, D, D).name == "fa3_varlen"
        assert choice.capped_varlen_kernel(q, D, 2.0).softcap == 2.0
        assert choice.part_kernel(q, 2.0).name == "fa3_part"
        assert choice.varlen_kernel(q, 12, 12) is None  # not a multiple of 8
        assert choice.varlen_kernel(q, 264, 264) is None  # over 256
        assert choice.varlen_kernel(q, D, 16) is None  # unequal head dims


def test_only_builds_taking_the_arguments_passed_are_chosen() -> None:
    """A package's ops are used only where their schemas name every argument cpshard passes:
    the stand-ins (the packages' own argument lists) pass, a build without soft-cap does not."""
    from cpshard.attention import fa3, flash_attn2

    assert fa3.compatible(flash_standin.fa3_ops)
    assert flash_attn2.compatible(flash_standin.fa2_ops)
    assert not fa3.compatible(flash_standin.fa2_ops)
    assert not flash_attn2.compatible(flash_standin.fa3_ops)
    assert not fa3.compatible(torch.ops.cpshard_no_such_namespace)
    older = torch.library.Library("cpshard_standin_fa3_nosoftcap", "DEF")
    for schema in (flash_standin.FA3_FWD, flash_standin.FA3_BWD):
        older.define(schema.replace(" float softcap = 0.0,", ""))
    assert not fa3.compatible(torch.ops.cpshard_standin_fa3_nosoftcap)


def _host_reads(rank: int, world: int, loop: bool) -> list[str]:
    """The host reads of two soft-capped layers and their backward through FA3 in a step after a
    first one (the kernel's choice reads no tensor data)."""
    import cpshard
    from cpshard.attention import active_state, packing
    from tests.helpers import recording_host_reads

    keys_per_row = packing.PACKED_KEYS_PER_ROW
    packing.PACKED_KEYS_PER_ROW = 0 if loop else keys_per_row
    doc, *full, _, _ = _case(CASES[1])
    reads: list[str] = []
    for step in range(2):  # the second step's setup makes the views the first one's calls read
        ctx, sharder = step_context("balanced", doc)
        qkv = [_sharded(sharder, t).requires_grad_() for t in full[:3]]
        with ctx():
            state = active_state()
        with flash_on_cpu("fa3"), recording_host_reads(reads if step else [], state.key):
            for _ in range(2):
                with ctx():
                    out = cpshard.cp_attention(*qkv, enable_gqa=True, softcap=0.8)
                out.sum().backward()
            ran = cpshard.attention_kernel()
    packing.PACKED_KEYS_PER_ROW = keys_per_row
    assert ran == ("fa3_part" if loop else "fa3_varlen"), ran
    return reads


@pytest.mark.parametrize("loop", [False, True], ids=["varlen", "loop"])
def test_the_fa3_path_reads_no_tensor_data_on_the_host(pools, loop: bool) -> None:
    assert pools(2).run(_host_reads, loop, timeout=120) == [[], []]
