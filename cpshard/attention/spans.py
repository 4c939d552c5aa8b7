"""The unit of a step's CP attention: a span, one run of a rank's queries and the keys it sees."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """A run of queries in the kernel's coordinates: local queries ``[q, q + n)`` of batch row
    ``row`` attend the keys ``[k, split)`` of the row's key buffer all visible and, in a causal
    state, ``[split, split + n)`` causally (query ``q + i`` sees ``split .. split + i``): the
    keys of one document in order (a bidirectional state's spans end at ``split``)."""

    row: int
    q: int
    n: int
    k: int
    split: int
