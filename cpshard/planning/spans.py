"""The unit of a step's CP attention: a span, one run of a rank's queries and the keys it sees,
and the rule that says which of its keys each query sees."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from cpshard.masks import INF


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


def span_rules(table: torch.Tensor, causal: bool, window: int | None = None) -> torch.Tensor:
    """``[N, 3]`` int64 rules ``(end, back, ahead)`` of a span table whose spans are all of one
    kind: causal (each query sees up to itself, the last ``window`` keys with a window) or every
    key of ``[k, split)`` visible (see :func:`query_keys`)."""
    split, n = table[:, 4], table[:, 2]
    end = split + n if causal else split
    back = torch.full_like(split, INF if window is None else window - 1)
    return torch.stack((end, back, torch.full_like(split, 0 if causal else INF)), 1)


def query_keys(
    table: torch.Tensor, rules: torch.Tensor, span: torch.Tensor, i: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[first, end)`` of the buffer keys query ``q + i`` of span ``span`` sees under the
    spans' ``rules`` ``(end, back, ahead)``: ``[max(k, own - back), min(end, own + 1 + ahead))``
    with ``own = split + i`` its own buffer row (a span whose queries see every key of
    ``[k, end)`` has ``split = end`` and no ``back`` or ``ahead``). Every kind of span the
    step's states plan is one rule: causal (``ahead = 0``, ``end = split + n``), bidirectional,
    a sliding window (``back = window - 1``), a mask description's pieces (its ``back`` and
    ``ahead`` as they are: a sliding start with a fixed end, a look-ahead window)."""
    own = table[span, 4] + i
    first = torch.maximum(table[span, 3], own - rules[span, 1])
    end = torch.minimum(rules[span, 0], own + 1 + rules[span, 2])
    return first, end
