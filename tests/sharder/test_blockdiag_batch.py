"""Block-diagonal CP attention against a single-process dense reference.

The reference (:func:`tests.helpers.dense_attention`) builds the block-diagonal causal mask
independently (a document is a maximal run of one non-zero id; pads attend to nothing and output
zeros) and runs plain softmax attention on the full sequence. Every rank's output and the float64
gradients of q, k, v and of an upstream ``inputs_embeds`` (through projections) must match it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpshard.attention import active_state
from cpshard.batch import document_ids
from tests.helpers import (
    PATHS,
    D,
    compare_compiled,
    dense_attention,
    kernel_path,
    packed_doc_ids,
    record_host_reads,
)


class _Proj(torch.nn.Module):
    """inputs_embeds -> q, k, v [B, heads, S, D]."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.heads, self.kv_heads = heads, kv_heads
        self.q = torch.nn.Linear(hidden, heads * D, dtype=torch.float64)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, D).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, D).permute(2, 0, 3, 1, 4)
        return q, k, v


def _inputs(b: int, s: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(b, s, hidden, dtype=torch.float64, generator=g)
    upstream = torch.randn(
        b, 4, s + 4, D, dtype=torch.float64, generator=g
    )  # covers W <= 4 padding
    return emb, upstream


CASES = [
    # packing, B, S, heads, kv heads
    ("short_docs", 1, 24, 2, 2),
    ("one_doc", 2, 23, 4, 2),
    ("interior_pad", 2, 30, 2, 1),
    ("leading_pad", 1, 21, 2, 2),
    ("pad_rank", 1, 40, 2, 2),
    ("reused_ids", 3, 26, 4, 4),
    ("random", 2, 37, 4, 2),
    ("random", 1, 5, 2, 1),
]


def _distributed(
    rank: int, world: int, cases: list[tuple], path: str = "per_segment"
) -> list[tuple[torch.Tensor, ...]]:
    """Per case: this rank's output, and the gradients of its embeds shard and the projections,
    through the kernel ``path`` (see :func:`tests.helpers.kernel_path`; the step's own halo
    exchange there, so that every rank attends every call's heads)."""
    strategy = "auto" if path == "per_segment" else "needed_rows"
    with kernel_path(path) as kernel:
        results = _distributed_cases(rank, world, cases, strategy)
    if kernel is not None:  # one forward and one backward launch per call with segments
        assert kernel.calls["forward"] == kernel.calls["backward"] >= len(cases) - 1, kernel.calls
    return results


def _distributed_cases(
    rank: int, world: int, cases: list[tuple], strategy: str = "auto"
) -> list[tuple[torch.Tensor, ...]]:
    import torch.distributed as dist

    from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    results = []
    for name, b, s, heads, kv_heads in cases:
        doc = packed_doc_ids(name, b, s)
        emb, upstream = _inputs(b, s, 6, seed=s)
        emb.requires_grad_()
        proj = _Proj(6, heads, kv_heads)
        batch = {"inputs_embeds": emb, "_packed_seq_ids": doc, "labels": doc.clone()}
        ctx, batch = make_cp_blockdiag_batch_and_ctx(
            dist.group.WORLD, None, batch, strategy=strategy
        )
        local = batch["inputs_embeds"].shape[1]
        q, k, v = proj(batch["inputs_embeds"])
        with ctx():
            out = cp_blockdiag_sdpa(q, k, v, enable_gqa=heads != kv_heads)
        assert active_state() is None
        weight = upstream[:, :heads, rank * local : (rank + 1) * local]
        (out * weight).sum().backward()
        # an all-padding rank's q projection takes no part in its output: no gradient there
        grads = [emb.grad] + [
            torch.zeros_like(p) if p.grad is None else p.grad for p in proj.parameters()
        ]
        results.append((out.detach(), batch.targets.padding_mask, *grads))
    return results


def _single(cases: list[tuple], world: int) -> list[tuple[torch.Tensor, ...]]:
    results = []
    for name, b, s, heads, kv_heads in cases:
        doc = packed_doc_ids(name, b, s)
        emb, upstream = _inputs(b, s, 6, seed=s)
        emb.requires_grad_()
        proj = _Proj(6, heads, kv_heads)
        q, k, v = proj(emb)
        out = dense_attention(q, k, v, doc)
        (out * upstream[:, :heads, :s]).sum().backward()
        results.append((out.detach(), doc == 0, emb.grad, *[p.grad for p in proj.parameters()]))
    return results


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_dense_reference(pools, world: int, path: str) -> None:
    got = pools(world).run(_distributed, CASES, path, timeout=180)
    want = _single(CASES, world)
    for i, case in enumerate(CASES):
        s = case[2]
        out = torch.cat([got[r][i][0] for r in range(world)], dim=2)
        torch.testing.assert_close(
            out[:, :, :s], want[i][0], rtol=0, atol=1e-12, msg=f"{case} output"
        )
        assert torch.all(out[:, :, s:] == 0), case
        pad = torch.cat([got[r][i][1] for r in range(world)], dim=1)
        assert torch.equal(pad[:, :s], want[i][1]) and bool(pad[:, s:].all()), case
        for j, name in enumerate(["inputs_embeds", "q.weight", "q.bias", "kv.weight", "kv.bias"]):
            total = sum(got[r][i][2 + j] for r in range(world))  # each rank holds a partial grad
            torch.testing.assert_close(
                total, want[i][2 + j], rtol=0, atol=1e-10, msg=f"{case} grad {name}"
            )


def test_pad_rows_output_zero_and_no_mask_materialised() -> None:
    """Pad rows are exactly zero; W = 1 per-segment attention equals the dense reference."""
    from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    doc = packed_doc_ids("interior_pad", 1, 30)
    q, k, v = (torch.randn(1, 2, 30, D, dtype=torch.float64) for _ in range(3))
    ctx, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"inputs_embeds": torch.zeros(1, 30, 4), "_packed_seq_ids": doc}
    )
    with ctx():
        out = cp_blockdiag_sdpa(q, k, v)
    assert torch.all(out[:, :, doc[0] == 0] == 0)
    torch.testing.assert_close(out, dense_attention(q, k, v, doc), rtol=0, atol=1e-12)


