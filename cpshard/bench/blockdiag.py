"""Block-diagonal CP attention: :func:`cpshard.cp_blockdiag_sdpa` next to the straightforward way.

The baseline all-gathers the full K and V (differentiably: list all-gather + cat, backward
reduce-scatter), builds this rank's dense block-diagonal causal mask ``[L, S]`` and calls SDPA.
cpshard receives only the K/V rows its documents reach back to and attends per document.
Shapes: 8 query heads, 2 KV heads, head dim 64, documents of 512 tokens, one step forward +
backward; cases S = 4096 on 2 ranks (the first two of the group) and
S = 4096 x W on all W ranks.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
from cpshard.bench.baselines import ListAllGatherCat
from cpshard.bench.memory import peak_extra_bytes
from cpshard.bench.report import mib
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps

HEADS, KV_HEADS, HEAD_DIM, DOC_LEN = 8, 2, 64, 512
QUICK_TOKENS_PER_RANK, QUICK_DOC_LEN = 128, 48


def cases(world: int, quick: bool) -> list[tuple[int, int]]:
    """(ranks, sequence length) per case: S = 4096 on 2 ranks, then 4096 tokens per rank on all."""
    per_rank = QUICK_TOKENS_PER_RANK if quick else 2048
    out = [(2, 2 * per_rank)]
    if world > 2:
        out.append((world, 2 * per_rank * world))
    return out


def steps(rt: Runtime) -> int:
    return len(cases(rt.world, rt.cfg.quick))


def dense_mask(doc: torch.Tensor, mine: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The per-document causal mask of queries at positions ``mine`` over keys at positions
    ``keys`` of the documents ``doc`` ``[1, S]``: ``[1, 1, L, K]``, True = attend."""
    d = doc[0]
    same = (d[mine, None] == d[None, keys]) & (d[mine, None] != 0)
    return (same & (keys[None, :] <= mine[:, None]))[None, None]


