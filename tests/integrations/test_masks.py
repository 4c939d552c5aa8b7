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


_SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
)  # fmt: skip
_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=8, patch_size=4,
)  # fmt: skip


def _refused_model(rank: int, world: int, family: str) -> tuple[str, bool]:
    """One CP step of ``family``'s tiny model on a packed row (two documents, image tokens or a
    prefix in the VLMs' token types): the error each rank raises, and whether it computed."""
    import torch.distributed as dist
    import transformers as T

    from cpshard import make_cp_blockdiag_batch_and_ctx
    from cpshard.integrations import transformers as cp_transformers

    cp_transformers.register()
    torch.manual_seed(0)
    gemma3_text = dict(**_SMALL, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    if family == "llama4":
        config = T.Llama4TextConfig(
            **_SMALL, intermediate_size_mlp=64,
            attention_chunk_size=4, num_local_experts=2, num_experts_per_tok=1,
            max_position_embeddings=256, no_rope_layers=[1, 0], interleave_moe_layer_step=1,
        )  # fmt: skip
        model = T.Llama4ForCausalLM(config)
    elif family == "gemma3_bidirectional":
        config = T.Gemma3TextConfig(**gemma3_text, use_bidirectional_attention=True)
        model = T.Gemma3ForCausalLM(config)
    elif family == "gemma3_vlm":
        config = T.Gemma3Config(
            text_config=gemma3_text, vision_config=_VISION, mm_tokens_per_image=4,
            image_token_index=5,
        )  # fmt: skip
        model = T.Gemma3ForConditionalGeneration(config)
    else:
        config = T.PaliGemmaConfig(
            text_config=dict(model_type="gemma", **_SMALL), vision_config=_VISION,
            projection_dim=32, image_token_index=5,
        )  # fmt: skip
        model = T.PaliGemmaForConditionalGeneration(config)
    model = model.double()
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    doc = torch.tensor([[1] * 9 + [2] * 7])
    types = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0]])
    ctx, local = make_cp_blockdiag_batch_and_ctx(
        dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    fields = {"input_ids": local["input_ids"], "position_ids": local["position_ids"]}
    if family in ("gemma3_vlm", "paligemma"):
        length = local["input_ids"].shape[1]
        fields["token_type_ids"] = types[:, rank * length : (rank + 1) * length]
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with ctx():
        try:
            model(**fields, use_cache=False)
            return "no error", bool(calls)
        except ValueError as exc:
            return str(exc), bool(calls)


@pytest.mark.parametrize(
    "family,piece",
    [
        ("llama4", "chunked_overlay"),  # chunked attention
        ("gemma3_bidirectional", "or_mask"),  # causal widened to bidirectional
        ("gemma3_vlm", "or_mask"),  # bidirectional image blocks from the token types
        ("paligemma", "or_mask"),  # a bidirectional prefix from the token types
    ],
)
def test_masks_cp_attention_does_not_plan_from_are_refused_on_every_rank(
    pools, family: str, piece: str
) -> None:
    results = pools(2).run(_refused_model, family, timeout=120)
    for rank, (message, computed) in enumerate(results):
        assert f"rank {rank}" in message and piece in message, message
        assert not computed
