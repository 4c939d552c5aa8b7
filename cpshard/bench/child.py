"""A section's work in a fresh Python process: a simulated rank needs the fake backend as its
default group, and the bench's ranks already belong to a real one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any


def run_in_child(module: str, *args: str) -> Any:
    """Run ``python -m module *args OUT`` in a fresh process (this checkout first on its path)
    and return the JSON it wrote to ``OUT``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p
    ))  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="cpshard-bench-") as folder:
        out = os.path.join(folder, "result.json")
        subprocess.run([sys.executable, "-m", module, *args, out], env=env, check=True)
        with open(out) as f:
            return json.load(f)
