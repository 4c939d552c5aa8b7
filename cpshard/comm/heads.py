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

All parts travel together in one all-to-all-v (``cpshard::all_to_all_v``), each destination's
heads back to back with no padding; a large call (at least :data:`ROUND_BYTES` per rank and
round on average) goes in about :data:`ROUNDS` instead, each carrying a chunk of one part's
heads (the same offsets of every rank's range), so that the send and receive buffers hold a
round's share beside the outputs, which each round fills in place. A part goes into the send
buffer and out of the receive buffer in one strided pass where its ranges are regular (every
rank the same count ``c``, runs of ``k`` ranks sharing a range, the runs tiling the heads in
rank order: the even splits and GQA replicas of
:func:`~cpshard.attention.head_split.split_heads`), by a loop over ranks otherwise: the ranges
may be uneven (heads not divisible by W), empty, or overlap. Every rank holds the same ``L``
(the CP layouts' equal shards).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from cpshard.comm.collectives import all_to_all_v
from cpshard.comm.group import group_from_name

ROUNDS = 4  # about how many all-to-alls a large call takes: the buffers' share, against latency
ROUND_BYTES = 1 << 20  # the least a round moves per rank on average


def head_ranges(heads: Sequence[int], parts: int, world: int) -> list[list[tuple[int, int]]]:
    """``heads`` flattened ``[part][rank][2]`` -> ``ranges[part][rank] = (start, count)``."""
    if len(heads) != parts * world * 2:
        raise ValueError(
            f"cpshard head all-to-all: heads holds {len(heads)} values, expected "
            f"{parts} parts x {world} ranks x 2"
        )
    it = iter(int(h) for h in heads)
    return [[(next(it), next(it)) for _ in range(world)] for _ in range(parts)]


def _regular(part: Sequence[tuple[int, int]]) -> int | None:
    """``k`` when rank r's range is ``((r // k) * c, c)`` with ``c > 0`` (module docstring),
    else None."""
    world, c = len(part), part[0][1]
    k = next((r for r, (s, _) in enumerate(part) if s != part[0][0]), world)
    if c == 0 or world % k or any(n != c or s != r // k * c for r, (s, n) in enumerate(part)):
        return None
    return k


def _rounds(
    ranges: list[list[tuple[int, int]]], head_bytes: list[int]
) -> list[tuple[int, list[list[int]]]]:
    """Each round's head offset ``lo`` within the ranges and, per part and rank, how many heads
    it carries: one round with all heads when the call moves little, else each part's heads in
    chunks, the part's share of :data:`ROUNDS` (rounded up). ``head_bytes``: per part, the
    bytes of one head of one rank's tokens. The same on every rank (what ranks move on average
    decides)."""
    moved = [n * sum(c for _, c in part) for n, part in zip(head_bytes, ranges)]
    rounds = min(ROUNDS, sum(moved) // ROUND_BYTES)
    if rounds <= 1:
        return [(0, [[c for _, c in part] for part in ranges])]
    out = []
    for i, (part, share) in enumerate(zip(ranges, moved)):
        most = max(c for _, c in part)
        if not most:
            continue
        step = -(-most // max(1, min(most, -(-rounds * share // sum(moved)))))
        for lo in range(0, most, step):
            counts = [[0] * len(other) for other in ranges]
            counts[i] = [max(0, min(c, lo + step) - lo) for _, c in part]
            out.append((lo, counts))
    return out


def _rank_views(
    buf: torch.Tensor, tensors: list[torch.Tensor], counts: list[list[int]], rank: int,
    length: int,
) -> list[torch.Tensor]:  # fmt: skip
    """``buf`` of ``W`` equal chunks, each holding every part's ``[B, n_i, L, D_i]`` back to back
    (``n_i = counts[i][rank]``; ``D_i`` of ``tensors[i]``) -> per part its view
    ``[W, B, n_i, L, D_i]``."""
    world, b = len(counts[0]), tensors[0].shape[0]
    chunks = buf.view(world, -1)
    views, at = [], 0
    for t, n in zip(tensors, counts):
        size = b * n[rank] * length * t.shape[3]
        views.append(chunks[:, at : at + size].view(world, b, n[rank], length, t.shape[3]))
        at += size
    return views


def _range_blocks(
    buf: torch.Tensor, tensors: list[torch.Tensor], ranges: list[list[tuple[int, int]]],
    counts: list[list[int]], length: int, lo: int,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int, int]]:  # fmt: skip
    """Ranges that are not regular: per rank r and part i, in buffer order, the block of
    ``buf`` ``[B, n, L, D_i]`` that holds heads ``[s, s + n)`` of ``tensors[i]``, with ``s``
    (rank r's range start plus ``lo``) and ``n = counts[i][r]``."""
    b, at = tensors[0].shape[0], 0
    for r in range(len(ranges[0])):
        for t, part, n in zip(tensors, ranges, counts):
            size = b * n[r] * length * t.shape[3]
            yield buf[at : at + size].view(b, n[r], length, t.shape[3]), t, part[r][0] + lo, n[r]
            at += size


def _heads_into(dest: torch.Tensor, x: torch.Tensor, c: int, k: int, lo: int) -> None:
    """``dest[r]`` ``[B, g, L, D]`` = heads ``[lo, lo + g)`` of rank r's regular range of ``x``
    ``[B, H, L, D]`` (``c`` heads, runs of ``k`` ranks): one strided copy."""
    world, g = dest.shape[0], dest.shape[2]
    src = x[:, : world // k * c].unflatten(1, (world // k, c))[:, :, lo : lo + g]
    dest.unflatten(0, (world // k, k)).copy_(src.transpose(0, 1).unsqueeze(1))


def _heads_out(out: torch.Tensor, got: torch.Tensor, c: int, k: int, lo: int) -> None:
    """Adjoint of :func:`_heads_into`: received ``[W, B, g, L, D]`` -> heads ``[lo, lo + g)``
    of every range of ``out`` ``[B, H, L, D]``, the ``k`` ranks sharing a range summed."""
    world, g = got.shape[0], got.shape[2]
    dest = out[:, : world // k * c].unflatten(1, (world // k, c))[:, :, lo : lo + g]
    dest = dest.transpose(0, 1)
    if k == 1:
        dest.copy_(got)
    else:
        torch.sum(got.unflatten(0, (world // k, k)), 1, out=dest)


Sources = tuple[torch.Tensor, torch.Tensor] | None  # per gathered token: source rank, row there


def token_sources(order: torch.Tensor | None, length: int) -> Sources:
    """Where token p of ``order`` (``[W * L]`` or ``[B, W * L]``) comes from: its source rank
    and row there (None: rank-major). Made once per attention call, for every head chunk, part
    and round of its movements."""
    return None if order is None else (order // length, order % length)


def inverse_order(order: torch.Tensor | None) -> torch.Tensor | None:
    """The inverse permutation of ``order``: rank-major token q is token ``inverse[q]`` (None:
    rank-major). Made once per attention call, for every head chunk, part and round of its
    movements."""
    if order is None:
        return None
    positions = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def _tokens_out(dest: torch.Tensor, got: torch.Tensor, sources: Sources) -> None:
    """Received ``[W, B, g, L, D]`` (each source's tokens) -> ``dest`` ``[B, g, W * L, D]``
    whose token p is source ``src[p]``'s row ``row[p]`` (``sources``; None: rank-major)."""
    world, b, g, length, _ = got.shape
    ranks_first = got.permute(1, 2, 0, 3, 4)
    if sources is None:
        dest.unflatten(2, (world, length)).copy_(ranks_first)
        return
    src, row = sources
    if src.dim() == 1:
        dest.copy_(ranks_first[:, :, src, row])
        return
    batch = torch.arange(b, device=got.device)[:, None, None]
    head = torch.arange(g, device=got.device)[None, :, None]
    dest.copy_(ranks_first[batch, head, src[:, None], row[:, None]])


def _tokens_into(dest: torch.Tensor, x: torch.Tensor, inverse: torch.Tensor | None) -> None:
    """Adjoint of :func:`_tokens_out`: ``x`` ``[B, g, W * L, D]`` (tokens in the order whose
    inverse is ``inverse``) -> the ``[W, B, g, L, D]`` view ``dest`` (each destination's
    rank-major tokens), one pass."""
    world, b, _, length, _ = dest.shape
    if inverse is None:
        dest.copy_(x.unflatten(2, (world, length)).permute(2, 0, 1, 3, 4))
        return
    if inverse.dim() == 1:
        index = inverse.view(world, 1, 1, length, 1)
    else:
        index = inverse.view(b, world, length).transpose(0, 1)[:, :, None, :, None]
    source = x.unsqueeze(0).expand(world, *x.shape)
    torch.gather(source, 3, index.expand(dest.shape), out=dest)


def _pack_heads(
    send: torch.Tensor,
    parts: list[torch.Tensor],
    ranges: list[list[tuple[int, int]]],
    regular: list[int | None],
    counts: list[list[int]],
    length: int,
    lo: int,
) -> None:
    """A round's send buffer of :func:`seq_to_heads`: per destination r, each part's heads
    ``[s_r + lo, s_r + lo + n_r)`` of this rank's tokens."""
    if None not in regular:  # every rank's count is the same: rank 0's gives the views
        views = _rank_views(send, parts, counts, 0, length)
        for dest, x, part, k in zip(views, parts, ranges, regular):
            _heads_into(dest, x, part[0][1], k, lo)
        return
    for block, x, s, n in _range_blocks(send, parts, ranges, counts, length, lo):
        block.copy_(x[:, s : s + n])


def _unpack_tokens(
    got: torch.Tensor,
    outs: list[torch.Tensor],
    counts: list[list[int]],
    me: int,
    length: int,
    lo: int,
    sources: Sources,
) -> None:
    """A round's receive buffer of :func:`seq_to_heads` into heads ``[lo, lo + n)`` of
    ``outs``, tokens in the call's order (``sources``)."""
    for out, g in zip(outs, _rank_views(got, outs, counts, me, length)):
        _tokens_out(out[:, lo : lo + g.shape[2]], g, sources)


def _pack_tokens(
    send: torch.Tensor,
    parts: list[torch.Tensor],
    counts: list[list[int]],
    me: int,
    length: int,
    lo: int,
    inverse: torch.Tensor | None,
) -> None:
    """A round's send buffer of :func:`heads_to_seq`: per destination, its rank-major tokens of
    heads ``[lo, lo + n)`` of every part (``inverse``: of the call's token order)."""
    for dest, x in zip(_rank_views(send, parts, counts, me, length), parts):
        _tokens_into(dest, x[:, lo : lo + dest.shape[2]], inverse)


def _unpack_heads(
    got: torch.Tensor,
    outs: list[torch.Tensor],
    ranges: list[list[tuple[int, int]]],
    regular: list[int | None],
    counts: list[list[int]],
    length: int,
    lo: int,
) -> None:
    """A round's receive buffer of :func:`heads_to_seq` into ``outs``: source r's heads
    ``[s_r + lo, s_r + lo + n_r)`` of each part, written (regular ranges) or added."""
    if None not in regular:  # every rank's count is the same: rank 0's gives the views
        views = _rank_views(got, outs, counts, 0, length)
        for out, g, part, k in zip(outs, views, ranges, regular):
            _heads_out(out, g, part[0][1], k, lo)
        return
    for block, out, s, n in _range_blocks(got, outs, ranges, counts, length, lo):
        out[:, s : s + n] += block


def _token_major(x: torch.Tensor, b: int, heads: int, tokens: int, d: int) -> torch.Tensor:
    """An uninitialised ``[b, heads, tokens, d]`` laid out token-major (``[b, tokens, heads, d]``
    in memory): the layout the CPU flash kernels work in, so that neither their inputs nor the
    gradients they return into this layout are copied to another."""
    return x.new_empty(b, tokens, heads, d).transpose(1, 2)


def to_heads(
    parts: list[torch.Tensor],
    group_name: str,
    ranges: list[list[tuple[int, int]]],
    sources: Sources,
    key: int,
) -> list[torch.Tensor]:
    """The movement of :func:`seq_to_heads` for ``ranges[part][rank] = (start, count)`` (no
    autograd), the tokens ordered by ``sources`` (:func:`token_sources` of the order): callers
    that move a few heads at a time (head-parallel attention's chunks) call it directly, with
    the order's sources made once."""
    group = group_from_name(group_name)
    world, me = group.world, group.rank
    regular = [_regular(part) for part in ranges]
    b, length = parts[0].shape[0], parts[0].shape[2]
    widths = [x.shape[3] for x in parts]
    head_bytes = [b * length * d * x.element_size() for x, d in zip(parts, widths)]
    outs = [
        _token_major(x, b, part[me][1], world * length, d)
        for x, part, d in zip(parts, ranges, widths)
    ]
    for lo, counts in _rounds(ranges, head_bytes):
        sends = [sum(b * n[r] * length * d for n, d in zip(counts, widths)) for r in range(world)]
        recvs = [sum(b * n[me] * length * d for n, d in zip(counts, widths))] * world
        send = parts[0].new_empty(sum(sends))
        _pack_heads(send, parts, ranges, regular, counts, length, lo)
        got = all_to_all_v(send, group_name, sends, recvs, key)
        del send  # each buffer freed once used, before the next round's are made
        _unpack_tokens(got, outs, counts, me, length, lo, sources)
        del got
    return outs


@torch.library.custom_op("cpshard::seq_to_heads", mutates_args=())
def seq_to_heads(
    parts: list[torch.Tensor],
    group_name: str,
    heads: Sequence[int],
    order: torch.Tensor | None,
    key: int,
) -> list[torch.Tensor]:
    """This rank's tokens of all heads -> its heads of every rank's tokens (module docstring)."""
    ranges = head_ranges(heads, len(parts), group_from_name(group_name).world)
    return to_heads(parts, group_name, ranges, token_sources(order, parts[0].shape[2]), key)


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
        _token_major(x, x.shape[0], part[group.rank][1], group.world * x.shape[2], x.shape[3])
        for x, part in zip(parts, ranges)
    ]


def to_seq_into(
    outs: list[torch.Tensor],
    parts: list[torch.Tensor],
    group_name: str,
    ranges: list[list[tuple[int, int]]],
    inverse: torch.Tensor | None,
    key: int,
) -> None:
    """The movement of :func:`heads_to_seq` into ``outs`` (``[B, H_i, L, D_i]``, no autograd),
    the tokens ordered by the inverse of the order (:func:`inverse_order`): the heads
    ``ranges`` name are written where the ranges are regular, else added, so ``outs`` hold zeros
    there unless every part's ranges are regular."""
    group = group_from_name(group_name)
    world, me = group.world, group.rank
    regular = [_regular(part) for part in ranges]
    b = parts[0].shape[0]
    length = parts[0].shape[2] // world
    widths = [x.shape[3] for x in parts]
    head_bytes = [b * length * d * x.element_size() for x, d in zip(parts, widths)]
    for lo, counts in _rounds(ranges, head_bytes):
        sends = [sum(b * n[me] * length * d for n, d in zip(counts, widths))] * world
        recvs = [sum(b * n[r] * length * d for n, d in zip(counts, widths)) for r in range(world)]
        send = parts[0].new_empty(sum(sends))
        _pack_tokens(send, parts, counts, me, length, lo, inverse)
        got = all_to_all_v(send, group_name, sends, recvs, key)
        del send  # each buffer freed once used, before the next round's are made
        _unpack_heads(got, outs, ranges, regular, counts, length, lo)
        del got


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
    world = group_from_name(group_name).world
    ranges = head_ranges(heads, len(parts), world)
    b, length = parts[0].shape[0], parts[0].shape[2] // world
    regular = [_regular(part) for part in ranges]
    fill = torch.empty if None not in regular else torch.zeros  # each head written once, or added
    outs = [
        fill(b, _head_count(part), length, x.shape[3], dtype=x.dtype, device=x.device)
        for x, part in zip(parts, ranges)
    ]
    to_seq_into(outs, parts, group_name, ranges, inverse_order(order), key)
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
