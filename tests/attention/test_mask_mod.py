"""CP attention of a FlexAttention-style ``mask_mod`` against plain masked attention on the whole
batch.

Every rank shards full q/k/v (``[B, H, S, D]``, float64) with the sharder of a layout (or the
block-diagonal batch), attends inside the step's context with ``cp_attention(mask_mod=...)``
(or ``cp_blockdiag_sdpa``) and back-propagates its share of a weighted sum; the gathered output
and the summed gradients of the full q/k/v must equal attention on the whole rows under a dense
mask built here straight from the function (:func:`_dense`, not the planner). The functions:
document-causal attention with a summary token every token sees across documents (documents
flag off), a dilated causal pattern, a random block-sparse table, a per-head mask. Also: the
rows a rank receives are the rows its queries' masks reach, a function is planned once per step,
and what cannot be executed raises naming ``mask_mod`` and the rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard.layouts import LAYOUTS
from tests.helpers import (
    assert_refused_on_every_rank,
    check_cp_results,
    cp_case_result,
    each_case,
    masked_attention,
    packed_doc_ids,
    random_qkvw,
    shard_heads,
    step_context,
    visible_reference,
)

LAYOUTS_AND_BATCH = [*LAYOUTS, "blockdiag"]
# packing, B, S, query heads, KV heads (S not a multiple of W: trailing padding)
CASES = [("interior_pad", 2, 30, 2, 1), ("random", 2, 23, 2, 2), ("pad_rank", 1, 20, 2, 1)]
# name -> whether the documents bound the mask (mask_mod_documents)
MASK_MODS = {"summary": False, "dilated": True, "block_sparse": True, "per_head": True}


def mask_mod(name: str, doc: torch.Tensor):
    """The function ``name`` over the document ids ``doc`` ``[B, S]`` (global positions)."""
    first = (doc != 0).to(torch.int64).argmax(1)  # each row's first document token
    table = torch.rand(8, 8, generator=torch.Generator().manual_seed(5)) < 0.4

    def summary(b, h, q, k):  # document-causal, and every query sees its row's summary token
        return ((doc[b, q] == doc[b, k]) & (k <= q)) | (k == first[b])

    def dilated(b, h, q, k):
        return (k <= q) & ((q - k) % 3 == 0)

    def block_sparse(b, h, q, k):
        return table[q // 4, k // 4]

    def per_head(b, h, q, k):  # head 0 causal, head 1 a causal window of 3
        return (k <= q) & ((h == 0) | (q - k < 3))

    return {"summary": summary, "dilated": dilated, "block_sparse": block_sparse,
            "per_head": per_head}[name]  # fmt: skip


def _dense(name: str, doc: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, H, S, S]``: the function on every (b, h, q, k) at once, within documents when its
    flag says so; padding neither sees nor is seen."""
    b, s = doc.shape
    idx = [torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in
           enumerate((b, heads, s, s))]  # fmt: skip
    seen = mask_mod(name, doc)(*idx).expand(b, heads, s, s)
    valid = doc != 0
    seen = seen & valid[:, None, :, None] & valid[:, None, None, :]
    if MASK_MODS[name]:
        seen = seen & (doc[:, None, :, None] == doc[:, None, None, :])
    return seen


def _full(case: tuple) -> tuple[torch.Tensor, ...]:
    name, b, s, heads, kv_heads = case
    return packed_doc_ids(name, b, s), *random_qkvw(b, s, heads, kv_heads, 100 * b + s)


def _reached(step, planned, dense: torch.Tensor) -> list[str]:
    """Mismatches between the rows every rank receives and the keys of other ranks its
    queries see (from the dense mask over the step's padded rows)."""
    b, p = step.documents.shape
    dense = torch.nn.functional.pad(dense.any(1), (0, p - dense.shape[-1], 0, p - dense.shape[-1]))
    problems = []
    for r in range(step.group.world):
        idx = step.shard_layout.indices(r).to(torch.int64).expand(b, step.local_len)
        reach = torch.stack([dense[i, idx[i]].any(0) for i in range(b)])  # [B, P]
        own = torch.zeros_like(reach).scatter_(1, idx, True)
        want, got = int((reach & ~own).sum()), planned.carrier.exchange.received[r]
        if got != want:
            problems.append(f"rank {step.group.rank}: rank {r} receives {got}, reaches {want}")
    return problems


