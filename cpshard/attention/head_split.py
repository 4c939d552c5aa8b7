"""Which query and key/value heads each rank of a head-parallel all-to-all attends.

Every rank's query heads share key/value heads in the model's fixed ratio, so each rank attends
plain GQA (``q_count`` a multiple of ``kv_count``):

* at least as many key/value heads as ranks: each rank takes whole groups (a key/value head and
  its query heads), as evenly as whole groups allow (heads not divisible by W: some ranks take
  one group more);
* fewer key/value heads than ranks (GQA with few KV heads): each group's ranks split its query
  heads as evenly as they can and each receives the group's one key/value head (a replica; its
  gradients are summed back to its owner).

A rank may get no heads (fewer query heads than ranks): it exchanges nothing and attends nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class HeadSplit:
    """Per rank: ``q[r] = (first query head, count)`` and ``kv[r]`` likewise."""

    q: tuple[tuple[int, int], ...]
    kv: tuple[tuple[int, int], ...]

    def flat(self) -> list[int]:
        """The ranges as the head all-to-all takes them (query part, then key/value part)."""
        return [v for part in (self.q, self.kv) for rng in part for v in rng]


def _even(total: int, parts: int, i: int) -> int:
    """Start of part ``i`` when ``total`` splits into ``parts`` as evenly as possible."""
    return i * total // parts


@lru_cache(maxsize=256)
def split_heads(q_heads: int, kv_heads: int, world: int) -> HeadSplit:
    """The split of ``q_heads`` query and ``kv_heads`` key/value heads (``q_heads`` a multiple
    of ``kv_heads``) over ``world`` ranks (module docstring)."""
    if kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} must be a multiple of key/value heads {kv_heads}")
    group = q_heads // kv_heads
    q, kv = [], []
    if kv_heads >= world:
        for r in range(world):
            lo, hi = _even(kv_heads, world, r), _even(kv_heads, world, r + 1)
            q.append((lo * group, (hi - lo) * group))
            kv.append((lo, hi - lo))
    else:
        for r in range(world):
            head = next(h for h in range(kv_heads) if _even(world, kv_heads, h + 1) > r)
            first, ranks = _even(world, kv_heads, head), _even(world, kv_heads, head + 1)
            i, n = r - first, ranks - first
            lo, hi = _even(group, n, i), _even(group, n, i + 1)
            q.append((head * group + lo, hi - lo))
            kv.append((head, 1 if hi > lo else 0))
    return HeadSplit(tuple(q), tuple(kv))
