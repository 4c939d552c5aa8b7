"""Block-diagonal CP attention (mirror of
``nemo_automodel.components.distributed.blockdiag_cp.runtime``'s ``cp_blockdiag_sdpa``)."""

from __future__ import annotations

from typing import Any

import torch

from cpshard.attention import AttentionState, active_state
from cpshard.attention import cp_blockdiag_sdpa as _cp_blockdiag_sdpa

__all__ = ["cp_blockdiag_sdpa"]


def cp_blockdiag_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: float | None = None, enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
    """:func:`cpshard.cp_blockdiag_sdpa` with NeMo's conventions: while the block-diagonal state
    is active, ``attn_mask`` and extra keyword arguments are ignored (the documents define the
    mask) and a pad row outputs its own value row (it attends to itself only); otherwise plain
    SDPA with ``attn_mask``."""
    state = active_state()
    if state is None:
        return _cp_blockdiag_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    out = _cp_blockdiag_sdpa(query, key, value, None, dropout_p, is_causal, scale, enable_gqa)
    real = _document_rows(state, out.device)
    if real is None:
        return out
    rows = value if value.shape[1] == query.shape[1] else value.repeat_interleave(
        query.shape[1] // value.shape[1], dim=1)
    return torch.where(real, out, rows.to(out.dtype))


def _document_rows(state: AttentionState, device: torch.device) -> torch.Tensor | None:
    """``[B, 1, L, 1]`` bool: the local rows inside a document (None when every row is)."""
    real = torch.zeros(state.batch_size, state.local_len, dtype=torch.bool)
    for span in state.spans:
        real[span.row, span.q: span.q + span.n] = True
    if bool(real.all()):
        return None
    return real.to(device)[:, None, :, None]
