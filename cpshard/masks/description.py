"""A step's attention mask as the planners can plan from it: each document cut into segments,
each segment's queries reaching one key interval given by four numbers.

Query ``q`` of a segment sees the keys ``[max(lo, q - back), min(hi, q + 1 + ahead))`` (global
positions of its batch row; nothing when that is empty). Causal attention is one segment per
document with ``lo`` its start, ``hi`` its end, ``ahead = 0`` and no ``back``; bidirectional
attention has no ``ahead`` either; a sliding window sets ``back``; a chunk is a segment whose
``lo`` and ``hi`` are the chunk's bounds; a bidirectional block (an image span, a prefix) is a
segment whose ``hi`` is the block's end. Intersections keep this form segment by segment; a
union is cut where one of its two intervals changes form and is refused (None) where, for some
query, the two are disjoint (the union would not be one interval). "No limit" is :data:`INF`.

Every builder clips the intervals to the documents (a mask never reaches across documents);
two descriptions combine only over the same documents. Host int64 tensors, whole-tensor work,
O(documents + segments): never a pass per position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.batch.runs import document_bounds, run_starts
from cpshard.ranges import ragged_arange

INF = 1 << 60  # a back or ahead this large never binds (and q + 1 + INF never overflows int64)


@dataclass(frozen=True, eq=False)
class MaskDescription:
    """The attention mask of a packed batch of ``rows`` rows of ``length`` positions (module
    doc): segments ``[start, end)`` of batch row ``row`` (sorted by row and start, disjoint,
    covering exactly the documents' positions, each inside its document ``[doc_start,
    doc_end)``) and, per segment, the key rule ``lo``, ``back``, ``hi``, ``ahead``. Picklable;
    int64 vectors of one length."""

    rows: int
    length: int
    row: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    doc_start: torch.Tensor
    doc_end: torch.Tensor
    lo: torch.Tensor
    back: torch.Tensor
    hi: torch.Tensor
    ahead: torch.Tensor

    @property
    def segments(self) -> int:
        return int(self.start.numel())

    def same_as(self, other: MaskDescription) -> bool:
        """Whether ``other`` describes the same mask, segment by segment (O(segments))."""
        return (self.rows, self.length) == (other.rows, other.length) and all(
            torch.equal(getattr(self, name), getattr(other, name))
            for name in ("row", "start", "end", "doc_start", "doc_end", "lo", "back", "hi", "ahead")
        )

    def first_key(self, q: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The first key query ``q`` of segment ``at`` sees."""
        return torch.maximum(self.lo[at], q - self.back[at])

    def end_key(self, q: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """One past the last key query ``q`` of segment ``at`` sees."""
        return torch.minimum(self.hi[at], q + 1 + self.ahead[at])

    def dense(self) -> torch.Tensor:
        """``[rows, length, length]`` bool, True where a query sees a key: the brute-force view
        (O(rows x length^2); for tests and debugging, never for planning)."""
        at = torch.arange(self.segments).repeat_interleave(self.end - self.start)
        q = ragged_arange(self.start, self.end - self.start)
        keys = torch.arange(self.length)
        seen = (keys >= self.first_key(q, at)[:, None]) & (keys < self.end_key(q, at)[:, None])
        out = torch.zeros(self.rows, self.length, self.length, dtype=torch.bool)
        out[self.row[at], q] = seen
        return out

    def padded_to(self, length: int) -> MaskDescription:
        """The same mask over rows of ``length`` positions (the extra ones padding: no
        segments), as a CP step's layout pads its rows."""
        if length < self.length:
            raise ValueError(f"cannot pad a mask of {self.length} positions to {length}")
        if length == self.length:
            return self
        cols = (self.row, self.start, self.end, self.doc_start, self.doc_end, self.lo,
                self.back, self.hi, self.ahead)  # fmt: skip
        return MaskDescription(self.rows, length, *cols)

    # ---------------------------------------------------------------- builders

    @classmethod
    def within_documents(
        cls, documents: torch.Tensor, back: int = INF, ahead: int = INF
    ) -> MaskDescription:
        """One segment per document of ``documents`` ``[B, S]`` (int64 ids, 0 = pad): query ``q``
        sees its document's keys from ``q - back`` to ``q + ahead``. Causal: ``ahead=0``;
        bidirectional: the defaults; a causal sliding window ``W``: ``back=W - 1, ahead=0``."""
        if back < 0 or ahead < 0:
            raise ValueError(f"back and ahead must be >= 0, got {back} and {ahead}")
        row, start, end = document_bounds(_host(documents))
        return _make(documents.shape, row, start, end, start, end, start, back, end, ahead)

    @classmethod
    def chunks(cls, documents: torch.Tensor, size: int) -> MaskDescription:
        """Chunked attention within each document: its chunks of ``size`` tokens from its start
        (a shorter last one) see each other and nothing else (with causal: ``q // size == k //
        size`` in document positions)."""
        if size < 1:
            raise ValueError(f"the chunk size must be >= 1, got {size}")
        row, ds, de = document_bounds(_host(documents))
        count = (de - ds + size - 1) // size
        first = ragged_arange(torch.zeros_like(count), count) * size
        row, ds, de = (t.repeat_interleave(count) for t in (row, ds, de))
        start = ds + first
        end = torch.minimum(start + size, de)
        return _make(documents.shape, row, start, end, ds, de, start, INF, end, INF)

    @classmethod
    def blocks(cls, documents: torch.Tensor, block_ids: torch.Tensor) -> MaskDescription | None:
        """Bidirectional blocks: the tokens of one block id ``>= 0`` (``block_ids`` ``[B, S]``)
        in one document see each other; other tokens (id < 0) see nothing. None when a block's
        tokens inside a document are not consecutive (no interval says what they see)."""
        if block_ids.shape != documents.shape:
            raise ValueError(
                f"block_ids must have the documents' shape {tuple(documents.shape)}, got "
                f"{tuple(block_ids.shape)}"
            )
        documents, block_ids = _host(documents), _host(block_ids)
        valid = documents != 0
        starts = run_starts(documents, valid) | run_starts(block_ids, valid)
        row, start, end, ds, de, doc = _segments_at(documents, starts)
        group = block_ids[row, start]
        inside = group >= 0
        # one segment per (document, block): a block cut by other tokens is two segments
        key = doc[inside] * (max(int(group.max()), 0) + 1 if group.numel() else 1) + group[inside]
        if torch.unique(key).numel() != key.numel():
            return None
        lo = torch.where(inside, start, ds)
        hi = torch.where(inside, end, ds)  # ds: an empty interval
        return _make(documents.shape, row, start, end, ds, de, lo, INF, hi, INF)

    # ---------------------------------------------------------------- combinations

    def intersect(self, other: MaskDescription) -> MaskDescription:
        """The keys both descriptions let a query see (an interval in every segment)."""
        a, b, row, start, end, ds, de = _refine(self, other)
        return _make(
            (self.rows, self.length), row, start, end, ds, de,
            torch.maximum(self.lo[a], other.lo[b]), torch.minimum(self.back[a], other.back[b]),
            torch.minimum(self.hi[a], other.hi[b]), torch.minimum(self.ahead[a], other.ahead[b]),
        ).compact()  # fmt: skip

    def union(self, other: MaskDescription) -> MaskDescription | None:
        """The keys either description lets a query see, or None when for some query the two
        intervals neither overlap nor touch (the union is not one interval).

        Each common segment is cut at every query where one of the four bounds changes form
        (``lo`` to ``q - back``, ``q + 1 + ahead`` to ``hi``) or where two of them cross, so
        that on each piece every bound is one line and every comparison between them one sign:
        the piece's first query decides them all."""
        a, b, row, start, end, ds, de = _refine(self, other)
        if start.numel() == 0:  # no documents
            return self
        const = torch.stack((self.lo[a], other.lo[b], self.hi[a], other.hi[b]), 1)
        line = torch.stack(
            (-self.back[a], -other.back[b], 1 + self.ahead[a], 1 + other.ahead[b]), 1
        )  # the bounds' other form: q + line
        root = (const[:, :, None] - line[:, None, :]).reshape(len(start), 16)
        cuts = torch.cat((root, root + 1), 1)
        keep = (cuts > start[:, None]) & (cuts < end[:, None])
        seg = torch.arange(len(start))
        at = torch.cat((seg, seg.repeat_interleave(keep.sum(1))))
        first = torch.cat((start, cuts[keep]))
        flat = torch.unique(row[at] * (self.length + 1) + first)  # sorted pieces
        at = torch.searchsorted(row * (self.length + 1) + start, flat, right=True) - 1
        first = flat - row[at] * (self.length + 1)
        last = torch.cat((first[1:], first.new_zeros(1)))
        ends = torch.where(
            torch.cat((at[1:] == at[:-1], at.new_zeros(1, dtype=torch.bool))), last, end[at]
        )
        x = first
        l1 = torch.maximum(const[at, 0], x + line[at, 0])
        l2 = torch.maximum(const[at, 1], x + line[at, 1])
        h1 = torch.minimum(const[at, 2], x + line[at, 2])
        h2 = torch.minimum(const[at, 3], x + line[at, 3])
        empty1, empty2 = l1 >= h1, l2 >= h2
        if bool((~empty1 & ~empty2 & ((l2 > h1) | (l1 > h2))).any()):
            return None
        take_lo1 = empty2 | (~empty1 & (l1 <= l2))
        take_hi1 = empty2 | (~empty1 & (h1 >= h2))
        both = empty1 & empty2
        pa, pb = a[at], b[at]
        lo = torch.where(take_lo1, self.lo[pa], other.lo[pb])
        back = torch.where(take_lo1, self.back[pa], other.back[pb])
        hi = torch.where(take_hi1, self.hi[pa], other.hi[pb])
        ahead = torch.where(take_hi1, self.ahead[pa], other.ahead[pb])
        dsp = ds[at]
        lo, hi = torch.where(both, dsp, lo), torch.where(both, dsp, hi)
        back, ahead = (torch.where(both, INF, t) for t in (back, ahead))
        return _make(
            (self.rows, self.length), row[at], first, ends, dsp, de[at], lo, back, hi, ahead
        ).compact()

    def compact(self) -> MaskDescription:
        """The same mask with adjacent segments of one document and one rule merged."""
        n = self.segments
        if n == 0:
            return self
        cols = (self.row, self.doc_start, self.lo, self.back, self.hi, self.ahead)
        same = torch.ones(n - 1, dtype=torch.bool)
        for t in cols:
            same &= t[1:] == t[:-1]
        same &= self.start[1:] == self.end[:-1]
        first = torch.nonzero(torch.cat((same.new_ones(1), ~same))).flatten()
        last = torch.cat((first[1:] - 1, first.new_tensor([n - 1])))
        return _make(
            (self.rows, self.length), self.row[first], self.start[first], self.end[last],
            *(t[first] for t in (self.doc_start, self.doc_end, self.lo, self.back, self.hi,
                                 self.ahead)),
        )  # fmt: skip


def _host(ids: torch.Tensor) -> torch.Tensor:
    """Per-token ids as host int64 (a description is host metadata)."""
    if ids.dim() != 2:
        raise ValueError(f"per-token ids must be [B, S], got {tuple(ids.shape)}")
    return ids.to("cpu", torch.int64)


def _make(shape: tuple[int, ...] | torch.Size, *columns: torch.Tensor | int) -> MaskDescription:
    """A :class:`MaskDescription` of ``shape`` (rows, length) from its columns in field order
    (an int column: the same value for every segment)."""
    n = int(columns[1].numel())  # type: ignore[union-attr]
    full = [
        c.to(torch.int64) if isinstance(c, torch.Tensor) else torch.full((n,), c)
        for c in columns
    ]
    return MaskDescription(int(shape[0]), int(shape[1]), *full)


def _segments_at(documents: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Segments beginning where ``starts`` ``[B, S]`` is True (every document start among them,
    pad positions never), each ending at the next or at its document's end: row, start, end,
    document start and end, and the document's index among every row's documents."""
    b, length = documents.shape
    drow, dstart, dend = document_bounds(documents)
    flat = torch.nonzero(starts.reshape(-1)).flatten()
    row = flat // max(length, 1)
    start = flat - row * length
    doc = torch.searchsorted(drow * length + dstart, flat, right=True) - 1
    nxt = torch.cat((flat[1:], flat.new_tensor([b * length])))
    end = torch.minimum(nxt - row * length, dend[doc])
    return row, start, end, dstart[doc], dend[doc], doc


def _refine(a: MaskDescription, b: MaskDescription) -> tuple[torch.Tensor, ...]:
    """The common refinement of two descriptions' segments: for each piece, its segment in
    ``a`` and in ``b``, row, start, end, document start and end."""
    if (a.rows, a.length) != (b.rows, b.length):
        raise ValueError(
            f"descriptions of different batches: {a.rows} x {a.length} and {b.rows} x {b.length}"
        )
    span = a.length + 1
    fa, fb = a.row * span + a.start, b.row * span + b.start
    flat = torch.unique(torch.cat((fa, fb)))
    ia = torch.searchsorted(fa, flat, right=True) - 1
    ib = torch.searchsorted(fb, flat, right=True) - 1
    ok = (ia >= 0) & (ib >= 0)
    ia, ib = ia.clamp(min=0), ib.clamp(min=0)
    ok &= (flat < a.row[ia] * span + a.end[ia]) & (flat < b.row[ib] * span + b.end[ib])
    ok &= (a.doc_start[ia] == b.doc_start[ib]) & (a.doc_end[ia] == b.doc_end[ib])
    if not bool(ok.all()) or int((a.end - a.start).sum()) != int((b.end - b.start).sum()):
        raise ValueError("the two mask descriptions are of different documents")
    row = a.row[ia]
    start = flat - row * span
    end = torch.minimum(a.end[ia], b.end[ib])
    return ia, ib, row, start, end, a.doc_start[ia], a.doc_end[ia]
