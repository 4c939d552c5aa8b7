"""How the ``per_document_head_tail`` layout deals each run of a row, in closed form: what every
closed-form count of its planning is made from.

A run of ``n = q C + m`` tokens has ``K = C / W`` passes of chunks, each ``q`` tokens plus its
extra: the ``e``-th extra widens the pass-``e // W`` chunk of rank ``(c + e) mod W`` (``c``: the
extras counter at the run). So every rank gets ``M = m // W`` extras, in passes ``0 .. M - 1``,
and the ranks of the cyclic interval ``J = [c, c + m mod W)`` one more, in pass ``M``. A *full*
run (``q > 0``) gives every rank a token in every pass; a *short* one (``q = 0``) gives rank
``r`` its tokens in its first ``M + [r in J]`` passes. Inside a pass, chunks run by rank on even
passes and backwards on odd ones (``pos(r) = r`` or ``W - 1 - r``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.planning.cyclic import count_below, cyclic_cover, in_cyclic


@dataclass(frozen=True)
class ZigzagDeal:
    """Every run's deal (module doc; zeros for padding runs): ``q``, ``m``, the counter ``c``,
    ``M`` and ``J``'s length ``j``, ``full``; ``world`` and ``passes``."""

    world: int
    passes: int
    q: torch.Tensor
    m: torch.Tensor
    c: torch.Tensor
    M: torch.Tensor
    j: torch.Tensor
    full: torch.Tensor

    @classmethod
    def of(cls, length: torch.Tensor, counter: torch.Tensor, world: int, chunks: int) -> ZigzagDeal:
        """The deal of runs of ``length`` tokens (0 for padding runs) with extras ``counter``."""
        q, m = length // chunks, length % chunks
        return cls(world, chunks // world, q, m, counter, m // world, m % world, q > 0)

    @property
    def length(self) -> torch.Tensor:
        return self.q * self.passes * self.world + self.m

    def pos(self, parity: torch.Tensor | int, rank: torch.Tensor | int) -> torch.Tensor:
        """Where rank ``rank``'s chunk sits in a pass of that parity (elementwise)."""
        rank = torch.as_tensor(rank)
        return torch.where(torch.as_tensor(parity) % 2 == 0, rank, self.world - 1 - rank)

    def in_j(self, rank: int) -> torch.Tensor:
        """``[R]`` bool: whether ``rank`` is in each run's ``J``."""
        c, j, w = self.c, self.j, self.world
        return count_below(c, j, w, rank + 1) > count_below(c, j, w, rank)

    def nonempty(self, rank: int) -> torch.Tensor:
        """``[R]``: how many of ``rank``'s chunks of each run are non-empty (its first ones)."""
        return torch.where(self.full, self.passes, self.M + self.in_j(rank))

    def every_nonempty(self) -> torch.Tensor:
        """``[R, W]``: :meth:`nonempty` of every rank."""
        count = self.M[:, None] + in_cyclic(self.c, self.j, self.world)
        return count.masked_fill_(self.full[:, None], self.passes)

    def short(self) -> tuple[torch.Tensor, ...]:
        """The short runs' ``M``, ``c``, ``j`` (padding runs among them: they hold nothing)."""
        s = ~self.full
        return self.M[s], self.c[s], self.j[s]

    def own_sizes(self, rank: int) -> torch.Tensor:
        """``[R, K]``: rank ``rank``'s chunk of every pass of each run."""
        w = self.world
        first_extra = rank - self.c + w * (self.c > rank)  # (rank - c) mod W
        extra = torch.arange(self.passes) * w + first_extra[:, None] < self.m[:, None]
        return self.q[:, None] + extra

    def _pass_extras(self, m: torch.Tensor) -> torch.Tensor:
        """``[R, K]``: how many extras of runs with ``m`` extras each pass deals."""
        return (m[:, None] - torch.arange(self.passes) * self.world).clamp_(0, self.world)

    def rank_sizes(self, runs: torch.Tensor) -> torch.Tensor:
        """``[R', K, W]``: every rank's chunk of every pass of the runs ``runs``."""
        q, m, c = self.q[runs], self.m[runs], self.c[runs]
        extras = self._pass_extras(m)
        cover = in_cyclic(c[:, None].expand_as(extras).reshape(-1), extras.reshape(-1), self.world)
        return cover.view(-1, self.passes, self.world) + q[:, None, None]

    def pass_sums(self, by: torch.Tensor, groups: int) -> torch.Tensor:
        """``[groups, K, W]``: every rank's chunk of every pass summed over the runs of each
        group ``by`` (``[R]``, in ``[0, groups)``): the tokens every chunk has before the extras,
        plus how many runs of the group deal the rank an extra in the pass."""
        passes = self.passes
        base = torch.zeros(groups, dtype=torch.int64).index_add_(0, by, self.q)
        key = (by[:, None] * passes + torch.arange(passes)).reshape(-1)
        cover = cyclic_cover(
            self.c.repeat_interleave(passes), self._pass_extras(self.m).reshape(-1), self.world,
            group=key, groups=groups * passes,
        )  # fmt: skip
        return cover.view(groups, passes, self.world) + base[:, None, None]

    def tokens(self) -> torch.Tensor:
        """``[W]``: every rank's tokens: ``K q + M`` of every run, plus one per run whose ``J``
        holds it."""
        every = int((self.q * self.passes + self.M).sum())
        return cyclic_cover(self.c, self.j, self.world)[0] + every