def documents(seq_len: int, lens: tuple[int, int]) -> torch.Tensor:
    """``[1, S]`` document ids of random lengths in ``[lens[0], lens[1])`` (fixed seed), the last
    one cut at S: the same batch on every rank and in every run."""
    g = torch.Generator().manual_seed(5)
    sizes = torch.randint(*lens, (seq_len // lens[0] + 1,), generator=g)
    return torch.repeat_interleave(torch.arange(1, sizes.numel() + 1), sizes)[:seq_len].view(1, -1)


def case_fields(rt: Runtime, doc: torch.Tensor) -> dict:
    """The shapes an attention row over the documents ``doc`` ``[1, S]`` reports."""
    return {
        "seq_len": doc.shape[1],
        "world": rt.world,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "documents": int(doc.max()),
        "dtype": rt.cfg.dtype,
    }


def check_output(rt: Runtime, ours, base, leaves: tuple[torch.Tensor, ...], what: str) -> None:
    """Raise, naming this rank and ``what``, unless ``ours(*leaves)`` matches the baseline's."""
    want, got = base(*leaves).detach(), ours(*leaves).detach()
    tol = 1e-4 if rt.dtype in (torch.float32, torch.float64) else 3e-2
    if not torch.allclose(want, got, rtol=tol, atol=tol):
        raise AssertionError(f"rank {rt.rank}: {what}: output differs from the baseline")


def all_gather_baseline(rt: Runtime, mask: torch.Tensor, attention=None):
    """Attention over the all-gathered K/V (rank-major) with a dense ``mask`` ``[1, 1, L, S]``
    (``attention(q, k, v, mask)``: SDPA unless given)."""

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_full = ListAllGatherCat.apply(k, rt.pg, 2)
        v_full = ListAllGatherCat.apply(v, rt.pg, 2)
        return (attention or sdpa)(q, k_full, v_full, mask)

    return attend


def random_qkv(
    rt: Runtime, local: int, heads: int = HEADS, kv_heads: int = KV_HEADS
) -> tuple[torch.Tensor, ...]:
    """This rank's q ``[1, heads, local, HEAD_DIM]``, k and v ``[1, kv_heads, local, HEAD_DIM]``
    (leaves) and an upstream gradient."""
    gen = torch.Generator().manual_seed(99 + rt.rank)

    def make(n: int, grad: bool = True) -> torch.Tensor:
        t = torch.randn(1, n, local, HEAD_DIM, generator=gen)
        return t.to(device=rt.device, dtype=rt.dtype).requires_grad_(grad)

    return make(heads), make(kv_heads), make(kv_heads), make(heads, grad=False)


def run_case(rt: Runtime, seq_len: int, doc_len: int) -> dict:
    """fwd+bwd time and peak extra memory of both at one sequence length, on ``rt``'s group."""
    world, rank = rt.world, rt.rank
    local = seq_len // world
    doc = (torch.arange(seq_len) // doc_len + 1).view(1, seq_len)
    batch = {"inputs_embeds": torch.zeros(1, seq_len, 1), "_packed_seq_ids": doc}
    ctx, _ = make_cp_blockdiag_batch_and_ctx(rt.pg, None, batch)
    q, k, v, grad = random_qkv(rt, local)
    mine = torch.arange(rank * local, (rank + 1) * local)
    base = all_gather_baseline(rt, dense_mask(doc, mine, torch.arange(seq_len)).to(rt.device))

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with ctx():
            return cp_blockdiag_sdpa(q, k, v, enable_gqa=True)

    check_output(rt, ours, base, (q, k, v), f"blockdiag S={seq_len}")

    out = {
        "seq_len": seq_len,
        "world": world,
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "doc_len": doc_len,
        "dtype": rt.cfg.dtype,
    }
    return {**out, **fwd_bwd_figures(rt, {"ours": ours, "base": base}, (q, k, v), grad)}


def fwd_bwd_timings(
    rt: Runtime, impls: dict, leaves: tuple[torch.Tensor, ...], grad: torch.Tensor
) -> dict[str, dict]:
    """``who`` -> median fwd+bwd time (max over ranks), its repeats, CPU time and peak extra
    memory of ``impls[who](*leaves)`` back-propagating ``grad`` (all timed side by side)."""

    def step(impl):
        def run() -> None:
            for t in leaves:
                t.grad = None
            impl(*leaves).backward(grad)

        return run

    runs = {who: step(impl) for who, impl in impls.items()}
    cfg = rt.cfg
    timings = time_steps(
        rt, runs, warmup=cfg.warmup, repeats=cfg.repeats, iters=cfg.iters, target_s=cfg.target_s
    )
    return {
        who: {
            "fwd_bwd_s": timings[who].median_s,
            "fwd_bwd_repeats_s": list(timings[who].repeats_s),
            "fwd_bwd_cpu_s": timings[who].cpu_s,
            "fwd_bwd_peak_bytes": peak_extra_bytes(rt, fn) if cfg.memory else None,
        }
        for who, fn in runs.items()
    }


def fwd_bwd_figures(
    rt: Runtime, impls: dict, leaves: tuple[torch.Tensor, ...], grad: torch.Tensor
) -> dict:
    """:func:`fwd_bwd_timings` of ``impls`` ``ours`` and ``base`` as ``{who}_{figure}`` keys,
    and the base/ours speedup."""
    figures = fwd_bwd_timings(rt, impls, leaves, grad)
    out = {f"{who}_{k}": v for who, fig in figures.items() for k, v in fig.items()}
    out["speedup"] = out["base_fwd_bwd_s"] / out["ours_fwd_bwd_s"]
    return out


def run(rt: Runtime) -> list[dict]:
    """Every case; a case on fewer ranks than the group runs on its first ranks while the rest
    wait (every rank creates the subgroup, as ``new_group`` requires)."""
    doc_len = QUICK_DOC_LEN if rt.cfg.quick else DOC_LEN
    rows = []
    for ranks, seq_len in cases(rt.world, rt.cfg.quick):
        rt.progress(f"blockdiag S={seq_len} on {ranks} ranks")
        if ranks == rt.world:
            rows.append(run_case(rt, seq_len, doc_len))
            continue
        sub = dist.new_group(list(range(ranks)))
        if rt.rank < ranks:
            rows.append(run_case(dataclasses.replace(rt, world=ranks, pg=sub), seq_len, doc_len))
            dist.destroy_process_group(sub)
        dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    return rows


def render(rows: list[dict]) -> str:
    out = [
        "# blockdiag: cp_blockdiag_sdpa fwd+bwd (per-document causal attention, needed-only K/V",
        f"#   halo)  vs  full K/V all-gather + dense block-diagonal mask + SDPA; {HEADS} query /",
        f"#   {KV_HEADS} KV heads, head dim {HEAD_DIM}; median ms (max over ranks) / peak extra MiB",
        f"#{'world':>6} {'S':>7} {'doc':>5} {'cpshard ms':>11} {'base ms':>9} {'speedup':>8} "
        f"{'cpshard MiB':>12} {'base MiB':>9} {'mem':>6}",
    ]
    for r in rows:
        ours_mib, base_mib = r["ours_fwd_bwd_peak_bytes"], r["base_fwd_bwd_peak_bytes"]
        mem = f"{ours_mib / base_mib:.2f}" if ours_mib is not None and base_mib else "-"
        out.append(
            f" {r['world']:>6} {r['seq_len']:>7} {r['doc_len']:>5} {r['ours_fwd_bwd_s'] * 1e3:>11.1f} "
            f"{r['base_fwd_bwd_s'] * 1e3:>9.1f} {r['speedup']:>8.2f} {mib(ours_mib):>12} "
            f"{mib(base_mib):>9} {mem:>6}"
        )
    return "\n".join(out)
