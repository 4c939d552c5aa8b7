"""The public CP attention functions: :func:`cp_attention` (causal or bidirectional within
documents, sliding windows, a mask description, a FlexAttention-style ``mask_mod``,
soft-capping, sinks, a sharded batch's token check) and :func:`cp_blockdiag_sdpa` (a drop-in
for ``F.scaled_dot_product_attention``). Both attend under the active step state
(:mod:`cpshard.attention.state`), whatever layout the ranks' tokens follow, and are plain SDPA
when no CP attention context is active."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cpshard.attention.head_attention import head_parallel_attention
from cpshard.attention.mask_mod import mask_mod_state
from cpshard.attention.ops import cp_attention_op
from cpshard.attention.plain import described_attention, mask_mod_attention, plain_attention
from cpshard.attention.state import AttentionState, active_state
from cpshard.attention.strategy import route
from cpshard.attention.tokens import check_outside, state_for_tokens, token_problem
from cpshard.consensus import check_call
from cpshard.fingerprints import device_code, digest, dtype_code
from cpshard.guard.reach import note_cpshard_mixing
from cpshard.masks import MaskDescription, MaskMod
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
    return int(window)


def _softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, int | float):
        raise TypeError(f"{_WHAT}: softcap must be a number or None, got {type(softcap).__name__}")
    if not softcap > 0:
        raise ValueError(f"{_WHAT}: softcap must be > 0, got {softcap}")
    return float(softcap)


def _position_ids(position_ids: object) -> torch.Tensor | None:
    """``position_ids`` checked to be a tensor or None (the token check looks tensors up)."""
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise TypeError(
            f"{_WHAT}: position_ids must be a tensor or None, got {type(position_ids).__name__}"
        )
    return position_ids


def _mask(mask: object) -> MaskDescription | None:
    if mask is not None and not isinstance(mask, MaskDescription):
        raise TypeError(
            f"{_WHAT}: mask must be a cpshard.masks.MaskDescription or None, got "
            f"{type(mask).__name__}"
        )
    return mask


def _mask_problem(mask: MaskDescription | None, window: int | None) -> str | None:
    """What conflicts with ``mask`` among the call's other arguments (None: nothing)."""
    if mask is not None and window is not None:
        return "window must be None with mask (a description states its windows)"
    return None


def _mask_mod(mask_mod: object, documents: object, what: str) -> MaskMod | None:
    """``mask_mod`` checked to be callable or None, and its documents flag a bool."""
    if mask_mod is not None and not callable(mask_mod):
        raise TypeError(f"{what}: mask_mod must be callable or None, got {type(mask_mod).__name__}")
    if not isinstance(documents, bool):
        raise TypeError(
            f"{what}: mask_mod_documents must be a bool, got {type(documents).__name__}"
        )
    return mask_mod


def _mask_mod_problem(
    mask_mod: MaskMod | None,
    mask: MaskDescription | None,
    window: int | None,
    is_causal: bool | None,
    attn_mask: object,
) -> str | None:
    """What conflicts with ``mask_mod`` among the call's other arguments (None: nothing)."""
    if mask_mod is None:
        return None
    if mask is not None:
        return "mask_mod and mask exclude each other (one states the mask)"
    if window is not None:
        return "window must be None with mask_mod (state the window in the function)"
    if is_causal:
        return "is_causal=True conflicts with mask_mod (state causality in the function)"
    if attn_mask is not None:
        return "attn_mask must be None with mask_mod"
    return None


def _causal_claim_problem(
    mask: MaskDescription | None, causal: bool, looks_ahead: bool
) -> str | None:
    """``is_causal=True`` with a ``mask`` some of whose queries see later keys (None: no
    conflict)."""
    if mask is None or not causal or not looks_ahead:
        return None
    return (
        "is_causal=True conflicts with mask: some of its queries see later keys (leave "
        "is_causal unset or pass False: the description says which keys each query sees)"
    )


