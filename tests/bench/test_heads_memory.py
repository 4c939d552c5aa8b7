"""``cpshard.bench.heads_memory``: the resident peak of head-parallel CP attention against the
floor every implementation holds (its output and the q, k, v gradients) plus the one gathered
head's worth the cost model charges it, and against DeepSpeed-Ulysses where it is installed."""

from __future__ import annotations

from cpshard.bench import heads_memory


def test_heads_holds_the_floor_and_one_head() -> None:
    world, seq = 2, 4096
    for q_heads, kv_heads in heads_memory.HEAD_SHAPES:
        row = heads_memory.run_case(world, seq, q_heads, kv_heads, runs=2, repeats=1)
        assert {"heads", "needed_rows", "auto", "floor"} <= set(row)
        assert all(float(f["peak"]) > 0 for f in row.values())
        # one K/V head and one query head over every rank's tokens, with their gradients
        # (the cost model's ``heads`` term: 4 x W x tokens x (d_k + d_v) x 4 bytes)
        one_head = 4 * world * (seq // world) * 2 * heads_memory.HEAD_DIM * 4
        floor = float(row["floor"]["peak"])
        assert float(row["heads"]["peak"]) <= floor + 1.5 * one_head, (row, floor, one_head)
        if "deepspeed" in row:
            assert row["heads"]["peak"] <= row["deepspeed"]["peak"], row
