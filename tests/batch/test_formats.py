"""Batches as models produce them: documents from every packing format, per-document positions,
labels shifted once over the whole sequence, and the caller's batch left alone.

References are written here independently: document ids by hand, positions by a loop over
tokens, the shift on the full sequence in one process, per-document attention with a dense mask.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from cpshard.batch import document_ids, document_positions

LAYOUTS = ["contiguous", "head_tail", "stripe", "balanced", "per_document_head_tail"]
# Two rows, interior and trailing padding (0), distinct ids for neighbouring documents.
PACKED = torch.tensor(
    [
        [1, 1, 1, 2, 2, 0, 0, 3, 3, 3, 3, 0, 0],
        [1, 1, 2, 2, 2, 2, 3, 4, 4, 4, 4, 4, 0],
    ]
)
B, S = PACKED.shape


def _positions_by_loop(ids: torch.Tensor) -> torch.Tensor:
    """0, 1, ... in every document; a pad continues from the token before it."""
    out = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        for i in range(ids.shape[1]):
            new_doc = ids[b, i] != 0 and (i == 0 or ids[b, i - 1] != ids[b, i])
            out[b, i] = 0 if (i == 0 or new_doc) else out[b, i - 1] + 1
    return out


def _formats(ids: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """The same documents in every format a model or collator produces."""
    valid = (ids != 0).long()
    pos = _positions_by_loop(ids)
    seq_idx = torch.cumsum((pos == 0) & (ids != 0), dim=1) - 1
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)
    block = same & torch.tril(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool))
    return {
        "_packed_seq_ids": {"_packed_seq_ids": ids},
        "position_ids": {"position_ids": pos, "attention_mask": valid},
        "seq_idx": {"seq_idx": seq_idx, "attention_mask": valid},
        "4-D bool mask": {"attention_mask": block[:, None]},
        "4-D additive mask": {"attention_mask": torch.where(block, 0.0, float("-inf"))[:, None]},
        "2-D indexed mask": {"attention_mask": ids},
        "padding_mask + position_ids": {"position_ids": pos, "padding_mask": ids == 0},
    }


def _flattened() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A DataCollatorWithFlattening-style batch: one row, no padding, cu_seq_lens + seq_idx +
    restarting position_ids; and its ids."""
    lengths = [3, 1, 4, 2]
    ids = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(lengths)])[None]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    batch = {
        "input_ids": torch.arange(ids.shape[1])[None] + 5,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "seq_idx": (ids - 1).int(),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu.clone(),
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }
    return batch, ids


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("name", list(_formats(PACKED)))
def test_every_format_gives_the_packed_ids(name: str) -> None:
    batch = _formats(PACKED)[name]
    assert torch.equal(document_ids(batch, S, "cpu", B), PACKED), name


def test_flattened_formats_give_the_packed_ids() -> None:
    batch, ids = _flattened()
    n = ids.shape[1]
    for keys in (["position_ids"], ["seq_idx"], ["cu_seq_lens_q"], ["cu_seq_lens_k"], list(batch)):
        assert torch.equal(document_ids({k: batch[k] for k in keys}, n, "cpu", 1), ids), keys
    # cu_seqlens ending early: the tail is padding
    cu = torch.tensor([0, 3, 4])
    assert document_ids({"cu_seqlens": cu}, 6, "cpu", 1).tolist() == [[1, 1, 1, 2, 0, 0]]
    # over two rows of a flattened B * S stream, a row start always starts a document
    cu = torch.tensor([0, 2, 8])
    assert document_ids({"cu_seqlens": cu}, 4, "cpu", 2).tolist() == [[1, 1, 2, 2], [1, 1, 1, 1]]


