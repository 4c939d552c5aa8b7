"""The bench's memory figures leave nothing alive: a section measures hundreds of steps, so a
measured step's graph kept after its figure is taken would pile up across the cases."""

from __future__ import annotations

import gc
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard.bench.config import BenchConfig
from cpshard.bench.memory import saved_bytes
from cpshard.bench.runtime import Runtime


def _saved_bytes_then_alive(rank: int, world: int) -> tuple[int, bool]:
    """``saved_bytes`` of an SDPA forward (it saves its output), and whether its leaf outlives
    the call once dropped."""
    rt = Runtime(BenchConfig(), rank, world, "gloo", torch.device("cpu"), dist.group.WORLD)
    q = torch.randn(1, 2, 64, 8, requires_grad=True)
    figure = saved_bytes(rt, lambda: F.scaled_dot_product_attention(q, q, q), (q,))
    leaf = weakref.ref(q)
    del q
    gc.collect()
    return figure, leaf() is not None


def test_saved_bytes_keeps_no_graph_alive(pool1):
    ((figure, alive),) = pool1.run(_saved_bytes_then_alive)
    assert figure > 0
    assert not alive
