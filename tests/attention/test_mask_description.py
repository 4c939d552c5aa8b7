"""CP attention of a mask description against plain masked attention on the whole batch.

Every rank shards full q/k/v (``[B, H, S, D]``, float64) with the sharder of a layout (or the
block-diagonal batch), attends inside the step's context with ``cp_attention(mask=...)`` and
back-propagates its share of a weighted sum; the gathered output and the summed gradients of
the full q/k/v must equal attention under ``description.dense()`` on the whole rows in one
process (:func:`_reference`). The descriptions: chunked causal attention (chunks shorter than
the documents, crossing rank boundaries), bidirectional chunks, image blocks over causal
attention (in some documents only, one crossing a rank boundary), a prefix-LM, Gemma 3's
sliding layers with images (``(causal | blocks) & window``: a sliding start with a fixed end)
and its bidirectional sliding layers (``|q - k| < W``: a look-ahead window). Also: the rows a
rank receives are the rows its queries' masks reach, causal / bidirectional / window
descriptions execute exactly what today's arguments do, the head-parallel strategies plan the
description over the gathered tokens, and what cannot be executed raises on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard.layouts import LAYOUTS
from cpshard.masks import MaskDescription
from tests.helpers import (
    assert_refused_on_every_rank,
    D,
    check_cp_results,
    cp_case_result,
    each_case,
    cp_mesh,
    kernel_path,
    masked_attention,
    packed_doc_ids,
    random_qkvw,
    recording_routes,
    shard_heads,
    step_context,
    visible_reference,
)

LAYOUTS_AND_BATCH = [*LAYOUTS, "blockdiag"]
# packing, B, S, query heads, KV heads (S not a multiple of W: trailing padding)
CASES = [
    ("random", 2, 37, 2, 1),
    ("interior_pad", 2, 30, 2, 2),
    ("one_doc", 1, 23, 2, 2),
]
DESCRIPTIONS = [
    "chunked_causal",
    "chunked",
    "image",
    "prefix",
    "sliding_image",
    "look_ahead",
]


def _images(doc: torch.Tensor) -> torch.Tensor:
    """Block ids ``[B, S]``: an image span of 5 tokens from the 6th token of every other
    document (with the first one, which crosses the middle of a row at S >= 23), -1 elsewhere."""
    out = torch.full_like(doc, -1)
    for r in range(doc.shape[0]):
        starts = [0] + [p for p in range(1, doc.shape[1]) if doc[r, p] != doc[r, p - 1]]
        for j, s in enumerate(starts):
            if doc[r, s] == 0 or j % 2:
                continue
            end = s
            while end < doc.shape[1] and doc[r, end] == doc[r, s] and end - s < 11:
                end += 1
            out[r, s + 6 : end] = j
    return out


def _prefix(doc: torch.Tensor) -> torch.Tensor:
    """Block 0 on the first 4 tokens of every document (a prefix-LM's prefix), else -1."""
    pos = torch.arange(doc.shape[1]).expand_as(doc)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start = torch.cummax(torch.where(new, pos, 0), 1).values
    return torch.where((doc != 0) & (pos - start < 4), 0, -1)


def describe(name: str, doc: torch.Tensor) -> MaskDescription:
    """The description ``name`` of the documents ``doc`` ``[B, S]``."""
    causal = MaskDescription.within_documents(doc, ahead=0)
    if name == "causal":
        return causal
    if name == "bidirectional":
        return MaskDescription.within_documents(doc)
    if name == "window":
        return MaskDescription.within_documents(doc, back=2, ahead=0)
    if name == "chunked_causal":
        return MaskDescription.chunks(doc, 4).intersect(causal)
    if name == "chunked":
        return MaskDescription.chunks(doc, 5)
    if name == "look_ahead":  # |q - k| < 3
        return MaskDescription.within_documents(doc, back=2, ahead=2)
    ids = _prefix(doc) if name == "prefix" else _images(doc)
    blocks = MaskDescription.blocks(doc, ids)
    assert blocks is not None
    union = causal.union(blocks)
    assert union is not None
    if name == "sliding_image":  # k > q - 3
        return union.intersect(MaskDescription.within_documents(doc, back=2))
    return union


def _full(case: tuple) -> tuple[torch.Tensor, ...]:
    """Document ids, full q/k/v and the upstream weight of a case."""
    name, b, s, heads, kv_heads = case
    return packed_doc_ids(name, b, s), *random_qkvw(b, s, heads, kv_heads, 1000 * b + s)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """Attention of the whole rows under ``visible`` ``[B, S, S]``."""
    return visible_reference(q, k, v, visible[:, None])


def _reached(state, sharder, mask: MaskDescription) -> list[str]:
    """Mismatches between the rows this rank's exchange receives and the rows its queries'
    masks reach (from ``dense()``): exact for the needed rows, the farthest reach for the
    halo."""
    from cpshard.attention.halo import HaloExchange

    padded = state.documents
    b, p = padded.shape
    dense = mask.padded_to(p).dense()
    world, rank = state.group.world, state.group.rank
    problems = []
    for r in range(world):
        idx = state.shard_layout.indices(r).to(torch.int64).expand(b, state.local_len)
        reach = torch.stack([dense[i, idx[i]].any(0) for i in range(b)])  # [B, P]
        own = torch.zeros_like(reach).scatter_(1, idx, True)
        if isinstance(state.exchange, HaloExchange):
            pos = torch.arange(p).expand(b, p)
            first = int(torch.where(reach, pos, p).min()) if reach.any() else p
            want = max(0, min(r * state.local_len, r * state.local_len - first))
            got = state.exchange.halos[r]
        else:
            want, got = int((reach & ~own).sum()), state.exchange.received[r]
        if got != want:
            problems.append(f"rank {rank}: rank {r} receives {got} rows, its masks reach {want}")
    return problems


def _distributed(
    rank: int, world: int, strategy: str, mesh: bool, layouts: list[str], cases: list,
    names: list[str], path: str = "per_segment",
) -> list[tuple]:  # fmt: skip
    """Per (layout, case, description): the gathered output, this rank's gradients of the full
    q/k/v and the reach mismatches. The varlen stand-in must have been handed packings of each
    kind (causal, windowed, every key visible), the head-parallel strategies must have routed
    their calls through their plans."""
    with kernel_path(path) as kernel, recording_routes() as kinds:
        results = _cases(world, strategy, mesh, layouts, cases, names)
    if kernel is not None:
        seen = {(p.causal, p.window) for p in kernel.packings}
        assert {(True, None), (True, 3), (False, None)} <= seen, seen
    if strategy in ("heads", "hierarchical"):
        assert kinds and set(kinds) == {strategy}, kinds
    return results


def _cases(
    world: int, strategy: str, mesh: bool, layouts: list[str], cases: list, names: list[str]
) -> list[tuple]:
    from cpshard import cp_attention
    from cpshard.attention import active_state

    group = cp_mesh(2, world // 2) if mesh else dist.group.WORLD
    results = []
    for layout, case, name, doc, (q, k, v), w in each_case(layouts, cases, names, _full):
        mask = describe(name, doc)
        ctx, sharder = _step(layout, doc, group, strategy)
        with ctx():
            out = cp_attention(
                *(shard_heads(sharder, t) for t in (q, k, v)),
                enable_gqa=case[3] != case[4],
                mask=mask,
            )
            state = active_state().masked(mask)
            assert active_state().masked(mask) is state  # planned once per step
            # an equal description made again (a recomputed forward's) reuses the plan
            assert active_state().masked(describe(name, doc)) is state
            reached = [] if strategy != "needed_rows" else _reached(state, sharder, mask)
        results.append(cp_case_result(sharder, out, w, (q, k, v), reached))
    return results


def _step(layout: str, doc: torch.Tensor, group, strategy: str):
    """``(context factory, sharder)`` of a step under ``strategy``."""
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    if strategy == "needed_rows":
        return step_context(layout, doc, group)
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    if layout == "blockdiag":
        ctx, _ = make_cp_blockdiag_batch_and_ctx(group, None, batch, strategy=strategy)
        sharder = ContextParallelSharder(group, "contiguous", strategy=strategy)
        sharder.shard(dict(batch))
        return ctx, sharder
    sharder = ContextParallelSharder(group, layout, strategy=strategy)
    ctx, _ = sharder.shard(batch)
    return ctx, sharder


def _check(
    got: list[list[tuple]], world: int, layouts: list[str], cases: list, names: list[str],
    where: str,
) -> None:  # fmt: skip
    expected = []
    for layout, case, name, doc, leaves, w in each_case(layouts, cases, names, _full):
        want = _reference(*leaves, describe(name, doc).dense())
        grads = torch.autograd.grad((want * w).sum(), leaves)
        expected.append((f"{where} W={world} {layout} {case} {name}", want, grads))
    check_cp_results(got, expected)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_matches_the_dense_mask(pools, world: int) -> None:
    """Every layout and the block-diagonal batch, every description, B = 1 and 2, interior
    padding, GQA."""
    args = ("needed_rows", False, LAYOUTS_AND_BATCH, CASES, DESCRIPTIONS)
    _check(pools(world).run(_distributed, *args, timeout=600), world, *args[2:], "needed_rows")


@pytest.mark.parametrize("world", [1, 3])
def test_some_layouts_match_the_dense_mask(pools, world: int) -> None:
    layouts = ["contiguous", "stripe", "blockdiag"]
    args = ("needed_rows", False, layouts, CASES[:2], DESCRIPTIONS)
    _check(pools(world).run(_distributed, *args, timeout=600), world, *args[2:], "needed_rows")


@pytest.mark.parametrize("path", ["varlen", "math"])
def test_kernel_paths_match_the_dense_mask(pool3, path: str) -> None:
    """The varlen packings (its CPU stand-in: causal, windowed and fully visible pieces in a
    launch each, the rest in the loop next to them) and the explicit part kernel, W = 3."""
    layouts = ["head_tail", "balanced", "blockdiag"]
    args = ("needed_rows", False, layouts, CASES[:2], DESCRIPTIONS)
    got = pool3.run(_distributed, *args, path, timeout=600)
    _check(got, 3, *args[2:], f"needed_rows {path}")


@pytest.mark.parametrize(("strategy", "world"), [("heads", 2), ("hierarchical", 4), ("auto", 4)])
def test_head_parallel_strategies_plan_the_description(pools, strategy: str, world: int) -> None:
    """``heads`` and ``hierarchical`` (2 x 2 mesh), and ``auto``'s choice: the inner state
    plans the same description over the gathered tokens."""
    mesh = strategy != "heads"
    args = (strategy, mesh, ["stripe", "contiguous", "blockdiag"], CASES[:2], DESCRIPTIONS)
    _check(pools(world).run(_distributed, *args, timeout=600), world, *args[2:], strategy)


def _same_as_today(rank: int, world: int, layout: str) -> list[str]:
    """Causal, bidirectional and window descriptions against today's arguments: the same spans
    and exchange plan, and bit-identical outputs and gradients."""
    from cpshard import cp_attention
    from cpshard.attention import active_state

    problems = []
    for case in CASES[:2]:
        doc, *full, w = _full(case)
        ctx, sharder = step_context(layout, doc)
        for name, today in (
            ("causal", {}),
            ("bidirectional", {"is_causal": False}),
            ("window", {"window": 3}),
        ):
            mask = describe(name, doc)
            results = []
            for kwargs in ({"mask": mask}, today):
                q, k, v = (shard_heads(sharder, t).detach().requires_grad_() for t in full)
                with ctx():
                    out = cp_attention(q, k, v, enable_gqa=case[3] != case[4], **kwargs)
                    step = active_state()
                results.append((out, *torch.autograd.grad((out * shard_heads(sharder, w)).sum(),
                                                          (q, k, v))))  # fmt: skip
            masked = step.masked(mask)
            plain = step.variant(name != "bidirectional").windowed(today.get("window"))
            label = f"rank {rank} {layout} {case} {name}"
            if not torch.equal(masked.span_table, plain.span_table):
                problems.append(f"{label}: spans {masked.span_table} vs {plain.span_table}")
            if masked.exchange.plan != plain.exchange.plan:
                problems.append(
                    f"{label}: exchange {masked.exchange.plan} vs {plain.exchange.plan}"
                )
            for j, (a, b) in enumerate(zip(*results, strict=True)):
                if not torch.equal(a, b):
                    problems.append(f"{label}: result {j} differs")
    return problems


@pytest.mark.parametrize("layout", ["contiguous", "stripe", "balanced"])
def test_causal_bidirectional_and_window_descriptions_are_todays_arguments(
    pool2, layout: str
) -> None:
    problems = [p for got in pool2.run(_same_as_today, layout, timeout=300) for p in got]
    assert not problems, problems


def _second_call_reads(rank: int, world: int, path: str) -> list[str]:
    """Host reads of tensor data in a layer's call (forward and backward) with the description
    an earlier layer of the step passed: its state is the one planned then."""
    from cpshard import cp_attention
    from cpshard.attention import active_state
    from tests.helpers import recording_host_reads

    doc, *full, _ = _full(CASES[0])
    ctx, sharder = step_context("balanced", doc)
    mask = describe("sliding_image", doc)
    qkv = tuple(shard_heads(sharder, t).detach().requires_grad_() for t in full)
    reads: list[str] = []
    with kernel_path(path):
        for layer in range(2):
            with ctx():
                keys = (active_state().key, active_state().masked(mask).key)
            with recording_host_reads(reads if layer else [], keys):
                with ctx():
                    out = cp_attention(*qkv, enable_gqa=True, mask=mask)
                out.sum().backward()
    return reads


@pytest.mark.parametrize("path", ["per_segment", "varlen"])
def test_a_description_is_planned_once_per_step(pool2, path: str) -> None:
    assert pool2.run(_second_call_reads, path, timeout=120) == [[], []]


def _capped(rank: int, world: int, layouts: list[str]) -> list[tuple]:
    """Per (layout, description): soft-capped logits and sinks under a description (the
    explicit varlen kernel's packings next to the loop): the gathered output and this rank's
    gradients of q, k, v and the sinks."""
    from cpshard import cp_attention

    results = []
    doc, *full, w = _full(CASES[0])
    sinks = torch.linspace(-1.0, 1.0, full[0].shape[1], dtype=torch.float64)
    for layout in layouts:
        for name in DESCRIPTIONS:
            q, k, v, s = (t.detach().clone().requires_grad_() for t in (*full, sinks))
            ctx, sharder = step_context(layout, doc)
            with ctx():
                out = cp_attention(
                    *(shard_heads(sharder, t) for t in (q, k, v)),
                    enable_gqa=True,
                    mask=describe(name, doc),
                    softcap=2.0,
                    sinks=s,
                )
            results.append(cp_case_result(sharder, out, w, (q, k, v, s), []))
    return results


def test_softcap_and_sinks_with_a_description(pool2) -> None:
    """Soft-capping and sinks (the explicit kernels, its varlen packings per kind next to the
    loop's tiles) under every description, against the per-head weighted sum on the whole rows
    (:func:`tests.helpers.masked_attention`)."""
    layouts = ["stripe", "contiguous", "blockdiag"]
    got = pool2.run(_capped, layouts, timeout=300)
    doc, q, k, v, w = _full(CASES[0])
    sinks = torch.linspace(-1.0, 1.0, q.shape[1], dtype=torch.float64)
    expected = []
    for layout in layouts:
        for name in DESCRIPTIONS:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
            dense = describe(name, doc).dense()
            want = masked_attention(*leaves[:3], dense, D**-0.5, 2.0, leaves[3])
            grads = torch.autograd.grad((want * w).sum(), leaves)
            expected.append((f"{layout} {name}", want, grads))
    check_cp_results(got, expected, ("q", "k", "v", "sinks"))


def _refusal(rank: int, world: int, kind: str) -> None:
    from cpshard import cp_attention

    doc, q, k, v, _ = _full(CASES[0])
    ctx, sharder = step_context("stripe", doc)
    q, k, v = (shard_heads(sharder, t) for t in (q, k, v))
    with ctx():
        if kind == "other_batch":
            cp_attention(q, k, v, enable_gqa=True, mask=describe("chunked", doc[:1]))
        elif kind == "other_documents":
            other = doc.clone()
            other[:, 5] = 9
            cp_attention(q, k, v, enable_gqa=True, mask=describe("chunked", other))
        elif kind == "is_causal":
            cp_attention(q, k, v, enable_gqa=True, is_causal=True, mask=describe("image", doc))
        elif kind == "window":
            cp_attention(q, k, v, enable_gqa=True, window=3, mask=describe("image", doc))


REFUSALS = {
    "other_batch": "mask: the mask describes a [1, 37] batch",
    "other_documents": "mask: a run is not covered",
    "is_causal": "is_causal=True conflicts with mask",
    "window": "window must be None with mask",
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_what_cannot_be_executed_raises_on_every_rank(pool2, kind: str) -> None:
    assert_refused_on_every_rank(pool2.run_collect(_refusal, kind, timeout=60), REFUSALS[kind])


def test_outside_cp_the_dense_mask() -> None:
    """No context: SDPA under ``dense()``, a query that sees nothing gets zeros, and the
    description of another shape raises."""
    from cpshard import cp_attention

    doc, q, k, v, w = _full(CASES[1])
    for name in DESCRIPTIONS:
        mask = describe(name, doc)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = cp_attention(*leaves, mask=mask)
        want = _reference(q, k, v, mask.dense())
        torch.testing.assert_close(out, want, rtol=0, atol=1e-12, msg=name)
        (out * w).sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in leaves), name
    with pytest.raises(ValueError, match="mask describes a \\[2, 29\\] batch"):
        cp_attention(q, k, v, mask=describe("chunked", doc[:, :29]))
    with pytest.raises(ValueError, match="is_causal=True conflicts with mask"):
        cp_attention(q, k, v, is_causal=True, mask=describe("chunked", doc))


def test_torch_flash_varlen_calls_for_a_description() -> None:
    """The launches of descriptions' packings (causal, a causal window, every key visible)
    with torch's real varlen flash ops, on meta tensors (their meta kernels check the
    arguments and give the shapes): GQA bf16 forward and backward."""
    from cpshard import make_cp_blockdiag_batch_and_ctx
    from cpshard.attention import active_state
    from cpshard.attention.engine import Varlen
    from cpshard.attention.kernels import TorchFlashVarlen

    doc = packed_doc_ids("random", 2, 37)
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    ctx, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    kinds = set()
    for name in ("image", "sliding_image"):
        with ctx():
            state = active_state().masked(describe(name, doc))
        packed = state.packing_on(torch.device("meta"))
        kinds |= {(p.causal, p.window) for p in packed.packings}
        assert bool(packed.rest) == (name == "sliding_image")  # sliding starts: the loop's
        impl = Varlen(TorchFlashVarlen(), packed.packings)
        q = torch.empty(2, 4, 38, 64, dtype=torch.bfloat16, device="meta")
        k = torch.empty(2, 2, state.exchange.key_len, 64, dtype=torch.bfloat16, device="meta")
        out, lse = impl.forward(q, k, k, None)
        assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
        grads = impl.backward(torch.empty_like(out), q, k, k, out, lse, 0.125)
        assert [t.shape for t in grads] == [q.shape, k.shape, k.shape]
    assert kinds == {(True, None), (True, 3), (False, None)}, kinds
