"""The CP loss and the gradient rule that goes with it.

With context parallelism each rank holds a slice of every sequence, so a token-mean loss must
divide the **local** sum by the **global** number of labelled tokens: the ranks' losses then add
up to the single-process loss, and so do their parameter gradients. Hence the rule:

* ranks whose losses split the tokens (:func:`cp_cross_entropy`): **sum** the parameter gradients
  over the CP group;
* ranks that each compute the full loss (a replicated computation): **average** them (a sum
  would be exactly W times too large).

:func:`reduce_cp_gradients` applies it. With data parallelism as well, reduce over the CP group
first with this rule, then average over the data-parallel group as usual (the two commute).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from cpshard.comm import GroupLike, resolve_group
from cpshard.comm.reduce import all_reduce_sum_

IGNORE_INDEX = -100
_RULES = ("split", "replicated")


def cp_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: GroupLike,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Token-mean cross entropy over the CP group: this rank's summed loss over its labelled
    tokens divided by the number of labelled tokens on all ranks (one all-reduce of a count,
    no host sync). ``logits`` ``[..., V]`` and ``labels`` ``[...]`` are this rank's tokens,
    labels already shifted (``ignore_index`` where there is no target). The ranks' results add
    up to the single-process token-mean loss; their gradients follow the ``"split"`` rule of
    :func:`reduce_cp_gradients`. With no labelled token anywhere the loss is 0 (not NaN)."""
    what = "cpshard.cp_cross_entropy"
    g = resolve_group(group, what)
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(f"{what}: rank {g.rank}: logits and labels must be tensors")
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        raise ValueError(
            f"{what}: rank {g.rank}: logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [V]"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"{what}: rank {g.rank}: labels must be integers, got {labels.dtype}")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    local_sum = F.cross_entropy(flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum")
    count = (flat_labels != ignore_index).sum().to(local_sum.dtype).reshape(1)
    all_reduce_sum_([count], g)
    return local_sum / count.clamp(min=1).squeeze(0)


def reduce_cp_gradients(
    parameters: Iterable[torch.nn.Parameter] | torch.nn.Module,
    group: GroupLike,
    loss: str = "split",
) -> None:
    """Make every rank's parameter gradients those of the single-process loss.

    ``loss="split"`` (the ranks' losses split the tokens, e.g. :func:`cp_cross_entropy`): sum
    over the group. ``loss="replicated"`` (every rank computed the full loss): average. Every
    rank must pass the same parameters in the same order; a parameter without a gradient on
    this rank counts as zeros, so ranks whose tokens never reached a parameter stay in step."""
    what = "cpshard.reduce_cp_gradients"
    g = resolve_group(group, what)
    if loss not in _RULES:
        raise ValueError(f"{what}: rank {g.rank}: loss must be one of {_RULES}, got {loss!r}")
    params = list(parameters.parameters() if isinstance(parameters, torch.nn.Module) else parameters)
    trainable = [p for p in params if p.requires_grad]
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in trainable]
    all_reduce_sum_(grads, g)
    if loss == "replicated" and g.world > 1:
        for grad in grads:
            grad.div_(g.world)
