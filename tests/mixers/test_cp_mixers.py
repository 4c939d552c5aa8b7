"""The CP causal convolution, the CP gated delta rule, the CP SSD (Mamba2), the CP selective
scan (Mamba) and the CP lightning attention (MiniMax) against each document run alone
(:func:`tests.helpers.causal_conv_reference`, :func:`tests.helpers.delta_rule_reference`,
:func:`tests.helpers.ssd_reference`, :func:`tests.helpers.selective_scan_reference`: a plain
conv1d and the token-by-token recurrences; :func:`tests.helpers.lightning_reference`: the
full-sequence quadratic form under a per-document causal mask), every layout that keeps
documents in few pieces per rank and the block-diagonal batch, W = 1..4, forward and float64
backward; ``stripe`` refused on every rank; bad shapes raise naming the argument and the rank."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    causal_conv_reference,
    delta_rule_reference,
    lightning_reference,
    packed_doc_ids,
    selective_scan_reference,
    ssd_reference,
    step_context,
)

LAYOUTS = ["contiguous", "head_tail", "per_document_head_tail", "balanced", "blockdiag"]
# (packing, B, S, heads k, heads v, d_k, d_v, conv channels, kernel); the SSD runs with the
# value heads as heads, the key heads as groups, d_v as head dim and d_k as state size
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
    xs, dt = torch.randn(b, s, hv, dv, **f64), torch.rand(b, s, hv, **f64)
    a, d = -0.1 - 2 * torch.rand(hv, **f64), torch.randn(hv, **f64)
    bm, cm = torch.randn(b, s, hk, dk, **f64), torch.randn(b, s, hk, dk, **f64)
    ssd_w = torch.randn(b, s, hv, dv, **f64) * real[..., None, None]
    ssd = (xs, dt, a, bm, cm, d)
    return doc, q, k, v, logdecay, beta, x, w, bias, *ssd, out_w, conv_w, ssd_w


def _loss(outs: tuple[torch.Tensor, ...], weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return sum((o * w).sum() for o, w in zip(outs, weights, strict=True))


def _distributed(rank: int, world: int, layouts: list[str]) -> list[tuple]:
    from cpshard.attention import active_state
    from cpshard.mixers import cp_causal_conv1d, cp_gated_delta_rule, cp_ssd, recurrence_runs

    results = []
    for layout in layouts:
        for case in CASES:
            doc, *full, out_w, conv_w, ssd_w = _inputs(case)
            leaves = [t.requires_grad_() for t in full]
            q, k, v, logdecay, beta, x, w, bias, xs, dt, a, bm, cm, d = leaves
            ctx, sharder = step_context(layout, doc)

            def shard(t: torch.Tensor) -> torch.Tensor:
                return sharder.shard_token_tensor(t, seq_dim=1, fill=0.0)

            with ctx():
                state = active_state()
                runs = recurrence_runs(state, "test")
                sharded = (shard(t) for t in (q, k, v, logdecay, beta))
                o = cp_gated_delta_rule(*sharded, runs, state.group)
                y = cp_causal_conv1d(shard(x), w, bias, state, "silu")
                z = cp_ssd(shard(xs), shard(dt), a, shard(bm), shard(cm), d, runs, state.group)
            _loss((o, y, z), tuple(shard(t) for t in (out_w, conv_w, ssd_w))).backward()
            gathered = [
                sharder.gather_token_tensor(t.detach(), 1, trim=True) for t in (o, y, z)
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
            doc, *full, out_w, conv_w, ssd_w = _inputs(case)
            leaves = [t.requires_grad_() for t in full]
            q, k, v, logdecay, beta, x, w, bias, xs, dt, a, bm, cm, d = leaves
            want_o = delta_rule_reference(q, k, v, logdecay, beta, doc)
            want_y = causal_conv_reference(x, w, bias, doc)
            want_z = ssd_reference(xs, dt, a, bm, cm, d, doc)
            wants = (want_o, want_y, want_z)
            grads = torch.autograd.grad(_loss(wants, (out_w, conv_w, ssd_w)), leaves)
            where = f"{layout} W={world} {case[0]}"
            pad = doc == 0
            for r in range(world):
                for what, out, want in zip(("delta rule", "conv", "ssd"), got[r][at][:3], wants):
                    torch.testing.assert_close(
                        out[~pad], want[~pad], rtol=0, atol=1e-12, msg=f"{where} {what}, rank {r}"
                    )
            names = ["q", "k", "v", "g", "beta", "x", "conv weight", "conv bias",
                     "ssd x", "dt", "A", "B", "C", "D"]  # fmt: skip
            for j, name in enumerate(names):
                parts = [got[r][at][3 + j] for r in range(world)]  # None: rank held no token
                total = sum(p for p in parts if p is not None)
                torch.testing.assert_close(
                    total, grads[j], rtol=0, atol=1e-10, msg=f"{where} grad {name}"
                )
            at += 1


def _scan_inputs(case: tuple) -> tuple[torch.Tensor, ...]:
    """The selective scan's arguments for ``case``: its conv channels as channels, its d_k as
    state size; and the output's weights (0 on padding)."""
    packing, b, s, _, _, dk, _, c, kernel = case
    doc = packed_doc_ids(packing, b, s)
    f64 = dict(dtype=torch.float64, generator=torch.Generator().manual_seed(5 * s + b + kernel))
    x, dt = torch.randn(b, s, c, **f64), torch.rand(b, s, c, **f64)
    a, d = -0.1 - 2 * torch.rand(c, dk, **f64), torch.randn(c, **f64)
    bm, cm = torch.randn(b, s, dk, **f64), torch.randn(b, s, dk, **f64)
    weight = torch.randn(b, s, c, **f64) * (doc != 0).to(torch.float64)[..., None]
    return doc, x, dt, a, bm, cm, d, weight


