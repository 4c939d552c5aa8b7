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


def node_layout(layout: ShardLayout, nodes: int, per_node: int) -> tuple[ShardLayout, list]:
    """The layout whose rank e holds the union of the shards of flat ranks ``e * per_node`` ..
    ``e * per_node + per_node - 1`` in global order, and every node's ``order``: where each
    token of its gathered (rank-major) shards goes in that order (None: they already are). A
    node's gathered shards are one range of the rank-major order, so its union is the positions
    whose rank-major slot lies in that range (one stable sort by node, none for one node)."""
    padded = layout.padded_seq_len
    if layout.contiguous_shards:  # the unions are contiguous and already in order
        return ShardLayout("contiguous", nodes, padded, padded), [None] * nodes
    inv = layout.rank_major_inverse().to("cpu", torch.int64)  # [P] or [B, P]
    size = padded // max(nodes, 1)  # tokens of a node
    if nodes == 1:  # the union is every position, its order the rank-major slot of each
        unions, gathered = torch.arange(padded).expand_as(inv)[None], inv[None]
    else:
        perm = torch.sort(inv // size, dim=-1, stable=True).indices  # by node, then position
        gathered = inv.gather(-1, perm).unflatten(-1, (nodes, size)).movedim(-2, 0)
        unions = perm.unflatten(-1, (nodes, size)).movedim(-2, 0)
    orders = []
    for e in range(nodes):
        order = gathered[e] - e * size
        same = bool(torch.equal(order, torch.arange(size).expand_as(order)))
        orders.append(None if same else order.contiguous())
    if nodes == 1:  # the union is every position
        return ShardLayout("contiguous", 1, padded, padded), orders
    return ShardLayout(f"{layout.name} by node", nodes, padded, padded, unions.contiguous()), orders


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
