"""``cpshard env`` (and ``python -m cpshard``): the report users paste into a bug, with and
without transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*code_or_args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, timeout=300, cwd=REPO
    )


def test_python_m_cpshard_dispatches_every_command() -> None:
    done = _run("-m", "cpshard", "--help")
    assert done.returncode == 0, done.stderr
    for command in ("bench", "kernels", "nccl-world1", "parity", "plan", "env"):
        assert f"  {command} " in done.stdout, done.stdout
    done = _run("-m", "cpshard", "nonsense")
    assert done.returncode == 2 and "unknown command 'nonsense'" in done.stderr, done.stderr


def test_env_reports_the_build_the_libraries_and_the_hooks(tmp_path) -> None:
    pytest.importorskip("transformers")
    import torch
    import transformers

    path = tmp_path / "env.json"
    done = _run("-m", "cpshard", "env", "--json", str(path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("cpshard environment (paste into a bug report)"), out
    for words in ("cpshard build: CUDA kernels", f"torch: {torch.__version__}", "NCCL runtime:",
                  "Python: ", f"transformers: {transformers.__version__}", "declared: ",
                  "transformers hooks:", "active   Mamba: transformers.models.mamba.modeling_mamba",
                  "refused  under CP"):  # fmt: skip
        assert words in out, (words, out)
    report = json.loads(path.read_text())
    families = {f["module"]: f for f in report["transformers_hooks"]["families"]}
    assert families["transformers.models.llama4.modeling_llama4"]["state"] == "active"
    assert "transformers.models.deepseek_v32.modeling_deepseek_v32.DeepseekV32Indexer" in (
        report["transformers_hooks"]["refused"]
    )
    assert report["torch"]["version"] == torch.__version__


def test_env_runs_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None; "
        "from cpshard.cli import main; sys.exit(main(['env']))"
    )
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr
    assert "transformers hooks:\n  transformers is not installed" in done.stdout, done.stdout
