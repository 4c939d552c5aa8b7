"""The block-diagonal CP batch: the contiguous layout with NeMo's batch conventions.

:func:`make_cp_blockdiag_batch_and_ctx` is NeMo Automodel's entry point for per-document CP
attention over contiguous shards. It is the built-in ``contiguous`` planning of
:class:`~cpshard.ContextParallelSharder` (:class:`~cpshard.sharder.planning.BatchPlanner`), so
both shard the same batch identically and install the same attention state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ContextManager

import torch

from cpshard.batch.targets import ShardedBatch
from cpshard.comm import GroupLike, resolve_group, split_cp_mesh
from cpshard.consensus import agree
from cpshard.sharder.planning import BatchPlanner, check_strategy

_WHAT = "cpshard.make_cp_blockdiag_batch_and_ctx"


def _problem(batch: object, loss_mask: object, shift_labels: object) -> str | None:
    """This rank's problem with the entry point's own arguments, or None."""
    ref = batch.get("inputs_embeds", batch.get("input_ids")) if isinstance(batch, dict) else None
    labels = batch.get("labels") if isinstance(batch, dict) else None
    mask = batch.get("loss_mask") if loss_mask is None and isinstance(batch, dict) else loss_mask
    if not isinstance(ref, torch.Tensor) or ref.dim() < 2:
        return "batch needs inputs_embeds [B, S, H] or input_ids [B, S]"
    if any(
        t is not None
        and (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(ref.shape[:2]))
        for t in (labels, mask)
    ):
        return f"labels and loss_mask must be [B, S] tensors matching {tuple(ref.shape[:2])}"
    if not isinstance(shift_labels, bool):
        return f"shift_labels must be a bool, got {type(shift_labels).__name__}"
    return None


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh: GroupLike,
    tp_mesh: Any,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    *,
    shift_labels: bool = True,
    strategy: str = "auto",
) -> tuple[Callable[[], ContextManager[None]], ShardedBatch]:
    """Shard a batch sequentially for block-diagonal (per-document) CP attention.

    Reads the documents (:func:`cpshard.batch.documents.read_documents`: ``_packed_seq_ids``,
    ``seq_idx``, ``cu_seqlens``, masks, ``position_ids`` restarts; contradictions raise on every
    rank), creates per-document ``position_ids`` when the batch has none, shifts ``labels`` (and
    ``loss_mask``, which overrides the batch's) once over the whole sequence unless
    ``shift_labels=False``, pads the sequence to a multiple of the CP size and slices every
    sequence-aligned tensor to this rank's contiguous chunk (differentiably for
    ``inputs_embeds``). Returns ``(train_ctx, batch)``: a new
    :class:`~cpshard.batch.targets.ShardedBatch` holding what the model's forward takes, with
    labels, the labelled-token count, ``loss_mask``, ``padding_mask`` (True = pad) and document
    ids in ``batch.targets``; the caller's batch is not modified. Entering ``train_ctx()`` makes
    :func:`cpshard.cp_blockdiag_sdpa` / :func:`cpshard.cp_attention` attend within each document
    across the CP group (causal, or bidirectional with ``is_causal=False``). ``tp_mesh`` is
    accepted for signature compatibility and unused. Batch size > 1 is supported. The batch's
    ``position_ids`` are registered as this step's tokens: CP attention given them raises under
    another context or outside any. ``strategy``: how CP attention exchanges, as
    :class:`~cpshard.ContextParallelSharder` takes it (``cp_mesh`` may then be a 2-D
    ``(inter, intra)`` mesh).
    """
    cp_mesh, mesh = split_cp_mesh(cp_mesh, _WHAT)
    g = resolve_group(cp_mesh, _WHAT)
    check_strategy(strategy, mesh, f"{_WHAT}: rank {g.rank}")
    problem = _problem(batch, loss_mask, shift_labels)
    if problem is not None:  # every rank raises (the others in the planner's consensus round)
        agree(g, _WHAT, problem)
    planner = BatchPlanner(
        "contiguous", None, 1, {}, {}, shift_labels, what=_WHAT, strategy=strategy, mesh=mesh
    )
    ctx, sharded, _ = planner.shard_batch(
        cp_mesh, tp_mesh, batch, loss_mask=loss_mask, padding_token_id=padding_token_id
    )
    return ctx, sharded
