"""Mask descriptions against a dense statement of each pattern, element by element, on fuzzed
packed batches (padding anywhere, one-token documents, empty rows, B > 1): the builders, their
intersections and unions (refused exactly when a query's keys are not one interval), and runs
(random ones, and every rank's runs of every layout at W = 1-4) cut at the segments: every query
of every run sees exactly its row of the dense mask."""

from __future__ import annotations

import pickle
import random

import torch

from cpshard.layouts import make_layout
from cpshard.masks import INF, MaskDescription, cut_runs
from cpshard.planning import layout_runs
from tests.helpers import document_spans


def _documents(rng: random.Random, rows: int, length: int) -> torch.Tensor:
    """``[rows, length]`` ids (0 = pad): documents of 1-12 tokens (often one), padding runs
    anywhere, some rows all padding; ids distinct within a row."""
    doc = torch.zeros(rows, length, dtype=torch.int64)
    for b in range(rows):
        if rng.random() < 0.15:
            continue  # an empty row
        pos, ident = 0, 1
        while pos < length:
            size = rng.choice([1, 1, 2, 3, 5, 8, 12])
            if rng.random() < 0.25:
                pos += size  # padding
                continue
            doc[b, pos : pos + size] = ident
            ident, pos = ident + 1, pos + size
    return doc


def _dense(doc: torch.Tensor, sees) -> torch.Tensor:
    """The dense mask: ``sees(b, ds, q, k)`` for the queries ``q`` ``[n, 1]`` and keys ``k``
    ``[1, n]`` of each document (nothing across documents)."""
    rows, length = doc.shape
    out = torch.zeros(rows, length, length, dtype=torch.bool)
    for b, ds, de in document_spans(doc):
        q = torch.arange(ds, de)[:, None]
        out[b, ds:de, ds:de] = torch.as_tensor(sees(b, ds, q, q.T)).expand(de - ds, de - ds)
    return out


def _random_blocks(rng: random.Random, doc: torch.Tensor, split: bool) -> torch.Tensor:
    """Block ids: runs of -1 and of block ids; with ``split``, ids may come back inside a
    document."""
    ids = torch.full(doc.shape, -1, dtype=torch.int64)
    for b in range(doc.shape[0]):
        pos, group = 0, 0
        while pos < doc.shape[1]:
            size = rng.randint(1, 5)
            if rng.random() < 0.5:
                ids[b, pos : pos + size] = rng.randint(0, group) if split else group
                group += 1
            pos += size
    return ids


def _split_block(doc: torch.Tensor, ids: torch.Tensor) -> bool:
    """Some block's tokens inside some document are not consecutive."""
    for b, ds, de in document_spans(doc):
        seen: set[int] = set()
        for i in range(ds, de):
            g = int(ids[b, i])
            if g >= 0 and g in seen and int(ids[b, i - 1]) != g:
                return True
            seen.add(g)
    return False


def _random_rules(rng: random.Random, doc: torch.Tensor) -> tuple[MaskDescription, torch.Tensor]:
    """A description with arbitrary rules (intervals that need not hold the query, empty ones)
    on random segments, and its dense mask stated from the rule."""
    chunks = MaskDescription.chunks(doc, rng.randint(1, 6))
    n = chunks.segments
    ds, de = chunks.doc_start, chunks.doc_end

    def inside() -> torch.Tensor:
        bounds = zip(ds.tolist(), de.tolist(), strict=True)
        return torch.tensor([rng.randint(x, y) for x, y in bounds], dtype=torch.int64)

    def reach() -> torch.Tensor:
        return torch.tensor([rng.choice([0, 1, 2, 4, INF]) for _ in range(n)], dtype=torch.int64)

    lo, hi, back, ahead = inside(), inside(), reach(), reach()
    described = MaskDescription(
        chunks.rows, chunks.length, chunks.row, chunks.start, chunks.end, ds, de, lo, back, hi,
        ahead,
    )  # fmt: skip
    dense = torch.zeros(chunks.rows, chunks.length, chunks.length, dtype=torch.bool)
    for s in range(n):
        for q in range(int(chunks.start[s]), int(chunks.end[s])):
            first = max(int(lo[s]), q - int(back[s]))
            end = min(int(hi[s]), q + 1 + int(ahead[s]))
            dense[int(chunks.row[s]), q, first:max(first, end)] = True
    return described, dense


def _one_interval(dense: torch.Tensor) -> bool:
    """Every query's keys are one interval (or none)."""
    changes = (dense[..., 1:] != dense[..., :-1]).sum(-1) + dense[..., 0].long()
    return bool((changes <= 2).all())


