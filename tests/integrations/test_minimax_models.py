"""MiniMax through transformers under CP: lightning attention (a decayed linear attention)
layers beside softmax attention, MoE, a tiny random config in float64, one packed row of
documents of uneven lengths with interior padding (one spans ranks, one is shorter than a
shard): every layout that keeps documents in few pieces per rank and the block-diagonal batch
at W = 2, two at W = 1, 3 and 4; ``stripe`` and a cache refused on every rank before the
model's head; outside CP the layer runs transformers' own code.

The reference runs each document alone through a copy of the model (plain SDPA attention, and
transformers' own block-by-block lightning attention, in float64 with blocks of 4 tokens so that
every document crosses blocks). RMS norms are their float64 statements, the logits read before
the head's float32 cast. Bounds: loss relative error < 1e-9, every gradient within 1e-8 of the
largest."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

from tests.helpers import (
    EXAMPLES,
    CausalLMLogits,
    check_relative_errors,
    check_stripe_and_cache_refused,
    float64_rms,
    relative_step_errors,
    stripe_and_cache_errors,
)

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402

from cpshard.integrations import transformers as cp_transformers  # noqa: E402

ROWS = [[11, -2, 6, 3, -1, 8, -1]]  # documents of 11, 6, 3, 8 tokens
LAYOUTS = ["contiguous", "head_tail", "per_document_head_tail", "balanced", "blockdiag"]
GRID = {  # world -> layouts
    1: ["contiguous", "blockdiag"],
    2: LAYOUTS,
    3: ["balanced", "head_tail"],
    4: ["per_document_head_tail", "contiguous"],
}
MODELING = "transformers.models.minimax.modeling_minimax"


def _model() -> torch.nn.Module:
    import transformers as T

    cp_transformers.register()
    config = T.MiniMaxConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, block_size=4, max_position_embeddings=128, use_cache=False,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        tie_word_embeddings=False, experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.float64)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = float64_rms.__get__(module)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def _step(layout: str, group) -> tuple[float, float, float]:
    model = _model()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    batch = cp_decoder.packed_batch(ROWS, model.config.vocab_size, seed=5)
    logits = CausalLMLogits(model)

    def forward(local: dict[str, torch.Tensor]) -> torch.Tensor:
        return logits(local["input_ids"], local["position_ids"]).logits

    cp = cp_decoder.cp_loss(group, batch, forward, layout)
    ref = cp_decoder.reference_loss(CausalLMLogits(reference), cp_decoder.text_documents(batch))
    cp_decoder.reference_backward(ref, reference, dist.get_world_size(group))
    return relative_step_errors(model, reference, cp, ref, group)


def _cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {f"minimax {layout}": _step(layout, dist.group.WORLD) for layout in GRID[world]}


@pytest.mark.parametrize("world", sorted(GRID))
def test_minimax_matches_each_document_alone(pools, world: int) -> None:
    check_relative_errors(pools(world).run(_cases, timeout=600), world)


def _refusals(rank: int, world: int) -> list[str]:
    return stripe_and_cache_errors(_model, ROWS)


def test_stripe_and_a_cache_are_refused_on_every_rank(pools) -> None:
    results = pools(2).run(_refusals, timeout=300)
    check_stripe_and_cache_refused(results)
    for stripe, _ in results:
        assert "lightning attention" in stripe, stripe


def test_outside_cp_the_layer_runs_transformers_code() -> None:
    """With cpshard's dispatcher installed, the model outside CP gives exactly what it gives
    with transformers' own forward, with a padding mask and with a cache."""
    import importlib

    model = _model().train()
    cls = importlib.import_module(MODELING).MiniMaxLightningAttention
    ids = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0

    def logits() -> tuple[torch.Tensor, torch.Tensor]:
        plain = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        cached = model(input_ids=ids, use_cache=True).logits
        return plain, cached

    dispatched = cls.forward
    assert hasattr(dispatched, "cpshard_original")
    got = logits()
    try:
        cls.forward = dispatched.cpshard_original
        want = logits()
    finally:
        cls.forward = dispatched
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
