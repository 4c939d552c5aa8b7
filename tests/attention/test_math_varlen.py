"""The explicit varlen kernel (:class:`cpshard.attention.kernels.MathVarlen`, the varlen path of
soft-capped logits and of queries no flash kernel serves) equals the per-span loop it replaces
(the explicit part kernel), forward and backward in float64, with short spans sharing chunks and
long spans cut into row pieces; and a step of many short documents runs a handful of chunks,
not one call per span."""

from __future__ import annotations

import pytest
import torch

import cpshard
from cpshard.attention import engine, packing
from cpshard.attention.kernels import MathPart

DOCS = [37, 100, 1, 250, 12, 3, 3, 90]


def _step(variant: dict, heads: int, kv_heads: int, loop: bool, docs: list[int]) -> list:
    """cp_attention at world size 1 over ``docs`` and its gradients, on the loop with the
    explicit part kernel (``loop``) or on the explicit varlen kernel; which ran is checked."""
    g = torch.Generator().manual_seed(11)
    s = sum(docs)
    leaves = [
        torch.randn(1, h, s, 16, generator=g, dtype=torch.float64).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    ]
    if variant.get("sinks"):
        leaves.append(torch.randn(heads, generator=g, dtype=torch.float64).requires_grad_())
    weight = torch.randn(1, heads, s, 16, generator=g, dtype=torch.float64)
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(docs)])[None]
    ctx, local = cpshard.ContextParallelSharder(None, "contiguous").shard(
        {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    seen: list[str] = []
    saved = engine.part_kernel, engine.math_varlen, engine.implementation
    engine.part_kernel = lambda q, softcap=None: MathPart(softcap)  # as on CUDA fp32/fp64
    if loop:
        engine.math_varlen = lambda part: None

    def recording(*args, **kwargs):
        impl = saved[2](*args, **kwargs)
        seen.append(type(impl).__name__)
        return impl

    engine.implementation = recording
    try:
        with ctx():
            out = cpshard.cp_attention(
                *leaves[:3], is_causal=True, enable_gqa=heads != kv_heads,
                window=variant.get("window"), softcap=variant.get("softcap"),
                sinks=leaves[3] if variant.get("sinks") else None,
                position_ids=local["position_ids"],
            )  # fmt: skip
            grads = torch.autograd.grad((out * weight).sum(), leaves)
    finally:
        engine.part_kernel, engine.math_varlen, engine.implementation = saved
    assert set(seen) == {"Loop" if loop else "Varlen"}, seen
    return [out.detach(), *grads]


VARIANTS = [
    {},
    {"softcap": 3.0},
    {"window": 24},
    {"window": 24, "softcap": 3.0, "sinks": True},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(v) or "plain")
@pytest.mark.parametrize("scores", [packing.MATH_SCORES, 600])
def test_the_chunked_varlen_kernel_equals_the_loop(
    monkeypatch: pytest.MonkeyPatch, variant: dict, scores: int
) -> None:
    # 600 score elements: the 250-token document is cut into row pieces, short ones grouped
    monkeypatch.setattr(packing, "MATH_SCORES", scores)
    want = _step(variant, 4, 2, loop=True, docs=DOCS)
    got = _step(variant, 4, 2, loop=False, docs=DOCS)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_many_short_documents_run_in_few_chunks() -> None:
    lengths = [16] * 256  # 4096 tokens in 256 documents
    chunks = packing.math_chunks(lengths, lengths, causal=True, window=None)
    # spans grouped while a chunk computes at most MATH_WASTE times their own elements
    assert len(chunks) == 256 // packing.MATH_WASTE
    assert [q1 - q0 for q0, q1, _, _ in chunks] == [16 * packing.MATH_WASTE] * len(chunks)
    long = packing.math_chunks([1 << 14], [1 << 14], causal=True, window=None)
    assert len(long) == -(-(1 << 14) // (packing.MATH_SCORES >> 14))  # row pieces of the budget
    assert all((q1 - q0) * (k1 - k0) <= packing.MATH_SCORES for q0, q1, k0, k1 in long)
    assert long[0][2:] == (0, packing.MATH_SCORES >> 14)  # causal: a piece reads only its prefix
