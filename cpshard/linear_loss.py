"""The CP loss from the final hidden states and the LM head, never holding the logits.

:func:`cp_linear_cross_entropy` is :func:`cpshard.cp_cross_entropy` of ``hidden @ weight.T
(+ bias)`` (optionally soft-capped), computed a chunk of tokens at a time: the forward keeps each
token's log-sum-exp and the summed loss, the backward recomputes each chunk's logits and adds the
chunk's share to the gradients of the hidden states, the weight and the bias. At S/W = 128k tokens
and a 152k vocabulary the logits alone would be 37 GiB in bf16; here at most one chunk's are
alive. Half-precision inputs are multiplied in their own dtype (as the LM head would) and each
chunk's logits are upcast to float32, as transformers' causal-LM loss upcasts its logits.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from cpshard.batch.padding import IGNORE_INDEX
from cpshard.comm import GroupLike, resolve_group
from cpshard.consensus import check_call
from cpshard.fingerprints import device_code, dtype_code
from cpshard.loss import targets_fields, targets_problem, token_mean
from cpshard.validation import is_int

# One chunk's logits in the compute dtype: 64 MiB (about 110 tokens of a 152k vocabulary in
# float32). The forward holds one such buffer at a time, the backward two with a soft cap.
DEFAULT_CHUNK_BYTES = 64 * 2**20

_WHAT = "cpshard.cp_linear_cross_entropy"


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the loss is computed and returned in: float32 for half precision, else
    ``dtype`` (float32 or float64)."""
    return torch.promote_types(dtype, torch.float32)


def chunk_size(tokens: int, vocab: int, dtype: torch.dtype, chunk_bytes: int) -> int:
    """Tokens per chunk: as many as ``chunk_bytes`` of ``[tokens, vocab]`` logits in the compute
    dtype of ``dtype`` allow, at least 1 and at most ``tokens``."""
    per_token = vocab * compute_dtype(dtype).itemsize
    return max(1, min(tokens, chunk_bytes // per_token))


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's logits ``[n, V]`` in the compute dtype (soft-capped when ``softcap``), and
    ``tanh(raw / softcap)`` that the backward of the cap needs (None without one)."""
    raw = hidden @ weight.T if bias is None else torch.addmm(bias, hidden, weight.T)
    logits = raw.to(compute_dtype(raw.dtype))
    if softcap is None:
        return logits, None
    capped = logits.div_(softcap).tanh_()
    return capped * softcap, capped


class _LinearCrossEntropy(torch.autograd.Function):
    """The summed cross entropy of ``hidden @ weight.T (+ bias)`` over the labelled tokens,
    a chunk of tokens at a time. Saves the inputs and each token's log-sum-exp only."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        ignore_index: int,
        softcap: float | None,
        chunk: int,
    ) -> torch.Tensor:
        dtype = compute_dtype(hidden.dtype)
        tokens = hidden.shape[0]
        valid = labels != ignore_index
        targets = labels.masked_fill(~valid, 0).unsqueeze(1)
        lse = torch.empty(tokens, dtype=dtype, device=hidden.device)
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        for start in range(0, tokens, chunk):
            rows = slice(start, start + chunk)
            logits, _ = _chunk_logits(hidden[rows], weight, bias, softcap)
            picked = logits.gather(1, targets[rows]).squeeze(1)
            top = logits.amax(1, keepdim=True)  # the log-sum-exp in place: no second chunk
            lse[rows] = logits.sub_(top).exp_().sum(1).log_().add_(top.squeeze(1))
            del logits
            total += ((lse[rows] - picked) * valid[rows]).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, valid, lse)
        ctx.softcap, ctx.chunk = softcap, chunk
        return total

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad_total: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, valid, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        dtype = lse.dtype
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        )
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_bias else None
        # d(loss)/d(logit) of a labelled token: softmax - one-hot, times the upstream gradient
        scale = valid.to(dtype) * grad_total.to(dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            logits, capped = _chunk_logits(hidden[rows], weight, bias, ctx.softcap)
            grad = logits.sub_(lse[rows].unsqueeze(1)).exp_()
            grad.scatter_add_(1, targets[rows], torch.full_like(targets[rows], -1, dtype=dtype))
            grad.mul_(scale[rows].unsqueeze(1))
            if capped is not None:  # d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
                grad.mul_(capped.square_().neg_().add_(1))
                del capped
            if grad_hidden is not None:
                torch.mm(grad.to(weight.dtype), weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, hidden[rows].to(dtype))
            if grad_bias is not None:
                grad_bias += grad.sum(0)
            del grad
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None, None, None, None,
        )  # fmt: skip


