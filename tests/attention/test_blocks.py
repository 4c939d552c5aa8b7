"""The loop's blocks of short runs (:mod:`cpshard.attention.blocks`) and the packing's overlap
test, against brute force over the spans they replace."""

from __future__ import annotations

import random

import pytest
import torch

from cpshard.attention.blocks import BLOCK_QUERIES, SHORT_SPAN, Block, plan_blocks
from cpshard.attention.packing import overlap as _overlap
from cpshard.masks import INF
from cpshard.planning.spans import Span, span_rules, span_table


def _visible(spans: list[Span], causal: bool) -> set[tuple[int, int, int]]:
    """(row, local query, buffer key) pairs the spans attend (the kernels' contract)."""
    pairs = set()
    for s in spans:
        for i in range(s.n):
            last = s.split + i + 1 if causal else s.split
            pairs |= {(s.row, s.q + i, key) for key in range(s.k, last)}
    return pairs


def _random_spans(rng: random.Random, rows: int) -> list[Span]:
    """Row-major spans as a layout's plan gives them: runs of documents (some short, some long),
    each run's keys from its document's start in the row's buffer."""
    spans = []
    for row in range(rows):
        q = key = 0
        for _ in range(rng.randint(0, 6)):  # documents
            doc_start = key
            for _ in range(rng.randint(1, 40)):  # this rank's runs in the document
                n = rng.choice([1, 1, 2, 3, SHORT_SPAN - 1, SHORT_SPAN, 70])
                key += rng.randint(0, 3)  # other ranks' tokens in between
                spans.append(Span(row, q, n, doc_start, key))
                q, key = q + n, key + n
            q += rng.randint(0, 2)  # padding between documents
    return spans


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_blocks_attend_exactly_the_spans_pairs(seed: int, causal: bool) -> None:
    rng = random.Random(seed)
    spans = _random_spans(rng, rows=rng.randint(1, 3))
    table = span_table(spans)
    blocks = plan_blocks(table, span_rules(table, causal))
    got = set()
    for item in blocks.items:
        if not isinstance(item, Block):
            got |= _visible([item], causal)
            continue
        assert 2 <= item.n <= BLOCK_QUERIES
        mask = blocks.mask(item, torch.float64)[0, 0]
        assert mask.shape == (item.n, item.width)
        for i, j in torch.nonzero(mask == 0).tolist():
            got.add((item.row, item.q + i, item.k + j))
        assert torch.isneginf(mask[mask != 0]).all()
    assert got == _visible(spans, causal)
    # every short span that has a short neighbour in its document and row ends up in a block
    alone = [s for s in blocks.items if isinstance(s, Span) and s.n < SHORT_SPAN]
    for s in alone:
        nxt = [t for t in spans if t.row == s.row and t.k == s.k and t.q == s.q + s.n]
        assert not (nxt and nxt[0].n < SHORT_SPAN), (s, nxt)


def test_stripe_state_runs_in_blocks() -> None:
    """``stripe`` gives single-token runs: the loop runs them as a few blocks, not per token."""
    from cpshard.attention.step import step_state as layout_state
    from cpshard.layouts import make_layout

    class Solo:  # the one rank of a world-4 group whose state is planned (no communication)
        world, rank, name = 4, 1, "solo"

    doc = torch.repeat_interleave(torch.arange(1, 9), 64).view(1, -1)  # 8 documents of 64
    state = layout_state(Solo(), make_layout("stripe", 4, 512), doc)
    assert len(state.spans) == 128
    assert [type(i) for i in state.blocks.items] == [Block] * 8
    assert [i.n for i in state.blocks.items] == [16] * 8
    # each token's run would pack its document's whole prefix: no varlen packing, the loop runs
    assert state.packing is None and state.packing_on(torch.device("meta")) is None
    assert layout_state(Solo(), make_layout("contiguous", 4, 512), doc).packing is not None


@pytest.mark.parametrize("seed", range(20))
def test_overlap_matches_duplicate_rows(seed: int) -> None:
    rng = random.Random(seed)
    first = [rng.randint(0, 60) for _ in range(rng.randint(0, 8))]
    lengths = [rng.randint(0, 9) for _ in first]
    rows = [r for f, n in zip(first, lengths, strict=True) for r in range(f, f + n)]
    assert _overlap(first, lengths) == (len(rows) != len(set(rows)))


def _walked_blocks(spans: list[Span], causal: bool, window: int | None) -> list[tuple]:
    """The blocks by a walk over every span (what the whole-tensor planner must give): short
    spans of one document and row join the open block while it has room, cut spans are tiled,
    long spans stand alone; each item as a tuple with its per-query key ranges."""
    items, group, room = [], [], 0

    def close(tile: bool = False) -> None:
        nonlocal room
        room = 0
        if len(group) == 1 and not tile:
            items.append(("span", *group[0][0]))
        elif group:
            s0, i0, _ = group[0]
            ranges = [s.key_range(i0 + i, causal, window) for s, i0, m in group for i in range(m)]
            lo, hi = min(a for a, _ in ranges), max(b for _, b in ranges)
            items.append(("block", s0.row, s0.q + i0, len(ranges), lo, hi - lo,
                          [(a - lo, b - lo) for a, b in ranges]))  # fmt: skip
        group.clear()

    for s in spans:
        if window is not None and s.key_range(s.n - 1, causal, None)[1] - s.k > window:
            close()
            tile = min(BLOCK_QUERIES, max(SHORT_SPAN, window))
            for i0 in range(0, s.n, tile):
                group.append((s, i0, min(tile, s.n - i0)))
                close(tile=True)
            continue
        if s.n >= SHORT_SPAN:
            close()
            items.append(("span", *s))
            continue
        if group:
            last, i0, m = group[-1]
            if not (s.row == last.row and s.doc == last.doc and s.q == last.q + i0 + m
                    and room + s.n <= BLOCK_QUERIES):  # fmt: skip
                close()
        group.append((s, 0, s.n))
        room += s.n
    close()
    return items


