"""The step's planners (cpshard.planning) against a brute-force, per-position statement of the
same plans: every rank's needed rows as a ``[B, P]`` mask, sorted by owner, counted one rank at a
time. The fast planners must give the very same plans, byte for byte, on fuzzed batches (documents,
padding, several rows, windows, every layout, small and large W)."""

from __future__ import annotations

import random

import pytest
import torch

from cpshard.batch.runs import run_starts
from cpshard.layouts import make_layout
from cpshard.masks import INF, MaskDescription
from cpshard.planning import layout_runs, plan_halo, plan_needed_rows
from cpshard.planning.spans import Span, query_keys, span_table
from cpshard.ranges import ragged_arange

LAYOUTS = ("contiguous", "head_tail", "stripe", "per_document_head_tail", "balanced")


def document_starts(doc: torch.Tensor) -> torch.Tensor:
    """``[B, P]``: where each token's run of one id starts."""
    new = run_starts(doc, torch.ones_like(doc, dtype=torch.bool))
    pos = torch.arange(doc.shape[1]).expand_as(doc)
    return torch.cummax(torch.where(new, pos, 0), dim=1).values


def rank_runs(idx: torch.Tensor, doc: torch.Tensor, starts: torch.Tensor) -> tuple:
    """One rank's runs (row, first local index, length, document start, first position)."""
    b, length = idx.shape
    st = starts.gather(1, idx)
    new = torch.ones_like(idx, dtype=torch.bool)
    new[:, 1:] = (idx[:, 1:] != idx[:, :-1] + 1) | (st[:, 1:] != st[:, :-1])
    head = torch.cummax(torch.where(new, torch.arange(length), 0), dim=1).values
    flat = (torch.arange(b)[:, None] * length + head)[doc.gather(1, idx) != 0]
    heads, n = torch.unique_consecutive(flat, return_counts=True)
    row, q = heads // length, heads % length
    return row, q, n, st[row, q], idx[row, q]


def _cover(shape, row, lo, hi) -> torch.Tensor:
    delta = torch.zeros(shape[0], shape[1] + 1, dtype=torch.int64)
    ones = torch.ones_like(row)
    delta.index_put_((row, lo), ones, accumulate=True)
    delta.index_put_((row, hi), -ones, accumulate=True)
    return delta.cumsum(1)[:, : shape[1]] > 0


def reference_exchange(layout, doc: torch.Tensor, me: int, needs: list[torch.Tensor]) -> dict:
    """Rank ``me``'s tables and every rank's counts when rank r needs the positions ``needs[r]``
    (``[B, P]`` bool), received grouped by owner, each owner's in global order."""
    b, padded = doc.shape
    world = layout.world_size
    length = padded // world
    inv = layout.rank_major_inverse().to(torch.int64).expand(b, padded)
    owner, slot = inv // max(length, 1), inv % max(length, 1)
    counts, sends, out = [], [], {}
    for r, need in enumerate(needs):
        pb, pp = torch.nonzero(need, as_tuple=True)
        order = torch.sort(owner[pb, pp], stable=True).indices
        pb, pp = pb[order], pp[order]
        src = owner[pb, pp]
        counts.append(torch.bincount(src, minlength=world).tolist())
        sends.append((pb * length + slot[pb, pp])[src == me])
        if r == me:
            width = int(need.sum(1).max()) if b else 0
            out["recv_rows"] = pb * width + (need.cumsum(1) - 1)[pb, pp]
            out["buffer_len"] = width
    out.update(
        send_rows=torch.cat(sends),
        send_counts=tuple(row[me] for row in counts),
        recv_counts=tuple(counts[me]),
        received=tuple(sum(row) - row[r] for r, row in enumerate(counts)),
        sent=tuple(sum(counts[q][r] for q in range(world) if q != r) for r in range(world)),
    )
    return out


