"""The public CP attention functions: :func:`cp_attention` (causal or bidirectional within
documents, sliding windows, a sharded batch's token check) and :func:`cp_blockdiag_sdpa` (a
drop-in for ``F.scaled_dot_product_attention``). Both attend under the active step state
(:mod:`cpshard.attention.state`), whatever layout the ranks' tokens follow, and are plain SDPA
when no CP attention context is active."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from cpshard.attention.ops import cp_attention_op
from cpshard.attention.state import AttentionState, active_state
from cpshard.attention.tokens import check_outside, step_state, token_problem
from cpshard.consensus import check_call
from cpshard.fingerprints import device_code, digest, dtype_code
from cpshard.validation import is_int

_WHAT = "cpshard.cp_attention"
_SDPA_WHAT = "cpshard.cp_blockdiag_sdpa"


def _window(window: object) -> int | None:
    if window is None:
        return None
    if not is_int(window):
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


def _refusal(state: AttentionState, window: int | None) -> str | None:
    """Why CP attention cannot serve the call exactly on this step (``state``: the step's state
    for the call's mask), or None. It depends on the step alone (``reach`` is the same on every
    rank), so every rank refuses."""
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
    bidirectional within each document.
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
    state = step_state(position_ids, active_state())  # a checkpoint recompute finds its step
    if state is not None:
        chosen = state if is_causal else state.bidirectional()
        problem = token_problem(position_ids, state) or _refusal(chosen, window)
        return attend(
            chosen,
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


def _problem(
    state: AttentionState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: object,
    dropout_p: float,
    enable_gqa: bool,
) -> str | None:
    """This rank's problem with the arguments, or None (shapes and the state's sizes only)."""
    problem = None
    if attn_mask is not None:
        problem = "attn_mask must be None while CP attention is active"
    elif dropout_p != 0.0:
        problem = "dropout_p must be 0 while CP attention is active"
    elif q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        problem = "q, k, v must be [B, heads, L, D]"
    elif (
        q.shape[2] != state.local_len
        or k.shape[2] != state.local_len
        or v.shape[2] != state.local_len
    ):
        problem = (
            f"q/k/v hold {q.shape[2]}/{k.shape[2]}/{v.shape[2]} tokens but this rank's shard of "
            f"the active {state.layout!r} layout has {state.local_len}"
        )
    elif q.shape[0] != state.batch_size:
        problem = f"q has batch {q.shape[0]} but the sharded batch has {state.batch_size}"
    elif k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype or k.device != v.device:
        problem = (
            f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must match in every "
            "dim but the last, in dtype and in device"
        )
    elif k.shape[0] != q.shape[0] or q.dtype != k.dtype or q.device != k.device:
        problem = (
            f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must match in batch, "
            "dtype and device"
        )
    elif q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        problem = (
            f"q has {q.shape[1]} heads and k {k.shape[1]}: pass enable_gqa=True with a divisible "
            "head count"
        )
    return problem


def _fields(
    state: AttentionState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], dict[str, Sequence[int]]]:
    """What every rank's call must agree on (checked mode only: it reads the step's plan)."""
    return lambda: {
        "layout": digest([ord(c) for c in state.layout]),
        "dtype": [dtype_code(q.dtype)],
        "device type": [device_code(q)],
        "q, k, v heads and dims": [q.shape[1], k.shape[1], q.shape[3], k.shape[3], v.shape[3]],
        # ranks that differ here would block in the backward exchange
        "requires_grad": [int(torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))],
        "exchange plan": digest(state.exchange.plan),
    }


def attend(
    state: AttentionState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
    what: str,
    problem: str | None = None,
) -> torch.Tensor:
    """Causal attention within documents under ``state``: the step's K/V exchange, then the
    spans' attention. ``problem``: the caller's own finding about its arguments, reported like
    the shape checks (locally, or on every rank in checked mode)."""
    problem = problem or _problem(state, query, key, value, attn_mask, dropout_p, enable_gqa)
    check_call(state.group, what, problem, _fields(state, query, key, value))
    kv = torch.cat([key, value], dim=-1)
    out, _ = cp_attention_op(query, kv, state.key, key.shape[-1], scale)
    return out


def cp_blockdiag_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention``: plain SDPA when no CP attention state is
    active; otherwise causal attention within each document across the CP group, whatever
    ``is_causal`` says (``attn_mask`` must be None and ``dropout_p`` 0: the documents define the
    mask). :func:`cpshard.cp_attention` honours ``is_causal`` and ``window`` instead.

    Checks are local (shapes against the step's sizes) unless checked mode is on, which adds one
    consensus round so that bad input on one rank makes every rank raise."""
    state = active_state()
    if state is None:
        return plain_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return attend(state, query, key, value, attn_mask, dropout_p, scale, enable_gqa, _SDPA_WHAT)


def plain_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (what the CP attention functions do outside a context)."""
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
