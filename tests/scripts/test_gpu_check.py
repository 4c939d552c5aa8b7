"""``scripts/gpu/check.sh``: its dry run executes every stage's logic on CPU (multi-rank
correctness at W = 2 and 4 within the low-precision bound, compile, the steady state, the graph
stage's calls, the benchmark's code) and writes each stage's JSON; and the check exits 0 only
when every stage ran and passed: a failed stage exits 1, a stage skipped because the time budget
ran out exits 2 and says INCOMPLETE. For the exit statuses ``true`` / ``false`` stand in for the
interpreter (every stage then passes / fails at once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

CHECK = REPO / "scripts" / "gpu" / "check.sh"
STAGES = ("smoke", "build", "correctness", "bench")


def _check(tmp_path: Path, *args: str, python: str, budget_s: int) -> tuple[int, str, Path]:
    env = dict(os.environ, PYTHON=python, BUDGET_S=str(budget_s), PYTHONPATH=str(REPO))
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(CHECK), *args, str(out)], env=env, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, (out / "summary.txt").read_text(), out


def test_the_dry_run_runs_every_stage_on_cpu_and_writes_its_json(tmp_path: Path) -> None:
    rc, summary, out = _check(tmp_path, "--dry-run", python=sys.executable, budget_s=280)
    assert rc == 0, summary + (out / "log.txt").read_text()[-4000:]
    for name in STAGES:
        record = json.loads((out / f"stage_{name}.json").read_text())
        assert record["status"] == "PASS" and record["dry_run"] is True, record
    correctness = json.loads((out / "correctness.json").read_text())
    assert correctness["ok"] and sorted(correctness["worlds"]) == ["2", "4"]
    for world in correctness["worlds"].values():
        for rank in world["ranks"]:
            strategies = {case["strategy"] for case in rank["cases"]}
            assert {"needed_rows", "heads", "mixer"} <= strategies, strategies
            assert rank["world"] != 4 or "hierarchical" in strategies
            errors = [e for case in rank["cases"] for e in case["errors"]]
            assert errors and all(e["err"] <= e["bound"] for e in errors)
            assert rank["compile"]["ok"] and rank["sync_free"]["ok"]
    assert correctness["graph"]["ok"]
    bench = json.loads((out / "bench.json").read_text())
    assert bench["dry_run"] and bench["layer_step_w2_ms"] > 0


@pytest.mark.parametrize(
    "python, budget_s, rc, says, never",
    [
        ("true", 300, 0, "PASS bench", ("SKIP", "FAIL", "INCOMPLETE")),
        ("false", 300, 1, "FAIL smoke", ("SKIP", "INCOMPLETE", "PASS")),
        ("true", 0, 2, "INCOMPLETE: the budget (0 s) ran out before smoke build", ("PASS", "FAIL")),
    ],
)
def test_the_check_is_green_only_when_every_stage_ran_and_passed(
    tmp_path: Path, python: str, budget_s: int, rc: int, says: str, never: tuple[str, ...]
) -> None:
    got, summary, out = _check(tmp_path, python=python, budget_s=budget_s)
    assert got == rc, summary
    assert says in summary, summary
    assert not [word for word in never if word in summary], summary
    for name in STAGES:  # every stage leaves its JSON, skipped ones included
        assert json.loads((out / f"stage_{name}.json").read_text())["stage"] == name