def _problem(
    hidden: object,
    weight: object,
    labels: object,
    bias: object,
    ignore_index: object,
    num_labelled: object,
    softcap: object,
    chunk_bytes: object,
    chunk_tokens: object,
) -> str | None:
    """This rank's problem with the arguments of :func:`cp_linear_cross_entropy` (host metadata
    only, no device sync), or None."""
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if bias is not None and not isinstance(bias, torch.Tensor):
        return f"bias must be a torch.Tensor or None, got {type(bias).__name__}"
    floats = [("hidden", hidden), ("weight", weight), ("bias", bias)][: 2 if bias is None else 3]
    for name, t in floats:
        if isinstance(t, DTensor):
            return f"{name} is a DTensor (sharded): pass {name}.full_tensor(), the whole LM head"
        if not t.dtype.is_floating_point:
            return f"{name} must be floating point, got {t.dtype}"
        if t.device != hidden.device:
            return f"{name} is on {t.device} but hidden on {hidden.device}"
        if t.dtype != hidden.dtype:
            return f"{name} is {t.dtype} but hidden {hidden.dtype}: pass the LM head's dtype"
    if weight.dim() != 2 or weight.shape[0] < 1:
        return f"weight must be [V, H] with V >= 1 (the LM head's), got {tuple(weight.shape)}"
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        return f"hidden {tuple(hidden.shape)} must end in weight's H = {weight.shape[1]}"
    if tuple(hidden.shape[:-1]) != tuple(labels.shape):
        return f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} + [H]"
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        return f"bias {tuple(bias.shape)} must be [V] = ({weight.shape[0]},)"
    if softcap is not None and (
        isinstance(softcap, bool) or not isinstance(softcap, int | float) or not softcap > 0
    ):
        return f"softcap must be a number > 0 or None, got {softcap!r}"
    if not is_int(chunk_bytes) or chunk_bytes < 1:
        return f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}"
    if chunk_tokens is not None and (not is_int(chunk_tokens) or chunk_tokens < 1):
        return f"chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}"
    return targets_problem(labels, "hidden", hidden.device, ignore_index, num_labelled)


def _fields(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    num_labelled: object,
    softcap: float | None,
) -> Callable[[], Mapping[str, Sequence[int]]]:
    """What every rank's :func:`cp_linear_cross_entropy` must agree on (checked mode only): what
    decides whether and how the count is all-reduced, and what makes the losses one loss."""
    return lambda: {
        **targets_fields(labels, ignore_index, num_labelled),
        "hidden dtype": [dtype_code(hidden.dtype)],
        "weight shape": list(weight.shape),
        "bias given": [int(bias is not None)],
        "softcap": list(struct.unpack("<q", struct.pack("<d", float(softcap or 0.0)))),
        "device type": [device_code(hidden)],
    }


def cp_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    group: GroupLike,
    ignore_index: int = IGNORE_INDEX,
    num_labelled: torch.Tensor | int | None = None,
    *,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """:func:`cpshard.cp_cross_entropy` of the logits ``hidden @ weight.T + bias`` (soft-capped
    to ``softcap * tanh(logits / softcap)`` when ``softcap``, as Gemma 2's
    ``final_logit_softcapping``), without ever holding those ``[..., V]`` logits: the same token
    mean over the CP group (this rank's summed loss times the group's size over the labelled
    tokens of every rank, one all-reduce of a count unless ``num_labelled`` gives it; 0 with no
    labelled token), so the ranks' losses and gradients **average** to the single-process ones
    as DDP / FSDP2 or :func:`cpshard.reduce_cp_gradients` reduce them.

    ``hidden`` ``[..., H]``: this rank's final hidden states (after the final norm);
    ``weight`` ``[V, H]`` and ``bias`` ``[V]``: the LM head's (the same dtype as ``hidden``);
    ``labels`` ``[...]``: already shifted (``ignore_index`` where there is no target).
    Tokens are processed ``chunk_tokens`` at a time, by default as many as ``chunk_bytes`` of
    logits hold: the forward keeps each token's log-sum-exp, the backward recomputes each chunk's
    logits (one more matmul than the plain loss) and accumulates the gradients chunk by chunk.
    The loss is computed in float32 for half-precision inputs (the head's matmul in their dtype,
    each chunk's logits upcast; the weight's gradient accumulated in float32), in float64 for
    float64.

    Checked like :func:`cpshard.cp_cross_entropy`: locally by default (the message names the
    argument and the rank); in checked mode one consensus round also makes every rank raise for a
    problem on any rank and for ``ignore_index``, dtypes, the head's shape, the bias, the cap, the
    device type or the presence of ``num_labelled`` differing across ranks."""
    g = resolve_group(group, _WHAT)
    problem = _problem(
        hidden, weight, labels, bias, ignore_index, num_labelled, softcap, chunk_bytes, chunk_tokens
    )
    check_call(
        g, _WHAT, problem,
        _fields(hidden, weight, labels, bias, ignore_index, num_labelled, softcap),
    )  # fmt: skip
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1)
    tokens = flat_hidden.shape[0]
    chunk = chunk_tokens or chunk_size(tokens, weight.shape[0], hidden.dtype, chunk_bytes)
    local_sum = _LinearCrossEntropy.apply(
        flat_hidden,
        weight,
        bias,
        flat_labels,
        ignore_index,
        None if softcap is None else float(softcap),
        chunk,
    )
    return token_mean(local_sum, flat_labels, ignore_index, num_labelled, g)