def reference_needed_rows(rank, layout, doc, causal, window=None) -> dict:
    """Every rank's needed positions as a mask, one rank at a time (the plan's definition)."""
    b, padded = doc.shape
    world = layout.world_size
    length = padded // world
    starts = document_starts(doc)
    ends = padded - document_starts(doc.flip(1)).flip(1)
    reach, needs, spans = 0, [], None
    for r in range(world):
        idx = layout.indices(r).to(torch.int64).expand(b, length)
        row, q, n, ds, begin = rank_runs(idx, doc, starts)
        end = begin + n if causal else ends[row, begin]
        lo = ds if window is None else torch.maximum(ds, begin - window + 1)
        reach = max(reach, int((end - ds).max()) if n.numel() else 0)
        needs.append(_cover((b, padded), row, lo, end))
        if r == rank:
            at = needs[-1].cumsum(1) - 1
            split = at[row, begin] if causal else at[row, end - 1] + 1
            cols = (row, q, n, at[row, lo], split, ds)
            spans = span_table([Span(*v) for v in zip(*(t.tolist() for t in cols), strict=True)])
    return {"spans": spans, "reach": reach, **reference_exchange(layout, doc, rank, needs)}


def reference_halo(rank, world, doc, window=None) -> tuple:
    b, padded = doc.shape
    local = padded // world
    starts = document_starts(doc)
    halos, reach, mine = [], 0, ()
    for r in range(world):
        idx = torch.arange(r * local, (r + 1) * local).expand(b, local)
        row, q, n, ds, begin = rank_runs(idx, doc, starts)
        first = q == 0
        back = int((r * local - ds[first]).max()) if bool(first.any()) else 0
        halos.append(back if window is None else min(back, window - 1))
        reach = max(reach, int((begin + n - ds).max()) if n.numel() else 0)
        if r == rank:
            mine = tuple(zip(*(t.tolist() for t in (row, begin, n, ds)), strict=True))
    return tuple(halos), mine, reach


def fuzzed_doc_ids(rng: random.Random, rows: int, seq_len: int) -> torch.Tensor:
    """``[rows, seq_len]`` document ids: runs of random (often long-tailed) lengths, padding
    runs at the start, middle or end, ids reused across rows and sometimes adjacent."""
    out = []
    for _ in range(rows):
        row, next_id = [], 1
        while len(row) < seq_len:
            n = min(seq_len - len(row), max(1, int(rng.paretovariate(1.1)) if rng.random() < 0.7
                                            else rng.randint(1, seq_len)))  # fmt: skip
            pad = rng.random() < 0.15
            row.extend([0 if pad else next_id] * n)
            if not pad and rng.random() < 0.9:
                next_id += 1
        out.append(row)
    return torch.tensor(out, dtype=torch.int64)


def _cases(seed: int, count: int, worlds: tuple[int, ...], max_len: int):
    rng = random.Random(seed)
    for _ in range(count):
        world = rng.choice(worlds)
        layout_name = rng.choice(LAYOUTS)
        rows = rng.choice((1, 1, 2, 3))
        seq_len = rng.randint(0 if rng.random() < 0.05 else 1, max_len)
        doc = fuzzed_doc_ids(rng, rows, seq_len) if seq_len else torch.zeros(rows, 0, dtype=torch.int64)
        window = rng.choice((None, None, 1, 2, rng.randint(1, max(1, seq_len))))
        yield world, layout_name, doc, window


def _padded(layout, doc: torch.Tensor) -> torch.Tensor:
    extra = layout.padded_seq_len - doc.shape[1]
    return torch.cat([doc, doc.new_zeros(doc.shape[0], extra)], dim=1)


