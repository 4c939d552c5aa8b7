"""The sequence <-> head all-to-alls of head-parallel (Ulysses) CP attention, as ``torch.library``
custom ops keyed by group name, each the other's backward.

* ``cpshard::seq_to_heads(parts, group, heads, order, key)``: every part ``[B, H_i, L, D_i]``
  (all heads, this rank's ``L`` tokens) -> ``[B, c_i, W * L, D_i]`` (this rank's heads, every
  rank's tokens): rank r receives heads ``[s_ir, s_ir + c_ir)`` of part i, where ``heads`` holds
  ``(s_ir, c_ir)`` for every part and rank, flattened ``[part][rank][2]``. The tokens arrive in
  rank-major order (rank 0's shard, rank 1's, ...) and, with ``order`` (``[W * L]``, or
  ``[B, W * L]`` per batch row), token p of the output is rank-major token ``order[p]``.
* ``cpshard::heads_to_seq(parts, group, heads, order, key)``: its adjoint. A head sent to
  several ranks (a GQA key/value head whose query heads are split) comes back as the sum of
  their parts.

All parts travel in ONE all-to-all-v (``cpshard::all_to_all_v``), each destination's heads back
to back with no padding:
the ranges may be uneven (heads not divisible by W), empty, or overlap. Every rank holds the
same ``L`` (the CP layouts' equal shards).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cpshard.comm.collectives import all_to_all_v
from cpshard.comm.group import group_from_name
from cpshard.comm.verbs import offsets


def head_ranges(heads: Sequence[int], parts: int, world: int) -> list[list[tuple[int, int]]]:
    """``heads`` flattened ``[part][rank][2]`` -> ``ranges[part][rank] = (start, count)``."""
    if len(heads) != parts * world * 2:
        raise ValueError(
            f"cpshard head all-to-all: heads holds {len(heads)} values, expected "
            f"{parts} parts x {world} ranks x 2"
        )
    it = iter(int(h) for h in heads)
    return [[(next(it), next(it)) for _ in range(world)] for _ in range(parts)]


def _to_global(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Rank-major tokens (dim 2) -> the order ``order`` names."""
    if order is None:
        return x
    if order.dim() == 1:
        return x.index_select(2, order)
    index = order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return x.gather(2, index)


