"""Runs attended through a per-query key range under one masked kernel call: short runs of one
document together, and long runs a sliding window cuts, tile by tile.

A layout such as ``stripe`` gives each rank single-token runs (every W-th token of a document),
and the per-span loop makes one or two kernel calls per span: thousands of tiny calls per layer.
Consecutive short spans of one document in one batch row have consecutive local queries and
keys in one range of the key buffer (in global order), so they form a :class:`Block`: its
queries attend the range under a mask that lets query ``i`` see the keys in
``[starts[i], ends[i])``. A windowed span whose window is shorter than its keys (query ``i``
sees only the window's last keys) is cut into blocks of at most ``window`` queries, each over
the keys its queries' windows cover. Exact, and a block's mask is at most ``BLOCK_QUERIES`` rows
by one document's prefix (or one tile's windows), never ``[L, S]``. Other long spans keep the
loop's exact prefix + causal split (a mask would make the kernel compute the causal half it can
skip).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard.attention.placement import pinned
from cpshard.planning.spans import Span

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
    """A step's spans as the loop runs them: long spans alone, short ones grouped in blocks,
    window-cut ones in tiles."""

    items: tuple[Span | Block, ...]
    starts: torch.Tensor  # int64, every block's per-query first visible key, back to back
    ends: torch.Tensor  # int64, every block's per-query end of visible keys, back to back

    def to(self, device: torch.device) -> Blocks:
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Blocks(self.items, move(self.starts), move(self.ends))

    def mask(self, b: Block, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, n, width]`` additive mask of block ``b`` (0 visible, -inf hidden)."""
        keys = torch.arange(b.width, device=self.ends.device)[None, :]
        hidden = (keys < self.starts[b.at : b.at + b.n, None]) | (
            keys >= self.ends[b.at : b.at + b.n, None]
        )
        zeros = torch.zeros(b.n, b.width, dtype=dtype, device=self.ends.device)
        return zeros.masked_fill_(hidden, float("-inf"))[None, None]


def _cut(s: Span, causal: bool, window: int | None) -> bool:
    """Whether the window hides some of the span's keys from some of its queries."""
    return window is not None and s.key_range(s.n - 1, causal, None)[1] - s.k > window


def plan_blocks(spans: Sequence[Span], causal: bool, window: int | None = None) -> Blocks:
    """Group consecutive short spans of one document and row, tile window-cut spans (host work,
    once per step: the grouping walks the spans, every block's per-query key ranges come from
    whole-tensor work)."""
    items: list[Span | int] = []  # a span, or the index of a block in ``groups``
    groups: list[list[tuple[Span, int, int]]] = []
    group: list[tuple[Span, int, int]] = []  # (span, first query, queries) of the open block
    queries = 0  # the open block's queries

    def close(tile: bool = False) -> None:
        nonlocal queries
        queries = 0
        if len(group) == 1 and not tile:
            items.append(group[0][0])
        elif group:
            items.append(len(groups))
            groups.append(list(group))
        group.clear()

    for s in spans:
        if _cut(s, causal, window):
            close()
            tile = min(BLOCK_QUERIES, max(SHORT_SPAN, window))
            for i0 in range(0, s.n, tile):
                group.append((s, i0, min(tile, s.n - i0)))
                close(tile=True)
            continue
        if s.n >= SHORT_SPAN:
            close()
            items.append(s)
            continue
        if group:
            last, i0, n = group[-1]
            joins = (
                s.row == last.row
                and s.doc == last.doc
                and s.q == last.q + i0 + n
                and queries + s.n <= BLOCK_QUERIES
            )
            if not joins:
                close()
        group.append((s, 0, s.n))
        queries += s.n
    close()
    blocks, starts, ends = _group_blocks(groups, causal, window)
    resolved = tuple(blocks[it] if isinstance(it, int) else it for it in items)
    return Blocks(resolved, pinned(starts), pinned(ends))


def _group_blocks(
    groups: list[list[tuple[Span, int, int]]], causal: bool, window: int | None
) -> tuple[list[Block], torch.Tensor, torch.Tensor]:
    """Every group's :class:`Block` and the per-query first and end keys of all of them, back to
    back (relative to each block's first key)."""
    entries = [(g, s.k, s.split, i0, n) for g, group in enumerate(groups) for s, i0, n in group]
    if not entries:
        empty = torch.zeros(0, dtype=torch.int64)
        return [], empty, empty
    gid, k, split, i0, n = torch.tensor(entries, dtype=torch.int64).unbind(1)
    total = int(n.sum())
    offsets = torch.cumsum(n, 0) - n
    i = torch.repeat_interleave(i0 - offsets, n, output_size=total) + torch.arange(total)
    gid, k, split = (torch.repeat_interleave(t, n, output_size=total) for t in (gid, k, split))
    end = split + i + 1 if causal else split
    first = k if window is None else torch.maximum(k, end - window)
    count = len(groups)
    low = torch.zeros(count, dtype=torch.int64).scatter_reduce_(
        0, gid, first, "amin", include_self=False
    )
    high = torch.zeros(count, dtype=torch.int64).scatter_reduce_(
        0, gid, end, "amax", include_self=False
    )
    sizes = torch.zeros(count, dtype=torch.int64).index_add_(0, gid, torch.ones_like(gid))
    at = torch.cumsum(sizes, 0) - sizes
    blocks = [
        Block(group[0][0].row, group[0][0].q + group[0][1], m, lo, hi - lo, a)
        for group, m, lo, hi, a in zip(
            groups, sizes.tolist(), low.tolist(), high.tolist(), at.tolist(), strict=True
        )
    ]
    return blocks, first - low[gid], end - low[gid]
