"""NVTX ranges around the transport's transfers (a profiler timeline names them)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch


@contextmanager
def nvtx_range(name: str, like: torch.Tensor) -> Iterator[None]:
    """An NVTX range around a collective on CUDA tensors; nothing on CPU."""
    ctx = torch.cuda.nvtx.range(name) if like.is_cuda else nullcontext()
    with ctx:
        yield
