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


def _even(ranges: list[list[tuple[int, int]]]) -> bool:
    """Whether every part sends each rank the same number of heads (then each destination's
    chunk of the send buffer, and each source's of the receive buffer, has one size and every
    part is one strided view ``[W, B, c, L, D]`` of the buffer)."""
    return all(len({c for _, c in part}) <= 1 for part in ranges)


def _rank_views(
    buf: torch.Tensor, parts: Sequence[tuple[int, int, int]], world: int, length: int
) -> list[torch.Tensor]:
    """``buf`` of ``world`` equal chunks, each holding part i's ``[B, c_i, L, D_i]`` back to back
    (``parts`` as ``(B, c_i, D_i)``) -> per part its view ``[W, B, c_i, L, D_i]``."""
    chunks = buf.view(world, -1)
    views, at = [], 0
    for b, c, d in parts:
        n = b * c * length * d
        views.append(chunks[:, at : at + n].view(world, b, c, length, d))
        at += n
    return views


def _heads_into(dest: torch.Tensor, x: torch.Tensor, starts: Sequence[int]) -> None:
    """``dest[r] = x[:, starts[r] : starts[r] + c]`` for the ``[W, B, c, L, D]`` view ``dest``:
    one strided copy when the ranges tile the heads in rank order, else one gather."""
    world, c = dest.shape[0], dest.shape[2]
    if list(starts) == [r * c for r in range(world)]:
        dest.copy_(x[:, : world * c].unflatten(1, (world, c)).transpose(0, 1))
        return
    index = torch.tensor(starts, device=x.device)[:, None] + torch.arange(c, device=x.device)
    source = x.unsqueeze(0).expand(world, *x.shape)
    torch.gather(source, 2, index[:, None, :, None, None].expand(dest.shape), out=dest)


def _tokens_from(got: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """Received ``[W, B, c, L, D]`` (each source's tokens) -> ``[B, c, W * L, D]`` with token p
    the rank-major token ``order[p]`` (``[W * L]`` or ``[B, W * L]``): one copy (none when
    the buffer already is that tensor)."""
    world, b, c, length, d = got.shape
    ranks_first = got.permute(1, 2, 0, 3, 4)
    if order is None:
        return ranks_first.reshape(b, c, world * length, d)
    src, row = order // length, order % length
    if order.dim() == 1:
        return ranks_first[:, :, src, row]
    batch = torch.arange(b, device=got.device)[:, None, None]
    head = torch.arange(c, device=got.device)[None, :, None]
    return ranks_first[batch, head, src[:, None], row[:, None]]


def _tokens_into(dest: torch.Tensor, x: torch.Tensor, order: torch.Tensor | None) -> None:
    """Adjoint of :func:`_tokens_from`: ``x`` ``[B, c, W * L, D]`` (tokens in ``order``) ->
    the ``[W, B, c, L, D]`` view ``dest`` (each destination's rank-major tokens), one pass."""
    world, b, c, length, d = dest.shape
    if order is None:
        dest.copy_(x.view(b, c, world, length, d).permute(2, 0, 1, 3, 4))
        return
    inverse = torch.empty_like(order).scatter_(
        -1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order)
    )  # rank-major token q is token inverse[q] of ``x``
    if order.dim() == 1:
        index = inverse.view(world, 1, 1, length, 1)
    else:
        index = inverse.view(b, world, length).transpose(0, 1)[:, :, None, :, None]
    source = x.unsqueeze(0).expand(world, *x.shape)
    torch.gather(source, 3, index.expand(dest.shape), out=dest)


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
    sizes = [[b * c * length * x.shape[3] for _, c in part] for x, part in zip(parts, ranges)]
    sends = [sum(sz[r] for sz in sizes) for r in range(world)]
    send = parts[0].new_empty(sum(sends))
    if _even(ranges):  # one strided write per part
        shapes = [(b, part[0][1], x.shape[3]) for x, part in zip(parts, ranges)]
        for dest, x, part in zip(_rank_views(send, shapes, world, length), parts, ranges):
            _heads_into(dest, x, [s for s, _ in part])
    else:  # per destination, each part's heads of this rank's tokens
        at = 0
        for r in range(world):
            for x, (s, c) in zip(parts, (part[r] for part in ranges)):
                n = b * c * length * x.shape[3]
                send[at : at + n].view(b, c, length, x.shape[3]).copy_(x[:, s : s + c])
                at += n
    recvs = [sum(b * part[me][1] * length * x.shape[3] for x, part in zip(parts, ranges))] * world
    got = all_to_all_v(send, group_name, sends, recvs, key)
    del send
    shapes = [(b, part[me][1], x.shape[3]) for x, part in zip(parts, ranges)]
    return _unaliased([_tokens_from(g, order) for g in _rank_views(got, shapes, world, length)], got)


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
    sends = [sum(x[:, :, :length].numel() for x in parts)] * world
    send = parts[0].new_empty(sum(sends))
    shapes = [(b, x.shape[1], x.shape[3]) for x in parts]
    for dest, x in zip(_rank_views(send, shapes, world, length), parts):
        _tokens_into(dest, x, order)
    recvs = [
        sum(b * part[r][1] * length * x.shape[3] for x, part in zip(parts, ranges))
        for r in range(world)
    ]
    got = all_to_all_v(send, group_name, sends, recvs, key)
    del send
    if _even(ranges):
        shapes = [(b, part[0][1], x.shape[3]) for x, part in zip(parts, ranges)]
        views = _rank_views(got, shapes, world, length)
        return _unaliased([_heads_from(g, part) for g, part in zip(views, ranges, strict=True)], got)
    outs, at = [], offsets(recvs)[:-1]
    for x, part in zip(parts, ranges, strict=True):
        d = x.shape[3]
        tiled = _tiled(part)
        out = x.new_empty if tiled else x.new_zeros
        out = out(b, _head_count(part), length, d)
        for r, (s, c) in enumerate(part):
            n = b * c * length * d
            block = got[at[r] : at[r] + n].view(b, c, length, d)
            if tiled:
                out[:, s : s + c] = block
            else:
                out[:, s : s + c] += block
            at[r] += n
        outs.append(out)
    return outs


def _unaliased(outs: list[torch.Tensor], got: torch.Tensor) -> list[torch.Tensor]:
    """``outs``, of which a view of the receive buffer ``got`` is kept only when it is the one
    output (a custom op's outputs must not alias each other)."""
    if len(outs) == 1:
        return outs
    ptr = got.untyped_storage().data_ptr()
    return [o.clone() if o.untyped_storage().data_ptr() == ptr else o for o in outs]


def _tiled(part: Sequence[tuple[int, int]]) -> bool:
    """Whether the ranks' ranges tile the heads in rank order (each head held by one rank)."""
    return all(s == sum(c for _, c in part[:r]) for r, (s, _) in enumerate(part))


def _heads_from(got: torch.Tensor, part: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Received ``[W, B, c, L, D]`` (source r's heads ``[s_r, s_r + c)``) -> ``[B, H, L, D]``,
    a head held by several ranks summed (in rank order) and one held by none zero: one copy
    when the ranges tile the heads, else ``c`` index-adds."""
    world, b, c, length, d = got.shape
    if _tiled(part):
        return got.transpose(0, 1).reshape(b, world * c, length, d)
    out = got.new_zeros(b, _head_count(part), length, d)
    starts = torch.tensor([s for s, _ in part], device=got.device)
    for j in range(c):
        out.index_add_(1, starts + j, got[:, :, j].transpose(0, 1))
    return out


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
