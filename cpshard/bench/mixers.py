"""Hybrid-model layers under CP: a Gated DeltaNet layer's short causal convolution and gated
delta rule on this rank's contiguous shard (:func:`cpshard.mixers.cp_causal_conv1d`,
:func:`cpshard.mixers.cp_gated_delta_rule`) next to the straightforward way; then, against the
same baseline, Mamba's selective scan (:func:`cpshard.mixers.cp_selective_scan`, ``CHANNELS``
channels of state ``D_STATE``) and MiniMax's lightning attention
(:func:`cpshard.mixers.cp_lightning_attention`, the value heads and head size of the first row).

The baseline all-gathers the layer's inputs (the convolution's channels, then q, k, v, the
decays and rates; backward reduce-scatter), runs the convolution and the recurrence over the
whole sequence on every rank (per document) and keeps its own rows. cpshard receives
``kernel - 1`` rows before each of its runs for the convolution and ONE ragged all-gather of
the documents' end states and transitions for the recurrence (the parallel scan of
:mod:`cpshard.mixers.carry`). The other exact way to carry the state, a sequential pass over
ranks, makes rank r wait for the recurrences of ranks 0..r-1 in the forward and of r+1..W-1 in
the backward: its latency is about W times one rank's recurrence; that figure is derived from
the measured time of this rank's recurrence alone (no carry), printed beside it. One batch row
of S = 16384 tokens (``--quick``: 512) in documents of 2048-6144 tokens (``--quick``: 64-192),
so that most documents span ranks; 2 key / 4 value heads of dimension 64 (``--quick``: 16),
kernel 4; contiguous layout; one step forward + backward (time and bytes; no peak memory).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import ContextParallelSharder, gather_sequence
from cpshard.attention import active_state
from cpshard.bench.blockdiag import documents
from cpshard.bench.blockdiag import check_output, fwd_bwd_figures
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps
from cpshard.mixers import (
    cp_causal_conv1d,
    cp_gated_delta_rule,
    cp_lightning_attention,
    cp_selective_scan,
    recurrence_runs,
)
from cpshard.mixers.chunks import CHUNK, ChunkTable, chunk_table
from cpshard.mixers.delta_rule import chunked_delta_rule, l2_normalise
from cpshard.mixers.runs import RecurrenceRuns, Run
from cpshard.mixers.selective_scan import scanned
from cpshard.mixers.ssd import chunked_ssd

SEQ_LEN, QUICK_SEQ_LEN = 16384, 512
DOC_LENS, QUICK_DOC_LENS = (2048, 6145), (64, 193)
KEY_HEADS, VALUE_HEADS, DIM, QUICK_DIM, KERNEL = 2, 4, 64, 16, 4
CHANNELS, QUICK_CHANNELS, D_STATE = 128, 16, 16  # the selective scan's


def steps(rt: Runtime) -> int:
    return 1


def _inputs(rt: Runtime, local: int, dim: int) -> tuple[torch.Tensor, ...]:
    """This rank's layer inputs (leaves): conv channels, q, k, v, log decays, rates; and the
    conv weight."""
    gen = torch.Generator().manual_seed(7 + rt.rank)
    channels = 2 * KEY_HEADS * dim + VALUE_HEADS * dim

    def make(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen) * scale + shift
        return t.to(device=rt.device, dtype=rt.dtype).requires_grad_()

    x = make(1, local, channels)
    q, k = make(1, local, KEY_HEADS, dim), make(1, local, KEY_HEADS, dim)
    v = make(1, local, VALUE_HEADS, dim)
    g = (-torch.rand(1, local, VALUE_HEADS, generator=gen) * 0.1).to(rt.device, rt.dtype)
    beta = torch.rand(1, local, VALUE_HEADS, generator=gen).to(rt.device, rt.dtype)
    weight = torch.randn(channels, KERNEL, generator=torch.Generator().manual_seed(3))
    return x, q, k, v, g.requires_grad_(), beta.requires_grad_(), weight.to(rt.device, rt.dtype)


def _documents_table(doc: torch.Tensor) -> tuple[list[int], list[int], ChunkTable]:
    """The documents' starts and ends in the one row of ``doc``, and their chunk table over the
    whole sequence."""
    starts = [0] + [i for i in range(1, doc.shape[1]) if doc[0, i] != doc[0, i - 1]]
    ends = starts[1:] + [doc.shape[1]]
    runs = tuple(Run(0, s, e - s, s, s, e) for s, e in zip(starts, ends, strict=True))
    return starts, ends, chunk_table(runs, doc.shape[1], 1, CHUNK)


def _full_sequence_layer(doc: torch.Tensor, weight: torch.Tensor):
    """The layer over the whole sequence, every document from a zero state (what each rank of
    the baseline runs on the gathered inputs)."""
    starts, ends, table = _documents_table(doc)

    def layer(x, q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = weight.shape[1]
        parts = [
            F.conv1d(x[:, s:e].transpose(1, 2), weight[:, None], padding=kernel - 1,
                     groups=x.shape[2])[..., : e - s]
            for s, e in zip(starts, ends, strict=True)
        ]  # fmt: skip
        y = F.silu(torch.cat(parts, -1).transpose(1, 2))
        rep = v.shape[2] // q.shape[2]
        qn, kn = (l2_normalise(t.repeat_interleave(rep, 2)) for t in (q, k))
        o, _ = chunked_delta_rule(qn * qn.shape[-1] ** -0.5, kn, v, g, beta, table.to(q.device), None)
        return y, o

    return layer


def _carry_bytes(runs: RecurrenceRuns, state_numel: int, transition_numel: int, itemsize: int) -> int:
    """What the carry's one ragged all-gather brings every rank: each rank's end states and
    transitions."""
    return itemsize * sum(
        len(ex) * state_numel + sum(rs[i].incoming for i in ex) * transition_numel
        for rs, ex in zip(runs.runs, runs.exported, strict=True)
    )


def _selective_scan_row(rt: Runtime, doc: torch.Tensor, ctx, runs: RecurrenceRuns) -> dict:
    """Mamba's selective scan on this rank's contiguous shard against the all-gather baseline:
    its figures, bytes received and the check that both agree."""
    seq_len = doc.shape[1]
    local = seq_len // rt.world
    channels = QUICK_CHANNELS if rt.cfg.quick else CHANNELS
    gen = torch.Generator().manual_seed(11 + rt.rank)

    def make(*shape: int, low: float | None = None) -> torch.Tensor:
        t = torch.rand(*shape, generator=gen) + low if low is not None else torch.randn(*shape, generator=gen)
        return t.to(device=rt.device, dtype=rt.dtype).requires_grad_()

    x, dt = make(1, local, channels), make(1, local, channels, low=0.01)
    b, c = make(1, local, D_STATE), make(1, local, D_STATE)
    rates = -torch.linspace(0.5, 4.0, channels * D_STATE).view(channels, D_STATE)
    a = rates.to(device=rt.device, dtype=rt.dtype)
    leaves = (x, dt, b, c)
    table = _documents_table(doc)[2].to(rt.device)
    mine = slice(rt.rank * local, (rt.rank + 1) * local)

    def ours(x, dt, b, c) -> torch.Tensor:
        with ctx():
            return cp_selective_scan(x, dt, a, b, c, None, runs, active_state().group).sum()

    def base(x, dt, b, c) -> torch.Tensor:
        gathered = [gather_sequence(t.contiguous(), rt.pg, 1) for t in (x, dt, b, c)]
        y, _ = scanned(*gathered[:2], a, *gathered[2:], table, None)
        return y.view(1, seq_len, channels)[:, mine].sum()

    check_output(rt, ours, base, leaves, "mixers (selective scan)")
    itemsize = torch.empty((), dtype=rt.dtype).element_size()
    one = torch.ones((), device=rt.device, dtype=rt.dtype)
    unprofiled = dataclasses.replace(rt, cfg=dataclasses.replace(rt.cfg, memory=False))
    out = {
        "channels": channels,
        "d_state": D_STATE,
        "ours_carry_bytes_received": _carry_bytes(runs, channels * D_STATE, channels * D_STATE, itemsize),
        "base_bytes_received": (seq_len - local) * (2 * channels + 2 * D_STATE) * itemsize,
    }
    out.update(fwd_bwd_figures(unprofiled, {"ours": ours, "base": base}, leaves, one))
    return out


def _lightning_row(rt: Runtime, doc: torch.Tensor, ctx, runs: RecurrenceRuns, dim: int) -> dict:
    """MiniMax's lightning attention on this rank's contiguous shard against the all-gather
    baseline (the same chunked recurrence over the whole sequence, per document): its figures,
    bytes received and the check that both agree."""
    seq_len = doc.shape[1]
    local = seq_len // rt.world
    gen = torch.Generator().manual_seed(13 + rt.rank)

    def make() -> torch.Tensor:
        t = torch.randn(1, local, VALUE_HEADS, dim, generator=gen) * dim**-0.5
        return t.to(device=rt.device, dtype=rt.dtype).requires_grad_()

    q, k, v = make(), make(), make()
    slope = torch.logspace(-3, -1, VALUE_HEADS).to(device=rt.device, dtype=rt.dtype)
    leaves = (q, k, v)
    table = _documents_table(doc)[2].to(rt.device)
    mine = slice(rt.rank * local, (rt.rank + 1) * local)

    def ours(q, k, v) -> torch.Tensor:
        with ctx():
            return cp_lightning_attention(q, k, v, slope, runs, active_state().group).sum()

    def base(q, k, v) -> torch.Tensor:
        qf, kf, vf = (gather_sequence(t.contiguous(), rt.pg, 1) for t in (q, k, v))
        step = vf.new_ones(vf.shape[:3])
        y, _ = chunked_ssd(vf, step, -step * slope, kf, qf, table, None)
        assert y is not None
        return y.view(1, seq_len, VALUE_HEADS, dim)[:, mine].sum()

    check_output(rt, ours, base, leaves, "mixers (lightning attention)")
    itemsize = torch.empty((), dtype=rt.dtype).element_size()
    one = torch.ones((), device=rt.device, dtype=rt.dtype)
    unprofiled = dataclasses.replace(rt, cfg=dataclasses.replace(rt.cfg, memory=False))
    state_numel = VALUE_HEADS * dim * dim  # a state; a transition is one decay per head
    out = {
        "heads": VALUE_HEADS,
        "head_dim": dim,
        "ours_carry_bytes_received": _carry_bytes(runs, state_numel, VALUE_HEADS, itemsize),
        "base_bytes_received": (seq_len - local) * 3 * VALUE_HEADS * dim * itemsize,
    }
    out.update(fwd_bwd_figures(unprofiled, {"ours": ours, "base": base}, leaves, one))
    return out


def run(rt: Runtime) -> dict:
    quick = rt.cfg.quick
    seq_len, dim = (QUICK_SEQ_LEN, QUICK_DIM) if quick else (SEQ_LEN, DIM)
    rt.progress(f"mixers: Gated DeltaNet conv + recurrence S={seq_len}")
    doc = documents(seq_len, QUICK_DOC_LENS if quick else DOC_LENS)
    sharder = ContextParallelSharder(rt.pg, "contiguous")
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    local = seq_len // rt.world
    x, q, k, v, g, beta, weight = _inputs(rt, local, dim)
    leaves = (x, q, k, v, g, beta)
    full_layer = _full_sequence_layer(doc, weight)
    mine = slice(rt.rank * local, (rt.rank + 1) * local)

    def ours(x, q, k, v, g, beta) -> torch.Tensor:
        with ctx():
            state = active_state()
            y = cp_causal_conv1d(x, weight, None, state, "silu")
            o = cp_gated_delta_rule(q, k, v, g, beta, recurrence_runs(state, "bench"), state.group)
        return y.sum() + o.sum()

    def base(x, q, k, v, g, beta) -> torch.Tensor:
        gathered = [gather_sequence(t.contiguous(), rt.pg, 1) for t in (x, q, k, v, g, beta)]
        y, o = full_layer(*gathered)
        return y[:, mine].sum() + o.view(1, seq_len, VALUE_HEADS, dim)[:, mine].sum()

    with ctx():
        state = active_state()
        runs = recurrence_runs(state, "bench")
        halo_rows = torch.tensor([state.windowed(KERNEL).exchange.received_rows])
    dist.all_reduce(halo_rows, op=dist.ReduceOp.MAX, group=rt.pg)  # the most any rank receives
    itemsize = torch.empty((), dtype=rt.dtype).element_size()
    state_numel = VALUE_HEADS * dim * dim  # a state and a transition alike
    inputs_per_token = x.shape[2] + 2 * KEY_HEADS * dim + VALUE_HEADS * dim + 2 * VALUE_HEADS
    out = {
        "world": rt.world,
        "seq_len": seq_len,
        "documents": int(doc.max()),
        "key_heads": KEY_HEADS,
        "value_heads": VALUE_HEADS,
        "head_dim": dim,
        "kernel": KERNEL,
        "dtype": rt.cfg.dtype,
        "ours_conv_bytes_received": int(halo_rows) * x.shape[2] * itemsize,
        "ours_carry_bytes_received": _carry_bytes(runs, state_numel, state_numel, itemsize),
        "base_bytes_received": (seq_len - local) * inputs_per_token * itemsize,
    }
    check_output(rt, ours, base, leaves, "mixers")
    one = torch.ones((), device=rt.device, dtype=rt.dtype)
    # no memory columns: a profiled step of this section (the recurrence's thousands of small
    # allocations, on 4 ranks) ran the 24 GiB bench machine out of memory
    unprofiled = dataclasses.replace(rt, cfg=dataclasses.replace(rt.cfg, memory=False))
    out.update(fwd_bwd_figures(unprofiled, {"ours": ours, "base": base}, leaves, one))

    # this rank's recurrence alone (no carry): the unit a sequential pass would chain W times
    table = chunk_table(runs.mine, local, 1, CHUNK)

    def alone() -> None:
        for t in leaves:
            t.grad = None
        rep = VALUE_HEADS // KEY_HEADS
        qn, kn = (l2_normalise(t.repeat_interleave(rep, 2)) for t in (q, k))
        o, _ = chunked_delta_rule(qn * qn.shape[-1] ** -0.5, kn, v, g, beta, table, None)
        o.sum().backward()

    cfg = rt.cfg
    timing = time_steps(
        rt, {"alone": alone}, warmup=cfg.warmup, repeats=cfg.repeats, iters=cfg.iters,
        target_s=cfg.target_s,
    )["alone"]  # fmt: skip
    out["recurrence_alone_s"] = timing.median_s
    out["sequential_estimate_s"] = rt.world * timing.median_s
    rt.progress(f"mixers: Mamba selective scan S={seq_len}")
    out["selective_scan"] = _selective_scan_row(rt, doc, ctx, runs)
    rt.progress(f"mixers: lightning attention S={seq_len}")
    out["lightning"] = _lightning_row(rt, doc, ctx, runs, dim)
    return out


def render(r: dict) -> str:
    mib = 1 << 20
    m, a = r["selective_scan"], r["lightning"]
    return "\n".join(
        [
            "# mixers: a Gated DeltaNet layer's causal conv + gated delta rule fwd+bwd on the",
            "#   rank's contiguous shard (conv: kernel - 1 rows per run; recurrence: one ragged",
            "#   all-gather of end states and transitions)  vs  all-gather of the layer's inputs +",
            f"#   the layer on the whole sequence on every rank; W = {r['world']}, S = "
            f"{r['seq_len']}, {r['documents']} documents, {r['key_heads']} key / "
            f"{r['value_heads']} value heads, dim {r['head_dim']}, kernel {r['kernel']}, "
            f"{r['dtype']}",
            f"#{'cpshard ms':>11} {'base ms':>9} {'speedup':>8} {'conv KiB':>9} "
            f"{'carry KiB':>10} {'base MiB':>9} {'alone ms':>9} {'seq. est ms':>12}",
            f" {r['ours_fwd_bwd_s'] * 1e3:>11.1f} {r['base_fwd_bwd_s'] * 1e3:>9.1f} "
            f"{r['speedup']:>8.2f} {r['ours_conv_bytes_received'] / 1024:>9.1f} "
            f"{r['ours_carry_bytes_received'] / 1024:>10.1f} "
            f"{r['base_bytes_received'] / mib:>9.1f} {r['recurrence_alone_s'] * 1e3:>9.1f} "
            f"{r['sequential_estimate_s'] * 1e3:>12.1f}",
            "#   bytes received per rank (conv: the most any rank receives; carry: all ranks'",
            "#   payloads, which every rank receives);",
            "#   alone = this rank's recurrence with no carry (median, max over ranks); seq. est =",
            "#   W x alone, the latency a sequential pass over ranks would add up to (derived)",
            f"# mixers: Mamba's selective scan fwd+bwd, {m['channels']} channels of state "
            f"{m['d_state']} (one ragged all-gather of end states and transitions)  vs  the same "
            "baseline",
            f"#{'cpshard ms':>11} {'base ms':>9} {'speedup':>8} {'carry KiB':>10} {'base MiB':>9}",
            f" {m['ours_fwd_bwd_s'] * 1e3:>11.1f} {m['base_fwd_bwd_s'] * 1e3:>9.1f} "
            f"{m['speedup']:>8.2f} {m['ours_carry_bytes_received'] / 1024:>10.1f} "
            f"{m['base_bytes_received'] / mib:>9.1f}",
            f"# mixers: MiniMax's lightning attention fwd+bwd, {a['heads']} heads of "
            f"{a['head_dim']} (one ragged all-gather of end states and per-head decays)  vs  the "
            "same baseline",
            f"#{'cpshard ms':>11} {'base ms':>9} {'speedup':>8} {'carry KiB':>10} {'base MiB':>9}",
            f" {a['ours_fwd_bwd_s'] * 1e3:>11.1f} {a['base_fwd_bwd_s'] * 1e3:>9.1f} "
            f"{a['speedup']:>8.2f} {a['ours_carry_bytes_received'] / 1024:>10.1f} "
            f"{a['base_bytes_received'] / mib:>9.1f}",
        ]
    )
