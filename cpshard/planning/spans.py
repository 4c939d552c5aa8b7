"""The unit of a step's CP attention: a span, one run of a rank's queries and the keys it sees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class Span(NamedTuple):
    """A run of queries in the kernel's coordinates: local queries ``[q, q + n)`` of batch row
    ``row`` attend the keys ``[k, split)`` of the row's key buffer all visible and, in a causal
    state, ``[split, split + n)`` causally (query ``q + i`` sees ``split .. split + i``): the
    keys of one document in order (a bidirectional state's spans end at ``split``). In a
    windowed state query ``q + i`` sees only the window's last keys up to ``split + i``; ``k``
    is then the first key its first query sees. ``doc`` names the run's document (its start's
    global position: spans of one row with equal ``doc`` are runs of one document)."""

    row: int
    q: int
    n: int
    k: int
    split: int
    doc: int = 0

    def key_range(self, i: int, causal: bool, window: int | None) -> tuple[int, int]:
        """``[first, end)`` of the buffer keys query ``q + i`` sees."""
        end = self.split + i + 1 if causal else self.split
        first = self.k if window is None else max(self.k, end - window)
        return first, end


def span_table(spans: Sequence[Span]) -> torch.Tensor:
    """``[N, 6]`` int64: ``spans`` as rows of their fields (``row, q, n, k, split, doc``)."""
    return torch.tensor(spans, dtype=torch.int64).view(len(spans), len(Span._fields))


def spans_of(table: torch.Tensor) -> tuple[Span, ...]:
    """The :class:`Span` of each row of a span table (see :func:`span_table`)."""
    return tuple(Span._make(fields) for fields in table.tolist())
