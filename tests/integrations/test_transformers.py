"""Real transformers models on cpshard (``cpshard.integrations.transformers``): tiny random
configs, float64, gloo, W = 1..4.

A CP step (the block-diagonal batch making per-document positions and shifting the labels once
before sharding, the ``"cpshard"`` attention, ``cp_cross_entropy``, ``reduce_cp_gradients``) must give
the single-process loss and every parameter gradient, where the reference runs each document on
its own through an ``"sdpa"`` copy of the model. The steps are the examples' own functions
(``examples/cp_decoder.py``, ``examples/cp_vlm.py``), so the examples are tested too.

Tolerance: 1e-10 for loss and gradients. The Qwen3-VL vision rotary embedding computes in
float32; frames run whole on one rank with the same float32 arithmetic as in the reference, so
the VLM reaches ~1e-16 here too, but its bound is 1e-9, what a float32 rotary guarantees.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tests.helpers import EXAMPLES

pytest.importorskip("transformers")

sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402
import cp_vlm  # noqa: E402

from cpshard import make_cp_blockdiag_batch_and_ctx  # noqa: E402
from cpshard.integrations import transformers as cp_transformers  # noqa: E402

TOL = 1e-10
VLM_TOL = 1e-9
# (architecture, rows): B = 1 and 2 for each architecture; every row has several documents and
# interior or trailing padding (the last case also leading padding and one-token documents).
DECODER_CASES = [
    ("llama", [[7, 5, -2, 6, -3]]),
    ("llama", cp_decoder.ROWS),
    ("qwen3", [[3, 9, -1, 4, 6]]),
    ("qwen3", [[-2, 1, 9, 1, -1, 5, 4, -1], [12, -3, 1, 6, -2]]),
]
VLM_CASES = {
    "B=2": cp_vlm.ROWS,
    "B=1": [[(2, (4, 4), 3), (1, (4, 4), 2), 3, (4, None, 0), 2]],
}


def _decoder_cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {
        f"{arch} B={len(rows)} case {seed}": cp_decoder.decoder_step(rank, world, arch, rows, seed)
        for seed, (arch, rows) in enumerate(DECODER_CASES)
    }


# Every ContextParallelSharder layout: a Llama-style case with B = 2 and a Qwen3-style one
# with B = 1 (several documents, interior and trailing padding).
LAYOUT_CASES = [DECODER_CASES[1], DECODER_CASES[2]]


def _layout_cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    from cpshard import LAYOUTS

    return {
        f"{layout} {arch} B={len(rows)}": cp_decoder.decoder_step(rank, world, arch, rows, seed, layout)
        for layout in LAYOUTS
        for seed, (arch, rows) in enumerate(LAYOUT_CASES)
    }


def _vlm_cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {
        name: cp_vlm.vlm_step(rank, world, rows, seed)
        for seed, (name, rows) in enumerate(VLM_CASES.items())
    }


def _check(results: list[dict[str, tuple[float, float, float]]], tol: float) -> None:
    for rank, cases in enumerate(results):
        for name, (cp, ref, grad) in cases.items():
            assert abs(cp - ref) <= tol, f"rank {rank} {name}: CP loss {cp!r} vs {ref!r}"
            assert grad <= tol, f"rank {rank} {name}: max |grad diff| {grad:.3e}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_decoders_match_single_process(pools, world):
    _check(pools(world).run(_decoder_cases, timeout=300), TOL)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_sharder_layout_matches_single_process(pools, world):
    _check(pools(world).run(_layout_cases, timeout=600), TOL)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_qwen3_vl_matches_single_process(pools, world):
    _check(pools(world).run(_vlm_cases, timeout=300), VLM_TOL)


# --------------------------------------------------------------------------- refusals


def _refusals(rank: int, world: int) -> dict[str, str]:
    """Each unsupported attention under CP: the error text on this rank (or 'no error')."""
    import transformers

    cp_transformers.register()
    group = dist.group.WORLD
    batch = cp_decoder.packed_batch(cp_decoder.ROWS, 64)
    out = {}
    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, use_sliding_window=True,
        sliding_window=4, max_window_layers=0, attn_implementation="cpshard",
    )
    sliding = transformers.Qwen3ForCausalLM(config).double()
    decoder = cp_decoder.tiny_decoder("llama")
    attention = decoder.model.layers[0].self_attn
    q = torch.randn(2, 4, 12, 8, dtype=torch.float64)
    kv = torch.randn(2, 2, 12, 8, dtype=torch.float64)
    calls = {
        "sliding window": lambda local: sliding(input_ids=local["input_ids"]),
        "bidirectional": lambda local: cp_transformers.cpshard_attention(
            attention, q, kv, kv, None, is_causal=False
        ),
        "bidirectional window": lambda local: cp_transformers.cpshard_attention(
            attention, q, kv, kv, None, is_causal=False, sliding_window=3
        ),
        "position_bias": lambda local: cp_transformers.cpshard_attention(
            attention, q, kv, kv, None, position_bias=torch.zeros(1)
        ),
    }
    for name, call in calls.items():
        train_ctx, local = make_cp_blockdiag_batch_and_ctx(group, None, dict(batch))
        try:
            with train_ctx():
                call(local)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_unsupported_attention_refused_on_every_rank(pool2):
    expected = {"bidirectional window": "window needs is_causal=True", "position_bias": "position_bias"}
    for rank, outcome in enumerate(pool2.run(_refusals, timeout=120)):
        for supported in ("bidirectional", "sliding window"):
            assert outcome[supported] == "no error", (rank, supported, outcome[supported])
        for name, fragment in expected.items():
            assert fragment in outcome[name] and f"rank {rank}" in outcome[name], (rank, name, outcome[name])


def _tower_inside_cp_step(rank: int, world: int) -> float:
    """The wrapped tower (attention "cpshard" too) called inside a CP step and a vision scope:
    it attends within its frames, not over the sharded text; |difference| from the plain tower."""
    from cpshard import CpVisionFrameShardingConfig, cp_vision_group

    model = cp_vlm.tiny_vlm()
    batch = cp_vlm.vlm_batch(model)
    pixels, grid = batch["pixel_values"], batch["image_grid_thw"]
    want = model.model.visual(pixels, grid_thw=grid, return_dict=True).pooler_output
    cp_transformers.wrap_vision_tower(model)
    train_ctx, _ = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, dict(batch))
    config = CpVisionFrameShardingConfig(enabled=True, min_tokens=1, min_frames=1, min_local_patch_rows=1)
    with train_ctx(), cp_vision_group(dist.group.WORLD, config=config):
        got = model.model.visual(pixels, grid_thw=grid, return_dict=True).pooler_output
    return float((got - want).abs().max())


def test_wrapped_tower_inside_a_cp_step(pool2):
    assert max(pool2.run(_tower_inside_cp_step, timeout=120)) <= VLM_TOL


# --------------------------------------------------------------------------- single process


def test_outside_cp_the_attention_is_sdpa_with_its_masks():
    """Outside a CP step "cpshard" is transformers' "sdpa": same logits for a padded batch."""
    model = cp_decoder.tiny_decoder("qwen3")
    ids = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, 8:] = 0
    mask[1, :3] = 0
    got = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    want = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, want)


