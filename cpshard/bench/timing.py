"""How times are measured.

Several steps are timed together, their repeats interleaved (repeat 1 of every step, then
repeat 2, ...), so that a machine whose load drifts (a shared CI box) slows them alike. A repeat
of one step is a barrier, then N back-to-back iterations on every rank; its per-iteration time
is the MAX over ranks (a collective step is as slow as its slowest rank). The MEDIAN over
repeats is reported.

Two load-insensitive figures come with each time (CPU ranks only; medians over repeats, per
iteration, SUMMED over ranks): the CPU time the ranks' processes used (all threads, user +
system: copies, reductions, the kernel's loopback TCP and page faults) and the minor page faults
(first touches of freshly allocated memory). On a machine shared with other jobs the wall time
swings with their load; these do not.

Single-process benchmarks (kernels, the NCCL world-1 verbs, the planner) time plain calls with
:func:`time_calls`: each call's wall and CPU time, and the minor page faults per call.
"""

from __future__ import annotations

import math
import resource
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpshard.bench.runtime import Runtime

MAX_ITERS = 1000


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    repeats_s: tuple[float, ...]  # per-iteration time of each repeat, max over ranks
    iters: int  # iterations per repeat
    cpu_s: float  # per iteration, summed over ranks (median over repeats)
    minor_faults: float  # per iteration, summed over ranks (median over repeats)


@dataclass(frozen=True)
class Calls:
    wall_s: list[float]  # each timed call's wall time
    cpu_s: list[float]  # each timed call's process CPU time (all threads, user + system)
    minor_faults: float  # minor page faults per timed call


def _no_sync() -> None:
    """Nothing to wait for: CPU calls are done when they return."""


def time_calls(
    fn: Callable[[], object],
    repeats: int,
    warmup: int = 0,
    sync: Callable[[], None] = _no_sync,
) -> Calls:
    """``repeats`` calls of ``fn`` in this process after ``warmup`` untimed ones, each followed
    by ``sync()`` (``torch.cuda.synchronize`` for GPU work, so that a time is the call's from an
    idle device to its end)."""
    for _ in range(warmup):
        fn()
    sync()
    wall, cpu = [], []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        sync()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return Calls(wall, cpu, faults / max(1, repeats))


def _reduce(rt: Runtime, values: list[float], op: dist.ReduceOp) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, op=op, group=rt.pg)
    return t.cpu().tolist()


def _run(rt: Runtime, step: Callable[[], object], iters: int) -> tuple[float, float, float]:
    """Per-iteration (wall seconds, process CPU seconds, minor faults) of ``iters`` runs."""
    dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    rt.sync()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    rt.sync()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    return wall / iters, cpu / iters, faults / iters


def time_steps(
    rt: Runtime,
    steps: Mapping[str, Callable[[], object]],
    *,
    warmup: int,
    repeats: int,
    iters: int,
    target_s: float,
) -> dict[str, Timing]:
    """Time each step (one iteration; it must leave nothing pending on the device).

    ``iters=0`` picks each step's iterations per repeat from the time of its last warmup run
    (one untimed run if ``warmup`` is 0), identically on every rank: enough for about
    ``target_s`` per repeat, at most 1000.
    """
    names = list(steps)
    probe = iters <= 0
    once = []
    for name in names:
        for _ in range(warmup - 1 if probe and warmup > 0 else warmup):
            steps[name]()
        if probe:
            once.append(_run(rt, steps[name], 1)[0])
    rt.sync()
    if probe:
        once = _reduce(rt, once, dist.ReduceOp.MAX)
        counts = {
            name: max(1, min(MAX_ITERS, math.ceil(target_s / max(t, 1e-9))))
            for name, t in zip(names, once, strict=True)
        }
    else:
        counts = dict.fromkeys(names, iters)
    local = [[_run(rt, steps[name], counts[name]) for name in names] for _ in range(repeats)]
    walls = _reduce(rt, [w for rep in local for w, _, _ in rep], dist.ReduceOp.MAX)
    used = _reduce(rt, [v for rep in local for _, c, f in rep for v in (c, f)], dist.ReduceOp.SUM)
    out = {}
    k = len(names)
    for i, name in enumerate(names):
        per_rep = tuple(walls[r * k + i] for r in range(repeats))
        cpu = [used[2 * (r * k + i)] for r in range(repeats)]
        faults = [used[2 * (r * k + i) + 1] for r in range(repeats)]
        out[name] = Timing(
            statistics.median(per_rep),
            min(per_rep),
            per_rep,
            counts[name],
            statistics.median(cpu),
            statistics.median(faults),
        )
    return out
