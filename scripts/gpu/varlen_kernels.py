"""The bench stage's attention kernels, side by side on one step of packed documents (world size
1, bf16 on the GPU): forward + backward of ``cpshard.cp_attention`` with each varlen kernel
cpshard can run forced in turn — torch's FA2 flash op, FlashAttention-3, the flash-attn
package's FA2 kernels (soft-capped logits only: the plain ones are torch's), the explicit
kernel in chunks — plain and soft-capped, against the same forward + backward of per-document
SDPA (which has no soft-cap: the plain kernels' yardstick, and the soft-capped ones' floor).

A kernel this machine cannot run (no GPU, another architecture, its package absent) is
recorded as not available with the reason, never timed. Which kernel cpshard's own choice ran
(:func:`cpshard.attention_kernel`) is recorded for plain and soft-capped logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

import cpshard
from cpshard.attention import engine, fa3, flash_attn2
from cpshard.attention.kernels import (
    MathVarlen,
    TorchFlashVarlen,
    VarlenKernel,
    torch_flash_runs_on,
)

import timing  # beside this script: the GPU check puts its folder on the path

SOFTCAP = 50.0  # Gemma 2's attention logit soft-cap
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def _kernels(q: torch.Tensor) -> dict[str, tuple[VarlenKernel | None, VarlenKernel | None] | str]:
    """Each varlen kernel's (plain, soft-capped) instances where it serves ``q`` here (None: it
    takes no such logits), else why not."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    torch_flash = q.is_cuda and half and torch_flash_runs_on(q.device)
    three = fa3.fa3_serving(q, HEAD_DIM)
    package = flash_attn2.flash_attn_serving(q, HEAD_DIM)
    return {
        "torch_flash_varlen": (TorchFlashVarlen(), None)
        if torch_flash
        else "not available: needs CUDA fp16/bf16 on an sm80+ GPU",
        "fa3_varlen": (fa3.Fa3Varlen(three), fa3.Fa3Varlen(three, SOFTCAP))
        if three is not None
        else "not available: needs CUDA fp16/bf16 on an sm 9.x GPU and the FA3 package "
        "(flash_attn_interface)",
        "flash_attn_varlen": (None, flash_attn2.FlashAttnVarlen(package, SOFTCAP))
        if package is not None
        else "not available: needs CUDA fp16/bf16 on an sm80+ GPU and the flash-attn package",
        "math_varlen": (MathVarlen(), MathVarlen(SOFTCAP)),
    }


@contextmanager
def _forced(kern: VarlenKernel) -> Iterator[None]:
    """The engine's varlen choice replaced by ``kern`` (plain and soft-capped alike)."""
    saved = engine.varlen_kernel, engine.capped_varlen_kernel
    engine.varlen_kernel = lambda q, d_k, d_v: kern
    engine.capped_varlen_kernel = lambda q, d, softcap: kern
    try:
        yield
    finally:
        engine.varlen_kernel, engine.capped_varlen_kernel = saved


def bench(device: str, repeats: int, docs: list[int]) -> dict:
    """Forward + backward milliseconds of each kernel, plain and soft-capped, next to
    per-document SDPA, and the kernels cpshard's own choice ran."""
    low = torch.bfloat16 if device == "cuda" else torch.float32
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(docs)])[None]
    ctx, local = cpshard.ContextParallelSharder(None, "contiguous").shard(
        {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    position_ids = local["position_ids"].to(device)
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, doc.shape[1], HEAD_DIM, generator=g).to(device, low).requires_grad_()
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    grad = torch.randn(1, HEADS, doc.shape[1], HEAD_DIM, generator=g).to(device, low)

    def step(softcap: float | None) -> Callable[[], object]:
        def run() -> object:
            with ctx():
                out = cpshard.cp_attention(
                    q, k, v, is_causal=True, enable_gqa=True, softcap=softcap,
                    position_ids=position_ids,
                )  # fmt: skip
            return torch.autograd.grad(out, (q, k, v), grad)

        return run

    def per_document() -> object:
        at, outs = 0, []
        for n in docs:
            sl = slice(at, at + n)
            outs.append(
                F.scaled_dot_product_attention(
                    q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True, enable_gqa=True
                )
            )
            at += n
        return torch.autograd.grad(torch.cat(outs, 2), (q, k, v), grad)

    sdpa_ms = timing.median_ms(per_document, device, repeats)
    kernels: dict[str, dict] = {}
    for name, found in _kernels(q).items():
        if isinstance(found, str):
            kernels[name] = {"available": False, "why": found}
            continue
        row: dict[str, object] = {"available": True}
        for logits, kern, softcap in (("plain", found[0], None), ("softcap", found[1], SOFTCAP)):
            if kern is None:
                row[f"{logits}_ms"] = None
                continue
            with _forced(kern):
                ms = timing.median_ms(step(softcap), device, repeats)
                row[f"{logits}_ran"] = cpshard.attention_kernel()
            row[f"{logits}_ms"] = ms
            row[f"{logits}_vs_sdpa"] = ms / sdpa_ms
        kernels[name] = row
    chosen = {}
    for logits, softcap in (("plain", None), ("softcap", SOFTCAP)):
        step(softcap)()
        chosen[logits] = cpshard.attention_kernel()
    return {
        "documents": docs,
        "heads": [HEADS, KV_HEADS, HEAD_DIM],
        "softcap": SOFTCAP,
        "per_document_sdpa_fwd_bwd_ms": sdpa_ms,
        "kernels": kernels,
        "chosen": chosen,
    }
