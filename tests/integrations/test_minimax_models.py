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

import pytest
import torch

from tests.integrations.harness import (
    LAYOUTS,
    check_relative_errors,
    check_stripe_and_cache_refused,
    step_errors,
    stripe_and_cache_errors,
    tiny_model,
)

pytest.importorskip("transformers")

ROWS = [[11, -2, 6, 3, -1, 8, -1]]  # documents of 11, 6, 3, 8 tokens
GRID = {  # world -> layouts
    1: ["contiguous", "blockdiag"],
    2: LAYOUTS,
    3: ["balanced", "head_tail"],
    4: ["per_document_head_tail", "contiguous"],
}
MODELING = "transformers.models.minimax.modeling_minimax"


def _model() -> torch.nn.Module:
    import transformers as T

    config = T.MiniMaxConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, block_size=4, max_position_embeddings=128, use_cache=False,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        tie_word_embeddings=False, experts_implementation="eager",
    )  # fmt: skip
    return tiny_model(config)


def _cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {
        f"minimax {layout}": step_errors(_model(), layout, rows=ROWS, seed=5)
        for layout in GRID[world]
    }


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
