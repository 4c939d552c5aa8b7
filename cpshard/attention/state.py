"""The per-step CP attention state of a sharder layout: which K/V rows each rank needs, who sends
them, and the spans each query run attends (host work, once per step).

For every run of a rank's tokens (consecutive global positions inside one document, in a batch
row) its queries attend the document's keys from the document start to the run's end (or to the
document's end: each step also has a bidirectional state). The rows
a rank needs are the union of those ranges, per batch row; its key buffer holds exactly them, in
global order, so each run's keys are one contiguous range of the buffer (a :class:`Span`). Every
rank derives every rank's needs from the same document ids and layout, so the senders know what
to send without asking: one all-to-all-v moves exactly the needed rows (a rank's own rows are
copied locally), its backward the reverse exchange.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpshard.blockdiag.state import AttentionState, Span, cached_on, pinned
from cpshard.comm import Group
from cpshard.layout import ShardLayout


@dataclass(frozen=True)
class Tables:
    """The exchange's row indices: ``send_rows`` into this rank's flattened ``[B * L]`` K/V rows
    (grouped by destination rank), ``recv_rows`` into its flattened ``[B * key_len]`` key buffer
    (grouped by source rank, in the order the sources send)."""

    send_rows: torch.Tensor
    recv_rows: torch.Tensor

    def to(self, device: torch.device) -> Tables:
        return Tables(
            self.send_rows.to(device, non_blocking=True),
            self.recv_rows.to(device, non_blocking=True),
        )


@dataclass(frozen=True)
class LayoutState(AttentionState):
    """The attention state of one step sharded by a :class:`~cpshard.layout.ShardLayout`."""

    layout: str = "contiguous"  # the layout's name
    causal: bool = True  # runs see their document's prefix, else the whole document
    twin: LayoutState | None = None  # the step's bidirectional state (of a causal one)
    buffer_len: int = 0  # rows per batch row of this rank's key buffer
    planned: tuple[Span, ...] = ()
    counts: tuple[tuple[int, ...], ...] = ()  # counts[r][q]: rows rank r receives from rank q
    tables: Tables | None = None  # host copy
    _tables_on: dict[torch.device, Tables] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def _spans(self) -> tuple[Span, ...]:
        return self.planned

    @property
    def key_len(self) -> int:
        return self.buffer_len

    @property
    def exchange_plan(self) -> tuple[int, ...]:
        return tuple(c for row in self.counts for c in row)

    @property
    def send_counts(self) -> list[int]:
        """Rows this rank sends to each rank (its own included: a local copy)."""
        return [row[self.group.rank] for row in self.counts]

    @property
    def recv_counts(self) -> list[int]:
        """Rows this rank receives from each rank."""
        return list(self.counts[self.group.rank])

    def tables_on(self, device: torch.device) -> Tables:
        """The exchange tables on ``device``, copied there once per device and cached."""
        assert self.tables is not None
        return cached_on(self._tables_on, device, self.tables)

    def place_on(self, device: torch.device) -> None:
        super().place_on(device)
        self.tables_on(device)

    def bidirectional(self) -> LayoutState | None:
        return self.twin if self.causal else self

    def extend(self, kv: torch.Tensor) -> torch.Tensor:
        from cpshard.attention.exchange import layout_exchange  # the ops module imports this one

        return layout_exchange(kv, self.key)

    def restore(self, grad: torch.Tensor, length: int) -> torch.Tensor:
        from cpshard.attention.exchange import layout_exchange_return

        return layout_exchange_return(grad, self.key, length)


def document_starts(doc: torch.Tensor) -> torch.Tensor:
    """``[B, P]``: the position where each token's run of one id (its document) starts."""
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    pos = torch.arange(doc.shape[1]).expand_as(doc)
    return torch.cummax(torch.where(new, pos, 0), dim=1).values


