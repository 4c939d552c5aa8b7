"""``scripts/gpu/check.sh`` exits 0 only when every step ran and passed: a failed step exits 1,
and a step skipped because the time budget ran out exits 2 and says INCOMPLETE, so a green check
means every step ran. Run without a GPU: ``true`` stands in for the interpreter (every Python
step then passes at once) and a stand-in ``nvidia-smi`` passes or fails as told."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import REPO

CHECK = REPO / "scripts" / "gpu" / "check.sh"


def _check(tmp_path: Path, budget_s: int, smi_rc: int) -> tuple[int, str]:
    """Run the check with a budget of ``budget_s`` and an ``nvidia-smi`` exiting ``smi_rc``;
    its exit status and summary.txt."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\nexit {smi_rc}\n")
    smi.chmod(0o755)
    env = dict(
        os.environ, PYTHON="true", BUDGET_S=str(budget_s), PATH=f"{bin_dir}:{os.environ['PATH']}"
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(CHECK), str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    return proc.returncode, (out / "summary.txt").read_text()


@pytest.mark.parametrize(
    "budget_s, smi_rc, rc, says, never",
    [
        (300, 0, 0, "PASS gpu_compile_tests", ("SKIP", "FAIL", "INCOMPLETE")),
        (300, 1, 1, "FAIL nvidia-smi", ("SKIP", "INCOMPLETE")),
        (0, 0, 2, "INCOMPLETE: the budget (0 s) ran out before deps nvidia-smi", ("PASS", "FAIL")),
    ],
)
def test_the_check_is_green_only_when_every_step_ran_and_passed(
    tmp_path: Path, budget_s: int, smi_rc: int, rc: int, says: str, never: tuple[str, ...]
) -> None:
    got, summary = _check(tmp_path, budget_s, smi_rc)
    assert got == rc, summary
    assert says in summary, summary
    assert not [word for word in never if word in summary], summary
