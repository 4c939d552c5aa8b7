"""What every rank needs, serves and is sent in the ``per_document_head_tail`` layout's exchange
without a window, in closed form from each run's deal
(:class:`~cpshard.planning.zigzag_deal.ZigzagDeal`): O(runs + W) per step, no table of
(document, rank) pairs.

A *full* run gives every rank a token in every pass: rank ``r``'s last chunk is its pass ``K -
1`` chunk. A *short* run gives rank ``r`` its last token in pass ``M`` if ``r`` is in ``J``,
else in pass ``M - 1`` (none if ``M = 0``).

A rank needs a run it holds from its start to the end of its last chunk (causal) or to its end;
every count below sums, over the runs, a constant, a line in ``r`` or how many ranks of a
cyclic interval lie on one side of ``r`` (:mod:`~cpshard.planning.cyclic`).
"""

from __future__ import annotations

import torch

from cpshard.planning.cyclic import below_counts, count_below, cyclic_cover, cyclic_ramps
from cpshard.planning.zigzag_deal import ZigzagDeal


def reach_of(deal: ZigzagDeal, rank: int, causal: bool) -> torch.Tensor:
    """``[R]``: how many keys of each run rank ``rank`` needs (0: it holds none of it)."""
    w, last = deal.world, deal.passes - 1
    q, m, c, M, j = deal.q, deal.m, deal.c, deal.M, deal.j
    inside = deal.in_j(rank)
    if not causal:
        return deal.length * (deal.full | (M >= 1) | inside)
    # full: every earlier pass, and its last pass's chunks up to this rank's
    tail = (m - last * w).clamp(0, w)
    if last % 2 == 0:
        extras = count_below(c, tail, w, rank + 1)
    else:
        extras = tail - count_below(c, tail, w, rank)
    pos = int(deal.pos(last, rank))
    full = last * w * q + m.clamp(max=last * w) + q * (pos + 1) + extras
    # short: its last pass M (in J) or M - 1, every earlier pass complete
    le = count_below(c, j, w, rank + 1)
    ge = j - count_below(c, j, w, rank)
    in_last = M * w + torch.where(M % 2 == 0, le, ge)
    before = (M - 1) * w + deal.pos(M - 1, rank) + 1
    short = torch.where(inside, in_last, torch.where(M >= 1, before, 0))
    return torch.where(deal.full, full, short)


def needed_without_window(deal: ZigzagDeal, causal: bool) -> torch.Tensor:
    """``[W]``: the keys every rank needs, summed over the runs."""
    w, last = deal.world, deal.passes - 1
    ranks = torch.arange(w)
    if not causal:
        whole = deal.full | (deal.M >= 1)
        n = deal.length
        return (n * whole).sum() + cyclic_cover(deal.c, deal.j, w, weight=n * ~whole)[0]
    q, m, c = deal.q, deal.m, deal.c
    f = deal.full
    # full runs: every earlier pass, the last pass's chunks up to the rank's, its extras too
    tail = (m[f] - last * w).clamp(0, w)
    start = (last * w * q[f] + m[f].clamp(max=last * w)).sum()
    pos = deal.pos(last, ranks)
    extras = below_counts(cyclic_cover(c[f], tail, w)[0], ascending=last % 2 == 0)
    full = start + q[f].sum() * (pos + 1) + extras
    # short runs, ranks in J: the complete passes and J's ranks up to theirs in pass M
    M, c, j = deal.short()
    even = M % 2 == 0
    in_last = cyclic_cover(c, j, w, weight=M * w)[0] + _ranks_on_one_side(c, j, w, even)
    # ranks outside J (M >= 1): every pass before M - 1 and theirs in it: (M - 1) W + pos + 1
    some = M >= 1
    line_base = ((M - 1) * w + 1 + torch.where(M % 2 == 1, 0, w - 1)) * some
    line_slope = torch.where(M % 2 == 1, 1, -1) * some
    every = line_base.sum() + line_slope.sum() * ranks
    outside = every - cyclic_ramps(c, j, w, line_base, line_slope, line_base)
    return full + in_last + outside


