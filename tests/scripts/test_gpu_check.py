"""``scripts/gpu/check.sh``: its dry run, from a fresh copy of the tree on an interpreter that
has torch and the build tools but not cpshard (the lent GPU machine's situation), runs every
stage's own scripts on CPU and passes: smoke with torch alone, the in-place build of the
extension, the CUDA / NCCL test files and scripts (which skip, and say so), multi-rank
correctness at W = 2 and 4 within the low-precision bound, numerics, the benchmarks, compile and
the graph stage's calls; no stage claims what it did not measure. And the check exits 0 only
when every stage ran and passed: a failed stage exits 1, a stage skipped because the time budget
ran out exits 2 and says INCOMPLETE. For the exit statuses ``true`` / ``false`` stand in for the
interpreter (every stage then passes / fails at once)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

CHECK = Path("scripts") / "gpu" / "check.sh"
STAGES = (
    "smoke", "build", "kernels", "nccl", "steady_state", "correctness", "numerics", "bench",
    "bench_kernels", "bench_nccl", "compile", "graph",
)  # fmt: skip
BUILD_TOOLS = ("cmake", "ninja")


def _fresh_copy(dest: Path) -> Path:
    """The tree as a fresh clone of it would be, uncommitted work included: tracked files still
    on disk and untracked ones git does not ignore; no build output, no extension."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, check=True, capture_output=True,
    ).stdout  # fmt: skip
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file() and not name.endswith(".so"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def _interpreter_without_cpshard(root: Path) -> Path:
    """A venv whose site-packages links every entry of this interpreter's except cpshard's own
    (an editable install's ``.pth`` and finder, its dist-info, an installed package), so torch,
    pytest and the rest import while ``import cpshard`` fails; this interpreter's cmake / ninja
    beside its python, where setup.py looks first."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    python = root / "bin" / "python"
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.run([python, "-c", where], check=True, capture_output=True, text=True)
                .stdout.strip())  # fmt: skip
    for base in {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}:
        for entry in base.iterdir():
            if "cpshard" not in entry.name.lower() and not (site / entry.name).exists():
                (site / entry.name).symlink_to(entry)
    for tool in BUILD_TOOLS:
        found = Path(sys.executable).parent / tool
        if found.exists():
            (root / "bin" / tool).symlink_to(found)
    return python


def _check(
    tree: Path, out: Path, *args: str, python: str, budget_s: int, timeout: int = 300
) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=python, BUDGET_S=str(budget_s))
    proc = subprocess.run(
        ["bash", str(tree / CHECK), *args, str(out)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    return proc.returncode, (out / "summary.txt").read_text()


def test_the_dry_run_from_a_fresh_clone_without_cpshard_runs_every_stage(tmp_path: Path) -> None:
    tree = _fresh_copy(tmp_path / "clone")
    python = _interpreter_without_cpshard(tmp_path / "venv")
    imports = "import torch, pytest, hypothesis, setuptools; import cpshard"
    probe = subprocess.run([python, "-c", imports], cwd=tmp_path, capture_output=True, text=True)
    assert "No module named 'cpshard'" in probe.stderr, probe.stderr  # everything else imports
    assert not list(tree.glob("cpshard/_C*.so")) and not (tree / "build").exists()

    start = time.monotonic()
    out = tmp_path / "out"
    rc, summary = _check(tree, out, "--dry-run", python=str(python), budget_s=1500, timeout=1800)
    print(summary, f"dry run from a fresh copy: {time.monotonic() - start:.0f} s", sep="\n")
    assert rc == 0, summary + (out / "log.txt").read_text()[-6000:]
    for name in STAGES:
        record = json.loads((out / f"stage_{name}.json").read_text())
        assert record["status"] == "PASS" and record["dry_run"] is True, record

    smoke = json.loads((out / "smoke.json").read_text())  # ran before anything was built
    assert smoke["ok"] and smoke["all_reduce"]["backend"] == "gloo"
    assert smoke["machine"]["attention"]["kernels"]["sdpa_causal"], smoke
    build = json.loads((out / "build.json").read_text())
    assert build["ok"] and Path(build["extension"]).parent == tree / "cpshard", build
    assert not build["cuda_kernels"] and build["build_exit"] == 0

    correctness = json.loads((out / "correctness.json").read_text())
    assert correctness["ok"] and sorted(correctness["worlds"]) == ["2", "4"]
    for world in correctness["worlds"].values():
        for rank in world["ranks"]:
            strategies = {case["strategy"] for case in rank["cases"]}
            assert {"needed_rows", "heads", "mixer"} <= strategies, strategies
            assert rank["world"] != 4 or "hierarchical" in strategies
            errors = [e for case in rank["cases"] for e in case["errors"]]
            assert errors and all(e["err"] <= e["bound"] for e in errors)
            assert rank["sync_free"]["checked"] is False and "ok" not in rank["sync_free"]
    compiled = json.loads((out / "compile.json").read_text())
    assert compiled["ok"] and list(compiled["worlds"]) == ["2"]
    assert all(r["backend"] == "aot_eager" for r in compiled["worlds"]["2"]["ranks"])
    graph = json.loads((out / "graph.json").read_text())
    assert graph["ok"] and graph["captured"] is False and "why" in graph

    numerics = json.loads((out / "numerics.json").read_text())
    assert numerics["ok"] and numerics["cases"] and numerics["device"] == "cpu"
    bench = json.loads((out / "bench.json").read_text())
    assert bench["dry_run"] and bench["layer_step_w2_ms"] > 0
    # the attention kernels: what CPU cannot run said so, the explicit one timed, the choice named
    kernels = bench["attention_kernels"]["kernels"]
    for name in ("torch_flash_varlen", "fa3_varlen", "flash_attn_varlen"):
        assert not kernels[name]["available"] and "not available" in kernels[name]["why"]
    math = kernels["math_varlen"]
    assert math["plain_ms"] > 0 and math["softcap_ms"] > 0 and math["softcap_ran"] == "math_varlen"
    assert bench["attention_kernels"]["chosen"] == {"plain": "cpu_flash", "softcap": "math_varlen"}
    assert json.loads((out / "kernels_cpu.json").read_text())
    # what needs a GPU skipped and says why, in its JSON and in the summary
    for name in ("steady_state.json", "nccl_world1.json"):
        assert json.loads((out / name).read_text())["skipped"] == "no GPU"
    assert "PASS bench_nccl" in summary and "skipped: no GPU" in summary
    assert "skipped" in json.loads((out / "stage_kernels.json").read_text())["last_line"]


@pytest.mark.parametrize(
    "python, budget_s, rc, says, never",
    [
        ("true", 300, 0, "PASS graph", ("SKIP", "FAIL", "INCOMPLETE")),
        ("false", 300, 1, "FAIL smoke", ("SKIP", "INCOMPLETE", "PASS")),
        ("true", 0, 2, "INCOMPLETE: the budget (0 s) ran out before smoke build", ("PASS", "FAIL")),
    ],
)
def test_the_check_is_green_only_when_every_stage_ran_and_passed(
    tmp_path: Path, python: str, budget_s: int, rc: int, says: str, never: tuple[str, ...]
) -> None:
    out = tmp_path / "out"
    got, summary = _check(REPO, out, python=python, budget_s=budget_s)
    assert got == rc, summary
    assert says in summary, summary
    assert not [word for word in never if word in summary], summary
    for name in STAGES:  # every stage leaves its JSON, skipped ones included
        assert json.loads((out / f"stage_{name}.json").read_text())["stage"] == name
