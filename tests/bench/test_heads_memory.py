"""``cpshard bench --ops heads_memory`` (and ``python -m cpshard.bench.heads_memory``): the
resident peak of CP attention over one causal document per strategy, compared with
DeepSpeed-Ulysses's own measured peak where DeepSpeed is installed, and otherwise with the
floor every implementation holds (its output and the q, k, v gradients) plus what the cost
model says the strategy holds beyond it (what ``auto`` weighs): a strategy that comes to hold
more than it should fails either way."""

from __future__ import annotations

from cpshard.bench import heads_memory


def test_section_reports_every_strategy_beside_deepspeed_or_the_floor(run_bench) -> None:
    proc, data = run_bench("--world", "2", "--ops", "heads_memory", "--quick", timeout=900)
    rows = data["heads_memory"]
    assert [(r["world"], r["seq_len"], r["q_heads"], r["kv_heads"]) for r in rows] == [
        (2, 1024, q, kv) for q, kv in heads_memory.HEAD_SHAPES
    ]
    installed = heads_memory.deepspeed_installed()
    for r in rows:
        names = {*heads_memory.STRATEGIES, *(("deepspeed",) if installed else ())}
        assert set(r["impls"]) == names and (r["deepspeed"] is not None) == installed
        assert r["floor_bytes"] == heads_memory.floor_bytes(512, r["q_heads"], r["kv_heads"])
        assert all(f["peak_bytes"] > 0 and f["fwd_bwd_s"] > 0 for f in r["impls"].values())
        assert r["impls"]["auto"]["ran"] in ("heads", "needed_rows")
    assert "# heads_memory:" in proc.stdout and "auto ran" in proc.stdout
    assert ("DeepSpeed not installed" in proc.stdout) != installed


def test_peaks_at_or_below_deepspeed_else_the_floor_and_the_modelled_hold() -> None:
    world, seq = 2, 4096
    for q_heads, kv_heads in heads_memory.HEAD_SHAPES:
        row = heads_memory.case_row(world, seq, q_heads, kv_heads, runs=2, repeats=1)
        impls, floor = row["impls"], row["floor_bytes"]
        for name in heads_memory.STRATEGIES:
            peak, held = impls[name]["peak_bytes"], impls[name]["held_model_bytes"]
            # the floor, what the model says the strategy holds beyond it, and a quarter of
            # the floor for one tile's (or one head's) temporaries and the kernels' buffers
            assert peak <= floor + held + floor // 4, (name, row)
        if "deepspeed" in impls:
            ds = impls["deepspeed"]["peak_bytes"]
            assert impls["heads"]["peak_bytes"] <= ds, row
            assert impls["auto"]["peak_bytes"] <= ds, row
            if kv_heads <= 2:  # the needed rows' key buffer no larger than heads' gathered head
                assert impls["needed_rows"]["peak_bytes"] <= ds, row
