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

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from cpshard.batch.padding import IGNORE_INDEX
from cpshard.comm import GroupLike, resolve_group
from cpshard.comm.reduce import all_reduce_sum_
from cpshard.consensus import agree, check_call
from cpshard.fingerprints import device_code, digest, dtype_code
from cpshard.validation import is_int

_RULES = ("split", "replicated")


def _cross_entropy_problem(
    logits: object, labels: object, ignore_index: object, num_labelled: object
) -> str | None:
    """This rank's problem with the arguments of :func:`cp_cross_entropy` (host metadata only,
    no device sync), or None."""
    if not isinstance(logits, torch.Tensor):
        return f"logits must be a torch.Tensor, got {type(logits).__name__}"
    if not isinstance(labels, torch.Tensor):
        return f"labels must be a torch.Tensor, got {type(labels).__name__}"
    if logits.dim() < 1 or tuple(logits.shape[:-1]) != tuple(labels.shape):
        return f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} + [V]"
    if not logits.dtype.is_floating_point:
        return f"logits must be floating point, got {logits.dtype}"
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        return f"labels must be integers, got {labels.dtype}"
    if labels.device != logits.device:
        return f"labels are on {labels.device} but logits on {logits.device}"
    if not is_int(ignore_index):
        return f"ignore_index must be an int, got {type(ignore_index).__name__}"
    if num_labelled is None:
        return None
    if isinstance(num_labelled, torch.Tensor):
        if num_labelled.numel() != 1 or num_labelled.dtype == torch.bool:
            return f"num_labelled must be a one-element count, got {num_labelled.dtype} {tuple(num_labelled.shape)}"
    elif not is_int(num_labelled) or num_labelled < 0:
        return f"num_labelled must be a tensor, an int >= 0 or None, got {num_labelled!r}"
    return None


def _cross_entropy_fields(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, num_labelled: object
) -> Callable[[], Mapping[str, Sequence[int]]]:
    """What every rank's :func:`cp_cross_entropy` must agree on (checked mode only): whatever
    decides whether and how the count is all-reduced, and what makes the losses one loss."""
    return lambda: {
        "ignore_index": [ignore_index],
        "num_labelled given": [int(num_labelled is not None)],
        "labels dtype": [dtype_code(labels.dtype)],
        "logits dtype": [dtype_code(logits.dtype)],
        "vocabulary size": [logits.shape[-1]],
        "device type": [device_code(logits)],
    }


def cp_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: GroupLike,
    ignore_index: int = IGNORE_INDEX,
    num_labelled: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Token-mean cross entropy over the CP group: this rank's summed loss over its labelled
    tokens divided by the number of labelled tokens on all ranks (one all-reduce of a count,
    no host sync). ``logits`` ``[..., V]`` and ``labels`` ``[...]`` are this rank's tokens,
    labels already shifted (``ignore_index`` where there is no target). The ranks' results add
    up to the single-process token-mean loss; their gradients follow the ``"split"`` rule of
    :func:`reduce_cp_gradients`. With no labelled token anywhere the loss is 0 (not NaN).
    ``num_labelled`` (the global count, e.g. a sharded batch's ``targets.num_labelled``) skips
    the all-reduce.

    Arguments are checked locally; in checked mode (:func:`cpshard.check_mode`) one consensus
    round also makes every rank raise for a problem on any rank, and for ``ignore_index``,
    dtypes, vocabulary size, device type or the presence of ``num_labelled`` differing across
    ranks (which would hang or break the count's all-reduce, or silently mix different losses)."""
    what = "cpshard.cp_cross_entropy"
    g = resolve_group(group, what)
    problem = _cross_entropy_problem(logits, labels, ignore_index, num_labelled)
    check_call(g, what, problem, _cross_entropy_fields(logits, labels, ignore_index, num_labelled))
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    local_sum = F.cross_entropy(
        flat_logits, flat_labels, ignore_index=ignore_index, reduction="sum"
    )
    if num_labelled is None:
        count = (flat_labels != ignore_index).sum().to(local_sum.dtype)
        all_reduce_sum_([count], g)
    else:
        count = torch.as_tensor(num_labelled, dtype=local_sum.dtype, device=local_sum.device)
    return local_sum / count.clamp(min=1)


def _parameters(parameters: object) -> tuple[list[torch.Tensor], str | None]:
    """The parameters passed to :func:`reduce_cp_gradients` as a list, and this rank's problem
    with them (or None)."""
    if isinstance(parameters, torch.nn.Module):
        return list(parameters.parameters()), None
    if isinstance(parameters, torch.Tensor) or not isinstance(parameters, Iterable):
        return (
            [],
            f"parameters must be a Module or an iterable of tensors, got {type(parameters).__name__}",
        )
    params = list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            return params, f"parameters[{i}] must be a tensor, got {type(p).__name__}"
    return params, None


def _gradient_fields(loss: str, trainable: list[torch.Tensor]) -> dict[str, Sequence[int]]:
    """What every rank's :func:`reduce_cp_gradients` must agree on: the rule and the gradients'
    count, shapes, dtypes and device types, which decide the all-reduce."""
    return {
        "loss": [_RULES.index(loss)],
        "trainable parameter count": [len(trainable)],
        "parameter shapes": digest([s for p in trainable for s in (p.dim(), *p.shape)]),
        "parameter dtypes": digest([dtype_code(p.dtype) for p in trainable]),
        "parameter device types": digest([device_code(p) for p in trainable]),
    }


def reduce_cp_gradients(
    parameters: Iterable[torch.nn.Parameter] | torch.nn.Module,
    group: GroupLike,
    loss: str = "split",
) -> None:
    """Make every rank's parameter gradients those of the single-process loss.

    ``loss="split"`` (the ranks' losses split the tokens, e.g. :func:`cp_cross_entropy`): sum
    over the group. ``loss="replicated"`` (every rank computed the full loss): average. Every
    rank must pass the same parameters in the same order; a parameter without a gradient on
    this rank counts as zeros, so ranks whose tokens never reached a parameter stay in step.

    Once per step, so checked like the other per-step entry points, in every mode: one
    consensus round over the host channel makes every rank raise for a problem on any rank, and
    for a ``loss`` rule or trainable parameters (count, shapes, dtypes, device types) differing
    across ranks, which the gradients' all-reduce would otherwise mix without an error."""
    what = "cpshard.reduce_cp_gradients"
    g = resolve_group(group, what)
    params, problem = _parameters(parameters)
    if problem is None and loss not in _RULES:
        problem = f"loss must be one of {_RULES}, got {loss!r}"
    trainable = [p for p in params if p.requires_grad] if problem is None else []
    agree(g, what, problem, None if problem is not None else _gradient_fields(loss, trainable))
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in trainable]
    all_reduce_sum_(grads, g)
    if loss == "replicated" and g.world > 1:
        for grad in grads:
            grad.div_(g.world)
