"""A complete context-parallel training step of a tiny Qwen3-VL (vision tower + decoder), on CPU.

    python examples/cp_vlm.py [--world 2]

Spawns ``--world`` gloo ranks. Each builds the same tiny random Qwen3-VL (float64) and the same
packed batch (documents with images, interior and trailing padding). The step:

1. the vision tower, wrapped once by :func:`cpshard.integrations.transformers.wrap_vision_tower`,
   runs on this rank's frames only inside :func:`cpshard.cp_vision_group`, and every rank gets
   all image embeddings (``get_image_features`` is the model's own);
2. the full sequence's ``inputs_embeds`` (image embeddings scattered in), its deepstack
   features (as dense ``[B, S, D]`` tensors), per-document mRoPE ``position_ids``
   ``[3, B, S]`` and the batch's token types are built BEFORE sharding: a shard of
   ``input_ids`` holds only part of an image's tokens, so the model's own merge cannot run on
   it (the labels stay unshifted: cpshard shifts them once);
3. :func:`cpshard.make_cp_blockdiag_batch_and_ctx` shards all of it (differentiably) and keeps
   the rows' token types for the step, the decoder runs on this rank's tokens with the
   ``"cpshard"`` attention, and :func:`cpshard.cp_cross_entropy` /
   :func:`cpshard.reduce_cp_gradients` finish the step.

A VLM whose attention mask reads token types (Gemma 3's bidirectional image blocks,
PaliGemma's prefix: :func:`cpshard.integrations.transformers.register_vlm`, which
``wrap_vision_tower`` calls) runs its decoder through the VLM's own model with the shard's
token types (:func:`decoder_logits`), so that its mask function holds the blocks and the step
reads them for the whole row; a step without them raises on every rank instead of attending
the image tokens causally.

It prints the CP loss (averaged over ranks) beside the single-process loss (every document run on
its own through the unmodified model) and the largest parameter-gradient difference.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import cpshard
from cpshard.batch.token_types import TOKEN_TYPE_KEYS
from cpshard.integrations import transformers as cp_transformers

from cp_decoder import (
    IGNORE,
    compare,
    cp_loss,
    document_ids,
    reference_backward,
    reference_loss,
    run_example,
    runs,
    shifted_labels,
)

IMAGE, VIDEO, START, END = 60, 61, 62, 63
PATCH = 3 * 2 * 2  # channels * patch_size ** 2 (temporal patch 1)
# Per row, the documents: ``(text before, image grid (h, w) or None, text after)``; an int is
# that many padding tokens.
ROWS: list[list[Any]] = [
    [(3, (4, 4), 4), 2, (2, (4, 6), 3), (5, None, 0), 1],
    [(2, (6, 4), 2), (4, None, 0), 3, (1, (4, 4), 5)],
]


def tiny_vlm(seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen3-VL (float64) with the ``"cpshard"`` attention (text and vision)."""
    import transformers

    cp_transformers.register()
    config = transformers.Qwen3VLConfig(
        text_config=dict(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
        ),
        vision_config=dict(
            depth=2, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
            temporal_patch_size=1, spatial_merge_size=2, out_hidden_size=32,
            num_position_embeddings=16, deepstack_visual_indexes=[0],
        ),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3VLForConditionalGeneration(config).to(torch.float64)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def _document(spec: tuple[int, Any, int], g: torch.Generator) -> tuple[list[int], list[int], list[int] | None]:
    """One document's token ids, token types (1 = image) and image grid ``[1, h, w]``."""
    before, grid, after = spec
    text = lambda n: torch.randint(1, IMAGE, (n,), generator=g).tolist()  # noqa: E731
    ids, types = text(before), [0] * before
    if grid is not None:
        n = grid[0] * grid[1] // 4
        ids += [START] + [IMAGE] * n + [END]
        types += [0] + [1] * n + [0]
    ids += text(after)
    types += [0] * after
    return ids, types, None if grid is None else [1, *grid]


def vlm_batch(model: torch.nn.Module, rows: Sequence[Sequence[Any]] = ROWS, seed: int = 0) -> dict[str, Any]:
    """A packed VLM batch: ``input_ids``, ``_packed_seq_ids``, unshifted labels, per-document
    mRoPE ``position_ids`` ``[3, B, S]`` (the model's ``get_rope_index`` on each document),
    ``mm_token_type_ids``, and ``pixel_values`` / ``image_grid_thw`` for all images in order."""
    g = torch.Generator().manual_seed(seed)
    id_rows, type_rows, lengths, grids = [], [], [], []
    for row in rows:
        ids: list[int] = []
        types: list[int] = []
        spec: list[int] = []
        for entry in row:
            if isinstance(entry, int):
                ids, types, spec = ids + [0] * entry, types + [0] * entry, spec + [-entry]
                continue
            doc_ids, doc_types, grid = _document(entry, g)
            ids, types, spec = ids + doc_ids, types + doc_types, spec + [len(doc_ids)]
            if grid is not None:
                grids.append(grid)
        id_rows.append(ids)
        type_rows.append(types)
        lengths.append(spec)
    width = max(len(r) for r in id_rows)
    for ids, types, spec in zip(id_rows, type_rows, lengths):  # trailing padding to one length
        extra = width - len(ids)
        ids += [0] * extra
        types += [0] * extra
        if extra:
            spec.append(-extra)
    input_ids = torch.tensor(id_rows)
    doc = document_ids(lengths)
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    rows_px = int(grid_thw.prod(-1).sum())
    batch = {
        "input_ids": input_ids,
        "mm_token_type_ids": torch.tensor(type_rows),
        "labels": torch.where(doc == 0, IGNORE, input_ids),  # unshifted: cpshard shifts once
        "_packed_seq_ids": doc,
        "pixel_values": torch.randn(rows_px, PATCH, generator=g, dtype=torch.float64),
        "image_grid_thw": grid_thw,
    }
    batch["position_ids"] = _mrope_positions(model, batch)
    return batch


def _document_images(batch: dict[str, Any]) -> list[tuple[int, int, slice, slice]]:
    """Per document in row-major order: ``(row, start, end)`` with its image rows of
    ``image_grid_thw`` and its patch rows of ``pixel_values``."""
    grid = batch["image_grid_thw"]
    counts = (grid.prod(-1)).tolist()
    out, image, pixel = [], 0, 0
    for b in range(batch["input_ids"].shape[0]):
        for s, e in runs(batch["_packed_seq_ids"][b]):
            n = int((batch["input_ids"][b, s:e] == START).sum())
            rows = sum(counts[image : image + n])
            out.append((b, s, e, slice(image, image + n), slice(pixel, pixel + rows)))
            image, pixel = image + n, pixel + rows
    return out


def _doc_inputs(batch: dict[str, Any], b: int, s: int, e: int, images: slice, pixels: slice) -> dict[str, Any]:
    inputs = {
        "input_ids": batch["input_ids"][b : b + 1, s:e],
        "mm_token_type_ids": batch["mm_token_type_ids"][b : b + 1, s:e],
    }
    if images.stop > images.start:
        inputs["pixel_values"] = batch["pixel_values"][pixels]
        inputs["image_grid_thw"] = batch["image_grid_thw"][images]
    return inputs


def _mrope_positions(model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """``[3, B, S]`` mRoPE positions restarting in every document (0 on padding)."""
    ids = batch["input_ids"]
    pos = torch.zeros(3, *ids.shape, dtype=torch.int64)
    for b, s, e, images, pixels in _document_images(batch):
        inputs = _doc_inputs(batch, b, s, e, images, pixels)
        grid = inputs.get("image_grid_thw")
        pos[:, b, s:e] = model.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=grid
        )[0][:, 0]
    return pos


def vlm_documents(batch: dict[str, Any]) -> list[tuple[dict[str, Any], torch.Tensor]]:
    """The documents of a packed VLM batch as separate inputs of the unmodified model."""
    targets = shifted_labels(batch["input_ids"], batch["_packed_seq_ids"])
    return [
        (_doc_inputs(batch, b, s, e, images, pixels), targets[b, s:e])
        for b, s, e, images, pixels in _document_images(batch)
    ]


def _joined(features: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """Image features as one tensor: transformers returns them per image (a tuple) or, in older
    releases, already joined."""
    return features if isinstance(features, torch.Tensor) else torch.cat(tuple(features))


def merged_inputs(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, Any]:
    """The decoder's inputs for the FULL sequence, ready to shard: ``inputs_embeds`` with the
    image embeddings scattered in, the image-token mask and one dense ``[B, S, D]`` tensor per
    deepstack level (zeros off images; none for a model without them), plus positions, labels,
    document ids and the batch's token types (the step keeps them for a mask that reads them)."""
    vlm = model.model
    features = vlm.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
    mask = (batch["input_ids"] == IMAGE).unsqueeze(-1)
    embeds = vlm.get_input_embeddings()(batch["input_ids"])
    merged = {
        "inputs_embeds": embeds.masked_scatter(mask, _joined(features.pooler_output)),
        "visual_pos_masks": mask[..., 0],
        "position_ids": batch["position_ids"],
        "labels": batch["labels"],
        "_packed_seq_ids": batch["_packed_seq_ids"],
    }
    for k, level in enumerate(getattr(features, "deepstack_features", None) or []):
        merged[f"deepstack_{k}"] = torch.zeros_like(embeds).masked_scatter(mask, _joined(level))
    merged.update({k: batch[k] for k in TOKEN_TYPE_KEYS if k in batch})
    return merged


def decoder_logits(model: torch.nn.Module, local: dict[str, Any]) -> torch.Tensor:
    """The decoder and LM head on this rank's tokens of :func:`merged_inputs`. A VLM whose mask
    reads token types runs the VLM's model on the embeddings with the shard's token types (its
    own mask then holds the image blocks; without them the step raises on every rank)."""
    key = cp_transformers.register_vlm(model)
    if key is not None:
        hidden = model.model(
            inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"],
            use_cache=False, **{key: local.get(key)},
        ).last_hidden_state  # fmt: skip
        return model.lm_head(hidden)
    mask = local["visual_pos_masks"]
    levels = sorted(k for k in local if k.startswith("deepstack_"))
    deepstack = (  # models without deepstack levels (Qwen3.5) take no such arguments
        {"visual_pos_masks": mask, "deepstack_visual_embeds": [local[k][mask] for k in levels]}
        if levels
        else {"use_cache": False}
    )
    hidden = model.model.language_model(
        inputs_embeds=local["inputs_embeds"], position_ids=local["position_ids"], **deepstack
    ).last_hidden_state
    return model.lm_head(hidden)


def vlm_step(rank: int, world: int, rows: Sequence[Sequence[Any]] = ROWS,
             seed: int = 0) -> tuple[float, float, float]:
    """One CP step of the tiny VLM on this rank, and the single-process reference."""
    group = dist.group.WORLD
    model = tiny_vlm(seed)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    cp_transformers.wrap_vision_tower(model)
    batch = vlm_batch(model, rows, seed)
    config = cpshard.CpVisionFrameShardingConfig(
        enabled=True, min_tokens=1, min_frames=1, min_local_patch_rows=1
    )
    with cpshard.cp_vision_group(group, config=config):
        merged = merged_inputs(model, batch)
    cp = cp_loss(group, merged, lambda local: decoder_logits(model, local))
    ref = reference_loss(reference, vlm_documents(batch))
    reference_backward(ref, reference, world)
    return compare(model, reference, cp, ref, group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    run_example(vlm_step, parser.parse_args().world, "qwen3-vl")


if __name__ == "__main__":
    main()