def served_without_window(deal: ZigzagDeal, causal: bool) -> torch.Tensor:
    """``[W]``: every rank's tokens counted once per rank that needs them, over the runs."""
    w, last = deal.world, deal.passes - 1
    ranks = torch.arange(w)
    if not causal:  # every holder needs the whole run
        holders = torch.where(deal.full | (deal.M >= 1), w, deal.j)
        tokens = deal.q * deal.passes + deal.M
        return (holders * tokens).sum() + cyclic_cover(deal.c, deal.j, w, weight=holders)[0]
    # full runs: every rank needs every chunk of the earlier passes; of the last pass, the
    # chunks at or before its own
    sums = deal.pass_sums(deal.full.long(), 2)[1]  # [K, W]
    full = sums[:-1].sum(0) * w + sums[-1] * (w - deal.pos(last, ranks))
    # short runs: passes before M - 1 are needed by all; in pass M - 1, rank q's chunk by J and
    # by the ranks outside J whose chunk comes at or after it; in pass M (q in J), by J's
    # ranks whose chunk comes at or after it
    M, c, j = deal.short()
    some = M >= 1
    odd = (M - 1) % 2 == 1  # pass M - 1 runs backwards
    complete = ((M - 1).clamp(min=0) * w).sum() + (j * some).sum()
    after = (w - ranks) * (some & ~odd).sum() + (ranks + 1) * (some & odd).sum()
    cover = cyclic_cover(c, j, w, weight=some.long(), group=odd.long(), groups=2)
    in_j_after = below_counts(cover[0], ascending=False) + below_counts(cover[1], ascending=True)
    last_pass = _ranks_on_one_side(c, j, w, M % 2 == 1)
    return full + complete + after - in_j_after + last_pass


def sent_by(deal: ZigzagDeal, rank: int, causal: bool) -> torch.Tensor:
    """``[W]``: how many of its tokens rank ``rank`` sends every rank (its own included)."""
    w, last = deal.world, deal.passes - 1
    ranks = torch.arange(w)
    mine = deal.in_j(rank)
    own = deal.q * deal.passes + deal.M + mine  # its tokens of each run
    if not causal:
        whole = deal.full | (deal.M >= 1)
        return (own * whole).sum() + cyclic_cover(deal.c, deal.j, w, weight=own * ~whole)[0]
    f = deal.full

    def first(parity: int) -> torch.Tensor:  # [W]: its chunk of a pass comes first
        return ranks >= rank if parity % 2 == 0 else ranks <= rank

    # full runs: its chunks of every pass before the last, and of the last if it comes first
    last_size = deal.q + (deal.M + mine > last)  # its pass K - 1 chunk
    full = ((own - last_size) * f).sum() + (last_size * f).sum() * first(last)
    # short runs: to a rank in J, its first M chunks and its pass M one if it comes first; to
    # one outside J (M >= 1), its first M - 1 and its pass M - 1 one if it comes first
    M, c, j = deal.short()
    mine = mine[~f].long()
    even = M % 2 == 0
    lo = torch.where(even, rank, 0)  # the ranks r' its pass-M chunk comes before
    hi = torch.where(even, w, rank + 1)
    in_j = cyclic_cover(c, j, w, weight=M)[0] + _cover_within(c, j, w, lo, hi, mine)
    some = (M >= 1).long()
    lo1, hi1 = torch.where(even, 0, rank), torch.where(even, rank + 1, w)  # pass M - 1
    every = ((M - 1) * some).sum()
    every = every + (some * ~even).sum() * first(0) + (some * even).sum() * first(1)
    outside = every - cyclic_cover(c, j, w, weight=(M - 1) * some)[0]
    outside -= _cover_within(c, j, w, lo1, hi1, some)
    return full + in_j + outside


def _ranks_on_one_side(
    start: torch.Tensor, count: torch.Tensor, world: int, at_most: torch.Tensor
) -> torch.Tensor:
    """``[W]``: summed over the cyclic intervals ``J = [start, start + count)`` that hold rank
    ``r``, how many of ``J``'s ranks are at most ``r`` (``at_most``) or at least ``r``: a line
    in ``r`` on each of ``J``'s two plain ranges (``[start, W)`` and the wrapped ``[0, end -
    W)``, whose ranks all lie below the first's)."""
    end = start + count
    wrapped = (end - world).clamp(min=0)
    first = torch.where(at_most, 1 - start + wrapped, end.clamp(max=world))
    second = torch.where(at_most, 1, wrapped + world - start)
    return cyclic_ramps(start, count, world, first, torch.where(at_most, 1, -1), second)


def _cover_within(
    start: torch.Tensor, count: torch.Tensor, world: int, lo: torch.Tensor, hi: torch.Tensor,
    weight: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``[W]``: the weight of the cyclic intervals holding each rank, within ``[lo, hi)`` of
    each."""
    end = start + count
    wrapped = (end - world).clamp(min=0)
    a = torch.cat([start.maximum(lo), lo])
    b = torch.cat([end.clamp(max=world).minimum(hi), wrapped.minimum(hi)])
    b = b.maximum(a)
    return cyclic_cover(a, b - a, world, weight=weight.repeat(2))[0]
