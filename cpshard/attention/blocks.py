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
    once per step)."""
    items: list[Span | Block] = []
    starts: list[int] = []
    ends: list[int] = []
    group: list[tuple[Span, int, int]] = []  # (span, first query, queries) of the open block
    queries = 0  # the open block's queries

    def close(tile: bool = False) -> None:
        nonlocal queries
        queries = 0
        if len(group) == 1 and not tile:
            items.append(group[0][0])
        elif group:
            ranges = [
                s.key_range(i, causal, window) for s, i0, n in group for i in range(i0, i0 + n)
            ]
            first = min(a for a, _ in ranges)
            s0, i0, _ = group[0]
            at = len(ends)
            starts.extend(a - first for a, _ in ranges)
            ends.extend(e - first for _, e in ranges)
            width = max(e for _, e in ranges) - first
            items.append(Block(s0.row, s0.q + i0, len(ranges), first, width, at))
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
    as_tensor = lambda v: pinned(torch.tensor(v, dtype=torch.int64))  # noqa: E731
    return Blocks(tuple(items), as_tensor(starts), as_tensor(ends))
