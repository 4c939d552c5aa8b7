"""Models whose layers mix tokens outside attention in a way cpshard does not shard (Mamba) are
refused under a CP context, on every rank and before any result, with the module named; outside
CP they run as before: a refusal, never a silently wrong step. (Gated DeltaNet hybrids and Mamba2
models run under CP: tests/integrations/test_hybrid_models.py, test_mamba2_models.py.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from cpshard.integrations import transformers as cp_transformers  # noqa: E402


def _hybrid(name: str) -> torch.nn.Module:
    import transformers as T

    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    linear = dict(linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                  linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])  # fmt: skip
    ssm = dict(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4)
    if name == "qwen3_next":
        config = T.Qwen3NextConfig(
            **text, **linear, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, experts_implementation="eager",
        )
    elif name == "qwen3_5":
        config = T.Qwen3_5TextConfig(**text, **linear)
    elif name == "mamba":
        config = T.MambaConfig(**ssm)
    elif name == "mamba2":
        config = T.Mamba2Config(**ssm, num_heads=4, head_dim=16, n_groups=1)
    else:
        raise AssertionError(name)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.float64)
    cp_transformers.register()
    if name.startswith("qwen"):
        model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


HYBRIDS = {  # model -> the module its refusal names
    "mamba": "backbone.layers.0.mixer",
}


def _refused(rank: int, world: int, name: str, layout: str) -> tuple[str, bool]:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    model = _hybrid(name)
    doc = torch.tensor([[1] * 7 + [2] * 5 + [0] * 2 + [3] * 6])
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    if layout == "blockdiag":
        ctx, local = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    else:
        ctx, local = ContextParallelSharder(dist.group.WORLD, layout).shard(batch)
    calls = []
    hook = model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        with ctx():
            model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    hook.remove()
    outside = model(input_ids=doc).logits  # outside CP the model runs unchanged
    return message, not calls and bool(torch.isfinite(outside).all())


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_models_are_refused_on_every_rank(pools, name: str) -> None:
    for layout in ("blockdiag", "balanced"):
        for rank, (message, clean) in enumerate(pools(2).run(_refused, name, layout, timeout=120)):
            assert f"rank {rank}" in message and repr(HYBRIDS[name]) in message, (layout, message)
            assert "train wrong" in message, message
            assert clean, f"{name} {layout}: the model computed under CP before the refusal"
