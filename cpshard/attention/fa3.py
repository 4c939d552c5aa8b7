"""FlashAttention-3 (Hopper, sm 9.x) as CP attention's kernels, called through the FA3 package's
own torch ops (``torch.ops.flash_attn_3.fwd`` / ``bwd``, registered by ``import
flash_attn_interface``): varlen sequences, GQA, causal aligned bottom-right, left windows and
soft-capped logits (``softcap * tanh(score / softcap)``) all in the kernel. Nothing global is
switched on: torch's ``activate_flash_attention_impl("FA3")`` reroutes every flash call of the
process, which a library must not do on its user's behalf.

* :class:`Fa3Varlen`: the varlen path's kernel, ONE launch per packing (the contract of
  :class:`~cpshard.attention.kernels.TorchFlashVarlen`, log-sum-exp ``[heads, tokens]`` fp32);
* :class:`Fa3Part`: the per-span loop's part kernel (every key visible, or causal over a square
  part), GQA and K/V views of any strides in the kernel. Given the MERGED output and
  log-sum-exp of several parts, its backward is the part's exact share (FA3's backward reads the
  output only in ``D = rowsum(dout * out)`` and rebuilds ``P = exp(cap(S) - lse)``); a part
  under an additive mask (the loop's blocks) goes to the explicit kernel.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from cpshard.attention.kernels import (
    Grads,
    MathPart,
    T,
    Tensors,
    Visible,
    device_capability,
    fold_heads,
    op_takes,
    repeat_heads,
)
from cpshard.attention.packing import Packing

HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # FA3's largest head dim (a multiple of 8), forward and backward


def runs_fa3(q: torch.Tensor) -> bool:
    """Whether ``q`` is a tensor FA3 takes on a device it runs on: CUDA fp16/bf16 on an sm 9.x
    GPU (the capability read once per device)."""
    return q.is_cuda and q.dtype in HALF and device_capability(q.device)[0] == 9


# The keywords Fa3Varlen / Fa3Part pass (FA3's op schemas name them so)
FWD_ARGS = {
    "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
    "is_causal", "window_size_left", "window_size_right", "softcap",
}  # fmt: skip
BWD_ARGS = FWD_ARGS | {"dq", "dk", "dv", "deterministic"}


def compatible(ops: Any) -> bool:
    """Whether an op namespace has FA3's ``fwd`` and ``bwd`` with the arguments cpshard passes."""
    return op_takes(getattr(ops, "fwd", None), FWD_ARGS) and op_takes(
        getattr(ops, "bwd", None), BWD_ARGS
    )


@functools.cache
def fa3_ops() -> Any | None:
    """The FA3 package's op namespace (``torch.ops.flash_attn_3``) where ``flash_attn_interface``
    imports and registers ops cpshard can call, else None (looked up once)."""
    try:
        importlib.import_module("flash_attn_interface")
    except Exception:  # absent, or built for another torch / CUDA: not this process's kernel
        return None
    return torch.ops.flash_attn_3 if compatible(torch.ops.flash_attn_3) else None


def fa3_serving(q: torch.Tensor, d: int) -> Any | None:
    """The FA3 op namespace where FA3 serves queries ``q`` with q/k and v head dim ``d`` (a
    multiple of 8, at most 256; with deterministic algorithms at most 192, FA3's deterministic
    backward limit), else None."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    fits = d % 8 == 0 and d <= (192 if deterministic else MAX_HEAD_DIM)
    return fa3_ops() if fits and runs_fa3(q) else None


def _cap(softcap: float | None) -> float:
    return 0.0 if softcap is None else float(softcap)


class Fa3Varlen:
    """FA3's varlen kernels over a :class:`Packing`: a windowed packing's window is the left
    window (keys ``window - 1`` before a query and the query itself)."""

    name = "fa3_varlen"

    def __init__(self, ops: Any, softcap: float | None = None) -> None:
        self.ops, self.softcap = ops, softcap

    def _args(self, p: Packing, scale: float | None) -> dict[str, Any]:
        left, right = (p.window - 1, 0) if p.window is not None else (-1, -1)
        return {
            "cu_seqlens_q": p.cu_q,
            "cu_seqlens_k": p.cu_k,
            "max_seqlen_q": p.max_q,
            "max_seqlen_k": p.max_k,
            "softmax_scale": scale,
            "is_causal": p.causal,
            "window_size_left": left,
            "window_size_right": right,
            "softcap": _cap(self.softcap),
        }

    def forward(self, q: T, k: T, v: T, p: Packing, scale: float | None) -> Tensors:
        out, lse, *_ = self.ops.fwd(q, k, v, **self._args(p, scale))
        return out, lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, p: Packing, scale: float | None
    ) -> Grads:
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
        self.ops.bwd(
            grad, q, k, v, out, lse, dq, dk, dv, **self._args(p, scale),
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )  # fmt: skip
        return dq, dk, dv


class Fa3Part:
    """FA3's dense kernels on one part (queries ``[1, H, n, D]``, keys ``[1, Hkv, m, D]``, GQA in
    the kernel); a part under an additive mask goes to :class:`MathPart` with the K/V heads
    repeated."""

    name = "fa3_part"
    grouped = True  # K/V views of any strides, fewer KV heads than query heads

    def __init__(self, ops: Any, softcap: float | None = None) -> None:
        self.ops, self.softcap = ops, softcap
        self.masked = MathPart(softcap)

    def forward(self, q: T, k: T, v: T, how: Visible, scale: float | None) -> Tensors:
        if isinstance(how, torch.Tensor):
            heads = q.shape[1]
            return self.masked.forward(
                q, repeat_heads(k, heads), repeat_heads(v, heads), how, scale
            )
        out, lse, *_ = self.ops.fwd(
            *(t.transpose(1, 2) for t in (q, k, v)),
            softmax_scale=scale, is_causal=how, softcap=_cap(self.softcap),
        )  # fmt: skip
        return out.transpose(1, 2), lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: Visible, scale: float | None
    ) -> Grads:
        if isinstance(how, torch.Tensor):
            heads, kv_heads = q.shape[1], k.shape[1]
            wide = repeat_heads(k, heads), repeat_heads(v, heads)
            dq, dk, dv = self.masked.backward(grad, q, *wide, out, lse, how, scale)
            return dq, fold_heads(dk, kv_heads), fold_heads(dv, kv_heads)
        bshd = [t.transpose(1, 2) for t in (grad, q, k, v, out)]
        dq, dk, dv = (torch.empty_like(t) for t in bshd[1:4])
        self.ops.bwd(
            *bshd, lse.contiguous(), dq, dk, dv,
            softmax_scale=scale, is_causal=how, softcap=_cap(self.softcap),
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )  # fmt: skip
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
