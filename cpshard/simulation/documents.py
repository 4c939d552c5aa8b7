"""Document lengths of a simulated packed sequence, from a spec, and their ``[1, S]`` ids.

Specs (``--docs``): an explicit comma list of lengths (``4096,1000,20``; the rest of the
sequence is padding), ``one`` (a single document of S tokens), ``equal:N`` (N documents of
near-equal lengths), ``uniform:N`` (N documents, lengths drawn uniformly) or ``pareto:N`` (N
long-tailed documents, lengths drawn from a Pareto law of index :data:`PARETO_ALPHA`). Drawn
lengths are scaled to sum to S exactly (each >= 1) and are fixed by the seed.
"""

from __future__ import annotations

import random

import torch

PARETO_ALPHA = 1.2  # a long tail: a few documents hold most tokens
DISTRIBUTIONS = ("equal", "uniform", "pareto")


def _scaled(weights: list[float], seq_len: int) -> list[int]:
    """Lengths >= 1 proportional to ``weights`` that sum to ``seq_len``."""
    spare, total = seq_len - len(weights), sum(weights)
    bounds, acc = [0], 0.0
    for w in weights:
        acc += w
        bounds.append(int(acc / total * spare))
    bounds[-1] = spare
    return [1 + b - a for a, b in zip(bounds, bounds[1:])]


def document_lengths(spec: str, seq_len: int, seed: int = 0) -> list[int]:
    """The lengths ``spec`` gives a sequence of ``seq_len`` tokens (see the module)."""
    text = spec.strip()
    if text == "one":
        return [seq_len]
    kind, sep, count = text.partition(":")
    if sep:
        if kind not in DISTRIBUTIONS:
            raise ValueError(
                f"--docs: unknown distribution {kind!r}; choose from {', '.join(DISTRIBUTIONS)}"
            )
        if not count.isdigit() or not 1 <= int(count) <= seq_len:
            raise ValueError(f"--docs: {text!r} needs a document count in 1..{seq_len}")
        n, rng = int(count), random.Random(seed)
        if kind == "equal":
            weights = [1.0] * n
        elif kind == "uniform":
            weights = [rng.random() + 1e-9 for _ in range(n)]
        else:
            weights = [rng.paretovariate(PARETO_ALPHA) for _ in range(n)]
        return _scaled(weights, seq_len)
    try:
        lengths = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--docs: {spec!r} is neither a list of lengths nor one, equal:N, uniform:N, pareto:N"
        ) from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--docs: {spec!r} needs lengths >= 1")
    if sum(lengths) > seq_len:
        raise ValueError(f"--docs: the lengths sum to {sum(lengths)}, more than --seq-len {seq_len}")
    return lengths


def document_ids(lengths: list[int], seq_len: int) -> torch.Tensor:
    """``[1, seq_len]`` int64 ids 1..n of consecutive documents of ``lengths``, then 0 (padding)."""
    ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))
    return torch.cat([ids, ids.new_zeros(seq_len - ids.numel())]).view(1, -1)