def _check_needed_rows(world, layout_name, doc, window) -> None:
    layout = make_layout(layout_name, world, doc.shape[1], doc_ids=doc)
    padded = _padded(layout, doc)
    runs = layout_runs(layout, padded)
    for causal in (True, False):
        w = window if causal else None
        for rank in sorted({0, world - 1, world // 2}):
            got = plan_needed_rows(rank, runs, causal, w)
            want = reference_needed_rows(rank, layout, padded, causal, w)
            where = f"{layout_name} W={world} rank {rank} causal={causal} window={w} doc={padded.tolist()}"
            for name, value in want.items():
                mine = getattr(got, name)
                if isinstance(value, torch.Tensor):
                    assert mine.dtype == torch.int64 and torch.equal(mine, value), (name, where)
                else:
                    assert mine == value, (name, where)


@pytest.mark.parametrize("seed", range(6))
def test_needed_rows_equal_the_per_position_plan(seed: int) -> None:
    for case in _cases(seed, 40, (1, 2, 3, 4, 5, 6, 7, 8), 64):
        _check_needed_rows(*case)


def test_needed_rows_equal_the_per_position_plan_at_large_world() -> None:
    for case in _cases(100, 12, (16, 32, 64, 128), 512):
        _check_needed_rows(*case)


@pytest.mark.parametrize("seed", range(3))
def test_halo_equals_the_per_position_plan(seed: int) -> None:
    for world, _, doc, window in _cases(seed + 50, 60, (1, 2, 3, 4, 7, 8, 32), 96):
        layout = make_layout("contiguous", world, doc.shape[1])
        padded = _padded(layout, doc)
        runs = layout_runs(layout, padded)
        for rank in range(world):
            got = plan_halo(rank, runs, window)
            assert (got.halos, got.runs, got.reach) == reference_halo(rank, world, padded, window)


def test_degenerate_batches() -> None:
    """All padding, one-token documents, a single long document, P == W."""
    for world in (1, 2, 4):
        for doc in (
            torch.zeros(2, 8, dtype=torch.int64),
            torch.arange(1, 9)[None],
            torch.ones(1, 16, dtype=torch.int64),
            torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0]]),
            torch.arange(1, world + 1)[None],
        ):
            for layout_name in LAYOUTS:
                _check_needed_rows(world, layout_name, doc, None)
                _check_needed_rows(world, layout_name, doc, 2)


def reference_node_orders(layout, nodes: int, per_node: int) -> tuple[list, list]:
    """Each node's shards gathered rank-major and sorted: the union in global order and the
    sort's permutation (None where it is the identity)."""
    unions, orders = [], []
    for e in range(nodes):
        gathered = torch.cat(
            [layout.indices(e * per_node + i).to(torch.int64) for i in range(per_node)], dim=-1
        )
        ascending, order = torch.sort(gathered, dim=-1, stable=True)
        unions.append(ascending)
        same = bool(torch.equal(order, torch.arange(order.shape[-1]).expand_as(order)))
        orders.append(None if same else order)
    return unions, orders


def test_head_parallel_node_layouts_equal_the_sorted_union() -> None:
    from cpshard.planning import node_layout

    rng = random.Random(7)
    for _ in range(150):
        nodes, per_node = rng.choice(((1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 3), (3, 2), (1, 8)))
        world = nodes * per_node
        name = rng.choice(LAYOUTS)
        doc = fuzzed_doc_ids(rng, rng.choice((1, 2, 3)), rng.randint(1, 60))
        layout = make_layout(name, world, doc.shape[1], doc_ids=doc)
        merged, orders = node_layout(layout, nodes, per_node)
        unions, want = reference_node_orders(layout, nodes, per_node)
        for e in range(nodes):
            got = orders[e]
            assert (got is None) == (want[e] is None) and (got is None or torch.equal(got, want[e]))
            if not layout.contiguous_shards:  # one row's union may be held as [L] or [1, L]
                assert torch.equal(*torch.broadcast_tensors(merged.indices(e), unions[e]))


def test_runs_equal_the_pass_over_every_position() -> None:
    """Every rank's runs, from the layout's pieces (a planned layout's own, contiguous shards'
    from the sizes, others' read from the positions) or the stripe's closed form, equal a pass
    over every position of every rank."""
    for world, name, doc, _ in _cases(77, 80, (1, 2, 3, 4, 8, 32), 96):
        layout = make_layout(name, world, doc.shape[1], doc_ids=doc)
        padded = _padded(layout, doc)
        runs = layout_runs(layout, padded)
        starts = document_starts(padded)
        ends = padded.shape[1] - document_starts(padded.flip(1)).flip(1)
        b, length = padded.shape[0], layout.padded_seq_len // world
        for rank in range(world):
            row, q, n, ds, begin = rank_runs(layout.indices(rank).expand(b, length), padded, starts)
            want = (row, q, n, ds, begin, ends[row, begin])
            got = runs.of_rank(rank)
            assert all(torch.equal(a, c) for a, c in zip(got, want, strict=True)), (name, world)
        mine = [torch.full_like(c[0], r) for r, c in enumerate(map(runs.of_rank, range(world)))]
        every = [torch.cat(c) for c in zip(*map(runs.of_rank, range(world)), strict=True)]
        want = (torch.cat(mine), every[0], every[1], every[2], every[3], every[4], every[5])
        assert all(torch.equal(a, c) for a, c in zip(runs.columns, want, strict=True)), name


