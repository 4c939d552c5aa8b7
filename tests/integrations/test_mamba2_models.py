"""Mamba2 models through transformers under CP: Mamba2 (state-space layers only) and the
Mamba2-attention hybrids NemotronH, Bamba, GraniteMoeHybrid (with MoE), Zamba2 (a shared attention
block) and Falcon-H1 (Mamba2 in parallel with attention in each layer), tiny random configs, float64, one packed row of documents longer than
the convolution with interior padding, every layout that keeps documents in few pieces per rank
and the block-diagonal batch, W = 1..4 (the four newer hybrids: every layout at W = 2, one or
two at W = 1, 3 and 4, to keep the suite affordable); ``stripe`` refused on every rank before the model's
head; a cached call refused on every rank; a padding mask not read under CP (the step's
documents say what is padding); outside CP the layers run transformers' own code.

The reference runs each document alone through a copy of the model (plain SDPA attention) with,
for the recurrence, the token-by-token SSD of :mod:`tests.helpers` (transformers' own computes
in float32). Both models' RMS norms are their float64 statements (transformers' compute in
float32) and the logits are read before the heads' float32 cast. Bounds: loss relative error
< 1e-9, every gradient within 1e-8 of the largest."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import ssd_reference
from tests.integrations.harness import (
    LAYOUTS,
    ROWS,
    check_outside_cp_runs_transformers_code,
    check_relative_errors,
    check_stripe_and_cache_refused,
    float64_rms,
    step_errors,
    stripe_and_cache_errors,
    tiny_model,
)

pytest.importorskip("transformers")

from cpshard.integrations import mamba2  # noqa: E402

MODELS = {
    "mamba2": "transformers.models.mamba2.modeling_mamba2",
    "nemotron_h": "transformers.models.nemotron_h.modeling_nemotron_h",
}
HYBRIDS = {
    "bamba": "transformers.models.bamba.modeling_bamba",
    "granitemoehybrid": "transformers.models.granitemoehybrid.modeling_granitemoehybrid",
    "zamba2": "transformers.models.zamba2.modeling_zamba2",
    "falcon_h1": "transformers.models.falcon_h1.modeling_falcon_h1",
}
MODULES = {**MODELS, **HYBRIDS}


def _config(family: str):
    import transformers as T

    if family == "mamba2":
        return T.Mamba2Config(
            vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
            conv_kernel=4, num_heads=4, head_dim=16, n_groups=2, residual_in_fp32=False,
            time_step_limit=(0.0, 0.3), use_cache=False, tie_word_embeddings=False,
        )  # fmt: skip
    if family == "nemotron_h":
        return T.NemotronHConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            ssm_state_size=4, mamba_num_heads=4, mamba_head_dim=8, n_groups=2, conv_kernel=4,
            initializer_range=0.1, use_cache=False,
        )  # fmt: skip
    attention = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        max_position_embeddings=256, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    mamba = dict(
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=4, mamba_d_conv=4,
        mamba_expand=2, time_step_limit=(0.0, 0.3),
    )  # fmt: skip
    if family == "bamba":
        return T.BambaConfig(
            **attention, **mamba, num_key_value_heads=2, num_hidden_layers=2, attn_layer_indices=[1]
        )
    if family == "granitemoehybrid":
        return T.GraniteMoeHybridConfig(
            **attention, **mamba, num_key_value_heads=2, num_hidden_layers=2,
            layer_types=["mamba", "attention"], num_local_experts=2, num_experts_per_tok=1,
            shared_intermediate_size=32, position_embedding_type="rope",
            experts_implementation="eager",
        )  # fmt: skip
    if family == "falcon_h1":
        return T.FalconH1Config(
            **attention, **mamba, num_key_value_heads=2, num_hidden_layers=2, mamba_d_ssm=64,
            mamba_rms_norm=False,
        )
    if family == "zamba2":  # layer 1 is the shared attention block's with its Mamba2 layer
        return T.Zamba2Config(
            **attention, num_key_value_heads=4, num_hidden_layers=3,
            layers_block_type=["mamba", "hybrid", "mamba"], mamba_d_state=4, mamba_d_conv=4,
            mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, num_mem_blocks=1,
            use_mem_rope=True,
        )  # fmt: skip
    raise AssertionError(family)


def _gated_rms(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba2's gated norm: gate first, then RMS over each group of channels."""
    if gate is not None:
        x = x * F.silu(gate)
    groups = x.view(*x.shape[:-1], -1, self.group_size)
    normed = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * normed.view(x.shape)


