"""CP attention for every sharder layout against a single-process dense reference.

Every rank shards full q/k/v (``[B, H, S, D]``, float64) with the sharder of the layout under
test, attends inside the sharder's context with ``cpshard.cp_attention`` and back-propagates its
share of a weighted sum; the gathered outputs and the summed gradients of the full q/k/v must
equal dense per-document causal attention (:func:`test_blockdiag._reference`).
"""

from __future__ import annotations

import pytest
import torch
from test_blockdiag import D, _packing, _path, _reference

from cpshard.blockdiag.state import active_state
from cpshard.layout import LAYOUTS


def _batch(name: str, b: int, s: int, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """Document ids, full q/k/v and the upstream weight of a case."""
    doc = _packing(name, b, s)
    g = torch.Generator().manual_seed(1000 * b + s)
    q, k, v, w = (
        torch.randn(b, h, s, D, dtype=torch.float64, generator=g)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    return doc, q, k, v, w


# packing, B, S, heads, kv heads (S not a multiple of W: trailing padding)
CASES = [
    ("short_docs", 1, 24, 2, 2),
    ("short_docs", 2, 26, 4, 2),
    ("one_doc", 2, 23, 2, 2),
    ("interior_pad", 2, 30, 2, 1),
    ("random", 1, 37, 4, 2),
    ("reused_ids", 2, 19, 2, 2),
]


def _sharded(sharder, t: torch.Tensor) -> torch.Tensor:
    """``[B, H, S, D]`` -> this rank's ``[B, H, L, D]`` (the batch dim before the token dim, as
    per-row layouts need)."""
    return sharder.shard_token_tensor(t.transpose(1, 2), seq_dim=1, fill=0.0).transpose(1, 2)


def _distributed(rank: int, world: int, layouts: list[str], path: str) -> list[tuple]:
    """Per (layout, case): the gathered output and this rank's gradients of the full q/k/v."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_attention

    results = []
    with _path(path):
        for layout in layouts:
            for name, b, s, heads, kv_heads in CASES:
                doc, *full = _batch(name, b, s, heads, kv_heads)
                q, k, v = (t.requires_grad_() for t in full[:3])
                sharder = ContextParallelSharder(dist.group.WORLD, layout)
                ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
                with ctx():
                    out = cp_attention(
                        *(_sharded(sharder, t) for t in (q, k, v)), enable_gqa=heads != kv_heads
                    )
                    assert active_state().layout == layout
                assert active_state() is None
                (out * _sharded(sharder, full[3])).sum().backward()
                gathered = sharder.gather_token_tensor(out.detach().transpose(1, 2), 1, trim=True)
                results.append((gathered.transpose(1, 2), q.grad, k.grad, v.grad))
    return results


def _check(got: list[list[tuple]], layouts: list[str], world: int) -> None:
    at = 0
    for layout in layouts:
        for case in CASES:
            doc, q, k, v, w = _batch(*case)
            leaves = [t.requires_grad_() for t in (q, k, v)]
            want = _reference(*leaves, doc)
            grads = torch.autograd.grad((want * w).sum(), leaves)
            where = f"{layout} W={world} {case}"
            for r in range(world):
                torch.testing.assert_close(
                    got[r][at][0], want, rtol=0, atol=1e-12, msg=f"{where} output on rank {r}"
                )
            for j, name in enumerate("qkv"):
                total = sum(got[r][at][1 + j] for r in range(world))
                torch.testing.assert_close(
                    total, grads[j], rtol=0, atol=1e-10, msg=f"{where} grad {name}"
                )
            at += 1


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_matches_dense_reference(pools, world: int) -> None:
    layouts = list(LAYOUTS)
    got = pools(world).run(_distributed, layouts, "per_segment", timeout=600)
    _check(got, layouts, world)


@pytest.mark.parametrize("path", ["varlen", "math"])
def test_kernel_paths_match_dense_reference(pools, path: str) -> None:
    """The one-launch varlen path (its CPU stand-in) and the explicit part kernel, W = 3."""
    layouts = ["head_tail", "stripe", "balanced"]
    _check(pools(3).run(_distributed, layouts, path, timeout=600), layouts, 3)
