"""Mamba (v1) models through transformers under CP: Mamba (selective-scan layers only) and Jamba
(Mamba layers, attention and MoE), tiny random configs, float64, one packed row of documents
longer than the convolution with interior padding: every layout that keeps documents in few
pieces per rank and the block-diagonal batch at W = 2, one or two at W = 1, 3 and 4 (Jamba at
W = 2 and 4); ``stripe`` and a cache refused on every rank before the model's head; outside CP
the layers run transformers' own code.

The reference runs each document alone through a copy of the model (plain SDPA attention) with,
for the scan, the token-by-token selective scan of :mod:`tests.helpers` (transformers' own
computes in float32), the ``D`` term and gate applied as the layer's own function applies them.
RMS norms are their float64 statements, the logits read before the head's float32 cast. Bounds:
loss relative error < 1e-9, every gradient within 1e-8 of the largest."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import selective_scan_reference
from tests.integrations.harness import (
    LAYOUTS,
    ROWS,
    check_outside_cp_runs_transformers_code,
    check_relative_errors,
    check_stripe_and_cache_refused,
    step_errors,
    stripe_and_cache_errors,
    tiny_model,
)

pytest.importorskip("transformers")

from cpshard.integrations import mamba  # noqa: E402

MODELS = {
    "mamba": "transformers.models.mamba.modeling_mamba",
    "jamba": "transformers.models.jamba.modeling_jamba",
}
GRID = {  # world -> (family, layouts)
    1: [("mamba", ["contiguous"])],
    2: [("mamba", LAYOUTS), ("jamba", ["head_tail", "blockdiag"])],
    3: [("mamba", ["balanced"])],
    4: [("mamba", ["per_document_head_tail"]), ("jamba", ["balanced"])],
}


def _config(family: str):
    import transformers as T

    if family == "mamba":
        return T.MambaConfig(
            vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
            conv_kernel=4, residual_in_fp32=False, use_cache=False, tie_word_embeddings=False,
        )  # fmt: skip
    if family == "jamba":
        return T.JambaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2,
            attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=2,
            num_experts_per_tok=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2,
            mamba_dt_rank=8, max_position_embeddings=256, use_cache=False,
            tie_word_embeddings=False, experts_implementation="eager",
        )  # fmt: skip
    raise AssertionError(family)


def _steps_that_carry(module: torch.nn.Module) -> None:
    """Time steps of about 0.3 to 1.3: the state carries far."""
    if hasattr(module, "dt_proj"):
        with torch.no_grad():
            module.dt_proj.bias.normal_()


def _model(family: str) -> torch.nn.Module:
    return tiny_model(_config(family), prepare=_steps_that_carry, attention=family == "jamba")


def _reference_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None,
                    delta_softplus=False, return_last_state=False, **kwargs):  # fmt: skip
    """One document's selective scan, token by token in float64, from the step the layer's own
    scan makes (bias, softplus), ``[B, channels, L]`` in and out as the layer's."""
    assert not return_last_state
    dt = dt + delta_bias[..., None] if delta_bias is not None else dt
    dt = F.softplus(dt) if delta_softplus else dt
    x, step, b, c = (t.transpose(1, 2) for t in (hidden_states, dt, B, C))
    doc = torch.ones(x.shape[:2], dtype=torch.int64)
    y = selective_scan_reference(x, step, A, b, c, D, doc).transpose(1, 2)
    return y * F.silu(z) if z is not None else y


def _step(family: str, layout: str) -> tuple[float, float, float]:
    """One CP step and the per-document reference (the selective scan token by token)."""
    return step_errors(
        _model(family), layout, seed=len(family),
        reference_attention="sdpa" if family == "jamba" else None,
        scan=(MODELS[family], "mamba_selective_scan", _reference_scan),
    )  # fmt: skip


def _cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {
        f"{family} {layout}": _step(family, layout)
        for family, layouts in GRID[world]
        for layout in layouts
    }


@pytest.mark.parametrize("world", sorted(GRID))
def test_mamba_models_match_each_document_alone(pools, world: int) -> None:
    check_relative_errors(pools(world).run(_cases, timeout=900), world)


def _refusals(rank: int, world: int) -> list[str]:
    """Each model's errors under ``stripe`` and with a cache, on this rank."""
    out = []
    for family in MODELS:
        out += stripe_and_cache_errors(functools.partial(_model, family), ROWS)
    return out


def test_stripe_and_a_cache_are_refused_on_every_rank(pools) -> None:
    check_stripe_and_cache_refused(pools(2).run(_refusals, timeout=300))


@pytest.mark.parametrize("family", list(MODELS))
def test_outside_cp_the_layers_run_transformers_code(family: str) -> None:
    """With cpshard's dispatchers installed, a model outside CP gives exactly what it gives with
    transformers' own functions, in training (the fused-kernel entry taken first) and with a
    padding mask."""
    check_outside_cp_runs_transformers_code(_model(family), MODELS[family], mamba.FAMILY)
