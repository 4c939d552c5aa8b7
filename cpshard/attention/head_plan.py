"""A step's head-parallel plans (host work, once per step): for the all-to-all over the whole
CP group (``heads``) and for the one inside each node of a 2-D ``(inter, intra)`` CP mesh
(``hierarchical``).

After the all-to-all over a node's ranks (the whole group: one node), each rank holds its heads
for the union of the node's shards. The ranks that hold the same heads (one per node) then
form a CP group of their own whose "shards" are those unions, sorted into global order: the
inner state plans their attention like any layout's (one node: a plain per-document attention,
nothing exchanged; several: the needed-rows exchange between nodes, or the halo when the
shards are contiguous).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpshard.attention.placement import pinned
from cpshard.attention.state import AttentionState, HeadParallel
from cpshard.comm import Group
from cpshard.layouts import ShardLayout

PlanStep = Callable[..., AttentionState]


def _node_layout(layout: ShardLayout, nodes: int, per_node: int) -> tuple[ShardLayout, list]:
    """The layout whose rank e holds the union of the shards of flat ranks ``e * per_node`` ..
    ``e * per_node + per_node - 1`` in global order, and every node's ``order``: where each
    token of its gathered (rank-major) shards goes in that order. A node's gathered shards are
    one range of the rank-major order, so its union is the positions whose rank-major slot
    lies in that range (one stable sort by node, none for one node)."""
    padded = layout.padded_seq_len
    if layout.contiguous_shards:  # the unions are contiguous and already in order
        return ShardLayout("contiguous", nodes, padded, padded), [None] * nodes
    inv = layout.rank_major_inverse().to("cpu", torch.int64)  # [P] or [B, P]
    size = padded // max(nodes, 1)  # tokens of a node
    if nodes == 1:  # the union is every position, its order the rank-major slot of each
        unions, gathered = torch.arange(padded).expand_as(inv)[None], inv[None]
    else:
        node = inv // size
        perm = torch.sort(node, dim=-1, stable=True).indices  # by node, ascending positions
        gathered = inv.gather(-1, perm)
        unions = perm.unflatten(-1, (nodes, size)).movedim(-2, 0)
        gathered = gathered.unflatten(-1, (nodes, size)).movedim(-2, 0)
    orders = []
    for e in range(nodes):
        order = gathered[e] - e * size
        same = bool(torch.equal(order, torch.arange(size).expand_as(order)))
        orders.append(None if same else order.contiguous())
    if nodes == 1:  # the union is every position
        return ShardLayout("contiguous", 1, padded, padded), orders
    return ShardLayout(f"{layout.name} by node", nodes, padded, padded, unions.contiguous()), orders


def _plan(
    kind: str,
    intra: Group,
    inter: Group,
    layout: ShardLayout,
    doc: torch.Tensor,
    device: torch.device | None,
    plan_step: PlanStep,
) -> HeadParallel:
    merged, orders = _node_layout(layout, inter.world, intra.world)
    inner = plan_step(inter, merged, doc, device)
    order = orders[inter.rank]
    return HeadParallel(kind, intra, inner, None if order is None else pinned(order))


def head_parallel_plans(
    group: Group,
    layout: ShardLayout,
    doc: torch.Tensor,
    device: torch.device | None,
    strategy: str,
    mesh: tuple[Group, Group] | None,
    plan_step: PlanStep,
) -> tuple[HeadParallel, ...]:
    """The head-parallel plans ``strategy`` may use (none for ``needed_rows``; ``auto`` plans
    ``heads`` and, on a 2-D mesh whose dims both exceed one rank, ``hierarchical``).
    ``plan_step(group, layout, doc, device)`` plans an inner state (the step's own planner)."""
    if strategy == "needed_rows":
        return ()
    if strategy == "hierarchical" and mesh is None:
        raise ValueError(
            f"cpshard CP attention: rank {group.rank}: strategy='hierarchical' needs a 2-D CP "
            "mesh (inter, intra)"
        )
    plans = []
    if strategy in ("heads", "auto"):
        plans.append(_plan("heads", group, Group(None, 0, 1), layout, doc, device, plan_step))
    if mesh is not None and (
        strategy == "hierarchical" or (strategy == "auto" and min(m.world for m in mesh) > 1)
    ):
        inter, intra = mesh
        plans.append(_plan("hierarchical", intra, inter, layout, doc, device, plan_step))
    return tuple(plans)
