"""The varlen kernel's view of a step: every span's queries and keys packed back to back, one
packing per kind of span a varlen kernel states (causal, with a window, or every key visible);
the spans whose queries see per-query key ranges (a mask description's sliding starts with a
fixed end and look-ahead windows) are left to the loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard.attention.placement import pinned
from cpshard.masks import INF
from cpshard.planning.spans import Span, spans_of
from cpshard.ranges import ragged_arange

# The most packed key rows per key buffer row: beyond it the varlen packing is not built (the
# loop's blocks serve the step). Each span packs its document's whole prefix, so layouts with
# many short runs per document (``stripe``: one per token) would pack O(L * document) rows.
PACKED_KEYS_PER_ROW = 4
# The explicit varlen kernel's chunks (:func:`math_chunks`): at most this many score elements
# per head (query rows x keys), 32 MiB of fp32 per head for each of its few temporaries.
MATH_SCORES = 1 << 23
# ... and at most this many times the elements its spans own (a chunk of g equal spans computes
# g times theirs: the block-diagonal rest is masked).
MATH_WASTE = 8


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
    # The explicit varlen kernel's view: packed query i sees the packed keys
    # [q_first[i], q_last[i]] (its span's, causal and window applied), and its chunks
    # (q0, q1, k0, k1) of whole query rows with the key range they read (host ints).
    q_first: torch.Tensor | None = None  # int64 [tokens in spans]
    q_last: torch.Tensor | None = None  # int64 [tokens in spans]
    chunks: tuple[tuple[int, int, int, int], ...] = ()

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
            None if self.q_first is None else move(self.q_first),
            None if self.q_last is None else move(self.q_last),
            self.chunks,
        )


@dataclass(frozen=True)
class Packed:
    """A step's varlen view: its ``packings`` (one per kind of span) and the spans none of them
    states (``rest``: indices into the span table, host ints), which the loop attends."""

    packings: tuple[Packing, ...]
    rest: tuple[int, ...]

    def to(self, device: torch.device) -> Packed:
        return Packed(tuple(p.to(device) for p in self.packings), self.rest)


def pack_spans(
    table: torch.Tensor, rules: torch.Tensor, local_len: int, key_len: int, batch_size: int
) -> Packed | None:
    """The spans of ``table`` under their ``rules`` (:func:`~cpshard.planning.spans.query_keys`)
    packed per kind a varlen kernel states: causal spans per window (``back + 1``, or none),
    spans whose queries all see every key of ``[k, end)``; the others left to the loop. None
    when the packings would hold more than ``PACKED_KEYS_PER_ROW`` key rows per buffer row."""
    n, k, split = table[:, 2], table[:, 3], table[:, 4]
    end, back, ahead = rules.unbind(1)
    causal = ahead == 0
    visible = ~causal & (split + n - 1 - back <= k) & (split + 1 + ahead >= end)
    keys = torch.where(causal, split + n - k, end - k)
    if int(keys[causal | visible].sum()) > PACKED_KEYS_PER_ROW * batch_size * key_len:
        return None
    whole = table.clone()
    whole[:, 4] = torch.where(causal, split, end)  # a visible span's keys end at its split
    window = torch.where(back < INF, back + 1, 0)  # 0: no window
    packings = []
    for kind_causal, kind in ((True, causal), (False, visible)):
        windows = window[kind]
        for w in torch.unique(windows).tolist():
            pick = torch.nonzero(kind).flatten()[windows == w]
            packing = pack(
                spans_of(whole[pick]), local_len, key_len, kind_causal, batch_size,
                (w or None) if kind_causal else None,
            )  # fmt: skip
            assert packing is not None, "the packings' keys were counted above"
            packings.append(packing)
    rest = torch.nonzero(~(causal | visible)).flatten().tolist()
    return Packed(tuple(packings), tuple(rest))


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
    q_lens = [s.n for s in spans]
    q_first, q_last = visible_keys(q_lens, k_lens, causal, window)
    return Packing(
        *map(pinned, (q_rows, k_rows, cu_q, cu_k)),
        max(q_lens, default=0),
        max(k_lens, default=0),
        overlap(k_first, k_lens),
        causal,
        window,
        pinned(q_first),
        pinned(q_last),
        math_chunks(q_lens, k_lens, causal, window),
    )


def visible_keys(
    q_lens: list[int], k_lens: list[int], causal: bool, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and last packed key each packed query sees: its span's keys, causal aligned
    bottom-right (query r of n sees the keys up to ``k - n + r``), a window keeping the last
    ``window`` of them."""
    nq = torch.tensor(q_lens, dtype=torch.int64)
    nk = torch.tensor(k_lens, dtype=torch.int64)
    k_at = torch.cumsum(nk, 0) - nk
    r = ragged_arange(torch.zeros_like(nq), nq)  # each query's index in its span
    start, n_q, n_k = (t.repeat_interleave(nq) for t in (k_at, nq, nk))
    if not causal:
        return start, start + n_k - 1
    last = start + n_k - n_q + r
    first = start if window is None else torch.maximum(start, last - window + 1)
    return first, last


def math_chunks(
    q_lens: list[int], k_lens: list[int], causal: bool, window: int | None
) -> tuple[tuple[int, int, int, int], ...]:
    """Packed query rows in chunks ``(q0, q1, k0, k1)`` of at most :data:`MATH_SCORES` query x
    key elements: consecutive short spans share a chunk (one masked matmul-softmax for all of
    them) while the chunk computes at most :data:`MATH_WASTE` times their own elements (the
    rest is masked), a span too large for one is cut into row pieces, each with the keys its
    rows reach."""
    out: list[tuple[int, int, int, int]] = []
    current: list[int] | None = None  # [q0, q1, k0, k1] of spans gathered so far
    useful = 0  # the gathered spans' own query x key elements
    q_at = k_at = 0
    for nq, nk in zip(q_lens, k_lens, strict=True):
        if current is not None:
            area = (current[1] - current[0] + nq) * (k_at + nk - current[2])
            if area > MATH_SCORES or area > MATH_WASTE * (useful + nq * nk):
                out.append((current[0], current[1], current[2], current[3]))
                current, useful = None, 0
        if nq * nk <= MATH_SCORES:
            current = [q_at if current is None else current[0], q_at + nq,
                       k_at if current is None else current[2], k_at + nk]  # fmt: skip
            useful += nq * nk
        else:
            rows = max(1, MATH_SCORES // max(nk, 1))
            for r0 in range(0, nq, rows):
                r1 = min(nq, r0 + rows)
                hi = nk - nq + r1 if causal else nk
                lo = max(0, nk - nq + r0 - window + 1) if causal and window is not None else 0
                out.append((q_at + r0, q_at + r1, k_at + lo, k_at + hi))
        q_at, k_at = q_at + nq, k_at + nk
    if current is not None:
        out.append((current[0], current[1], current[2], current[3]))
    return tuple(out)


def overlap(first: list[int], lengths: list[int]) -> bool:
    """Whether two of the ranges ``[first[i], first[i] + lengths[i])`` share a row."""
    reached = None
    for start, n in sorted((f, n) for f, n in zip(first, lengths, strict=True) if n):
        if reached is not None and start < reached:
            return True
        reached = max(start + n, reached or 0)
    return False
