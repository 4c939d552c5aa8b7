"""The mask hook's pieces: which mask functions are CP attention's plain pieces (the verified
families' causal, sliding windows, packed documents), what a layer's own causality and window
attend, which mask functions read block ids, which VLMs' masks read token types (a VLM selected
for CP is registered), and a VLM whose step lacks its token types refused on every rank, naming
them. The models whose masks are translated run end to end in ``test_mask_models.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import masking_utils as M  # noqa: E402

from cpshard.integrations.mask_translation import reads_block_ids  # noqa: E402
from cpshard.integrations.masks import layer_attends, mask_problem  # noqa: E402
from cpshard.masks import INF, MaskDescription  # noqa: E402


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


def test_what_a_layer_attends_and_which_masks_read_block_ids() -> None:
    docs = torch.tensor([[1, 1, 1, 0, 2, 2, 2, 2]])
    base = MaskDescription.within_documents
    assert layer_attends(base(docs, ahead=0), True, None)
    assert layer_attends(base(docs), False, None)
    assert layer_attends(base(docs, back=2, ahead=0), True, 3)
    # causal widened by True: bidirectional, the last query of each document stated causally
    assert layer_attends(base(docs, ahead=0).union(base(docs)), False, None)
    assert layer_attends(MaskDescription.chunks(docs, 1).intersect(base(docs, ahead=0)), True, 1)
    blocks = MaskDescription.blocks(docs, torch.tensor([[-1, 0, 0, -1, -1, 1, 1, -1]]))
    for d, causal, window in (
        (base(docs), True, None),  # a bidirectional mask on a causal layer
        (base(docs, ahead=0), False, None),
        (base(docs, back=2, ahead=0), True, None),  # the layer's window is not the mask's
        (MaskDescription.chunks(docs, 2), False, None),
        (MaskDescription.chunks(docs, 1), True, None),  # chunks of one on a layer with no window
        (base(docs, back=2, ahead=2), False, 3),
        (base(docs, ahead=0).union(blocks), True, None),
    ):
        assert not layer_attends(d, causal, window)
    ids = torch.zeros(1, 8, dtype=torch.long)
    blockwise = M.or_masks(M.causal_mask_function, M.blockwise_overlay(ids))
    assert reads_block_ids(M.and_masks(blockwise, M.sliding_window_overlay(3)))
    assert not reads_block_ids(M.sliding_window_causal_mask_function(3))


def test_what_a_layer_attends_agrees_with_the_dense_masks() -> None:
    """``layer_attends`` against brute force: the description's dense mask is the layer's
    (bidirectional, or causal with its window) on fuzzed documents and descriptions."""
    g = torch.Generator().manual_seed(0)
    base = MaskDescription.within_documents
    for trial in range(60):
        lengths = torch.randint(1, 7, (4,), generator=g).tolist()
        docs = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
        docs[0, torch.randint(0, docs.shape[1], (1,), generator=g)] = 0
        options = [
            base(docs, ahead=0), base(docs), base(docs, back=trial % 4, ahead=0),
            base(docs, back=trial % 3, ahead=trial % 2),
            MaskDescription.chunks(docs, 1 + trial % 3),
        ]  # fmt: skip
        a, b = (options[int(i)] for i in torch.randint(0, len(options), (2,), generator=g))
        d = a.union(b) if trial % 2 else a.intersect(b)
        if d is None:
            continue
        dense = d.dense()
        for causal, window in ((False, None), (True, None), *((True, w) for w in range(1, 5))):
            back = INF if window is None else window - 1
            layer = base(docs, back=back, ahead=0 if causal else INF)
            want = torch.equal(dense, layer.dense())
            assert layer_attends(d, causal, window) == want, (trial, causal, window, docs)


def test_vlms_whose_masks_read_token_types_are_detected() -> None:
    import transformers as T

    from cpshard.integrations.token_types import marked_rule, register_vlm, token_type_rule

    from cpshard.integrations import transformers as cp_transformers

    cp_transformers.register()
    # selecting "cpshard" registers a VLM: at set_attn_implementation, or when built with it
    selected = T.Gemma3ForConditionalGeneration(_gemma3_vlm_config())
    assert marked_rule(selected.config.text_config) is None
    selected.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    assert marked_rule(selected.model.language_model.config).key == "token_type_ids"
    config = _paligemma_config()
    config._attn_implementation = cp_transformers.ATTN_IMPLEMENTATION
    built = T.PaliGemmaForConditionalGeneration(config)
    assert marked_rule(built.model.language_model.config).family == "paligemma"
    gemma3 = T.Gemma3ForConditionalGeneration(_gemma3_vlm_config())
    pali = T.PaliGemmaForConditionalGeneration(_paligemma_config())
    assert register_vlm(gemma3) == "token_type_ids"
    assert register_vlm(pali) == "token_type_ids"
    rule = marked_rule(gemma3.model.language_model.config)
    assert rule is not None and rule.family == "gemma3"
    types = torch.tensor([[0, 1, 1, 0, 1, 0]])
    assert rule.block_ids(types).tolist() == [[-1, 0, 0, -1, 1, -1]]
    pali_rule = marked_rule(pali.model.language_model.config)
    assert pali_rule.block_ids(types).tolist() == [[0, -1, -1, 0, -1, 0]]
    # a text model (the same text config class as the VLM's), and a VLM whose mask reads none
    text = T.Gemma3ForCausalLM(T.Gemma3TextConfig(**_GEMMA3_TEXT))
    assert token_type_rule(text) is None and register_vlm(text) is None
    assert marked_rule(text.config) is None
    qwen = T.Qwen3VLForConditionalGeneration(  # mm_token_type_ids feed its positions only
        T.Qwen3VLConfig(
            text_config=dict(
                **_SMALL, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1]}
            ),
            vision_config=dict(
                depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0],
            ),
        )
    )  # fmt: skip
    assert token_type_rule(qwen) is None


_SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
)  # fmt: skip
_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=8, patch_size=4,
)  # fmt: skip


_GEMMA3_TEXT = dict(**_SMALL, sliding_window=3, layer_types=["sliding_attention", "full_attention"])


def _gemma3_vlm_config():
    import transformers as T

    return T.Gemma3Config(
        text_config=_GEMMA3_TEXT, vision_config=_VISION, mm_tokens_per_image=4,
        image_token_index=5,
    )  # fmt: skip


def _paligemma_config():
    import transformers as T

    return T.PaliGemmaConfig(
        text_config=dict(model_type="gemma", **_SMALL), vision_config=_VISION,
        projection_dim=32, image_token_index=5,
    )  # fmt: skip


def _refused_model(rank: int, world: int, family: str) -> tuple[str, bool]:
    """One CP step of ``family``'s tiny VLM on a packed row (two documents, image tokens or a
    prefix in its token types, given to the model but not to the sharder): the error each rank
    raises, and whether it computed."""
    import torch.distributed as dist
    import transformers as T

    from cpshard import make_cp_blockdiag_batch_and_ctx
    from cpshard.integrations import transformers as cp_transformers

    cp_transformers.register()
    torch.manual_seed(0)
    if family == "gemma3_vlm":
        model = T.Gemma3ForConditionalGeneration(_gemma3_vlm_config())
    else:
        model = T.PaliGemmaForConditionalGeneration(_paligemma_config())
    model = model.double()
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    doc = torch.tensor([[1] * 9 + [2] * 7])
    types = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0]])
    ctx, local = make_cp_blockdiag_batch_and_ctx(
        dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    length = local["input_ids"].shape[1]
    fields = {
        "input_ids": local["input_ids"],
        "position_ids": local["position_ids"],
        "token_type_ids": types[:, rank * length : (rank + 1) * length],
    }
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    with ctx():
        try:
            model(**fields, use_cache=False)
            return "no error", bool(calls)
        except ValueError as exc:
            return str(exc), bool(calls)


@pytest.mark.parametrize("family", ["gemma3_vlm", "paligemma"])
def test_vlms_without_the_steps_token_types_are_refused_on_every_rank(pools, family: str) -> None:
    """The token types given to the model but not to the sharder: the step lacks the row's."""
    results = pools(2).run(_refused_model, family, timeout=120)
    for rank, (message, computed) in enumerate(results):
        assert f"rank {rank}" in message and "no token_type_ids" in message, message
        assert not computed
