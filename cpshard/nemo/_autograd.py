"""NeMo's documented ``torch.autograd.Function`` classes on top of cpshard's differentiable
transport functions.

NeMo exposes its gathers as ``Function`` subclasses (``_GatherSequence.apply(x, group)``...).
cpshard's transport functions are already differentiable, so these classes do not implement the
math again: ``forward`` runs the cpshard function on a detached copy of the input with grad
enabled and keeps that small graph; ``backward`` runs it backward (the cpshard collective:
reduce-scatter, return-to-owner, ...). The same re-entrant pattern as activation checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def reentrant_forward(ctx: Any, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> torch.Tensor:
    """``fn(x, *args)`` with its autograd graph kept on ``ctx`` for :func:`reentrant_backward`."""
    leaf = x.detach().requires_grad_(x.is_floating_point() or x.is_complex())
    with torch.enable_grad():
        out = fn(leaf, *args)
    ctx.leaf, ctx.out = leaf, out
    return out.detach()


def reentrant_backward(ctx: Any, grad: torch.Tensor, extra: int) -> tuple:
    """The gradient of ``x`` through the kept graph, and ``None`` for the ``extra`` other
    inputs of ``forward``."""
    leaf, out = ctx.leaf, ctx.out
    del ctx.leaf, ctx.out
    if not out.requires_grad:  # nothing differentiable was gathered
        return (None, *([None] * extra))
    (dx,) = torch.autograd.grad(out, leaf, grad)
    return (dx, *([None] * extra))
