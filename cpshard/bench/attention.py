"""CP attention for every layout and exchange strategy: :func:`cpshard.cp_attention` inside each
sharder layout's context next to the straightforward way.

The baseline all-gathers the full K and V (list all-gather + cat, backward reduce-scatter),
builds this rank's dense per-document causal mask ``[L, S]`` over the gathered (rank-major)
keys and calls SDPA. One batch row of S = 16384 tokens (the default run's one case: 4096;
``--quick``: 512) in documents of
256-768 tokens (~512 on average; ``--quick``: 16-48), head dim 64, one step forward + backward,
and the bytes each forward keeps for its backward.

The strategy grid (:mod:`cpshard.bench.attention_strategies`) runs ``needed_rows``, ``heads``
and ``auto`` (and ``hierarchical`` on a 2 x 2 mesh of 4 ranks) for MHA (8 / 8) and GQA (8 / 2)
heads on the layouts of :data:`~cpshard.bench.attention_strategies.GRID_LAYOUTS` and the
block-diagonal batch.

The mask rows (:mod:`cpshard.bench.attention_masks`, every run) execute a mask description:
chunked causal attention and bidirectional image blocks inside causal documents.

The sliding-window rows (8 query / 2 KV heads, strategy ``needed_rows``: their columns are its
exchange's) attend with a window of 4096 keys (``--quick``: 64) over documents longer than it
(6144-12288 tokens; ``--quick``: 96-192), the baseline with the window in its dense mask: a
windowed layer receives at most ``window - 1`` rows before each of its runs (the bound column),
where full attention over such documents receives nearly the whole sequence. Two more rows run
the ``balanced`` layout on the first quarter of the first batch (S = 4096: the explicit
baseline's autograd holds several ``[L, S]`` logits per head) with soft-capped logits (the
explicit kernel, as on every device) and with sinks, against the all-gather baseline running
the same explicit statement.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpshard import LAYOUTS, ContextParallelSharder, cp_attention
from cpshard.attention import active_state
from cpshard.attention.plain import plain_attention
from cpshard.bench import attention_masks as masks
from cpshard.bench import attention_strategies as grid
from cpshard.bench.blockdiag import (
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    all_gather_baseline,
    case_fields,
    check_output,
    dense_mask,
    documents,
    fwd_bwd_figures,
    random_qkv,
)
from cpshard.bench.memory import release_freed_memory, saved_bytes
from cpshard.bench.report import mib
from cpshard.bench.runtime import Runtime

SEQ_LEN, QUICK_SEQ_LEN = 16384, 512
SUBSET_SEQ_LEN = 4096  # the default run's one case (the dense baseline grows as S^2)
DOC_LENS, QUICK_DOC_LENS = (256, 769), (16, 49)
WINDOW, QUICK_WINDOW = 4096, 64
SOFTCAP = 50.0  # Gemma 2's attention soft-cap
VARIANT_SHRINK = 4  # the soft-cap and sinks rows run on the first quarter of the batch
LONG_DOC_LENS, QUICK_LONG_DOC_LENS = (6144, 12289), (96, 193)


def cases(rt: Runtime) -> list[tuple[str, str]]:
    """The strategy grid's cases this run: all with ``--full``, else one (``balanced`` layout,
    GQA heads), which still times every exchange strategy."""
    return grid.cases() if rt.cfg.full else [("balanced", "GQA")]


def steps(rt: Runtime) -> int:
    return len(cases(rt)) + len(masks.CASES) + (len(LAYOUTS) + 2 if rt.cfg.full else 0)


def _pairs(rt: Runtime, window: int | None) -> list[int]:
    """(query, key) pairs every rank's spans attend, from the active state (host)."""
    state = active_state().windowed(window)
    mine = sum(
        end - first
        for s in state.spans
        for first, end in (s.key_range(i, True, window) for i in range(s.n))
    )
    every = torch.zeros(rt.world, dtype=torch.int64)
    every[rt.rank] = mine
    dist.all_reduce(every, group=rt.pg)
    return every.tolist()


def _max(rt: Runtime, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=rt.pg)
    return int(t)