def _lightning_inputs(case: tuple) -> tuple[torch.Tensor, ...]:
    """Lightning attention's arguments for ``case``: its value heads as heads, d_k and d_v as
    head sizes, slopes from slow (the state carries across the whole row) to fast; and the
    output's weights (0 on padding)."""
    packing, b, s, _, hv, dk, dv, _, kernel = case
    doc = packed_doc_ids(packing, b, s)
    f64 = dict(dtype=torch.float64, generator=torch.Generator().manual_seed(3 * s + b + kernel))
    q, k = torch.randn(b, s, hv, dk, **f64), torch.randn(b, s, hv, dk, **f64)
    v = torch.randn(b, s, hv, dv, **f64)
    slope = torch.logspace(-3, 0, hv, dtype=torch.float64)
    weight = torch.randn(b, s, hv, dv, **f64) * (doc != 0).to(torch.float64)[..., None, None]
    return doc, q, k, v, slope, weight


def _scan_call(runs, group, shard, x, dt, a, bm, cm, d) -> torch.Tensor:
    from cpshard.mixers import cp_selective_scan

    return cp_selective_scan(shard(x), shard(dt), a, shard(bm), shard(cm), d, runs, group)


def _lightning_call(runs, group, shard, q, k, v, slope) -> torch.Tensor:
    from cpshard.mixers import cp_lightning_attention

    return cp_lightning_attention(shard(q), shard(k), shard(v), slope, runs, group)


# the mixers with one output: mixer -> (its inputs and output weights, its CP call on this
# rank's shards, its reference over the whole row, the names of its differentiable inputs)
ONE_OUTPUT = {
    "selective_scan": (_scan_inputs, _scan_call, selective_scan_reference,
                       ["x", "dt", "A", "B", "C", "D"]),
    "lightning": (_lightning_inputs, _lightning_call, lightning_reference,
                  ["q", "k", "v", "slope"]),
}  # fmt: skip


def _one_output_distributed(rank: int, world: int, mixer: str, layouts: list[str]) -> list[tuple]:
    from cpshard.attention import active_state
    from cpshard.mixers import recurrence_runs

    inputs, call, _, _ = ONE_OUTPUT[mixer]
    results = []
    for layout in layouts:
        for case in CASES:
            doc, *full, weight = inputs(case)
            leaves = [t.requires_grad_() for t in full]
            ctx, sharder = step_context(layout, doc)

            def shard(t: torch.Tensor) -> torch.Tensor:
                return sharder.shard_token_tensor(t, seq_dim=1, fill=0.0)

            with ctx():
                state = active_state()
                y = call(recurrence_runs(state, "test"), state.group, shard, *leaves)
            (y * shard(weight)).sum().backward()
            gathered = sharder.gather_token_tensor(y.detach(), 1, trim=True)
            results.append((gathered, *(t.grad for t in leaves)))
    return results