def _distributed(rank: int, world: int, layouts: list[str], cases: list, names: list[str],
                 sdpa: bool = False) -> list[tuple]:  # fmt: skip
    """Per (layout, case, function): the gathered output, this rank's gradients of the full
    q/k/v and the reach mismatches (a second call of the step plans nothing new)."""
    from cpshard import cp_attention, cp_blockdiag_sdpa
    from cpshard.attention import active_state
    from cpshard.attention.mask_mod import mask_mod_state

    results = []
    for layout, case, name, doc, (q, k, v), w in each_case(layouts, cases, names, _full):
        fn, documents = mask_mod(name, doc), MASK_MODS[name]
        ctx, sharder = step_context(layout, doc, dist.group.WORLD)
        attention = cp_blockdiag_sdpa if sdpa else cp_attention
        with ctx():
            args = [shard_heads(sharder, t) for t in (q, k, v)]
            out = attention(*args, enable_gqa=case[3] != case[4], mask_mod=fn,
                            mask_mod_documents=documents)  # fmt: skip
            step = active_state()
            planned = mask_mod_state(step, fn, case[3], documents)
            attention(*args, enable_gqa=True, mask_mod=fn, mask_mod_documents=documents)
            assert mask_mod_state(step, fn, case[3], documents) is planned
            reached = _reached(step, planned, _dense(name, doc, case[3]))
        results.append(cp_case_result(sharder, out, w, (q, k, v), reached))
    return results


def _check(got: list[list[tuple]], world: int, layouts: list[str], cases: list,
           names: list[str]) -> None:  # fmt: skip
    expected = []
    for layout, case, name, doc, leaves, w in each_case(layouts, cases, names, _full):
        want = visible_reference(*leaves, _dense(name, doc, case[3]))
        grads = torch.autograd.grad((want * w).sum(), leaves)
        expected.append((f"W={world} {layout} {case} {name}", want, grads))
    check_cp_results(got, expected)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_matches_the_dense_mask(pools, world: int) -> None:
    """Every layout and the block-diagonal batch, every function, B = 2, interior padding,
    GQA: forward, float64 backward, and the rows each rank receives."""
    args = (LAYOUTS_AND_BATCH, CASES[:1], list(MASK_MODS))
    _check(pools(world).run(_distributed, *args, timeout=600), world, *args)


@pytest.mark.parametrize("world", [1, 3])
def test_some_layouts_match_the_dense_mask(pools, world: int) -> None:
    """A subset of layouts, every case (``pad_rank``: a whole rank of padding at W = 3)."""
    args = (["contiguous", "stripe", "blockdiag"], CASES, list(MASK_MODS))
    _check(pools(world).run(_distributed, *args, timeout=600), world, *args)


def test_cp_blockdiag_sdpa_takes_a_mask_mod(pool2) -> None:
    args = (["balanced"], CASES[1:], ["summary", "per_head"])
    _check(pool2.run(_distributed, *args, True, timeout=600), 2, *args)


def _capped(rank: int, world: int, layouts: list[str], names: list[str]) -> list[tuple]:
    """Per (layout, function): soft-capped logits and sinks under a ``mask_mod`` (the explicit
    statement on the key buffer): the gathered output and this rank's gradients of q, k, v
    and the sinks."""
    from cpshard import cp_attention

    results = []
    sinks = torch.linspace(-1.0, 1.0, CASES[0][3], dtype=torch.float64)
    for layout, _, name, doc, (q, k, v), w in each_case(layouts, CASES[:1], names, _full):
        s = sinks.clone().requires_grad_()
        ctx, sharder = step_context(layout, doc)
        with ctx():
            out = cp_attention(
                *(shard_heads(sharder, t) for t in (q, k, v)), enable_gqa=True,
                mask_mod=mask_mod(name, doc), mask_mod_documents=MASK_MODS[name], softcap=2.0,
                sinks=s,
            )  # fmt: skip
        results.append(cp_case_result(sharder, out, w, (q, k, v, s), []))
    return results


def test_softcap_and_sinks_with_a_mask_mod(pool2) -> None:
    """Against the per-head weighted sum on the whole rows (:func:`tests.helpers.masked_attention`:
    a query that sees nothing gets zeros next to its sink)."""
    layouts, names = ["stripe", "blockdiag"], ["dilated", "summary"]
    got = pool2.run(_capped, layouts, names, timeout=300)
    sinks = torch.linspace(-1.0, 1.0, CASES[0][3], dtype=torch.float64)
    expected = []
    for layout, _, name, doc, leaves, w in each_case(layouts, CASES[:1], names, _full):
        leaves = (*leaves, sinks.clone().requires_grad_())
        dense = _dense(name, doc, 1)
        want = masked_attention(*leaves[:3], dense, leaves[0].shape[-1] ** -0.5, 2.0, leaves[3])
        grads = torch.autograd.grad((want * w).sum(), leaves)
        expected.append((f"{layout} {name}", want, grads))
    check_cp_results(got, expected, ("q", "k", "v", "sinks"))


