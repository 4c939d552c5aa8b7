"""The needed-rows K/V exchange of any layout: which K/V rows each rank needs, who sends them,
and the spans each query run attends (host work, once per step).

For every run of a rank's tokens (consecutive global positions inside one document, in a batch
row) its queries attend the document's keys from the document start to the run's end (or to the
document's end: bidirectional). The rows a rank needs are the union of those ranges, per batch
row; its key buffer holds exactly them, in global order, so each run's keys are one contiguous
range of the buffer (a :class:`~cpshard.attention.spans.Span`). Every rank derives every rank's
needs from the same document ids and layout, so the senders know what to send without asking:
one all-to-all-v moves exactly the needed rows (a rank's own rows are copied locally), its
backward the reverse exchange.

* ``cpshard::kv_needed_rows(kv, key)``: this rank's K/V ``[B, H, L, D]`` -> its key buffer
  ``[B, H, N, D]`` (zeros after a row's last needed row). ``N`` is the step's data (an
  unbacked size under compile).
* ``cpshard::kv_needed_rows_return(grad, key, length)``: its adjoint, the reverse exchange; a
  row sent to several ranks gets their gradients added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpshard.attention.exchange import register_exchange_autograd
from cpshard.attention.placement import cached_on, pinned
from cpshard.attention.spans import Span
from cpshard.attention.state import state_for
from cpshard.batch.runs import document_starts, rank_runs
from cpshard.comm import Group
from cpshard.comm.collectives import all_to_all_v
from cpshard.fingerprints import EXCHANGE, call_key
from cpshard.layouts import ShardLayout


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
class NeededRowsExchange:
    """The needed-rows exchange of one step: ``counts[r][q]`` rows rank r receives from rank q;
    this rank's ``tables`` (host copy) and key buffer width ``buffer_len``."""

    group: Group
    buffer_len: int
    counts: tuple[tuple[int, ...], ...]
    tables: Tables
    _tables_on: dict[torch.device, Tables] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def key_len(self) -> int:
        return self.buffer_len

    @property
    def plan(self) -> tuple[int, ...]:
        return tuple(c for row in self.counts for c in row)

    @property
    def send_counts(self) -> list[int]:
        """Rows this rank sends to each rank (its own included: a local copy)."""
        return [row[self.group.rank] for row in self.counts]

    @property
    def recv_counts(self) -> list[int]:
        """Rows this rank receives from each rank."""
        return list(self.counts[self.group.rank])

    @property
    def received_rows(self) -> int:
        return sum(self.recv_counts) - self.recv_counts[self.group.rank]

    @property
    def most_rows_moved(self) -> int:
        world = len(self.counts)
        received = [sum(row) - row[r] for r, row in enumerate(self.counts)]
        sent = [sum(self.counts[q][r] for q in range(world) if q != r) for r in range(world)]
        return max(2 * received[r] + sent[r] for r in range(world))

    def tables_on(self, device: torch.device) -> Tables:
        """The exchange tables on ``device``, copied there once per device and cached."""
        return cached_on(self._tables_on, device, self.tables)

    def place_on(self, device: torch.device) -> None:
        self.tables_on(device)

    def extend(self, kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return kv_needed_rows(kv, key)

    def restore(self, grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
        return kv_needed_rows_return(grad, key, length)


# ------------------------------------------------------------------ planning


def _cover(
    shape: tuple[int, int], row: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> torch.Tensor:
    """``[B, P]`` bool: positions inside any range ``[lo[i], hi[i])`` of row ``row[i]``."""
    delta = torch.zeros(shape[0], shape[1] + 1, dtype=torch.int64)
    ones = torch.ones_like(row)
    delta.index_put_((row, lo), ones, accumulate=True)
    delta.index_put_((row, hi), -ones, accumulate=True)
    return delta.cumsum(1)[:, : shape[1]] > 0


@dataclass(frozen=True)
class NeededRowsPlan:
    """This rank's spans and exchange for one attention mask, and the step's ``reach`` (the
    most keys a query attends without a window)."""

    spans: tuple[Span, ...]
    exchange: NeededRowsExchange
    reach: int


def plan_needed_rows(
    group: Group, layout: ShardLayout, doc: torch.Tensor, causal: bool, window: int | None = None
) -> NeededRowsPlan:
    """This rank's plan from the padded document ids ``doc`` ``[B, P]`` (host int64, 0 = pad):
    each run reaches its document's keys from the document start to the run's end
    (``causal``) or to the document's end; with a (causal) ``window``, from the window's start
    of its first query, at most ``window - 1`` rows before the run."""
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
        row, q, n, ds, begin = rank_runs(idx, doc, starts)
        end = begin + n if causal else ends[row, begin]
        lo = ds if window is None else torch.maximum(ds, begin - window + 1)
        reach = max(reach, int((end - ds).max()) if n.numel() else 0)
        need = _cover((b, padded), row, lo, end)
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
                for v in zip(
                    *(t.tolist() for t in (row, q, n, at[row, lo], split, ds)), strict=True
                )
            )
            buffer_len = width
    tables = Tables(pinned(torch.cat(sends)), pinned(recv_rows))
    return NeededRowsPlan(spans, NeededRowsExchange(group, buffer_len, tuple(counts), tables), reach)


# ------------------------------------------------------------------ the custom ops


def _needed_rows_exchange(key: torch.Tensor) -> NeededRowsExchange:
    exchange = state_for(key).exchange
    assert isinstance(exchange, NeededRowsExchange)
    return exchange


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` -> token-major rows ``[B * N, H * D]``."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b * n, h * d)


def _heads(rows: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """Adjoint view of :func:`_tokens`: ``[B * N, H * D]`` -> ``[B, H, N, D]`` (contiguous)."""
    return rows.view(b, -1, h, rows.shape[1] // h).transpose(1, 2).contiguous()


def _move(
    exchange: NeededRowsExchange, rows: torch.Tensor, send: list[int], recv: list[int]
) -> torch.Tensor:
    """``rows`` ``[sum send, width]`` (grouped by destination) -> ``[sum recv, width]``."""
    if exchange.group.world == 1:
        return rows
    width = rows.shape[1]
    # the same fingerprint on every rank and in both directions: the step's counts and the row
    key = call_key(EXCHANGE, rows.dtype, (width,), 0, True, False, exchange.plan)
    got = all_to_all_v(
        rows.reshape(-1),
        exchange.group.name,
        [c * width for c in send],
        [c * width for c in recv],
        key,
    )
    return got.view(-1, width)


@torch.library.custom_op("cpshard::kv_needed_rows", mutates_args=())
def kv_needed_rows(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``kv`` ``[B, H, L, D]`` -> this rank's key buffer ``[B, H, key_len, D]``."""
    exchange = _needed_rows_exchange(key)
    t = exchange.tables_on(kv.device)
    b, h = kv.shape[:2]
    rows = _tokens(kv).index_select(0, t.send_rows)
    got = _move(exchange, rows, exchange.send_counts, exchange.recv_counts)
    buf = got.new_zeros(b * exchange.key_len, got.shape[1]).index_copy_(0, t.recv_rows, got)
    return _heads(buf, b, h)


@kv_needed_rows.register_fake
def _kv_needed_rows_fake(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    buffer = torch.library.get_ctx().new_dynamic_size()  # the step's data
    return kv.new_empty(kv.shape[0], kv.shape[1], buffer, kv.shape[3])


@torch.library.custom_op("cpshard::kv_needed_rows_return", mutates_args=())
def kv_needed_rows_return(grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
    """Adjoint of :func:`kv_needed_rows`: ``[B, H, length, D]``, every sent row's gradients
    added by its owner."""
    exchange = _needed_rows_exchange(key)
    t = exchange.tables_on(grad.device)
    b, h = grad.shape[:2]
    rows = _tokens(grad).index_select(0, t.recv_rows)
    back = _move(exchange, rows, exchange.recv_counts, exchange.send_counts)
    out = back.new_zeros(b * length, back.shape[1]).index_add_(0, t.send_rows, back)
    return _heads(out, b, h)


@kv_needed_rows_return.register_fake
def _kv_needed_rows_return_fake(
    grad: torch.Tensor, key: torch.Tensor, length: int
) -> torch.Tensor:
    return grad.new_empty(grad.shape[0], grad.shape[1], length, grad.shape[3])


register_exchange_autograd(kv_needed_rows, kv_needed_rows_return)
