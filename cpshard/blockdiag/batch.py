"""Pad, slice and set up block-diagonal CP for one training step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager

import torch

from cpshard import ops
from cpshard.attention.tokens import register_tokens
from cpshard.batch_padding import IGNORE_INDEX, pad_sequence, sequence_dim
from cpshard.blockdiag.state import BlockDiagState, Segment, activated
from cpshard.comm import GroupLike, resolve_group
from cpshard.consensus import agree, digest
from cpshard.documents import DocumentError, document_positions, read_documents
from cpshard.targets import CONSUMED_KEYS, BatchTargets, ShardedBatch, shift_targets


def _segments(doc: torch.Tensor, start: int, end: int) -> list[Segment]:
    seg = ops.document_segments(doc, start, end)
    return [Segment(*map(int, row)) for row in zip(seg.row.tolist(), seg.begin.tolist(), seg.length.tolist(), seg.doc_start.tolist())]


def _halo(segments: list[Segment], start: int) -> int:
    """How far before ``start`` the documents of a rank's first tokens reach (max over rows)."""
    return max((start - s.doc_start for s in segments if s.begin == start), default=0)


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh: GroupLike,
    tp_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    *,
    shift_labels: bool = True,
) -> tuple[Callable[[], ContextManager[None]], ShardedBatch]:
    """Shard a batch sequentially for block-diagonal (per-document) CP attention.

    Reads the documents (:func:`cpshard.documents.read_documents`: ``_packed_seq_ids``,
    ``seq_idx``, ``cu_seqlens``, masks, ``position_ids`` restarts; contradictions raise on every
    rank), creates per-document ``position_ids`` when the batch has none, shifts ``labels`` (and
    ``loss_mask``, which overrides the batch's) once over the whole sequence unless
    ``shift_labels=False``, pads the sequence to a multiple of the CP size and slices every
    sequence-aligned tensor to this rank's contiguous chunk (differentiably for
    ``inputs_embeds``). Returns ``(train_ctx, batch)``: a new
    :class:`~cpshard.targets.ShardedBatch` holding what the model's forward takes, with labels,
    the labelled-token count, ``loss_mask``, ``padding_mask`` (True = pad) and document ids in
    ``batch.targets`` (:mod:`cpshard.targets`); the caller's batch is not modified. Entering
    ``train_ctx()`` makes :func:`cp_blockdiag_sdpa` attend causally within each document across
    the CP group. ``tp_mesh`` is accepted for signature compatibility and unused. Batch size > 1
    is supported. The batch's ``position_ids`` are registered as this step's tokens: CP attention
    given them (:mod:`cpshard.attention.tokens`) raises under another context or outside any.
    """
    what = "cpshard.make_cp_blockdiag_batch_and_ctx"
    g = resolve_group(cp_mesh, what)
    ref = batch.get("inputs_embeds", batch.get("input_ids")) if isinstance(batch, dict) else None
    labels = batch.get("labels") if isinstance(batch, dict) else None
    mask = batch.get("loss_mask") if loss_mask is None and isinstance(batch, dict) else loss_mask
    problem = None
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
        problem = "batch needs inputs_embeds [B, S, H] or input_ids [B, S]"
    elif any(
        t is not None
        and (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape[:2]))
        for t in (labels, mask)
    ):
        problem = f"labels and loss_mask must be [B, S] tensors matching {tuple(ref.shape[:2])}"
    elif not isinstance(shift_labels, bool):
        problem = f"shift_labels must be a bool, got {type(shift_labels).__name__}"
    if problem is None:
        try:
            doc, pad = read_documents(batch, ref.shape[0], ref.shape[1])
        except DocumentError as e:
            problem = str(e)
    if problem is not None:
        agree(g, what, problem)
    bsz, seq = ref.shape[0], ref.shape[1]
    world, rank = g.world, g.rank
    padded = -(-seq // world) * world
    local = padded // world
    start = rank * local
    doc = pad_sequence("_packed_seq_ids", doc, 1, padded)  # the step's host copy
    agree(g, what, None, {"[B, S]": [bsz, seq], "document ids": digest(doc)})

    def take(key: str, value: Any, length: int = seq) -> Any:
        dim = sequence_dim(key, value, bsz, length)
        if dim is None:
            return value
        return pad_sequence(key, value, dim, padded, padding_token_id).narrow(dim, start, local)

    if shift_labels:
        labels, mask = shift_targets(labels, mask, doc[:, :seq])
    positions = batch.get("position_ids")
    if positions is None:
        positions = document_positions(doc[:, :seq]).to(ref.device)
    out = {key: take(key, value) for key, value in batch.items() if key not in CONSUMED_KEYS}
    out["position_ids"] = take("position_ids", positions)
    targets = BatchTargets(
        labels=take("labels", labels),
        num_labelled=None if labels is None else (labels != IGNORE_INDEX).sum(),
        loss_mask=take("loss_mask", mask),
        padding_mask=take("padding_mask", pad.to(ref.device)),
        document_ids=doc.narrow(1, start, local).to(ref.device),
    )

    segments = [_segments(doc, r * local, (r + 1) * local) for r in range(world)]
    state = BlockDiagState(
        group=g,
        start=start,
        local_len=local,
        batch_size=bsz,
        reach=max((s.begin + s.length - s.doc_start for ss in segments for s in ss), default=0),
        halos=tuple(_halo(segments[r], r * local) for r in range(world)),
        segments=tuple(segments[rank]),
    )
    state.place_on(ref.device)  # the attention's metadata on the batch's device, once per step
    register_tokens(out["position_ids"], state)  # attention checks whose tokens they are

    return lambda: activated(state), ShardedBatch(out, targets)
