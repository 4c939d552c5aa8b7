"""`cpshard bench --ops layouts`: a quick end-to-end run (2 spawned gloo ranks, JSON output)."""

from __future__ import annotations

from cpshard.bench.layouts import BALANCED_GOAL, QUICK_BALANCE, QUICK_CASES
from cpshard.layouts import CLOSED_FORM_LAYOUTS, LAYOUTS


def test_layouts_section_quick_run(run_bench):
    proc, data = run_bench(*"--world 2 --ops layouts --quick --repeats 2 --warmup 0 --iters 1".split())
    steps = len(QUICK_BALANCE.means) + len(QUICK_CASES)
    assert f"[{steps}/{steps}]" in proc.stderr  # one progress line per step
    assert "# layouts: per-rank causal-attention cost" in proc.stdout
    assert f"# balanced <= {BALANCED_GOAL}:" in proc.stdout
    assert "# layouts: gather_token_tensor(trim=True)" in proc.stdout

    result = data["layouts"]
    assert result["world"] == 2
    balance = result["balance"]
    assert len(balance) == len(QUICK_BALANCE.means) * len(LAYOUTS)
    cell = {(r["layout"], r["mean_doc_len"]): r for r in balance}
    for r in balance:
        assert r["world"] == 2 and r["rows"] == QUICK_BALANCE.rows
        assert 1.0 <= r["mean_max_over_mean"] <= r["worst_max_over_mean"]
        assert (r["plan_ms_per_row"] is None) == (r["layout"] in CLOSED_FORM_LAYOUTS)
    for mean in QUICK_BALANCE.means:
        bal = cell["balanced", mean]
        assert bal["plan_ms_per_row"] > 0
        assert bal["rows_within_goal"] == QUICK_BALANCE.rows  # these packings allow it
        for other in ("contiguous", "head_tail"):
            assert bal["mean_max_over_mean"] <= cell[other, mean]["mean_max_over_mean"]
            assert bal["worst_max_over_mean"] <= cell[other, mean]["worst_max_over_mean"]

    gathers = result["gather"]
    assert [(g["layout"], g["shape"]) for g in gathers] == [
        (c.layout, list(c.shape)) for c in QUICK_CASES
    ]
    for g in gathers:
        assert g["world"] == 2 and g["speedup"] > 0
        for who in ("cpshard", "baseline"):
            assert g[who]["median_s"] > 0 and len(g[who]["repeats_s"]) == 2
            assert g[who]["cpu_s"] > 0 and g[who]["peak_bytes"] >= 0
