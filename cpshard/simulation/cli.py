"""``cpshard plan``: simulate the per-step planning of a W-rank CP job in this one process.

Exit status 0 on success, 2 for bad arguments."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

from cpshard.attention.state import STRATEGIES
from cpshard.byte_units import human_bytes
from cpshard.cli_args import mesh_shape
from cpshard.layouts import LAYOUTS
from cpshard.simulation.documents import document_ids, document_lengths
from cpshard.simulation.head_shape import HeadShape, shape_from_model, shape_of_config
from cpshard.simulation.memory_cli import run_memory
from cpshard.simulation.memory_report import DEVICES, device
from cpshard.simulation.model_config import NAMED, model_config
from cpshard.simulation.plan_setup import MemorySetup, Setup
from cpshard.simulation.rank_plan import RankPlan, simulate_rank
from cpshard.simulation.ranks import ALL_UP_TO, parse_ranks
from cpshard.simulation.step_loss import LOSSES
from cpshard.simulation.training_step import DTYPES, OPTIMIZERS, StepSpec

MAX_WORLD = 1024
_SUFFIX = {"k": 1024, "K": 1024, "m": 1024**2, "M": 1024**2}

_DESCRIPTION = """\
Simulate what every rank of a W-rank context-parallel job plans for one packed batch, in this
one process: each simulated rank joins torch's fake backend as rank r of W and runs the
sharder's shard() on the same batch a real rank would. Per rank: tokens, causal attention cost
over the mean, K/V rows received and sent (the needed-rows exchange; the halo on contiguous
shards), bytes per strategy for a forward and backward of one layer (this rank's and the
busiest rank's), the strategy the step uses, the key buffer's K/V memory and shard()'s time.

Ranks: all of a job of up to {all_up_to}, else 0, 1, W/2, W-1 and a few sampled (--ranks all
for every one). --docs: one, equal:N, uniform:N, pareto:N (N long-tailed documents) or a comma
list of lengths (the rest is padding).

--memory: instead, each simulated rank's predicted peak memory of a training step (forward,
loss, backward, optimizer step) by category, and whether the worst rank fits --device. --model
is then a named shape ({named}), a transformers model type (llama, qwen3, ...; sizes from
--hidden-size, --intermediate-size, --vocab-size, --layers, --heads, --kv-heads, --head-dim) or
a config.json path. --max-seq-len LIMIT searches the largest S up to LIMIT that fits (--seq-len
is then the granularity). --fsdp: parameters, gradients and optimizer state sharded by FSDP2
over the W CP ranks times --dp-shard data-parallel replicas (default: replicated).
"""


def _size(text: str, what: str, high: int | None = None) -> int:
    t = text.strip()
    mult = _SUFFIX.get(t[-1:], 1)
    try:
        value = int(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: {text!r} is not an integer") from None
    if value < 1 or (high is not None and value > high):
        raise argparse.ArgumentTypeError(f"{what}: {text!r} must be in 1..{high or 'inf'}")
    return value


def _count(what: str, high: int | None = None):
    return lambda text: _size(text, what, high)


def _mesh(text: str) -> tuple[int, int]:
    return mesh_shape(text, "AxB", "4x8")


def parser(prog: str = "cpshard plan") -> argparse.ArgumentParser:
    description = _DESCRIPTION.format(all_up_to=ALL_UP_TO, named=", ".join(NAMED))
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=_count("--world", MAX_WORLD), help=f"ranks (1..{MAX_WORLD})")
    p.add_argument(
        "--mesh", type=_mesh, help="a 2-D (inter, intra) CP mesh AxB instead of --world (A*B ranks)"
    )
    p.add_argument(
        "--seq-len", type=_count("--seq-len"), required=True, help="tokens (k, M suffixes: x1024)"
    )
    p.add_argument("--docs", default="pareto:64", help="document lengths (default: pareto:64)")
    p.add_argument("--seed", type=int, default=0, help="seed of --docs and the sampled ranks")
    p.add_argument("--layout", choices=LAYOUTS, default="head_tail")
    p.add_argument("--strategy", choices=STRATEGIES, default="auto")
    p.add_argument(
        "--model", help="transformers config or model class name, or a config.json path"
    )
    for flag, what in (
        ("--heads", "query heads"),
        ("--kv-heads", "K/V heads"),
        ("--head-dim", "head size"),
        ("--layers", "attention layers (key-buffer memory over all of them)"),
        ("--window", "sliding window (keys a query sees)"),
    ):
        p.add_argument(flag, type=_count(flag), help=f"{what}; overrides --model's")
    for flag, what in (
        ("--hidden-size", "model width"),
        ("--intermediate-size", "MLP width"),
        ("--vocab-size", "vocabulary"),
    ):
        p.add_argument(flag, type=_count(flag), help=f"{what} (--memory); overrides --model's")
    p.add_argument("--dtype-bytes", type=_count("--dtype-bytes"), default=2, help="default: 2")
    memory = p.add_argument_group("memory (--memory)")
    memory.add_argument("--memory", action="store_true", help="predict each rank's peak memory")
    memory.add_argument("--dtype", choices=DTYPES, default="bf16", help="parameters' dtype")
    memory.add_argument("--checkpointing", choices=("on", "off"), default="off",
                        help="activation checkpointing of every decoder layer")  # fmt: skip
    memory.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    memory.add_argument("--loss", choices=tuple(LOSSES), default="cross_entropy")
    memory.add_argument("--fsdp", action="store_true",
                        help="parameters, gradients and optimizer state sharded by FSDP2 over "
                        "the CP ranks x --dp-shard (default: replicated on every rank)")
    memory.add_argument("--dp-shard", type=_count("--dp-shard"), metavar="N",
                        help="with --fsdp: N data-parallel replicas share the sharding "
                        "(FSDP2 over N x W ranks; default 1)")  # fmt: skip
    memory.add_argument("--device", default="h100",
                        help=f"{', '.join(DEVICES)} or a size (96GiB, 80GB); default h100",
                        )  # fmt: skip
    memory.add_argument("--jobs", type=_count("--jobs"), metavar="N",
                        help="ranks traced in N forked processes at once (default: the CPU "
                        "count; the same figures)")  # fmt: skip
    memory.add_argument("--max-seq-len", type=_count("--max-seq-len"), metavar="LIMIT",
                        help="search the largest S <= LIMIT (multiple of --seq-len) that fits",
                        )  # fmt: skip
    p.add_argument("--ranks", default="default", help="default, all, or a comma list of ranks")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write every figure to PATH")
    p.add_argument("--plot", dest="plot_path", metavar="PNG", help="per-rank figures (matplotlib)")
    return p


def _memory(args: argparse.Namespace) -> MemorySetup | None:
    if not args.memory:
        for flag in (
            "max_seq_len", "hidden_size", "intermediate_size", "vocab_size", "dp_shard", "jobs",
        ):  # fmt: skip
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')}: only with --memory")
        if args.fsdp:
            raise ValueError("--fsdp: only with --memory")
        return None
    if args.model is None:
        raise ValueError("--model: needed with --memory")
    if args.window is not None:
        raise ValueError("--window: not with --memory (the config's sliding window is used)")
    if args.plot_path is not None:
        raise ValueError("--plot: not with --memory (--json writes the figures)")
    sizes = {
        "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size, "layers": args.layers, "heads": args.heads,
        "kv_heads": args.kv_heads, "head_dim": args.head_dim,
    }  # fmt: skip
    spec = StepSpec(
        model_config(args.model, **sizes), DTYPES[args.dtype], args.checkpointing == "on",
        args.optimizer, args.loss, args.fsdp, args.dp_shard or 1,
    )  # fmt: skip
    jobs = args.jobs or os.cpu_count() or 1
    return MemorySetup(args.model, spec, device(args.device), args.max_seq_len, jobs)


def _shape(args: argparse.Namespace) -> HeadShape:
    given = {
        "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "layers": args.layers, "window": args.window,
    }  # fmt: skip
    if args.memory:
        if args.model is None:
            raise ValueError("--model: needed with --memory")
        config = model_config(args.model)
        return shape_of_config(config, args.dtype_bytes, repr(args.model), **given)
    if args.model is not None:
        return shape_from_model(args.model, args.dtype_bytes, **given)
    missing = [f"--{k.replace('_', '-')}" for k in ("heads", "head_dim") if given[k] is None]
    if missing:
        raise ValueError(f"{' and '.join(missing)}: needed without --model")
    given["kv_heads"] = given["kv_heads"] or given["heads"]
    return HeadShape(dtype_bytes=args.dtype_bytes, **given)


def setup(argv: Sequence[str], prog: str = "cpshard plan") -> Setup:
    """``argv`` as a :class:`Setup`; exits with status 2 on bad values."""
    p = parser(prog)
    args = p.parse_args(list(argv))
    try:
        if args.mesh is not None:
            world = args.mesh[0] * args.mesh[1]
            if args.world is not None and args.world != world:
                raise ValueError(f"--world: {args.world} but --mesh has {world} ranks")
            if world > MAX_WORLD:
                raise ValueError(f"--mesh: {world} ranks, more than {MAX_WORLD}")
        elif args.world is None:
            raise ValueError("--world: needed (or --mesh)")
        else:
            world = args.world
        if args.strategy == "hierarchical" and args.mesh is None:
            raise ValueError("--strategy: hierarchical needs a 2-D --mesh")
        for flag, path in (("--json", args.json_path), ("--plot", args.plot_path)):
            if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise ValueError(f"{flag}: the folder of {path} does not exist")
        if args.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
            raise ValueError("--plot: needs matplotlib, which is not installed; --json writes "
                             "the same figures")  # fmt: skip
        return Setup(
            world=world,
            mesh=args.mesh,
            seq_len=args.seq_len,
            docs=args.docs,
            lengths=document_lengths(args.docs, args.seq_len, args.seed),
            layout=args.layout,
            strategy=args.strategy,
            shape=_shape(args),
            ranks=parse_ranks(args.ranks, world, args.seed),
            json_path=args.json_path,
            plot_path=args.plot_path,
            memory=_memory(args),
        )
    except ValueError as exc:
        p.error(str(exc))


def summary(plans: list[RankPlan]) -> dict:
    """Max and mean over the simulated ranks, the busiest-rank bytes and the planning times."""
    def over(field: str) -> dict:
        values = [getattr(p, field) for p in plans]
        return {"max": max(values), "mean": statistics.fmean(values)}

    times = [p.plan_ms for p in plans]
    return {
        "ranks": len(plans),
        **{f: over(f) for f in ("cost_over_mean", "rows_received", "rows_sent", "key_buffer_bytes")},
        "busiest_bytes": plans[0].busiest_bytes,
        "strategy": plans[0].strategy,
        "plan_ms": {"median": statistics.median(times), "max": max(times)},
    }


def render(cfg: Setup, plans: list[RankPlan], summ: dict) -> str:
    s = cfg.shape
    where = f"mesh {cfg.mesh[0]}x{cfg.mesh[1]}" if cfg.mesh else f"W={cfg.world}"
    kinds = list(plans[0].strategy_bytes)
    out = [
        f"# cpshard plan: {where}, S={cfg.seq_len}, {len(cfg.lengths)} document(s) "
        f"({cfg.docs}), layout {cfg.layout}, strategy {cfg.strategy}",
        f"#   heads {s.heads}, kv heads {s.kv_heads}, head dim {s.head_dim}, layers {s.layers}, "
        f"window {s.window}, {s.dtype_bytes} B/element; bytes: one layer, forward + backward",
        f"#{'rank':>5} {'tokens':>8} {'cost/mean':>9} {'recv rows':>10} {'sent rows':>10} "
        f"{'key rows':>9} {'key buf':>10} "
        + " ".join(f"{k:>12}" for k in kinds)
        + f" {'uses':>11} {'plan ms':>9}",
    ]
    for p in plans:
        out.append(
            f" {p.rank:>5} {p.tokens:>8} {p.cost_over_mean:>9.3f} {p.rows_received:>10} "
            f"{p.rows_sent:>10} {p.key_rows:>9} {human_bytes(p.key_buffer_bytes):>10} "
            + " ".join(f"{human_bytes(p.strategy_bytes[k]):>12}" for k in kinds)
            + f" {p.strategy:>11} {p.plan_ms:>9.1f}"
        )
    busiest = ", ".join(f"{k} {human_bytes(v)}" for k, v in summ["busiest_bytes"].items())
    out += [
        f"# over {summ['ranks']} simulated rank(s) of {cfg.world}: cost/mean max "
        f"{summ['cost_over_mean']['max']:.3f}; received rows max "
        f"{summ['rows_received']['max']} mean {summ['rows_received']['mean']:.0f}; key buffer max "
        f"{human_bytes(summ['key_buffer_bytes']['max'])}",
        f"# busiest rank of the job: {busiest}; the step uses {summ['strategy']}",
        f"# shard() planning: median {summ['plan_ms']['median']:.1f} ms, worst "
        f"{summ['plan_ms']['max']:.1f} ms",
    ]
    return "\n".join(out)


def plot(path: str, plans: list[RankPlan]) -> None:
    """Per simulated rank: cost over the mean, received K/V rows, shard() time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [p.rank for p in plans]
    panels = (
        ("cost / mean", [p.cost_over_mean for p in plans]),
        ("K/V rows received", [p.rows_received for p in plans]),
        ("shard() ms", [p.plan_ms for p in plans]),
    )
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 7), sharex=True)
    for ax, (label, values) in zip(axes, panels, strict=True):
        ax.plot(ranks, values, "o-", markersize=3)
        ax.set_ylabel(label)
    axes[-1].set_xlabel("rank")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None, prog: str = "cpshard plan") -> int:
    """Run ``cpshard plan``; the exit status."""
    cfg = setup(sys.argv[1:] if argv is None else argv, prog)
    if cfg.memory is not None:
        return run_memory(cfg, cfg.memory)
    ids = document_ids(cfg.lengths, cfg.seq_len)
    plans, started = [], time.perf_counter()
    for i, rank in enumerate(cfg.ranks):
        plans.append(
            simulate_rank(rank, cfg.world, cfg.layout, cfg.strategy, ids, cfg.shape, cfg.mesh)
        )
        print(
            f"[{i + 1}/{len(cfg.ranks)}] {time.perf_counter() - started:4.0f} s  rank {rank}: "
            f"shard() {plans[-1].plan_ms:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
    summ = summary(plans)
    print(render(cfg, plans, summ))
    if cfg.json_path is not None:
        setup_fields = dataclasses.asdict(cfg)
        for key in ("json_path", "plot_path", "lengths", "memory"):
            setup_fields.pop(key)
        setup_fields["documents"] = len(cfg.lengths)
        with open(cfg.json_path, "w") as f:
            json.dump(
                {"setup": setup_fields, "ranks": [dataclasses.asdict(p) for p in plans],
                 "summary": summ}, f, indent=1,
            )  # fmt: skip
    if cfg.plot_path is not None:
        plot(cfg.plot_path, plans)
    return 0
