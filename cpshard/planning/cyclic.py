"""Counts over cyclic intervals of ranks: a zig-zagged run deals its extra tokens to ranks ``c, c
+ 1, ...`` (mod ``W``), so what every rank gets from many runs is how many of their cyclic
intervals ``[c, c + count)`` hold it, summed with difference arrays in O(intervals + W) instead
of a ``[runs, W]`` table."""

from __future__ import annotations

import torch


def in_cyclic(start: torch.Tensor, count: torch.Tensor, world: int) -> torch.Tensor:
    """``[N, W]`` bool: whether rank ``r`` lies in the cyclic interval ``[start, start + count)``
    (mod ``W``; ``0 <= start < W``, ``0 <= count <= W``) of each of the ``N`` rows."""
    ranks = torch.arange(world)
    end = (start + count)[:, None]
    inside = (ranks >= start[:, None]) & (ranks < end)
    return inside.logical_or_(ranks < end - world)


def count_below(
    start: torch.Tensor, count: torch.Tensor, world: int, rank: torch.Tensor | int
) -> torch.Tensor:
    """How many ranks of each cyclic interval ``[start, start + count)`` lie below ``rank``
    (``0 <= rank <= W``; elementwise)."""
    wrapped = (start + count - world).clamp(min=0)  # the part past W, from rank 0
    return (rank - start).clamp(min=0).minimum(count) + wrapped.clamp(max=rank)


def cyclic_cover(
    start: torch.Tensor, count: torch.Tensor, world: int, weight: torch.Tensor | None = None,
    group: torch.Tensor | None = None, groups: int = 1,
) -> torch.Tensor:  # fmt: skip
    """``[groups, W]``: the ``weight`` (default 1) of the cyclic intervals ``[start, start +
    count)`` (mod ``W``; ``0 <= start < W``, ``0 <= count <= W``) of each group (``group``,
    default all one) that hold each rank."""
    (lo, hi), (lo2, hi2) = _segments(start, count, world)
    w = torch.ones_like(start) if weight is None else weight.long()
    return _sums(torch.cat([lo, lo2]), torch.cat([hi, hi2]), torch.cat([w, w]), None, world,
                 None if group is None else group.repeat(2), groups)  # fmt: skip


def cyclic_ramps(
    start: torch.Tensor, count: torch.Tensor, world: int, base: torch.Tensor, slope: torch.Tensor,
    wrap_base: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``[W]``: the sum over the cyclic intervals ``[start, start + count)`` of ``base + slope
    r`` at every rank ``r`` they hold, ``wrap_base + slope r`` at those past the wrap (ranks
    below ``start``)."""
    (lo, hi), (lo2, hi2) = _segments(start, count, world)
    return _sums(torch.cat([lo, lo2]), torch.cat([hi, hi2]), torch.cat([base, wrap_base]),
                 slope.repeat(2), world)[0]  # fmt: skip


def below_counts(cover: torch.Tensor, ascending: bool) -> torch.Tensor:
    """From a cover ``[W]`` (how many intervals hold each rank): how many of their ranks are at
    most ``r`` (``ascending``) or at least ``r``, summed over the intervals, for every ``r``."""
    if ascending:
        return torch.cumsum(cover, 0)
    return torch.cumsum(cover.flip(0), 0).flip(0)


def _segments(
    start: torch.Tensor, count: torch.Tensor, world: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Each cyclic interval as two plain ranges: ``[start, min(end, W))`` and the wrapped
    ``[0, end - W)`` (empty when it does not wrap)."""
    end = start + count
    wrapped = (end - world).clamp(min=0)
    return (start, end.clamp(max=world)), (torch.zeros_like(start), wrapped)


def _sums(
    lo: torch.Tensor, hi: torch.Tensor, base: torch.Tensor, slope: torch.Tensor | None,
    world: int, group: torch.Tensor | None = None, groups: int = 1,
) -> torch.Tensor:  # fmt: skip
    """``[groups, W]``: the sum of ``base + slope r`` over the ranges ``[lo, hi)`` (of each
    group) holding every rank ``r``: difference arrays of the base and the slope."""
    span = world + 1
    at = torch.zeros_like(lo) if group is None else group * span
    out = torch.zeros(groups * span, dtype=torch.int64)
    out.index_add_(0, at + lo, base).index_add_(0, at + hi, -base)
    out = torch.cumsum(out.view(groups, span), 1)[:, :world]
    if slope is not None:
        steep = torch.zeros(groups * span, dtype=torch.int64)
        steep.index_add_(0, at + lo, slope).index_add_(0, at + hi, -slope)
        out += torch.cumsum(steep.view(groups, span), 1)[:, :world] * torch.arange(world)
    return out
