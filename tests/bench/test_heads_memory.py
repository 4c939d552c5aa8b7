"""``cpshard.bench.heads_memory``: the head-parallel layer beside the Ulysses floor (and any
implementation a caller adds) on two spawned ranks, every output checked against the floor's."""

from __future__ import annotations

import torch.distributed as dist

from cpshard.bench import heads_memory
from cpshard.testing import run_ranks


def _plain_sdpa(pg: dist.ProcessGroup):
    """An added implementation: the floor itself under another name."""
    return lambda q, k, v: heads_memory.ulysses_attention(pg, q, k, v)


def test_rows_time_and_peak_every_implementation() -> None:
    for q_heads, kv_heads in heads_memory.HEAD_SHAPES:
        row = run_ranks(
            heads_memory.measure, 2, 512, q_heads, kv_heads, {"again": _plain_sdpa}, 1,
            timeout=300,
        )[0]  # fmt: skip
        assert set(row) == {"ulysses", "cpshard", "again"}
        for figures in row.values():
            assert figures["s"] > 0 and figures["peak"] > 0
        # the layer holds no joined K/V and no copies of the gathered heads: below the floor
        assert row["cpshard"]["peak"] <= row["ulysses"]["peak"]
