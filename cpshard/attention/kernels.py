"""The attention kernels CP attention runs, each with an explicit backward (a custom op's
backward cannot use autograd).

* :class:`TorchFlashVarlen`: torch's own varlen flash kernels (``aten._flash_attention_forward``
  / ``_flash_attention_backward``; CUDA fp16/bf16 on sm80+, equal q/k and v head dims that are a
  multiple of 8 up to 256; causal aligned bottom-right, GQA in the kernel): ONE launch per layer
  for every span of the step. No flash-attn package is needed (flash-attn's
  ``flash_attn_varlen_func`` is an autograd function, which a custom op's explicit backward
  cannot call; torch ships the same FA2 kernels).
* Part kernels for the per-span loop: :class:`CpuFlash` (torch's CPU flash kernel) and
  :class:`MathPart` (explicit matmul-softmax, memory O(n * m) per part) for devices and dtypes no
  flash kernel serves (CUDA fp32/fp64, pre-sm80 GPUs, head dims flash does not take): use
  fp16/bf16 on GPUs.
"""

from __future__ import annotations

import functools
from typing import Protocol, TypeVar

import torch

from cpshard.attention.packing import Packing

Tensors = tuple[torch.Tensor, torch.Tensor]
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


How = TypeVar("How", contravariant=True)
T = torch.Tensor


class Kernel(Protocol[How]):
    """An attention kernel with an explicit backward (a custom op's backward cannot use
    autograd). ``how`` says which keys each query sees: a :class:`Packing` for a varlen kernel,
    ``causal`` for a part kernel. The backward takes the forward's output and log-sum-exp."""

    def forward(self, q: T, k: T, v: T, how: How, scale: float | None) -> Tensors: ...

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: How, scale: float | None
    ) -> Grads: ...


# A packed varlen kernel (the contract of torch's varlen flash kernels): ``[tokens, heads, D]``
# sequences delimited by int32 ``cu_q`` / ``cu_k``, causal aligned bottom-right, GQA by head
# groups; ``lse`` is ``[heads, q tokens]`` float32.
VarlenKernel = Kernel[Packing]
# Which keys of a part each query sees: all (False), causal with n == m (True), or an additive
# ``[1, 1, n, m]`` mask in the queries' dtype (0 visible, -inf hidden).
Visible = bool | torch.Tensor
Part = tuple[slice, Visible]  # a key range of the row's key buffer and which keys each query sees
# Queries ``[1, H, n, D]`` over one key part ``[1, H, m, D]``; ``lse`` is ``[1, H, n]``.
PartKernel = Kernel[Visible]


class TorchFlashVarlen:
    """torch's own varlen flash-attention kernels (CUDA fp16/bf16), dropout off."""

    def forward(self, q: T, k: T, v: T, p: Packing, scale: float | None) -> Tensors:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, p.causal, False, scale=scale
        )
        return out, lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, p: Packing, scale: float | None
    ) -> Grads:
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # unused without dropout
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad,
            q,
            k,
            v,
            out,
            lse,
            p.cu_q,
            p.cu_k,
            p.max_q,
            p.max_k,
            0.0,
            p.causal,
            rng,
            unused,
            scale=scale,
        )
        return dq, dk, dv


@functools.cache
def _flash_runs_on(device: torch.device) -> bool:
    """torch's flash kernels run on this GPU: built in, and an sm80+ device (a host query)."""
    return torch.backends.cuda.is_flash_attention_available() and (
        torch.cuda.get_device_capability(device) >= (8, 0)
    )


def varlen_kernel(q: torch.Tensor, d_k: int, d_v: int) -> VarlenKernel | None:
    """The one-launch kernel for CUDA fp16/bf16 queries with equal head dims that the flash
    kernels take (a multiple of 8, at most 256) on a GPU they run on, else None (the loop)."""
    fits = d_k == d_v and d_k % 8 == 0 and d_k <= 256
    half = q.dtype in (torch.float16, torch.bfloat16)
    if q.is_cuda and half and fits and _flash_runs_on(q.device):
        return TorchFlashVarlen()
    return None


class CpuFlash:
    """torch's CPU flash kernels. Given the MERGED output and log-sum-exp of several parts, the
    backward of each part is its exact share of the joint softmax's gradient."""

    def forward(self, q: T, k: T, v: T, how: Visible, scale: float | None) -> Tensors:
        causal, mask = _causal_and_mask(how)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        return out, lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: Visible, scale: float | None
    ) -> Grads:
        causal, mask = _causal_and_mask(how)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )


def _causal_and_mask(how: Visible) -> tuple[bool, torch.Tensor | None]:
    return (False, how) if isinstance(how, torch.Tensor) else (how, None)


class MathPart:
    """Explicit matmul-softmax (fp16/bf16 computed in fp32), for devices and dtypes no flash
    kernel serves (CUDA fp32/fp64, pre-sm80 GPUs, head dims flash does not take)."""

    @staticmethod
    def _probs(
        q: torch.Tensor,
        k: torch.Tensor,
        lse: torch.Tensor | None,
        how: Visible,
        scale: float | None,
    ) -> Tensors:
        s = scale if scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-1, -2)) * s
        if isinstance(how, torch.Tensor):
            scores = scores + how.to(scores.dtype)
        elif how:
            n = q.shape[2]
            scores = scores.masked_fill(
                torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q: T, k: T, v: T, how: Visible, scale: float | None) -> Tensors:
        wide = lse_dtype(q.dtype)  # fp16/bf16 computed in fp32
        probs, lse = self._probs(q.to(wide), k.to(wide), None, how, scale)
        return (probs @ v.to(wide)).to(q.dtype), lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: Visible, scale: float | None
    ) -> Grads:
        s = scale if scale is not None else q.shape[-1] ** -0.5
        dtype, wide = q.dtype, lse_dtype(q.dtype)
        grad, q, k, v, out = (t.to(wide) for t in (grad, q, k, v, out))
        probs, _ = self._probs(q, k, lse, how, scale)
        dv = probs.transpose(-1, -2) @ grad
        dscores = probs * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True)) * s
        return tuple(t.to(dtype) for t in (dscores @ k, dscores.transpose(-1, -2) @ q, dv))


def part_kernel(q: torch.Tensor) -> PartKernel:
    """The per-segment part kernel for q's device."""
    return CpuFlash() if q.device.type == "cpu" else MathPart()
