"""Block-diagonal CP attention: :func:`cpshard.cp_blockdiag_sdpa` next to the straightforward way.

The baseline all-gathers the full K and V (differentiably: list all-gather + cat, backward
reduce-scatter), builds this rank's dense block-diagonal causal mask ``[L, S]`` and calls SDPA.
cpshard receives only the K/V rows its documents reach back to and attends per document.
Shapes follow the issue: 8 query heads, 2 KV heads, head dim 64, documents of 512 tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpshard.bench.baselines import ListAllGatherCat
from cpshard.bench.memory import peak_extra_bytes
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps
from cpshard.blockdiag import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

HEADS, KV_HEADS, HEAD_DIM, DOC_LEN = 8, 2, 64, 512


def default_seq_len(world: int) -> int:
    """The issue's sizes: S = 4096 at W = 2, S = 16384 at W = 4 (4096 tokens per rank)."""
    return 4096 if world <= 2 else 4096 * world


def _dense_mask(doc: torch.Tensor, start: int, length: int) -> torch.Tensor:
    """This rank's rows of the block-diagonal causal mask, ``[1, 1, L, S]`` (True = attend)."""
    pos = torch.arange(doc.shape[1])
    rows = slice(start, start + length)
    same = (doc[0, rows, None] == doc[0, None, :]) & (doc[0, rows, None] != 0)
    return (same & (pos[rows, None] >= pos[None, :]))[None, None]


def _baseline(rt: Runtime, mask: torch.Tensor):
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_full = ListAllGatherCat.apply(k, rt.pg, 2)
        v_full = ListAllGatherCat.apply(v, rt.pg, 2)
        return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, enable_gqa=True)

    return attend


def run_blockdiag(rt: Runtime, seq_len: int) -> dict:
    """fwd+bwd time and peak extra memory of both, at one sequence length (same on every rank)."""
    world, rank = rt.world, rt.rank
    if seq_len % world:
        raise ValueError(f"blockdiag: seq_len={seq_len} must be a multiple of the world size {world}")
    local = seq_len // world
    doc = (torch.arange(seq_len) // DOC_LEN + 1).view(1, seq_len)
    batch = {"inputs_embeds": torch.zeros(1, seq_len, 1), "_packed_seq_ids": doc}
    ctx, _ = make_cp_blockdiag_batch_and_ctx(rt.pg, None, batch)
    gen = torch.Generator().manual_seed(99 + rank)

    def make(heads: int) -> torch.Tensor:
        t = torch.randn(1, heads, local, HEAD_DIM, generator=gen).to(device=rt.device, dtype=rt.dtype)
        return t.requires_grad_(True)

    q, k, v = make(HEADS), make(KV_HEADS), make(KV_HEADS)
    grad = torch.randn(1, HEADS, local, HEAD_DIM, generator=gen).to(device=rt.device, dtype=rt.dtype)
    mask = _dense_mask(doc, rank * local, local).to(rt.device)
    base = _baseline(rt, mask)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with ctx():
            return cp_blockdiag_sdpa(q, k, v, enable_gqa=True)

    want, got = base(q, k, v).detach(), ours(q, k, v).detach()
    tol = 1e-4 if rt.dtype in (torch.float32, torch.float64) else 3e-2
    if not torch.allclose(want, got, rtol=tol, atol=tol):
        raise AssertionError(f"rank {rank}: blockdiag: cpshard's output differs from the baseline's")

    def step(impl):
        def run() -> None:
            for t in (q, k, v):
                t.grad = None
            impl(q, k, v).backward(grad)

        return run

    steps = {"ours": step(ours), "base": step(base)}
    timings = time_steps(rt, steps, warmup=rt.cfg.warmup, repeats=rt.cfg.repeats, iters=rt.cfg.iters,
                         target_s=rt.cfg.target_s)
    out = {"op": "blockdiag", "seq_len": seq_len, "world": world, "heads": HEADS, "kv_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "doc_len": DOC_LEN}
    for who in steps:
        out[f"{who}_fwd_bwd_s"] = timings[who].median_s
        out[f"{who}_fwd_bwd_repeats_s"] = list(timings[who].repeats_s)
        if rt.cfg.memory:
            out[f"{who}_fwd_bwd_peak_bytes"] = peak_extra_bytes(rt, steps[who])
    out["speedup"] = out["base_fwd_bwd_s"] / out["ours_fwd_bwd_s"]
    return out
