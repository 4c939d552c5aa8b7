"""Differentiable sequence transport across a context-parallel group.

* :func:`gather_sequence` / :func:`gather_metadata`: equal contiguous shards -> full sequence.
* :func:`gather_ragged`: per-rank blocks of different lengths -> their concatenation.
* :func:`gather_halo`: prepend the preceding causal window, from as many ranks as it spans.

Each gathers into one output allocation (plus a staging buffer only where the token dim is not
the outermost non-trivial dim, so that a rank's slot is strided), never sends padding, and has
the dual collective as its backward: reduce-scatter(SUM) for gathers, return-to-owner for
halos. The transfers are the custom ops of :mod:`cpshard.comm.collectives`, so
``torch.compile(fullgraph=True)`` traces these functions forward and backward.

Checks (the validation model, :mod:`cpshard.consensus`): by default each call checks its local
arguments only and issues nothing but its data transfer; in checked mode it first reaches
consensus on its arguments (one round over the host channel), so bad input on one rank makes
every rank raise a ``ValueError`` naming it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from cpshard import ops
from cpshard.comm import Group, GroupLike, resolve_group
from cpshard.comm.collectives import all_gather_v, halo_exchange
from cpshard.consensus import check_call
from cpshard.fingerprints import GATHER, HALO, device_code, digest, dtype_code, tensor_call_key
from cpshard.validation import counts_arg, dim_arg, is_int, problem_of, tensor_arg

_MAX_DIMS = 8


def _shape_field(shape: Sequence[int], skip: int | None = None) -> list[int]:
    """ndim then the sizes (``-1`` at ``skip``), padded to a fixed length for consensus."""
    sizes = [-1 if i == skip else int(s) for i, s in enumerate(shape)]
    return [len(sizes), *sizes[:_MAX_DIMS], *([0] * (_MAX_DIMS - min(len(sizes), _MAX_DIMS)))]


def _dim_problem(x: object, dim: int, name: str) -> str | None:
    """The local problem with x and its token dim (argument ``name``), or None."""
    problem = problem_of(lambda: dim_arg(tensor_arg(x, "x"), dim, name))
    if problem is None and x.dim() > _MAX_DIMS:
        problem = f"x has {x.dim()} dims; at most {_MAX_DIMS} are supported"
    return problem


def _common_fields(x: torch.Tensor, dim: int, equal_shape: bool) -> dict[str, list[int]]:
    return {
        "dtype": [dtype_code(x.dtype)],
        "device type": [device_code(x)],
        "token dim": [dim],
        # ranks that differ here would block in the backward collective
        "requires_grad": [int(x.requires_grad and torch.is_grad_enabled())],
        "x.shape" if equal_shape else "x.shape (token dim aside)": _shape_field(
            x.shape, None if equal_shape else dim
        ),
    }


def _gather_blocks(x: torch.Tensor, group: Group, counts: Sequence[int], dim: int) -> torch.Tensor:
    """Rank r's block of ``counts[r]`` tokens along ``dim``, concatenated in rank order.

    Where a rank's slot of the output is contiguous (nothing but size-1 dims before ``dim``)
    the transfer writes straight into the output; otherwise it lands rank-major and one fused
    kernel moves it into place. Autograd composes the dual moves."""
    shape = list(x.shape)
    row = math.prod(shape[:dim]) * math.prod(shape[dim + 1 :])  # elements per token
    sizes = [c * row for c in counts]
    out_shape = shape[:dim] + [sum(counts)] + shape[dim + 1 :]
    flat = all_gather_v(x, group.name, sizes, tensor_call_key(GATHER, x, dim, True, counts))
    if math.prod(shape[:dim]) == 1:  # a rank's slot of the output is contiguous
        return flat.view(out_shape)
    if all(c == counts[0] for c in counts):
        return ops.interleave_sequence(flat.view([len(counts), *shape]), dim)
    return ops.unpack_ragged(flat, list(counts), out_shape, dim)


# ------------------------------------------------------------------ equal shards


def _checked_equal(x: torch.Tensor, group: GroupLike, seq_dim: int, what: str, metadata: bool) -> tuple[Group, int]:
    g = resolve_group(group, what)
    problem = _dim_problem(x, seq_dim, "seq_dim")
    if problem is None and metadata and x.requires_grad:
        problem = "x requires grad; use gather_sequence for differentiable tensors"
    if problem is not None or g.world == 1:
        check_call(g, what, problem)
        return g, 0
    dim = seq_dim % x.dim()
    check_call(g, what, None, lambda: _common_fields(x, dim, equal_shape=True))
    return g, dim


def gather_sequence(x: torch.Tensor, group: GroupLike, seq_dim: int = 1) -> torch.Tensor:
    """Gather equal contiguous CP shards ``[.., L, ..]`` into the full ``[.., W*L, ..]`` sequence
    in rank order; backward reduce-scatters (SUM) the gradient. Returns ``x`` itself (an alias)
    without CP (``group`` None or of size 1)."""
    what = "cpshard.gather_sequence"
    g, dim = _checked_equal(x, group, seq_dim, what, metadata=False)
    if g.world == 1:
        return x
    return _gather_blocks(x, g, [x.shape[dim]] * g.world, dim)


def gather_metadata(x: torch.Tensor, group: GroupLike, seq_dim: int = 1) -> torch.Tensor:
    """Gather non-differentiable shards (positions, masks, index projections) like
    :func:`gather_sequence`; raises if ``x.requires_grad``. Aliases ``x`` without CP."""
    what = "cpshard.gather_metadata"
    g, dim = _checked_equal(x, group, seq_dim, what, metadata=True)
    if g.world == 1:
        return x
    with torch.no_grad():
        return _gather_blocks(x, g, [x.shape[dim]] * g.world, dim)


# ------------------------------------------------------------------ ragged blocks


def gather_ragged(x: torch.Tensor, group: GroupLike, counts: Sequence[int], dim: int = 0) -> torch.Tensor:
    """Gather per-rank blocks with different token counts into ``[.., sum(counts), ..]`` in rank
    order (``counts[r]`` = rank r's ``x.shape[dim]``, the same list on every rank). Backward is
    reduce-scatter-v(SUM): each rank receives the sum over ranks of its block's gradient rows.
    No padding is sent. Returns ``x`` itself without CP."""
    what = "cpshard.gather_ragged"
    g = resolve_group(group, what)
    problem = _dim_problem(x, dim, "dim") or problem_of(counts_arg, counts, g.world)
    if problem is None and x.shape[dim] != counts[g.rank]:
        problem = f"x.shape[{dim % x.dim()}] = {x.shape[dim]} but counts[{g.rank}] = {counts[g.rank]}"
    if problem is not None or g.world == 1:
        check_call(g, what, problem)
        return x
    d = dim % x.dim()

    def fields() -> dict[str, list[int]]:
        return {**_common_fields(x, d, equal_shape=False), "counts": digest(counts)}

    check_call(g, what, None, fields)
    return _gather_blocks(x, g, list(counts), d)


# ------------------------------------------------------------------ halo exchange


def _halo_problem(halo_size: object, left_padding: object, world: int) -> str | None:
    if isinstance(halo_size, Sequence) and not isinstance(halo_size, str):
        if len(halo_size) != world:
            return f"halo_size has {len(halo_size)} entries but the group has {world} ranks"
        values = list(halo_size)
    else:
        values = [halo_size]
    for v in values:
        if not is_int(v):
            return f"halo_size must be an int or a list of ints, got {v!r}"
        if v < 0:
            return f"halo_size={v} must be >= 0"
    if not is_int(left_padding) or left_padding < 0:
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
    found a problem of its own calls ``check_call(g, what, problem)`` instead: in checked mode
    that is the same exchange, so every rank raises after ONE consensus round."""
    problem = _dim_problem(x, seq_dim, "seq_dim") or _halo_problem(halo_size, left_padding, g.world)
    if problem is not None:
        check_call(g, what, problem)
    dim = seq_dim % x.dim()
    halos = list(halo_size) if isinstance(halo_size, Sequence) else [halo_size] * g.world
    if g.world == 1:
        if left_padding == 0:
            return x
        pad_shape = list(x.shape)
        pad_shape[dim] = left_padding
        return torch.cat([x.new_zeros(pad_shape), x], dim)

    def fields() -> dict[str, list[int]]:
        return {**_common_fields(x, dim, equal_shape=True), "halo_size": digest(halos)}

    check_call(g, what, None, fields)
    key = tensor_call_key(HALO, x, dim, False, halos)
    return halo_exchange(x, g.name, halos, left_padding, dim, key)
