"""``ContextParallelSharder(pad_multiple=..., extra_pad_values=...)`` and the layouts'
``rank_multiple``: every rank's shard length is a multiple of ``pad_multiple`` (NeMo
Automodel's per-rank shard multiple, e.g. a compression ratio), and extra sequence buffers are
padded with their own values. References are written token by token here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from cpshard.layouts import make_layout, padded_seq_len
from cpshard.sharder import ContextParallelSharder


@pytest.mark.parametrize("layout", ["contiguous", "head_tail", "stripe"])
def test_padded_length_is_the_smallest_valid_one(layout):
    """The smallest P >= S with P % base == 0 and (P / W) % m == 0 (searched one by one)."""
    for world in (1, 2, 3, 4):
        base = 2 * world if layout == "head_tail" else world
        for m in (1, 2, 3, 4):
            for seq in (0, 1, 5, 13, 24):
                want = next(p for p in range(seq, seq + 10 * base * m + 1)
                            if p % base == 0 and (p // world) % m == 0)
                assert padded_seq_len(seq, layout, world, rank_multiple=m) == want
                lay = make_layout(layout, world, seq, rank_multiple=m)
                assert lay.padded_seq_len == want and (want // world) % m == 0
    with pytest.raises(ValueError, match="rank_multiple"):
        padded_seq_len(4, layout, 2, rank_multiple=0)


def test_data_dependent_layouts_honour_the_multiple():
    doc = torch.tensor([[1, 1, 1, 2, 2, 0, 3]])
    for name in ("balanced", "per_document_head_tail"):
        lay = make_layout(name, 2, 7, doc_ids=doc, rank_multiple=3)
        assert lay.padded_seq_len == 12 and all(c % 3 == 0 for c in lay.counts)


def test_constructor_checks():
    with pytest.raises(ValueError, match="pad_multiple"):
        ContextParallelSharder(None, "contiguous", pad_multiple=0)
    with pytest.raises(ValueError, match="extra_pad_values"):
        ContextParallelSharder(None, "contiguous", extra_pad_values={"ids": -1})
    with pytest.raises(TypeError, match="extra_pad_values"):
        ContextParallelSharder(None, "contiguous", extra_seq_buffers={"ids": 1}, extra_pad_values=[("ids", -1)])


def _run(rank: int, world: int) -> list[str]:
    bad = []
    b, s, m = 2, 7, 3
    ids = torch.arange(1, 1 + b * s).reshape(b, s)
    groups = torch.arange(b * s).reshape(b, s) % 4 + 10
    for layout in ("contiguous", "head_tail"):
        sharder = ContextParallelSharder(
            dist.group.WORLD, layout, padding_token_id=0, pad_multiple=m,
            extra_seq_buffers={"vision_group": 1}, extra_pad_values={"vision_group": -7},
        )
        _, out = sharder.shard({"input_ids": ids, "vision_group": groups})
        padded = sharder.shard_layout.padded_seq_len
        local = padded // world
        if local % m or padded < s or padded - s >= math.lcm(2 * world if layout == "head_tail" else world, world * m):
            bad.append(f"W={world} {layout}: padded {padded}")
        mine = sharder.shard_layout.indices(rank)
        full = torch.cat([groups, torch.full((b, padded - s), -7)], 1)
        if out["input_ids"].shape[1] != local or not torch.equal(out["vision_group"], full[:, mine]):
            bad.append(f"W={world} r={rank} {layout}: {out['vision_group'].tolist()}")
    return bad


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sharder_pads_to_the_rank_multiple(pools, world):
    bad = [m for rank_bad in pools(world).run(_run, timeout=60) for m in rank_bad]
    assert not bad, "\n".join(bad)
