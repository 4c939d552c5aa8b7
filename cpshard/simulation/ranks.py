"""Which ranks of a W-rank job to simulate: all of a small job, else a spread and a sample."""

from __future__ import annotations

import random

ALL_UP_TO = 64  # jobs up to this many ranks simulate every rank by default
SAMPLE = 4  # ranks drawn at random beyond the spread (0, 1, W/2, W-1)


def default_ranks(world: int, seed: int = 0) -> list[int]:
    """Every rank when ``world <= ALL_UP_TO``; else 0, 1, W/2, W-1 and :data:`SAMPLE` more
    drawn with ``seed``."""
    if world <= ALL_UP_TO:
        return list(range(world))
    spread = {0, 1, world // 2, world - 1}
    rest = [r for r in range(world) if r not in spread]
    return sorted(spread | set(random.Random(seed).sample(rest, SAMPLE)))


def parse_ranks(text: str, world: int, seed: int = 0) -> list[int]:
    """``--ranks``: ``default``, ``all`` or a comma list of ranks below ``world``."""
    text = text.strip()
    if text == "default":
        return default_ranks(world, seed)
    if text == "all":
        return list(range(world))
    try:
        ranks = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise ValueError(f"--ranks: {text!r} is not all, default or a list of ranks") from None
    if not ranks or ranks[0] < 0 or ranks[-1] >= world:
        raise ValueError(f"--ranks: {text!r} needs ranks in 0..{world - 1}")
    return ranks
