"""The CP loss and the gradient rule that goes with it.

With context parallelism each rank holds a slice of every sequence, so a token-mean loss divides
the **local** sum by the **global** number of labelled tokens. :func:`cp_cross_entropy` also
multiplies by the CP group's size, so that the ranks' losses **average** to the single-process
loss, and so do their parameter gradients: the same convention as data parallelism. Hence one
rule, whatever wraps the model: **average** the gradients over every rank, as DDP and FSDP2 do.

* FSDP2 over the flattened (dp, cp) mesh, HSDP (replicate dp, shard cp), DDP over all ranks:
  their own averaging is the whole reduction; nothing else to call.
* No wrapper, or a wrapper over the data-parallel ranks alone (FSDP2 / DDP over ``dp``):
  :func:`reduce_cp_gradients` averages over the CP group (it reduces the local shards of FSDP2's
  DTensor gradients) after ``backward()``.

``reduce_cp_gradients(..., loss="sum")`` serves a loss of one's own whose ranks' values add up to
the loss (this rank's sum over the global count, with no factor): it sums instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from cpshard.batch.padding import IGNORE_INDEX
from cpshard.comm import Group, GroupLike, resolve_group
from cpshard.comm.group import global_ranks
from cpshard.comm.reduce import all_reduce_sum_
from cpshard.consensus import agree, check_call
from cpshard.fingerprints import device_code, digest, dtype_code
from cpshard.validation import is_int

_RULES = ("mean", "sum")
# The rules' names before the mean convention: refused with what to pass now, never reinterpreted.
_RENAMED = {
    "split": "cp_cross_entropy's losses now average to the loss: pass loss=\"mean\" (the default); "
    "loss=\"sum\" only for a loss of your own whose ranks' values add up to the loss",
    "replicated": "pass loss=\"mean\" (the default): ranks that each computed the full loss average",
}


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
    return targets_problem(labels, "logits", logits.device, ignore_index, num_labelled)


def targets_problem(
    labels: torch.Tensor,
    source: str,
    device: torch.device,
    ignore_index: object,
    num_labelled: object,
) -> str | None:
    """This rank's problem with a CP loss's targets (``labels`` beside the tensor named
    ``source`` on ``device``, ``ignore_index``, ``num_labelled``), or None: the checks
    :func:`cp_cross_entropy` and :func:`cpshard.cp_linear_cross_entropy` share."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        return f"labels must be integers, got {labels.dtype}"
    if labels.device != device:
        return f"labels are on {labels.device} but {source} on {device}"
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
        **targets_fields(labels, ignore_index, num_labelled),
        "logits dtype": [dtype_code(logits.dtype)],
        "vocabulary size": [logits.shape[-1]],
        "device type": [device_code(logits)],
    }


def targets_fields(
    labels: torch.Tensor, ignore_index: int, num_labelled: object
) -> dict[str, Sequence[int]]:
    """What every rank of a CP loss must agree on about its targets (checked mode): they decide
    whether and how the count is all-reduced."""
    return {
        "ignore_index": [ignore_index],
        "num_labelled given": [int(num_labelled is not None)],
        "labels dtype": [dtype_code(labels.dtype)],
    }


def cp_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    group: GroupLike,
    ignore_index: int = IGNORE_INDEX,
    num_labelled: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Token-mean cross entropy over the CP group: this rank's summed loss over its labelled
    tokens, times the group's size, divided by the number of labelled tokens on all ranks (one
    all-reduce of a count, no host sync). ``logits`` ``[..., V]`` and ``labels`` ``[...]`` are
    this rank's tokens, labels already shifted (``ignore_index`` where there is no target). The
    ranks' results **average** to the single-process token-mean loss, and so do their gradients:
    FSDP2 / DDP over every rank need no factor, and :func:`reduce_cp_gradients` averages (log
    the loss's mean over the group). ``group`` may span data-parallel ranks too (the flattened
    (dp, cp) group): the count is then global and the mean over all ranks is the global
    token-mean loss. With no labelled token anywhere the loss is 0 (not NaN).
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
    return token_mean(local_sum, flat_labels, ignore_index, num_labelled, g)


