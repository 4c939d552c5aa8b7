"""``torch.compile(fullgraph=True)`` traces the transport (``cpshard.transport``): each of
``gather_sequence``, ``gather_ragged`` and ``gather_halo``, forward and backward, compiles with no
graph break and equals eager at W = 2 and 4 on gloo (the verbs are custom ops keyed by group
name, with fake kernels and autograd)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard import gather_halo, gather_ragged, gather_sequence

F64 = torch.float64


def _programs(world: int, rank: int):
    g = dist.group.WORLD
    counts = [1 + (3 * r) % 5 for r in range(world)]
    halos = [min(5, 2 * r) for r in range(world)]
    # name -> (function of x, x's shape on this rank)
    return {
        "sequence dim 1": (lambda x: gather_sequence(x * 2.0, g, seq_dim=1).sin(), (2, 3, 4)),
        "sequence dim 0": (lambda x: gather_sequence(x, g, seq_dim=0).cos(), (3, 5)),
        "ragged dim 0": (lambda x: gather_ragged(x.exp(), g, counts, dim=0) * 3.0, (counts[rank], 4)),
        "ragged dim 1": (lambda x: gather_ragged(x, g, counts, dim=1).tanh(), (2, counts[rank], 3)),
        "halo": (lambda x: gather_halo(x.square(), g, 3, left_padding=1, seq_dim=1), (2, 4, 3)),
        "halo per rank": (lambda x: gather_halo(x, g, halos, seq_dim=1).sin(), (1, 3, 2)),
    }


def _compiled_equals_eager(rank: int, world: int) -> list[str]:
    torch._dynamo.reset()
    problems = []
    for name, (fn, shape) in _programs(world, rank).items():
        torch.manual_seed(rank + 7)
        x = torch.randn(shape, dtype=F64, requires_grad=True)
        up_seed = torch.Generator().manual_seed(99)
        eager = fn(x)
        up = torch.randn(eager.shape, dtype=F64, generator=up_seed)
        (g_eager,) = torch.autograd.grad(eager, x, up)
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        out = compiled(x)
        (g_comp,) = torch.autograd.grad(out, x, up)
        if not torch.equal(out, eager):
            problems.append(f"{name}: forward differs by {(out - eager).abs().max():.3g}")
        if not torch.allclose(g_comp, g_eager, rtol=0, atol=1e-12):
            problems.append(f"{name}: gradient differs by {(g_comp - g_eager).abs().max():.3g}")
    return problems


@pytest.mark.parametrize("world", [2, 4])
def test_compiled_transport_equals_eager(pools, world):
    for problems in pools(world).run(_compiled_equals_eager, timeout=600):
        assert problems == []


def _opcheck_verbs(rank: int, world: int) -> list[str]:
    """``torch.library.opcheck`` (schema, fake kernel, autograd registration, AOT dispatch) on
    every transport op; every rank runs the same checks, so the collectives inside match."""
    name = dist.group.WORLD.group_name
    sizes = [3 * (r + 1) for r in range(world)]
    halos = [min(2, r) for r in range(world)]
    ops = torch.ops.cpshard
    cases = {
        "all_gather_v": (ops.all_gather_v.default, (torch.randn(sizes[rank], dtype=F64, requires_grad=True), name, sizes, 5)),
        "reduce_scatter_v": (ops.reduce_scatter_v.default, (torch.randn(sum(sizes), dtype=F64, requires_grad=True), name, sizes, 5)),
        "halo_exchange": (ops.halo_exchange.default, (torch.randn(2, 3, 2, dtype=F64, requires_grad=True), name, halos, 1, 1, 7)),
        "halo_return": (
            ops.halo_return.default,
            (torch.randn(2, 1 + min(rank * 3, halos[rank]) + 3, 2, dtype=F64, requires_grad=True), name, halos, 1, 1, 7),
        ),
    }
    problems = []
    for label, (op, args) in cases.items():
        result = torch.library.opcheck(op, args)
        problems += [f"{label}: {k}: {v}" for k, v in result.items() if v != "SUCCESS"]
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_transport_ops_pass_opcheck(pools, world):
    for problems in pools(world).run(_opcheck_verbs, timeout=300):
        assert problems == []
