"""One causal document under the ``heads`` strategy (contiguous shards, one batch row: the
all-to-alls' strided passes, in one call or in rounds, and the kernel's whole-tensor path with
GQA in the kernel) against plain SDPA over the full sequence, forward and float64 backward,
W = 1-4, MHA and GQA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

S, D = 24, 8
HEADS = [(4, 4), (4, 2), (4, 1)]


def _full(q_heads: int, kv_heads: int) -> list[torch.Tensor]:
    """q, k, v ``[1, H, S, D]`` and the loss weights of the output (the same on every rank)."""
    g = torch.Generator().manual_seed(5)
    shapes = (q_heads, kv_heads, kv_heads, q_heads)
    return [torch.randn(1, h, S, D, dtype=torch.float64, generator=g) for h in shapes]


def _distributed(rank: int, world: int, q_heads: int, kv_heads: int, rounds: bool) -> list:
    """This rank's output and q, k, v gradients."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention
    from cpshard.comm import heads

    doc = torch.ones(1, S, dtype=torch.int64)
    ctx, _ = ContextParallelSharder(dist.group.WORLD, "contiguous", strategy="heads").shard(
        {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    mine = slice(rank * S // world, (rank + 1) * S // world)
    *qkv, w = (t[:, :, mine] for t in _full(q_heads, kv_heads))
    qkv = [t.clone().requires_grad_() for t in qkv]
    saved = heads.ROUND_BYTES
    try:
        heads.ROUND_BYTES = 1 if rounds else saved
        with ctx():
            out = cp_attention(*qkv, enable_gqa=True)
        (out * w).sum().backward()
    finally:
        heads.ROUND_BYTES = saved
    return [out.detach(), *(t.grad for t in qkv)]


@pytest.mark.parametrize("rounds", [False, True], ids=["one", "rounds"])
@pytest.mark.parametrize("q_heads,kv_heads", HEADS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_one_document_matches_sdpa(
    pools, world: int, q_heads: int, kv_heads: int, rounds: bool
) -> None:
    got = pools(world).run(_distributed, q_heads, kv_heads, rounds, timeout=300)
    *qkv, w = _full(q_heads, kv_heads)
    qkv = [t.requires_grad_() for t in qkv]
    want = F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad((want * w).sum(), qkv)
    for rank, (out, *mine) in enumerate(got):
        at = slice(rank * S // world, (rank + 1) * S // world)
        torch.testing.assert_close(out, want.detach()[:, :, at], rtol=0, atol=1e-12)
        for g, ref in zip(mine, grads, strict=True):
            torch.testing.assert_close(g, ref[:, :, at], rtol=0, atol=1e-12)
