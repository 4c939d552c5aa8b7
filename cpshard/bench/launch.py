"""Start the ranks and run the benchmarks on each.

Under a launcher (``RANK`` and ``WORLD_SIZE`` in the environment, as ``torchrun`` sets them) this
process is one rank: it joins the group by ``env://``. Otherwise it spawns ``--world`` local
processes (spawn, never fork) that join through a file store in a temporary folder: gloo on
CPU, or NCCL with one GPU per rank when ``--backend auto`` finds enough GPUs. Workers run with
``OMP_NUM_THREADS=1`` unless the user set it. Rank 0 prints the tables and writes the files.
"""

from __future__ import annotations

import datetime
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing

from cpshard.bench.config import DEFAULT_WORLD_CPU, BenchConfig
from cpshard.bench.runtime import Runtime


def under_launcher() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def choose_backend(requested: str, world: int, gpus: int) -> str:
    """``auto``: NCCL when every rank can have its own GPU, else gloo."""
    if requested == "auto":
        return "nccl" if gpus >= world and dist.is_nccl_available() else "gloo"
    if requested == "nccl" and gpus < world:
        raise ValueError(f"--backend nccl needs one GPU per rank: {world} ranks, {gpus} GPU(s)")
    return requested


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(cfg: BenchConfig) -> int:
    """Run the benchmark described by ``cfg``; the exit status."""
    if under_launcher():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if cfg.world is not None and cfg.world != world:
            print(
                f"cpshard bench: --world {cfg.world} but the launcher started {world} ranks",
                file=sys.stderr,
            )
            return 2
        local = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        try:
            backend = choose_backend(cfg.backend, local_world, _gpus())
        except ValueError as exc:
            print(f"cpshard bench: {exc}", file=sys.stderr)
            return 2
        run_rank(rank, world, cfg, backend, "env://", local)
        return 0
    gpus = _gpus()
    world = cfg.world
    if world is None:
        world = (
            gpus
            if cfg.backend != "gloo" and gpus >= 2 and dist.is_nccl_available()
            else DEFAULT_WORLD_CPU
        )
    try:
        backend = choose_backend(cfg.backend, world, gpus)
    except ValueError as exc:
        print(f"cpshard bench: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the workers
    folder = tempfile.mkdtemp(prefix="cpshard-bench-")
    try:
        torch.multiprocessing.start_processes(
            _spawned,
            args=(world, cfg, backend, f"file://{folder}/store"),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    except torch.multiprocessing.ProcessRaisedException as exc:
        print(f"cpshard bench failed:\n{exc}", file=sys.stderr)
        return 1
    except torch.multiprocessing.ProcessExitedException as exc:
        print(f"cpshard bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def _spawned(rank: int, world: int, cfg: BenchConfig, backend: str, init_method: str) -> None:
    """A spawned rank: run, then leave without the interpreter's teardown. torch's profiler
    (the memory columns) can abort a process in its exit-time static destructors ("terminate
    called without an active exception") after all the work is done; a failure still reaches
    the parent as an exception through :func:`torch.multiprocessing.start_processes`."""
    run_rank(rank, world, cfg, backend, init_method, rank)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(
    rank: int, world: int, cfg: BenchConfig, backend: str, init_method: str, local_rank: int
) -> None:
    """Join the group, run every requested benchmark, report on rank 0, leave the group."""
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    try:
        rt = Runtime(cfg, rank, world, backend, device, dist.group.WORLD)
        from cpshard.bench.report import report
        from cpshard.bench.suite import run_suite

        results = run_suite(rt)
        if rank == 0:
            report(rt, results)
        dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    finally:
        dist.destroy_process_group()
