"""``cp_attention``: the active CP attention (block-diagonal or a sharder layout's), plain SDPA
when none is active."""

from __future__ import annotations

import torch

from cpshard.attention.tokens import check_outside, token_problem
from cpshard.blockdiag.attention import attend, plain_sdpa
from cpshard.blockdiag.state import AttentionState, active_state

_WHAT = "cpshard.cp_attention"


def _window(window: object) -> int | None:
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"{_WHAT}: window must be an int or None, got {type(window).__name__}")
    if window < 1:
        raise ValueError(f"{_WHAT}: window must be >= 1, got {window}")
    return window


def _position_ids(position_ids: object) -> torch.Tensor | None:
    """``position_ids`` checked to be a tensor or None (the token check looks tensors up)."""
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise TypeError(
            f"{_WHAT}: position_ids must be a tensor or None, got {type(position_ids).__name__}"
        )
    return position_ids


def _refusal(state: AttentionState | None, window: int | None) -> str | None:
    """Why CP attention cannot serve the call exactly on this step (``state``: the step's state
    for the call's mask, None when it has none), or None. Both depend on the step alone
    (``reach`` is the same on every rank), so every rank refuses."""
    if state is None:
        return (
            "is_causal=False (bidirectional attention within documents) is not supported by the "
            "block-diagonal context; shard with ContextParallelSharder (any layout) instead"
        )
    if window is not None and not state.causal:
        return "window needs is_causal=True"
    if window is not None and window < state.reach:
        return (
            f"window={window} is shorter than the longest document prefix of this step "
            f"({state.reach} tokens), where sliding-window attention differs from causal "
            "attention; sliding windows shorter than a document are not supported by CP attention"
        )
    return None


def _band(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """``[Lq, Lk]`` bool: causal (aligned top-left, as SDPA's ``is_causal``) within ``window``."""
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    return (j <= i) & (j > i - window)


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = True,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: int | None = None,
    *,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``[B, H, L, D]`` queries, keys and values.

    Inside a CP attention context (``ContextParallelSharder.shard``'s or
    ``make_cp_blockdiag_batch_and_ctx``'s): causal attention within each document over the whole
    sequence, whatever layout the ranks' tokens follow, exact forward and backward (``attn_mask``
    must be None and ``dropout_p`` 0: the documents define the mask); ``is_causal=False``:
    bidirectional within each document (sharder contexts; the block-diagonal one raises).
    ``window`` (keys a query sees, itself included) is exact when no document prefix of the step
    is longer; otherwise it raises rather than attend differently. Checks are local unless
    checked mode is on (then every rank raises).

    ``position_ids``: the positions of the call's tokens as the model received them (the sharded
    batch's ``position_ids``). When they are a sharded batch's, tokens of another step or layout
    than the active context's raise, and so do sharded tokens outside any context
    (:mod:`cpshard.attention.tokens`); equal local lengths would otherwise attend wrongly
    without an error. Other tensors (positions a model derives itself) are not checked.

    Outside: ``F.scaled_dot_product_attention`` (with ``window``, a causal band mask)."""
    window = _window(window)
    position_ids = _position_ids(position_ids)
    state = active_state()
    if state is not None:
        chosen = state if is_causal else state.bidirectional()
        problem = token_problem(position_ids, state) or _refusal(chosen, window)
        return attend(
            chosen or state,
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            scale,
            enable_gqa,
            _WHAT,
            problem,
        )
    check_outside(position_ids, _WHAT)
    if window is not None:
        if attn_mask is not None or not is_causal:
            raise ValueError(f"{_WHAT}: window needs is_causal=True and no attn_mask")
        attn_mask, is_causal = _band(query, key, window), False
    return plain_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
