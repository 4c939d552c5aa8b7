"""Which step's CP attention context a sharded batch's tokens belong to.

The producers of a CP step's batch (``ContextParallelSharder``'s built-in ``shard_batch``,
``make_cp_blockdiag_batch_and_ctx``) register the ``position_ids`` tensor they put in the sharded
batch against the step's attention state. The attention entry points that see the model's
``position_ids`` (:func:`cpshard.cp_attention` with ``position_ids=``, the transformers
``"cpshard"`` attention) look it up: tokens sharded for another step or layout than the active
context's, or sharded tokens attended with no context active, raise instead of attending wrongly
without an error (a ``stripe`` batch under the block-diagonal context has the same local length,
so the shape checks pass).

The lookup follows the tensor object through an identity map that keeps neither the tensor nor
the state alive: a host-side dict lookup, no device read, nothing that syncs. Tensors nobody
registered are not checked: position ids a model derives itself (Qwen3-VL's mRoPE), or a copy
of the batch's (``.to(device)`` onto another device). Under ``torch.compile`` tracing the lookup
is skipped (a traced graph has no tensor identity to follow); eager calls check.

The same map lets an activation-checkpoint recompute find its step: a layer re-run during
backward (``torch.utils.checkpoint``, transformers' ``gradient_checkpointing_enable``, torch's
``checkpoint_wrapper``) after the step's ``with ctx():`` has exited gets the same
``position_ids`` object it had in the forward, and :func:`state_for_tokens` returns that step's state,
so the recompute attends as the forward did wherever ``backward()`` is called.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:  # the state is only named in annotations here
    from cpshard.attention.state import AttentionState


@dataclass(frozen=True)
class _Origin:
    """The step a registered ``position_ids`` tensor was sharded for."""

    state: weakref.ref[AttentionState]
    layout: str
    rank: int


_origins: WeakIdKeyDictionary = WeakIdKeyDictionary()


_POSITIONS = "the sharded batch's position_ids"


def register_tokens(position_ids: torch.Tensor, state: AttentionState) -> None:
    """Record ``position_ids`` (of a sharded batch) as tokens of ``state``'s step, and keep them
    in the step's state (:func:`step_positions`)."""
    _origins[position_ids] = _Origin(weakref.ref(state), state.layout, state.group.rank)
    state.derived[_POSITIONS] = position_ids


def step_positions(state: AttentionState) -> torch.Tensor | None:
    """The position ids the step's sharded batch holds (``[B, L]``: each token's position in
    its document, as the sharder made or kept them), or None (no batch registered): for a layer
    that needs them where its model does not pass them on."""
    return state.derived.get(_POSITIONS)  # type: ignore[return-value]


def token_problem(position_ids: torch.Tensor | None, state: AttentionState | None) -> str | None:
    """Why attention under ``state`` (the active one, None outside any context) must not run on
    tokens whose positions are ``position_ids``, or None (also for unregistered tensors)."""
    if position_ids is None or torch.compiler.is_compiling():
        return None
    origin = _origins.get(position_ids)
    if origin is None:
        return None
    if state is None:
        return (
            f"position_ids: sharded tokens passed outside their step's CP attention context (a "
            f"{origin.layout!r} batch); run the model's forward inside the context it came with "
            "(backward, and activation-checkpoint recomputes in it, may run outside)"
        )
    if origin.state() is state:
        return None
    whose = "another step's" if origin.layout == state.layout else "a"
    return (
        f"position_ids: tokens of {whose} {origin.layout!r} sharded batch attended under the "
        f"active {state.layout!r} CP attention context; run the model on the batch the context "
        "came with"
    )


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (a checkpointed
    layer's recompute runs there)."""
    return torch._C._current_graph_task_id() != -1


def state_for_tokens(
    position_ids: torch.Tensor | None, active: AttentionState | None
) -> AttentionState | None:
    """The state CP attention must run under for tokens ``position_ids``: ``active`` (the
    innermost active context's, or None), except for a recompute during backward, where a
    sharded batch's tokens get their own step's state even after its context has exited.

    Raises ``RuntimeError`` (naming the rank) for a recompute whose step's state is gone (the
    context object was dropped before ``backward()``)."""
    if position_ids is None or torch.compiler.is_compiling() or not in_backward():
        return active
    origin = _origins.get(position_ids)
    if origin is None:
        return active
    state = origin.state()
    if state is None:
        raise RuntimeError(
            f"cpshard CP attention: rank {origin.rank}: an activation-checkpoint recompute in "
            f"backward ran a layer on a {origin.layout!r} sharded batch whose step's attention "
            "state is gone; keep the context returned by ContextParallelSharder.shard / "
            "make_cp_blockdiag_batch_and_ctx alive until backward() has run"
        )
    return state


def check_recompute_found(what: str, layer: str) -> None:
    """Raise ``ValueError`` (naming ``what``) when a ``layer`` runs during backward with no CP
    context active while some CP step is alive: an activation-checkpoint recompute whose step
    could not be found (its ``position_ids`` are not the sharded batch's, or it sees none), which
    would otherwise run on the rank's shard alone. (A model outside CP recomputed while a CP
    step is alive is refused too: the two cannot be told apart here.)"""
    from cpshard.attention.state import any_step_alive

    if in_backward() and any_step_alive() and not torch.compiler.is_compiling():
        raise ValueError(
            f"{what}: a checkpointed {layer} was recomputed during backward outside its CP "
            "step's context, where cpshard cannot find its step; call backward() inside the "
            "`with ctx():` block when such layers are checkpointed"
        )


def check_outside(position_ids: torch.Tensor | None, what: str) -> None:
    """Raise ``ValueError`` (naming ``what`` and the rank) when ``position_ids`` are a sharded
    batch's while no CP attention context is active."""
    problem = token_problem(position_ids, None)
    if problem is not None:
        raise ValueError(f"{what}: rank {_origins[position_ids].rank}: {problem}")
