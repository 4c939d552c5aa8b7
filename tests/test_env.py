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


def test_the_declared_range_is_read_by_distribution_name(monkeypatch) -> None:
    """A message names the range declared for exactly that distribution (not one whose name
    starts the same), without the extra's marker."""
    from importlib import metadata

    from cpshard import declared

    requires = [
        "torch<2.16,>=2.11",
        'transformers-stream-generator>=0.1; extra == "transformers"',
        'Transformers>=5.24.0; extra == "transformers"',
    ]
    monkeypatch.setattr(metadata, "requires", lambda name: requires if name == "cpshard" else None)
    assert declared.declared_requirements() == requires
    assert declared.declared_range("transformers") == "Transformers>=5.24.0"
    assert declared.declared_range("torch") == "torch<2.16,>=2.11"
    assert declared.declared_range("trl") == "the trl range cpshard declares"