@pytest.mark.parametrize("window", [None, 1, 3, 40, 300])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_blocks_equal_the_walk_over_every_span(seed: int, causal: bool, window: int | None) -> None:
    rng = random.Random(1000 + seed)
    spans = [s._replace(doc=s.k) for s in _random_spans(rng, rows=rng.randint(1, 3))]
    if window is not None and not causal:
        return  # a window needs causal attention
    table = span_table(spans)
    blocks = plan_blocks(table, span_rules(table, causal, window))
    got = []
    for item in blocks.items:
        if isinstance(item, Span):
            got.append(("span", *item))
            continue
        ranges = list(zip(blocks.starts[item.at : item.at + item.n].tolist(),
                          blocks.ends[item.at : item.at + item.n].tolist(), strict=True))  # fmt: skip
        got.append(("block", item.row, item.q, item.n, item.k, item.width, ranges))
    assert got == _walked_blocks(spans, causal, window)


def _ruled_spans(rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Random spans (a few runs per document, so that their varlen packing stays under its
    bound) each with a random rule of every kind a mask description's pieces have: causal
    (with or without a sliding start), every key of ``[k, end)`` visible, a sliding start with
    a fixed end, a look-ahead window (each query seeing itself)."""
    spans = []
    for row in range(rng.randint(1, 2)):
        q = key = 0
        for _ in range(rng.randint(1, 4)):  # documents
            doc_start = key
            for _ in range(rng.randint(1, 4)):  # this rank's runs in the document
                n = rng.choice([1, 2, 3, SHORT_SPAN - 1, SHORT_SPAN, 40])
                key += rng.randint(0, 3)  # other ranks' tokens in between
                spans.append(Span(row, q, n, doc_start, key, doc_start))
                q, key = q + n, key + n
            key += 8  # the rest of the document (a look-ahead or block reaches into it)
    table = span_table(spans)
    rules = []
    for s in table.tolist():
        n, split = s[2], s[4]
        back = rng.choice([INF, rng.randint(0, 12)])
        kind = rng.choice(["causal", "visible", "sliding", "ahead"])
        if kind == "causal":
            rules.append((split + n, back, 0))
            continue
        end = split + n + rng.randint(0, 6)
        if kind == "visible":
            s[4] = end  # a fully visible span's split is its end
            rules.append((end, INF, INF))
        else:
            rules.append((end, back, INF if kind == "sliding" else rng.randint(1, 5)))
        table[len(rules) - 1] = torch.tensor(s)
    return table, torch.tensor(rules, dtype=torch.int64).view(-1, 3)


def _ruled_pairs(table: torch.Tensor, rules: torch.Tensor) -> set[tuple[int, int, int]]:
    """(row, local query, buffer key) pairs the rules let each query see, query by query."""
    pairs = set()
    for (row, q, n, k, split, _), (end, back, ahead) in zip(
        table.tolist(), rules.tolist(), strict=True
    ):
        for i in range(n):
            own = split + i
            first, last = max(k, own - back), min(end, own + 1 + ahead)
            pairs |= {(row, q + i, key) for key in range(first, last)}
    return pairs


def _blocks_pairs(blocks) -> set[tuple[int, int, int]]:
    """The pairs the loop's items attend: a span alone its prefix and causal square, or all its
    keys; a block what its mask shows."""
    got = set()
    for item, causal in zip(blocks.items, blocks.causal, strict=True):
        if isinstance(item, Block):
            mask = blocks.mask(item, torch.float64)[0, 0]
            got |= {(item.row, item.q + i, item.k + j)
                    for i, j in torch.nonzero(mask == 0).tolist()}  # fmt: skip
        else:
            got |= _visible([item], causal)
    return got


@pytest.mark.parametrize("seed", range(16))
def test_blocks_and_packings_attend_each_querys_rule(seed: int) -> None:
    """Spans of every kind of rule: the loop's blocks attend exactly the pairs the rules say,
    and so do the varlen packings (one per kind they state) with the loop's view of the rest,
    each query in exactly one of them."""
    from cpshard.attention.packing import pack_spans

    rng = random.Random(3000 + seed)
    table, rules = _ruled_spans(rng)
    want = _ruled_pairs(table, rules)
    assert _blocks_pairs(plan_blocks(table, rules)) == want
    local_len = int((table[:, 1] + table[:, 2]).max()) + 1
    key_len = int(torch.maximum(rules[:, 0], table[:, 4] + table[:, 2]).max()) + 1
    rows = int(table[:, 0].max()) + 1
    packed = pack_spans(table, rules, local_len, key_len, rows)
    assert packed is not None
    got, queries = set(), []
    for p in packed.packings:
        for i, flat in enumerate(p.q_rows.tolist()):
            row, q = divmod(flat, local_len)
            queries.append((row, q))
            keys = p.k_rows[int(p.q_first[i]) : int(p.q_last[i]) + 1].tolist()
            got |= {(row, q, key % key_len) for key in keys}
    rest = [int(i) for i in packed.rest]
    if rest:
        got |= _blocks_pairs(plan_blocks(table[rest], rules[rest]))
        queries += [(r, q + i) for r, q, n, *_ in table[rest].tolist() for i in range(n)]
    assert got == want
    assert len(queries) == len(set(queries)) == int(table[:, 2].sum())