def _steps_that_carry(module: torch.nn.Module) -> None:
    """Time steps of about 0.3 to 1.3: the state carries far."""
    if hasattr(module, "dt_bias"):
        with torch.no_grad():
            module.dt_bias.normal_()


def _model(family: str) -> torch.nn.Module:
    norms = {"RMSNormGated": _gated_rms, "RMSNorm": float64_rms}
    return tiny_model(_config(family), norms, _steps_that_carry, attention=family != "mamba2")


def _reference_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,
                    initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                    return_final_states=False, **kwargs):  # fmt: skip
    """One document's SSD, token by token in float64, from the step the layer's own scan makes
    (bias, softplus, clamp)."""
    assert initial_states is None and not return_final_states
    dt = F.softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    doc = torch.ones(hidden_states.shape[:2], dtype=torch.int64)
    return ssd_reference(hidden_states, dt, A, B, C, D, doc)


def _step(family: str, layout: str, group) -> tuple[float, float, float]:
    """One CP step and the per-document reference (the SSD token by token)."""
    return step_errors(
        _model(family), layout, group, seed=len(family),
        reference_attention=None if family == "mamba2" else "sdpa",
        scan=(MODULES[family], "mamba2_chunk_scan", _reference_scan),
    )  # fmt: skip


def _cases(
    rank: int, world: int, families: list[str], layouts: list[str]
) -> dict[str, tuple[float, float, float]]:
    return {
        f"{family} {layout}": _step(family, layout, dist.group.WORLD)
        for family in families
        for layout in layouts
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mamba2_models_match_each_document_alone(pools, world: int) -> None:
    layouts = LAYOUTS if world > 1 else ["contiguous", "blockdiag"]
    check_relative_errors(pools(world).run(_cases, list(MODELS), layouts, timeout=900), world)


HYBRID_LAYOUTS = {1: ["contiguous"], 2: LAYOUTS, 3: ["balanced"], 4: ["head_tail", "blockdiag"]}


@pytest.mark.parametrize("world", list(HYBRID_LAYOUTS))
def test_mamba2_hybrids_match_each_document_alone(pools, world: int) -> None:
    cases = pools(world).run(_cases, list(HYBRIDS), HYBRID_LAYOUTS[world], timeout=900)
    check_relative_errors(cases, world)


def _refusals(rank: int, world: int) -> list[str]:
    """Each model's errors under ``stripe`` and with a cache, on this rank."""
    out = []
    for family in MODULES:
        out += stripe_and_cache_errors(functools.partial(_model, family), ROWS)
    return out


def test_stripe_and_a_cache_are_refused_on_every_rank(pools) -> None:
    check_stripe_and_cache_refused(pools(2).run(_refusals, timeout=300))


@pytest.mark.parametrize("family", list(MODULES))
def test_outside_cp_the_layers_run_transformers_code(family: str) -> None:
    """With cpshard's dispatchers installed, a model outside CP gives exactly what it gives with
    transformers' own functions, in training (the fused-kernel entry taken first) and with a
    padding mask."""
    check_outside_cp_runs_transformers_code(_model(family), MODULES[family], mamba2.FAMILY)


def _mask_ignored(rank: int, world: int) -> list[float]:
    """Per model, under CP: the largest logit difference between a call with the full
    sequence's padding mask (transformers trims it to the shard's length) and one without."""
    from cp_decoder import packed_batch

    import cpshard

    out = []
    for family in MODELS:
        model = _model(family)
        batch = packed_batch(ROWS, model.config.vocab_size, seed=2)
        mask = (batch["_packed_seq_ids"] != 0).long()
        ctx, local = cpshard.ContextParallelSharder(dist.group.WORLD, "balanced").shard(batch)
        with ctx():
            calls = [
                model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                      use_cache=False, **extra).logits
                for extra in ({}, {"attention_mask": mask})
            ]  # fmt: skip
        out.append(float((calls[0] - calls[1]).abs().max()))
    return out


def test_a_padding_mask_is_not_read_under_cp(pools) -> None:
    for rank, diffs in enumerate(pools(2).run(_mask_ignored, timeout=300)):
        assert diffs == [0.0] * len(MODELS), f"rank {rank}: {diffs}"
