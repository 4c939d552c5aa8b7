"""The attention section's mask rows: CP attention of a :class:`~cpshard.masks.MaskDescription`
(``cp_attention(..., mask=description)``) against the all-gather baseline.

Two rows on the ``balanced`` layout (strategy ``needed_rows``, 8 query / 2 KV heads, head dim
64), one batch row of S = 32768 tokens with ``--full`` (the default run: 4096; ``--quick``:
2048) in documents of 5/16 to 5/8 of S (10240-20479 tokens at S = 32768; the last one cut at
S):

* ``chunked``: chunked causal attention ``chunks(S / 4) ∩ causal`` (chunks of 8192 tokens at
  S = 32768, 512 with ``--quick``), documents longer than a chunk;
* ``image blocks``: bidirectional image spans of S / 32 to S / 8 tokens (1024-4095 at S =
  32768) inside causal documents, ``causal ∪ blocks``, every other document without images;
* ``mask_mod``: ``cp_attention(..., mask_mod=fn)`` with a FlexAttention-style function, a
  dilated causal pattern inside each document (query ``q`` sees key ``k <= q`` when ``q - k``
  is a multiple of 4) plus the row's first token, a summary every query sees across documents
  (``mask_mod_documents=False``: the function states the documents itself).

The baseline all-gathers K and V (list all-gather + cat, backward reduce-scatter) and calls SDPA
under this rank's rows of ``description.dense()`` (the ``mask_mod`` row: the function evaluated
on every (query, key) pair) over the gathered (rank-major) keys; cpshard's
output must equal it. Each row reports forward+backward time, peak extra memory, the bytes each
forward keeps for its backward, and per rank the K/V rows cpshard's exchange receives next to
the rows outside the rank's own that its queries' masks reach (from the same dense mask) and the
rows the all-gather receives (every other rank's).

No FlexAttention column: in the installed torch (2.13, CPU build) ``flex_attention`` with a
``BlockMask`` runs the forward on CPU but raises ``NotImplementedError`` ("FlexAttention does not
support backward on CPU"), so it cannot be timed forward+backward here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpshard import ContextParallelSharder, cp_attention
from cpshard.attention import active_state
from cpshard.bench.blockdiag import (
    all_gather_baseline,
    case_fields,
    check_output,
    documents,
    fwd_bwd_figures,
    random_qkv,
)
from cpshard.bench.memory import release_freed_memory, saved_bytes
from cpshard.bench.report import mib
from cpshard.bench.runtime import Runtime
from cpshard.attention.mask_mod import mask_mod_state
from cpshard.masks import MaskDescription, MaskMod

SEQ_LEN, DEFAULT_SEQ_LEN, QUICK_SEQ_LEN = 32768, 4096, 2048
LAYOUT = "balanced"
CASES = ("chunked", "image blocks", "mask_mod")
DILATION = 4  # the mask_mod row: a query sees every 4th earlier key of its document


def seq_len(full: bool, quick: bool) -> int:
    """The rows' sequence length in a run of these settings."""
    return QUICK_SEQ_LEN if quick else SEQ_LEN if full else DEFAULT_SEQ_LEN


def chunk_size(seq: int) -> int:
    """The chunk of the chunked row: a quarter of the sequence (8192 tokens at S = 32768)."""
    return seq // 4


