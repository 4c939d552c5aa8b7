"""Peak extra resident memory and time of one forward+backward of CP attention over one causal
document (contiguous shards, spawned gloo ranks on CPU), per strategy (``heads``,
``needed_rows`` and what ``auto`` picks), beside DeepSpeed-Ulysses's ``DistributedAttention``
around SDPA where DeepSpeed is installed, and beside the floor every implementation holds: the
output and the gradients of q, k and v (the inputs exist before the call).

The peak is resident memory: ``VmHWM`` after resetting it (``/proc/self/clear_refs``) minus
``VmRSS`` before the call, the C heap trimmed first, max over ranks, the median of ``runs``
calls. Ranks are spawned with ``MALLOC_MMAP_THRESHOLD_`` fixed (unless already set), so that the
C allocator maps and unmaps every large block: the peak is what the call holds at once, not
what the heap kept from an earlier call. Every output is checked against a plain Ulysses
statement (one all-to-all each way per tensor, SDPA between).

``cpshard bench --ops heads_memory`` runs it as a section (rank 0 runs the cases in a fresh
process, which spawns their ranks; opt-in: the cases take minutes on a CPU); ``python -m
cpshard.bench.heads_memory [--worlds 2 4] [--seqs 4096 16384] [--json PATH]`` runs it alone.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard.bench.child import run_in_child
from cpshard.bench.config import BenchConfig
from cpshard.bench.memory import release_freed_memory
from cpshard.bench.report import mib
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps

HEAD_DIM = 64
HEAD_SHAPES = ((8, 8), (8, 2))  # (query heads, key/value heads)
STRATEGIES = ("heads", "needed_rows", "auto")
MMAP_THRESHOLD = "65536"  # bytes: larger blocks are mapped apart and unmapped when freed
CASE_TIMEOUT_S = 3600.0  # a case's whole run, and each of its collectives

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _SeqToHeads(torch.autograd.Function):
    """``[B, H, L, D]`` (this rank's tokens) -> ``[B, H / W, W * L, D]`` (its heads); the
    backward is the inverse movement."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
        ctx.pg = pg
        return _to_heads(x, pg)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _to_seq(grad, ctx.pg), None


class _HeadsToSeq(torch.autograd.Function):
    """Inverse of :class:`_SeqToHeads`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
        ctx.pg = pg
        return _to_seq(x, pg)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _to_heads(grad, ctx.pg), None


def _to_heads(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    w = dist.get_world_size(pg)
    b, h, length, d = x.shape
    send = x.reshape(b, w, h // w, length, d).transpose(0, 1).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=pg)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // w, w * length, d)


def _to_seq(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    w = dist.get_world_size(pg)
    b, c, total, d = x.shape
    send = x.reshape(b, c, w, total // w, d).permute(2, 0, 1, 3, 4).contiguous()
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=pg)
    return got.transpose(0, 1).reshape(b, w * c, total // w, d)


def ulysses_attention(
    pg: dist.ProcessGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """The reference outputs are checked against: causal SDPA of ``[B, H, L, D]`` shards
    (rank-major tokens) between plain all-to-alls (K/V heads repeated up to W when fewer)."""
    w = dist.get_world_size(pg)
    if k.shape[1] % w:
        k, v = (t.repeat_interleave(w // k.shape[1], dim=1) for t in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(t, pg) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return _HeadsToSeq.apply(out, pg)


def deepspeed_installed() -> bool:
    """Whether DeepSpeed can be imported here (it is no dependency of cpshard)."""
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_version() -> str | None:
    """The installed DeepSpeed's version, None where it is not installed."""
    if not deepspeed_installed():
        return None
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def deepspeed_attention(pg: dist.ProcessGroup) -> Attend:
    """DeepSpeed-Ulysses: ``DistributedAttention`` around SDPA on ``[B, S, H, D]`` views of the
    shards, K/V heads repeated up to W when fewer (as it needs)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True, enable_gqa=True))

    attn, w = DistributedAttention(local, pg, scatter_idx=2, gather_idx=1), pg.size()

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if k.shape[1] % w:
            k, v = (x.repeat_interleave(w // k.shape[1], dim=1) for x in (k, v))
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        return t(attn(t(q), t(k), t(v), 0))

    return attend


def cpshard_attention(
    pg: dist.ProcessGroup, seq: int, strategy: str, q_heads: int, kv_heads: int
) -> tuple[Attend, str, int]:
    """cpshard over one causal document of ``seq`` tokens, contiguous shards, with ``strategy``;
    the strategy a call of those heads takes (``auto``'s pick) and the bytes the cost model
    says it holds beyond the floor (:func:`~cpshard.attention.strategy.strategy_memory`)."""
    from cpshard import ContextParallelSharder, cp_attention
    from cpshard.attention import active_state
    from cpshard.attention.strategy import chosen_strategy, strategy_memory

    doc = torch.ones(1, seq, dtype=torch.int64)
    sharder = ContextParallelSharder(pg, "contiguous", strategy=strategy)
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with ctx():
            return cp_attention(q, k, v, enable_gqa=True)

    with ctx():
        size = torch.tensor([], dtype=torch.float32).element_size()
        args = (active_state(), None, q_heads, kv_heads, HEAD_DIM, HEAD_DIM, size)
        picked = chosen_strategy(*args)
        held = strategy_memory(*args)[picked]
    return attend, picked, held


def leaves(
    rank: int, local: int, q_heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's q, k, v ``[1, H, local, HEAD_DIM]`` (leaves) and an upstream gradient."""
    g = torch.Generator().manual_seed(11 + rank)

    def make(h: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(1, h, local, HEAD_DIM, generator=g).requires_grad_(grad)

    return make(q_heads), make(kv_heads), make(kv_heads), make(q_heads, False)


def floor_bytes(local: int, q_heads: int, kv_heads: int, size: int = 4) -> int:
    """What every implementation holds after the call: the output and the q, k, v gradients."""
    return (2 * q_heads + 2 * kv_heads) * local * HEAD_DIM * size


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field))


def resident_peak(rt: Runtime, step: Callable[[], object], runs: int) -> int:
    """Peak extra resident bytes of ``step`` (module docstring): per run the max over ranks,
    then the median over runs."""
    peaks = []
    for _ in range(runs):
        release_freed_memory()
        dist.barrier(group=rt.pg)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _kib("VmRSS:")
        step()
        t = torch.tensor([(_kib("VmHWM:") - before) * 1024], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.pg)
        peaks.append(int(t.item()))
    return int(statistics.median(peaks))


def measure(
    rank: int,
    world: int,
    seq: int,
    q_heads: int,
    kv_heads: int,
    with_deepspeed: bool,
    runs: int = 5,
    repeats: int = 5,
) -> dict[str, dict[str, float | str | None]] | None:
    """Rank 0's row: per implementation, median fwd+bwd seconds (max over ranks), its resident
    peak (bytes), what it ran (``auto``: the strategy it picked) and the bytes the cost model
    says that holds beyond the floor (None for DeepSpeed)."""
    pg = dist.group.WORLD
    rt = Runtime(BenchConfig(world=world), rank, world, "gloo", torch.device("cpu"), pg)
    q, k, v, grad = leaves(rank, seq // world, q_heads, kv_heads)
    impls = {s: cpshard_attention(pg, seq, s, q_heads, kv_heads) for s in STRATEGIES}
    if with_deepspeed:
        impls["deepspeed"] = (deepspeed_attention(pg), "Ulysses", None)
    want = ulysses_attention(pg, q, k, v).detach()
    for name, (fn, *_) in impls.items():
        if not torch.allclose(fn(q, k, v).detach(), want, rtol=1e-4, atol=1e-4):
            raise AssertionError(f"rank {rank}: {name} differs from the reference")

    def step(fn: Attend) -> Callable[[], None]:
        def run() -> None:
            fn(q, k, v).backward(grad)
            for t in (q, k, v):
                t.grad = None  # after the peak is taken: the next run starts without them

        return run

    steps = {name: step(fn) for name, (fn, *_) in impls.items()}
    times = time_steps(rt, steps, warmup=1, repeats=repeats, iters=1, target_s=0)
    row: dict[str, dict[str, float | str | None]] = {
        name: {
            "s": times[name].median_s, "peak": resident_peak(rt, fn, runs), "ran": ran,
            "held_model": held,
        }
        for (name, fn), (_, ran, held) in zip(steps.items(), impls.values())
    }  # fmt: skip
    row["floor"] = {"peak": floor_bytes(seq // world, q_heads, kv_heads)}
    return row if rank == 0 else None


def run_case(
    world: int, seq: int, q_heads: int, kv_heads: int, runs: int = 5, repeats: int = 5
) -> dict[str, dict[str, float | str | None]]:
    """One case on ``world`` spawned ranks (with the module's fixed mmap threshold; collectives
    wait as long as a case may take: a long document's backward on a loaded CPU keeps the other
    ranks waiting for minutes)."""
    from cpshard.testing import RankPool

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
    with RankPool(world, pg_timeout=CASE_TIMEOUT_S) as pool:
        return pool.run(
            measure, seq, q_heads, kv_heads, deepspeed_installed(), runs, repeats,
            timeout=CASE_TIMEOUT_S,
        )[0]  # fmt: skip


def case_row(
    world: int, seq: int, q_heads: int, kv_heads: int, runs: int = 5, repeats: int = 5
) -> dict:
    """One case measured, as a JSON-able row: per implementation its peak (bytes), median
    fwd+bwd seconds and what it ran; the floor; DeepSpeed's version (None: not installed)."""
    got = run_case(world, seq, q_heads, kv_heads, runs, repeats)
    floor = got.pop("floor")
    impls = {
        name: {
            "peak_bytes": int(fig["peak"]), "fwd_bwd_s": float(fig["s"]), "ran": fig["ran"],
            "held_model_bytes": fig["held_model"],
        }
        for name, fig in got.items()
    }
    return {
        "world": world, "seq_len": seq, "q_heads": q_heads, "kv_heads": kv_heads,
        "head_dim": HEAD_DIM, "dtype": "float32", "runs": runs, "floor_bytes": int(floor["peak"]),
        "deepspeed": deepspeed_version(), "impls": impls,
    }  # fmt: skip


def _ratio(peak: int, ref: int | None) -> str:
    return f"{peak / ref:.2f}" if ref else "-"


def render(rows: list[dict]) -> str:
    """The section's table: per case each strategy's peak with its ratio to DeepSpeed-Ulysses's
    (where installed) and to the floor."""
    versions = {r["deepspeed"] for r in rows}
    ds = ", ".join(sorted(v for v in versions if v)) or "not installed: ratios to the floor only"
    out = [
        "# heads_memory: peak extra resident memory of one fwd+bwd of causal attention over one",
        "#   document (VmHWM, max over ranks, median of runs; contiguous shards, d = 64, fp32,",
        "#   gloo ranks) per strategy, beside DeepSpeed-Ulysses (DistributedAttention + SDPA;",
        f"#   DeepSpeed {ds}) and the floor (out, dq, dk, dv)",
        "#   cells: MiB (/ DeepSpeed, / floor)",
        "#" + f"{'W':>2} {'S':>6} {'heads':>5} "
        + " ".join(f"{n:>22}" for n in (*STRATEGIES, "deepspeed"))
        + f" {'floor':>6} {'auto ran':>12}",
    ]
    for r in rows:
        floor, impls = r["floor_bytes"], r["impls"]
        ref = impls.get("deepspeed", {}).get("peak_bytes")
        cells = []
        for name in (*STRATEGIES, "deepspeed"):
            if name not in impls:
                cells.append(f"{'-':>22}")
                continue
            peak = impls[name]["peak_bytes"]
            text = f"{mib(peak)} ({_ratio(peak, ref)}, {_ratio(peak, floor)})"
            cells.append(f"{text:>22}")
        heads = f"{r['q_heads']}/{r['kv_heads']}"
        out.append(
            f" {r['world']:>2} {r['seq_len']:>6} {heads:>5} {' '.join(cells)} {mib(floor):>6} "
            f"{impls['auto']['ran']:>12}"
        )
    return "\n".join(out)


def _cases(rt: Runtime) -> list[tuple[int, int, int, int]]:
    """(W, S, query heads, KV heads) of the section's cases: W = 2 and 4 at S = 4096 (with
    ``--full`` also 16384; with ``--quick`` W = 2 at S = 1024)."""
    worlds = (2,) if rt.cfg.quick else (2, 4)
    seqs = (1024,) if rt.cfg.quick else (4096, 16384) if rt.cfg.full else (4096,)
    return [(w, s, qh, kvh) for w in worlds for s in seqs for qh, kvh in HEAD_SHAPES]


def steps(rt: Runtime) -> int:
    return len(_cases(rt))


def run(rt: Runtime) -> list[dict] | None:
    """Rank 0 runs each case in a fresh process (which spawns the case's ranks, the allocator
    set as the measurement needs) while the others wait."""
    runs = 1 if rt.cfg.quick else 3
    repeats = 1 if rt.cfg.quick else rt.cfg.repeats
    rows = []
    for world, seq, qh, kvh in _cases(rt):
        rt.progress(f"heads_memory W={world} S={seq} heads={qh}/{kvh}")
        if rt.rank == 0:
            args = ["--worlds", str(world), "--seqs", str(seq), "--heads", f"{qh}/{kvh}"]
            args += ["--runs", str(runs), "--repeats", str(repeats), "--json"]
            rows.extend(run_in_child("cpshard.bench.heads_memory", *args))
        dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    return rows if rt.rank == 0 else None


def _head_shape(text: str) -> tuple[int, int]:
    try:
        q_heads, kv_heads = (int(n) for n in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads: {text!r} is not Q/KV (e.g. 8/2)") from None
    if q_heads < 1 or kv_heads < 1 or q_heads % kv_heads:
        raise argparse.ArgumentTypeError(f"--heads: {text!r}: KV heads must divide query heads")
    return q_heads, kv_heads


def main(argv: list[str] | None = None) -> None:
    """Run the cases (W, S, heads) and print the section's table, or write its rows as JSON
    with ``--json`` (a progress line per case on stderr)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    p.add_argument(
        "--heads", type=_head_shape, nargs="+", default=list(HEAD_SHAPES),
        help="query/KV head shapes (default: 8/8 8/2)",
    )  # fmt: skip
    p.add_argument("--runs", type=int, default=5, help="measured calls per implementation")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per implementation")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="write the rows to PATH")
    args = p.parse_args(argv)
    rows = []
    for world in args.worlds:
        for seq in args.seqs:
            for qh, kvh in args.heads:
                print(f"heads_memory: W={world} S={seq} heads={qh}/{kvh}", file=sys.stderr)
                rows.append(case_row(world, seq, qh, kvh, args.runs, args.repeats))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(rows, f, indent=1)
    else:
        print(render(rows), flush=True)


if __name__ == "__main__":
    main()
