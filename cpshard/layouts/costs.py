"""The cost model the planned layouts balance: causal attention inside documents.

A token at offset ``t`` of its document attends to ``t + 1`` keys; a rank's cost is the sum over
its tokens (padding costs nothing). A piece ``[a, b)`` of a document (offsets) costs
``pairs(b) - pairs(a)`` with ``pairs(n) = n (n + 1) / 2``. A *document* is a maximal run of one
non-zero id (0 = padding), as everywhere in cpshard.
"""

from __future__ import annotations

import torch

__all__ = ["attended_pairs", "piece_cost", "rank_costs", "token_costs"]


def attended_pairs(n: int) -> int:
    """Causal (query, key) pairs of a document of ``n`` tokens: ``n (n + 1) / 2``."""
    return n * (n + 1) // 2


def piece_cost(offset: int, n: int) -> int:
    """Causal pairs of the ``n`` tokens at ``offset`` of their document."""
    return attended_pairs(offset + n) - attended_pairs(offset)


def token_costs(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, P]`` int64: the keys each token attends to (its offset in its document + 1; 0 for
    padding)."""
    ids = doc_ids.to(torch.int64)
    rows, length = ids.shape
    if length == 0:
        return torch.zeros_like(ids)
    pos = torch.arange(length).expand(rows, length)
    change = torch.ones_like(ids, dtype=torch.bool)
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    run_start = torch.cummax(torch.where(change, pos, torch.zeros_like(pos)), dim=1).values
    return (pos - run_start + 1) * (ids != 0)


def rank_costs(doc_ids: torch.Tensor, owner: torch.Tensor, world: int) -> torch.Tensor:
    """``[W]`` int64: every rank's causal-attention cost (sum of its tokens' attended keys)."""
    return torch.zeros(world, dtype=torch.int64).scatter_add_(
        0, owner.reshape(-1).to(torch.int64), token_costs(doc_ids).reshape(-1)
    )
