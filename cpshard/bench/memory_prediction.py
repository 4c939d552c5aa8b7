"""``cpshard plan --memory``'s prediction beside the measured peak of the same step on CPU.

Each rank of the bench's gloo group runs the real training step
(:mod:`cpshard.simulation.training_step`: a small random Llama, a packed batch sharded by the
sharder, forward, loss, backward, AdamW step; replicated, or sharded by FSDP2 over the ranks)
twice and measures the second (a later step, as the prediction models): the bytes its parameters and optimizer state hold, plus the peak of the
running sum of torch's CPU allocator events during the step (:func:`cpshard.bench.memory.
cpu_peak`, the profiler's record, independent of the predictor's tracker). Rank 0 then predicts
every rank's peak in a fresh process (a simulated rank needs the fake backend as its default
group) and the section prints both per rank with their ratio.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpshard.bench.child import run_in_child
from cpshard.bench.memory import cpu_peak, release_freed_memory
from cpshard.bench.runtime import Runtime
from cpshard.comm.torch_compat import all_gather_single
from cpshard.sharder import ContextParallelSharder
from cpshard.simulation.documents import document_ids, document_lengths
from cpshard.simulation.model_config import model_config
from cpshard.simulation.step_loss import LOSSES, LossModule
from cpshard.simulation.step_memory import Predictor
from cpshard.simulation.training_step import (
    DTYPES,
    CausalStep,
    StepSpec,
    build_model,
    forward_backward,
    fully_shard_step,
    make_optimizer,
    packed_batch,
    world_mesh,
)

# A small Llama: big enough that activations dominate, small enough for a CPU step.
SMALL_LLAMA = {
    "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768, "layers": 4,
    "heads": 8, "kv_heads": 4, "head_dim": 32,
}  # fmt: skip
DOCS = "pareto:16"
DTYPE = "fp32"


@dataclass(frozen=True)
class Case:
    """One step to predict and measure."""

    seq_len: int
    layout: str
    strategy: str = "auto"
    checkpointing: bool = False
    docs: str = DOCS
    loss: str = "cross_entropy"
    fsdp: bool = False
    dp_shard: int = 1


SMOKE = (Case(1024, "head_tail"),)
DEFAULT = (
    Case(8192, "head_tail"),
    Case(8192, "contiguous", checkpointing=True),
    Case(8192, "head_tail", fsdp=True),
)
FULL = (
    *DEFAULT,
    Case(16384, "head_tail"),
    Case(16384, "stripe"),
    Case(16384, "head_tail", strategy="heads"),
    Case(16384, "contiguous", docs="one"),
    Case(16384, "head_tail", loss="linear_cross_entropy"),
    Case(16384, "head_tail", fsdp=True),
    Case(16384, "contiguous", checkpointing=True, fsdp=True),
)


def spec_of(case: Case) -> StepSpec:
    """The step of ``case``: :data:`SMALL_LLAMA` in :data:`DTYPE` with AdamW."""
    return StepSpec(
        model_config("llama", **SMALL_LLAMA), DTYPES[DTYPE], case.checkpointing, "adamw",
        case.loss, case.fsdp, case.dp_shard,
    )  # fmt: skip


def _held(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> int:
    """Bytes of ``model``'s parameters and buffers and ``opt``'s state (distinct storages; a
    DTensor's: its local shard's)."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    if opt is not None:
        states = [v for s in opt.state.values() for v in s.values()]
        tensors += [v for v in states if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = getattr(t, "_local_tensor", t).untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def cp_group(case: Case) -> dist.ProcessGroup:
    """This rank's CP group for ``case``: every rank, or with ``dp_shard`` replicas those of
    this rank's replica (consecutive ranks)."""
    if case.dp_shard == 1:
        return dist.group.WORLD
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % case.dp_shard:
        raise ValueError(f"dp_shard: {case.dp_shard} does not divide {world} ranks")
    mesh = (case.dp_shard, world // case.dp_shard)
    return init_device_mesh("cpu", mesh, mesh_dim_names=("dp", "cp"))["cp"].get_group()


def measure_rank(group: dist.ProcessGroup, case: Case) -> int:
    """This rank's measured peak bytes of a later step of ``case`` with CP over ``group``."""
    spec = spec_of(case)
    torch.manual_seed(0)
    model = build_model(spec, spec.layers)
    step = CausalStep(model, LossModule(model.get_output_embeddings(), LOSSES[spec.loss], group))
    if spec.fsdp:
        fully_shard_step(step, world_mesh())
    opt = make_optimizer(spec, step)
    ids = document_ids(document_lengths(case.docs, case.seq_len), case.seq_len)
    batch = packed_batch(ids, int(spec.config.vocab_size))
    sharder = ContextParallelSharder(group, case.layout, strategy=case.strategy)

    def train(ctx, local) -> None:  # noqa: ANN001
        forward_backward(step, local, ctx)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    train(*sharder.shard(batch))  # the first step: the guard's audit, the views' first use
    release_freed_memory()
    ctx, local = sharder.shard(batch)
    held = _held(step, opt)
    return held + cpu_peak(lambda: train(ctx, local))


def predict(world: int, case: Case) -> list[dict]:
    """Every CP rank's predicted peak of ``case`` on ``world`` CP ranks (in a process without a
    default group)."""
    ids = document_ids(document_lengths(case.docs, case.seq_len), case.seq_len)
    predictor = Predictor(spec_of(case))
    found = predictor.ranks(world, list(range(world)), case.layout, case.strategy, ids)
    return [{"rank": m.rank, "peak_bytes": m.peak_bytes, "at": m.at} for m in found]


def _cases(rt: Runtime) -> tuple[Case, ...]:
    return SMOKE if rt.cfg.quick else FULL if rt.cfg.full else DEFAULT


def steps(rt: Runtime) -> int:
    return len(_cases(rt))


def run(rt: Runtime) -> list[dict] | None:
    """Every case: each rank measures, rank 0 predicts; rank 0's rows."""
    rows: list[dict] = []
    for case in _cases(rt):
        rt.progress(f"memory prediction: S={case.seq_len} {case.layout} {case.strategy}")
        measured = torch.tensor([measure_rank(rt.pg, case)], dtype=torch.int64)
        every = torch.zeros(rt.world, dtype=torch.int64)
        all_gather_single(every, measured, group=rt.pg)
        if rt.rank == 0:
            predicted = run_in_child(
                "cpshard.bench.memory_prediction", str(rt.world), json.dumps(case.__dict__)
            )
            for p in predicted:
                m = int(every[p["rank"]])
                rows.append({
                    **case.__dict__, "world": rt.world, "rank": p["rank"],
                    "predicted": p["peak_bytes"], "measured": m, "at": p["at"],
                    "ratio": p["peak_bytes"] / m,
                })  # fmt: skip
        dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    return rows if rt.rank == 0 else None


def render(rows: list[dict]) -> str:
    size = ", ".join(f"{k} {v}" for k, v in SMALL_LLAMA.items())
    out = [
        "# memory prediction: cpshard plan --memory's per-rank peak of a training step beside",
        f"#   the measured one (CPU allocator), a Llama ({size}), {DTYPE}, AdamW, later step",
        f"#{'W':>3} {'S':>7} {'layout':>12} {'strategy':>9} {'ckpt':>5} {'fsdp':>5} {'docs':>10} "
        f"{'rank':>4} "
        f"{'predicted MiB':>14} {'measured MiB':>13} {'ratio':>6}  peak at",
    ]
    for r in rows:
        out.append(
            f" {r['world']:>3} {r['seq_len']:>7} {r['layout']:>12} {r['strategy']:>9} "
            f"{'on' if r['checkpointing'] else 'off':>5} {'on' if r.get('fsdp') else 'off':>5} "
            f"{r['docs']:>10} {r['rank']:>4} "
            f"{r['predicted'] / 2**20:>14.1f} {r['measured'] / 2**20:>13.1f} {r['ratio']:>6.3f}"
            f"  {r['at']}"
        )
    return "\n".join(out)


if __name__ == "__main__":
    w, arg, path = sys.argv[1:]
    result = predict(int(w), Case(**json.loads(arg)))
    with open(path, "w") as f:
        json.dump(result, f)
