"""Models whose attention masks say more than causal / bidirectional / sliding windows, under CP:
Llama 4's chunked layers, Gemma 3 text with ``use_bidirectional_attention``, a Gemma 3 VLM's
image blocks and PaliGemma's prefix (both from ``token_type_ids``, through the VLM recipe of
``examples/cp_vlm.py``: image embeddings merged before sharding, the token types in the batch).

* every rank's mask hook translates the model's mask functions into the description the whole
  unsharded batch gives (:func:`describe_transformers_mask` of the mask functions the model
  builds for the whole padded row, outside CP), at W = 1-4, with an image span crossing a rank
  boundary;
* the VLM recipe without the token types, or with them but the language model run alone,
  raises on every rank naming ``token_type_ids`` and the rank;
* end to end (float64, each document alone through the same model as the reference, every
  layout and the block-diagonal batch at W = 2, subsets at W = 1, 3, 4): loss within 1e-9
  relative, every gradient within 1e-8 of the largest: each described layer passes its
  description to CP attention (``cpshard.cp_attention``'s ``mask=``), which executes it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

from cpshard.layouts import LAYOUTS  # noqa: E402
from tests.helpers import swapped  # noqa: E402
from tests.integrations.harness import (  # noqa: E402
    ROWS,
    Errors,
    ModelLogits,
    bind_norms,
    check_relative_errors,
    cp_decoder,
    relative_step_errors,
    step_errors,
)

IMAGE, TOKENS = 5, 4  # the image token id; tokens per image (mm_tokens_per_image, 4 patches)
# One packed row: per document ``(text, images, text)`` (PaliGemma: ``(prefix text, images,
# suffix text)``, its images first), an int: that many pads. The images sit at 3-6, 12-15 and
# 23-26 (Gemma 3): the second crosses the W = 2 contiguous boundary (15), the third W = 2
# head_tail's (21) and W = 4's (24); the third document has none.
ROW = [(3, 1, 2), -2, (1, 1, 1), (2, 0, 0), (4, 1, 2), -1]
# llama4_temperature: its layer without RoPE scales queries by their document position (floor
# scale 2: the scale changes every other token)
TEXT_FAMILIES = ("llama4", "llama4_temperature", "gemma3_bidirectional")
ALL_LAYOUTS = [*LAYOUTS, "blockdiag"]  # every sharder layout and the block-diagonal batch
VLM_FAMILIES = ("gemma3_vlm", "paligemma")
_SMALL = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
)  # fmt: skip
_GEMMA3_TEXT = dict(**_SMALL, sliding_window=3, layer_types=["sliding_attention", "full_attention"])
_VISION = dict(
    hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    image_size=8, patch_size=4,
)  # fmt: skip


def _gemma_norm(self, x: torch.Tensor) -> torch.Tensor:
    """Gemma's RMS norm in float64 (transformers' computes in float32)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _llama4_norm(self, x: torch.Tensor) -> torch.Tensor:
    """Llama 4's RMS norm in float64 (transformers' computes in float32)."""
    eps = self.eps if hasattr(self, "eps") else self.variance_epsilon  # renamed in 5.25
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _model(family: str) -> torch.nn.Module:
    """``family``'s tiny model, seeded, float64 (norms too), with the ``"cpshard"`` attention
    (which registers the VLMs' token-type rules)."""
    import transformers as T

    from cpshard.integrations import transformers as cp_transformers
    from cpshard.integrations.token_types import marked_rule

    cp_transformers.register()
    torch.manual_seed(0)
    if family.startswith("llama4"):  # layer 0 chunked (chunks of 4), layer 1 full without RoPE
        tuned = family == "llama4_temperature"
        config = T.Llama4TextConfig(
            **_SMALL, intermediate_size_mlp=64, attention_chunk_size=4, num_local_experts=2,
            num_experts_per_tok=1, max_position_embeddings=256, no_rope_layers=[1, 0],
            interleave_moe_layer_step=1, use_qk_norm=False, attn_temperature_tuning=tuned,
            floor_scale=2, attn_scale=0.5,
        )  # fmt: skip
        model, norm = T.Llama4ForCausalLM(config), _llama4_norm
    elif family.startswith("gemma3_bidirectional"):
        text = dict(_GEMMA3_TEXT, use_bidirectional_attention=True)
        if family.endswith("_full"):  # full layers only: causal widened by True
            text["layer_types"] = ["full_attention", "full_attention"]
        model, norm = T.Gemma3ForCausalLM(T.Gemma3TextConfig(**text)), _gemma_norm
    elif family == "gemma3_vlm":
        config = T.Gemma3Config(
            text_config=_GEMMA3_TEXT, vision_config=_VISION, mm_tokens_per_image=TOKENS,
            image_token_index=IMAGE,
        )  # fmt: skip
        model, norm = T.Gemma3ForConditionalGeneration(config), _gemma_norm
    else:
        config = T.PaliGemmaConfig(
            text_config=dict(model_type="gemma", **_SMALL), vision_config=_VISION,
            projection_dim=32, image_token_index=IMAGE,
        )  # fmt: skip
        model, norm = T.PaliGemmaForConditionalGeneration(config), _gemma_norm
    model = model.to(torch.float64)
    bind_norms(model, {"RMSNorm": norm})
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    if family in VLM_FAMILIES:  # registered by selecting "cpshard", with no call of its own
        rule = marked_rule(model.model.language_model.config)
        assert rule is not None and rule.key == "token_type_ids"
    return model


