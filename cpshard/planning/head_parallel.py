"""The head-parallel plans of a step (pure host work): for the all-to-all over the whole CP group
(``heads``) and for the one inside each node of a 2-D ``(inter, intra)`` CP mesh
(``hierarchical``).

After the all-to-all over a node's ranks (the whole group: one node), each rank holds its heads
for the union of the node's shards. The ranks that hold the same heads (one per node) then form
a CP group of their own whose "shards" are those unions, sorted into global order: the inner
plan attends them like any layout's (one node: a plain per-document attention, nothing
exchanged; several: the needed-rows exchange between nodes, or the halo when the shards are
contiguous).
"""

from __future__ import annotations

import torch

from cpshard.layouts import ShardLayout
from cpshard.layouts.owners import owner_to_indices


def node_layout(layout: ShardLayout, nodes: int, per_node: int) -> tuple[ShardLayout, list]:
    """The layout whose rank e holds the union of the shards of flat ranks ``e * per_node`` ..
    ``e * per_node + per_node - 1`` in global order, and every node's ``order``: where each
    token of its gathered (rank-major) shards goes in that order (None: they already are). A
    node's gathered shards are one range of the rank-major order, so its union is the positions
    whose rank-major slot lies in that range (the runs of one node, sorted by node: no sort of
    the sequence)."""
    padded = layout.padded_seq_len
    if layout.contiguous_shards:  # the unions are contiguous and already in order
        return ShardLayout("contiguous", nodes, padded, padded), [None] * nodes
    inv = layout.rank_major_inverse().to("cpu", torch.int64)  # [P] or [B, P]
    if nodes == 1:  # the union is every position, its order the rank-major slot of each
        order = None if _ascending_shards(layout, inv) else inv.contiguous()
        return ShardLayout("contiguous", 1, padded, padded), [order]
    size = padded // max(nodes, 1)  # tokens of a node
    rows = inv if inv.dim() == 2 else inv[None]
    per_row = owner_to_indices(rows // size, nodes)  # [nodes, B, size]: by node, then position
    gathered = rows[None].expand(nodes, -1, -1).gather(-1, per_row)
    unions = per_row if inv.dim() == 2 else per_row[:, 0]
    gathered = gathered if inv.dim() == 2 else gathered[:, 0]
    orders = []
    for e in range(nodes):
        order = gathered[e] - e * size
        same = bool(torch.equal(order, torch.arange(size).expand_as(order)))
        orders.append(None if same else order.contiguous())
    return ShardLayout(f"{layout.name} by node", nodes, padded, padded, unions.contiguous()), orders


def _ascending_shards(layout: ShardLayout, inv: torch.Tensor) -> bool:
    """Whether the ranks' shards back to back (rank-major: ``inv`` the slot of each position)
    are already in global order. Carried shards each ascend, so they are exactly when every
    rank's last position comes before the next rank's first (O(W) per row); a closed form's are
    compared in full."""
    idx = layout.local_token_global_indices
    if isinstance(idx, torch.Tensor) and idx.shape[-1]:
        return bool((idx[:-1, ..., -1] < idx[1:, ..., 0]).all())
    return bool(torch.equal(inv, torch.arange(inv.shape[-1]).expand_as(inv)))


def head_parallel_kinds(strategy: str, mesh: tuple[int, int] | None) -> tuple[str, ...]:
    """The head-parallel plans ``strategy`` may use on a CP group (or a 2-D mesh of ``(nodes,
    ranks per node)``): none for ``needed_rows``; ``auto`` plans ``heads`` and, on a mesh whose
    dims both exceed one rank, ``hierarchical``."""
    kinds = []
    if strategy in ("heads", "auto"):
        kinds.append("heads")
    if mesh is not None and (strategy == "hierarchical" or (strategy == "auto" and min(mesh) > 1)):
        kinds.append("hierarchical")
    return tuple(kinds)
