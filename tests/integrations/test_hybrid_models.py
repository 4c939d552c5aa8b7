"""Hybrid models through transformers under CP: Qwen3.5 and Qwen3-Next (Gated DeltaNet linear
attention with its short causal convolution, mixed with full attention), tiny random configs,
float64, one packed row of documents longer than the convolution with interior padding, every
layout that keeps documents in few pieces per rank and the block-diagonal batch, W = 1..4, and
their attention under the head-parallel strategies (``heads`` at W = 2 and 4, ``hierarchical`` on
a 2 x 2 mesh); ``stripe`` refused on every rank before the model computes anything.

The reference runs each document alone through a copy of the model with plain SDPA attention
and, for the recurrence, the token-by-token gated delta rule of :mod:`tests.helpers` (transformers'
own computes in float32). Both models' RMS norms are their float64 statements (transformers'
compute in float32). Bounds: loss relative error < 1e-9, every gradient within 1e-8 of the
largest."""

from __future__ import annotations

import copy
import functools
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import EXAMPLES, cp_mesh, delta_rule_reference, recording_routes, swapped
from tests.integrations.harness import (
    LAYOUTS,
    ROWS,
    ModelLogits,
    bind_norms,
    check_relative_errors,
    check_stripe_and_cache_refused,
    relative_step_errors,
    step_errors,
    stripe_and_cache_errors,
    tiny_model,
)

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402

from cpshard.integrations import transformers as cp_transformers  # noqa: E402

MODELS = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
}


def _config(family: str):
    import transformers as T

    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, layer_types=["linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=4, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4,
    )  # fmt: skip
    if family == "qwen3_5":
        return T.Qwen3_5TextConfig(**common)
    if family == "qwen3_next":
        return T.Qwen3NextConfig(
            **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, decoder_sparse_step=1,
            experts_implementation="eager",
        )  # fmt: skip
    raise AssertionError(family)


def _rms(self, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _gated_rms(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * normed * F.silu(gate)


NORMS = {"RMSNormGated": _gated_rms, "RMSNorm": _rms}


def _float64_norms(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its RMS norms' float64 statements and the ``"cpshard"`` attention."""
    bind_norms(model, NORMS)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def _model(family: str) -> torch.nn.Module:
    return tiny_model(_config(family), NORMS)


def _reference_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
    """One document's gated delta rule, token by token in float64 (heads repeated as the
    layer's grouped value heads need)."""
    assert use_qk_l2norm_in_kernel and initial_state is None and not output_final_state
    rep = value.shape[2] // key.shape[2]
    q, k = (t.repeat_interleave(rep, dim=2) for t in (query, key))
    doc = torch.ones(q.shape[:2], dtype=torch.int64)
    return delta_rule_reference(q, k, value, g, beta, doc), None


def _step(
    family: str, layout: str, group, strategy: str = "auto", mesh=None
) -> tuple[float, float, float]:
    """One CP step (over ``mesh`` when given, a 2-D mesh whose flattening is ``group``) with CP
    attention's ``strategy``, and the per-document reference (the gated delta rule token by
    token): (CP loss averaged over ranks, reference loss, worst gradient difference relative to
    the largest gradient)."""
    return step_errors(
        _model(family), layout, group, seed=len(family), logits=ModelLogits,
        scan=(MODELS[family], "torch_chunk_gated_delta_rule", _reference_rule),
        strategy=strategy, mesh=mesh,
    )  # fmt: skip


def _cases(rank: int, world: int, layouts: list[str]) -> dict[str, tuple[float, float, float]]:
    return {
        f"{family} {layout}": _step(family, layout, dist.group.WORLD)
        for family in MODELS
        for layout in layouts
    }


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_hybrids_match_each_document_alone(pools, world: int) -> None:
    layouts = LAYOUTS if world > 1 else ["contiguous", "blockdiag"]
    check_relative_errors(pools(world).run(_cases, layouts, timeout=900), world)


# world -> (strategy, 2-D mesh shape or None): the full-attention layers' head-parallel paths.
STRATEGY_CASES = {2: [("heads", None)], 4: [("heads", None), ("hierarchical", (2, 2))]}


def _strategy_cases(
    rank: int, world: int
) -> dict[str, tuple[tuple[float, float, float], str, list[str]]]:
    """Each case's errors, the strategy and the plan kinds its attention calls took."""
    out = {}
    for strategy, shape in STRATEGY_CASES[world]:
        mesh = None if shape is None else cp_mesh(*shape)
        for family in MODELS:
            for layout in ("head_tail", "blockdiag"):
                with recording_routes() as kinds:
                    errors = _step(family, layout, dist.group.WORLD, strategy, mesh)
                out[f"{family} {layout} {strategy}"] = errors, strategy, sorted(set(kinds))
    return out


@pytest.mark.parametrize("world", sorted(STRATEGY_CASES))
def test_hybrids_under_head_parallel_strategies(pools, world: int) -> None:
    results = pools(world).run(_strategy_cases, timeout=600)
    for rank, cases in enumerate(results):
        for name, (_, strategy, kinds) in cases.items():
            assert kinds == [strategy], f"rank {rank} W={world} {name}: attention took {kinds}"
    check_relative_errors([{n: c[0] for n, c in cases.items()} for cases in results], world)


def _tiny_vlm() -> torch.nn.Module:
    """A tiny random Qwen3.5 VLM (vision tower + hybrid decoder), float64 norms."""
    import cp_vlm
    import transformers

    cp_transformers.register()
    text = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                         "partial_rotary_factor": 1.0},
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=4, linear_value_head_dim=6, linear_num_key_heads=2,
        linear_num_value_heads=4,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
        temporal_patch_size=1, spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16,
    )  # fmt: skip
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config=vision, image_token_id=cp_vlm.IMAGE,
        video_token_id=cp_vlm.VIDEO, vision_start_token_id=cp_vlm.START,
        vision_end_token_id=cp_vlm.END, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.float64)
    return _float64_norms(model)