@pytest.mark.parametrize("mixer", list(ONE_OUTPUT))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_one_output_mixers_match_their_reference(pools, world: int, mixer: str) -> None:
    """The selective scan against each document alone, token by token; lightning attention
    against the quadratic form over the whole row."""
    inputs, _, reference, names = ONE_OUTPUT[mixer]
    layouts = LAYOUTS if world > 1 else ["contiguous", "blockdiag"]
    got = pools(world).run(_one_output_distributed, mixer, layouts, timeout=600)
    at = 0
    for layout in layouts:
        for case in CASES:
            doc, *full, weight = inputs(case)
            leaves = [t.requires_grad_() for t in full]
            want = reference(*leaves, doc)
            grads = torch.autograd.grad((want * weight).sum(), leaves)
            where = f"{mixer} {layout} W={world} {case[0]}"
            pad = doc == 0
            for r in range(world):
                torch.testing.assert_close(
                    got[r][at][0][~pad], want[~pad], rtol=0, atol=1e-12, msg=f"{where} rank {r}"
                )
            for j, name in enumerate(names):
                parts = [got[r][at][1 + j] for r in range(world)]  # None: rank held no token
                total = sum(p for p in parts if p is not None)
                torch.testing.assert_close(
                    total, grads[j], rtol=0, atol=1e-10, msg=f"{where} grad {name}"
                )
            at += 1


def test_stripe_is_refused_on_every_rank(pools) -> None:
    messages = pools(2).run(_refused, timeout=120)
    for r, msg in enumerate(messages):
        assert f"rank {r}" in msg and "'stripe'" in msg and "contiguous" in msg, msg


class _Solo:  # rank 1 of a world-2 group, planned alone (the checks run before any transfer)
    world, rank, name = 2, 1, "solo"


def _ssd_args(**bad: tuple[int, ...] | None) -> dict:
    """cp_ssd's tensors for rank 1's shard of ``[1, 12]`` (6 tokens, 4 heads of 3, 2 groups of
    state 5), with the shapes ``bad`` names replaced."""
    shapes = {"x": (1, 6, 4, 3), "dt": (1, 6, 4), "A": (4,), "B": (1, 6, 2, 5),
              "C": (1, 6, 2, 5), "D": (4,)} | bad  # fmt: skip
    return {k: None if s is None else torch.randn(s, dtype=torch.float64) for k, s in shapes.items()}


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"x": (1, 5, 4, 3)}, "x must be [B, L, heads, head_dim]"),
        ({"dt": (1, 6, 3)}, "dt must be (1, 6, 4)"),
        ({"A": (4, 1)}, "A must be [4]"),
        ({"D": (3,)}, "D must be [4] or None"),
        ({"B": (1, 6, 3, 5), "C": (1, 6, 3, 5)}, "B must be [B, L, groups, d_state]"),
        ({"C": (1, 6, 1, 5)}, "B and C must have one shape"),
    ],
)
def test_ssd_bad_shapes_raise_naming_the_argument_and_the_rank(bad: dict, words: str) -> None:
    from cpshard.layouts import make_layout
    from cpshard.mixers import cp_ssd, plan_recurrence_runs

    doc = torch.tensor([[1] * 7 + [2] * 5])
    runs = plan_recurrence_runs(1, 2, make_layout("contiguous", 2, 12), doc, "test")
    with pytest.raises(ValueError, match="rank 1") as err:
        cp_ssd(**_ssd_args(**bad), runs=runs, group=_Solo())
    assert words in str(err.value), err.value


