"""Head-parallel CP attention (DeepSpeed-Ulysses) as one ``torch.library`` custom op pair that
moves and attends a few heads at a time.

``cpshard::head_attention`` (the ``heads`` strategy: the inner state exchanges nothing) walks
this rank's key/value heads one at a time (a chunk): the sequence -> head all-to-all of that K
and V head, then, per query head it serves, the all-to-all of that query head, the inner
state's per-document attention over the gathered tokens, and the head -> sequence all-to-all
of the output, written straight into its heads of the output. It saves only the caller's q,
k, v, the output and the gathered heads' log-sum-exp (``[B, heads, W * L]``, one value per
row): no gathered head outlives its chunk.

``cpshard::head_attention_backward`` walks the same chunks: it gathers the chunk's K and V
again and, per query chunk, its q, output and output gradient (the cheap all-to-all, instead
of keeping the gathered heads from the forward), runs the attention's backward and sends the
query gradient back at once; the K/V gradients of the chunk are summed over its query chunks
and sent back after them. So a call holds its output and gradients (what any implementation
returns) plus one chunk's gathered heads, not every gathered head at once (DeepSpeed-Ulysses
keeps all of q, k, v and the output gathered from the forward to the backward, and the backward
holds their gradients beside them). Each chunk's all-to-alls are the same on every rank: a rank
with fewer heads (heads not divisible by W) joins with empty ranges.

``hierarchical`` (an inner state that exchanges K/V between nodes) moves all heads at once
(``cpshard::seq_to_heads`` / ``heads_to_seq``) and keeps the gathered heads for the backward:
per-chunk calls would exchange each K/V head between nodes once per query head.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from cpshard.attention.head_split import HeadSplit, split_heads
from cpshard.attention.kernels import lse_dtype
from cpshard.attention.ops import cp_attention_backward_op, cp_attention_op
from cpshard.attention.state import HeadParallel
from cpshard.comm.group import group_from_name
from cpshard.comm.heads import (
    head_ranges,
    heads_to_seq,
    inverse_order,
    seq_to_heads,
    to_heads,
    to_seq_into,
    token_sources,
)
from cpshard.fingerprints import HEADS, call_key
from cpshard.masks import MaskDescription

Ranges = list[tuple[int, int]]  # per rank: (first head, count)


def _split(heads: Sequence[int], world: int) -> HeadSplit:
    """The :class:`HeadSplit` the op's flat ``heads`` list holds."""
    q, kv = head_ranges(heads, 2, world)
    return HeadSplit(tuple(q), tuple(kv))