def test_plain_sdpa_when_inactive_and_nesting_restores() -> None:
    from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    q, k, v = (torch.randn(2, 2, 6, D) for _ in range(3))
    torch.testing.assert_close(
        cp_blockdiag_sdpa(q, k, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )
    outer, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"input_ids": torch.ones(2, 6, dtype=torch.long)}
    )
    inner, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"input_ids": torch.ones(2, 4, dtype=torch.long)}
    )
    with outer():
        first = active_state()
        with inner():
            assert active_state() is not first and active_state().local_len == 4
        assert active_state() is first
    assert active_state() is None


def test_batch_sharding_conventions(pools) -> None:
    got = pools(3).run(_shard_batch, timeout=60)
    for rank, batch in enumerate(got):
        sl = slice(rank * 3, rank * 3 + 3)
        ids = torch.cat([torch.arange(7).view(1, 7) + 10, torch.full((1, 2), 5)], 1)
        # labels and loss_mask shifted once over the whole sequence, then padded and sliced
        labels = torch.cat([torch.arange(1, 7).view(1, 6), torch.full((1, 3), -100)], 1)
        pos = torch.arange(9).view(1, 9)
        assert torch.equal(batch["input_ids"], ids[:, sl])
        assert torch.equal(batch["targets.labels"], labels[:, sl])
        assert torch.equal(batch["position_ids"], pos[:, sl])
        assert torch.equal(
            batch["targets.loss_mask"], torch.cat([torch.ones(1, 6), torch.zeros(1, 3)], 1)[:, sl]
        )
        assert torch.equal(batch["targets.padding_mask"], (torch.arange(9) >= 7).view(1, 9)[:, sl])
        assert int(batch["targets.num_labelled"]) == 6
        assert sorted(k for k in batch if not k.startswith("targets.")) == [
            "input_ids", "pixel_values", "position_ids"
        ]
        assert batch["pixel_values"].shape == (4, 3)  # not sequence-aligned: untouched


