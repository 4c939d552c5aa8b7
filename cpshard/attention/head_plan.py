"""A step's head-parallel states from its plans (:mod:`cpshard.planning.head_parallel`): the
all-to-all's group, the inner state of the ranks that hold the same heads, and the token order.

``heads`` runs its all-to-all over the whole CP group and attends alone (an inner group of one
rank); ``hierarchical`` runs it inside each node of a 2-D ``(inter, intra)`` CP mesh and
exchanges between the nodes' ranks that hold the same heads (the ``inter`` group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpshard.attention.placement import pinned
from cpshard.attention.state import AttentionState, HeadParallel
from cpshard.comm import Group
from cpshard.planning import StepPlan

# (group, plan, device) -> the plan's causal state (the step's own builder)
BuildState = Callable[[Group, StepPlan, "torch.device | None"], AttentionState]


def head_parallel_states(
    group: Group,
    plan: StepPlan,
    device: torch.device | None,
    mesh: tuple[Group, Group] | None,
    build: BuildState,
) -> tuple[HeadParallel, ...]:
    """The :class:`HeadParallel` of each of ``plan``'s head-parallel plans, their inner states
    built by ``build`` over their groups."""
    states = []
    for hp in plan.head_parallel:
        if hp.kind == "heads":
            intra, inter = group, Group(None, 0, 1)
        else:
            assert mesh is not None, "a hierarchical plan needs the 2-D mesh's groups"
            inter, intra = mesh
        inner = build(inter, hp.inner, device)
        order = None if hp.order is None else pinned(hp.order)
        states.append(HeadParallel(hp.kind, intra, inner, order))
    return tuple(states)
