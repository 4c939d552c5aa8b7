"""The multi-hop halo K/V exchange of contiguous shards.

Rank r's key buffer is its own K/V with, in front, the rows before its first token that the
documents of its first tokens reach back to (the max over batch rows), received from as many
preceding ranks as they span (the transport's ``halo_exchange``); its backward sends each halo
row's gradient back to its owner (``halo_return``). For short documents that is a few rows per
rank, never a K/V all-gather.

* ``cpshard::kv_halo(kv, key)``: ``[B, H, L, D]`` -> ``[B, H, halo + L, D]``;
* ``cpshard::kv_halo_return(grad, key, length)``: its adjoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard.attention.exchange import register_exchange_autograd
from cpshard.attention.state import state_for
from cpshard.comm import Group
from cpshard.comm.collectives import halo_exchange, halo_return
from cpshard.fingerprints import HALO, call_key


@dataclass(frozen=True)
class HaloExchange:
    """The halo exchange of one step: ``halos[r]`` rows (of each of ``batch_size`` batch rows)
    reach back before rank r's first token (global position ``start`` on this rank)."""

    group: Group
    start: int
    local_len: int
    batch_size: int
    halos: tuple[int, ...]

    @property
    def halo(self) -> int:
        """Rows this rank receives before its first token."""
        return min(self.halos[self.group.rank], self.start)

    @property
    def key_len(self) -> int:
        return self.halo + self.local_len

    @property
    def plan(self) -> tuple[int, ...]:
        return self.halos

    @property
    def received_rows(self) -> int:
        return self.halo * self.batch_size

    @property
    def most_rows_moved(self) -> int:
        length, world = self.local_len, len(self.halos)
        starts = [r * length - min(h, r * length) for r, h in enumerate(self.halos)]
        # covered(k): halo rows (counted per halo) below position k * length, by one sweep over
        # the halos' bounds (host integers: this runs inside a step's first call)
        bounds = sorted([(b, 1) for b in starts] + [(r * length, -1) for r in range(world)])
        covered, depth, last, total, i = [], 0, 0, 0, 0
        for k in range(world + 1):
            x = k * length
            while i < len(bounds) and bounds[i][0] <= x:
                total += depth * (bounds[i][0] - last)
                last, depth, i = bounds[i][0], depth + bounds[i][1], i + 1
            total += depth * (x - last)
            last = x
            covered.append(total)
        moved = (
            2 * (r * length - starts[r]) + covered[r + 1] - covered[r] for r in range(world)
        )
        return max(moved, default=0) * self.batch_size

    @property
    def most_rows_received(self) -> int:
        length = self.local_len
        return max(min(h, r * length) for r, h in enumerate(self.halos)) * self.batch_size

    @property
    def keeps_local(self) -> bool:
        return self.group.world == 1

    def extend(self, kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return kv_halo(kv, key) if self.group.world > 1 else kv

    def restore(self, grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
        return kv_halo_return(grad, key, length) if self.group.world > 1 else grad

    def place_on(self, device: torch.device) -> None:
        """Nothing to place: the halo sizes are host integers."""


def halo_spans(
    exchange: HaloExchange,
    runs: Sequence[tuple[int, int, int, int]],
    window: int | None = None,
    firsts: Sequence[int] | None = None,
) -> torch.Tensor:
    """This rank's runs ``(row, begin, length, doc_start)`` (global positions) as spans over
    the halo-extended key buffer (causal: each run sees its document from its start, from its
    first query's ``window``, or from its first key ``firsts``, a mask description's): a span
    table (:func:`~cpshard.planning.spans.span_table`)."""
    origin = exchange.start - exchange.halo  # global position of the buffer's first row
    row, begin, length, doc_start = (
        torch.tensor(runs, dtype=torch.int64).view(len(runs), 4).unbind(1)
    )
    if firsts is not None:
        first = torch.tensor(firsts, dtype=torch.int64)
    elif window is None:
        first = doc_start
    else:
        first = torch.maximum(doc_start, begin - window + 1)
    return torch.stack(
        (row, begin - exchange.start, length, first - origin, begin - origin, doc_start), 1
    )


def _halo_exchange(key: torch.Tensor) -> HaloExchange:
    exchange = state_for(key).exchange
    assert isinstance(exchange, HaloExchange)
    return exchange


def _halo_key(dtype: torch.dtype, shape: Sequence[int], halos: list[int]) -> int:
    """The transfer's fingerprint from the forward's K/V shape: the same in the forward and the
    backward exchange."""
    return call_key(HALO, dtype, shape, 2, True, False, halos)


@torch.library.custom_op("cpshard::kv_halo", mutates_args=())
def kv_halo(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``kv`` ``[B, H, L, D]`` with the step's halo rows in front along dim 2."""
    exchange = _halo_exchange(key)
    halos = list(exchange.halos)
    name = exchange.group.name
    return halo_exchange(kv, name, halos, 0, 2, _halo_key(kv.dtype, kv.shape, halos))


@kv_halo.register_fake
def _kv_halo_fake(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    extended = torch.library.get_ctx().new_dynamic_size()  # halo + L: the step's data
    return kv.new_empty(kv.shape[0], kv.shape[1], extended, kv.shape[3])


@torch.library.custom_op("cpshard::kv_halo_return", mutates_args=())
def kv_halo_return(grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
    """Adjoint of :func:`kv_halo`: ``[B, H, length, D]``, halo rows' gradients added by their
    owners."""
    exchange = _halo_exchange(key)
    halos = list(exchange.halos)
    shape = (grad.shape[0], grad.shape[1], length, grad.shape[3])
    key_ = _halo_key(grad.dtype, shape, halos)
    return halo_return(grad.contiguous(), exchange.group.name, halos, 0, 2, key_)


@kv_halo_return.register_fake
def _kv_halo_return_fake(grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
    return grad.new_empty(grad.shape[0], grad.shape[1], length, grad.shape[3])


register_exchange_autograd(kv_halo, kv_halo_return)
