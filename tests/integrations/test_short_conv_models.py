"""Short-convolution hybrids through transformers under CP: LFM2 and LFM2-MoE (gated causal
depthwise convolutions mixed with full attention), tiny random configs, float64, one packed row
of documents longer than the convolution with interior padding: every layout that keeps
documents in few pieces per rank and the block-diagonal batch at W = 2, one or two at W = 1, 3
and 4 (LFM2-MoE at W = 2); ``stripe`` refused on every rank before the model's head.

The reference runs each document alone through a copy of the model with plain SDPA attention and
transformers' own convolution (float64 throughout). RMS norms are their float64 statements
(transformers' compute in float32). Bounds: loss relative error < 1e-9, every gradient within
1e-8 of the largest."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

from tests.helpers import EXAMPLES, check_relative_errors, float64_rms, relative_step_errors

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402

from cpshard.integrations import transformers as cp_transformers  # noqa: E402

ROWS = [[9, -2, 6, 3, -1, 7, -1]]  # documents of 9, 6, 3, 7 tokens; the convolution spans 3
LAYOUTS = ["contiguous", "head_tail", "per_document_head_tail", "balanced", "blockdiag"]
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


def _model(family: str) -> torch.nn.Module:
    import transformers

    cp_transformers.register()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).to(torch.float64)
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = float64_rms.__get__(module)
        if isinstance(module, torch.nn.Conv1d):  # taps large enough to carry far
            with torch.no_grad():
                module.weight.normal_()
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def _step(family: str, layout: str, group) -> tuple[float, float, float]:
    model = _model(family)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    batch = cp_decoder.packed_batch(ROWS, model.config.vocab_size, seed=len(family))

    def forward(local: dict[str, torch.Tensor]) -> torch.Tensor:
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
        return out.logits

    cp = cp_decoder.cp_loss(group, batch, forward, layout)
    ref = cp_decoder.reference_loss(reference, cp_decoder.text_documents(batch))
    cp_decoder.reference_backward(ref, reference, dist.get_world_size(group))
    return relative_step_errors(model, reference, cp, ref, group)


def _cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {
        f"{family} {layout}": _step(family, layout, dist.group.WORLD)
        for family, layouts in GRID[world]
        for layout in layouts
    }


@pytest.mark.parametrize("world", sorted(GRID))
def test_short_conv_models_match_each_document_alone(pools, world: int) -> None:
    check_relative_errors(pools(world).run(_cases, timeout=900), world)


def _stripe(rank: int, world: int) -> str:
    import cpshard

    model = _model("lfm2")
    ran = []
    model.lm_head.register_forward_hook(lambda *a: ran.append(True))
    batch = cp_decoder.packed_batch(ROWS, model.config.vocab_size, seed=1)
    ctx, local = cpshard.ContextParallelSharder(dist.group.WORLD, "stripe").shard(batch)
    with ctx():
        try:
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
        except ValueError as exc:
            return str(exc) + (" (model computed)" if ran else "")
    return "no error"


def test_stripe_is_refused_on_every_rank(pools) -> None:
    for rank, message in enumerate(pools(2).run(_stripe, timeout=300)):
        assert f"rank {rank}" in message and "'stripe'" in message, message
        assert "model computed" not in message, message
