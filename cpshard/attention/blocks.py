"""Short runs of one document attended together: one masked kernel call instead of one per run.

A layout such as ``stripe`` gives each rank single-token runs (every W-th token of a document),
and the per-span loop makes one or two kernel calls per span: thousands of tiny calls per layer.
Consecutive short spans of one document in one batch row have consecutive local queries and
keys in one range of the key buffer (from the document's start, in global order), so they form a
:class:`Block`: its queries attend the range under a mask that lets query ``i`` see the keys
below ``ends[i]``. Exact, and a block's mask is at most ``BLOCK_QUERIES`` rows by one document's
prefix, never ``[L, S]``. Long spans keep the loop's exact prefix + causal split (a mask would
make the kernel compute the causal half it can skip).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard.attention.placement import pinned
from cpshard.attention.spans import Span

SHORT_SPAN = 32  # spans with fewer queries are grouped into blocks
BLOCK_QUERIES = 256  # the most queries of one block


@dataclass(frozen=True)
class Block:
    """Local queries ``[q, q + n)`` of batch row ``row`` over the key buffer's ``[k, k + width)``;
    query ``q + i`` sees the range's first ``ends[at + i]`` keys (``ends`` of :class:`Blocks`)."""

    row: int
    q: int
    n: int
    k: int
    width: int
    at: int


@dataclass(frozen=True)
class Blocks:
    """A step's spans as the loop runs them: long spans alone, short ones grouped in blocks."""

    items: tuple[Span | Block, ...]
    ends: torch.Tensor  # int64, every block's per-query key counts back to back

    def to(self, device: torch.device) -> Blocks:
        return Blocks(self.items, self.ends.to(device, non_blocking=True))

    def mask(self, b: Block, dtype: torch.dtype) -> torch.Tensor:
        """``[1, 1, n, width]`` additive mask of block ``b`` (0 visible, -inf hidden)."""
        keys = torch.arange(b.width, device=self.ends.device)
        hidden = keys[None, :] >= self.ends[b.at : b.at + b.n, None]
        zeros = torch.zeros(b.n, b.width, dtype=dtype, device=self.ends.device)
        return zeros.masked_fill_(hidden, float("-inf"))[None, None]


def _ends(s: Span, causal: bool) -> list[int]:
    """Keys each query of ``s`` sees, counted from the span's first key ``s.k``."""
    if not causal:
        return [s.split - s.k] * s.n
    return list(range(s.split - s.k + 1, s.split - s.k + s.n + 1))


def _joins(last: Span, queries: int, s: Span) -> bool:
    """Whether short span ``s`` extends a block of ``queries`` queries that ends with ``last``."""
    return (
        s.row == last.row
        and s.k == last.k
        and s.q == last.q + last.n
        and queries + s.n <= BLOCK_QUERIES
    )


def plan_blocks(spans: Sequence[Span], causal: bool) -> Blocks:
    """Group consecutive short spans of one document and row (host work, once per step)."""
    items: list[Span | Block] = []
    ends: list[int] = []
    group: list[Span] = []
    queries = 0  # in the block being built

    def close() -> None:
        if len(group) == 1:
            items.append(group[0])
        elif group:
            mine = [e for s in group for e in _ends(s, causal)]
            first = group[0]
            items.append(Block(first.row, first.q, len(mine), first.k, max(mine), len(ends)))
            ends.extend(mine)
        group.clear()

    for s in spans:
        if s.n >= SHORT_SPAN:
            close()
            items.append(s)
            continue
        if group and not _joins(group[-1], queries, s):
            close()
        queries = s.n + (queries if group else 0)
        group.append(s)
    close()
    return Blocks(tuple(items), pinned(torch.tensor(ends, dtype=torch.int64)))
