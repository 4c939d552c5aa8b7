"""transformers' mask functions translated into mask descriptions, exact against the models' own
masks: tiny random Llama 4 (chunked layers), Gemma 3 text with bidirectional attention, a Gemma
3 VLM with image tokens and a PaliGemma prefix-LM build their mask functions through their own
forward on fuzzed packed batches (documents, padding, images in some documents, spans at
document edges); the translation's dense mask equals each document's mask built by the model
from that document alone, and transformers' packed mask restricted to the documents where that
one reads every piece in document order. What cannot be translated gives None."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

import transformers as T  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers import masking_utils as M  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from cpshard.integrations.mask_translation import describe_transformers_mask  # noqa: E402
from tests.helpers import document_spans, per_document_positions  # noqa: E402

_CAPTURE = "cpshard_test_mask_capture"
_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=8, patch_size=4,
)  # fmt: skip
_TEXT = dict(
    vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=8,
)  # fmt: skip


@pytest.fixture(scope="module")
def captured() -> list:
    """The mask functions the models hand their mask builder, in call order: an attention
    implementation that is transformers' "sdpa" with a mask builder that records them."""
    calls: list = []

    def record(*args, **kwargs):
        calls.append(kwargs["mask_function"])
        return M.sdpa_mask(*args, **kwargs)

    AttentionInterface.register(_CAPTURE, sdpa_attention_forward)
    M.AttentionMaskInterface.register(_CAPTURE, record)
    return calls


def _llama4() -> torch.nn.Module:
    config = T.Llama4TextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, intermediate_size_mlp=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        attention_chunk_size=4, num_local_experts=2, num_experts_per_tok=1,
        no_rope_layers=[1, 0], interleave_moe_layer_step=1,
    )  # fmt: skip
    return T.Llama4TextModel(config)


def _gemma3_bidirectional() -> torch.nn.Module:
    config = T.Gemma3TextConfig(
        **_TEXT, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=True,
    )  # fmt: skip
    return T.Gemma3TextModel(config)


def _gemma3_vlm() -> torch.nn.Module:
    text = T.Gemma3TextConfig(
        **_TEXT, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
    )
    config = T.Gemma3Config(
        text_config=text.to_dict(), vision_config=_VISION, mm_tokens_per_image=4,
        image_token_index=5,
    )  # fmt: skip
    return T.Gemma3Model(config)


def _paligemma() -> torch.nn.Module:
    config = T.PaliGemmaConfig(
        text_config=dict(model_type="gemma", **_TEXT), vision_config=_VISION, projection_dim=16,
        image_token_index=5,
    )  # fmt: skip
    return T.PaliGemmaModel(config)


def _batch(rng: random.Random, rows: int, length: int, kind: str) -> tuple[torch.Tensor, ...]:
    """Documents ``[B, S]`` (0 = pad; one-token documents, padding first, between and last, an
    empty row sometimes) and token types: image spans (1) in some documents, at their edges
    too (``"images"``), or a prefix (0) then a suffix (1) per document (``"prefix"``)."""
    doc = torch.zeros(rows, length, dtype=torch.int64)
    types = torch.zeros(rows, length, dtype=torch.int64) + (kind == "prefix")
    for b in range(rows):
        if rng.random() < 0.2:
            continue  # an empty row
        pos, ident = rng.choice([0, 0, 2]), 1
        while pos < length:
            size = min(rng.choice([1, 3, 6, 9, 13]), length - pos)
            doc[b, pos : pos + size] = ident
            if kind == "images" and rng.random() < 0.7:
                for _ in range(rng.randint(1, 2)):
                    first = rng.randint(pos, pos + size - 1)
                    types[b, first : min(first + rng.randint(1, 4), pos + size)] = 1
            elif kind == "prefix":
                types[b, pos : pos + rng.randint(0, size)] = 0
            ident, pos = ident + 1, pos + size + rng.choice([0, 0, 0, 2])
    return doc, types


def _masks(model, captured: list, doc: torch.Tensor, types: torch.Tensor | None) -> list:
    """The model's mask functions for the batch (its forward builds them)."""
    captured.clear()
    kwargs = dict(position_ids=per_document_positions(doc), use_cache=False)
    rows, length = doc.shape
    if types is None:
        kwargs["input_ids"] = torch.ones(rows, length, dtype=torch.int64)
    else:
        kwargs.update(inputs_embeds=torch.randn(rows, length, 16), token_type_ids=types)
    with torch.no_grad():
        model(**kwargs)
    return list(captured)


def _dense(fn, rows: int, length: int) -> torch.Tensor:
    """transformers' own dense evaluation of a mask function: ``[B, S, S]``."""
    mask = M.sdpa_mask(
        batch_size=rows, q_length=length, kv_length=length, mask_function=fn,
        allow_is_causal_skip=False, use_vmap=True,
    )  # fmt: skip
    return mask[:, 0].expand(rows, length, length)


def _each_alone(model, captured: list, doc: torch.Tensor, types: torch.Tensor | None) -> list:
    """Per mask function of the model: every document's mask, built by the model from that
    document alone, placed on the block diagonal of ``[B, S, S]``."""
    rows, length = doc.shape
    out: list[torch.Tensor] = []
    for b, ds, de in document_spans(doc):
        alone = doc[b : b + 1, ds:de]
        part = None if types is None else types[b : b + 1, ds:de]
        fns = _masks(model, captured, alone, part)
        if not out:
            out = [torch.zeros(rows, length, length, dtype=torch.bool) for _ in fns]
        for dense, fn in zip(out, fns, strict=True):
            dense[b, ds:de, ds:de] = _dense(fn, 1, de - ds)[0]
    return out


