"""The flash-attn package's FlashAttention-2 varlen kernels (2.7 and later), for soft-capped
logits where FA3 does not run: torch's own copy of the FA2 kernels takes no soft-cap, the
package's does (``softcap * tanh(score / softcap)`` in the kernel, forward and backward).

Called through the package's torch ops (``torch.ops.flash_attn._flash_attn_varlen_forward`` /
``_flash_attn_varlen_backward``, registered by ``import flash_attn``), never through
``flash_attn_varlen_func``: that is an autograd function, which a custom op's explicit backward
cannot call. The contract is :class:`~cpshard.attention.kernels.TorchFlashVarlen`'s (the same
kernels): varlen ``[tokens, heads, D]``, GQA in the kernel, causal aligned bottom-right, the
window as the left window, log-sum-exp ``[heads, tokens]`` fp32.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from cpshard.attention.kernels import (
    Grads,
    T,
    Tensors,
    TorchFlashVarlen,
    device_capability,
    op_takes,
)
from cpshard.attention.packing import Packing

# The arguments FlashAttnVarlen passes by keyword (the package's 2.7 / 2.8 op schemas)
FORWARD_ARGS = {
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
    "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
}  # fmt: skip
BACKWARD_ARGS = FORWARD_ARGS | {"alibi_slopes", "deterministic"}


def compatible(ops: Any) -> bool:
    """Whether an op namespace has the package's varlen forward and backward with the
    arguments cpshard passes."""
    forward = getattr(ops, "_flash_attn_varlen_forward", None)
    backward = getattr(ops, "_flash_attn_varlen_backward", None)
    return op_takes(forward, FORWARD_ARGS) and op_takes(backward, BACKWARD_ARGS)


@functools.cache
def flash_attn_ops() -> Any | None:
    """The flash-attn package's op namespace (``torch.ops.flash_attn``) where ``flash_attn``
    imports and registers varlen ops cpshard can call, else None (looked up once)."""
    try:
        importlib.import_module("flash_attn")
    except Exception:  # absent, or built for another torch / CUDA
        return None
    return torch.ops.flash_attn if compatible(torch.ops.flash_attn) else None


def runs_flash_attn(q: torch.Tensor) -> bool:
    """Whether ``q`` is a tensor the package's FA2 kernels take on a device they run on: CUDA
    fp16/bf16 on an sm80+ GPU."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    return q.is_cuda and half and device_capability(q.device) >= (8, 0)


def flash_attn_serving(q: torch.Tensor, d: int) -> Any | None:
    """The package's op namespace where its varlen kernels serve queries ``q`` with q/k and v
    head dim ``d`` (a multiple of 8, at most 256), else None."""
    fits = d % 8 == 0 and d <= 256
    return flash_attn_ops() if fits and runs_flash_attn(q) else None


class FlashAttnVarlen:
    """The flash-attn package's varlen kernels with a soft-cap, dropout off; windows as
    :class:`TorchFlashVarlen` passes them (never FlashAttention-2's single-query head-group
    swap)."""

    name = "flash_attn_varlen"

    def __init__(self, ops: Any, softcap: float) -> None:
        self.ops, self.softcap = ops, float(softcap)

    def _args(self, p: Packing, scale: float | None, d: int) -> dict[str, Any]:
        window = {k: -1 if w is None else w for k, w in TorchFlashVarlen._window(p).items()}
        return {
            "cu_seqlens_q": p.cu_q,
            "cu_seqlens_k": p.cu_k,
            "max_seqlen_q": p.max_q,
            "max_seqlen_k": p.max_k,
            "dropout_p": 0.0,
            "softmax_scale": d**-0.5 if scale is None else scale,
            "causal": p.causal,
            **window,
            "softcap": self.softcap,
        }

    def forward(self, q: T, k: T, v: T, p: Packing, scale: float | None) -> Tensors:
        out, lse, *_ = self.ops._flash_attn_varlen_forward(
            q, k, v, **self._args(p, scale, q.shape[-1])
        )
        return out, lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, p: Packing, scale: float | None
    ) -> Grads:
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        self.ops._flash_attn_varlen_backward(
            grad, q, k, v, out, lse, dq, dk, dv, **self._args(p, scale, q.shape[-1]),
            alibi_slopes=None, deterministic=torch.are_deterministic_algorithms_enabled(),
        )  # fmt: skip
        return dq, dk, dv
