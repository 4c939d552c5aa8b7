"""Batch padding, sequential sharding, and block-diagonal CP context setup (mirror of
``nemo_automodel.components.distributed.blockdiag_cp.batch``).

Thin adapters over :func:`cpshard.make_cp_blockdiag_batch_and_ctx`. The conventions that differ from the top-level
:func:`cpshard.make_cp_blockdiag_batch_and_ctx`: padded ``position_ids`` are 0 here (NeMo
Automodel's convention, also for mRoPE ``[3, B, S]``) where the top level keeps counting; labels
are not shifted (NeMo's labels are targets already); the caller's batch is updated in place and
keeps ``labels``, ``loss_mask``, ``padding_mask`` and ``_packed_seq_ids`` (the top level returns a
new batch of model inputs and puts those in its ``targets`` side record).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from cpshard.batch import document_ids
from cpshard.comm import resolve_group
from cpshard.nemo._mesh import cp_group
from cpshard.sharder import make_cp_blockdiag_batch_and_ctx as _make_batch_and_ctx

__all__ = ["_cp_blockdiag_doc_ids", "make_cp_blockdiag_batch_and_ctx"]

_WHAT = "cpshard.nemo make_cp_blockdiag_batch_and_ctx"


def _cp_blockdiag_doc_ids(batch: dict, seq_len: int, device, batch_size: int) -> torch.Tensor:
    """Resolve per-position document ids ``[B, S]`` (0 == padding) for the mask: the collator's
    ``_packed_seq_ids`` when present (preferred: the batch's other sources, e.g. the
    ``attention_mask``, are not read then), else a 4-D block-causal ``attention_mask``'s
    diagonal, else a 2-D ``attention_mask``, else one document per row
    (:func:`cpshard.document_ids`)."""
    return document_ids(_preferred_sources(batch), seq_len, device, batch_size)


def _preferred_sources(batch: dict) -> dict:
    """The batch as NeMo reads its documents: ``_packed_seq_ids`` alone when present."""
    packed = batch.get("_packed_seq_ids") if isinstance(batch, dict) else None
    return batch if packed is None else {"_packed_seq_ids": packed}


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None,
    batch: dict[str, Any],
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
) -> tuple[Callable[[], AbstractContextManager], dict[str, Any]]:
    """Sequentially shard a pre-embedded batch for block-diagonal CP.

    :func:`cpshard.make_cp_blockdiag_batch_and_ctx` with NeMo's conventions: labels are not
    shifted (NeMo's are targets already), ``batch`` is updated in place and returned with
    ``attention_mask`` dropped, ``padding_mask`` added, ``labels``, ``loss_mask`` (when given or
    present) and ``_packed_seq_ids`` (when present) sharded and kept in it, and padded
    ``position_ids`` set to 0. Documents come from ``_packed_seq_ids`` when present (a 4-D
    ``attention_mask`` is not read then, as :func:`_cp_blockdiag_doc_ids`). ``cp_mesh`` may be a
    ``DeviceMesh``, a ``ProcessGroup``, None, or a duck-typed mesh (``get_group()``, ``size()``,
    ``get_local_rank()``). ``tp_mesh`` and ``padding_token_id`` are accepted for signature
    compatibility (``padding_token_id`` pads ``input_ids`` when the batch has them). Returns
    ``(train_ctx, batch)``; entering ``train_ctx()`` activates the step's per-document CP
    attention.
    """
    cp_mesh = cp_group(cp_mesh, _WHAT, "cp_mesh")
    if isinstance(batch, dict) and batch.get("_packed_seq_ids") is not None:
        batch.pop("attention_mask", None)  # dropped anyway; the packed ids are preferred
    ref = batch.get("inputs_embeds", batch.get("input_ids")) if isinstance(batch, dict) else None
    seq_len = ref.shape[1] if isinstance(ref, torch.Tensor) and ref.dim() >= 2 else None
    train_ctx, out = _make_batch_and_ctx(
        cp_mesh, tp_mesh, batch, loss_mask, padding_token_id, shift_labels=False
    )
    packed = "_packed_seq_ids" if batch.get("_packed_seq_ids") is not None else None
    out = out.with_targets(packed)
    pos = out.get("position_ids")
    if isinstance(pos, torch.Tensor) and seq_len is not None:
        local = pos.shape[-1]
        first_pad = seq_len - resolve_group(cp_mesh, _WHAT).rank * local  # local index
        if first_pad < local:
            keep = torch.arange(local, device=pos.device) < first_pad
            # In place: ``pos`` is this step's own padded copy (never the caller's tensor), the
            # one registered as the step's tokens (cpshard.attention.tokens).
            pos.masked_fill_(~keep, 0)
    batch.clear()
    batch.update(out)
    return train_ctx, batch