def test_zigzag_closed_form_answers_as_the_runs_do() -> None:
    """The per-document zig-zag's chunk table (used whenever the layout's pieces are the deal of
    its documents) answers every question of the planners as the runs and their search do: a
    rank's runs, token counts, merged key intervals with windows, served counts, the whole
    needed-rows plan without a window (its closed-form exchange, row tables included), and
    positions below any position, for every rank and row, with a num_chunks of 2W and 4W."""
    from cpshard.planning.needed_rows import _merge, _served
    from cpshard.planning.runs import LayoutRuns

    rng = random.Random(31)
    used = 0
    for world, _, doc, window in _cases(31, 60, (1, 2, 3, 4, 8, 32), 160):
        # long rows of few documents count served rows at chunk bounds, others per position
        chunks = world * rng.choice((2, 2, 4))
        layout = make_layout(
            "per_document_head_tail", world, doc.shape[1], doc_ids=doc, num_chunks=chunks
        )
        padded = _padded(layout, doc)
        closed = layout_runs(layout, padded)
        assert closed.closed is not None, "the layout's own pieces must match its deal"
        used += 1
        plain = LayoutRuns(world, padded.shape[0], padded.shape[1], layout, padded)
        for rank in range(world):
            got, want = closed.of_rank(rank), plain.of_rank(rank)
            assert all(torch.equal(a, c) for a, c in zip(got, want, strict=True)), (world, rank)
        assert torch.equal(closed.tokens(), plain.tokens())
        for causal in (True, False):
            for w in {None, window}:
                _, row, lo, hi = _merge(*plain.intervals(causal, w))
                assert torch.equal(_served(closed, row, lo, hi), _served(plain, row, lo, hi))
                if w is not None:
                    assert all(
                        torch.equal(a, c)
                        for a, c in zip(_merge(*closed.intervals(causal, w)),
                                        _merge(*plain.intervals(causal, w)), strict=True)
                    ), (world, causal, w)  # fmt: skip
            for rank in range(world):  # the closed-form exchange against the intervals'
                got, want = (plan_needed_rows(rank, r, causal) for r in (closed, plain))
                for name in ("spans", "send_rows", "recv_rows"):
                    assert torch.equal(getattr(got, name), getattr(want, name)), (name, rank)
                for name in ("buffer_len", "send_counts", "recv_counts", "received", "sent"):
                    assert getattr(got, name) == getattr(want, name), (name, world, rank)
        b, p = padded.shape
        n = 200
        rank = torch.randint(0, world, (n,))
        row = torch.randint(0, b, (n,))
        position = torch.randint(0, p + 1, (n,))
        assert torch.equal(
            closed.prefix.before(rank, row, position), plain.prefix.before(rank, row, position)
        )
        assert torch.equal(
            closed.prefix.every_before(row, position), plain.prefix.every_before(row, position)
        )
        for r in sorted({0, world // 2, world - 1}):
            many = b * (p + 1) // n + 1  # a lookup per position: read from a running count
            for lookups in (row, row.repeat(many)):
                at = position.repeat(lookups.numel() // n)
                assert torch.equal(
                    closed.prefix.before_on(r, lookups, at), plain.prefix.before_on(r, lookups, at)
                )
        if p:
            slot = torch.randint(0, p // world, (n,))
            assert torch.equal(closed.position(rank, row, slot), plain.position(rank, row, slot))
    assert used


def test_zigzag_closed_form_is_not_used_for_other_pieces() -> None:
    """A layout named ``per_document_head_tail`` whose positions are not the deal of its
    documents is planned from its positions, exactly."""
    from cpshard.layouts import ShardLayout

    doc = torch.tensor([[1, 1, 1, 1, 1, 2, 2, 2]])
    pieces = ((torch.tensor([0, 4]), torch.tensor([4, 4]), torch.tensor([0, 1])),)
    layout = ShardLayout("per_document_head_tail", 2, 8, 8, num_chunks=4, owner_pieces=pieces)
    runs = layout_runs(layout, doc)
    assert runs.closed is None
    for rank in range(2):
        got = plan_needed_rows(rank, runs, True)
        want = reference_needed_rows(rank, layout, doc, True)
        assert torch.equal(got.spans, want["spans"]) and got.recv_counts == want["recv_counts"]
    # a layout planned for other documents: its table is not taken for these
    other = torch.tensor([[1, 1, 2, 2, 2, 2, 2, 2]])
    layout = make_layout("per_document_head_tail", 2, 8, doc_ids=other)
    assert layout_runs(layout, other).closed is not None
    runs = layout_runs(layout, doc)
    for rank in range(2):
        got = plan_needed_rows(rank, runs, True)
        want = reference_needed_rows(rank, layout, doc, True)
        assert torch.equal(got.spans, want["spans"]) and got.recv_counts == want["recv_counts"]
        assert got.send_counts == want["send_counts"] and got.received == want["received"]


# ---------------------------------------------------------------- plans from a mask description


def fuzzed_block_ids(rng: random.Random, doc: torch.Tensor) -> torch.Tensor:
    """``[B, P]`` block ids (-1 outside a block): random runs, each id used once per row."""
    out = torch.full_like(doc, -1)
    for r in range(doc.shape[0]):
        p, next_id = 0, 0
        while p < doc.shape[1]:
            n = rng.randint(1, max(1, doc.shape[1] // 3))
            if rng.random() < 0.5:
                out[r, p : p + n] = next_id
                next_id += 1
            p += n
    return out


def prefix_ids(doc: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """Block 0 on the first few tokens of every document (a prefix-LM's prefix), else -1."""
    pos = torch.arange(doc.shape[1]).expand_as(doc)
    into = pos - document_starts(doc)
    return torch.where((doc != 0) & (into < rng.randint(1, 6)), 0, -1)


def fuzzed_masks(rng: random.Random, doc: torch.Tensor) -> list[tuple[str, MaskDescription]]:
    """Descriptions of every kind of piece: chunked causal and bidirectional chunks, image
    blocks and a prefix over causal attention, plain causal and bidirectional, a causal sliding
    window, image blocks over causal attention under a sliding window (a sliding start with a
    fixed end) and a look-ahead window (``|q - k| <= W``, and one that looks ahead less)."""
    causal = MaskDescription.within_documents(doc, ahead=0)
    size = rng.randint(1, 9)
    chunks = MaskDescription.chunks(doc, size)
    window, ahead = rng.randint(1, 6), rng.randint(1, 4)
    out = [
        (f"chunks({size}) & causal", chunks.intersect(causal)),
        (f"chunks({size})", chunks),
        ("causal", causal),
        ("bidirectional", MaskDescription.within_documents(doc)),
        (f"window({window})", MaskDescription.within_documents(doc, back=window - 1, ahead=0)),
        (f"|q-k| <= {window}", MaskDescription.within_documents(doc, back=window, ahead=window)),
        (f"ahead({ahead}) back({window})",
         MaskDescription.within_documents(doc, back=window, ahead=ahead)),
    ]  # fmt: skip
    for name, ids in (("blocks", fuzzed_block_ids(rng, doc)), ("prefix", prefix_ids(doc, rng))):
        blocks = MaskDescription.blocks(doc, ids)
        assert blocks is not None
        union = causal.union(blocks)
        assert union is not None
        out.append((f"causal | {name}", union))
        sliding = MaskDescription.within_documents(doc, back=window - 1)
        out.append((f"(causal | {name}) & window({window})", union.intersect(sliding)))
    return out


def reference_mask_plan(rank: int, layout, doc: torch.Tensor, mask: MaskDescription) -> dict:
    """The needed rows of every rank from the dense mask: a position is needed when one of the
    rank's queries sees it; tables and counts as :func:`reference_exchange` lists them."""
    dense = mask.dense()
    b, padded = doc.shape
    length = padded // layout.world_size
    needs = []
    for r in range(layout.world_size):
        idx = layout.indices(r).to(torch.int64).expand(b, length)
        needs.append(torch.stack([dense[i, idx[i]].any(0) for i in range(b)]))  # [B, P]
        if r == rank:
            queries = idx
    out = reference_exchange(layout, doc, rank, needs)
    out.update(
        need=needs[rank], queries=queries, reach=int(dense.sum(-1).max()) if dense.numel() else 0
    )
    return out


def _check_mask_spans(got, want: dict, dense: torch.Tensor, doc: torch.Tensor, where: str) -> None:
    """Every query of the rank's documents is in one span, and the buffer keys its span lets it
    see are, in global positions, exactly the keys the dense mask lets it see (needed positions
    ascend in the buffer: a query's keys are its range of buffer rows when they are all needed,
    as many, from its first to its last)."""
    need, idx = want["need"], want["queries"]
    row, q, n, k, split, _ = got.spans.unbind(1)
    at = torch.arange(n.numel()).repeat_interleave(n)
    i = ragged_arange(torch.zeros_like(n), n)
    row, q = row[at], q[at] + i
    first, end = query_keys(got.spans, got.rules, at, i)
    assert torch.equal(got.causal, got.rules[:, 2] == 0), where
    seen = torch.zeros_like(idx).index_put_((row, q), torch.ones_like(q), accumulate=True)
    assert torch.equal(seen, (doc.gather(1, idx) != 0).to(torch.int64)), where
    visible = dense[row, idx[row, q]]  # [queries, P]
    buffer = (need.cumsum(1) - 1)[row]
    assert not bool((visible & ~need[row]).any()), where
    assert torch.equal(visible.sum(1), end - first), where
    big = doc.shape[1] + 1
    lowest = torch.where(visible, buffer, big).min(1).values if visible.numel() else first
    highest = torch.where(visible, buffer, -1).max(1).values if visible.numel() else end - 1
    some = end > first
    assert torch.equal(lowest[some], first[some]) and torch.equal(highest[some], end[some] - 1), where


def _check_mask_plans(
    world: int, layout_name: str, doc: torch.Tensor, rng: random.Random, masks=None
) -> None:
    layout = make_layout(layout_name, world, doc.shape[1], doc_ids=doc)
    padded = _padded(layout, doc)
    runs = layout_runs(layout, padded)
    for name, mask in masks(padded) if masks else fuzzed_masks(rng, padded):
        dense = mask.dense()
        for rank in sorted({0, world - 1, world // 2}):
            got = plan_needed_rows(rank, runs, mask=mask)
            want = reference_mask_plan(rank, layout, padded, mask)
            where = f"{name} {layout_name} W={world} rank {rank} doc={padded.tolist()}"
            for field_name, value in want.items():
                if field_name in ("need", "queries"):
                    continue
                mine = getattr(got, field_name)
                if isinstance(value, torch.Tensor):
                    assert torch.equal(mine, value), (field_name, where)
                else:
                    assert mine == value, (field_name, where)
            _check_mask_spans(got, want, dense, padded, where)
            if name in ("causal", "bidirectional") or name.startswith("window"):
                causal = name != "bidirectional"  # today's plans, byte for byte
                window = int(name[7:-1]) if name.startswith("window") else None
                plain = plan_needed_rows(rank, runs, causal, window)
                assert torch.equal(got.spans, plain.spans), where
                assert bool((got.causal == causal).all()), where
                same = ("send_rows", "recv_rows", "buffer_len", "reach")  # a window's reach:
                for field_name in same[: 3 if window else 4]:  # the description's, not today's
                    assert torch.equal(
                        torch.as_tensor(getattr(got, field_name)),
                        torch.as_tensor(getattr(plain, field_name)),
                    ), (field_name, where)


@pytest.mark.parametrize("seed", range(2))
def test_mask_plans_equal_the_dense_mask(seed: int) -> None:
    rng = random.Random(seed + 700)
    for world, layout_name, doc, _ in _cases(seed + 700, 15, (1, 2, 3, 4, 5, 6, 7, 8), 32):
        _check_mask_plans(world, layout_name, doc, rng)


def test_mask_plans_equal_the_dense_mask_at_large_world() -> None:
    rng = random.Random(800)
    for world, layout_name, doc, _ in _cases(800, 3, (16, 32, 64), 128):
        _check_mask_plans(world, layout_name, doc, rng)


def test_mask_halo_equals_the_dense_mask() -> None:
    """Contiguous shards, causal pieces (sliding windows among them): each rank's halo reaches
    its queries' first keys, and each piece's queries see from its first key (or their
    window's start) up to themselves, as the dense mask says."""
    rng = random.Random(900)
    for world, _, doc, _ in _cases(900, 20, (1, 2, 3, 4, 7, 8), 40):
        layout = make_layout("contiguous", world, doc.shape[1])
        padded = _padded(layout, doc)
        runs = layout_runs(layout, padded)
        local = padded.shape[1] // world
        causal = MaskDescription.within_documents(padded, ahead=0)
        chunked = MaskDescription.chunks(padded, rng.randint(1, 9)).intersect(causal)
        window = rng.randint(1, 6)
        windowed = MaskDescription.within_documents(padded, back=window - 1, ahead=0)
        for mask in (causal, chunked, windowed, chunked.intersect(windowed)):
            dense = mask.dense()
            keys = torch.arange(padded.shape[1])
            first_key = torch.where(dense, keys, padded.shape[1]).min(-1).values  # [B, P]
            for rank in range(world):
                got = plan_halo(rank, runs, mask=mask)
                for r in range(world):
                    mine = first_key[:, r * local : (r + 1) * local]
                    want = max(0, r * local - int(mine.min())) if mine.numel() else 0
                    assert got.halos[r] == want, (r, padded.tolist())
                covered = torch.zeros_like(padded)
                pieces = zip(got.runs, got.firsts, got.backs, strict=True)
                for (row, begin, n, _), first, back in pieces:
                    for i in range(n):
                        covered[row, begin + i] += 1
                        want_keys = torch.nonzero(dense[row, begin + i]).flatten()
                        since = max(first, begin + i - back)
                        assert torch.equal(want_keys, torch.arange(since, begin + i + 1))
                mine = padded[:, rank * local : (rank + 1) * local] != 0
                assert torch.equal(covered[:, rank * local : (rank + 1) * local], mine.long())
                assert covered.sum() == mine.sum()
            if mask is causal or mask is windowed:
                for rank in range(world):
                    got = plan_halo(rank, runs, mask=mask)
                    plain = plan_halo(rank, runs, None if mask is causal else window)
                    assert (got.halos, got.runs) == (plain.halos, plain.runs)
                    assert mask is windowed or got.reach == plain.reach  # a window's: its own


def test_mask_plans_refuse_what_the_attention_cannot_execute() -> None:
    """A query that sees nothing (or not itself) and a description of another batch are
    refused, never planned."""
    doc = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0]])
    layout = make_layout("head_tail", 2, 8)
    runs = layout_runs(layout, doc)
    image = torch.tensor([[-1, 0, 0, -1, -1, 1, 1, -1]])
    for mask, what in (
        (MaskDescription.blocks(doc, image), "does not see itself"),
        (MaskDescription.within_documents(doc[:, :6], ahead=0), "batch"),
    ):
        with pytest.raises(ValueError, match=what):
            plan_needed_rows(0, runs, mask=mask)
    causal = MaskDescription.within_documents(doc, ahead=0)
    for kwargs in ({}, {"causal": True, "mask": causal}, {"window": 2, "mask": causal}):
        with pytest.raises(ValueError, match="causal .* or a mask"):
            plan_needed_rows(0, runs, **kwargs)
    contiguous = layout_runs(make_layout("contiguous", 2, 8), doc)
    with pytest.raises(ValueError, match="window or a mask"):
        plan_halo(0, contiguous, 2, mask=causal)
    with pytest.raises(ValueError, match="causal pieces only"):
        plan_halo(0, layout_runs(make_layout("contiguous", 2, 8), doc), mask=MaskDescription.within_documents(doc))


def test_mask_plans_merge_ranges_that_do_not_ascend() -> None:
    """A piece whose range holds a later piece's (a fully visible head before causal queries of
    one document): the rank needs the union, not the ranges in run order."""

    def masks(padded: torch.Tensor) -> list[tuple[str, MaskDescription]]:
        cols = ([0, 0], [0, 2], [2, 12], [0, 0], [12, 12], [0, 2], [INF, INF], [12, 12], [INF, 0])
        one = MaskDescription(1, padded.shape[1], *(torch.tensor(c) for c in cols))
        return [("head sees the document", one)]

    doc = torch.tensor([[1] * 12])
    for world in (2, 3):
        for layout_name in LAYOUTS:
            _check_mask_plans(world, layout_name, doc, random.Random(0), masks)


def test_cyclic_interval_counts_equal_a_rank_by_rank_count() -> None:
    """The counts over cyclic intervals of ranks the per-document zig-zag's closed forms sum
    (membership, ranks below a rank, weighted covers by group, lines on the intervals' ranks,
    ranks on one side) against a rank-by-rank count, wrapping and empty intervals included."""
    from cpshard.planning.cyclic import (
        below_counts, count_below, cyclic_cover, cyclic_ramps, in_cyclic,
    )  # fmt: skip

    rng = random.Random(5)
    for _ in range(40):
        world = rng.randint(1, 9)
        n = rng.randint(0, 12)
        start = torch.tensor([rng.randrange(world) for _ in range(n)], dtype=torch.int64)
        count = torch.tensor([rng.randint(0, world) for _ in range(n)], dtype=torch.int64)
        weight = torch.randint(-3, 5, (n,))
        group = torch.randint(0, 3, (n,))
        base, slope, wrap_base = (torch.randint(-5, 6, (n,)) for _ in range(3))
        member = torch.zeros(n, world, dtype=torch.bool)
        wrapped = torch.zeros(n, world, dtype=torch.bool)
        for i in range(n):
            for k in range(int(count[i])):
                r = (int(start[i]) + k) % world
                member[i, r] = True
                wrapped[i, r] = r < int(start[i])
        assert torch.equal(in_cyclic(start, count, world), member)
        for rank in range(world + 1):
            below = member[:, :rank].sum(1)
            assert torch.equal(count_below(start, count, world, rank), below)
        cover = torch.zeros(3, world, dtype=torch.int64)
        for i in range(n):
            cover[int(group[i])] += weight[i] * member[i]
        assert torch.equal(cyclic_cover(start, count, world, weight, group, 3), cover)
        line = torch.where(wrapped, wrap_base[:, None], base[:, None]) + slope[:, None] * torch.arange(world)
        assert torch.equal(cyclic_ramps(start, count, world, base, slope, wrap_base),
                           (line * member).sum(0))  # fmt: skip
        total = member.sum(0)
        assert torch.equal(below_counts(total, True), torch.cumsum(total, 0))
        assert torch.equal(below_counts(total, False), total.flip(0).cumsum(0).flip(0))


def test_stripe_closed_form_exchange_equals_the_runs() -> None:
    """The stripe layout's exchange without a window (counted in closed form per document,
    row tables made from the documents) equals the one planned from every rank's runs, for
    every rank, causal and bidirectional, short and full documents, several rows."""
    from cpshard.planning.runs import LayoutRuns

    for world, _, doc, _ in _cases(41, 50, (2, 3, 4, 5, 8, 16, 32), 200):
        layout = make_layout("stripe", world, doc.shape[1])
        padded = _padded(layout, doc)
        closed = layout_runs(layout, padded)
        assert closed.closed is not None
        plain = LayoutRuns(world, padded.shape[0], padded.shape[1], layout, padded)
        for causal in (True, False):
            for rank in range(world):
                got, want = (plan_needed_rows(rank, r, causal) for r in (closed, plain))
                for name in ("spans", "send_rows", "recv_rows"):
                    assert torch.equal(getattr(got, name), getattr(want, name)), (name, rank)
                for name in ("buffer_len", "send_counts", "recv_counts", "received", "sent"):
                    assert getattr(got, name) == getattr(want, name), (name, world, rank)
