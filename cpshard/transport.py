"""Differentiable sequence transport across a context-parallel group.

* :func:`gather_sequence` / :func:`gather_metadata`: equal contiguous shards -> full sequence.
* :func:`gather_ragged`: per-rank blocks of different lengths -> their concatenation.
* :func:`gather_halo`: prepend the preceding causal window, from as many ranks as it spans.

Each gathers into one output allocation (plus a staging buffer only where the token dim is not
the outermost non-trivial dim, so that a rank's slot is strided), never sends padding, and has
the dual collective as its backward: reduce-scatter(SUM) for gathers, return-to-owner for
halos. Every call first reaches consensus on its arguments (one tiny all-gather), so bad input
on one rank makes every rank raise a ``ValueError`` naming it instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard import ops
from cpshard.comm import Group, GroupLike, nvtx_range, resolve_group, transport_for
from cpshard.consensus import agree, digest, dtype_code
from cpshard.hugepages import new_buffer

_MAX_DIMS = 8


def _shape_field(shape: Sequence[int], skip: int | None = None) -> list[int]:
    """ndim then the sizes (``-1`` at ``skip``), padded to a fixed length for consensus."""
    sizes = [-1 if i == skip else int(s) for i, s in enumerate(shape)]
    return [len(sizes), *sizes[:_MAX_DIMS], *([0] * (_MAX_DIMS - min(len(sizes), _MAX_DIMS)))]


def _dim_problem(x: object, dim: int, name: str) -> str | None:
    """The local problem with x and its token dim (argument ``name``), or None."""
    if not isinstance(x, torch.Tensor):
        return f"x must be a torch.Tensor, got {type(x).__name__}"
    if isinstance(dim, bool) or not isinstance(dim, int):
        return f"{name} must be an int, got {type(dim).__name__}"
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        return f"{name}={dim} is out of range for x of shape {tuple(x.shape)}"
    if x.dim() > _MAX_DIMS:
        return f"x has {x.dim()} dims; at most {_MAX_DIMS} are supported"
    return None


def _common_fields(x: torch.Tensor, dim: int, equal_shape: bool) -> dict[str, list[int]]:
    return {
        "dtype": [dtype_code(x.dtype)],
        "device type": [0 if x.device.type == "cpu" else 1],
        "token dim": [dim],
        # ranks that differ here would block in the backward collective
        "requires_grad": [int(x.requires_grad and torch.is_grad_enabled())],
        "x.shape" if equal_shape else "x.shape (token dim aside)": _shape_field(
            x.shape, None if equal_shape else dim
        ),
    }


def _outer(shape: Sequence[int], dim: int) -> int:
    """Product of the sizes before dim: 1 means a rank's slot along dim is contiguous."""
    out = 1
    for s in shape[:dim]:
        out *= int(s)
    return out


def _row_elems(shape: Sequence[int], dim: int) -> int:
    """Elements per token: the product of every size but ``shape[dim]``."""
    out = 1
    for i, s in enumerate(shape):
        if i != dim:
            out *= int(s)
    return out


# ------------------------------------------------------------------ equal shards


