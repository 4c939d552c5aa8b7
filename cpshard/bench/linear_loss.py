"""The CP loss from hidden states: :func:`cpshard.cp_linear_cross_entropy` beside
:func:`cpshard.cp_cross_entropy` of the materialised logits ``hidden @ weight.T``, one rank's
forward + backward, the logits' matmul included.

What a rank holds does not depend on the world size (the loss's one collective is the all-reduce
of a one-element count, given here as a sharded batch's targets carry it), so rank 0 measures one
rank's loss while the other ranks wait at a barrier (raise ``--timeout`` for the full-size case:
it runs for minutes on a CPU). The gradient buffers of the hidden states and the head are
allocated before each step, as in every training step after the first; the peak extra memory is
the allocator's peak during the step beyond them. S/W = 4096 tokens, V = 152064 (Qwen's
vocabulary), H = 1024 (``--quick``: 256, 8192, 128), in the run's dtype.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from cpshard import cp_cross_entropy, cp_linear_cross_entropy
from cpshard.bench.memory import local_peak_bytes, release_freed_memory
from cpshard.bench.runtime import Runtime
from cpshard.linear_loss import DEFAULT_CHUNK_BYTES, chunk_size

TOKENS, VOCAB, HIDDEN = 4096, 152064, 1024
QUICK_TOKENS, QUICK_VOCAB, QUICK_HIDDEN = 256, 8192, 128
IMPLS = ("cp_cross_entropy", "cp_linear_cross_entropy")


def steps(rt: Runtime) -> int:
    return len(IMPLS)


def _losses(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, count: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    """Each implementation's loss of one rank's tokens (the global count given)."""
    return {
        "cp_cross_entropy": lambda: cp_cross_entropy(
            hidden @ weight.T, labels, None, num_labelled=count
        ),
        "cp_linear_cross_entropy": lambda: cp_linear_cross_entropy(
            hidden, weight, labels, None, num_labelled=count
        ),
    }


def _measure(rt: Runtime, tokens: int, vocab: int, width: int) -> dict:
    """Rank 0's figures: per implementation the fwd+bwd seconds of each of ``repeats`` runs (the
    first one profiled for its peak extra bytes unless ``--no-memory``: a few dozen large ops,
    whose profiling costs little beside them) and their median; the two checked to agree."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(tokens, width, generator=gen).to(rt.device, rt.dtype).requires_grad_()
    weight = (torch.randn(vocab, width, generator=gen) / width**0.5).to(rt.device, rt.dtype)
    weight.requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(rt.device)
    labels[::7] = -100
    count = (labels != -100).sum()
    for t in (hidden, weight):
        t.grad = torch.zeros_like(t)
    losses = _losses(hidden, weight, labels, count)
    out: dict = {}
    seen: dict[str, list[torch.Tensor]] = {}
    for name, loss in losses.items():
        rt.progress(f"loss: {name} S/W={tokens} V={vocab} H={width}")

        def step(loss: Callable[[], torch.Tensor] = loss, name: str = name) -> None:
            value = loss()
            value.backward()
            seen[name] = [value.detach()]

        times, peak = [], None
        for i in range(rt.cfg.repeats):
            for t in (hidden, weight):
                t.grad.zero_()
            release_freed_memory()
            rt.sync()
            start = time.perf_counter()
            if i == 0 and rt.cfg.memory:  # the first run profiled for its peak
                peak = local_peak_bytes(rt, step)
            else:
                step()
            rt.sync()
            times.append(time.perf_counter() - start)
        seen[name] += [t.grad.clone() for t in (hidden, weight)]
        out[name] = {
            "fwd_bwd_s": statistics.median(times), "fwd_bwd_repeats_s": times, "peak_bytes": peak,
        }  # fmt: skip
    tol = 1e-4 if rt.dtype in (torch.float32, torch.float64) else 3e-2
    for what, want, got in zip(("loss", "hidden grad", "weight grad"), *seen.values()):
        if not torch.allclose(want.float(), got.float(), rtol=tol, atol=tol):
            raise AssertionError(f"rank {rt.rank}: loss section: the {what} differs from the base")
    base, ours = (out[name] for name in IMPLS)
    return {
        "tokens": tokens,
        "vocab": vocab,
        "hidden": width,
        "dtype": rt.cfg.dtype,
        "chunk_tokens": chunk_size(tokens, vocab, rt.dtype, DEFAULT_CHUNK_BYTES),
        "logits_bytes": tokens * vocab * rt.dtype.itemsize,
        **{f"{name}_{k}": v for name, fig in out.items() for k, v in fig.items()},
        "peak_ratio": (
            base["peak_bytes"] / ours["peak_bytes"]
            if rt.cfg.memory and ours["peak_bytes"]
            else None
        ),
        "time_ratio": ours["fwd_bwd_s"] / base["fwd_bwd_s"],
    }


def run(rt: Runtime) -> dict | None:
    """Rank 0 measures; the other ranks wait at a barrier."""
    sizes = (QUICK_TOKENS, QUICK_VOCAB, QUICK_HIDDEN) if rt.cfg.quick else (TOKENS, VOCAB, HIDDEN)
    result = _measure(rt, *sizes) if rt.rank == 0 else None
    if rt.rank != 0:
        rt.done_steps += len(IMPLS)
    dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    return result


def render(r: dict) -> str:
    mib = 1 << 20
    lines = [
        f"# loss: one rank's cross entropy fwd+bwd from hidden states, S/W = {r['tokens']} tokens, "
        f"V = {r['vocab']}, H = {r['hidden']}, {r['dtype']}",
        f"#   (the logits' matmul included, gradient buffers allocated; the logits alone: "
        f"{r['logits_bytes'] / mib:.0f} MiB): cp_cross_entropy of the materialised logits  vs",
        f"#   cp_linear_cross_entropy in chunks of {r['chunk_tokens']} tokens (the default budget)",
        f"#{'implementation':>24} {'fwd+bwd s':>10} {'peak MiB':>9}",
    ]
    for name in IMPLS:
        peak = r[f"{name}_peak_bytes"]
        peak_text = "-" if peak is None else f"{peak / mib:.0f}"
        lines.append(f" {name:>24} {r[f'{name}_fwd_bwd_s']:>10.2f} {peak_text:>9}")
    if r["peak_ratio"] is not None:
        ratio = r["peak_ratio"]
        lines.append(f"#   peak: cp_cross_entropy / cp_linear_cross_entropy = {ratio:.1f}x")
    lines.append(
        f"#   time: cp_linear_cross_entropy / cp_cross_entropy = {r['time_ratio']:.2f} "
        "(one more matmul: the backward recomputes each chunk's logits)"
    )
    return "\n".join(lines)
