"""Peak extra memory of one step: the most bytes the step holds at once beyond what existed
before it (its inputs), i.e. the peak of the running sum of its allocations and frees.

On CPU: one step under ``torch.profiler`` with ``profile_memory=True``; the allocator events
(``[memory]``, signed byte counts) are summed in time order. Allocations made outside torch's
allocator (a backend's private buffers) are not seen. On CUDA: ``max_memory_allocated`` after
``reset_peak_memory_stats``, minus what was allocated before the step.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from cpshard.bench.runtime import Runtime


@contextmanager
def _quiet_profiler_stderr() -> Iterator[None]:
    """Hide the profiler's own chatter on fd 2 (``USDT: ... profiler_start`` lines, warnings about
    blocks allocated before profiling started, whose frees it cannot size); anything else written
    meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest = [
                ln
                for ln in tmp.read().decode(errors="replace").splitlines(True)
                if not ln.startswith("USDT:") and "before the profiling started" not in ln
            ]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()


def cpu_peak(step: Callable[[], object]) -> int:
    """Peak extra bytes of ``step`` on the CPU: the running sum of torch's allocator events."""
    with _quiet_profiler_stderr():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    events = [
        e
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU
    ]
    events.sort(key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return peak


def _cuda_peak(rt: Runtime, step: Callable[[], object]) -> int:
    rt.sync()
    before = torch.cuda.memory_allocated(rt.device)
    torch.cuda.reset_peak_memory_stats(rt.device)
    step()
    rt.sync()
    return max(0, torch.cuda.max_memory_allocated(rt.device) - before)


def local_peak_bytes(rt: Runtime, step: Callable[[], object]) -> int:
    """Peak extra bytes of one run of ``step`` on this rank alone (no collective)."""
    return _cuda_peak(rt, step) if rt.is_cuda else cpu_peak(step)


def peak_extra_bytes(
    rt: Runtime,
    step: Callable[[], object],
    runs: int = 2,
    reset: Callable[[], object] | None = None,
) -> int:
    """Peak extra bytes of ``step`` (which must free its own temporaries): the max over ``runs``
    profiled runs and over ranks. Several runs, because a backend may release a collective's
    buffers from its own thread a little later (gloo's work objects hold their tensors), so
    one step's peak varies with timing. ``reset`` runs before each (outside the measurement),
    e.g. to drop the gradient the previous run left."""
    local = 0
    for _ in range(runs):
        if reset is not None:
            reset()
        dist.barrier(group=rt.pg, **rt.barrier_kwargs)
        local = max(local, local_peak_bytes(rt, step))
    t = torch.tensor([local], dtype=torch.int64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.pg)
    return int(t.item())


def saved_bytes(
    rt: Runtime, forward: Callable[[], object], inputs: tuple[torch.Tensor, ...]
) -> int:
    """Bytes ``forward``'s autograd graph keeps for the backward beyond ``inputs`` (what a model
    layer holds from its forward until its backward), max over ranks: the distinct storages of
    the tensors it saves, counted once. The hook keeps a detached alias, never the tensor itself:
    a saved output kept with its ``grad_fn`` would close a cycle through the graph that Python's
    garbage collector cannot see, and every measured graph (its inputs, exchanged K/V, masks)
    would stay alive until the process exits."""
    own = {t.untyped_storage().data_ptr() for t in inputs}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            kept[storage.data_ptr()] = storage.nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    t = torch.tensor([sum(kept.values())], dtype=torch.int64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.pg)
    return int(t.item())


def release_freed_memory() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc's
    ``malloc_trim``), so that a long section's later cases on a CPU machine do not run out of
    memory on what earlier cases freed but the heap kept."""
    import ctypes
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
