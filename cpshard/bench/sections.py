"""The benchmark sections beyond the transport tables: each one a module with a run and a render.

A section's ``run(rt)`` is called on every rank (it may use the group, or let rank 0 compute
while the others wait at a barrier) and returns rank 0's JSON-able result; ``render(result)``
turns that result into the text block printed after the transport tables; ``steps(rt)`` is the
number of progress lines ``run`` prints (for the ``[k/n]`` counter).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpshard.bench.runtime import Runtime

# op name in ``--ops`` -> module under cpshard.bench (imported only when the section runs)
SECTION_MODULES = {
    "planner": "cpshard.bench.planner",
    "vision": "cpshard.bench.vision",
    "layouts": "cpshard.bench.layouts",
    "blockdiag": "cpshard.bench.blockdiag",
    "attention": "cpshard.bench.attention",
    "mixers": "cpshard.bench.mixers",
    "loss": "cpshard.bench.linear_loss",
    "planning": "cpshard.bench.planning",
    "memory": "cpshard.bench.memory_prediction",
    "heads_memory": "cpshard.bench.heads_memory",
}


@dataclass(frozen=True)
class Section:
    steps: Callable[[Runtime], int]
    run: Callable[[Runtime], Any]
    render: Callable[[Any], str]


def section(name: str) -> Section:
    """The section behind ``--ops`` name ``name``."""
    mod = importlib.import_module(SECTION_MODULES[name])
    return Section(mod.steps, mod.run, mod.render)
