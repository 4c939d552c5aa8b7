"""Models whose attention mask says more than CP attention implements (chunked attention,
``or_masks`` widening, custom mask functions) are refused under CP on every rank; the masks of
the verified families (causal, sliding windows, packed documents) pass."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as M  # noqa: E402

from cpshard.integrations.masks import mask_problem  # noqa: E402


def test_implemented_masks_pass_and_others_are_named() -> None:
    packed = M.and_masks(
        M.remap_positions_for_packed_sequence(M.causal_mask_function, torch.arange(4)[None]),
        M.packed_sequence_mask_function(torch.ones(1, 4, dtype=torch.long)),
    )
    for ok in (
        None,
        M.causal_mask_function,
        M.bidirectional_mask_function,
        M.sliding_window_causal_mask_function(4),
        M.and_masks(M.causal_mask_function, M.padding_mask_function(torch.ones(1, 4, dtype=torch.bool))),
        packed,
    ):
        assert mask_problem(ok) is None
    chunked = M.chunked_causal_mask_function(8, torch.zeros(1, dtype=torch.long))
    assert mask_problem(chunked) == "chunked_overlay.<locals>.inner_mask"
    widened = M.or_masks(M.causal_mask_function, M.bidirectional_mask_function)
    assert mask_problem(widened) == "or_masks.<locals>.or_mask"
    assert mask_problem(M.and_masks(M.causal_mask_function, widened)) == "or_masks.<locals>.or_mask"
    assert mask_problem(lambda b, h, q, k: q >= k) == "test_implemented_masks_pass_and_others_are_named.<locals>.<lambda>"


def _chunked_model(rank: int, world: int) -> tuple[str, bool]:
    import torch.distributed as dist
    import transformers as T

    from cpshard import make_cp_blockdiag_batch_and_ctx
    from cpshard.integrations import transformers as cp_transformers

    cp_transformers.register()
    config = T.Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        attention_chunk_size=4, num_local_experts=2, num_experts_per_tok=1,
        max_position_embeddings=256, no_rope_layers=[1, 0], interleave_moe_layer_step=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(config).double()
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    doc = torch.tensor([[1] * 9 + [2] * 7])
    ctx, local = make_cp_blockdiag_batch_and_ctx(
        dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    calls = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    with ctx():
        try:
            model(input_ids=local["input_ids"], position_ids=local["position_ids"])
            return "no error", bool(calls)
        except ValueError as exc:
            return str(exc), bool(calls)


def test_chunked_attention_is_refused_on_every_rank(pools) -> None:
    for rank, (message, computed) in enumerate(pools(2).run(_chunked_model, timeout=120)):
        assert f"rank {rank}" in message and "chunked_overlay" in message, message
        assert not computed