def _runs(idx: torch.Tensor, doc: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A rank's runs from its positions ``idx`` ``[B, L]``: row, first local index, length,
    document start and first global position of each (int64 vectors, row-major)."""
    b, length = idx.shape
    st = starts.gather(1, idx)
    new = torch.ones_like(idx, dtype=torch.bool)
    new[:, 1:] = (idx[:, 1:] != idx[:, :-1] + 1) | (st[:, 1:] != st[:, :-1])
    head = torch.cummax(torch.where(new, torch.arange(length), 0), dim=1).values
    flat = (torch.arange(b)[:, None] * length + head)[doc.gather(1, idx) != 0]
    heads, n = torch.unique_consecutive(flat, return_counts=True)
    row, q = heads // length, heads % length
    return row, q, n, st[row, q], idx[row, q]


def _cover(
    shape: tuple[int, int], row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """``[B, P]`` bool: positions inside any range ``[lo[i], hi[i])`` of row ``row[i]``."""
    delta = torch.zeros(shape[0], shape[1] + 1, dtype=torch.int64)
    ones = torch.ones_like(row)
    delta.index_put_((row, lo), ones, accumulate=True)
    delta.index_put_((row, hi), -ones, accumulate=True)
    return delta.cumsum(1)[:, : shape[1]] > 0


def _plan(
    group: Group, layout: ShardLayout, doc: torch.Tensor, causal: bool, twin: LayoutState | None
) -> LayoutState:
    """This rank's state: each run reaches its document's keys from the document start to the
    run's end (``causal``) or to the document's end."""
    b, padded = doc.shape
    world, me = group.world, group.rank
    length = padded // world
    starts = document_starts(doc)
    ends = padded - document_starts(doc.flip(1)).flip(1)  # one past each document's last token
    inv = layout.rank_major_inverse().to(torch.int64).expand(b, padded)
    owner, slot = inv // max(length, 1), inv % max(length, 1)
    rows = torch.arange(b)[:, None] * length
    counts, reach = [], 0
    sends: list[torch.Tensor] = []
    recv_rows = spans = buffer_len = None
    for r in range(world):
        idx = layout.indices(r).to(torch.int64).expand(b, length)
        row, q, n, ds, begin = _runs(idx, doc, starts)
        end = begin + n if causal else ends[row, begin]
        reach = max(reach, int((end - ds).max()) if n.numel() else 0)
        need = _cover((b, padded), row, ds, end)
        width = int(need.sum(1).max()) if b else 0
        pb, pp = torch.nonzero(need, as_tuple=True)  # row-major: global order per row
        order = torch.sort(owner[pb, pp], stable=True).indices
        pb, pp = pb[order], pp[order]
        src = owner[pb, pp]
        counts.append(tuple(torch.bincount(src, minlength=world).tolist()))
        sends.append((rows[:, 0][pb] + slot[pb, pp])[src == me])
        if r == me:
            at = need.cumsum(1) - 1  # buffer row of every needed position
            recv_rows = pb * width + at[pb, pp]
            split = at[row, begin] if causal else at[row, end - 1] + 1
            spans = tuple(
                Span(*v)
                for v in zip(*(t.tolist() for t in (row, q, n, at[row, ds], split)), strict=True)
            )
            buffer_len = width
    return LayoutState(
        group=group,
        local_len=length,
        batch_size=b,
        reach=reach,
        layout=layout.name,
        causal=causal,
        twin=twin,
        buffer_len=buffer_len,
        planned=spans,
        counts=tuple(counts),
        tables=Tables(pinned(torch.cat(sends)), pinned(recv_rows)),
    )


def layout_state(
    group: Group, layout: ShardLayout, doc_ids: torch.Tensor, device: torch.device | None = None
) -> LayoutState:
    """The step's :class:`LayoutState` for this rank (and its bidirectional twin), from the
    batch's document ids ``[B, P]`` (padded length, host, 0 = padding; a document = a maximal run
    of one non-zero id). Every rank passes the same ids and layout (the sharder agreed on them).
    ``device``: where the step's tables go once (the batch's device)."""
    doc = doc_ids.to("cpu", torch.int64)
    both = _plan(group, layout, doc, False, None)
    state = _plan(group, layout, doc, True, both)
    if device is not None:  # the attention's metadata on the batch's device, once per step
        for s in (state, both):
            s.place_on(device)
    return state
