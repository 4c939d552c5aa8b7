"""Runs attended through a per-query key range under one masked kernel call: short runs of one
document together, and long runs whose queries see different key ranges, tile by tile.

A layout such as ``stripe`` gives each rank single-token runs (every W-th token of a document),
and the per-span loop makes one or two kernel calls per span: thousands of tiny calls per layer.
Consecutive short spans of one document in one batch row have consecutive local queries and
keys in one range of the key buffer (in global order), so they form a :class:`Block`: its
queries attend the range under a mask that lets query ``i`` see the keys in
``[starts[i], ends[i])``. A span whose queries' keys do not all start at its first key and end
at themselves (causal) or at its end (every key visible) — a sliding window shorter than its
keys, a mask description's sliding start with a fixed end or look-ahead window — is cut into
tiles of at most ``BLOCK_QUERIES`` queries (a window's size where it is shorter), each over the
keys its queries see (:func:`~cpshard.planning.spans.query_keys`). Exact, and a block's mask is
at most ``BLOCK_QUERIES`` rows by one document's prefix (or one tile's keys), never ``[L, S]``.
Other long spans keep the loop's exact prefix + causal split (a mask would make the kernel
compute the causal half it can skip).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate

import torch

from cpshard.attention.placement import pinned
from cpshard.masks import INF
from cpshard.planning.spans import Span, query_keys, spans_of
from cpshard.ranges import ragged_arange

SHORT_SPAN = 32  # spans with fewer queries are grouped into blocks
BLOCK_QUERIES = 256  # the most queries of one block


@dataclass(frozen=True)
class Block:
    """Local queries ``[q, q + n)`` of batch row ``row`` over the key buffer's ``[k, k + width)``;
    query ``q + i`` sees the range's keys ``[starts[at + i], ends[at + i])`` (of
    :class:`Blocks`)."""

    row: int
    q: int
    n: int
    k: int
    width: int
    at: int


@dataclass(frozen=True)
class Blocks:
    """A step's spans as the loop runs them: long spans alone (``causal[j]``: item ``j``'s
    queries see ``[k, split)`` and causally ``[split, split + n)``, else every key of ``[k,
    split)``), short ones grouped in blocks, cut ones in tiles."""

    items: tuple[Span | Block, ...]
    causal: tuple[bool, ...]  # per item (a block's mask says it all: False)
    starts: torch.Tensor  # int64, every block's per-query first visible key, back to back
    ends: torch.Tensor  # int64, every block's per-query end of visible keys, back to back

    def to(self, device: torch.device) -> Blocks:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Blocks(self.items, self.causal, move(self.starts), move(self.ends))

    def mask(self, b: Block, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, n, width]`` additive mask of block ``b`` (0 visible, -inf hidden)."""
        keys = torch.arange(b.width, device=self.ends.device)[None, :]
        hidden = (keys < self.starts[b.at : b.at + b.n, None]) | (
            keys >= self.ends[b.at : b.at + b.n, None]
        )
        zeros = torch.zeros(b.n, b.width, dtype=dtype, device=self.ends.device)
        return zeros.masked_fill_(hidden, float("-inf"))[None, None]


