"""Padding conventions for sequence-aligned batch tensors, shared by every sharder.

A tensor is sequence-aligned when it is ``[B, S, ...]`` (seq dim 1) or, for mRoPE position ids,
``[C, B, S]`` (seq dim 2). Padding appends positions at the end of the sequence with a value
that keeps every consumer correct: ``input_ids`` = the pad id, ``labels`` = -100,
``position_ids`` continue counting, ``loss_mask`` = 0, ``padding_mask`` = True,
``block_sequence_ids`` = -1 (no block), anything else 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def sequence_dim(key: str, value: object, batch_size: int, seq_len: int) -> int | None:
    """The sequence dim of a batch entry, or None when it is not sequence-aligned."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    if key == "position_ids" and value.dim() == 3 and value.shape[1:] == (batch_size, seq_len):
        return 2
    if tuple(value.shape[:2]) == (batch_size, seq_len):
        return 1
    return None


def pad_value(key: str, padding_token_id: int) -> int | bool:
    """The fill value for padded positions of the entry named ``key``."""
    fills = {"input_ids": padding_token_id, "labels": IGNORE_INDEX, "padding_mask": True}
    fills["block_sequence_ids"] = -1  # transformers' block ids: padding is in no block
    return fills.get(key, 0)


def pad_sequence(
    key: str, value: torch.Tensor, seq_dim: int, new_len: int, padding_token_id: int = 0
) -> torch.Tensor:
    """``value`` right-padded along ``seq_dim`` to ``new_len`` by the convention for ``key``
    (differentiable: floating tensors are padded with ``F.pad``)."""
    extra = new_len - value.shape[seq_dim]
    if extra < 0:
        raise ValueError(
            f"{key}: length {value.shape[seq_dim]} exceeds the padded length {new_len}"
        )
    if extra == 0:
        return value
    if key == "position_ids":
        n = value.shape[seq_dim]
        if n:
            last = value.narrow(seq_dim, n - 1, 1)
        else:
            last = value.new_full([1 if d == seq_dim else s for d, s in enumerate(value.shape)], -1)
        steps = torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
        steps = steps.view([extra if d == seq_dim else 1 for d in range(value.dim())])
        return torch.cat([value, last + steps], dim=seq_dim)
    pads = [0, 0] * (value.dim() - seq_dim - 1) + [0, extra]
    return F.pad(value, pads, value=pad_value(key, padding_token_id))
