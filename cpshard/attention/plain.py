"""Single-device attention with the variants CP attention supports (a sliding window, a mask
description, a ``mask_mod``, logit soft-capping, sinks): what the CP attention functions run
when no CP attention context is active. SDPA where it serves the call; the explicit statement
(plain PyTorch, autograd) where SDPA has no such option."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpshard.masks import MaskDescription, MaskMod, evaluate_mask_mod


def band(q: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """``[Lq, Lk]`` bool: causal (aligned top-left, as SDPA's ``is_causal``) within ``window``."""
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    return (j <= i) & (j > i - window)


def _bool_mask(
    q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool
) -> torch.Tensor | None:
    """The call's visibility as one boolean (or additive float) mask, or None."""
    if not is_causal:
        return attn_mask
    causal = band(q, k, k.shape[-2] + q.shape[-2])
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


def _explicit(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Matmul-softmax with soft-capped logits and a sink column (dropped after the softmax)."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    s = scale if scale is not None else q.shape[-1] ** -0.5
    logits = (q @ k.transpose(-1, -2)) * s
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if mask is not None:
        logits = (
            logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask
        )
    if sinks is not None:
        sink = sinks.to(logits.dtype).view(1, heads, 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs, dropout_p) if dropout_p else probs
    return probs.to(v.dtype) @ v


def plain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` with a causal ``window`` (a band mask), ``softcap``
    and ``sinks`` (the explicit statement: SDPA has neither)."""
    if window is not None:
        if attn_mask is not None or not is_causal:
            raise ValueError("cpshard.cp_attention: window needs is_causal=True and no attn_mask")
        attn_mask, is_causal = band(query, key, window), False
    if softcap is not None or sinks is not None:
        mask = _bool_mask(query, key, attn_mask, is_causal)
        return _explicit(query, key, value, mask, dropout_p, scale, softcap, sinks)
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


def described_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: MaskDescription,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`plain_attention` under the mask description ``mask`` of the call's ``[B, S]``
    tokens (its :meth:`~cpshard.masks.MaskDescription.dense` mask): a query that sees no key
    (padding) gets zeros, as under CP (it attends every key, then its output is dropped, so
    no NaN reaches the gradients)."""
    if attn_mask is not None:
        raise ValueError("cpshard.cp_attention: attn_mask must be None with mask")
    rows, length = query.shape[0], query.shape[-2]
    if (mask.rows, mask.length) != (rows, length) or key.shape[-2] != length:
        raise ValueError(
            f"cpshard.cp_attention: mask describes a [{mask.rows}, {mask.length}] batch, the "
            f"call's queries and keys are [{rows}, {length}] and {key.shape[-2]} keys"
        )
    visible = mask.dense().to(query.device)[:, None]
    return visible_attention(
        query, key, value, visible, dropout_p, scale, enable_gqa, softcap, sinks
    )


def visible_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`plain_attention` of the keys ``visible`` ``[B, 1 or H, Lq, Lk]`` (bool) says each
    query sees: a query that sees no key gets zeros (it attends every key, then its output is
    dropped, so no NaN reaches the gradients)."""
    empty = ~visible.any(-1, keepdim=True)
    out = plain_attention(
        query, key, value, visible | empty, dropout_p, False, scale, enable_gqa, None, softcap,
        sinks,
    )  # fmt: skip
    return out.masked_fill(empty, 0.0)


def mask_mod_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask_mod: MaskMod,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
    what: str,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`visible_attention` under ``mask_mod(b, h, q_idx, kv_idx)`` evaluated on the host
    over the call's ``[B, S]`` positions and query heads (no documents: the function says
    everything). Raises ``ValueError`` (naming ``what`` and ``mask_mod``) for a function that
    does not return a bool tensor of the broadcast shape, or keys of another length."""
    rows, heads, length = query.shape[0], query.shape[1], query.shape[-2]
    if key.shape[-2] != length:
        raise ValueError(
            f"{what}: mask_mod needs as many keys as queries, got {key.shape[-2]} "
            f"and {length}"
        )
    try:
        seen = evaluate_mask_mod(mask_mod, rows, length, torch.arange(length), None, heads)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None
    return visible_attention(
        query, key, value, seen.to(query.device), dropout_p, scale, enable_gqa, softcap, sinks
    )
