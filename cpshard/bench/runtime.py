"""What every benchmark on a rank needs: the group, the device, the dtype, the settings."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cpshard.bench.config import BenchConfig


@dataclass
class Runtime:
    cfg: BenchConfig
    rank: int
    world: int
    backend: str  # "gloo" or "nccl"
    device: torch.device
    pg: dist.ProcessGroup
    total_steps: int = 0
    done_steps: int = 0
    started: float = field(default_factory=time.perf_counter)

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.cfg.dtype)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def barrier_kwargs(self) -> dict:
        return {"device_ids": [self.device.index]} if self.is_cuda else {}

    def sync(self) -> None:
        """Wait for the device (a no-op on CPU, where every call returns when done)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def section(self, name: str, steps: int) -> None:
        """One line on rank 0's stderr as a section starts: ``== attention: 1 step(s)``."""
        if self.rank == 0:
            print(f"== {name}: {steps} step(s)", file=sys.stderr, flush=True)

    def progress(self, what: str) -> None:
        """One progress line on rank 0's stderr as a step starts: ``[3/12] 12 s  ragged ...``."""
        self.done_steps += 1
        if self.rank == 0:
            elapsed = time.perf_counter() - self.started
            print(
                f"[{self.done_steps}/{self.total_steps}] {elapsed:4.0f} s  {what}",
                file=sys.stderr,
                flush=True,
            )