def _shard_batch(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from cpshard import make_cp_blockdiag_batch_and_ctx

    batch = {
        "input_ids": torch.arange(7).view(1, 7) + 10,
        "labels": torch.arange(7).view(1, 7),
        "position_ids": torch.arange(7).view(1, 7),
        "attention_mask": torch.ones(1, 7, dtype=torch.long),
        "pixel_values": torch.zeros(4, 3),
    }
    _, out = make_cp_blockdiag_batch_and_ctx(
        dist.group.WORLD, None, batch, loss_mask=torch.ones(1, 7), padding_token_id=5
    )
    side = {f"targets.{k}": v for k, v in vars(out.targets).items()}
    return {k: v for k, v in {**out, **side}.items() if isinstance(v, torch.Tensor)}


def test_document_ids_priority() -> None:
    b, s = 2, 6
    packed = torch.tensor([[1, 1, 2, 2, 0, 0], [3, 3, 3, 1, 1, 1]])
    block = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for row, lengths in enumerate([(2, 2), (3, 3)]):
        at = 0
        for n in lengths:
            block[row, 0, at : at + n, at : at + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
            at += n
    flat = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert torch.equal(
        document_ids({"_packed_seq_ids": packed, "attention_mask": flat}, s, "cpu", b), packed
    )
    from_block = document_ids({"attention_mask": block}, s, "cpu", b)
    assert torch.equal(from_block, torch.tensor([[1, 1, 2, 2, 0, 0], [1, 1, 1, 2, 2, 2]]))
    additive = torch.where(block, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(document_ids({"attention_mask": additive}, s, "cpu", b), from_block)
    assert torch.equal(document_ids({"attention_mask": flat}, s, "cpu", b), flat)
    assert torch.equal(document_ids({}, s, "cpu", b), torch.ones(b, s, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        document_ids({"_packed_seq_ids": packed[:, :4]}, s, "cpu", b)


def _bad_rank(rank: int, world: int, kind: str) -> None:
    import torch.distributed as dist

    from cpshard import check_mode, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    s = 12 if not (kind == "seq_len" and rank == 1) else 13
    batch = {
        "inputs_embeds": torch.zeros(1, s, 4),
        "_packed_seq_ids": torch.ones(1, s, dtype=torch.long),
    }
    if kind == "doc_ids" and rank == 1:
        batch["_packed_seq_ids"][0, 0] = 2
    if kind == "no_embeds" and rank == 1:
        del batch["inputs_embeds"]
    ctx, batch = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    local = batch["inputs_embeds"].shape[1]
    q = torch.zeros(1, 2, local if not (kind == "q_len" and rank == 1) else local + 1, D)
    mask = torch.ones(1, 1) if kind == "mask" and rank == 1 else None
    v = q[:, :1] if kind == "kv" and rank == 1 else q  # k and v head counts differ on one rank
    with ctx(), check_mode("call"):  # per-call consensus: the checked mode
        cp_blockdiag_sdpa(q, q, v, attn_mask=mask)


@pytest.mark.parametrize("kind", ["seq_len", "doc_ids", "no_embeds", "q_len", "mask", "kv"])
def test_bad_input_on_one_rank_raises_everywhere(pools, kind: str) -> None:
    outcomes = pools(3).run_collect(_bad_rank, kind, timeout=30)
    assert all(not o.ok and o.error_type == "ValueError" for o in outcomes), outcomes
    assert all("rank 1" in o.error_message for o in outcomes), [o.error_message for o in outcomes]


COMPILE_BATCHES = [
    "short_docs",
    "one_doc",
    "interior_pad",
    "random",
]  # different segments and halos


def _compiled_vs_eager(rank: int, world: int, path: str, backend: str) -> list[int]:
    """cp_blockdiag_sdpa compiled once (fullgraph, ``backend``) over batches with different
    documents: outputs and gradients equal eager; returns the compile counts."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return cp_blockdiag_sdpa(q, k, v, enable_gqa=True) * 2

    compiled = torch.compile(attend, backend=counter, fullgraph=True)
    b, s, local = 2, 24, 24 // world
    halos = set()
    with kernel_path(path):
        for name in COMPILE_BATCHES:
            doc = packed_doc_ids(name, b, s)
            ctx, _ = make_cp_blockdiag_batch_and_ctx(
                dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
            )
            g = torch.Generator().manual_seed(len(name))
            q, k, v = (
                torch.randn(b, h, local, D, dtype=torch.float64, generator=g) for h in (4, 2, 2)
            )
            weight = torch.randn(b, 4, local, D, dtype=torch.float64, generator=g)
            compare_compiled(compiled, attend, ctx, (q, k, v), weight, name)
            with ctx():
                halos.add(active_state().exchange.halos)
    assert world == 1 or len(halos) > 1, halos  # the batches differ in their halos too
    return [counter.frame_count, counter.op_count]


@pytest.mark.parametrize(
    "path, backend",
    [("per_segment", "aot_eager"), ("varlen", "aot_eager"), ("per_segment", "inductor")],
)
def test_compiled_does_not_recompile_per_batch(pools, path: str, backend: str) -> None:
    """The segments and halos are data behind the step's key, not guards: one compile."""
    counts = pools(2).run(_compiled_vs_eager, path, backend, timeout=400)
    assert all(frames == 1 for frames, _ in counts), counts


def _host_reads(rank: int, world: int, path: str) -> list[str]:
    """Host reads of tensor data inside cp_blockdiag_sdpa and its backward (after the step's
    setup) in a model's second step (the first one's calls tell the setup what to make), and
    whether the kernel was handed the packing built at setup."""
    import torch.distributed as dist

    from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    doc = packed_doc_ids("random", 2, 37)
    reads = []
    for _ in range(2):  # two steps
        ctx, batch = make_cp_blockdiag_batch_and_ctx(
            dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
        )
        local = batch["input_ids"].shape[1]
        q, k, v = (
            torch.randn(2, h, local, D, dtype=torch.float64, requires_grad=True)
            for h in (4, 2, 2)
        )
        reads = record_host_reads(ctx, cp_blockdiag_sdpa, (q, k, v), path)
    return reads


@pytest.mark.parametrize("path", PATHS)
def test_hot_path_reads_no_tensor_data_on_host(pools, path: str) -> None:
    """Forward and backward read no tensor data on the host (no device sync on CUDA) and
    rebuild no metadata: the varlen kernel gets the packing computed once at the step's setup."""
    reads = pools(2).run(_host_reads, path, timeout=120)
    assert reads == [[], []], reads


def test_packing_is_built_once_and_cached_per_device() -> None:
    """The step's packing (host) is moved to a device once and reused by every later call;
    it lists exactly the non-pad query rows, and each segment's keys from its document start."""
    from cpshard import make_cp_blockdiag_batch_and_ctx

    doc = packed_doc_ids("interior_pad", 2, 30)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    with ctx():
        state = active_state()
    assert len(state.packing.packings) == 1 and state.packing.rest == ()  # causal spans only
    p = state.packing.packings[0]
    assert torch.equal(p.q_rows, torch.nonzero(doc.view(-1)).view(-1))
    for i, s in enumerate(state.spans):  # one rank: buffer rows are global positions
        keys = p.k_rows[p.cu_k[i] : p.cu_k[i + 1]]
        assert torch.equal(keys, s.row * 30 + torch.arange(s.k, s.split + s.n))
    meta = torch.device("meta")
    on_meta = state.packing_on(meta)
    assert on_meta is state.packing_on(meta) and on_meta.packings[0].q_rows.device == meta
    assert state.packing_on(torch.device("cpu")) is state.packing


def _rounds_and_transfers(rank: int, world: int) -> dict[str, list[int]]:
    """Per check mode, for one cp_blockdiag_sdpa call forward + backward: the consensus rounds
    (host channel) and the halo transfers (exchange, return) it issued."""
    import torch.distributed as dist

    from cpshard import check_mode, consensus, cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx
    from cpshard.attention import halo as attention

    counts = {"rounds": 0, "exchange": 0, "return": 0}

    def counting(name: str, real):
        def call(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        return call

    real = consensus.all_gather_small, attention.halo_exchange, attention.halo_return
    consensus.all_gather_small = counting("rounds", real[0])
    attention.halo_exchange, attention.halo_return = (
        counting("exchange", real[1]),
        counting("return", real[2]),
    )
    try:
        doc = packed_doc_ids("pad_rank", 1, 40)
        ctx, _ = make_cp_blockdiag_batch_and_ctx(
            dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
        )
        local = 40 // world
        got = {}
        for mode in ("step", "call"):
            counts.update(dict.fromkeys(counts, 0))
            q = torch.randn(1, 2, local, D, dtype=torch.float64, requires_grad=True)
            with check_mode(mode), ctx():
                out = cp_blockdiag_sdpa(q, q, q)
            out.sum().backward()
            got[mode] = [counts["rounds"], counts["exchange"], counts["return"]]
    finally:
        consensus.all_gather_small = real[0]
        attention.halo_exchange, attention.halo_return = real[1:]
    return got


def test_default_mode_issues_only_the_halo_transfers(pools) -> None:
    """By default a call issues its halo exchange in the forward, and in the backward the
    exchange again (only this rank's K/V are saved) and the return, nothing else, on every rank
    (an all-padding one included); checked mode adds one consensus round."""
    for got in pools(4).run(_rounds_and_transfers, timeout=60):
        assert got == {"step": [0, 2, 1], "call": [1, 2, 1]}, got


def test_opcheck_attention_ops() -> None:
    """The attention custom ops pass torch.library.opcheck (schema, fake kernel, autograd)."""
    from cpshard import make_cp_blockdiag_batch_and_ctx
    from cpshard.attention.ops import cp_attention_backward_op as blockdiag_attention_backward
    from cpshard.attention.ops import cp_attention_op as blockdiag_attention

    doc = packed_doc_ids("interior_pad", 2, 30)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    with ctx():
        key = active_state().key
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 30, D, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (
        torch.randn(2, 2, 30, D, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(2)
    )
    torch.library.opcheck(blockdiag_attention, (q, k, v, key, None))
    out, lse = (t.detach() for t in blockdiag_attention(q, k, v, key, 0.5))
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    args = (grad, q.detach(), k.detach(), v.detach(), out, lse, key, 0.5)
    torch.library.opcheck(blockdiag_attention_backward, args)


def _opcheck_halo_ops(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cpshard import make_cp_blockdiag_batch_and_ctx
    from cpshard.attention.halo import kv_halo as blockdiag_halo
    from cpshard.attention.halo import kv_halo_return as blockdiag_halo_return

    doc = packed_doc_ids("random", 1, 37)
    ctx, batch = make_cp_blockdiag_batch_and_ctx(
        dist.group.WORLD, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    with ctx():
        state = active_state()
    assert max(state.exchange.halos) > 0  # a rank receives rows
    local = batch["input_ids"].shape[1]
    kv = torch.randn(1, 2, local, 2 * D, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(blockdiag_halo, (kv, state.key))
    grad = torch.randn(1, 2, state.exchange.halo + local, 2 * D, dtype=torch.float64)
    torch.library.opcheck(blockdiag_halo_return, (grad, state.key, local))


def test_opcheck_halo_ops(pools) -> None:
    """The halo custom ops pass torch.library.opcheck on every rank (same calls everywhere)."""
    pools(2).run(_opcheck_halo_ops, timeout=120)


def test_padding_mask_and_document_ids_on_the_batch_device() -> None:
    """Host-made padding_mask and host-given document ids follow the batch to its device (meta
    here), and so does the attention's packing."""
    from cpshard import make_cp_blockdiag_batch_and_ctx

    doc = torch.tensor([[1, 1, 2, 2, 0]])
    embeds = torch.zeros(1, 5, 3, device="meta")
    ctx, batch = make_cp_blockdiag_batch_and_ctx(
        None, None, {"inputs_embeds": embeds, "_packed_seq_ids": doc}
    )
    assert {key: t.device.type for key, t in batch.items()} == dict.fromkeys(batch, "meta")
    side = batch.targets
    assert side.padding_mask.device.type == side.document_ids.device.type == "meta"
    with ctx():
        assert torch.device("meta") in active_state()._packing_on


@pytest.mark.parametrize("path", PATHS)
def test_bf16_on_every_path(path: str) -> None:
    """bf16 through each kernel path (the dtype of the GPU one-launch path) stays within bf16
    rounding of the float64 reference, forward and backward; outputs and gradients keep bf16."""
    from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    doc = packed_doc_ids("random", 2, 37)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, h, 37, D, dtype=torch.float64, generator=g) for h in (4, 2, 2))
    wide = [t.clone().requires_grad_() for t in (q, k, v)]
    want = dense_attention(*wide, doc)
    want_grads = torch.autograd.grad(want.sum(), wide)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    with kernel_path(path), ctx():
        got = cp_blockdiag_sdpa(*low, enable_gqa=True)
    got_grads = torch.autograd.grad(got.float().sum(), low)
    assert got.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in got_grads)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2)
    for a, e in zip(got_grads, want_grads, strict=True):  # gradients of magnitude up to ~10
        torch.testing.assert_close(a.double(), e, rtol=0, atol=1e-1)


def test_torch_flash_varlen_calls_match_the_aten_kernels() -> None:
    """The one-launch CUDA path with torch's real varlen flash ops, run on meta tensors (their
    meta kernels check the arguments and give the shapes): GQA bf16 forward and backward."""
    from cpshard import make_cp_blockdiag_batch_and_ctx
    from cpshard.attention.engine import Varlen as _Varlen
    from cpshard.attention.kernels import TorchFlashVarlen

    doc = packed_doc_ids("random", 2, 37)
    ctx, _ = make_cp_blockdiag_batch_and_ctx(
        None, None, {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    with ctx():
        packing = active_state().packing_on(torch.device("meta"))
    impl = _Varlen(TorchFlashVarlen(), packing.packings)
    q = torch.empty(2, 4, 37, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 37, 64, dtype=torch.bfloat16, device="meta")
    out, lse = impl.forward(q, k, k, None)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    grads = impl.backward(torch.empty_like(out), q, k, k, out, lse, 0.125)
    assert [t.shape for t in grads] == [q.shape, k.shape, k.shape]
