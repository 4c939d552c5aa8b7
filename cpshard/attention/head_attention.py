"""Head-parallel CP attention: the sequence -> head all-to-all of q, k and v (one transfer), the
inner state's per-document attention of the rank's heads over the gathered tokens, and the
head -> sequence all-to-all of the output; the backward is the same three in reverse (the verbs'
and the attention op's own backward). K and V travel and are attended apart (the inner state of
one rank exchanges nothing: the op takes them unjoined), so neither side ever holds them
concatenated, nor their gradients."""

from __future__ import annotations

import torch

from cpshard.attention.head_split import split_heads
from cpshard.attention.ops import cp_attention_op
from cpshard.attention.state import HeadParallel
from cpshard.comm.heads import heads_to_seq, seq_to_heads
from cpshard.fingerprints import HEADS, call_key
from cpshard.masks import MaskDescription


def _key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat: list[int]) -> int:
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1], k.shape[3], k.shape[3] + v.shape[3])
    return call_key(HEADS, q.dtype, shape, 0, backward, False, flat)


def head_parallel_attention(
    plan: HeadParallel,
    causal: bool,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    mask: MaskDescription | None = None,
) -> torch.Tensor:
    """Attention of this rank's q ``[B, Hq, L, d_k]``, k ``[B, Hkv, L, d_k]`` and v ``[B, Hkv,
    L, d_v]`` under ``plan`` (:class:`~cpshard.attention.state.HeadParallel`): the output
    ``[B, Hq, L, d_v]``. With ``mask``, the inner state plans the same description over the
    gathered tokens (the inner plan's documents are the step's)."""
    group = plan.used().group
    split = split_heads(q.shape[1], k.shape[1], group.world)
    start, count = split.q[group.rank]
    inner = plan.inner.variant(causal, mask)
    if sinks is not None:
        sinks = sinks[start : start + count]
    if group.world == 1:
        out, _ = cp_attention_op(q, k, v, inner.key, scale, window, softcap, sinks)
        return out
    flat, order = split.flat(), plan.order_on(q.device)
    key = _key(q, k, v, flat)
    kv_ranges = flat[2 * group.world :]
    q_h, k_h, v_h = seq_to_heads([q, k, v], group.name, flat + kv_ranges, order, key)
    if count:
        out_h, _ = cp_attention_op(q_h, k_h, v_h, inner.key, scale, window, softcap, sinks)
    else:  # no heads here (nor on the ranks of the inner group): nothing to attend, but the
        # backward's all-to-alls the other ranks wait for must run here too
        shape = (*q_h.shape[:3], v.shape[3])
        out_h = q_h.new_zeros(shape) + 0 * (q_h.sum() + k_h.sum() + v_h.sum())
    q_ranges = flat[: 2 * group.world]
    (out,) = heads_to_seq([out_h], group.name, q_ranges, order, key)
    return out
