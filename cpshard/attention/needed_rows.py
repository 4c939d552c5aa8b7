"""The needed-rows K/V exchange of any layout: which K/V rows each rank needs, who sends them,
and the spans each query run attends (planned once per step by
:mod:`cpshard.planning.needed_rows`).

For every run of a rank's tokens (consecutive global positions inside one document, in a batch
row) its queries attend the document's keys from the document start to the run's end (or to the
document's end: bidirectional). The rows a rank needs are the union of those ranges, per batch
row; its key buffer holds exactly them, in global order, so each run's keys are one contiguous
range of the buffer (a :class:`~cpshard.planning.spans.Span`). Every rank derives every rank's
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
from cpshard.attention.state import seen_views, state_for
from cpshard.comm import Group
from cpshard.comm.collectives import all_to_all_v
from cpshard.fingerprints import EXCHANGE, call_key
from cpshard.planning import NeededRowsPlan


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
    """The needed-rows exchange of one step for this rank: rows it sends to (``send_counts``)
    and receives from (``recv_counts``) each rank, its key buffer width ``buffer_len``;
    ``received[r]`` / ``sent[r]``: the rows every rank receives from and sends to the others
    (alike on every rank). Its :attr:`tables` (host, pinned) are made from its ``source`` plan
    when first used, and placed at a step's setup once a call has used them (a step that
    attends head-parallel never makes them)."""

    group: Group
    buffer_len: int
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    received: tuple[int, ...]
    sent: tuple[int, ...]
    source: NeededRowsPlan = field(repr=False, compare=False)
    _host: list[Tables] = field(default_factory=list, init=False, repr=False, compare=False)
    _tables_on: dict[torch.device, Tables] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def from_plan(cls, group: Group, plan: NeededRowsPlan) -> NeededRowsExchange:
        return cls(
            group, plan.buffer_len, plan.send_counts, plan.recv_counts, plan.received, plan.sent,
            plan,
        )  # fmt: skip

    @property
    def tables(self) -> Tables:
        """The exchange's host tables (pinned), made once."""
        if not self._host:
            self._host.append(Tables(pinned(self.source.send_rows), pinned(self.source.recv_rows)))
        return self._host[0]

    @property
    def key_len(self) -> int:
        return self.buffer_len

    @property
    def plan(self) -> tuple[int, ...]:
        return (*self.received, *self.sent)

    @property
    def received_rows(self) -> int:
        return self.received[self.group.rank]

    @property
    def most_rows_moved(self) -> int:
        return max(2 * got + out for got, out in zip(self.received, self.sent, strict=True))

    @property
    def most_rows_received(self) -> int:
        return max(self.received)

    def tables_on(self, device: torch.device) -> Tables:
        """The exchange tables on ``device``, copied there once per device and cached (a
        call's use: later steps' setups place them)."""
        seen_views.add("needed_rows")
        return cached_on(self._tables_on, device, self.tables)

    def place_on(self, device: torch.device) -> None:
        if "needed_rows" in seen_views:
            self.tables_on(device)

    @property
    def keeps_local(self) -> bool:
        return False  # the buffer holds the needed rows in global order, even of one rank

    def extend(self, kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return kv_needed_rows(kv, key)

    def restore(self, grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
        return kv_needed_rows_return(grad, key, length)


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
    got = _move(exchange, rows, list(exchange.send_counts), list(exchange.recv_counts))
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
    back = _move(exchange, rows, list(exchange.recv_counts), list(exchange.send_counts))
    out = back.new_zeros(b * length, back.shape[1]).index_add_(0, t.send_rows, back)
    return _heads(out, b, h)


@kv_needed_rows_return.register_fake
def _kv_needed_rows_return_fake(
    grad: torch.Tensor, key: torch.Tensor, length: int
) -> torch.Tensor:
    return grad.new_empty(grad.shape[0], grad.shape[1], length, grad.shape[3])


register_exchange_autograd(kv_needed_rows, kv_needed_rows_return)