def test_transformers_flattening_collator() -> None:
    transformers = pytest.importorskip("transformers")
    features = [{"input_ids": list(range(10, 10 + n))} for n in (3, 1, 4, 2)]
    collator = transformers.DataCollatorWithFlattening(
        return_tensors="pt", return_seq_idx=True, return_flash_attn_kwargs=True
    )
    batch = collator(features)
    want = torch.cat([torch.full((n,), d + 1) for d, n in enumerate((3, 1, 4, 2))])[None]
    n = want.shape[1]
    for key in ("position_ids", "seq_idx", "cu_seq_lens_q"):
        assert torch.equal(document_ids({key: batch[key]}, n, "cpu", 1), want), key
    assert torch.equal(document_ids(dict(batch), n, "cpu", 1), want)


@pytest.mark.parametrize(
    "batch, match",
    [
        (
            {
                "_packed_seq_ids": torch.tensor([[1, 1, 2, 2]]),
                "seq_idx": torch.tensor([[0, 0, 0, 1]]),
            },
            "seq_idx and _packed_seq_ids describe different documents",
        ),
        (
            {
                "_packed_seq_ids": torch.tensor([[1, 1, 1, 1]]),
                "position_ids": torch.tensor([[0, 1, 0, 1]]),
            },
            "position_ids restart at 0 inside a document",
        ),
        (
            {"cu_seq_lens_q": torch.tensor([0, 2, 4]), "cu_seq_lens_k": torch.tensor([0, 1, 4])},
            "cu_seq_lens_k and cu_seq_lens_q describe different documents",
        ),
        ({"cu_seqlens": torch.tensor([0, 3, 2])}, "non-decreasing"),
        ({"seq_idx": torch.tensor([[0.0, 0.0, 1.0, 1.0]])}, "seq_idx must hold integers"),
    ],
)
def test_contradictory_or_malformed_sources_raise(batch: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        document_ids(batch, 4, "cpu", 1)


def test_position_ids_may_continue_across_documents() -> None:
    """Packing without position reset: documents from the ids, positions not contradicting."""
    batch = {"_packed_seq_ids": PACKED, "position_ids": torch.arange(S).expand(B, S)}
    assert torch.equal(document_ids(batch, S, "cpu", B), PACKED)


def test_document_positions_restart_in_every_document() -> None:
    assert torch.equal(document_positions(PACKED), _positions_by_loop(PACKED))
    assert document_positions(torch.tensor([[0, 0, 5, 5, 0]])).tolist() == [[0, 1, 0, 1, 2]]


# --------------------------------------------------------------------------- ranks


def _full_batch() -> dict[str, torch.Tensor]:
    """A packed B = 2 batch with interior and trailing padding, labels = input_ids (unshifted,
    -100 at padding) as a causal LM takes them."""
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(1, 50, (B, S), generator=g)
    labels = torch.where(PACKED == 0, torch.full_like(input_ids, -100), input_ids)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "attention_mask": (PACKED != 0).long(),
        "position_ids": _positions_by_loop(PACKED),
        "pixel_values": torch.ones(2, 3),
    }


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """The single-process shift of the full sequence: the next token of the same document, else
    -100 (a document's last token, padding)."""
    out = torch.full_like(labels, -100)
    for b in range(labels.shape[0]):
        for i in range(labels.shape[1] - 1):
            if PACKED[b, i] != 0 and PACKED[b, i + 1] == PACKED[b, i]:
                out[b, i] = labels[b, i + 1]
    return out


def _shard_every_way(rank: int, world: int, fmt: str) -> list[dict]:
    """Every layout of the sharder and the block-diagonal batch, on a batch whose documents come
    in format ``fmt`` (no position_ids, so they are created): what each rank got, in global order
    where the sharder can gather it, plus whether the caller's batch was left alone."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    full = _full_batch()
    batch = {k: v for k, v in full.items() if k != "position_ids"}
    batch.update({k: v for k, v in _formats(PACKED)[fmt].items() if k != "position_ids"})
    if fmt in ("position_ids", "padding_mask + position_ids"):
        batch["position_ids"] = full["position_ids"]
    before = {k: (v, v.clone()) for k, v in batch.items()}
    results = []
    for layout in LAYOUTS:
        sh = ContextParallelSharder(dist.group.WORLD, layout)
        _, out = sh.shard(batch)
        results.append(_in_global_order(layout, out, partial(sh.gather_token_tensor, trim=True)))
    _, out = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    results.append(_in_global_order("blockdiag", out, lambda t: _all_gather_rows(t, world)[:, :S]))
    unchanged = set(batch) == set(before) and all(
        batch[k] is v and torch.equal(v, old) for k, (v, old) in before.items()
    )
    for r in results:
        r["unchanged"] = unchanged
    return results


def _in_global_order(who: str, out, gather: Callable[[torch.Tensor], torch.Tensor]) -> dict:
    """A sharded batch's keys, and its positions and side record in global order."""
    side = out.targets
    return {
        "who": who,
        "keys": sorted(out),
        "position_ids": gather(out["position_ids"]),
        "labels": gather(side.labels),
        "num_labelled": int(side.num_labelled),
        "document_ids": gather(side.document_ids),
        "padding_mask": gather(side.padding_mask),
    }


