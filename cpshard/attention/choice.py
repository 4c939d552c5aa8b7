"""Which kernel serves a call's queries, fastest first (host-side checks of dtype, device and
head dim; each device's capability and each package's presence looked up once):

* varlen, plain logits: FlashAttention-3 (:class:`~cpshard.attention.fa3.Fa3Varlen`: CUDA
  fp16/bf16 on sm 9.x with the FA3 package), else torch's FA2 kernels
  (:class:`~cpshard.attention.kernels.TorchFlashVarlen`: CUDA fp16/bf16 on sm80+);
* varlen, soft-capped logits: FA3 with its soft-cap, else the flash-attn package's FA2 kernels
  with theirs (:class:`~cpshard.attention.flash_attn2.FlashAttnVarlen`);
* where none of these serves: the explicit varlen kernel in chunks
  (:class:`~cpshard.attention.kernels.MathVarlen`) where the loop would run the explicit part
  kernel, else the loop;
* the loop's part kernel: FA3 (:class:`~cpshard.attention.fa3.Fa3Part`), else torch's CPU
  flash kernel for CPU queries with plain logits, else the explicit one.
"""

from __future__ import annotations

import torch

from cpshard.attention import fa3, flash_attn2
from cpshard.attention.kernels import (
    CpuFlash,
    MathPart,
    MathVarlen,
    PartKernel,
    TorchFlashVarlen,
    VarlenKernel,
    torch_flash_runs_on,
)


def varlen_kernel(q: torch.Tensor, d_k: int, d_v: int) -> VarlenKernel | None:
    """The one-launch kernel for queries ``q`` with plain logits and equal head dims that the
    flash kernels take (a multiple of 8, at most 256) on a GPU they run on, else None.
    (Unequal q/k and v head dims reach the kernels padded to the larger one.)"""
    if d_k != d_v:
        return None
    ops = fa3.fa3_serving(q, d_k)
    if ops is not None:
        return fa3.Fa3Varlen(ops)
    half = q.dtype in (torch.float16, torch.bfloat16)
    fits = d_k % 8 == 0 and d_k <= 256
    if q.is_cuda and half and fits and torch_flash_runs_on(q.device):
        return TorchFlashVarlen()
    return None


def capped_varlen_kernel(q: torch.Tensor, d: int, softcap: float) -> VarlenKernel | None:
    """The one-launch kernel for soft-capped logits of queries ``q`` with head dim ``d`` (both
    sides): FA3, else the flash-attn package's FA2 kernels, else None."""
    ops = fa3.fa3_serving(q, d)
    if ops is not None:
        return fa3.Fa3Varlen(ops, softcap)
    ops = flash_attn2.flash_attn_serving(q, d)
    return None if ops is None else flash_attn2.FlashAttnVarlen(ops, softcap)


def math_varlen(part: PartKernel) -> MathVarlen | None:
    """The explicit varlen kernel where the loop would run the explicit part kernel ``part``
    (no flash kernel serves the queries), else None."""
    return MathVarlen(part.softcap) if isinstance(part, MathPart) else None


def part_kernel(q: torch.Tensor, softcap: float | None = None) -> PartKernel:
    """The per-segment part kernel for queries ``q`` (their head dim, both sides)."""
    ops = fa3.fa3_serving(q, q.shape[-1])
    if ops is not None:
        return fa3.Fa3Part(ops, softcap)
    return CpuFlash() if q.device.type == "cpu" and softcap is None else MathPart(softcap)
