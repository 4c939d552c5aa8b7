"""A validated ``cpshard plan`` run: the simulated job and, with ``--memory``, the step whose
memory is predicted."""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.simulation.head_shape import HeadShape
from cpshard.simulation.memory_report import Device
from cpshard.simulation.training_step import StepSpec


@dataclass(frozen=True)
class MemorySetup:
    """``--memory``'s settings: the ``--model`` as given, the step, the device, the search's
    limit (None: predict ``--seq-len`` only) and the processes tracing ranks at once."""

    model: str
    spec: StepSpec
    device: Device
    max_seq_len: int | None
    jobs: int = 1


@dataclass(frozen=True)
class Setup:
    """A validated ``cpshard plan`` run."""

    world: int
    mesh: tuple[int, int] | None
    seq_len: int
    docs: str
    lengths: list[int]
    layout: str
    strategy: str
    shape: HeadShape
    ranks: list[int]
    json_path: str | None
    plot_path: str | None
    memory: MemorySetup | None = None
