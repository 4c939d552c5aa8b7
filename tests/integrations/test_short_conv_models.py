"""Short-convolution hybrids through transformers under CP: LFM2 and LFM2-MoE (gated causal
depthwise convolutions mixed with full attention), tiny random configs, float64, one packed row
of documents longer than the convolution with interior padding: every layout that keeps
documents in few pieces per rank and the block-diagonal batch at W = 2, one or two at W = 1, 3
and 4 (LFM2-MoE at W = 2); ``stripe`` refused on every rank (LFM2 and LFM2-MoE) before the
model's head.

The reference runs each document alone through a copy of the model with plain SDPA attention and
transformers' own convolution (float64 throughout). RMS norms are their float64 statements
(transformers' compute in float32). Bounds: loss relative error < 1e-9, every gradient within
1e-8 of the largest."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.integrations.harness import (
    LAYOUTS,
    ROWS,
    ModelLogits,
    check_relative_errors,
    check_stripe_and_cache_refused,
    step_errors,
    stripe_and_cache_errors,
    tiny_model,
)

pytest.importorskip("transformers")

GRID = {  # world -> (family, layouts)
    1: [("lfm2", ["contiguous"])],
    2: [("lfm2", LAYOUTS), ("lfm2_moe", ["balanced", "blockdiag"])],
    3: [("lfm2", ["balanced"])],
    4: [("lfm2", ["head_tail", "blockdiag"])],
}


def _config(family: str):
    import transformers as T

    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        conv_L_cache=3, layer_types=["conv", "full_attention"], use_cache=False,
        tie_word_embeddings=False,
    )  # fmt: skip
    if family == "lfm2":
        return T.Lfm2Config(**common)
    if family == "lfm2_moe":
        return T.Lfm2MoeConfig(
            **common, moe_intermediate_size=16, num_dense_layers=1, num_experts=2,
            num_experts_per_tok=1, experts_implementation="eager",
        )  # fmt: skip
    raise AssertionError(family)


def _taps_that_carry(module: torch.nn.Module) -> None:
    """Convolution taps large enough to carry far."""
    if isinstance(module, torch.nn.Conv1d):
        with torch.no_grad():
            module.weight.normal_()


def _model(family: str) -> torch.nn.Module:
    return tiny_model(_config(family), prepare=_taps_that_carry)


def _cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {
        f"{family} {layout}": step_errors(
            _model(family), layout, seed=len(family), logits=ModelLogits
        )
        for family, layouts in GRID[world]
        for layout in layouts
    }


@pytest.mark.parametrize("world", sorted(GRID))
def test_short_conv_models_match_each_document_alone(pools, world: int) -> None:
    check_relative_errors(pools(world).run(_cases, timeout=900), world)


def _refusals(rank: int, world: int) -> list[str]:
    """Each model's error under ``stripe``, on this rank."""
    out = []
    for family in ("lfm2", "lfm2_moe"):
        out += stripe_and_cache_errors(functools.partial(_model, family), ROWS, cache=False)
    return out


def test_stripe_is_refused_on_every_rank(pools) -> None:
    check_stripe_and_cache_refused(pools(2).run(_refusals, timeout=300), cache=False)