def token_mean(
    local_sum: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    num_labelled: torch.Tensor | int | None,
    g: Group,
) -> torch.Tensor:
    """This rank's summed loss ``local_sum`` as its share of the group's token mean: times the
    group's size, over the labelled tokens of every rank (``num_labelled``, or ``labels`` counted
    and all-reduced; at least 1), so that the ranks' losses average to the loss."""
    if num_labelled is None:
        count = (labels != ignore_index).sum().to(local_sum.dtype)
        all_reduce_sum_([count], g)
    elif isinstance(num_labelled, torch.Tensor):  # a device-side cast, no host read
        count = num_labelled.to(dtype=local_sum.dtype, device=local_sum.device)
    else:
        count = torch.as_tensor(num_labelled, dtype=local_sum.dtype, device=local_sum.device)
    return local_sum * g.world / count.clamp(min=1)


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


def _dtensor_problem(trainable: list[torch.Tensor], g: Group) -> str | None:
    """Why FSDP2's DTensor gradients among ``trainable`` must not be reduced over ``g``, or None:
    a gradient whose device mesh spans other ranks of the CP group was already averaged over
    them by FSDP2 (reducing again would average twice)."""
    if g.pg is None or g.world == 1:
        return None
    members, me = global_ranks(g)
    cp_ranks = set(members)
    for i, p in enumerate(trainable):
        grad = p.grad if p.grad is not None else p
        if not isinstance(grad, DTensor):
            continue
        mesh_ranks = set(grad.device_mesh.mesh.flatten().tolist())
        shared = sorted((mesh_ranks & cp_ranks) - {me})
        if shared:
            return (
                f"parameters[{i}]: its gradient is an FSDP2 DTensor over a device mesh that spans "
                f"CP ranks {shared} of this group, so FSDP2 already averaged it over the CP group "
                "(with cp_cross_entropy, that is the single-process gradient): do not call "
                "reduce_cp_gradients when FSDP2 / HSDP shards over the CP ranks"
            )
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor a collective reduces: a DTensor's local shard (the CP ranks of one
    data-parallel index hold the same shard), else the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def reduce_cp_gradients(
    parameters: Iterable[torch.nn.Parameter] | torch.nn.Module,
    group: GroupLike,
    loss: str = "mean",
) -> None:
    """Make every rank's parameter gradients those of the single-process loss, where nothing
    else reduces them over the CP group (no wrapper, or FSDP2 / DDP over the data-parallel ranks
    alone; call it after ``backward()``).

    ``loss="mean"`` (the ranks' losses average to the loss: :func:`cp_cross_entropy`'s, or
    every rank computing the full loss): average over the group. ``loss="sum"`` (a loss of one's
    own whose ranks' values add up to the loss): sum. Every rank must pass the same parameters
    in the same order; a parameter without a gradient on this rank counts as zeros, so ranks
    whose tokens never reached a parameter stay in step. FSDP2's DTensor gradients are reduced
    through their local shards; a DTensor whose mesh already spans the CP ranks (FSDP2 over the
    flattened (dp, cp) mesh, HSDP) is refused: FSDP2 averaged it already.

    Once per step, so checked like the other per-step entry points, in every mode: one
    consensus round over the host channel makes every rank raise for a problem on any rank, and
    for a ``loss`` rule or trainable parameters (count, shapes, dtypes, device types) differing
    across ranks, which the gradients' all-reduce would otherwise mix without an error."""
    what = "cpshard.reduce_cp_gradients"
    g = resolve_group(group, what)
    params, problem = _parameters(parameters)
    if problem is None and loss in _RENAMED:
        problem = f"loss={loss!r} is no longer a rule: {_RENAMED[loss]}"
    elif problem is None and loss not in _RULES:
        problem = f"loss must be one of {_RULES}, got {loss!r}"
    trainable = [p for p in params if p.requires_grad] if problem is None else []
    if problem is None:
        problem = _dtensor_problem(trainable, g)
    agree(g, what, problem, None if problem is not None else _gradient_fields(loss, trainable))
    for p in trainable:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [_local(p.grad) for p in trainable]
    all_reduce_sum_(grads, g)
    if loss == "mean" and g.world > 1:
        for grad in grads:
            grad.div_(g.world)
