"""Head-parallel CP attention: the sequence -> head all-to-all of q and k/v (one transfer), the
inner state's per-document attention of the rank's heads over the gathered tokens, and the
head -> sequence all-to-all of the output; the backward is the same three in reverse (the verbs'
and the attention op's own backward)."""

from __future__ import annotations

import torch

from cpshard.attention.head_split import split_heads
from cpshard.attention.ops import cp_attention_op
from cpshard.attention.state import HeadParallel
from cpshard.comm.heads import heads_to_seq, seq_to_heads
from cpshard.fingerprints import HEADS, call_key


def _key(q: torch.Tensor, kv: torch.Tensor, d_k: int, flat: list[int]) -> int:
    backward = torch.is_grad_enabled() and (q.requires_grad or kv.requires_grad)
    shape = (q.shape[0], q.shape[2], q.shape[1], kv.shape[1], d_k, kv.shape[3])
    return call_key(HEADS, q.dtype, shape, 0, backward, False, flat)


def head_parallel_attention(
    plan: HeadParallel,
    causal: bool,
    q: torch.Tensor,
    kv: torch.Tensor,
    d_k: int,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of this rank's q ``[B, Hq, L, d_k]`` and k/v ``[B, Hkv, L, d_k + d_v]`` under
    ``plan`` (:class:`~cpshard.attention.state.HeadParallel`): the output ``[B, Hq, L, d_v]``."""
    group = plan.group
    split = split_heads(q.shape[1], kv.shape[1], group.world)
    start, count = split.q[group.rank]
    inner = plan.inner if causal else plan.inner.bidirectional()
    if sinks is not None:
        sinks = sinks[start : start + count]
    if group.world == 1:
        out, _ = cp_attention_op(q, kv, inner.key, d_k, scale, window, softcap, sinks)
        return out
    flat, order = split.flat(), plan.order_on(q.device)
    key = _key(q, kv, d_k, flat)
    q_h, kv_h = seq_to_heads([q, kv], group.name, flat, order, key)
    if count:
        out_h, _ = cp_attention_op(q_h, kv_h, inner.key, d_k, scale, window, softcap, sinks)
    else:  # no heads here (nor on the ranks of the inner group): nothing to attend, but the
        # backward's all-to-alls the other ranks wait for must run here too
        shape = (*q_h.shape[:3], kv.shape[3] - d_k)
        out_h = q_h.new_zeros(shape) + 0 * (q_h.sum() + kv_h.sum())
    q_ranges = flat[: 2 * group.world]
    (out,) = heads_to_seq([out_h], group.name, q_ranges, order, key)
    return out