MODELS = [
    # name, model, token types, the masks transformers' packed batch reads in document order
    ("llama4_chunked", _llama4, None, "all"),
    ("gemma3_bidirectional", _gemma3_bidirectional, None, "all"),
    # the sliding layers' mask reads the block ids at document positions in a packed batch
    ("gemma3_vlm_images", _gemma3_vlm, "images", "first"),
    ("paligemma_prefix", _paligemma, "prefix", "all"),
]


@pytest.mark.parametrize("name,make,kind,packed", MODELS, ids=[m[0] for m in MODELS])
def test_translation_equals_each_document_alone(name, make, kind, packed, captured) -> None:
    torch.manual_seed(0)
    model = make().eval()
    model.set_attn_implementation(_CAPTURE)
    rng = random.Random(name)
    for rows, length in ((2, 23), (1, 1), (3, 17)):
        doc, types = _batch(rng, rows, length, kind or "none")
        types = types if kind else None
        fns = _masks(model, captured, doc, types)
        references = _each_alone(model, captured, doc, types)
        assert fns and len(references) in (0, len(fns))
        same_doc = (doc[:, :, None] == doc[:, None, :]) & (doc != 0)[:, :, None]
        for i, fn in enumerate(fns):
            described = describe_transformers_mask(fn, doc)
            assert described is not None, f"{name}: mask {i} not translated"
            got = described.dense()
            if references:
                assert torch.equal(got, references[i]), f"{name}: mask {i}"
            else:
                assert not bool(got.any())  # no documents
            if packed == "all" or i == 0:
                assert torch.equal(got, _dense(fn, rows, length) & same_doc), f"{name}: {i}"


def test_block_ids_from_the_batch_and_from_a_shard(captured) -> None:
    torch.manual_seed(0)
    model = _gemma3_vlm().eval()
    model.set_attn_implementation(_CAPTURE)
    doc, types = _batch(random.Random(5), 2, 20, "images")
    fns = _masks(model, captured, doc, types)
    ids = T.models.gemma3.modeling_gemma3.get_block_sequence_ids_for_mask(types)
    for fn in fns:
        read = describe_transformers_mask(fn, doc)
        given = describe_transformers_mask(fn, doc, block_ids=ids)
        assert read is not None and given is not None
        assert torch.equal(read.dense(), given.dense())
    # a shard's mask function holds the shard's block ids: not the batch's, refused
    shard = _masks(model, captured, doc[:, :10], types[:, :10])
    assert all(describe_transformers_mask(fn, doc) is None for fn in shard)
    assert all(describe_transformers_mask(fn, doc, block_ids=ids) is not None for fn in shard)


def test_untranslatable_masks_give_none() -> None:
    doc = torch.tensor([[1, 1, 1, 1, 2, 2, 0, 0]])
    causal = M.causal_mask_function
    split_prefix = torch.tensor([[0, -1, 0, -1, -1, -1, -1, -1]])  # a prefix with a hole
    split_packing = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]])
    for fn in (
        lambda b, h, q, k: k <= q,  # a user's function
        M.or_masks(causal, lambda b, h, q, k: k == 0),
        M.and_masks(causal, M.sliding_window_overlay(0)),  # a window without the query
        M.or_masks(causal, M.blockwise_overlay(split_prefix)),
        M.or_masks(causal, M.blockwise_overlay(torch.zeros(1, 4, dtype=torch.int64))),  # a shard's
        # packed sequences that split a document, padding inside one
        M.and_masks(causal, M.packed_sequence_mask_function(split_packing)),
        M.and_masks(causal, M.padding_mask_function(torch.tensor([[1, 1, 0, 1, 1, 1, 0, 0]]) > 0)),
    ):
        assert describe_transformers_mask(fn, doc) is None
    with pytest.raises(ValueError, match="block_ids"):
        describe_transformers_mask(causal, doc, block_ids=split_prefix[:, :4])
    # what says nothing more than the documents is translated
    causal_dense = describe_transformers_mask(None, doc).dense()
    packed = M.packed_sequence_mask_function(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]]))
    valid = M.padding_mask_function(torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]]) > 0)
    for fn in (causal, M.and_masks(causal, packed), M.and_masks(causal, valid)):
        assert torch.equal(describe_transformers_mask(fn, doc).dense(), causal_dense)


def test_transformers_compositions_equal_their_dense_masks() -> None:
    doc = torch.tensor([[1] * 7 + [0] + [2] * 5, [0] + [3] * 10 + [4] * 2])
    ids = torch.tensor([[-1] * 4 + [0] * 3 + [-1, 1, 1, -1, -1, 2], [-1] * 6 + [3] * 4 + [-1] * 3])
    causal = M.causal_mask_function
    same_doc = (doc[:, :, None] == doc[:, None, :]) & (doc != 0)[:, :, None]
    for fn in (
        M.bidirectional_mask_function,
        M.sliding_window_causal_mask_function(3),
        M.sliding_window_bidirectional_mask_function(2),
        M.or_masks(M.sliding_window_causal_mask_function(2), M.blockwise_overlay(ids)),
        M.and_masks(M.or_masks(causal, M.blockwise_overlay(ids)), M.sliding_window_overlay(2)),
        M.or_masks(causal, T.models.gemma3.modeling_gemma3._bidirectional_window_overlay(3)),
    ):
        described = describe_transformers_mask(fn, doc)
        assert described is not None
        assert torch.equal(described.dense(), _dense(fn, *doc.shape) & same_doc)