def _all_gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    """Contiguous [B, L] shards -> [B, W * L] in rank order."""
    from cpshard import gather_metadata

    return gather_metadata(t.contiguous(), None if world == 1 else _world(), seq_dim=1)


def _world():
    import torch.distributed as dist

    return dist.group.WORLD


@pytest.mark.parametrize("fmt", ["position_ids", "seq_idx", "4-D bool mask", "2-D indexed mask"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_batches_read_documents_create_positions_and_shift_once(
    pools, world: int, fmt: str
) -> None:
    got = pools(world).run(_shard_every_way, fmt, timeout=120)
    full = _full_batch()
    want_labels = _shifted(full["labels"])
    for rank in range(world):
        for r in got[rank]:
            who = f"{fmt}/{r['who']}/W={world}/rank {rank}"
            assert r["keys"] == ["input_ids", "pixel_values", "position_ids"], who
            assert torch.equal(r["document_ids"], PACKED), who
            assert torch.equal(r["padding_mask"], PACKED == 0), who
            assert torch.equal(r["position_ids"], full["position_ids"]), who
            assert torch.equal(r["labels"], want_labels), who
            assert r["num_labelled"] == int((want_labels != -100).sum()), who
            assert r["unchanged"], who


def _contradiction_on_rank_1(rank: int, world: int, entry: str) -> None:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    batch = {
        "input_ids": torch.ones(1, 8, dtype=torch.long),
        "_packed_seq_ids": torch.ones(1, 8, dtype=torch.long),
    }
    if rank == 1:
        batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    if entry == "sharder":
        ContextParallelSharder(dist.group.WORLD, "contiguous").shard(batch)
    else:
        make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)


@pytest.mark.parametrize("entry", ["sharder", "blockdiag"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_contradictory_sources_raise_on_every_rank(pools, world: int, entry: str) -> None:
    outcomes = pools(world).run_collect(_contradiction_on_rank_1, entry, timeout=30)
    assert all(not o.ok and o.error_type == "ValueError" for o in outcomes), outcomes
    assert "position_ids restart at 0 inside a document" in outcomes[1].error_message
    assert all("rank 1" in o.error_message for o in outcomes), [o.error_message for o in outcomes]


# --------------------------------------------------------------------------- silent-wrong cases


def _flattened_attention(rank: int, world: int) -> torch.Tensor:
    """Case 2: block-diagonal attention on a DataCollatorWithFlattening-style batch (documents
    only in position_ids / seq_idx / cu_seq_lens); this rank's output."""
    from cpshard import cp_blockdiag_sdpa, make_cp_blockdiag_batch_and_ctx

    batch, _ = _flattened()
    batch["inputs_embeds"] = _embeds(batch["input_ids"].shape[1])
    ctx, out = make_cp_blockdiag_batch_and_ctx(_world() if world > 1 else None, None, batch)
    x = out["inputs_embeds"]
    q = x.view(1, x.shape[1], 2, 4).transpose(1, 2)
    with ctx():
        return cp_blockdiag_sdpa(q, q * 0.5, q + 1.0)


def _embeds(n: int) -> torch.Tensor:
    return torch.randn(1, n, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


@pytest.mark.parametrize("world", [2, 4])
def test_case2_flattening_collator_batches_attend_within_documents(pools, world: int) -> None:
    got = pools(world).run(_flattened_attention, timeout=60)
    batch, ids = _flattened()
    n = ids.shape[1]
    q = _embeds(n).view(1, n, 2, 4).transpose(1, 2)
    same = (ids[0][:, None] == ids[0][None, :]) & torch.tril(torch.ones(n, n, dtype=torch.bool))
    want = F.scaled_dot_product_attention(q, q * 0.5, q + 1.0, attn_mask=same)
    out = torch.cat(got, dim=2)[:, :, :n]
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)


def _positions_without_any(rank: int, world: int, layout: str) -> torch.Tensor:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    batch = {"input_ids": torch.ones(B, S, dtype=torch.long), "_packed_seq_ids": PACKED}
    if layout == "blockdiag":
        _, out = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
        return _all_gather_rows(out["position_ids"], world)[:, :S]
    sh = ContextParallelSharder(dist.group.WORLD, layout)
    _, out = sh.shard(batch)
    return sh.gather_token_tensor(out["position_ids"], trim=True)


@pytest.mark.parametrize("layout", ["blockdiag", "contiguous", "head_tail"])
def test_case3_created_position_ids_restart_in_every_document(pools, layout: str) -> None:
    got = pools(2).run(_positions_without_any, layout, timeout=60)
    for pos in got:
        assert torch.equal(pos, _positions_by_loop(PACKED)), layout


def _cp_loss(rank: int, world: int, layout: str) -> tuple[float, bool]:
    """A token-wise 'model' (logits = a fixed embedding of input_ids): the CP loss from the
    side record's labels, and whether the model's own loss would be computed (labels kept)."""
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, cp_cross_entropy, make_cp_blockdiag_batch_and_ctx

    batch = _full_batch()
    if layout == "blockdiag":
        _, out = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    else:
        _, out = ContextParallelSharder(dist.group.WORLD, layout).shard(batch)
    logits = _logits(out["input_ids"])
    loss = cp_cross_entropy(logits, out.targets.labels, dist.group.WORLD)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world, "labels" in out


def _logits(input_ids: torch.Tensor) -> torch.Tensor:
    table = torch.randn(50, 50, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    return table[input_ids]


@pytest.mark.parametrize("layout", ["blockdiag", "contiguous", "head_tail"])
def test_case4_labels_shift_once_before_sharding(pools, layout: str) -> None:
    batch = _full_batch()
    want = F.cross_entropy(
        _logits(batch["input_ids"]).reshape(-1, 50),
        _shifted(batch["labels"]).reshape(-1),
        ignore_index=-100,
    )
    for total, kept in pools(3).run(_cp_loss, layout, timeout=60):
        assert not kept, "labels left in the batch: model(**batch) would shift them again per shard"
        assert abs(total - float(want)) < 1e-12, (total, float(want))


def test_case6_blockdiag_batch_leaves_the_callers_dict_alone() -> None:
    from cpshard import make_cp_blockdiag_batch_and_ctx

    batch = _full_batch()
    batch["inputs_embeds"] = torch.randn(B, S, 4, requires_grad=True)
    snapshot = dict(batch)
    _, out = make_cp_blockdiag_batch_and_ctx(None, None, batch, loss_mask=torch.ones(B, S))
    assert out is not batch
    assert set(batch) == set(snapshot) and all(batch[k] is v for k, v in snapshot.items())
    assert "attention_mask" in batch and "padding_mask" not in batch and "loss_mask" not in batch


def test_transformers_model_takes_the_sharded_batch() -> None:
    """``model(**batch)`` on a sharded DataCollatorWithFlattening batch (one rank, so the model's
    own packed-sequence attention applies): the forward accepts every key, computes no loss of
    its own, and the side record's labels give the model's own loss on the full batch."""
    transformers = pytest.importorskip("transformers")
    from cpshard import ContextParallelSharder, cp_cross_entropy, make_cp_blockdiag_batch_and_ctx

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = transformers.LlamaForCausalLM(config).double().eval()
    features = [{"input_ids": list(range(3 + n, 3 + 2 * n))} for n in (3, 5, 2)]
    batch = dict(transformers.DataCollatorWithFlattening(return_tensors="pt")(features))
    want = model(**batch).loss
    for entry in ("sharder", "blockdiag"):
        if entry == "sharder":
            _, out = ContextParallelSharder(None, "contiguous").shard(batch)
        else:
            _, out = make_cp_blockdiag_batch_and_ctx(None, None, batch)
        result = model(**out)
        assert result.loss is None, entry
        got = cp_cross_entropy(result.logits, out.targets.labels, None)
        # transformers computes its loss in float32
        torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=1e-6, msg=entry)
        assert int(out.targets.num_labelled) == int((batch["labels"][:, 1:] != -100).sum())


def test_labels_that_already_are_targets_are_not_shifted() -> None:
    """``shift_labels=False`` (labels already targets, e.g. NeMo's): sharded as given."""
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    batch = _full_batch()
    loss_mask = torch.rand(B, S, dtype=torch.float64)
    _, out = ContextParallelSharder(None, "stripe", shift_labels=False, loss_mask=loss_mask).shard(
        batch
    )
    assert torch.equal(out.targets.labels, batch["labels"]) and torch.equal(
        out.targets.loss_mask, loss_mask
    )
    _, out = make_cp_blockdiag_batch_and_ctx(None, None, batch, loss_mask, shift_labels=False)
    assert torch.equal(out.targets.labels, batch["labels"]) and torch.equal(
        out.targets.loss_mask, loss_mask
    )
    assert int(out.targets.num_labelled) == int((batch["labels"] != -100).sum())
    with pytest.raises(TypeError, match="shift_labels must be a bool"):
        ContextParallelSharder(None, "contiguous", shift_labels=1)
    with pytest.raises(ValueError, match="rank 0: labels and loss_mask must be"):
        make_cp_blockdiag_batch_and_ctx(None, None, {**batch, "labels": batch["labels"][:, :-1]})


def _documents_differ_on_rank_1(rank: int, world: int) -> None:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder

    ids = PACKED.clone()
    if rank == 1:
        ids[0, 2] = 2  # other documents, the same partition of a closed-form layout
    ContextParallelSharder(dist.group.WORLD, "head_tail").shard(
        {"input_ids": torch.ones(B, S, dtype=torch.long), "_packed_seq_ids": ids}
    )


def test_sharder_names_a_rank_whose_documents_differ(pools) -> None:
    outcomes = pools(2).run_collect(_documents_differ_on_rank_1, timeout=30)
    assert all(not o.ok and o.error_type == "ValueError" for o in outcomes), outcomes
    assert all("document ids differs on rank" in o.error_message for o in outcomes), [
        o.error_message for o in outcomes
    ]


@pytest.mark.parametrize("seed", range(20))
def test_document_positions_at_any_positions_equal_the_whole_rows(seed: int) -> None:
    """A rank's per-document positions (any of its positions, past the end included) equal the
    whole rows' positions, padded as position_ids are padded."""
    from cpshard.batch.documents import document_positions_at
    from cpshard.batch.padding import pad_sequence

    g = torch.Generator().manual_seed(seed)
    rows, seq_len = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(0, 40, (1,), generator=g))
    ids = torch.randint(0, 4, (rows, seq_len), generator=g).cummax(1).values  # runs, pads at start
    ids = ids * (torch.rand(rows, seq_len, generator=g) > 0.2)  # interior padding
    padded = seq_len + int(torch.randint(0, 9, (1,), generator=g))
    whole = pad_sequence("position_ids", document_positions(ids), 1, padded)
    at = torch.randperm(padded, generator=g)[: padded // 2]
    assert torch.equal(document_positions_at(ids, at), whole[:, at])
    per_row = torch.stack([torch.randperm(padded, generator=g)[: padded // 3] for _ in range(rows)])
    assert torch.equal(document_positions_at(ids, per_row), whole.gather(1, per_row))
