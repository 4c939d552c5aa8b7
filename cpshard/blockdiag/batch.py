"""Pad, slice and set up block-diagonal CP for one training step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ContextManager

import torch

from cpshard import ops
from cpshard.batch_padding import pad_sequence, sequence_dim
from cpshard.blockdiag.ids import document_ids
from cpshard.blockdiag.state import BlockDiagState, Segment, current
from cpshard.comm import GroupLike, resolve_group
from cpshard.consensus import agree, digest


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
) -> tuple[Callable[[], ContextManager[None]], dict[str, Any]]:
    """Shard a batch sequentially for block-diagonal (per-document) CP attention.

    Pads the sequence to a multiple of the CP size, slices every sequence-aligned tensor to this
    rank's contiguous chunk (differentiably for ``inputs_embeds``), drops ``attention_mask``,
    adds ``padding_mask`` (True = pad) and shards ``loss_mask``. Returns ``(train_ctx, batch)``
    (``batch`` is updated in place and returned); entering ``train_ctx()`` makes
    :func:`cp_blockdiag_sdpa` attend causally within each document across the CP group.
    ``tp_mesh`` is accepted for signature compatibility and unused. Batch size > 1 is supported.
    """
    what = "cpshard.make_cp_blockdiag_batch_and_ctx"
    g = resolve_group(cp_mesh, what)
    ref = batch.get("inputs_embeds", batch.get("input_ids"))
    problem = None
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
        problem = "batch needs inputs_embeds [B, S, H] or input_ids [B, S]"
    elif loss_mask is not None and (not isinstance(loss_mask, torch.Tensor) or tuple(loss_mask.shape[:2]) != tuple(ref.shape[:2])):
        problem = f"loss_mask must be a [B, S] tensor matching {tuple(ref.shape[:2])}"
    if problem is None:
        try:
            doc = document_ids(batch, ref.shape[1], "cpu", ref.shape[0])  # the step's host copy
        except ValueError as e:
            problem = str(e)
    if problem is not None:
        agree(g, what, problem)
    bsz, seq = ref.shape[0], ref.shape[1]
    world, rank = g.world, g.rank
    padded = -(-seq // world) * world
    local = padded // world
    start = rank * local
    doc = pad_sequence("_packed_seq_ids", doc, 1, padded)
    padding_mask = (doc == 0).to(ref.device)
    agree(g, what, None, {"[B, S]": [bsz, seq], "document ids": digest(doc)})

    if loss_mask is not None:
        batch["loss_mask"] = loss_mask
    batch.pop("attention_mask", None)
    batch["padding_mask"] = padding_mask
    for key, value in list(batch.items()):
        dim = sequence_dim(key, value, bsz, padded if key == "padding_mask" else seq)
        if dim is None:
            continue
        full = pad_sequence(key, value, dim, padded, padding_token_id)
        batch[key] = full.narrow(dim, start, local)
    if isinstance(batch.get("_packed_seq_ids"), torch.Tensor):  # may be given on the host
        batch["_packed_seq_ids"] = batch["_packed_seq_ids"].to(ref.device)

    segments = [_segments(doc, r * local, (r + 1) * local) for r in range(world)]
    state = BlockDiagState(
        group=g,
        start=start,
        local_len=local,
        batch_size=bsz,
        halos=tuple(_halo(segments[r], r * local) for r in range(world)),
        segments=tuple(segments[rank]),
    )
    state.packing_on(ref.device)  # the attention's metadata on the batch's device, once per step

    @contextmanager
    def train_ctx() -> Iterator[None]:
        token = current.set(state)
        try:
            yield
        finally:
            current.reset(token)

    return train_ctx, batch
