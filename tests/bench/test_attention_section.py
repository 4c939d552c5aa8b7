"""The ``attention`` section of ``cpshard bench``: quick runs on two spawned ranks (JSON and the
rendered block), its strategy grid checked against the cost model's own rule; ``--full`` runs
every case, the default one case with every strategy."""

from __future__ import annotations

from cpshard import LAYOUTS
from cpshard.bench.attention_strategies import (
    BLOCKDIAG,
    FLAT_STRATEGIES,
    GRID_LAYOUTS,
    HEAD_SHAPES,
)


def test_quick_run_reports_every_strategy(run_bench):
    proc, data = run_bench(
        *"--world 2 --ops attention --quick --full --repeats 1 --warmup 0 --iters 1 --no-memory".split()
    )
    assert "# attention: cp_attention fwd+bwd per exchange strategy" in proc.stdout
    result = data["attention"]
    grid = result["strategies"]
    cell = {(r["layout"], r["heads"], r["strategy"]): r for r in grid}
    entries = (*GRID_LAYOUTS, BLOCKDIAG)
    assert set(cell) == {(e, h, s) for e in entries for h in HEAD_SHAPES for s in FLAT_STRATEGIES}
    assert not any(r["mesh"] for r in grid)  # the 2 x 2 mesh needs 4 ranks
    for r in grid:
        assert r["world"] == 2 and r["fwd_bwd_s"] > 0 and r["speedup"] > 0
        assert (r["picked"] == r["strategy"]) == (r["strategy"] != "auto")
        assert r["bytes_moved_max"] == r["strategy_bytes"][r["picked"]] > 0
        assert (r["kv_rows_received_max"] is None) == (r["picked"] != "needed_rows")
    for heads in HEAD_SHAPES:
        for e in entries:
            auto = cell[e, heads, "auto"]
            moved = {s: cell[e, heads, s]["bytes_moved_max"] for s in ("needed_rows", "heads")}
            assert auto["strategy_bytes"] == moved
            held = auto["strategy_held_bytes"]
            fits = [s for s in moved if held[s] <= held["heads"]]  # memory first
            assert auto["picked"] in fits
            assert moved[auto["picked"]] + held[auto["picked"]] == min(
                moved[s] + held[s] for s in fits
            )  # then moved plus held
        # head parallel moves every rank's q/k/v and output, whatever the layout
        assert len({cell[e, heads, "heads"]["bytes_moved_max"] for e in entries}) == 1
    # the windowed rows (every layout) and the soft-capped and sinks rows are kept
    rows = result["rows"]
    assert [r["case"] for r in rows] == [f"{layout} window 64" for layout in LAYOUTS] + [
        "balanced softcap 50",
        "balanced sinks",
    ]
    for r in rows:
        assert r["ours_fwd_bwd_s"] > 0 and r["base_fwd_bwd_s"] > 0
        assert 0 <= r["ours_kv_rows_received_max"] <= r["base_kv_rows_received"]
        assert len(r["pairs_per_rank"]) == 2 and r["pairs_max_over_mean"] >= 1
        if r["window"] is not None:  # at most window - 1 rows before each run
            assert r["ours_kv_rows_received_max"] <= r["window_rows_bound_max"]


def test_default_run_times_one_case_under_every_strategy(run_bench):
    proc, data = run_bench(
        *"--world 2 --ops attention --quick --repeats 1 --warmup 0 --iters 1 --no-memory".split()
    )
    result = data["attention"]
    assert {(r["layout"], r["heads"], r["strategy"]) for r in result["strategies"]} == {
        ("balanced", "GQA", s) for s in FLAT_STRATEGIES
    }
    assert result["rows"] == [] and "sliding window" not in proc.stdout