def _sinks_problem(sinks: object, q: torch.Tensor) -> str | None:
    """What is wrong with ``sinks`` for queries ``q`` ``[B, H, L, D]`` (None: nothing)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor):
        return f"sinks must be a tensor or None, got {type(sinks).__name__}"
    if sinks.dim() != 1 or q.dim() != 4 or sinks.shape[0] != q.shape[1]:
        return f"sinks must be [query heads] = [{q.shape[1]}], got {tuple(sinks.shape)}"
    if sinks.device != q.device or not sinks.is_floating_point():
        return f"sinks must be a floating tensor on {q.device}, got {sinks.dtype} on {sinks.device}"
    return None


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: int | None = None,
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    mask: MaskDescription | None = None,
    mask_mod: MaskMod | None = None,
    mask_mod_documents: bool = True,
) -> torch.Tensor:
    """Attention of ``[B, H, L, D]`` queries and keys and ``[B, H, L, D_v]`` values (``D_v`` may
    differ from ``D``: multi-head latent attention).

    Inside a CP attention context (``ContextParallelSharder.shard``'s or
    ``make_cp_blockdiag_batch_and_ctx``'s): causal attention within each document over the whole
    sequence, whatever layout the ranks' tokens follow, exact forward and backward (``attn_mask``
    must be None and ``dropout_p`` 0: the documents define the mask); ``is_causal=False``:
    bidirectional within each document (``is_causal`` None: causal, or the mask's). The
    variants, in any combination, exact:

    * ``mask``: a :class:`~cpshard.masks.MaskDescription` of the batch (its rows and
      documents; the unpadded or the step's padded length): each query sees the keys its
      segment's rule says (chunked attention, bidirectional image blocks or a prefix over causal
      attention, sliding starts with a fixed end, look-ahead windows, ...). The step plans each
      description object once, on its first use (a layer type passing the same object reuses
      it). With ``mask``, ``window`` must be None (state it in the description) and
      ``is_causal`` None or False, or True only for a description no query of which sees a
      later key; anything else raises. A description of another batch, or with a query that
      does not see itself, raises naming ``mask`` and the rank;
    * ``mask_mod``: a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` over
      the global positions of the packed rows (broadcasting index tensors; tensor operations
      only; tensors it captures on the CPU), within each document unless
      ``mask_mod_documents=False`` (then the function alone decides: it may reach across
      documents); padding is never a query nor a key. The step plans each (function object,
      query heads) once, on the host: each rank receives exactly the K/V rows its queries see,
      and attends them under a boolean mask (per head when the function depends on ``h``)
      placed on the device once; a query that sees no key gives zeros
      (:mod:`cpshard.attention.mask_mod`). ``mask``, ``window``, ``attn_mask`` and
      ``is_causal=True`` are refused with it, and so is a function that does not return a bool
      tensor of the broadcast shape (naming ``mask_mod`` and the rank). Outside a context the
      function's dense mask over the call's ``[B, S]`` (no documents there);

    * ``window``: a sliding window, the keys a query sees (itself included) within its
      document; causal only. A windowed layer exchanges at most ``window - 1`` rows before each
      run (the step plans each window once, on its first use);
    * ``softcap``: logits ``softcap * tanh(score / softcap)`` (Gemma 2);
    * ``sinks``: ``[H]`` learned logits, one per query head, in every softmax denominator with
      no value (gpt-oss); differentiable.

    Checks are local unless checked mode is on (then every rank raises).

    ``position_ids``: the positions of the call's tokens as the model received them (the sharded
    batch's ``position_ids``). When they are a sharded batch's, tokens of another step or layout
    than the active context's raise, and so do sharded tokens outside any context
    (:mod:`cpshard.attention.tokens`); equal local lengths would otherwise attend wrongly
    without an error. Other tensors (positions a model derives itself) are not checked.

    Outside: ``F.scaled_dot_product_attention`` (with ``window``, a causal band mask; with
    ``mask``, its ``dense()`` mask, a query that sees no key giving zeros; with ``softcap`` or
    ``sinks``, the explicit statement), so the same layer code runs both ways."""
    window = _window(window)
    softcap = _softcap(softcap)
    position_ids = _position_ids(position_ids)
    mask = _mask(mask)
    mask_mod = _mask_mod(mask_mod, mask_mod_documents, _WHAT)
    mod_problem = _mask_mod_problem(mask_mod, mask, window, is_causal, attn_mask)
    causal = is_causal if is_causal is not None else mask is None
    # a checkpoint recompute run after the context finds its step by its tokens
    state = state_for_tokens(position_ids, active_state())
    if state is not None:
        problem = token_problem(position_ids, state) or _sinks_problem(sinks, query)
        problem = problem or mod_problem or _mask_problem(mask, window)
        if problem is None and window is not None and not causal:
            problem = "window needs is_causal=True"
        return attend(
            state,
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            scale,
            enable_gqa,
            _WHAT,
            problem,
            window=window,
            softcap=softcap,
            sinks=sinks,
            causal=causal,
            mask=mask,
            mask_mod=mask_mod,
            mask_mod_documents=mask_mod_documents,
        )
    check_outside(position_ids, _WHAT)
    problem = _sinks_problem(sinks, query) or mod_problem or _mask_problem(mask, window)
    if problem is None and mask is not None:
        problem = _causal_claim_problem(mask, causal, bool((mask.ahead > 0).any()))
    if problem is not None:
        raise ValueError(f"{_WHAT}: {problem}")
    if mask_mod is not None:
        return mask_mod_attention(
            query, key, value, mask_mod, dropout_p, scale, enable_gqa, _WHAT, softcap, sinks
        )
    if mask is not None:
        return described_attention(
            query, key, value, mask, attn_mask, dropout_p, scale, enable_gqa, softcap, sinks
        )
    return plain_attention(
        query, key, value, attn_mask, dropout_p, causal, scale, enable_gqa,
        window, softcap, sinks,
    )  # fmt: skip


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
    elif min(q.shape[1], k.shape[1]) < 1:
        problem = f"q and k need at least one head, got {q.shape[1]} and {k.shape[1]}"
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


def _mask_digest(mask: MaskDescription | None) -> list[int]:
    """A consensus field of a mask description: its segments and their rules."""
    if mask is None:
        return digest(None)
    cols = (mask.row, mask.start, mask.end, mask.lo, mask.back, mask.hi, mask.ahead)
    return [mask.rows, mask.length, *digest(torch.cat(cols))]


def _fields(
    state: AttentionState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> Callable[[], dict[str, Sequence[int]]]:
    """What every rank's call must agree on (checked mode only: it reads the step's plan)."""
    return lambda: {
        "mask": _mask_digest(state.mask),
        "layout": digest([ord(c) for c in state.layout]),
        "dtype": [dtype_code(q.dtype)],
        "device type": [device_code(q)],
        "q, k, v heads and dims": [q.shape[1], k.shape[1], q.shape[3], k.shape[3], v.shape[3]],
        # ranks that differ here would block in the backward exchange
        "requires_grad": [int(torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))],
        "window, softcap, sinks": [
            window or 0,
            *digest([ord(c) for c in repr(softcap)]),
            int(sinks is not None),
        ],
        "exchange plan": digest(state.windowed(window if state.causal else None).exchange.plan),
        "strategy": digest([ord(c) for c in state.strategy]),
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
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    mask: MaskDescription | None = None,
    mask_mod: MaskMod | None = None,
    mask_mod_documents: bool = True,
) -> torch.Tensor:
    """Attention within documents under the step's ``state``: causal, bidirectional
    (``causal=False``) or ``mask``'s (a :class:`~cpshard.masks.MaskDescription` of the step's
    batch, planned once per description object and step), with the ``window``, ``softcap`` and
    ``sinks`` variants (:func:`cp_attention`): the step's K/V exchange, then the spans'
    attention. Or ``mask_mod``'s (within documents unless ``mask_mod_documents`` is False;
    :mod:`cpshard.attention.mask_mod`, whatever the step's strategy). ``problem``: the
    caller's own finding about its arguments, reported like the shape checks (locally, or on
    every rank in checked mode), as is a description or function the step cannot execute."""
    note_cpshard_mixing()
    chosen = state
    if problem is None and mask_mod is None:
        try:
            chosen = state.variant(causal, mask)
        except ValueError as e:  # a description of another batch, or one it cannot execute
            problem = str(e)
        else:
            problem = _causal_claim_problem(mask, causal, chosen.looks_ahead)
    problem = problem or _problem(chosen, query, key, value, attn_mask, dropout_p, enable_gqa)
    planned = None
    if problem is None and mask_mod is not None:
        try:
            planned = mask_mod_state(state, mask_mod, query.shape[1], mask_mod_documents)
        except ValueError as e:  # a function that does not return the broadcast bool tensor
            problem = str(e)
        else:
            chosen = planned.carrier
    fields = _fields(chosen, query, key, value, window, softcap, sinks)
    check_call(chosen.group, what, problem, fields)
    if planned is not None:
        return planned.attend(query, key, value, scale, enable_gqa, softcap, sinks)
    d_k = key.shape[-1]
    size = query.element_size()
    plan = route(chosen, window, query.shape[1], key.shape[1], d_k, value.shape[-1], size)
    if plan is not None:
        return head_parallel_attention(
            plan, chosen.causal, query, key, value, scale, window, softcap, sinks, chosen.mask
        )
    out, _ = cp_attention_op(query, key, value, chosen.key, scale, window, softcap, sinks)
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
    *,
    mask_mod: MaskMod | None = None,
    mask_mod_documents: bool = True,
) -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention``: plain SDPA when no CP attention state is
    active; otherwise causal attention within each document across the CP group, whatever
    ``is_causal`` says (``attn_mask`` must be None and ``dropout_p`` 0: the documents define the
    mask). :func:`cpshard.cp_attention` honours ``is_causal`` and ``window`` instead.
    ``mask_mod`` (and ``mask_mod_documents``): a FlexAttention-style mask function, as
    :func:`cpshard.cp_attention` takes it (``is_causal`` must then be False; outside a context,
    SDPA under its dense mask).

    Checks are local (shapes against the step's sizes) unless checked mode is on, which adds one
    consensus round so that bad input on one rank makes every rank raise."""
    mask_mod = _mask_mod(mask_mod, mask_mod_documents, _SDPA_WHAT)
    problem = _mask_mod_problem(mask_mod, None, None, is_causal, attn_mask)
    state = active_state()
    if state is None:
        if problem is not None:
            raise ValueError(f"{_SDPA_WHAT}: {problem}")
        if mask_mod is not None:
            return mask_mod_attention(
                query, key, value, mask_mod, dropout_p, scale, enable_gqa, _SDPA_WHAT
            )
        return plain_attention(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )
    return attend(
        state, query, key, value, attn_mask, dropout_p, scale, enable_gqa, _SDPA_WHAT, problem,
        mask_mod=mask_mod, mask_mod_documents=mask_mod_documents,
    )  # fmt: skip