def _scan_args(**bad: tuple[int, ...] | None) -> dict:
    """cp_selective_scan's tensors for rank 1's shard of ``[1, 12]`` (6 tokens, 4 channels of
    state 5), with the shapes ``bad`` names replaced."""
    shapes = {"x": (1, 6, 4), "dt": (1, 6, 4), "A": (4, 5), "B": (1, 6, 5), "C": (1, 6, 5),
              "D": (4,)} | bad  # fmt: skip
    return {k: None if s is None else torch.randn(s, dtype=torch.float64) for k, s in shapes.items()}


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"x": (1, 5, 4)}, "x must be [B, L, channels]"),
        ({"dt": (1, 6, 3)}, "dt must be (1, 6, 4)"),
        ({"A": (4,)}, "A must be [4, d_state]"),
        ({"D": (3,)}, "D must be [4] or None"),
        ({"B": (1, 6, 4)}, "B must be (1, 6, 5)"),
        ({"C": (1, 5, 5)}, "C must be (1, 6, 5)"),
    ],
)
def test_selective_scan_bad_shapes_raise_naming_the_argument_and_the_rank(bad: dict, words: str) -> None:
    from cpshard.layouts import make_layout
    from cpshard.mixers import cp_selective_scan, plan_recurrence_runs

    doc = torch.tensor([[1] * 7 + [2] * 5])
    runs = plan_recurrence_runs(1, 2, make_layout("contiguous", 2, 12), doc, "test")
    with pytest.raises(ValueError, match="rank 1") as err:
        cp_selective_scan(**_scan_args(**bad), runs=runs, group=_Solo())
    assert words in str(err.value), err.value


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"q": (1, 5, 4, 3)}, "q must be [B, L, heads, head_dim]"),
        ({"k": (1, 6, 4, 2)}, "k must be (1, 6, 4, 3)"),
        ({"v": (1, 6, 3, 2)}, "v must be [B, L, heads, head_dim_v]"),
        ({"slope": (4, 1)}, "slope must be [4]"),
        ({"slope": (3,)}, "slope must be [4]"),
    ],
)
def test_lightning_bad_shapes_raise_naming_the_argument_and_the_rank(bad: dict, words: str) -> None:
    from cpshard.layouts import make_layout
    from cpshard.mixers import cp_lightning_attention, plan_recurrence_runs

    shapes = {"q": (1, 6, 4, 3), "k": (1, 6, 4, 3), "v": (1, 6, 4, 2), "slope": (4,)} | bad
    args = {name: torch.randn(shape, dtype=torch.float64) for name, shape in shapes.items()}
    doc = torch.tensor([[1] * 7 + [2] * 5])
    runs = plan_recurrence_runs(1, 2, make_layout("contiguous", 2, 12), doc, "test")
    with pytest.raises(ValueError, match="rank 1") as err:
        cp_lightning_attention(**args, runs=runs, group=_Solo())
    assert words in str(err.value), err.value


def _rule_args(**bad: tuple[int, ...]) -> dict:
    """cp_gated_delta_rule's tensors for rank 1's shard of ``[1, 12]`` (6 tokens, 2 key heads
    of 3, 4 value heads of 2), with the shapes ``bad`` names replaced."""
    shapes = {"query": (1, 6, 2, 3), "key": (1, 6, 2, 3), "value": (1, 6, 4, 2),
              "g": (1, 6, 4), "beta": (1, 6, 4)} | bad  # fmt: skip
    return {k: torch.randn(s, dtype=torch.float64) for k, s in shapes.items()}


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"query": (1, 7, 2, 3)}, "query must be [B, L, heads, head_dim]"),
        ({"key": (1, 6, 2, 4)}, "query and key must have one shape"),
        ({"value": (1, 6, 3, 2), "g": (1, 6, 3), "beta": (1, 6, 3)}, "multiple of key's 2"),
        ({"g": (1, 6, 2)}, "g must be (1, 6, 4)"),
        ({"beta": (1, 5, 4)}, "beta must be (1, 6, 4)"),
    ],
)
def test_delta_rule_bad_shapes_raise_naming_the_argument_and_the_rank(bad: dict, words: str) -> None:
    from cpshard.layouts import make_layout
    from cpshard.mixers import cp_gated_delta_rule, plan_recurrence_runs

    doc = torch.tensor([[1] * 7 + [2] * 5])
    runs = plan_recurrence_runs(1, 2, make_layout("contiguous", 2, 12), doc, "test")
    with pytest.raises(ValueError, match="rank 1") as err:
        cp_gated_delta_rule(**_rule_args(**bad), runs=runs, group=_Solo())
    assert words in str(err.value), err.value


@pytest.mark.parametrize(
    ("x", "weight", "words"),
    [((1, 5, 3), (3, 4), "x must be [B, L, channels]"), ((1, 6, 3), (2, 4), "weight must be [3")],
)
def test_conv_bad_shapes_raise_naming_the_argument_and_the_rank(x, weight, words) -> None:
    from cpshard.attention import step_state
    from cpshard.layouts import make_layout
    from cpshard.mixers import cp_causal_conv1d

    doc = torch.tensor([[1] * 7 + [2] * 5])
    state = step_state(_Solo(), make_layout("contiguous", 2, 12), doc)
    with pytest.raises(ValueError, match="rank 1") as err:
        cp_causal_conv1d(torch.randn(x), torch.randn(weight), None, state, "silu")
    assert words in str(err.value), err.value