def _second_call_reads(rank: int, world: int) -> list[str]:
    """Host reads of tensor data in a layer's call (forward and backward) with the function an
    earlier layer of the step passed: its plan is the one made then."""
    from cpshard import cp_attention
    from cpshard.attention import active_state
    from cpshard.attention.mask_mod import mask_mod_state
    from tests.helpers import recording_host_reads

    doc, *full, _ = _full(CASES[0])
    ctx, sharder = step_context("balanced", doc)
    fn = mask_mod("per_head", doc)
    qkv = tuple(shard_heads(sharder, t).detach().requires_grad_() for t in full)
    reads: list[str] = []
    for layer in range(2):
        with ctx():
            step = active_state()
            keys = (step.key, mask_mod_state(step, fn, full[0].shape[1], True).carrier.key)
        with recording_host_reads(reads if layer else [], keys):
            with ctx():
                out = cp_attention(*qkv, enable_gqa=True, mask_mod=fn)
            out.sum().backward()
    return reads


def test_a_function_is_planned_once_per_step(pool2) -> None:
    assert pool2.run(_second_call_reads, timeout=120) == [[], []]


def _refusal(rank: int, world: int, kind: str) -> None:
    from cpshard import cp_attention
    from cpshard.masks import MaskDescription

    doc, q, k, v, _ = _full(CASES[0])
    ctx, sharder = step_context("stripe", doc)
    q, k, v = (shard_heads(sharder, t) for t in (q, k, v))
    fn = mask_mod("dilated", doc)
    kwargs: dict = {
        "mask": {"mask": MaskDescription.within_documents(doc, ahead=0)},
        "window": {"window": 3},
        "is_causal": {"is_causal": True},
        "not_bool": {"mask_mod": lambda b, h, q, k: (k <= q).to(torch.int64)},
        "shape": {"mask_mod": lambda b, h, q, k: torch.ones(3, 1, 1, 1, dtype=torch.bool)},
    }[kind]
    with ctx():
        cp_attention(q, k, v, enable_gqa=True, **{"mask_mod": fn, **kwargs})


def _differing(rank: int, world: int) -> None:
    """Checked mode, a function that differs on rank 1 (its exchange another)."""
    from cpshard import check_mode, cp_attention

    doc, q, k, v, _ = _full(CASES[0])
    ctx, sharder = step_context("stripe", doc)
    q, k, v = (shard_heads(sharder, t) for t in (q, k, v))
    fn = mask_mod("dilated" if rank == 0 else "per_head", doc)
    with check_mode("call"), ctx():
        cp_attention(q, k, v, enable_gqa=True, mask_mod=lambda b, h, q, k: k == q)
        cp_attention(q, k, v, enable_gqa=True, mask_mod=fn)


def test_checked_mode_agrees_on_the_exchange(pool2) -> None:
    outcomes = pool2.run_collect(_differing, timeout=60)
    assert all(not o.ok and "exchange plan differs on rank 1" in o.error_message
               for o in outcomes), outcomes  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("mask", "mask_mod and mask exclude each other"),
        ("window", "window must be None with mask_mod"),
        ("is_causal", "is_causal=True conflicts with mask_mod"),
        ("not_bool", "mask_mod must return a bool tensor of shape [2, 2, "),
        ("shape", "mask_mod must return a bool tensor of shape [2, 2, "),
    ],
)
def test_what_cannot_be_executed_raises_on_every_rank(pool2, kind: str, message: str) -> None:
    assert_refused_on_every_rank(pool2.run_collect(_refusal, kind, timeout=60), message)


def test_outside_cp_the_dense_mask() -> None:
    """No context: SDPA under the function's dense mask over the call's rows (no documents;
    a query that sees nothing gets zeros, with finite gradients), and the refusals."""
    from cpshard import cp_attention, cp_blockdiag_sdpa

    doc, q, k, v, w = _full(CASES[0])
    s = doc.shape[1]
    def sparse(b, h, q, k):
        return mask_mod("block_sparse", doc)(b, h, q, k) & (q != 2)

    ones = torch.ones_like(doc)
    for fn, visible in ((sparse, None), (mask_mod("per_head", doc), _dense("per_head", ones, 2))):
        if visible is None:
            visible = _dense("block_sparse", ones, 1).expand(2, 2, s, s).clone()
            visible[:, :, 2] = False
        for attention in (cp_attention, cp_blockdiag_sdpa):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = attention(*leaves, enable_gqa=True, mask_mod=fn)
            torch.testing.assert_close(out, visible_reference(q, k, v, visible), rtol=0, atol=1e-12)
            (out * w).sum().backward()
            assert all(torch.isfinite(t.grad).all() for t in leaves)
    with pytest.raises(ValueError, match="cp_attention: window must be None with mask_mod"):
        cp_attention(q, k, v, enable_gqa=True, window=2, mask_mod=sparse)
    with pytest.raises(ValueError, match="cp_blockdiag_sdpa: is_causal=True conflicts"):
        cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True, mask_mod=sparse)
    with pytest.raises(ValueError, match="mask_mod must return a bool tensor"):
        cp_attention(q, k, v, enable_gqa=True, mask_mod=lambda b, h, q, k: True)
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        cp_attention(q, k, v, mask_mod=3)