# (name, attention_mask: None or "bool", softcap, sinks)
PLAIN_CASES = [
    ("softcap, no mask", None, 0.7, False),
    ("softcap sinks, no mask", None, 1.3, True),
    ("sinks, causal window padding mask", "bool", None, True),
    ("softcap sinks, causal padding mask", "bool", 0.9, True),
]


@pytest.mark.parametrize("case", PLAIN_CASES, ids=[c[0] for c in PLAIN_CASES])
def test_outside_cp_softcap_and_sinks_are_plain_attention(case):
    """Outside a CP step, a call with ``softcap`` or ``s_aux`` (which transformers' "sdpa" does
    not implement) is plain attention on "sdpa"'s reading of the mask (None: causal, as the
    module is; a boolean ``[B, 1, S, S]`` mask: its True entries): float64 forward and
    backward, the sinks' gradient included, against :func:`tests.helpers.masked_attention`."""
    from tests.helpers import masked_attention

    name, mask_kind, softcap, with_sinks = case
    b, heads, kv_heads, s, d = 2, 4, 2, 10, 8
    g = torch.Generator().manual_seed(len(name))
    q = torch.randn(b, heads, s, d, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(b, kv_heads, s, d, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(b, kv_heads, s, d, dtype=torch.float64, generator=g).requires_grad_()
    w = torch.randn(b, s, heads, d, dtype=torch.float64, generator=g)
    sinks = torch.randn(heads, dtype=torch.float64, generator=g).requires_grad_()
    module = torch.nn.Module().eval()
    module.is_causal = True
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = (j <= i).expand(b, s, s).clone()
    mask = None
    if mask_kind == "bool":  # right padding (row 1's last 3 tokens), a window of 4 in row 0
        visible[1] &= j < s - 3
        if "window" in name:
            visible[0] &= i - j < 4
        mask = visible[:, None]
    kwargs = {"softcap": softcap, "s_aux": sinks if with_sinks else None}
    got, weights = cp_transformers.cpshard_attention(module, q, k, v, mask, scaling=0.4, **kwargs)
    assert weights is None and got.shape == (b, s, heads, d)
    want = masked_attention(q, k, v, visible, 0.4, softcap, sinks if with_sinks else None)
    want = want.transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    leaves = [q, k, v] + ([sinks] if with_sinks else [])
    for label, a, e in zip(
        "qkvs"[: len(leaves)], torch.autograd.grad((got * w).sum(), leaves),
        torch.autograd.grad((want * w).sum(), leaves), strict=True,
    ):  # fmt: skip
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12, msg=f"{name}: d{label}")


def test_wrap_vision_tower_keeps_the_tower():
    model = cp_vlm.tiny_vlm()
    keys = list(model.state_dict())
    tower = model.model.visual
    cls = type(tower)
    assert cp_transformers.wrap_vision_tower(model) is tower
    assert cp_transformers.wrap_vision_tower(model) is tower  # idempotent
    assert model.model.visual is tower and isinstance(tower, cls)
    assert isinstance(tower, cp_transformers.CpVisionTower)
    assert list(model.state_dict()) == keys
    assert tower.dtype == torch.float64 and tower.spatial_merge_size == 2
    with pytest.raises(ValueError, match="no vision tower on LlamaForCausalLM"):
        cp_transformers.wrap_vision_tower(cp_decoder.tiny_decoder("llama"))


def test_wrapped_tower_without_scope_is_the_plain_call():
    model = cp_vlm.tiny_vlm()
    batch = cp_vlm.vlm_batch(model)
    want = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"], return_dict=True)
    cp_transformers.wrap_vision_tower(model)
    got = model.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"], return_dict=True)
    assert torch.equal(got.pooler_output, want.pooler_output)
    assert all(torch.equal(a, b) for a, b in zip(got.deepstack_features, want.deepstack_features))


@pytest.mark.parametrize("script", ["cp_decoder.py", "cp_vlm.py"])
def test_example_runs(script):
    """Each example's one command works and prints the two losses (one rank: the CP steps
    themselves are the functions tested above at W = 1..4)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--world", "1"],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "CP loss" in done.stdout and "single-process loss" in done.stdout, done.stdout
