"""``cpshard plan --memory``'s run: predict every simulated rank's peak (or search the largest
fitting sequence), print the report, write the JSON."""

from __future__ import annotations

import json
import sys
import time

from cpshard.simulation.documents import document_ids
from cpshard.simulation.memory_report import gib, payload, render
from cpshard.simulation.memory_search import largest_fitting
from cpshard.simulation.plan_setup import MemorySetup, Setup
from cpshard.simulation.step_memory import Predictor, RankMemory
from cpshard.simulation.training_step import StepSpec


def _sharding(spec: StepSpec) -> str:
    if not spec.fsdp:
        return "replicated"
    return "FSDP2 over the CP ranks" + (f" x {spec.dp_shard} replicas" if spec.dp_shard > 1 else "")


def _header(mem: MemorySetup, job: Setup, seq_len: int) -> list[str]:
    spec = mem.spec
    where = f"mesh {job.mesh[0]}x{job.mesh[1]}" if job.mesh else f"W={job.world}"
    return [
        f"# cpshard plan --memory: {mem.model} ({spec.layers} layers, {str(spec.dtype)[6:]}, "
        f"optimizer {spec.optimizer}, checkpointing {'on' if spec.checkpointing else 'off'}, "
        f"loss {spec.loss}, {_sharding(spec)}), {where}, S={seq_len}, docs {job.docs}, layout {job.layout}, "
        f"strategy {job.strategy}; peak bytes per rank in GiB, PREDICTED",
    ]


def _setup_fields(mem: MemorySetup, job: Setup) -> dict:
    spec = mem.spec
    return {
        "model": mem.model, "layers": spec.layers, "dtype": str(spec.dtype)[6:],
        "optimizer": spec.optimizer, "checkpointing": spec.checkpointing, "loss": spec.loss,
        "fsdp": spec.fsdp, "dp_shard": spec.dp_shard,
        "world": job.world, "mesh": job.mesh, "seq_len": job.seq_len, "docs": job.docs,
        "documents": len(job.lengths), "layout": job.layout, "strategy": job.strategy,
    }  # fmt: skip


def _progress(total: int, started: float):  # noqa: ANN202
    def report(done: int, m: RankMemory) -> None:
        print(
            f"[{done}/{total}] {time.perf_counter() - started:4.0f} s  rank {m.rank}: "
            f"{gib(m.peak_bytes)} GiB ({m.trace_s:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    return report


def _write(path: str | None, data: dict) -> None:
    if path is not None:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def run_memory(job: Setup, mem: MemorySetup) -> int:
    """Predict (or search) ``job``'s step and report; the exit status."""
    started = time.perf_counter()
    predictor = Predictor(mem.spec)
    if mem.max_seq_len is not None:
        return _search(predictor, mem, job, started)
    ranks = predictor.ranks(
        job.world, job.ranks, job.layout, job.strategy, document_ids(job.lengths, job.seq_len),
        job.mesh, _progress(len(job.ranks), started), mem.jobs,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    layers, traced = mem.spec.layers, predictor.traced
    print(render(_header(mem, job, job.seq_len), ranks, mem.device, layers, traced, seconds))
    _write(job.json_path, {"setup": _setup_fields(mem, job),
                           **payload(ranks, mem.device, layers, traced, seconds)})  # fmt: skip
    return 0


def _search(predictor: Predictor, mem: MemorySetup, job: Setup, started: float) -> int:
    assert mem.max_seq_len is not None

    def progress(seq: int, peak: int) -> None:
        print(
            f"{time.perf_counter() - started:5.0f} s  S={seq}: worst {gib(peak)} GiB",
            file=sys.stderr,
            flush=True,
        )

    found = largest_fitting(
        predictor, job.world, job.ranks, job.layout, job.strategy, job.docs, mem.device.bytes,
        job.seq_len, mem.max_seq_len, job.mesh, progress, mem.jobs,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    head = _header(mem, job, job.seq_len)[0].replace(f"S={job.seq_len}", f"S <= {mem.max_seq_len}")
    best = "none" if found.seq_len is None else str(found.seq_len)
    print(head)
    print(
        f"# largest S fitting {mem.device.name} ({gib(mem.device.bytes)} GiB), multiple of "
        f"{job.seq_len}: {best}"
        + ("" if found.peak_bytes is None else f" (worst rank {gib(found.peak_bytes)} GiB)")
        + f"; {len(found.tried)} predictions, {seconds:.1f} s"
    )
    _write(job.json_path, {
        "setup": _setup_fields(mem, job), "device": {"name": mem.device.name,
        "bytes": mem.device.bytes}, "max_seq_len": found.seq_len, "peak_bytes": found.peak_bytes,
        "tried": found.tried, "seconds": seconds,
    })  # fmt: skip
    return 0
