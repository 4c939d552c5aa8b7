"""The varlen kernel's view of a step: every span's queries and keys packed back to back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard.attention.placement import pinned
from cpshard.planning.spans import Span
from cpshard.ranges import ragged_arange

# The most packed key rows per key buffer row: beyond it the varlen packing is not built (the
# loop's blocks serve the step). Each span packs its document's whole prefix, so layouts with
# many short runs per document (``stripe``: one per token) would pack O(L * document) rows.
PACKED_KEYS_PER_ROW = 4


@dataclass(frozen=True)
class Packing:
    """The varlen kernel's view of a step's spans: span i's queries are the rows
    ``q_rows[cu_q[i]:cu_q[i+1]]`` of the flattened ``[B * L]`` queries, its keys the rows
    ``k_rows[cu_k[i]:cu_k[i+1]]`` of the flattened ``[B * N]`` key buffer."""

    q_rows: torch.Tensor  # int64 [tokens in spans]
    k_rows: torch.Tensor  # int64 [keys over all spans]
    cu_q: torch.Tensor  # int32 [spans + 1]
    cu_k: torch.Tensor  # int32 [spans + 1]
    max_q: int
    max_k: int
    shared_keys: bool  # a key row serves several spans (its gradients must be added up)
    causal: bool  # causal aligned bottom-right, else every key of a span visible
    window: int | None = None  # causal: each query sees only this many keys, itself included

    def to(self, device: torch.device) -> Packing:
        """The same packing on ``device`` (non-blocking copies; the host tensors are pinned when
        CUDA is available)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Packing(
            move(self.q_rows),
            move(self.k_rows),
            move(self.cu_q),
            move(self.cu_k),
            self.max_q,
            self.max_k,
            self.shared_keys,
            self.causal,
            self.window,
        )


def _runs(first: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat row indices of the runs ``[first[i], first[i] + lengths[i])`` back to back, and the
    int32 cumulative lengths."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu[1:])
    return ragged_arange(torch.tensor(first, dtype=torch.int64), lens), cu.to(torch.int32)


def pack(
    spans: Sequence[Span],
    local_len: int,
    key_len: int,
    causal: bool,
    batch_size: int,
    window: int | None = None,
) -> Packing | None:
    """The varlen packing of ``spans`` over ``[B * local_len]`` queries and ``[B * key_len]``
    keys (host tensors, pinned when CUDA is available); None when it would pack more than
    ``PACKED_KEYS_PER_ROW`` key rows per buffer row. ``window``: the kernel hides keys beyond
    each query's window (a span's keys start where its first query's window does)."""
    k_lens = [s.split + (s.n if causal else 0) - s.k for s in spans]
    if sum(k_lens) > PACKED_KEYS_PER_ROW * batch_size * key_len:
        return None
    q_rows, cu_q = _runs([s.row * local_len + s.q for s in spans], [s.n for s in spans])
    k_first = [s.row * key_len + s.k for s in spans]
    k_rows, cu_k = _runs(k_first, k_lens)
    return Packing(
        *map(pinned, (q_rows, k_rows, cu_q, cu_k)),
        max((s.n for s in spans), default=0),
        max(k_lens, default=0),
        overlap(k_first, k_lens),
        causal,
        window,
    )


def overlap(first: list[int], lengths: list[int]) -> bool:
    """Whether two of the ranges ``[first[i], first[i] + lengths[i])`` share a row."""
    reached = None
    for start, n in sorted((f, n) for f, n in zip(first, lengths, strict=True) if n):
        if reached is not None and start < reached:
            return True
        reached = max(start + n, reached or 0)
    return False
