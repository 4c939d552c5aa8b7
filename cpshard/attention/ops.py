"""CP attention as ``torch.library`` custom ops, so that ``torch.compile`` traces a call as one
opaque node (and its backward as another) and never sees the step's spans.

* ``cpshard::cp_attention(q, kv, key, d_k, scale)`` -> ``(out, lse)``: the step's K/V exchange
  (:mod:`cpshard.attention.exchange`) builds the key buffer from this rank's K and V
  (concatenated on the last dim) and the spans attend it (:mod:`cpshard.attention.engine`). It
  saves only this rank's own K/V: the backward (``cpshard::cp_attention_backward``, from the
  saved output and log-sum-exp) runs the exchange again and sends the buffer's gradients back
  to their owners (an all-padding rank joins too). A model's layers thus keep their own K/V for
  backward, not the exchanged buffer (up to W times larger for long documents or ``stripe``),
  for one more exchange per layer.

``key`` is the step state's CPU scalar key (:func:`cpshard.attention.state.state_for`): the
spans, the exchange plan and the varlen packing were computed once per step and moved to the
device once, so a call reads no device data on the host and copies nothing host->device.
"""

from __future__ import annotations

import torch

from cpshard.attention.engine import implementation
from cpshard.attention.kernels import T, Tensors, lse_dtype
from cpshard.attention.state import state_for


def _split(kv: torch.Tensor, d_k: int) -> Tensors:
    return kv[..., :d_k], kv[..., d_k:]


@torch.library.custom_op("cpshard::cp_attention", mutates_args=())
def cp_attention_op(
    q: torch.Tensor, kv: torch.Tensor, key: torch.Tensor, d_k: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document causal attention of q ``[B, Hq, L, d_k]`` over the key buffer the step's
    exchange builds from this rank's ``kv`` ``[B, Hkv, L, d_k + d_v]``: the output
    ``[B, Hq, L, d_v]`` (zeros on pad rows) and its log-sum-exp ``[B, Hq, L]`` (-inf on pad
    rows)."""
    state = state_for(key)
    k, v = _split(state.extend(kv), d_k)
    return implementation(state, q, d_k, v.shape[-1]).forward(q, k, v, scale)


@cp_attention_op.register_fake
def _cp_attention_op_fake(
    q: T, kv: T, key: T, d_k: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty(*q.shape[:3], kv.shape[3] - d_k)
    return out, q.new_empty(q.shape[:3], dtype=lse_dtype(q.dtype))


@torch.library.custom_op("cpshard::cp_attention_backward", mutates_args=())
def cp_attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key: torch.Tensor,
    d_k: int,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of q and of this rank's ``kv``: the exchange again, the spans' backward over
    the buffer, and the buffer's gradients returned to their owners (zeros where no query
    attends: an all-padding rank still joins both exchanges its peers wait for)."""
    state = state_for(key)
    k, v = _split(state.extend(kv), d_k)
    impl = implementation(state, q, d_k, v.shape[-1])
    dq, dk, dv = impl.backward(grad.contiguous(), q, k, v, out, lse, scale)
    return dq, state.restore(torch.cat([dk, dv], dim=-1), kv.shape[2])


@cp_attention_backward_op.register_fake
def _cp_attention_backward_op_fake(
    grad: T, q: T, kv: T, out: T, lse: T, key: T, d_k: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(kv)


def _keep_attention(ctx, inputs, output) -> None:
    q, kv, key, ctx.d_k, ctx.scale = inputs
    ctx.save_for_backward(q, kv, key, *output)


def _cp_attention_op_grad(ctx, grad: torch.Tensor, grad_lse: torch.Tensor | None):
    q, kv, key, out, lse = ctx.saved_tensors
    dq, dkv = cp_attention_backward_op(grad, q, kv, out, lse, key, ctx.d_k, ctx.scale)
    return dq, dkv, None, None, None


cp_attention_op.register_autograd(_cp_attention_op_grad, setup_context=_keep_attention)