def run_case(
    rt: Runtime,
    layout: str,
    doc: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
) -> dict:
    """fwd+bwd time, peak extra memory, K/V rows received and per-rank compute of one layout
    under strategy ``needed_rows`` (``window``: a sliding window of that many keys; ``softcap``:
    soft-capped logits; ``sinks``: one sink logit per head), the baseline with the same
    variant."""
    sharder = ContextParallelSharder(rt.pg, layout, strategy="needed_rows")
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    lay = sharder.shard_layout
    mine = lay.indices(rt.rank)
    keys = torch.cat([lay.indices(r) for r in range(rt.world)])  # the gathered keys' positions
    q, k, v, grad = random_qkv(rt, mine.numel())
    mask = dense_mask(doc, mine, keys)
    if window is not None:
        mask = mask & (mine[:, None] - keys[None, :] < window)
    sink = torch.linspace(-1, 1, HEADS, device=rt.device, dtype=rt.dtype) if sinks else None

    def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor):
        return plain_attention(q, k, v, m, 0.0, False, None, True, None, softcap, sink)

    variant = softcap is not None or sinks
    base = all_gather_baseline(rt, mask.to(rt.device), explicit if variant else None)

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with ctx():
            return cp_attention(
                q, k, v, enable_gqa=True, window=window, softcap=softcap, sinks=sink
            )

    name = " ".join(
        [layout]
        + ([f"window {window}"] if window else [])
        + ([f"softcap {softcap:g}"] if softcap else [])
        + (["sinks"] if sinks else [])
    )
    check_output(rt, ours, base, (q, k, v), f"attention {name}")
    with ctx():
        state = active_state().windowed(window)
        pairs = _pairs(rt, window)
    runs = len(state.spans)
    out = {
        "layout": layout,
        "case": name,
        "window": window,
        "softcap": softcap,
        "sinks": sinks,
        "window_rows_bound_max": None if window is None else _max(rt, runs * (window - 1)),
        **case_fields(rt, doc),
        "ours_kv_rows_received_max": _max(rt, state.exchange.received_rows),
        "base_kv_rows_received": mine.numel() * (rt.world - 1),
        "pairs_per_rank": pairs,
        "pairs_max_over_mean": max(pairs) * len(pairs) / max(1, sum(pairs)),
    }
    for who, fn in (("ours", ours), ("base", base)):
        out[f"{who}_saved_bytes"] = saved_bytes(rt, lambda fn=fn: fn(q, k, v), (q, k, v))
    return {**out, **fwd_bwd_figures(rt, {"ours": ours, "base": base}, (q, k, v), grad)}