def _to_rank_major(x: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Adjoint of :func:`_to_global` (``order`` is a permutation)."""
    if order is None:
        return x
    if order.dim() == 1:
        return torch.empty_like(x).index_copy_(2, order, x)
    index = order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
    return torch.empty_like(x).scatter_(2, index, x)


@torch.library.custom_op("cpshard::seq_to_heads", mutates_args=())
def seq_to_heads(
    parts: list[torch.Tensor],
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
) -> list[torch.Tensor]:
    """This rank's tokens of all heads -> its heads of every rank's tokens (module docstring)."""
    group = group_from_name(group_name)
    world, me = group.world, group.rank
    ranges = head_ranges(heads, len(parts), world)
    b, length = parts[0].shape[0], parts[0].shape[2]
    blocks = [  # per destination, each part's heads of this rank's tokens
        x[:, s : s + c].reshape(-1)
        for r in range(world)
        for x, part in zip(parts, ranges, strict=True)
        for s, c in (part[r],)
    ]
    send = torch.cat(blocks) if blocks else parts[0].new_empty(0)
    sizes = [[b * c * length * x.shape[3] for s, c in part] for x, part in zip(parts, ranges)]
    sends = [sum(sz[r] for sz in sizes) for r in range(world)]
    recvs = [sum(b * part[me][1] * length * x.shape[3] for x, part in zip(parts, ranges))] * world
    got = all_to_all_v(send, group_name, sends, recvs, key)
    outs = []
    at = [r * recvs[0] for r in range(world)]  # each source's offset in ``got``
    for x, part in zip(parts, ranges, strict=True):
        c, d = part[me][1], x.shape[3]
        out = x.new_empty(b, c, world * length, d)
        for r in range(world):
            n = b * c * length * d
            out[:, :, r * length : (r + 1) * length] = got[at[r] : at[r] + n].view(b, c, length, d)
            at[r] += n
        outs.append(_to_global(out, order))
    return outs


@seq_to_heads.register_fake
def _seq_to_heads_fake(
    parts: list[torch.Tensor],
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
) -> list[torch.Tensor]:
    group = group_from_name(group_name)
    ranges = head_ranges(heads, len(parts), group.world)
    return [
        x.new_empty(x.shape[0], part[group.rank][1], group.world * x.shape[2], x.shape[3])
        for x, part in zip(parts, ranges)
    ]


@torch.library.custom_op("cpshard::heads_to_seq", mutates_args=())
def heads_to_seq(
    parts: list[torch.Tensor],
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
) -> list[torch.Tensor]:
    """Adjoint of :func:`seq_to_heads`: this rank's heads of every rank's tokens ``[B, c_i,
    W * L, D_i]`` -> all heads of its own tokens ``[B, H_i, L, D_i]`` (``H_i``: one past the
    highest head of any range), a head held by several ranks summed."""
    group = group_from_name(group_name)
    world, me = group.world, group.rank
    ranges = head_ranges(heads, len(parts), world)
    b = parts[0].shape[0]
    length = parts[0].shape[2] // world
    rank_major = [_to_rank_major(x, order) for x in parts]
    blocks = [  # per destination, this rank's heads of its tokens
        x[:, :, r * length : (r + 1) * length].reshape(-1)
        for r in range(world)
        for x in rank_major
    ]
    send = torch.cat(blocks) if blocks else parts[0].new_empty(0)
    sends = [sum(x[:, :, :length].numel() for x in parts)] * world
    recvs = [
        sum(b * part[r][1] * length * x.shape[3] for x, part in zip(parts, ranges))
        for r in range(world)
    ]
    got = all_to_all_v(send, group_name, sends, recvs, key)
    outs, at = [], offsets(recvs)[:-1]
    for x, part in zip(parts, ranges, strict=True):
        d = x.shape[3]
        out = x.new_zeros(b, _head_count(part), length, d)
        for r, (s, c) in enumerate(part):
            n = b * c * length * d
            out[:, s : s + c] += got[at[r] : at[r] + n].view(b, c, length, d)
            at[r] += n
        outs.append(out)
    return outs


def _head_count(part: Sequence[tuple[int, int]]) -> int:
    return max((s + c for s, c in part), default=0)


@heads_to_seq.register_fake
def _heads_to_seq_fake(
    parts: list[torch.Tensor],
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
) -> list[torch.Tensor]:
    world = group_from_name(group_name).world
    ranges = head_ranges(heads, len(parts), world)
    return [
        x.new_empty(x.shape[0], _head_count(part), x.shape[2] // world, x.shape[3])
        for x, part in zip(parts, ranges)
    ]


def _keep_args(ctx, inputs, output) -> None:
    _, ctx.group_name, ctx.heads, order, ctx.key = inputs
    ctx.save_for_backward(order)
    ctx.outputs = [(o.shape, o.dtype, o.device) for o in output]


def _upstream(ctx, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """The outputs' gradients, zeros for outputs nothing used."""
    return [
        g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        for g, (shape, dtype, device) in zip(grads, ctx.outputs, strict=True)
    ]


def _seq_to_heads_backward(ctx, grads):
    (order,) = ctx.saved_tensors
    back = heads_to_seq(_upstream(ctx, grads), ctx.group_name, ctx.heads, order, ctx.key)
    return back, None, None, None, None


def _heads_to_seq_backward(ctx, grads):
    (order,) = ctx.saved_tensors
    back = seq_to_heads(_upstream(ctx, grads), ctx.group_name, ctx.heads, order, ctx.key)
    return back, None, None, None, None


seq_to_heads.register_autograd(_seq_to_heads_backward, setup_context=_keep_args)
heads_to_seq.register_autograd(_heads_to_seq_backward, setup_context=_keep_args)