def mask_documents(seq: int) -> torch.Tensor:
    """``[1, S]`` document ids of 5/16 to 5/8 of S tokens each (the last one cut at S): longer
    than a chunk."""
    return documents(seq, (5 * seq // 16, 5 * seq // 8))


def image_ids(doc: torch.Tensor) -> torch.Tensor:
    """Block ids ``[1, S]`` (-1 outside a block, as transformers' ``block_sequence_ids``):
    image spans of S / 32 to S / 8 tokens after text gaps of as many, in every other document
    (the first, third, ...; fixed seed), each span inside its document."""
    seq = doc.shape[1]
    lens = (seq // 32, seq // 8)
    g = torch.Generator().manual_seed(7)
    out = torch.full_like(doc, -1)
    ids = doc[0]
    starts = torch.nonzero(torch.cat((ids.new_ones(1), ids[1:] != ids[:-1]))).flatten().tolist()
    ends = [*starts[1:], seq]
    span = 0
    for j, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if j % 2:
            continue
        at = start + int(torch.randint(*lens, (1,), generator=g))
        while True:
            size = int(torch.randint(*lens, (1,), generator=g))
            if at + size > end:
                break
            out[0, at : at + size] = span
            span += 1
            at += size + int(torch.randint(*lens, (1,), generator=g))
    return out


def describe(case: str, doc: torch.Tensor) -> MaskDescription:
    """The description of ``case`` (:data:`CASES`) over the documents ``doc``."""
    causal = MaskDescription.within_documents(doc, ahead=0)
    if case == "chunked":
        return MaskDescription.chunks(doc, chunk_size(doc.shape[1])).intersect(causal)
    blocks = MaskDescription.blocks(doc, image_ids(doc))
    union = None if blocks is None else causal.union(blocks)
    if union is None:  # consecutive spans inside causal documents always give one interval
        raise AssertionError("image blocks: the union of causal and blocks is not one interval")
    return union


def summary_dilated(doc: torch.Tensor) -> MaskMod:
    """The ``mask_mod`` row's function over the documents ``doc`` ``[B, S]``: causal keys of the
    query's own document at a multiple of :data:`DILATION` back, and position 0 of the row (a
    summary token) from every query."""

    def fn(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        same = (doc[b, q] == doc[b, k]) & (k <= q) & ((q - k) % DILATION == 0)
        return same | (k == 0)

    return fn


def _dense(case: str, doc: torch.Tensor, mine: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``[L, S]``: which of the gathered ``keys`` each query at ``mine`` sees (the baseline's
    mask, stated directly from the description or the function)."""
    if case == "mask_mod":
        b = torch.zeros(1, dtype=torch.int64)
        return summary_dilated(doc)(b, b, mine[:, None], keys[None, :])
    return describe(case, doc).dense()[0][mine][:, keys]


def _per_rank(rt: Runtime, value: int) -> list[int]:
    """``value`` of every rank, alike on every rank (on the group's device: NCCL reduces no
    host tensor)."""
    every = torch.zeros(rt.world, dtype=torch.int64, device=rt.device)
    every[rt.rank] = value
    dist.all_reduce(every, group=rt.pg)
    return every.tolist()


def run_case(rt: Runtime, case: str, doc: torch.Tensor) -> dict:
    """fwd+bwd time, peak extra memory, saved bytes and K/V rows received and reached per rank
    of ``case``'s mask over ``doc``, checked against the all-gather baseline."""
    sharder = ContextParallelSharder(rt.pg, LAYOUT, strategy="needed_rows")
    ctx, _ = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    lay = sharder.shard_layout
    mine = lay.indices(rt.rank)
    keys = torch.cat([lay.indices(r) for r in range(rt.world)])  # the gathered keys' positions
    mask = _dense(case, doc, mine, keys)  # [L, S] over the gathered keys
    reach = mask.any(0).view(rt.world, -1)
    reach[rt.rank] = False  # the rows of other ranks this rank's queries see
    q, k, v, grad = random_qkv(rt, mine.numel())
    base = all_gather_baseline(rt, mask[None, None].to(rt.device))

    if case == "mask_mod":
        fn, description = summary_dilated(doc), None
        masked = {"mask_mod": fn, "mask_mod_documents": False}
    else:
        description = describe(case, doc)
        masked = {"mask": description}

    def ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with ctx():
            return cp_attention(q, k, v, enable_gqa=True, **masked)

    check_output(rt, ours, base, (q, k, v), f"attention {case}")
    with ctx():
        state = active_state()
        if description is None:
            heads = q.shape[1]
            state = mask_mod_state(state, fn, heads, documents=False).carrier
        else:
            state = state.masked(description)
        received = state.exchange.received_rows
    blocks = image_ids(doc) if case == "image blocks" else None
    out = {
        "layout": LAYOUT,
        "case": case,
        "chunk": chunk_size(doc.shape[1]) if case == "chunked" else None,
        "images": None if blocks is None else int(blocks.max()) + 1,
        "image_tokens": None if blocks is None else int((blocks >= 0).sum()),
        **case_fields(rt, doc),
        "segments": None if description is None else description.segments,
        "ours_kv_rows_received": _per_rank(rt, received),
        "kv_rows_reached": _per_rank(rt, int(reach.sum())),
        "base_kv_rows_received": mine.numel() * (rt.world - 1),
    }
    for who, fn in (("ours", ours), ("base", base)):
        out[f"{who}_saved_bytes"] = saved_bytes(rt, lambda fn=fn: fn(q, k, v), (q, k, v))
    return {**out, **fwd_bwd_figures(rt, {"ours": ours, "base": base}, (q, k, v), grad)}


def run(rt: Runtime) -> list[dict]:
    """Every row (:data:`CASES`) on the whole group, one batch each."""
    doc = mask_documents(seq_len(rt.cfg.full, rt.cfg.quick))
    rows = []
    for case in CASES:
        rt.progress(f"attention {LAYOUT} S={doc.shape[1]} mask {case}")
        rows.append(run_case(rt, case, doc))
        release_freed_memory()
    return rows


def render(rows: list[dict]) -> list[str]:
    """The mask rows' table."""
    head = rows[0]  # every run has every row
    out = [
        "# attention: cp_attention(mask=MaskDescription | mask_mod=fn) fwd+bwd, strategy",
        f"#   needed_rows, layout {LAYOUT}  vs  full K/V all-gather + SDPA under the dense mask;",
        f"#   W = {head['world']}, S = {head['seq_len']}, {head['documents']} documents, "
        f"{head['heads']} query / {head['kv_heads']} KV heads, head dim {head['head_dim']};",
        "#   median ms (max over ranks), peak extra MiB of fwd+bwd, MiB kept for the backward;",
        "#   K/V rows received (max over ranks), rows the masks reach outside the rank's own",
        "#   (max over ranks), rows the all-gather receives",
    ]
    for r in rows:
        if r["chunk"] is not None:
            out.append(f"# chunked: chunks of {r['chunk']} ∩ causal")
        if r["images"] is not None:
            out.append(
                f"# image blocks: causal ∪ {r['images']} bidirectional spans "
                f"({r['image_tokens']} tokens)"
            )
        if r["case"] == "mask_mod":
            out.append(
                f"# mask_mod: causal keys {DILATION} apart in the document, and the row's first "
                "token from every query"
            )
    out.append(
        f"#{'case':>13} {'cpshard ms':>11} {'base ms':>9} {'speedup':>8} {'cpshard MiB':>12} "
        f"{'base MiB':>9} {'kept MiB':>9} {'base kept':>9} {'kv rows':>8} {'reach':>8} "
        f"{'base rows':>9}"
    )
    for r in rows:
        out.append(
            f" {r['case']:>13} {r['ours_fwd_bwd_s'] * 1e3:>11.1f} "
            f"{r['base_fwd_bwd_s'] * 1e3:>9.1f} {r['speedup']:>8.2f} "
            f"{mib(r['ours_fwd_bwd_peak_bytes']):>12} {mib(r['base_fwd_bwd_peak_bytes']):>9} "
            f"{mib(r['ours_saved_bytes']):>9} {mib(r['base_saved_bytes']):>9} "
            f"{max(r['ours_kv_rows_received']):>8} {max(r['kv_rows_reached']):>8} "
            f"{r['base_kv_rows_received']:>9}"
        )
    return out