def run(rt: Runtime) -> dict:
    """The strategy grid, the mask rows (:mod:`cpshard.bench.attention_masks`), then (with
    ``--full``) every layout with a sliding window and the soft-capped and sinks rows, on the
    whole group, one batch each."""
    quick = rt.cfg.quick
    seq_len = QUICK_SEQ_LEN if quick else SEQ_LEN if rt.cfg.full else SUBSET_SEQ_LEN
    doc = documents(seq_len, QUICK_DOC_LENS if quick else DOC_LENS)
    long_doc = documents(seq_len, QUICK_LONG_DOC_LENS if quick else LONG_DOC_LENS)
    window = QUICK_WINDOW if quick else WINDOW
    mesh = grid.cp_mesh(rt)
    strategies = []
    for layout, heads in cases(rt):
        rt.progress(f"attention {layout} {heads} S={seq_len} strategies")
        strategies += grid.run_case(rt, layout, heads, doc, mesh)
        release_freed_memory()
    described = masks.run(rt)
    rows = []
    if not rt.cfg.full:
        return {"strategies": strategies, "masks": described, "rows": rows}
    for layout in LAYOUTS:
        rt.progress(f"attention {layout} S={seq_len} window={window}")
        rows.append(run_case(rt, layout, long_doc, window))
        release_freed_memory()
    short = doc[:, : seq_len // VARIANT_SHRINK]  # the explicit baseline holds [L, S] logits
    rt.progress(f"attention balanced S={short.shape[1]} softcap")
    rows.append(run_case(rt, "balanced", short, softcap=SOFTCAP))
    rt.progress(f"attention balanced S={short.shape[1]} sinks")
    rows.append(run_case(rt, "balanced", short, sinks=True))
    return {"strategies": strategies, "masks": described, "rows": rows}


def render_strategies(rows: list[dict]) -> list[str]:
    """The strategy grid's table: one line per configuration."""
    head = rows[0] if rows else {"world": 0, "seq_len": 0, "documents": 0}
    out = [
        "# attention: cp_attention fwd+bwd per exchange strategy (cpshard.attention.strategy)  vs",
        "#   full K/V all-gather + dense per-document causal mask + SDPA;",
        f"#   W = {head['world']}, S = {head['seq_len']}, {head['documents']} documents, head dim "
        f"{HEAD_DIM}; MHA {'/'.join(map(str, grid.HEAD_SHAPES['MHA']))}, GQA "
        f"{'/'.join(map(str, grid.HEAD_SHAPES['GQA']))} query/KV heads",
        f"#   layouts {', '.join(dict.fromkeys(r['layout'] for r in rows))}; blockdiag: "
        "make_cp_blockdiag_batch_and_ctx",
        "#   on the same batch (contiguous shards); (mesh): on a 2 x 2 (inter, intra) mesh",
        "#   moved MiB: the cost model's bytes of the busiest rank over fwd+bwd (auto: of the one",
        "#   it picked, shown as auto>picked); kv rows: K/V rows received (needed_rows, max over",
        "#   ranks); median ms (max over ranks), peak extra MiB of fwd+bwd, MiB kept for backward",
        f"#{'layout':>13} {'heads':>5} {'strategy':>24} {'moved MiB':>10} {'kv rows':>8} "
        f"{'cpshard ms':>11} {'base ms':>9} {'speedup':>8} {'cpshard MiB':>12} {'base MiB':>9} "
        f"{'kept MiB':>9} {'base kept':>9}",
    ]
    for r in rows:
        name = r["strategy"] + (f">{r['picked']}" if r["strategy"] == "auto" else "")
        name += " (mesh)" if r["mesh"] else ""
        rows_received = "-" if r["kv_rows_received_max"] is None else r["kv_rows_received_max"]
        out.append(
            f" {r['layout']:>13} {r['heads']:>5} {name:>24} {mib(r['bytes_moved_max']):>10} "
            f"{rows_received:>8} {r['fwd_bwd_s'] * 1e3:>11.1f} {r['base_fwd_bwd_s'] * 1e3:>9.1f} "
            f"{r['speedup']:>8.2f} {mib(r['fwd_bwd_peak_bytes']):>12} "
            f"{mib(r['base_fwd_bwd_peak_bytes']):>9} {mib(r['saved_bytes']):>9} "
            f"{mib(r['base_saved_bytes']):>9}"
        )
    return out


def render_rows(rows: list[dict]) -> list[str]:
    """The windowed, soft-capped and sinks rows' table."""
    head = rows[0] if rows else {"world": 0, "seq_len": 0, "documents": 0}
    out = [
        "# attention: cp_attention fwd+bwd, strategy needed_rows (needed-only K/V rows, one",
        "#   all-to-all-v)  vs  full K/V all-gather + dense per-document causal mask + SDPA;",
        f"#   W = {head['world']}, S = {head['seq_len']}, {head['documents']} documents, {HEADS} "
        f"query / {KV_HEADS} KV heads, head dim {HEAD_DIM}; median ms (max over ranks), peak",
        "#   extra MiB of fwd+bwd, MiB the forward keeps for the backward beyond q/k/v (a model",
        "#   layer holds it until its backward), K/V rows received (max over ranks), attended",
        "#   pairs max/mean over ranks",
        f"#{'layout':>22} {'cpshard ms':>11} {'base ms':>9} {'speedup':>8} {'cpshard MiB':>12} "
        f"{'base MiB':>9} {'kept MiB':>9} {'base kept':>9} {'kv rows':>8} {'base rows':>9} "
        f"{'max/mean':>9}",
    ]
    windowed = [r for r in rows if r.get("window") is not None]
    variants = [r for r in rows if r.get("softcap") is not None or r.get("sinks")]
    for r in rows:
        if r is (windowed[0] if windowed else None):
            out.append(
                f"# sliding window {r['window']} over {r['documents']} documents longer than it "
                "(rows bound: window - 1 per run, max over ranks, in the last column)"
            )
        if r is (variants[0] if variants else None):
            out.append(
                f"# soft-capped logits and sinks at S = {r['seq_len']} (the baseline: the same "
                "explicit statement)"
            )
        balance = (
            f"{r['pairs_max_over_mean']:>9.2f}"
            if r.get("window") is None
            else f"{r['window_rows_bound_max']:>9}"
        )
        out.append(
            f" {r['case'] if r in variants else r['layout']:>22} "
            f"{r['ours_fwd_bwd_s'] * 1e3:>11.1f} "
            f"{r['base_fwd_bwd_s'] * 1e3:>9.1f} "
            f"{r['speedup']:>8.2f} {mib(r['ours_fwd_bwd_peak_bytes']):>12} "
            f"{mib(r['base_fwd_bwd_peak_bytes']):>9} {mib(r['ours_saved_bytes']):>9} "
            f"{mib(r['base_saved_bytes']):>9} {r['ours_kv_rows_received_max']:>8} "
            f"{r['base_kv_rows_received']:>9} {balance}"
        )
    return out


def render(result: dict) -> str:
    rows = ["", *render_rows(result["rows"])] if result["rows"] else []
    described = ["", *masks.render(result["masks"])]
    return "\n".join([*render_strategies(result["strategies"]), *described, *rows])