def plan_blocks(table: torch.Tensor, rules: torch.Tensor) -> Blocks:
    """The loop's view of the spans of ``table`` (:func:`~cpshard.planning.spans.span_table`)
    under their ``rules`` (:func:`~cpshard.planning.spans.query_keys`): consecutive short spans
    of one document and row grouped greedily into blocks of at most ``BLOCK_QUERIES`` queries,
    cut spans tiled, long spans alone (host work, once per step: whole-tensor work plus a walk
    over the items, never over every span)."""
    if table.shape[0] == 0:
        empty = torch.zeros(0, dtype=torch.int64)
        return Blocks((), (), empty, empty)
    row, q, n, k, split, doc = table.unbind(1)
    end, back, ahead = rules.unbind(1)
    causal = ahead == 0
    from_k = split + n - 1 - back <= k  # every query's keys start at k
    to_end = split + 1 + ahead >= end  # every query sees up to the span's end
    cut = ~(from_k & (causal | to_end))
    short = ~cut & (n < SHORT_SPAN)
    joins = torch.zeros_like(short)  # a short span continuing the previous one's block
    joins[1:] = (
        short[1:]
        & short[:-1]
        & (row[1:] == row[:-1])
        & (doc[1:] == doc[:-1])
        & (q[1:] == q[:-1] + n[:-1])
    )
    heads = torch.nonzero(~joins).flatten().tolist()  # cut, long, or a chain of short spans
    count = table.shape[0]
    is_short, is_cut, sizes = short.tolist(), cut.tolist(), n.tolist()
    # a cut span's tiles: a window's size of queries (at least SHORT_SPAN), at most BLOCK_QUERIES
    tiles = torch.where(back < INF, (back + 1).clamp(SHORT_SPAN, BLOCK_QUERIES), BLOCK_QUERIES)
    tile = tiles.tolist()
    total = [0, *accumulate(sizes)]  # queries before each span

    # Items in span order: ("span", index) or ("group", group index); a group is the spans
    # [first, end) whole, or one tile (first, offset, queries) of a cut span.
    items: list[tuple[bool, int]] = []  # (is a group, span or group index)
    groups: list[tuple[int, int, int, int]] = []  # (first span, end span, offset, queries)
    for h, head in enumerate(heads):
        if is_cut[head]:
            for i0 in range(0, sizes[head], tile[head]):
                items.append((True, len(groups)))
                groups.append((head, head + 1, i0, min(tile[head], sizes[head] - i0)))
        elif not is_short[head]:
            items.append((False, head))
        else:
            stop_at = heads[h + 1] if h + 1 < len(heads) else count
            first = head
            while first < stop_at:  # greedy: each block takes spans while they fit
                stop = bisect_right(total, total[first] + BLOCK_QUERIES, first + 1, stop_at + 1)
                stop -= 1
                if stop - first == 1:
                    items.append((False, first))
                else:
                    items.append((True, len(groups)))
                    groups.append((first, stop, 0, total[stop] - total[first]))
                first = stop
    blocks, starts, ends = _group_blocks(table, rules, groups)
    alone = [i for is_group, i in items if not is_group]
    # a span alone sees [k, split) and, causal, [split, split + n); else every key to its end
    whole = table[alone].clone()
    whole[:, 4] = torch.where(causal[alone], split[alone], end[alone])
    single = dict(zip(alone, spans_of(whole), strict=True))
    flags = dict(zip(alone, causal[alone].tolist(), strict=True))
    resolved = tuple(blocks[i] if is_group else single[i] for is_group, i in items)
    kinds = tuple(False if is_group else flags[i] for is_group, i in items)
    return Blocks(resolved, kinds, pinned(starts), pinned(ends))


def _group_blocks(
    table: torch.Tensor, rules: torch.Tensor, groups: list[tuple[int, int, int, int]]
) -> tuple[list[Block], torch.Tensor, torch.Tensor]:
    """Every group's :class:`Block` and the per-query first and end keys of all of them, back to
    back (relative to each block's first key)."""
    if not groups:
        empty = torch.zeros(0, dtype=torch.int64)
        return [], empty, empty
    first, end, offset, queries = torch.tensor(groups, dtype=torch.int64).unbind(1)
    members = end - first
    span = ragged_arange(first, members)  # each group's spans, group by group
    gid = torch.repeat_interleave(torch.arange(len(groups)), members)
    tiled = members == 1  # a one-span group: a tile, or a whole short span (offset 0)
    i0 = offset[gid]
    n = torch.where(tiled[gid], queries[gid], table[span, 2])
    per_query = int(n.sum())
    # query index within its span of every query, group by group
    i = ragged_arange(i0, n)
    gid, span = (torch.repeat_interleave(t, n, output_size=per_query) for t in (gid, span))
    first_key, end_key = query_keys(table, rules, span, i)
    count = len(groups)
    low = torch.zeros(count, dtype=torch.int64).scatter_reduce_(
        0, gid, first_key, "amin", include_self=False
    )
    high = torch.zeros(count, dtype=torch.int64).scatter_reduce_(
        0, gid, end_key, "amax", include_self=False
    )
    at = torch.cumsum(queries, 0) - queries
    head_row = table[first, 0].tolist()
    head_q = (table[first, 1] + offset).tolist()
    blocks = [
        Block(r, q0, m, lo, hi - lo, a)
        for r, q0, m, lo, hi, a in zip(
            head_row, head_q, queries.tolist(), low.tolist(), high.tolist(), at.tolist(),
            strict=True,
        )
    ]  # fmt: skip
    return blocks, first_key - low[gid], end_key - low[gid]
