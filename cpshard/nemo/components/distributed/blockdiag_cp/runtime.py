"""Block-diagonal CP attention (mirror of
``nemo_automodel.components.distributed.blockdiag_cp.runtime``'s ``cp_blockdiag_sdpa``)."""

from __future__ import annotations

from typing import Any

import torch

from cpshard.blockdiag import cp_blockdiag_sdpa as _cp_blockdiag_sdpa
from cpshard.blockdiag.state import active_state

__all__ = ["cp_blockdiag_sdpa"]


def cp_blockdiag_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: float | None = None, enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
    """:func:`cpshard.cp_blockdiag_sdpa` with NeMo's calling convention: while the block-diagonal
    state is active, ``attn_mask`` is ignored (the documents define the mask) and extra keyword
    arguments are accepted and ignored; otherwise plain SDPA with ``attn_mask``."""
    if active_state() is not None:
        attn_mask = None
    return _cp_blockdiag_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
