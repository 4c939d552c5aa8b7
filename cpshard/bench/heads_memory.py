"""Peak extra memory and time of one forward+backward of head-parallel CP attention (the
``heads`` strategy) beside a DeepSpeed-Ulysses-style reference: one causal document, contiguous
shards, spawned gloo ranks on CPU.

The reference is the Ulysses floor: per tensor one permute copy into the send buffer, one
``all_to_all_single``, one permute copy out of it, SDPA over the gathered tokens, and the same
back for the output (key/value heads repeated up to the world size when fewer, as Ulysses
needs). Run ``python -m cpshard.bench.heads_memory [--worlds 2 4] [--seqs 4096 16384]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard.bench.config import BenchConfig
from cpshard.bench.memory import peak_extra_bytes
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps

HEAD_DIM = 64
HEAD_SHAPES = ((8, 8), (8, 2))  # (query heads, key/value heads)


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
    """The Ulysses reference: causal SDPA of ``[B, H, L, D]`` shards (rank-major tokens)."""
    w = dist.get_world_size(pg)
    if k.shape[1] % w:
        k, v = (t.repeat_interleave(w // k.shape[1], dim=1) for t in (k, v))
    qh, kh, vh = (_SeqToHeads.apply(t, pg) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
    return _HeadsToSeq.apply(out, pg)


def cpshard_attention(
    pg: dist.ProcessGroup, seq: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """cpshard's ``heads`` strategy over one causal document of ``seq`` tokens, contiguous."""
    from cpshard import ContextParallelSharder, cp_attention

    doc = torch.ones(1, seq, dtype=torch.int64)
    sharder = ContextParallelSharder(pg, "contiguous", strategy="heads")
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with ctx():
            return cp_attention(q, k, v, enable_gqa=True)

    return attend


def leaves(
    rank: int, local: int, q_heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's q, k, v ``[1, H, local, HEAD_DIM]`` (leaves) and an upstream gradient."""
    g = torch.Generator().manual_seed(11 + rank)

    def make(h: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(1, h, local, HEAD_DIM, generator=g).requires_grad_(grad)

    return make(q_heads), make(kv_heads), make(kv_heads), make(q_heads, False)


def measure(
    rank: int,
    world: int,
    seq: int,
    q_heads: int,
    kv_heads: int,
    extra: dict[str, Callable] | None = None,
    repeats: int = 5,
) -> dict[str, dict[str, float]] | None:
    """Rank 0's row: per implementation, median fwd+bwd seconds (max over ranks) and peak extra
    bytes (max over ranks). ``extra``: more implementations ``pg -> attend(q, k, v)`` (whose
    tokens are rank-major), checked against the reference like cpshard's."""
    pg = dist.group.WORLD
    rt = Runtime(BenchConfig(world=world), rank, world, "gloo", torch.device("cpu"), pg)
    q, k, v, grad = leaves(rank, seq // world, q_heads, kv_heads)
    impls = {
        "ulysses": lambda q, k, v: ulysses_attention(pg, q, k, v),
        "cpshard": cpshard_attention(pg, seq),
    }
    impls.update({name: make(pg) for name, make in (extra or {}).items()})
    want = impls["ulysses"](q, k, v).detach()
    for name, fn in impls.items():
        if not torch.allclose(fn(q, k, v).detach(), want, rtol=1e-4, atol=1e-4):
            raise AssertionError(f"rank {rank}: {name} differs from the reference")

    def step(fn: Callable) -> Callable[[], None]:
        def run() -> None:
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v).backward(grad)

        return run

    steps = {name: step(fn) for name, fn in impls.items()}
    times = time_steps(rt, steps, warmup=1, repeats=repeats, iters=1, target_s=0)
    row = {
        name: {"s": times[name].median_s, "peak": peak_extra_bytes(rt, fn, runs=2)}
        for name, fn in steps.items()
    }
    return row if rank == 0 else None


def main(extra: dict[str, Callable] | None = None) -> None:
    """Print one line per case (W, S, heads) and implementation."""
    from cpshard.testing import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--repeats", type=int, default=5, help="timed steps per implementation")
    args = p.parse_args()
    print(f"{'W':>2} {'S':>6} {'heads':>5} {'impl':>10} {'fwd+bwd ms':>11} {'peak MiB':>9}")
    for world in args.worlds:
        for seq in args.seqs:
            for qh, kvh in HEAD_SHAPES:
                row = run_ranks(measure, world, seq, qh, kvh, extra, args.repeats, timeout=3600)[0]
                for name, fig in row.items():
                    print(
                        f"{world:>2} {seq:>6} {qh:>2}/{kvh:<2} {name:>10} "
                        f"{fig['s'] * 1e3:>11.1f} {fig['peak'] / 2**20:>9.1f}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
