"""The needed-rows exchange of the ``per_document_head_tail`` layout without a window, from its
runs' deal (:mod:`~cpshard.planning.zigzag_runs`).

A rank needs every document it holds a token of from the document's start to the end of its
last chunk (causal) or to the document's end. A rank's chunks of a document are one per pass,
its non-empty ones its first (a run's chunks differ by at most one token, the extras dealt pass
by pass), so its last chunk is in pass ``p = non-empty - 1`` and rank ``q``'s chunk of pass
``t`` lies below it when ``t < p``, or ``t == p`` and ``q``'s chunk comes first in the pass
(``q <= r`` on even passes, ``q >= r`` on odd ones). The counts every rank needs, serves and is
sent are sums over the runs in closed form (:mod:`~cpshard.planning.zigzag_counts`, O(runs +
W)); what this rank receives, the chunk sizes summed by where its intervals end. The row tables
it moves are made from the chunk table only when first read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.planning.row_tables import ClosedExchange, received_rows
from cpshard.planning.zigzag_counts import (
    needed_without_window,
    reach_of,
    sent_by,
    served_without_window,
)
from cpshard.planning.zigzag_runs import ZigzagRuns
from cpshard.ranges import ragged_arange


def _orders(world: int, passes: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[K, W]`` bool: whether rank ``q``'s chunk of pass ``t`` comes before (or is) this
    rank's, and whether this rank's comes before (or is) rank ``q``'s."""
    ranks = torch.arange(world)
    even = (torch.arange(passes) % 2 == 0)[:, None]
    before, after = ranks <= rank, ranks >= rank
    return torch.where(even, before, after), torch.where(even, after, before)


@dataclass(frozen=True)
class ZigzagRowTables:
    """This rank's row tables of its exchange into a key buffer of ``width`` rows
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
        deal, world = t.deal(), t.world
        nonempty = deal.every_nonempty()
        holds = nonempty > 0
        own = deal.own_sizes(rank)  # [R, K]
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
        nonempty = t.deal().nonempty(rank)
        held = nonempty > 0
        d = torch.nonzero(held).flatten()
        mine = t.deal().rank_sizes(d)  # [R', K, W]
        world, passes = t.world, mine.shape[1]
        if self.causal:
            p = (nonempty[held] - 1)[:, None, None]
            k = torch.arange(passes)[None, :, None]
            mine = mine * ((k < p) | ((k == p) & _orders(world, passes, rank)[0][None]))
        count = mine.sum(1).T.reshape(-1)  # [W * R']: by source, then document
        first = t.before_run()[d].T.reshape(-1)  # every source's local index at the start
        source = torch.arange(world).repeat_interleave(d.numel())
        row, base = t.run_row[d].repeat(world), self.base.repeat(world)
        return received_rows(first, count, source, row, base, self.width, t.position)


def zigzag_exchange(table: ZigzagRuns, rank: int, causal: bool) -> ClosedExchange:
    """Rank ``rank``'s :class:`~cpshard.planning.row_tables.ClosedExchange` without a window, in
    closed form from each run's deal (:mod:`~cpshard.planning.zigzag_counts`): O(runs + W)."""
    world = table.world
    deal = table.deal()
    passes = deal.passes
    own = deal.tokens()
    received = needed_without_window(deal, causal) - own
    sent = served_without_window(deal, causal) - own

    # Received: every source's chunks of the documents this rank holds, up to its last one:
    # the chunk sizes summed by this rank's last pass of the document (-1: holds none).
    by_last = deal.pass_sums(deal.nonempty(rank), passes + 1)
    if causal:
        q_first = _orders(world, passes, rank)[0]
        p = torch.arange(passes)
        before = (p[None, :] < p[:, None])[:, :, None]
        below = before | ((p[None, :] == p[:, None])[:, :, None] & q_first)
        recv_counts = (by_last[1:] * below).sum((0, 1))
    else:
        recv_counts = by_last[1:].sum((0, 1))

    reach = reach_of(deal, rank, causal)
    held = reach > 0
    row, start = table.run_row[held], table.run_start[held]
    mine = (row, start, start + reach[held])
    send_counts = sent_by(deal, rank, causal)
    return ClosedExchange(
        ZigzagRowTables, table, rank, causal, received, sent, recv_counts, send_counts, mine
    )
