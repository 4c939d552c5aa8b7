"""The attention section's mask rows (:mod:`cpshard.bench.attention_masks`): a quick run on two
spawned ranks (gloo) times every row with outputs checked against the all-gather baseline (the
run fails otherwise), and every rank's received K/V rows equal the rows outside its shard that
its queries reach under the description's dense mask (or the ``mask_mod`` row's pattern),
recomputed here from the same batch."""

from __future__ import annotations

import torch

from cpshard.bench.attention_masks import (
    CASES,
    LAYOUT,
    chunk_size,
    describe,
    image_ids,
    mask_documents,
    seq_len,
)
from cpshard.layouts import make_layout

WORLD = 2


def _dense(case: str, doc: torch.Tensor) -> torch.Tensor:
    """``[S, S]``: which keys each query sees: the description's dense mask, or for the
    ``mask_mod`` row its pattern stated here (causal keys 4 apart in the query's document, and
    position 0 from every query)."""
    if case != "mask_mod":
        return describe(case, doc).dense()[0]
    pos = torch.arange(doc.shape[1])
    q, k = pos[:, None], pos[None, :]
    ids = doc[0]
    return ((ids[:, None] == ids[None, :]) & (k <= q) & ((q - k) % 4 == 0)) | (k == 0)


def _reached(case: str, doc: torch.Tensor) -> list[int]:
    """Per rank: the positions outside its shard that its queries see under ``case``'s mask of
    ``doc``."""
    dense = _dense(case, doc)
    lay = make_layout(LAYOUT, WORLD, doc.shape[1], doc_ids=doc)
    out = []
    for r in range(WORLD):
        mine = lay.indices(r).flatten()
        reach = dense[mine].any(0)
        reach[mine] = False
        out.append(int(reach.sum()))
    return out


def test_quick_run_reports_the_mask_rows(run_bench):
    proc, data = run_bench(
        *"--world 2 --ops attention --quick --repeats 1 --warmup 0 --iters 1 --no-memory".split()
    )
    assert "# attention: cp_attention(mask=MaskDescription | mask_mod=fn)" in proc.stdout
    rows = data["attention"]["masks"]
    assert [r["case"] for r in rows] == list(CASES)
    seq = seq_len(full=False, quick=True)
    doc = mask_documents(seq)
    ids = doc[0]
    lengths = torch.unique_consecutive(ids, return_counts=True)[1]
    assert (lengths[:-1] > chunk_size(seq)).all()  # documents longer than a chunk
    images = image_ids(doc)
    with_images = {int(d) for d in torch.unique(ids[images[0] >= 0])}
    assert 0 < len(with_images) < int(ids.max())  # some documents without images
    for r in rows:
        assert r["world"] == WORLD and r["seq_len"] == seq and r["layout"] == LAYOUT
        assert r["ours_fwd_bwd_s"] > 0 and r["base_fwd_bwd_s"] > 0 and r["speedup"] > 0
        reached = _reached(r["case"], doc)
        assert r["ours_kv_rows_received"] == r["kv_rows_reached"] == reached, r["case"]
        assert max(reached) <= r["base_kv_rows_received"] == seq - seq // WORLD
    chunked, image, mod = rows
    assert chunked["chunk"] == chunk_size(seq) and image["chunk"] is None
    assert image["images"] == int(images.max()) + 1 > 1
    # chunks cut every document, so a rank receives less than the all-gather
    assert max(chunked["ours_kv_rows_received"]) < chunked["base_kv_rows_received"]
    assert mod["segments"] is None and min(mod["ours_kv_rows_received"]) > 0


def test_full_size_batch() -> None:
    """``--full``: S = 32768, chunks of 8192 cutting documents longer than a chunk, image spans
    of 1024-4095 tokens each inside one document, some documents without images."""
    seq = seq_len(full=True, quick=False)
    doc = mask_documents(seq)
    assert seq == 32768 and chunk_size(seq) == 8192
    ids = doc[0]
    lengths = torch.unique_consecutive(ids, return_counts=True)[1]
    assert (lengths[:-1] > chunk_size(seq)).all()
    images = image_ids(doc)[0]
    spans = [torch.nonzero(images == i).flatten() for i in range(int(images.max()) + 1)]
    for span in spans:
        assert 1024 <= span.numel() < 4096
        assert span[-1] - span[0] + 1 == span.numel()  # consecutive
        assert ids[span].unique().numel() == 1  # inside one document
    with_images = {int(ids[span[0]]) for span in spans}
    assert 0 < len(with_images) < int(ids.max())
    for case in ("chunked", "image blocks"):
        assert describe(case, doc).segments > int(ids.max())  # chunks / spans cut documents
