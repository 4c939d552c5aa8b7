"""CP attention as ``torch.library`` custom ops, so that ``torch.compile`` traces a call as one
opaque node (and its backward as another) and never sees the step's spans.

* ``cpshard::cp_attention(q, k, v, key, scale, window, softcap, sinks)`` -> ``(out, lse)``:
  the step's K/V exchange (:mod:`cpshard.attention.exchange`) builds the key buffer from this
  rank's K and V (joined on the last dim for the one transfer) and the spans attend it
  (:mod:`cpshard.attention.engine`). It saves only this rank's own K and V (the caller's
  tensors: no copy): the backward (``cpshard::cp_attention_backward``, from the saved output and
  log-sum-exp) runs the exchange again and sends the buffer's gradients back to their owners
  (an all-padding rank joins too). A model's layers thus keep their own K/V for backward, not
  the exchanged buffer (up to W times larger for long documents or ``stripe``), for one more
  exchange per layer. Where the step exchanges nothing (a group of one, as head-parallel
  attention's inner state on its gathered tokens), K and V go to the kernels as they are and
  their gradients come back apart: nothing is joined either way.

The attention variants of today's models, each exact forward and backward:

* ``window``: a sliding window (keys a query sees, itself included); the step's windowed state
  (:meth:`~cpshard.attention.state.AttentionState.windowed`) exchanges only the rows the
  windows reach and its spans start where their windows do;
* ``softcap``: logits ``softcap * tanh(score / softcap)`` (in the flash kernel where one takes
  it, FA3 or the flash-attn package's FA2, else the explicit kernel: :mod:`~.choice`);
* ``sinks``: a learned logit per query head in every softmax denominator, with no value (the
  output scaled by ``sigmoid(lse - sink)``); its gradient is returned;
* q/k and v head dims that differ (multi-head latent attention): the smaller side is padded
  with zeros to the larger after the exchange (nothing padded on the wire), which changes no
  score and no output.

``key`` is the step state's CPU scalar key (:func:`cpshard.attention.state.state_for`): the
spans, the exchange plan and the varlen packing were computed once per step and moved to the
device once, so a call reads no device data on the host and copies nothing host->device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpshard.attention import engine
from cpshard.attention.kernels import T, lse_dtype
from cpshard.attention.state import AttentionState, state_for


def _widen(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` with zeros appended on the last dim up to ``d``."""
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` laid out as ``ref`` (as ``torch.empty_like(ref)``, what the op's fake returns):
    itself when it already is, else a copy."""
    if t.stride() == torch.empty_like(ref, device="meta").stride():  # the layout, no memory
        return t
    return torch.empty_like(ref).copy_(t)


def _gate(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, 1]``: each query's softmax mass left to its keys next to its head's sink."""
    return torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None]).unsqueeze(-1)


def _keys(
    key: torch.Tensor, window: int | None, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> tuple[AttentionState, torch.Tensor, torch.Tensor, int, float]:
    """The call's state (the window's), its key buffer's K and V (this rank's own where the
    step exchanges nothing, else the exchange's buffer of both joined, as views), the head dim
    both sides are padded to, and the scale (q/k's head dim by default)."""
    state = state_for(key).windowed(window)
    d_k = k.shape[-1]
    if not state.exchange.keeps_local:
        kv = state.extend(torch.cat([k, v], dim=-1))
        k, v = kv[..., :d_k], kv[..., d_k:]
    return state, k, v, max(d_k, v.shape[-1]), d_k**-0.5 if scale is None else scale


@torch.library.custom_op("cpshard::cp_attention", mutates_args=())
def cp_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: torch.Tensor,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document causal attention of q ``[B, Hq, L, d_k]`` over the key buffer the step's
    exchange builds from this rank's k ``[B, Hkv, L, d_k]`` and v ``[B, Hkv, L, d_v]``: the
    output ``[B, Hq, L, d_v]`` (zeros on pad rows) and the log-sum-exp of its logits ``[B, Hq,
    L]`` (-inf on pad rows; without the sinks)."""
    state, k, v, d, scale = _keys(key, window, k, v, scale)
    d_v = v.shape[-1]
    q, k, v = (_widen(t, d) for t in (q, k, v))
    out, lse = engine.implementation(state, q, d, softcap).forward(q, k, v, scale)
    del k, v  # the key buffer, freed before the output is laid out
    out = out[..., :d_v]
    if sinks is not None:
        out = out * _gate(lse, sinks).to(out.dtype)
    return out.contiguous(), lse


@cp_attention_op.register_fake
def _cp_attention_op_fake(
    q: T,
    k: T,
    v: T,
    key: T,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: T | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty(*q.shape[:3], v.shape[3])
    return out, q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("cpshard::cp_attention_backward", mutates_args=())
def cp_attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key: torch.Tensor,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, of this rank's ``k`` and ``v`` (laid out as they are) and of the sinks
    (empty without): the exchange again, the spans' backward over the buffer, and the buffer's
    gradients returned to their owners (zeros where no query attends: an all-padding rank still
    joins both exchanges its peers wait for).

    With sinks, ``out`` is the gated output ``O * g`` (``g = sigmoid(lse - sink)``): the kernels'
    backward given ``grad * g`` and the gated output is the exact backward of the gated
    attention (its softmax is the kernels' scaled by ``g``), and the sink's gradient is
    ``-sum((1 - g) * <grad, out>)``."""
    d_k, d_v, length = k.shape[-1], v.shape[-1], k.shape[2]
    key_in, value_in = k, v
    state, k, v, d, scale = _keys(key, window, k, v, scale)
    dsinks = q.new_zeros(0)
    if sinks is not None:
        gate = _gate(lse, sinks)
        mass = (grad.to(gate.dtype) * out.to(gate.dtype)).sum(-1, keepdim=True)
        dsinks = (-((1 - gate) * mass).sum((0, 2, 3))).to(sinks.dtype)
        grad = grad * gate.to(grad.dtype)
    q_, k, v, grad, out = (_widen(t, d) for t in (q, k, v, grad, out))
    impl = engine.implementation(state, q_, d, softcap)  # module attribute: checks route it
    dq, dk, dv = impl.backward(grad, q_, k, v, out, lse, scale)
    dq = _like(dq[..., :d_k], q)
    if state.exchange.keeps_local:  # the kernels' gradients are this rank's own
        return dq, _like(dk[..., :d_k], key_in), _like(dv[..., :d_v], value_in), dsinks
    dkv = engine.joined(dk[..., :d_k], dv[..., :d_v])
    del k, v, dk, dv  # the key buffer and its gradient's views: freed as it goes back
    dkv = state.restore(dkv, length)
    return dq, _like(dkv[..., :d_k], key_in), _like(dkv[..., d_k:], value_in), dsinks


@cp_attention_backward_op.register_fake
def _cp_attention_backward_op_fake(
    grad: T,
    q: T,
    k: T,
    v: T,
    out: T,
    lse: T,
    key: T,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: T | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _keep_attention(ctx, inputs, output) -> None:
    q, k, v, key, ctx.scale, ctx.window, ctx.softcap, sinks = inputs
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(q, k, v, key, *output, sinks)
    ctx.set_materialize_grads(False)  # no zeros made for the log-sum-exp's gradient


def _cp_attention_op_grad(ctx, grad: torch.Tensor, grad_lse: torch.Tensor | None):
    q, k, v, key, out, lse, sinks = ctx.saved_tensors
    if grad is None:  # only the log-sum-exp was used: nothing flows back through the output
        grad = torch.zeros_like(out)
    dq, dk, dv, dsinks = cp_attention_backward_op(
        grad, q, k, v, out, lse, key, ctx.scale, ctx.window, ctx.softcap,
        sinks if ctx.has_sinks else None,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, dsinks if ctx.has_sinks else None


cp_attention_op.register_autograd(_cp_attention_op_grad, setup_context=_keep_attention)