def _vlm_step(rank: int, world: int, layout: str) -> tuple[float, float, float]:
    """The Qwen3.5 VLM's CP step: the tower on this rank's frames (``maybe_distribute_visual``
    through the wrapped tower), the merged sequence sharded as ``layout``, the hybrid decoder
    under CP; and the per-document reference (loss, reference loss, worst relative gradient)."""
    import cp_vlm

    import cpshard

    group = dist.group.WORLD
    model = _tiny_vlm()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    reference.config.use_cache = False
    reference.config.text_config.use_cache = False
    cp_transformers.wrap_vision_tower(model)
    batch = cp_vlm.vlm_batch(model, cp_vlm.ROWS, 0)
    config = cpshard.CpVisionFrameShardingConfig(
        enabled=True, min_tokens=1, min_frames=1, min_local_patch_rows=1
    )
    with cpshard.cp_vision_group(group, config=config):
        merged = cp_vlm.merged_inputs(model, batch)
    cp = cp_decoder.cp_loss(group, merged, lambda local: cp_vlm.decoder_logits(model, local), layout)
    with swapped(MODELS["qwen3_5"], "torch_chunk_gated_delta_rule", _reference_rule):
        ref = cp_decoder.reference_loss(reference, cp_vlm.vlm_documents(batch))
    cp_decoder.reference_backward(ref, reference, world)
    return relative_step_errors(model, reference, cp, ref, group)


def _vlm_cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {layout: _vlm_step(rank, world, layout) for layout in LAYOUTS}


@pytest.mark.parametrize("world", [2, 4])
def test_qwen3_5_vlm_matches_each_document_alone(pools, world: int) -> None:
    check_relative_errors(pools(world).run(_vlm_cases, timeout=900), world)


def _refusals(rank: int, world: int) -> list[str]:
    """Each model's error under ``stripe``, on this rank."""
    out = []
    for family in MODELS:
        out += stripe_and_cache_errors(functools.partial(_model, family), ROWS, cache=False)
    return out


def test_stripe_is_refused_on_every_rank(pools) -> None:
    check_stripe_and_cache_refused(pools(2).run(_refusals, timeout=300), cache=False)


def _checkpointed(
    rank: int, world: int, backward_inside: bool, last: str = "linear_attention"
) -> tuple[str, tuple | None]:
    """A checkpointed Qwen3.5 whose last layer (the first recompute in backward) is ``last``.
    Backward inside the context: the step equals the reference; outside it: the recompute
    cannot find its step (Qwen3.5 derives its layers' position ids, so even its attention
    cannot look the step up): the error on this rank, never the layer run on the shard
    alone."""
    import transformers

    import cpshard

    group = dist.group.WORLD
    cp_transformers.register()
    config = _config("qwen3_5")
    config.layer_types = ["full_attention", "linear_attention"][:: 1 if last == "linear_attention" else -1]
    torch.manual_seed(0)
    model = _float64_norms(transformers.AutoModelForCausalLM.from_config(config).to(torch.float64))
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    reference.config.use_cache = False
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    batch = cp_decoder.packed_batch(ROWS, model.config.vocab_size, seed=2)
    ctx, local = cpshard.ContextParallelSharder(group, "balanced").shard(batch)
    with ctx():
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
        loss = cpshard.cp_cross_entropy(out.logits, local.targets.labels, group)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        try:
            loss.backward()
        except ValueError as exc:
            return str(exc), None
        return "no error", None
    del ctx  # the step is over: the reference's backward runs with no CP step alive
    with swapped(MODELS["qwen3_5"], "torch_chunk_gated_delta_rule", _reference_rule):
        ref = cp_decoder.reference_loss(reference, cp_decoder.text_documents(batch))
    cp_decoder.reference_backward(ref, reference, world)
    return "", relative_step_errors(model, reference, loss.detach(), ref, group)


def test_checkpointed_hybrid_layers(pools) -> None:
    """Backward inside the context: exact; outside: refused on every rank."""
    results = pools(2).run(_checkpointed, True, timeout=300)
    check_relative_errors([{"checkpointed, backward inside": r[1]} for r in results], 2)
    for last in ("linear_attention", "full_attention"):
        for rank, (message, _) in enumerate(pools(2).run(_checkpointed, False, last, timeout=300)):
            assert "recomputed during backward outside its CP step's context" in message, (rank, message)
