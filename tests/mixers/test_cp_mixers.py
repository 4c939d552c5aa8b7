"""The CP causal convolution and the CP gated delta rule against each document run alone
(:func:`tests.helpers.causal_conv_reference`, :func:`tests.helpers.delta_rule_reference`: a
plain conv1d and the token-by-token recurrence), every layout that keeps documents in few pieces
per rank and the block-diagonal batch, W = 1..4, forward and float64 backward; ``stripe``
refused on every rank."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    causal_conv_reference,
    delta_rule_reference,
    packed_doc_ids,
    step_context,
)

LAYOUTS = ["contiguous", "head_tail", "per_document_head_tail", "balanced", "blockdiag"]
# (packing, B, S, heads k, heads v, d_k, d_v, conv channels, kernel)
CASES = [
    ("one_doc", 1, 150, 2, 2, 4, 3, 5, 4),  # one document over every rank (chunks of 64 cut)
    ("interior_pad", 2, 42, 1, 2, 3, 4, 3, 4),  # GVA: value heads twice the key heads
    ("random", 2, 37, 2, 2, 3, 2, 4, 3),
    ("short_docs", 1, 26, 1, 1, 2, 2, 3, 4),  # documents shorter than the kernel
    ("pad_rank", 1, 40, 2, 2, 3, 3, 2, 2),  # a rank of padding only
]


def _inputs(case: tuple) -> tuple[torch.Tensor, ...]:
    packing, b, s, hk, hv, dk, dv, c, kernel = case
    doc = packed_doc_ids(packing, b, s)
    g = torch.Generator().manual_seed(7 * s + b + kernel)
    f64 = dict(dtype=torch.float64, generator=g)
    q, k = torch.randn(b, s, hk, dk, **f64), torch.randn(b, s, hk, dk, **f64)
    v = torch.randn(b, s, hv, dv, **f64)
    logdecay = -torch.rand(b, s, hv, **f64)
    beta = torch.rand(b, s, hv, **f64)
    x, w, bias = torch.randn(b, s, c, **f64), torch.randn(c, kernel, **f64), torch.randn(c, **f64)
    real = (doc != 0).to(torch.float64)  # padding outputs are not compared: weight them 0
    out_w = torch.randn(b, s, hv, dv, **f64) * real[..., None, None]
    conv_w = torch.randn(b, s, c, **f64) * real[..., None]
    return doc, q, k, v, logdecay, beta, x, w, bias, out_w, conv_w


def _distributed(rank: int, world: int, layouts: list[str]) -> list[tuple]:
    from cpshard.attention import active_state
    from cpshard.mixers import cp_causal_conv1d, cp_gated_delta_rule, recurrence_runs

    results = []
    for layout in layouts:
        for case in CASES:
            doc, *full, out_w, conv_w = _inputs(case)
            leaves = [t.requires_grad_() for t in full]
            q, k, v, logdecay, beta, x, w, bias = leaves
            ctx, sharder = step_context(layout, doc)

            def shard(t: torch.Tensor) -> torch.Tensor:
                return sharder.shard_token_tensor(t, seq_dim=1, fill=0.0)

            with ctx():
                state = active_state()
                runs = recurrence_runs(state, "test")
                sharded = (shard(t) for t in (q, k, v, logdecay, beta))
                o = cp_gated_delta_rule(*sharded, runs, state.group)
                y = cp_causal_conv1d(shard(x), w, bias, state, "silu")
            ((o * shard(out_w)).sum() + (y * shard(conv_w)).sum()).backward()
            gathered = [
                sharder.gather_token_tensor(t.detach(), 1, trim=True) for t in (o, y)
            ]
            results.append((*gathered, *(t.grad for t in leaves)))
    return results


def _refused(rank: int, world: int) -> str:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder
    from cpshard.attention import active_state
    from cpshard.mixers import recurrence_runs

    doc = packed_doc_ids("one_doc", 1, 32)
    ctx, _ = ContextParallelSharder(dist.group.WORLD, "stripe").shard(
        {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    with ctx():
        try:
            recurrence_runs(active_state(), "cpshard CP recurrence")
        except ValueError as exc:
            return str(exc)
    return "no error"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_matches_each_document_alone(pools, world: int) -> None:
    layouts = LAYOUTS if world > 1 else ["contiguous", "blockdiag"]
    got = pools(world).run(_distributed, layouts, timeout=600)
    at = 0
    for layout in layouts:
        for case in CASES:
            doc, *full, out_w, conv_w = _inputs(case)
            leaves = [t.requires_grad_() for t in full]
            q, k, v, logdecay, beta, x, w, bias = leaves
            want_o = delta_rule_reference(q, k, v, logdecay, beta, doc)
            want_y = causal_conv_reference(x, w, bias, doc)
            grads = torch.autograd.grad(
                (want_o * out_w).sum() + (want_y * conv_w).sum(), leaves
            )
            where = f"{layout} W={world} {case[0]}"
            pad = doc == 0
            for r in range(world):
                o, y = got[r][at][:2]
                torch.testing.assert_close(
                    o[~pad], want_o[~pad], rtol=0, atol=1e-12, msg=f"{where} delta rule, rank {r}"
                )
                torch.testing.assert_close(
                    y[~pad], want_y[~pad], rtol=0, atol=1e-12, msg=f"{where} conv, rank {r}"
                )
            names = ["q", "k", "v", "g", "beta", "x", "conv weight", "conv bias"]
            for j, name in enumerate(names):
                parts = [got[r][at][2 + j] for r in range(world)]  # None: rank held no token
                total = sum(p for p in parts if p is not None)
                torch.testing.assert_close(
                    total, grads[j], rtol=0, atol=1e-10, msg=f"{where} grad {name}"
                )
            at += 1


def test_stripe_is_refused_on_every_rank(pools) -> None:
    messages = pools(2).run(_refused, timeout=120)
    for r, msg in enumerate(messages):
        assert f"rank {r}" in msg and "'stripe'" in msg and "contiguous" in msg, msg