def chunks(split: HeadSplit) -> Iterator[tuple[Ranges, list[Ranges]]]:
    """Per key/value chunk (every rank's j-th key/value head), its ranges and those of its query
    chunks (one query head each); a rank with fewer heads gets empty ranges. Alike on every
    rank."""
    groups = [qc // kc if kc else 0 for (_, qc), (_, kc) in zip(split.q, split.kv)]
    for j in range(max(kc for _, kc in split.kv)):
        has = [j < kc for _, kc in split.kv]
        kv = [(s + j, 1) if h else (0, 0) for (s, _), h in zip(split.kv, has)]
        parts = [
            [(s + j * g + i, 1) if h and i < g else (0, 0)
             for (s, _), g, h in zip(split.q, groups, has)]
            for i in range(max(g for g, h in zip(groups, has) if h))
        ]
        yield kv, parts


def _local(split: HeadSplit, rank: int, ranges: Ranges) -> slice:
    """This rank's heads of a query chunk, as local indices (into its log-sum-exp rows)."""
    start, count = ranges[rank]
    first = split.q[rank][0]
    return slice(start - first, start - first + count)


@torch.library.custom_op("cpshard::head_attention", mutates_args=())
def head_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inner: torch.Tensor,
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Head-parallel attention of this rank's q ``[B, Hq, L, d_k]``, k and v ``[B, Hkv, L, d]``
    (module docstring): the output ``[B, Hq, L, d_v]`` and the log-sum-exp of this rank's
    heads over every rank's tokens ``[B, heads, W * L]``. ``inner``: the inner state's key;
    ``heads``: the split's ranges, flattened (query part, then key/value part)."""
    group = group_from_name(group_name)
    me = group.rank
    split = _split(heads, group.world)
    out = q.new_zeros(*q.shape[:3], v.shape[3])
    tokens = group.world * q.shape[2]
    lse = q.new_empty(q.shape[0], split.q[me][1], tokens, dtype=lse_dtype(q.dtype))
    sources, inverse = token_sources(order, q.shape[2]), inverse_order(order)  # once per call
    for kv_ranges, q_chunks in chunks(split):
        k_h, v_h = to_heads([k, v], group_name, [kv_ranges, kv_ranges], sources, key)
        for q_ranges in q_chunks:
            (q_h,) = to_heads([q], group_name, [q_ranges], sources, key)
            rows = _local(split, me, q_ranges)
            if q_h.shape[1]:
                ends = sinks[q_ranges[me][0] : sum(q_ranges[me])] if sinks is not None else None
                out_h, lse[:, rows] = cp_attention_op(
                    q_h, k_h, v_h, inner, scale, window, softcap, ends
                )
            else:  # no heads here in this chunk: the all-to-all back still runs
                out_h = q_h.new_zeros(*q_h.shape[:3], v.shape[3])
            del q_h
            to_seq_into([out], [out_h], group_name, [q_ranges], inverse, key)
            del out_h
        del k_h, v_h
    return out, lse


@head_attention_op.register_fake
def _head_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inner: torch.Tensor,
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    group = group_from_name(group_name)
    count = _split(heads, group.world).q[group.rank][1]
    lse = q.new_empty(q.shape[0], count, group.world * q.shape[2], dtype=lse_dtype(q.dtype))
    return q.new_empty(*q.shape[:3], v.shape[3]), lse


@torch.library.custom_op("cpshard::head_attention_backward", mutates_args=())
def head_attention_backward_op(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inner: torch.Tensor,
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of q, k, v and the sinks (this rank's heads; empty without sinks), chunk by
    chunk (module docstring)."""
    group = group_from_name(group_name)
    me = group.rank
    split = _split(heads, group.world)
    dq = torch.zeros_like(q)
    dk: torch.Tensor | None = None  # made once the first K/V chunk's gradients are back
    dv: torch.Tensor | None = None
    dsinks = torch.zeros_like(sinks) if sinks is not None else q.new_zeros(0)
    sources, inverse = token_sources(order, q.shape[2]), inverse_order(order)  # once per call
    for kv_ranges, q_chunks in chunks(split):
        k_h, v_h = to_heads([k, v], group_name, [kv_ranges, kv_ranges], sources, key)
        dk_h: torch.Tensor | None = None  # the first query chunk's, the others' added
        dv_h: torch.Tensor | None = None
        for q_ranges in q_chunks:
            q_h, o_h, g_h = to_heads([q, out, grad], group_name, [q_ranges] * 3, sources, key)
            start, count = q_ranges[me]
            if count:
                ends = sinks[start : start + count] if sinks is not None else None
                dq_h, dk_c, dv_c, ds = cp_attention_backward_op(
                    g_h, q_h, k_h, v_h, o_h, lse[:, _local(split, me, q_ranges)], inner, scale,
                    window, softcap, ends,
                )  # fmt: skip
                if dk_h is None or dv_h is None:
                    dk_h, dv_h = dk_c, dv_c
                else:
                    dk_h += dk_c
                    dv_h += dv_c
                del dk_c, dv_c
                if sinks is not None:
                    dsinks[start : start + count] = ds
            else:  # no heads here in this chunk: the all-to-all back still runs
                dq_h = q_h
            del q_h, o_h, g_h
            to_seq_into([dq], [dq_h], group_name, [q_ranges], inverse, key)
            del dq_h
        if dk_h is None or dv_h is None:  # no heads here in this chunk
            dk_h, dv_h = torch.zeros_like(k_h), torch.zeros_like(v_h)
        del k_h, v_h
        if dk is None or dv is None:
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        to_seq_into([dk, dv], [dk_h, dv_h], group_name, [kv_ranges, kv_ranges], inverse, key)
        del dk_h, dv_h
    assert dk is not None and dv is not None, "every rank walks at least one K/V chunk"
    return dq, dk, dv, dsinks


@head_attention_backward_op.register_fake
def _head_attention_backward_fake(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    inner: torch.Tensor,
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _keep(ctx, inputs, output) -> None:
    q, k, v, inner, *rest = inputs
    ctx.group_name, ctx.heads, order, ctx.key, ctx.scale, ctx.window, ctx.softcap, sinks = rest
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(q, k, v, inner, order, sinks, *output)
    ctx.set_materialize_grads(False)  # no zeros made for the log-sum-exp's gradient


def _grad(ctx, grad: torch.Tensor | None, grad_lse: torch.Tensor | None):
    q, k, v, inner, order, sinks, out, lse = ctx.saved_tensors
    if grad is None:  # the output unused: nothing flows back
        grad = torch.zeros_like(out)
    dq, dk, dv, dsinks = head_attention_backward_op(
        grad, q, k, v, out, lse, inner, ctx.group_name, ctx.heads, order, ctx.key, ctx.scale,
        ctx.window, ctx.softcap, sinks if ctx.has_sinks else None,
    )  # fmt: skip
    return dq, dk, dv, *(None,) * 8, dsinks if ctx.has_sinks else None


head_attention_op.register_autograd(_grad, setup_context=_keep)


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
    inner = plan.inner.variant(causal, mask)
    if group.world == 1:
        out, _ = cp_attention_op(q, k, v, inner.key, scale, window, softcap, sinks)
        return out
    split = split_heads(q.shape[1], k.shape[1], group.world)
    flat, order, key = split.flat(), plan.order_on(q.device), _key(q, k, v, split.flat())
    if inner.windowed(window).exchange.keeps_local:
        out, _ = head_attention_op(
            q, k, v, inner.key, group.name, flat, order, key, scale, window, softcap, sinks
        )
        return out
    start, count = split.q[group.rank]
    if sinks is not None:
        sinks = sinks[start : start + count]
    q_h, k_h, v_h = seq_to_heads([q, k, v], group.name, flat + flat[2 * group.world :], order, key)
    if count:
        out_h, _ = cp_attention_op(q_h, k_h, v_h, inner.key, scale, window, softcap, sinks)
    else:  # no heads here (nor on the ranks of the inner group): nothing to attend, but the
        # backward's all-to-alls the other ranks wait for must run here too
        shape = (*q_h.shape[:3], v.shape[3])
        out_h = q_h.new_zeros(shape) + 0 * (q_h.sum() + k_h.sum() + v_h.sum())
    (out,) = heads_to_seq([out_h], group.name, flat[: 2 * group.world], order, key)
    return out
