"""``scripts/venv.sh`` installs and builds only when something the build depends on changed.

A copy of the build's inputs and a stand-in environment whose ``pip`` records each call (and,
for the editable install, writes the extension ``cpshard/_C*.so`` as the real one does): the
first run installs, an unchanged tree skips, and a ``csrc/`` change, a missing extension (a
fresh checkout), another checkout sharing the environment, a changed requirement and
``CPSHARD_REBUILD=1`` each install again.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from tests.helpers import REPO

PIP = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../pip.log"
if [ "${@: -1}" = "." ]; then touch cpshard/_C.cpython-311-x86_64-linux-gnu.so; fi
"""


def _tree(root: Path) -> Path:
    root.mkdir()
    for name in ("requirements-dev.txt", "CMakeLists.txt", "setup.py", "pyproject.toml"):
        shutil.copy(REPO / name, root / name)
    shutil.copytree(REPO / "csrc", root / "csrc")
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "venv.sh", root / "scripts" / "venv.sh")
    (root / "cpshard").mkdir()
    return root


def _venv(path: Path) -> Path:
    (path / "bin").mkdir(parents=True)
    for tool, text in (("python", "#!/bin/sh\n"), ("pip", PIP)):
        (path / "bin" / tool).write_text(text)
        (path / "bin" / tool).chmod(0o755)
    return path


def _installs(tree: Path, venv: Path, **env: str) -> int:
    """Source venv.sh in ``tree``; the number of pip calls it made."""
    log = venv / "pip.log"
    before = len(log.read_text().splitlines()) if log.exists() else 0
    exports = " ".join(f"{k}={v}" for k, v in env.items())
    subprocess.run(
        ["bash", "-c", f"set -euo pipefail; export VENV={venv} {exports}; source scripts/venv.sh"],
        cwd=tree,
        check=True,
        capture_output=True,
        text=True,
    )
    return len(log.read_text().splitlines()) - before if log.exists() else 0


def test_install_and_build_only_when_needed(tmp_path: Path) -> None:
    tree, venv = _tree(tmp_path / "checkout"), _venv(tmp_path / "venv")
    assert _installs(tree, venv) == 2  # requirements, then the editable build
    assert _installs(tree, venv) == 0  # nothing changed
    source = next((tree / "csrc").rglob("*.cpp"))
    source.write_text(source.read_text() + "\n// changed\n")
    assert _installs(tree, venv) == 2
    assert _installs(tree, venv) == 0
    for so in (tree / "cpshard").glob("_C*.so"):
        so.unlink()  # a fresh checkout has no extension
    assert _installs(tree, venv) == 2
    other = tmp_path / "other"
    shutil.copytree(tree, other)
    assert _installs(other, venv) == 2  # the environment's editable install is the other tree's
    assert _installs(tree, venv) == 2
    (tree / "requirements-dev.txt").write_text(
        (tree / "requirements-dev.txt").read_text() + "six\n"
    )
    assert _installs(tree, venv) == 2
    assert _installs(tree, venv, CPSHARD_REBUILD="1") == 2
    assert _installs(tree, venv, CPSHARD_CUDA="1") == 2  # a build switch changes the build
    assert _installs(tree, venv) == 2
    assert _installs(tree, venv) == 0
