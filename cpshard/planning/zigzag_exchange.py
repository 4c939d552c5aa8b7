"""The needed-rows exchange of the ``per_document_head_tail`` layout without a window, in closed
form from its chunk table (:mod:`~cpshard.planning.zigzag_runs`).

A rank needs every document it holds a token of from the document's start to the end of its
last chunk (causal) or to the document's end. A rank's chunks of a document are one per pass,
its non-empty ones its first (a run's chunks differ by at most one token, the extras dealt pass
by pass), so its last chunk is in pass ``p = non-empty - 1`` and rank ``q``'s chunk of pass
``t`` lies below it when ``t < p``, or ``t == p`` and ``q``'s chunk comes first in the pass
(``q <= r`` on even passes, ``q >= r`` on odd ones). What every rank needs, and what this rank
sends to and receives from each, are then sums over the table's ``[documents, passes, ranks]``
chunk sizes: a few whole-tensor passes over the table, never a list of every rank's key
intervals. The row tables this rank moves are made only when first read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cpshard.planning.zigzag_runs import ZigzagRuns
from cpshard.ranges import ragged_arange


class BufferRows(Protocol):
    """Where a rank's needed positions sit in its key buffer."""

    width: int

    def buffer_row(self, row: torch.Tensor, position: torch.Tensor) -> torch.Tensor: ...


def _orders(world: int, passes: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[K, W]`` bool: whether rank ``q``'s chunk of pass ``t`` comes before (or is) this
    rank's, and whether this rank's comes before (or is) rank ``q``'s."""
    ranks = torch.arange(world)
    even = (torch.arange(passes) % 2 == 0)[:, None]
    return torch.where(even, ranks <= rank, ranks >= rank), torch.where(even, ranks >= rank, ranks <= rank)


@dataclass(frozen=True)
class ZigzagRowTables:
    """This rank's row tables of a :class:`ZigzagExchange` into a key buffer of ``width`` rows
    per batch row (``base``: each held document's first buffer row less its start), made from
    the chunk table when read."""

    table: ZigzagRuns
    rank: int
    causal: bool
    width: int
    base: torch.Tensor

    def send_rows(self) -> torch.Tensor:
        """Rank ``r'`` gets the first ``sends[d, r']`` of this rank's tokens of document ``d``
        (its tokens in ``r'``'s interval: its chunks ascend with the passes), by ``r'``, then
        document."""
        t, rank = self.table, self.rank
        nonempty, world = t.nonempty(), t.world
        holds = nonempty > 0
        own = t.own_sizes(rank)  # [R, K]
        if self.causal:
            at = (nonempty - 1).clamp_(min=0)
            mine_first = _orders(world, own.shape[1], rank)[1]
            sends = (torch.cumsum(own, 1) - own).gather(1, at)
            sends += own.gather(1, at) * mine_first[at, torch.arange(world)]
            sends.mul_(holds)
        else:
            sends = own.sum(1, keepdim=True) * holds
        first = t.run_row * t.local_len + t.rank_before_run(rank)
        return ragged_arange(first.repeat(world), sends.T.reshape(-1))

    def recv_rows(self) -> torch.Tensor:
        """From every source ``q``, its tokens of each document this rank holds up to the end
        of this rank's interval (its chunks up to this rank's last one), by source, then
        document, at their buffer rows."""
        t, rank = self.table, self.rank
        nonempty = t.nonempty()
        held = nonempty[:, rank] > 0
        d = torch.nonzero(held).flatten()
        mine = t.rank_sizes(d)  # [R', K, W]
        world, passes = t.world, mine.shape[1]
        if self.causal:
            p = (nonempty[held, rank] - 1)[:, None, None]
            k = torch.arange(passes)[None, :, None]
            mine = mine * ((k < p) | ((k == p) & _orders(world, passes, rank)[0][None]))
        count = mine.sum(1).T.reshape(-1)  # [W * R']: by source, then document
        first = t.before_run()[d].T.reshape(-1)  # every source's local index at the start
        slot = ragged_arange(first, count)
        src = torch.arange(world).repeat_interleave(d.numel())
        src, row, base = (
            torch.repeat_interleave(v, count)
            for v in (src, t.run_row[d].repeat(world), self.base.repeat(world))
        )
        return row * self.width + base + t.position(src, row, slot)


@dataclass(frozen=True)
class ZigzagExchange:
    """Rank ``rank``'s needed-rows exchange (module doc): rows every rank receives from and
    sends to the others (``received``, ``sent``, ``[W]``), what this rank receives from and
    sends to each (``recv_counts``, ``send_counts``, its own included) and its key intervals
    ``mine`` (row, start, end: one per document it holds, in row and position order; adjacent
    ones not merged)."""

    table: ZigzagRuns
    rank: int
    causal: bool
    received: torch.Tensor
    sent: torch.Tensor
    recv_counts: torch.Tensor
    send_counts: torch.Tensor
    mine: tuple[torch.Tensor, torch.Tensor, torch.Tensor]

    def tables(self, rows: BufferRows) -> ZigzagRowTables:
        """The row tables of this exchange into the key buffer ``rows``."""
        _, start, _ = self.mine
        base = rows.buffer_row(self.mine[0], start) - start
        return ZigzagRowTables(self.table, self.rank, self.causal, rows.width, base)


def zigzag_exchange(table: ZigzagRuns, rank: int, causal: bool) -> ZigzagExchange:
    """Rank ``rank``'s :class:`ZigzagExchange` of every rank's intervals without a window:
    column sums of the chunk sizes, grouped by where the intervals end (no per-(document,
    rank) table but the reach of each)."""
    world = table.world
    nonempty = table.nonempty()  # [R, W]
    passes = table.size.shape[1] // world
    holds = nonempty > 0
    if causal:  # the document's tokens up to the end of the rank's last chunk
        reach = table.through_last_chunk()
    else:
        reach = (table.run_end - table.run_start)[:, None] * holds
    own = table.tokens()
    received = reach.sum(0) - own
    sent = table.served_without_window(causal) - own

    # Received: every source's chunks of the documents this rank holds, up to its last one:
    # the chunk sizes summed by this rank's last pass of the document (-1: holds none).
    by_last = table.pass_sums(nonempty[:, rank], passes + 1)
    if causal:
        q_first, mine_first = _orders(world, passes, rank)
        p = torch.arange(passes)
        below = (p[None, :] < p[:, None])[:, :, None] | ((p[None, :] == p[:, None])[:, :, None] & q_first)
        recv_counts = (by_last[1:] * below).sum((0, 1))
    else:
        recv_counts = by_last[1:].sum((0, 1))

    # Sent: this rank's tokens of each document inside every rank's interval of it, a prefix
    # of them (its chunks ascend with the passes): its chunks of passes before that rank's
    # last, and of that pass if its chunk comes first.
    own_sizes = table.own_sizes(rank).double()  # [R, K]: exact (counts far below 2^53)
    if causal:
        send_counts = torch.zeros(world, dtype=torch.float64)
        for t in range(passes):
            later = own_sizes[:, t] @ (nonempty > t + 1).double()
            last = own_sizes[:, t] @ (nonempty == t + 1).double()
            send_counts += later + last * mine_first[t]
    else:
        send_counts = own_sizes.sum(1) @ holds.double()

    held = holds[:, rank]
    row, start = table.run_row[held], table.run_start[held]
    mine = (row, start, start + reach[held, rank])
    return ZigzagExchange(
        table, rank, causal, received, sent, recv_counts, send_counts.round().long(), mine
    )