# ------------------------------------------------------------------ the VLM batch and recipe


def _vlm_batch(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """The packed row :data:`ROW`: ``input_ids`` (text ids 6.., ``IMAGE`` on image tokens),
    ``token_type_ids`` (Gemma 3: 1 on image tokens; PaliGemma: 0 on the prefix, 1 on the
    suffix), unshifted labels, ``_packed_seq_ids`` and ``pixel_values`` of every image in
    order."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    types: list[int] = []
    docs: list[int] = []
    images = 0
    for n, entry in enumerate(ROW):
        if isinstance(entry, int):
            ids, types, docs = ids + [0] * -entry, types + [0] * -entry, docs + [0] * -entry
            continue
        before, count, after = entry
        text = lambda k: torch.randint(6, 64, (k,), generator=g).tolist()  # noqa: E731
        image = [IMAGE] * TOKENS * count
        if family == "paligemma":  # prefix = images and prompt, suffix = the answer
            part = image + text(before) + text(after)
            kind = [0] * (len(image) + before) + [1] * after
        else:
            part = text(before) + image + text(after)
            kind = [0] * before + [1] * len(image) + [0] * after
        ids, types, docs = ids + part, types + kind, docs + [n + 1] * len(part)
        images += count
    input_ids = torch.tensor([ids])
    doc = torch.tensor([docs])
    return {
        "input_ids": input_ids,
        "token_type_ids": torch.tensor([types]),
        "labels": torch.where(doc == 0, cp_decoder.IGNORE, input_ids),
        "_packed_seq_ids": doc,
        "pixel_values": torch.randn(images, 3, 8, 8, generator=g, dtype=torch.float64),
    }


def _merged(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], types: bool = True
) -> dict[str, Any]:
    """The recipe's inputs for the whole row, before sharding: the image embeddings (the
    model's own ``get_image_features``) scattered into the token embeddings, labels, document
    ids and (``types``) the token types."""
    vlm = model.model
    embeds = vlm.get_input_embeddings()(batch["input_ids"])
    features = vlm.get_image_features(batch["pixel_values"], return_dict=True).pooler_output
    mask = (batch["input_ids"] == IMAGE)[..., None].expand_as(embeds)
    merged = {
        "inputs_embeds": embeds.masked_scatter(mask, features.reshape(-1, embeds.shape[-1])),
        "labels": batch["labels"],
        "_packed_seq_ids": batch["_packed_seq_ids"],
    }
    if types:
        merged["token_type_ids"] = batch["token_type_ids"]
    return merged


def _recipe_logits(family: str, model: torch.nn.Module) -> Callable[[dict[str, Any]], torch.Tensor]:
    """The recipe's decoder on a rank's shard (``examples/cp_vlm.py``'s ``decoder_logits``);
    PaliGemma counts positions from 1 (its own forward's default)."""
    import cp_vlm  # examples/, on the path through the harness

    offset = 1 if family == "paligemma" else 0

    def forward(local: dict[str, Any]) -> torch.Tensor:
        positions = local["position_ids"] + offset
        return cp_vlm.decoder_logits(model, dict(local, position_ids=positions))

    return forward


def _vlm_documents(batch: dict[str, torch.Tensor]) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """Each document alone as the full VLM's inputs (its ids, token types and images)."""
    targets = cp_decoder.shifted_labels(batch["input_ids"], batch["_packed_seq_ids"])
    out, image = [], 0
    for s, e in cp_decoder.runs(batch["_packed_seq_ids"][0]):
        ids = batch["input_ids"][:, s:e]
        n = int((ids == IMAGE).sum()) // TOKENS
        inputs = {"input_ids": ids, "token_type_ids": batch["token_type_ids"][:, s:e]}
        if n:
            inputs["pixel_values"] = batch["pixel_values"][image : image + n]
        image += n
        out.append((inputs, targets[0, s:e]))
    return out


# ------------------------------------------------------------------ each rank's descriptions


def _shard(batch: dict[str, Any], layout: str):
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    if layout == "blockdiag":
        return make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    return ContextParallelSharder(dist.group.WORLD, layout).shard(batch)


def _same(a: Any, b: Any) -> bool:
    """Two mask descriptions (or two Nones) alike, field by field."""
    if a is None or b is None:
        return a is b
    fields = ("row", "start", "end", "doc_start", "doc_end", "lo", "back", "hi", "ahead")
    return (a.rows, a.length) == (b.rows, b.length) and all(
        torch.equal(getattr(a, f), getattr(b, f)) for f in fields
    )


def _whole_batch_descriptions(family: str, model: torch.nn.Module, padded: int) -> list[Any]:
    """The descriptions of the mask functions the model builds for the whole row padded to
    ``padded`` positions, outside CP (None: a mask of plain pieces)."""
    import transformers.masking_utils as M

    from cpshard.integrations.mask_translation import describe_transformers_mask
    from cpshard.integrations.masks import mask_problem

    if family in VLM_FAMILIES:
        batch = _vlm_batch(family)
    else:
        batch = cp_decoder.packed_batch(ROWS, 64, seed=1)
    pad = padded - batch["input_ids"].shape[1]
    grow = lambda t: torch.nn.functional.pad(t, (0, pad))  # noqa: E731
    documents = grow(batch["_packed_seq_ids"])
    functions: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        functions.append(kwargs["mask_function"])
        return real(*args, **kwargs)

    real = M.sdpa_mask
    inputs = {"input_ids": grow(batch["input_ids"])}
    if family in VLM_FAMILIES:
        inputs["token_type_ids"] = grow(batch["token_type_ids"])
    with swapped("transformers.masking_utils", "sdpa_mask", record), torch.no_grad():
        (model.model if family in VLM_FAMILIES else model)(**inputs, use_cache=False)
    return [
        None if mask_problem(fn) is None else describe_transformers_mask(fn, documents)
        for fn in functions
    ]


def _step_descriptions(family: str, model: torch.nn.Module, layout: str) -> tuple[list[Any], int]:
    """The descriptions this rank's mask hook builds in one CP forward (the recipe for the
    VLMs), and the step's padded length."""
    from cpshard.attention import active_state
    from cpshard.integrations import transformers as cp_transformers

    built: list[Any] = []
    real_mask = cp_transformers.step_mask

    def record(*args: Any, **kwargs: Any) -> Any:
        built.append(real_mask(*args, **kwargs))
        return built[-1]

    if family in VLM_FAMILIES:
        batch = _vlm_batch(family)
        local_batch, forward = _merged(model, batch), _recipe_logits(family, model)
    else:
        local_batch = cp_decoder.packed_batch(ROWS, 64, seed=1)
        logits = ModelLogits(model)
        forward = lambda local: logits(local["input_ids"], local["position_ids"])  # noqa: E731
    ctx, local = _shard(local_batch, layout)
    with (
        swapped("cpshard.integrations.transformers", "step_mask", record),
        ctx(),
        torch.no_grad(),
    ):
        forward(local)
        padded = active_state().documents.shape[1]
    return built, padded


def _description_mismatches(rank: int, world: int, layouts: list[str]) -> list[str]:
    bad = []
    for family in (*TEXT_FAMILIES, *VLM_FAMILIES):
        for layout in layouts:
            model = _model(family)
            built, padded = _step_descriptions(family, model, layout)
            want = _whole_batch_descriptions(family, model, padded)
            where = f"rank {rank} W={world} {family} {layout}"
            got = [None if b is None else b.description for b in built[: len(want)]]
            if len(built) < len(want) or not all(map(_same, got, want)):
                bad.append(f"{where}: {len(built)} masks built, {len(want)} wanted, or they differ")
            if all(w is None for w in want):
                bad.append(f"{where}: the whole batch's masks are plain: nothing was tested")
    return bad


@pytest.mark.parametrize(
    "world,layouts",
    [
        (1, ["contiguous"]),
        (2, ALL_LAYOUTS),
        (3, ["head_tail", "blockdiag"]),
        (4, ["balanced"]),
    ],
)
def test_every_ranks_mask_is_the_whole_batchs(pools, world: int, layouts: list[str]) -> None:
    bad = [m for r in pools(world).run(_description_mismatches, layouts, timeout=300) for m in r]
    assert not bad, bad[:8]


# ------------------------------------------------------------------ the recipe's refusals


def _recipe_error(rank: int, world: int, family: str, how: str) -> tuple[str, bool]:
    """One CP step of the VLM recipe: ``how`` = ``"no_types"`` (the batch without token types)
    or ``"language_model"`` (with them, the language model run alone): the error this rank
    raises, and whether the head ran."""
    model = _model(family)
    batch = _vlm_batch(family)
    ctx, local = _shard(_merged(model, batch, types=how != "no_types"), "head_tail")
    ran = []
    model.lm_head.register_forward_hook(lambda *_: ran.append(True))
    with ctx():
        try:
            if how == "language_model":
                hidden = model.model.language_model(
                    inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"],
                    use_cache=False,
                ).last_hidden_state  # fmt: skip
                model.lm_head(hidden)
            else:
                _recipe_logits(family, model)(local)
            return "no error", bool(ran)
        except ValueError as exc:
            return str(exc), bool(ran)


@pytest.mark.parametrize("family", VLM_FAMILIES)
@pytest.mark.parametrize("how", ["no_types", "language_model"])
def test_the_vlm_recipe_refuses_without_its_token_types(pools, family: str, how: str) -> None:
    family_type = "gemma3" if family == "gemma3_vlm" else "paligemma"
    for rank, (message, ran) in enumerate(pools(2).run(_recipe_error, family, how, timeout=120)):
        assert f"rank {rank}" in message and "token_type_ids" in message, message
        assert family_type in message and "causally" in message, message
        assert not ran


# ------------------------------------------------------------------ end to end


def _full_bidirectional(rank: int, world: int, layouts: list[str]) -> dict[str, Errors]:
    return {layout: _text_step("gemma3_bidirectional_full", layout) for layout in layouts}


@pytest.mark.parametrize(
    "world,layouts",
    [
        (1, ["blockdiag"]),
        (2, ALL_LAYOUTS),
        (3, ["head_tail"]),
        (4, ["blockdiag"]),
    ],
)
def test_bidirectional_full_layers_take_the_plain_path(
    pools, world: int, layouts: list[str]
) -> None:
    """Gemma 3 text with bidirectional attention and full layers only: its mask (causal widened
    by True) is translated, and each layer's own ``is_causal=False`` attends it (no description
    reaches CP attention)."""
    check_relative_errors(pools(world).run(_full_bidirectional, layouts, timeout=300), world)


def _text_step(family: str, layout: str) -> Errors:
    return step_errors(_model(family), layout, seed=len(family), logits=ModelLogits)


def _vlm_step(family: str, layout: str) -> Errors:
    """One CP step of the VLM recipe (each rank merges the whole row's images) against each
    document alone through the full VLM (its token types and images)."""
    group = dist.group.WORLD
    model = _model(family)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    batch = _vlm_batch(family, seed=2)
    merged = _merged(model, batch)
    cp = cp_decoder.cp_loss(group, merged, _recipe_logits(family, model), layout)
    ref = cp_decoder.reference_loss(reference, _vlm_documents(batch))
    cp_decoder.reference_backward(ref, reference, dist.get_world_size(group))
    return relative_step_errors(model, reference, cp, ref, group)


def _end_to_end(rank: int, world: int, layouts: list[str]) -> dict[str, Errors]:
    out = {}
    for layout in layouts:
        for family in TEXT_FAMILIES:
            out[f"{family} {layout}"] = _text_step(family, layout)
        for family in VLM_FAMILIES:
            out[f"{family} {layout}"] = _vlm_step(family, layout)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_mask_models_match_each_document_alone(pools, world: int) -> None:
    """Every model, every layout and the block-diagonal batch, W = 1-4."""
    check_relative_errors(pools(world).run(_end_to_end, ALL_LAYOUTS, timeout=600), world)
