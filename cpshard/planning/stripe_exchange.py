"""The needed-rows exchange of the ``stripe`` layout without a window, in closed form per
document (:mod:`~cpshard.planning.stripe_runs`): O(documents + W) per rank, no table of
(document, rank) pairs.

Rank ``r`` holds the positions ``p ≡ r (mod W)``: of a document at ``[s, s + n)``, those at
offsets ``f_r, f_r + W, ...`` with ``f_r = (r - s) mod W``. With ``n - 1 = a W + b``, rank ``r``
holds ``a + 1`` of its tokens if ``f_r <= b`` (the ranks of the cyclic interval ``B = [s, s + b
+ 1)`` mod ``W``), else ``a``; a *full* document (``a >= 1``) gives every rank a token. A rank
needs the document from its start to its last token (causal: ``f_r + 1 + W (a - 1 + [r in
B])`` keys) or to its end, and of rank ``q``'s tokens in those keys there are ``a_r + [f_q <=
f_r]``, ``a_r`` the rank's tokens before its last. Summed over the documents, each count is a
constant, a line in the rank on a cyclic interval, or how many cyclic intervals hold the rank
(:mod:`~cpshard.planning.cyclic`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.planning.cyclic import cyclic_cover, cyclic_ramps
from cpshard.planning.row_tables import ClosedExchange, received_rows
from cpshard.planning.stripe_runs import StripeRuns, below_on_rank
from cpshard.ranges import ragged_arange


@dataclass(frozen=True)
class _Documents:
    """Per document: its start's rank ``s0`` (``start mod W``), length ``n``, ``a`` and ``b``
    (``n - 1 = a W + b``) and whether it is full."""

    world: int
    s0: torch.Tensor
    n: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    full: torch.Tensor

    @classmethod
    def of(cls, table: StripeRuns) -> _Documents:
        w = table.world
        n = table.doc_end - table.doc_start
        a, b = (n - 1) // w, (n - 1) % w
        return cls(w, table.doc_start % w, n, a, b, a >= 1)

    def offset(self, rank: torch.Tensor | int) -> torch.Tensor:
        """``f_r``: rank ``rank``'s first offset in each document (broadcast)."""
        return torch.remainder(torch.as_tensor(rank) - self.s0, self.world)

    @property
    def holders(self) -> torch.Tensor:
        """How many ranks hold each document: ``W``, or ``n`` for a short one."""
        return torch.where(self.full, self.world, self.b + 1)


def stripe_exchange(table: StripeRuns, rank: int, causal: bool) -> ClosedExchange:
    """Rank ``rank``'s :class:`~cpshard.planning.row_tables.ClosedExchange` without a window,
    in closed form (module doc)."""
    docs = _Documents.of(table)
    w, s0, n, a, b, full = docs.world, docs.s0, docs.n, docs.a, docs.b, docs.full
    span = docs.holders  # the holders' cyclic interval from s0
    mine_first = docs.offset(rank)
    held = full | (mine_first <= b)
    ones = torch.ones_like(s0)
    own = table.tokens()
    if causal:
        last = a - 1 + (mine_first <= b)  # this rank's tokens of the document before its last
        needed = (
            cyclic_ramps(s0, span, w, 1 - s0, ones, w + 1 - s0)  # f_r + 1, over the holders
            + (w * (a - 1) * full).sum() + cyclic_cover(s0, b + 1, w, weight=w * full)[0]
        )  # fmt: skip
        served = (
            (n * full).sum() + cyclic_cover(s0, b + 1, w, weight=n * ~full)[0]
            - cyclic_ramps(s0, span, w, -s0, ones, w - s0)  # less f_q, over the holders
        )  # fmt: skip
        recv_counts = (last * held).sum() + cyclic_cover(s0, mine_first + 1, w, weight=held)[0]
        after = (span - mine_first).clamp(min=0)  # the holders at or after this rank
        send_counts = (
            ((a - 1) * full).sum() + cyclic_cover(s0, b + 1, w, weight=full.long())[0]
            + cyclic_cover(torch.full_like(s0, rank), after, w, weight=held.long())[0]
        )  # fmt: skip
        reach = (mine_first + 1 + w * last) * held
    else:
        needed = (n * full).sum() + cyclic_cover(s0, b + 1, w, weight=n * ~full)[0]
        served = (span * a).sum() + cyclic_cover(s0, b + 1, w, weight=span)[0]
        recv_counts = (a * held).sum() + cyclic_cover(s0, b + 1, w, weight=held.long())[0]
        tokens = a + (mine_first <= b)
        send_counts = (tokens * full).sum()
        send_counts = send_counts + cyclic_cover(s0, b + 1, w, weight=tokens * ~full * held)[0]
        reach = n * held
    row, start = table.doc_row[held], table.doc_start[held]
    mine = (row, start, start + reach[held])
    return ClosedExchange(
        StripeRowTables, table, rank, causal, needed - own, served - own, recv_counts,
        send_counts, mine,
    )  # fmt: skip


@dataclass(frozen=True)
class StripeRowTables:
    """This rank's row tables of its exchange into a key buffer of ``width`` rows per batch row
    (``base``: each held document's first buffer row less its start), made from the
    documents when read."""

    table: StripeRuns
    rank: int
    causal: bool
    width: int
    base: torch.Tensor

    def _counts(
        self, docs: _Documents, sender: torch.Tensor, receiver: torch.Tensor
    ) -> torch.Tensor:
        """How many of ``sender``'s tokens of each document lie in ``receiver``'s keys (0 when
        either holds none; broadcast)."""
        f_send, f_recv = docs.offset(sender), docs.offset(receiver)
        holds = (docs.full | (f_send <= docs.b)) & (docs.full | (f_recv <= docs.b))
        if self.causal:
            return (docs.a - 1 + (f_recv <= docs.b) + (f_send <= f_recv)) * holds
        return (docs.a + (f_send <= docs.b)) * holds

    def send_rows(self) -> torch.Tensor:
        """Every rank's keys among this rank's tokens of each document, by rank, then
        document: a range of its slots each."""
        t, w = self.table, self.table.world
        docs = _Documents.of(t)
        ranks = torch.arange(w)[:, None]
        counts = self._counts(docs, torch.tensor(self.rank), ranks)  # [W, D]
        first = t.doc_row * (t.padded // w) + below_on_rank(t.doc_start, self.rank, w)
        return ragged_arange(first.repeat(w), counts.reshape(-1))

    def recv_rows(self) -> torch.Tensor:
        """Every source's tokens in this rank's keys of each document it holds, by source,
        then document, at their buffer rows."""
        t, w = self.table, self.table.world
        docs = _Documents.of(t)
        held = docs.full | (docs.offset(self.rank) <= docs.b)
        ranks = torch.arange(w)[:, None]
        count = self._counts(docs, ranks, torch.tensor(self.rank))[:, held]  # [W, D']
        start = t.doc_start[held]
        first = below_on_rank(start[None], ranks, w)
        source = ranks.expand_as(count).reshape(-1)
        row, base = t.doc_row[held].repeat(w), self.base.repeat(w)
        return received_rows(first.reshape(-1), count.reshape(-1), source, row, base,
                             self.width, t.position)  # fmt: skip