def _primitives(
    rng: random.Random, doc: torch.Tensor
) -> list[tuple[MaskDescription, torch.Tensor]]:
    """The builders on ``doc`` (random windows, chunk size, blocks) and two descriptions of
    arbitrary rules, each with its dense statement."""
    back, ahead, size = rng.choice([0, 1, 3, INF]), rng.choice([0, 2, INF]), rng.randint(1, 9)
    ids = _random_blocks(rng, doc, split=False)
    out = [
        (MaskDescription.within_documents(doc, ahead=0), _dense(doc, lambda b, ds, q, k: k <= q)),
        (MaskDescription.within_documents(doc), _dense(doc, lambda b, ds, q, k: True)),
        (
            MaskDescription.within_documents(doc, back=back, ahead=ahead),
            _dense(doc, lambda b, ds, q, k: (q - back <= k) & (k <= q + ahead)),
        ),
        (
            MaskDescription.chunks(doc, size),
            _dense(doc, lambda b, ds, q, k: (q - ds) // size == (k - ds) // size),
        ),
        (
            MaskDescription.blocks(doc, ids),
            _dense(doc, lambda b, ds, q, k: (ids[b, q] == ids[b, k]) & (ids[b, q] >= 0)),
        ),
    ]
    return out + [_random_rules(rng, doc) for _ in range(2)]


def _batches(count: int) -> list[torch.Tensor]:
    rng = random.Random(7)
    shapes = [(1, 1), (2, 1), (1, 17), (3, 24), (2, 40)]
    return [_documents(rng, *shapes[i % len(shapes)]) for i in range(count)]


def test_builders_match_their_dense_statement() -> None:
    rng = random.Random(1)
    for doc in _batches(15):
        for described, dense in _primitives(rng, doc):
            assert torch.equal(described.dense(), dense)


def test_blocks_are_refused_when_split_inside_a_document() -> None:
    rng = random.Random(2)
    refused = 0
    for doc in _batches(30):
        ids = _random_blocks(rng, doc, split=True)
        described = MaskDescription.blocks(doc, ids)
        assert (described is None) == _split_block(doc, ids)
        refused += described is None
        if described is not None:
            same = _dense(doc, lambda b, ds, q, k: (ids[b, q] == ids[b, k]) & (ids[b, q] >= 0))
            assert torch.equal(described.dense(), same)
    assert refused  # the fuzz reaches the refusal


def test_intersections_and_unions_are_exact_or_refused() -> None:
    rng = random.Random(3)
    unions = refused = 0
    for doc in _batches(20):
        parts = _primitives(rng, doc)
        for _ in range(12):
            (a, da), (b, db) = rng.sample(parts, 2)
            both = a.intersect(b)
            assert torch.equal(both.dense(), da & db)
            either = a.union(b)
            assert (either is None) == (not _one_interval(da | db))
            if either is not None:
                assert torch.equal(either.dense(), da | db)
                unions += 1
                # a second level: unions of unions and intersections
                c, dc = rng.choice(parts)
                again = either.union(c)
                if again is not None:
                    assert torch.equal(again.dense(), da | db | dc)
                assert torch.equal(either.intersect(c).dense(), (da | db) & dc)
            else:
                refused += 1
    assert unions and refused


def test_descriptions_of_other_documents_do_not_combine() -> None:
    doc = torch.tensor([[1, 1, 2, 2, 0]])
    other = torch.tensor([[1, 1, 1, 2, 0]])
    a = MaskDescription.within_documents(doc)
    others = (other, doc[:, :4])
    for b in (MaskDescription.within_documents(ids) for ids in others):
        for combine in (a.intersect, a.union):
            try:
                combine(b)
            except ValueError as exc:
                assert "different" in str(exc)
            else:
                raise AssertionError("combined descriptions of different documents")


def _random_runs(rng: random.Random, doc: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every document cut at random points into runs (as ranks hold them), in random order:
    row, begin, length, document start and end; a few empty runs among them."""
    runs = []
    for b, ds, de in document_spans(doc):
        cuts = sorted({ds, de, *(rng.randint(ds, de) for _ in range(2))})
        runs += [(b, x, y - x, ds, de) for x, y in zip(cuts, cuts[1:])]
        if rng.random() < 0.2:
            runs.append((b, ds, 0, ds, de))
    rng.shuffle(runs)
    table = torch.tensor(runs, dtype=torch.int64).view(-1, 5)
    return table.unbind(1)


def test_runs_cut_at_segments_see_their_dense_rows() -> None:
    rng = random.Random(4)
    for doc in _batches(20):
        for described, dense in _primitives(rng, doc):
            if described is None:
                continue
            row, begin, n, ds, de = _random_runs(rng, doc)
            pieces = cut_runs(described, row, begin, n, ds, de)
            assert int(pieces.n.sum()) == int(n.sum())
            # each piece lies inside its run
            assert bool((pieces.begin >= begin[pieces.run]).all())
            assert bool((pieces.begin + pieces.n <= (begin + n)[pieces.run]).all())
            seen = torch.zeros_like(dense)
            covered = torch.zeros(dense.shape[:2], dtype=torch.bool)
            qrow, q, first, end = pieces.query_ranges()
            keys = torch.arange(dense.shape[2])
            seen[qrow, q] = (keys >= first[:, None]) & (keys < end[:, None])
            covered[qrow, q] = True
            assert torch.equal(seen, dense & covered[:, :, None])
            assert torch.equal(covered, doc != 0)
            # [lo, hi): every key of the piece's queries, and no more when none is empty
            for p in range(pieces.n.numel()):
                b, x, m = int(pieces.row[p]), int(pieces.begin[p]), int(pieces.n[p])
                rows = dense[b, x : x + m]
                visible = torch.nonzero(rows.any(0)).flatten()
                lo, hi = int(pieces.lo[p]), int(pieces.hi[p])
                assert all(lo <= k < hi for k in visible.tolist())
                if bool(rows.any(1).all()):
                    assert (lo, hi) == (int(visible.min()), int(visible.max()) + 1)
                if bool(pieces.causal[p]):  # no query sees past itself
                    assert not any(bool(dense[b, x + i, x + i + 1 :].any()) for i in range(m))


def test_runs_of_other_documents_are_refused() -> None:
    doc = torch.tensor([[1, 1, 1, 2, 2, 0]])
    described = MaskDescription.within_documents(doc, ahead=0)
    bad = [
        ([0], [4], [2], [3], [5]),  # reaches the padding
        ([0], [2], [2], [0], [3]),  # crosses a document boundary
        ([0], [0], [2], [0], [2]),  # another document end
    ]
    for cols in bad:
        try:
            cut_runs(described, *(torch.tensor(c) for c in cols))
        except ValueError as exc:
            assert "run" in str(exc)
        else:
            raise AssertionError(f"cut runs {cols} of other documents")


def test_descriptions_pickle() -> None:
    doc = _batches(4)[3]
    described = MaskDescription.within_documents(doc, ahead=0).union(
        MaskDescription.blocks(doc, _random_blocks(random.Random(5), doc, split=False))
    )
    assert described is not None
    again = pickle.loads(pickle.dumps(described))
    assert torch.equal(again.dense(), described.dense())


def test_every_ranks_runs_of_every_layout_see_their_dense_rows() -> None:
    """The runs the step's planners hold (every rank's, any layout) cut at the segments."""
    rng = random.Random(6)
    for doc in _batches(10)[2:]:
        for name in ("contiguous", "head_tail", "stripe", "per_document_head_tail", "balanced"):
            for world in (1, 2, 3, 4):
                layout = make_layout(name, world, doc.shape[1], doc_ids=doc)
                padded = torch.cat(
                    [doc, doc.new_zeros(doc.shape[0], layout.padded_seq_len - doc.shape[1])], 1
                )
                runs = layout_runs(layout, padded)
                for described, dense in _primitives(rng, padded)[:5]:
                    cols = (runs.row, runs.begin, runs.n, runs.doc_start, runs.doc_end)
                    qrow, q, first, end = cut_runs(described, *cols).query_ranges()
                    keys = torch.arange(padded.shape[1])
                    seen = (keys >= first[:, None]) & (keys < end[:, None])
                    assert torch.equal(seen, dense[qrow, q]), (name, world)
                    assert int(q.numel()) == int((padded != 0).sum())


def test_same_as_compares_every_segment_and_rule() -> None:
    """Two descriptions are the same mask iff their sizes, segments and rules all are (what
    lets a step reuse the plan of an equal description made again)."""
    doc = torch.tensor([[1, 1, 1, 2, 2, 0, 3, 3]])
    causal = MaskDescription.within_documents(doc, ahead=0)
    assert causal.same_as(MaskDescription.within_documents(doc, ahead=0))
    assert not causal.same_as(MaskDescription.within_documents(doc))  # bidirectional
    assert not causal.same_as(MaskDescription.within_documents(doc, back=1, ahead=0))  # window
    other = torch.tensor([[1, 1, 2, 2, 2, 0, 3, 3]])  # same shape, other documents
    assert not causal.same_as(MaskDescription.within_documents(other, ahead=0))
    longer = torch.cat([doc, doc.new_zeros(1, 2)], 1)  # same segments, another length
    assert not causal.same_as(MaskDescription.within_documents(longer, ahead=0))
