"""A mask_mod planned block by block against the mask_mod called on every (query, key) alone:
the kind of every (query block, key block) and the key ranges of every query block (every seen
key inside one, each range's ends seen), with documents and without, heads that differ, rows
that do not fill a block."""

from __future__ import annotations

import random

import pytest
import torch

from cpshard.masks import EMPTY, FULL, PARTIAL, plan_mask_mod


def _documents(rows: int, length: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    doc = torch.zeros(rows, length, dtype=torch.int64)
    for b in range(rows):
        pos, ident = rng.randint(0, 2), 1
        while pos < length:
            size = rng.choice([1, 3, 6, 11])
            if rng.random() > 0.2:
                doc[b, pos : pos + size] = ident
                ident += 1
            pos += size
    return doc


def _scalar_dense(mask_mod, doc: torch.Tensor | None, rows: int, length: int, heads: int):
    """``[B, H, S, S]``: the mask_mod called on each (b, h, q, k) alone, and the documents."""
    out = torch.zeros(rows, heads, length, length, dtype=torch.bool)
    for b in range(rows):
        for h in range(heads):
            for q in range(length):
                for k in range(length):
                    seen = bool(mask_mod(*(torch.tensor(v) for v in (b, h, q, k))))
                    if doc is not None:
                        seen = seen and int(doc[b, q]) != 0 and int(doc[b, q]) == int(doc[b, k])
                    out[b, h, q, k] = seen
    return out


def _cases(rows: int, length: int):
    doc = _documents(rows, length, seed=length)
    blocks = length // 4 + 1
    sparse = torch.rand(rows, blocks, blocks, generator=torch.Generator().manual_seed(3)) < 0.4

    def summary(b, h, q, k):  # document-causal, and every token sees the row's first token
        same = (doc[b, q] == doc[b, k]) & (doc[b, q] != 0)
        return (same & (k <= q)) | ((k == 0) & (doc[b, q] != 0))

    def dilated(b, h, q, k):
        return (k <= q) & ((q - k) % 3 == 0)

    def block_sparse(b, h, q, k):
        return sparse[b, q // 4, k // 4] & (k <= q)

    def per_head(b, h, q, k):  # head 0 causal, head 1 a window of 3
        return (k <= q) & ((h == 0) | (q - k < 3))

    return [
        (summary, None, 1),
        (dilated, doc, 1),
        (block_sparse, doc, 1),
        (per_head, doc, 2),
        (lambda b, h, q, k: q >= 0, None, 1),  # everything: full blocks
    ]


def _expected_ranges(seen: torch.Tensor, block: int) -> list[tuple[int, int, int, int]]:
    """(row, query block, lo, hi) from the dense mask, by walking the blocks."""
    rows, length = seen.shape[0], seen.shape[1]
    out = []
    for b in range(rows):
        for qb in range(0, length, block):
            keys = seen[b, qb : qb + block].any(0)
            run = None
            for kb in range(0, length + block, block):
                hit = torch.nonzero(keys[kb : kb + block]).flatten()
                if hit.numel():
                    lo, hi = kb + int(hit.min()), kb + int(hit.max()) + 1
                    run = (lo, hi) if run is None else (run[0], hi)
                elif run is not None:
                    out.append((b, qb // block, *run))
                    run = None
    return out


@pytest.mark.parametrize("rows,length,block", [(2, 23, 4), (1, 16, 8), (3, 9, 16), (2, 0, 4)])
def test_mask_mod_plan_matches_every_pair(
    rows: int, length: int, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    kinds_seen = set()
    for mask_mod, doc, heads in _cases(rows, length):
        plan = plan_mask_mod(mask_mod, rows, length, documents=doc, heads=heads, block=block)
        with monkeypatch.context() as m:  # one query block per evaluation: the same plan
            m.setattr("cpshard.masks.mask_mod._BAND_ELEMENTS", 1)
            banded = plan_mask_mod(mask_mod, rows, length, documents=doc, heads=heads, block=block)
        for name in ("kinds", "row", "qblock", "lo", "hi"):
            assert torch.equal(getattr(plan, name), getattr(banded, name))
        dense = _scalar_dense(mask_mod, doc, rows, length, heads)
        nq = (length + block - 1) // block
        assert plan.kinds.shape == (rows, nq, nq)
        for b in range(rows):
            for qb in range(nq):
                for kb in range(nq):
                    tile = dense[b, :, qb * block : (qb + 1) * block, kb * block : (kb + 1) * block]
                    want = FULL if bool(tile.all()) else PARTIAL if bool(tile.any()) else EMPTY
                    assert int(plan.kinds[b, qb, kb]) == want
                    kinds_seen.add(want)
        got = list(zip(*(t.tolist() for t in (plan.row, plan.qblock, plan.lo, plan.hi))))
        assert got == _expected_ranges(dense.any(1), block)
    if length:
        assert kinds_seen == {EMPTY, PARTIAL, FULL}


def test_mask_mod_bad_arguments() -> None:
    with pytest.raises(ValueError, match="documents"):
        plan_mask_mod(lambda b, h, q, k: k <= q, 1, 4, documents=torch.ones(1, 5).long())
    with pytest.raises(ValueError, match="block"):
        plan_mask_mod(lambda b, h, q, k: k <= q, 1, 4, block=0)
    with pytest.raises(ValueError, match="mask_mod must return a bool tensor of shape"):
        plan_mask_mod(lambda b, h, q, k: (k <= q).long(), 1, 4)
    with pytest.raises(ValueError, match="got \\[2, 1, 1, 1\\]"):
        plan_mask_mod(lambda b, h, q, k: torch.ones(2, 1, 1, 1, dtype=torch.bool), 1, 4)
