"""Per-token document ids ``[B, S]`` (int64, 0 = padding) from whatever a batch carries."""

from __future__ import annotations

from typing import Any

import torch


def _from_block_mask(mask: torch.Tensor) -> torch.Tensor:
    """Ids from a 4-D block-causal mask ``[B, 1, S, S]``: a position is valid when it attends to
    itself, and starts a new document when it does not attend to its predecessor."""
    attends = mask[:, 0] if mask.dtype == torch.bool or not mask.is_floating_point() else mask[:, 0] == 0
    attends = attends.bool()
    valid = attends.diagonal(dim1=-2, dim2=-1)
    to_prev = attends.diagonal(offset=-1, dim1=-2, dim2=-1)  # [B, S-1]: i attends i-1
    starts = valid.clone()
    starts[:, 1:] &= ~(to_prev & valid[:, :-1])
    return torch.cumsum(starts.long(), dim=1) * valid.long()


def document_ids(batch: dict[str, Any], seq_len: int, device: torch.device | str | None, batch_size: int) -> torch.Tensor:
    """Per-position document ids ``[B, S]`` (int64, 0 == padding).

    Priority: the collator's ``_packed_seq_ids``; else a 4-D block-causal ``attention_mask``
    (bool/int: nonzero attends; float: additive, 0 attends) read off its diagonals; else a 2-D
    ``attention_mask`` (validity 0/1 or per-document indices); else one document per row.
    A document is a maximal run of one non-zero id.
    """
    ids = batch.get("_packed_seq_ids")
    mask = batch.get("attention_mask")
    if ids is not None:
        out = torch.as_tensor(ids)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        if mask.shape[1] != 1 or mask.shape[-1] != mask.shape[-2]:
            raise ValueError(f"document_ids: a 4-D attention_mask must be [B, 1, S, S], got {tuple(mask.shape)}")
        out = _from_block_mask(mask)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 2:
        out = mask if not mask.is_floating_point() else (mask != 0)
    else:
        out = torch.ones(batch_size, seq_len, dtype=torch.int64)
    if out.dim() != 2 or tuple(out.shape) != (batch_size, seq_len):
        raise ValueError(f"document_ids: expected ids of shape [{batch_size}, {seq_len}], got {tuple(out.shape)}")
    return out.to(device=device, dtype=torch.int64)
