"""How many (interval, position) pairs a list of key intervals covers below a position: the
count behind every rank's served rows (each of its tokens counted once per interval holding it)
read at the bounds of its runs."""

from __future__ import annotations

import torch

from cpshard.batch.runs import DENSE_LOOKUPS


class Coverage:
    """How many (interval, position) pairs the intervals ``[lo, hi)`` of batch rows ``row``
    cover below a position of a row: the sum over positions of how many intervals hold each.
    By binary search over the sorted bounds (no pass over the sequence), or, when the
    ``lookups`` number about one per position and the intervals too many for a search to stay
    in cache, from the running sum over every position."""

    def __init__(
        self, row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, rows: int, padded: int,
        lookups: int,
    ) -> None:  # fmt: skip
        self.span = padded + 1
        positions = rows * padded  # a search of a table this much smaller stays in cache
        self.dense = min(lookups, lo.numel() * DENSE_LOOKUPS) * DENSE_LOOKUPS > positions
        if self.dense:
            delta = torch.zeros(rows * self.span + 1, dtype=torch.int64)
            delta.index_add_(0, row * self.span + lo, torch.ones_like(lo))
            delta.index_add_(0, row * self.span + hi, -torch.ones_like(hi))
            # below[row * span + x]: the covered pairs below x (x = 0..padded) of the row
            self.below_at = torch.cumsum(torch.cumsum(delta, 0), 0)
            self.below_at = torch.cat([self.below_at.new_zeros(1), self.below_at[:-1]])
        else:
            starts = torch.arange(rows) * self.span  # each row's first key
            self.lo, self.lo_sums, self.lo_first = self._sorted(row * self.span + lo, starts)
            self.hi, self.hi_sums, self.hi_first = self._sorted(row * self.span + hi, starts)

    @staticmethod
    def _sorted(keys: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The keys sorted, their running sums and where each row's keys begin."""
        keys = torch.sort(keys).values
        sums = torch.zeros(keys.numel() + 1, dtype=torch.int64)
        torch.cumsum(keys, 0, out=sums[1:])
        return keys, sums, torch.searchsorted(keys, starts)

    @staticmethod
    def _beyond(keys: torch.Tensor, sums: torch.Tensor, first: torch.Tensor,
                base_x: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Sum of ``x - bound`` over the row's bounds ``< x`` (``base_x``: row key + x;
        ``first``: where the row's keys begin)."""
        last = torch.searchsorted(keys, base_x)
        return (last - first) * base_x - (sums[last] - sums[first])

    def below(self, row: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per entry: the intervals' covered positions ``< x`` in batch row ``row``."""
        base = row * self.span
        if self.dense:
            return self.below_at[base + x] - self.below_at[base]
        key = base + x
        return self._beyond(self.lo, self.lo_sums, self.lo_first[row], key) - self._beyond(
            self.hi, self.hi_sums, self.hi_first[row], key
        )