def _gather_equal(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    world = group.world
    shape = list(x.shape)
    out_shape = shape[:dim] + [shape[dim] * world] + shape[dim + 1 :]
    comm = transport_for(group, x)
    if _outer(shape, dim) == 1:
        out = new_buffer(x, out_shape)
        comm.all_gather(out.view(-1), x)
        return out
    stage = new_buffer(x, [world, *shape])
    comm.all_gather(stage.view(-1), x)
    return ops.interleave_sequence(stage, dim)


def _reduce_scatter_equal(grad: torch.Tensor, group: Group, dim: int, shape: list[int]) -> torch.Tensor:
    full = grad if _outer(shape, dim) == 1 else ops.deinterleave_sequence(grad, group.world, dim)
    out = new_buffer(grad, shape)
    transport_for(group, grad).reduce_scatter(out.view(-1), full.contiguous().view(-1))
    return out


class _GatherSequence(torch.autograd.Function):
    """Gather into one allocation; reduce-scatter(SUM) the gradient back to the shard owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.shape = group, dim, list(x.shape)
        with nvtx_range("cpshard.gather_sequence", x):
            return _gather_equal(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        with nvtx_range("cpshard.gather_sequence.backward", grad):
            return _reduce_scatter_equal(grad, ctx.group, ctx.dim, ctx.shape), None, None


def _checked_equal(x: torch.Tensor, group: GroupLike, seq_dim: int, what: str, metadata: bool) -> tuple[Group, int]:
    g = resolve_group(group, what)
    problem = _dim_problem(x, seq_dim, "seq_dim")
    if problem is None and metadata and x.requires_grad:
        problem = "x requires grad; use gather_sequence for differentiable tensors"
    if g.world == 1 or problem is not None:
        agree(g, what, problem)
        return g, 0
    dim = seq_dim % x.dim()
    agree(g, what, None, _common_fields(x, dim, equal_shape=True))
    return g, dim


def gather_sequence(x: torch.Tensor, group: GroupLike, seq_dim: int = 1) -> torch.Tensor:
    """Gather equal contiguous CP shards ``[.., L, ..]`` into the full ``[.., W*L, ..]`` sequence
    in rank order; backward reduce-scatters (SUM) the gradient. Returns ``x`` itself (an alias)
    without CP (``group`` None or of size 1)."""
    what = "cpshard.gather_sequence"
    g, dim = _checked_equal(x, group, seq_dim, what, metadata=False)
    if g.world == 1:
        return x
    return _GatherSequence.apply(x, g, dim)


def gather_metadata(x: torch.Tensor, group: GroupLike, seq_dim: int = 1) -> torch.Tensor:
    """Gather non-differentiable shards (positions, masks, index projections) like
    :func:`gather_sequence`; raises if ``x.requires_grad``. Aliases ``x`` without CP."""
    what = "cpshard.gather_metadata"
    g, dim = _checked_equal(x, group, seq_dim, what, metadata=True)
    if g.world == 1:
        return x
    with torch.no_grad(), nvtx_range(what, x):
        return _gather_equal(x, g, dim)


# ------------------------------------------------------------------ ragged blocks


class _GatherRagged(torch.autograd.Function):
    """All-gather-v of per-rank blocks; reduce-scatter-v(SUM) of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, counts: list[int], dim: int) -> torch.Tensor:
        ctx.group, ctx.counts, ctx.dim, ctx.shape = group, counts, dim, list(x.shape)
        shape = list(x.shape)
        out_shape = shape[:dim] + [sum(counts)] + shape[dim + 1 :]
        sizes = [c * _row_elems(shape, dim) for c in counts]
        comm = transport_for(group, x)
        with nvtx_range("cpshard.gather_ragged", x):
            if _outer(shape, dim) == 1:
                out = new_buffer(x, out_shape)
                comm.all_gather_v(out.view(-1), x, sizes)
                return out
            stage = new_buffer(x, sum(sizes))
            comm.all_gather_v(stage, x, sizes)
            return ops.unpack_ragged(stage, counts, out_shape, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        counts, dim, shape = ctx.counts, ctx.dim, ctx.shape
        row = _row_elems(shape, dim)
        with nvtx_range("cpshard.gather_ragged.backward", grad):
            full = grad if _outer(shape, dim) == 1 else ops.pack_ragged(grad, counts, dim)
            out = new_buffer(grad, shape)
            transport_for(ctx.group, grad).reduce_scatter_v(
                out.view(-1), full.contiguous().view(-1), [c * row for c in counts]
            )
        return out, None, None, None


def _counts_problem(counts: object, world: int) -> str | None:
    if isinstance(counts, torch.Tensor):
        return "counts must be a list of ints, not a tensor (it must be known on the host)"
    if not isinstance(counts, Sequence) or isinstance(counts, str):
        return f"counts must be a sequence of ints, got {type(counts).__name__}"
    if len(counts) != world:
        return f"counts has {len(counts)} entries but the group has {world} ranks"
    for r, c in enumerate(counts):
        if isinstance(c, bool) or not isinstance(c, int):
            return f"counts[{r}] must be an int, got {type(c).__name__}"
        if c < 0:
            return f"counts[{r}] = {c} is negative"
    return None


def gather_ragged(x: torch.Tensor, group: GroupLike, counts: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Gather per-rank blocks with different token counts into ``[.., sum(counts), ..]`` in rank
    order (``counts[r]`` = rank r's ``x.shape[dim]``, the same list on every rank). Backward is
    reduce-scatter-v(SUM): each rank receives the sum over ranks of its block's gradient rows.
    No padding is sent. Returns ``x`` itself without CP."""
    what = "cpshard.gather_ragged"
    g = resolve_group(group, what)
    problem = _dim_problem(x, dim, "dim") or _counts_problem(counts, g.world)
    if problem is None and x.shape[dim] != counts[g.rank]:
        problem = f"x.shape[{dim % x.dim()}] = {x.shape[dim]} but counts[{g.rank}] = {counts[g.rank]}"
    if problem is not None or g.world == 1:
        agree(g, what, problem)
        return x
    d = dim % x.dim()
    fields = _common_fields(x, d, equal_shape=False)
    fields["counts"] = digest(counts)
    agree(g, what, None, fields)
    return _GatherRagged.apply(x, g, list(counts), d)


# ------------------------------------------------------------------ halo exchange


@dataclass(frozen=True)
class _HaloPlan:
    """Who sends which rows to whom, derived identically on every rank.

    ``recvs[q] = (lo, hi)``: rows [lo, hi) of rank q's shard land in this rank's halo at
    ``at``; ``sends[r] = (lo, hi)``: rows [lo, hi) of this shard go to rank r.
    """

    halo: int  # tokens this rank receives
    recvs: tuple[tuple[int, int, int, int], ...]  # (source rank, lo, hi, halo offset)
    sends: tuple[tuple[int, int, int], ...]  # (dest rank, lo, hi)


def _halo_plan(rank: int, world: int, length: int, halos: Sequence[int]) -> _HaloPlan:
    def window(r: int) -> tuple[int, int]:
        h = min(r * length, halos[r])
        return r * length - h, r * length

    begin, end = window(rank)
    recvs = []
    for q in range(world):
        lo, hi = max(begin, q * length), min(end, (q + 1) * length)
        if lo < hi:
            recvs.append((q, lo - q * length, hi - q * length, lo - begin))
    sends = []
    mine = (rank * length, (rank + 1) * length)
    for r in range(world):
        b, e = window(r)
        lo, hi = max(b, mine[0]), min(e, mine[1])
        if r != rank and lo < hi:
            sends.append((r, lo - mine[0], hi - mine[0]))
    return _HaloPlan(end - begin, tuple(recvs), tuple(sends))


class _GatherHalo(torch.autograd.Function):
    """Receive the preceding window from its owners; return its gradient to them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group, plan: _HaloPlan, left_padding: int, dim: int) -> torch.Tensor:
        ctx.group, ctx.plan, ctx.left_padding, ctx.dim = group, plan, left_padding, dim
        shape = list(x.shape)
        out_shape = list(shape)
        out_shape[dim] = left_padding + plan.halo + shape[dim]
        out = new_buffer(x, out_shape)
        out.narrow(dim, 0, left_padding).zero_()
        out.narrow(dim, left_padding + plan.halo, shape[dim]).copy_(x)
        direct = _outer(shape, dim) == 1
        recvs, copies = [], []
        for q, lo, hi, at in plan.recvs:
            slot = out.narrow(dim, left_padding + at, hi - lo)
            buf = slot if direct else x.new_empty(slot.shape)
            recvs.append((q, buf))
            if not direct:
                copies.append((slot, buf))
        sends = [(r, x.narrow(dim, lo, hi - lo)) for r, lo, hi in plan.sends]
        with nvtx_range("cpshard.gather_halo", x):
            transport_for(group, x).send_recv(sends, recvs)
        for slot, buf in copies:
            slot.copy_(buf)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        plan, lp, dim = ctx.plan, ctx.left_padding, ctx.dim
        length = grad.shape[dim] - lp - plan.halo
        grad_x = grad.narrow(dim, lp + plan.halo, length).clone(memory_format=torch.contiguous_format)
        sends = [(q, grad.narrow(dim, lp + at, hi - lo)) for q, lo, hi, at in plan.recvs]
        recvs = [(r, grad.new_empty(grad_x.narrow(dim, lo, hi - lo).shape)) for r, lo, hi in plan.sends]
        with nvtx_range("cpshard.gather_halo.backward", grad):
            transport_for(ctx.group, grad).send_recv(sends, recvs)
        for (r, lo, hi), (_, buf) in zip(plan.sends, recvs):
            grad_x.narrow(dim, lo, hi - lo).add_(buf)
        return grad_x, None, None, None, None


def _halo_problem(halo_size: object, left_padding: object, world: int) -> str | None:
    if isinstance(halo_size, Sequence) and not isinstance(halo_size, str):
        if len(halo_size) != world:
            return f"halo_size has {len(halo_size)} entries but the group has {world} ranks"
        values = list(halo_size)
    else:
        values = [halo_size]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            return f"halo_size must be an int or a list of ints, got {v!r}"
        if v < 0:
            return f"halo_size={v} must be >= 0"
    if isinstance(left_padding, bool) or not isinstance(left_padding, int) or left_padding < 0:
        return f"left_padding must be an int >= 0, got {left_padding!r}"
    return None


def gather_halo(
    x: torch.Tensor,
    group: GroupLike,
    halo_size: int | Sequence[int],
    left_padding: int = 0,
    seq_dim: int = 1,
) -> torch.Tensor:
    """Prepend the preceding causal window: rank r receives the last ``min(r*L, halo_size)``
    tokens before its shard, from as many preceding ranks as the window spans, plus
    ``left_padding`` zero positions that are not sent. Output length along ``seq_dim``:
    ``left_padding + min(r*L, halo_size) + L``. ``halo_size`` may be a per-rank list (the same
    list on every rank). Backward returns each halo row's gradient to its owner, which adds it."""
    what = "cpshard.gather_halo"
    return exchange_halo(x, resolve_group(group, what), halo_size, left_padding, seq_dim, what)


def exchange_halo(
    x: torch.Tensor,
    g: Group,
    halo_size: int | Sequence[int],
    left_padding: int,
    seq_dim: int,
    what: str,
) -> torch.Tensor:
    """:func:`gather_halo` on a resolved group, its errors reported as ``what``. A caller that
    found a problem of its own calls ``agree(g, what, problem)`` instead: that is the same
    exchange, so every rank raises after ONE consensus round."""
    problem = _dim_problem(x, seq_dim, "seq_dim") or _halo_problem(halo_size, left_padding, g.world)
    if problem is not None:
        agree(g, what, problem)
    dim = seq_dim % x.dim()
    halos = list(halo_size) if isinstance(halo_size, Sequence) else [halo_size] * g.world
    if g.world == 1:
        if left_padding == 0:
            return x
        pad_shape = list(x.shape)
        pad_shape[dim] = left_padding
        return torch.cat([x.new_zeros(pad_shape), x], dim)
    fields = _common_fields(x, dim, equal_shape=True)
    fields["halo_size"] = digest(halos)
    agree(g, what, None, fields)
    plan = _halo_plan(g.rank, g.world, x.shape[dim], halos)
    return _GatherHalo.apply(x, g, plan, left_padding, dim)
