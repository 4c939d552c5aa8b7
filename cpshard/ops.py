"""Validated wrappers over the native operators in ``torch.ops.cpshard``.

This is the only module that calls ``torch.ops.cpshard``. Each wrapper checks its arguments and
raises ``TypeError``/``ValueError`` naming the bad one before the native op runs (which checks
again with ``TORCH_CHECK``, so a direct ``torch.ops`` call cannot read or write out of bounds).
Fake kernels (for ``torch.compile`` / meta tensors) and autograd formulas are registered here:
every data-moving op is differentiable, its backward being the adjoint move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from cpshard import _C  # noqa: F401  (loads the library that registers torch.ops.cpshard)
from cpshard.validation import counts_arg, is_int, raised, tensor_arg

_ops = torch.ops.cpshard

Number = int | float | bool


def _counts(counts: Sequence[int], what: str) -> list[int]:
    """Per-rank counts (a host sequence or a tensor) as a list of non-negative Python ints."""
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    out = raised(what, counts_arg, counts)
    if not out:
        raise ValueError(f"{what}: counts must name at least one rank")
    return out


def _shape(shape: Sequence[int], name: str, what: str) -> list[int]:
    """A shape argument as a list of non-negative sizes (ints, or SymInts under tracing)."""
    if isinstance(shape, torch.Tensor) or not isinstance(shape, Sequence) or isinstance(shape, str):
        raise TypeError(f"{what}: {name} must be a sequence of ints, got {type(shape).__name__}")
    out = []
    for i, s in enumerate(shape):
        if isinstance(s, bool) or not isinstance(s, (int, torch.SymInt)):
            raise TypeError(f"{what}: {name}[{i}] must be an int, got {type(s).__name__}")
        if isinstance(s, int) and s < 0:
            raise ValueError(f"{what}: {name}[{i}] = {s} is negative")
        out.append(s)
    return out


def _tensor(x: object, name: str, what: str) -> torch.Tensor:
    return raised(what, tensor_arg, x, name)


def _dim(dim: int, ndim: int, name: str, what: str) -> int:
    """dim wrapped into [0, ndim), or a ValueError naming the argument."""
    if not is_int(dim):
        raise TypeError(f"{what}: {name} must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{what}: {name}={dim} is out of range for a {ndim}-d tensor")
    return dim % ndim


def _pad_to(pad_to: int | None, counts: list[int], what: str) -> int:
    """The native pad argument: -1 for exact offsets (None), else a length >= every count."""
    if pad_to is None:
        return -1
    if not is_int(pad_to):
        raise TypeError(f"{what}: pad_to must be an int or None, got {type(pad_to).__name__}")
    if pad_to < max(counts):
        raise ValueError(f"{what}: pad_to={pad_to} is smaller than the largest count {max(counts)}")
    return pad_to


def _fill(fill: Number, dtype: torch.dtype, what: str) -> Number:
    """fill, if dtype can hold it exactly in range (rounding a float is fine; wrapping, truncating
    or overflowing to inf is not)."""
    if not isinstance(fill, (bool, int, float, complex)):
        raise TypeError(f"{what}: fill must be a number, got {type(fill).__name__}")
    if isinstance(fill, complex) and not dtype.is_complex:
        raise TypeError(f"{what}: fill={fill!r} is complex but the data is {dtype}")
    if dtype.is_complex or isinstance(fill, bool):
        return fill
    if dtype == torch.bool:
        if fill not in (0, 1):
            raise ValueError(f"{what}: fill={fill!r} is not representable in torch.bool (0 or 1)")
    elif not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        if isinstance(fill, float) and not fill.is_integer() or not info.min <= fill <= info.max:
            raise ValueError(f"{what}: fill={fill!r} is not representable in {dtype}")
    elif math.isfinite(fill) and abs(fill) > torch.finfo(dtype).max:
        raise ValueError(f"{what}: fill={fill!r} overflows {dtype}")
    return fill


def _fits_int64(what: str, name: str, *factors: int) -> None:
    """Raise naming ``name`` when the product of ``factors`` (a buffer's numel) overflows int64."""
    if math.prod(factors) >= 2**63:
        raise ValueError(f"{what}: {name} makes a buffer of {math.prod(factors)} elements (over int64)")


def _shape_fits_int64(what: str, name: str, shape: Sequence[int]) -> None:
    """An output shape must multiply within int64 up to its first zero, in order (the native
    geometry multiplies it so, even when a zero size makes the tensor empty)."""
    # A plain loop, not itertools.takewhile: torch 2.11's Dynamo cannot trace takewhile.
    prefix: list[int] = []
    for size in shape:
        if not size:
            break
        prefix.append(size)
    _fits_int64(what, name, *prefix)


def _index(index: torch.Tensor, data: torch.Tensor, what: str) -> torch.Tensor:
    _tensor(index, "index", what)
    if index.dim() != 1:
        raise ValueError(f"{what}: index must be 1-D, got shape {tuple(index.shape)}")
    if index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{what}: index must be int64 or int32, got {index.dtype}")
    if index.device != data.device:
        raise ValueError(f"{what}: index is on {index.device} but the data is on {data.device}")
    return index


def pack_ragged(
    x: torch.Tensor,
    counts: Sequence[int],
    dim: int = 0,
    *,
    pad_to: int | None = None,
    fill: Number = 0,
) -> torch.Tensor:
    """Split compact ``x`` (``x.shape[dim] == sum(counts)``) into per-rank blocks.

    ``pad_to=None``: exact-offset blocks, block r = ``x``'s rows of rank r as a contiguous
    ``[pre, n_r, post]`` tensor, all blocks back to back in a 1-D buffer (what an uneven
    all-to-all sends). ``pad_to=P``: a ``[W, *pre, P, *post]`` tensor, padding rows set to
    ``fill`` (what a padded all-gather / reduce-scatter moves).
    """
    what = "cpshard.pack_ragged"
    _tensor(x, "x", what)
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension")
    counts = _counts(counts, what)
    dim = _dim(dim, x.dim(), "dim", what)
    if sum(counts) != x.shape[dim]:
        raise ValueError(f"{what}: counts sum to {sum(counts)} but x.shape[{dim}] is {x.shape[dim]}")
    pad = _pad_to(pad_to, counts, what)
    _fits_int64(what, "pad_to", len(counts), max(pad, 0), _numel_without(x.shape, dim))
    return _ops.pack_ragged(x, counts, dim, pad, _fill(fill, x.dtype, what))


def unpack_ragged(
    packed: torch.Tensor,
    counts: Sequence[int],
    out_shape: Sequence[int],
    dim: int = 0,
    *,
    pad_to: int | None = None,
) -> torch.Tensor:
    """Inverse of :func:`pack_ragged`: blocks (exact or padded to ``pad_to``) -> compact tensor of
    ``out_shape`` (with ``out_shape[dim] == sum(counts)``); padding rows are dropped."""
    what = "cpshard.unpack_ragged"
    _tensor(packed, "packed", what)
    counts = _counts(counts, what)
    out_shape = _shape(out_shape, "out_shape", what)
    if not out_shape:
        raise ValueError(f"{what}: out_shape must have at least one dimension")
    dim = _dim(dim, len(out_shape), "dim", what)
    if sum(counts) != out_shape[dim]:
        raise ValueError(f"{what}: counts sum to {sum(counts)} but out_shape[{dim}] is {out_shape[dim]}")
    pad = _pad_to(pad_to, counts, what)
    rows = len(counts) * pad if pad >= 0 else sum(counts)
    expected = rows * _numel_without(out_shape, dim)
    if packed.numel() != expected:
        raise ValueError(
            f"{what}: packed has {packed.numel()} elements but counts={counts}, pad_to={pad_to} "
            f"and out_shape={out_shape} describe {expected}"
        )
    return _ops.unpack_ragged(packed, counts, dim, pad, out_shape)


def _numel_without(shape: Sequence[int], dim: int) -> int:
    """Product of every size but ``shape[dim]``."""
    out = 1
    for i, s in enumerate(shape):
        if i != dim:
            out *= s
    return out


def interleave_sequence(x: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """``[W, *pre, L, *post]`` (one slot per rank, as an all-gather delivers it) ->
    ``[*pre, W*L, *post]`` in one pass; ``dim`` is the sequence dim of the output."""
    what = "cpshard.interleave_sequence"
    _tensor(x, "x", what)
    if x.dim() < 2:
        raise ValueError(f"{what}: x must be [W, ..., L, ...] with at least two dimensions")
    return _ops.interleave_sequence(x, _dim(dim, x.dim() - 1, "dim", what))


def deinterleave_sequence(x: torch.Tensor, world: int, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`interleave_sequence`: ``[*pre, W*L, *post]`` -> ``[W, *pre, L, *post]``."""
    what = "cpshard.deinterleave_sequence"
    _tensor(x, "x", what)
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension")
    if not is_int(world) or world < 1:
        raise ValueError(f"{what}: world must be a positive int, got {world!r}")
    dim = _dim(dim, x.dim(), "dim", what)
    if x.shape[dim] % world:
        raise ValueError(f"{what}: x.shape[{dim}] = {x.shape[dim]} is not divisible by world = {world}")
    # An empty x divides by any world; the [W, ...] output must still be sized within int64.
    _shape_fits_int64(what, "world", [world, *x.shape[:dim], x.shape[dim] // world, *x.shape[dim + 1 :]])
    return _ops.deinterleave_sequence(x, world, dim)


def index_gather(src: torch.Tensor, index: torch.Tensor, dim: int = 0, fill: Number = 0) -> torch.Tensor:
    """``out[.., i, ..] = src[.., index[i], ..]`` along ``dim``, ``fill`` where ``index[i] < 0``.

    Every non-negative index must be ``< src.shape[dim]``. On CPU that is checked before the
    kernel runs (a ``RuntimeError`` naming the index). On CUDA it is checked on the device, so
    that a call never syncs with the host: an out-of-range index is never read through; it fails
    a device-side assertion, reported as a CUDA error by the next call that synchronizes (and the
    CUDA context is unusable afterwards, as after any device-side assertion in PyTorch)."""
    what = "cpshard.index_gather"
    _tensor(src, "src", what)
    if src.dim() == 0:
        raise ValueError(f"{what}: src must have at least one dimension")
    dim = _dim(dim, src.dim(), "dim", what)
    return _ops.index_gather(src, _index(index, src, what), dim, _fill(fill, src.dtype, what))


def index_scatter_add(grad: torch.Tensor, index: torch.Tensor, dim: int, dim_size: int) -> torch.Tensor:
    """Adjoint of :func:`index_gather`: ``out.shape[dim] = dim_size`` and
    ``out[.., j, ..] = sum(grad[.., i, ..] for i with index[i] == j)``, summed in ascending ``i``
    (deterministic); rows with a negative index are dropped. An index ``>= dim_size`` raises on
    CPU and fails a device-side assertion on CUDA (no host sync per call), as in
    :func:`index_gather`."""
    what = "cpshard.index_scatter_add"
    _tensor(grad, "grad", what)
    if grad.dim() == 0:
        raise ValueError(f"{what}: grad must have at least one dimension")
    if grad.dtype == torch.bool:
        raise TypeError(f"{what}: grad must be numeric, got torch.bool")
    dim = _dim(dim, grad.dim(), "dim", what)
    if not is_int(dim_size) or dim_size < 0:
        raise ValueError(f"{what}: dim_size must be a non-negative int, got {dim_size!r}")
    index = _index(index, grad, what)
    if index.numel() != grad.shape[dim]:
        raise ValueError(f"{what}: index has {index.numel()} entries but grad.shape[{dim}] is {grad.shape[dim]}")
    _shape_fits_int64(what, "dim_size", [*grad.shape[:dim], dim_size, *grad.shape[dim + 1 :]])
    return _ops.index_scatter_add(grad, index, dim, dim_size)


class DocumentSegments(NamedTuple):
    """One rank's document segments, int64 ``[n_segments]`` each, in row-major order."""

    row: torch.Tensor  # batch row of the segment
    begin: torch.Tensor  # global position of its first token (>= the rank's start)
    length: torch.Tensor  # tokens in the segment (all inside the rank's range)
    doc_start: torch.Tensor  # global position where its document begins (<= begin)


def document_segments(doc_ids: torch.Tensor, start: int, end: int) -> DocumentSegments:
    """Segments of the documents (maximal runs of one non-zero id; 0 = padding) that overlap the
    token range ``[start, end)`` of every row of ``doc_ids`` ``[B, S]``.

    On CUDA this syncs with the host once per call (the number of segments sizes the outputs):
    it is a per-step op, meant to run once per batch, never inside a layer."""
    what = "cpshard.document_segments"
    _tensor(doc_ids, "doc_ids", what)
    if doc_ids.dim() != 2:
        raise ValueError(f"{what}: doc_ids must be [B, S], got shape {tuple(doc_ids.shape)}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex:
        raise TypeError(f"{what}: doc_ids must hold integers or bools, got {doc_ids.dtype}")
    for name, v in (("start", start), ("end", end)):
        if not is_int(v):
            raise TypeError(f"{what}: {name} must be an int, got {type(v).__name__}")
    if not 0 <= start <= end <= doc_ids.shape[1]:
        raise ValueError(f"{what}: need 0 <= start <= end <= S, got start={start}, end={end}, S={doc_ids.shape[1]}")
    return DocumentSegments(*_ops.document_segments(doc_ids, start, end))


# ---------------------------------------------------------------- fake kernels (meta shapes)


def _padded_shape(shape: Sequence[int], dim: int, world: int, pad: int) -> list[int]:
    out = [world, *shape]
    out[dim + 1] = pad
    return out


@torch.library.register_fake("cpshard::pack_ragged")
def _pack_ragged_fake(x, counts, dim, pad_to, fill):
    dim = dim % x.dim()
    if pad_to >= 0:
        return x.new_empty(_padded_shape(x.shape, dim, len(counts), pad_to))
    return x.new_empty([x.numel()])


@torch.library.register_fake("cpshard::unpack_ragged")
def _unpack_ragged_fake(packed, counts, dim, pad_to, out_shape):
    return packed.new_empty(out_shape)


@torch.library.register_fake("cpshard::interleave_sequence")
def _interleave_fake(x, dim):
    dim = dim % (x.dim() - 1)
    shape = list(x.shape[1:])
    shape[dim] = shape[dim] * x.shape[0]
    return x.new_empty(shape)


@torch.library.register_fake("cpshard::deinterleave_sequence")
def _deinterleave_fake(x, world, dim):
    dim = dim % x.dim()
    return x.new_empty(_padded_shape(x.shape, dim, world, x.shape[dim] // world))


def _same_device(data: torch.Tensor, index: torch.Tensor, what: str) -> None:
    if index.device != data.device:
        raise RuntimeError(f"{what}: index is on {index.device} but the data is on {data.device}")


@torch.library.register_fake("cpshard::index_gather")
def _index_gather_fake(src, index, dim, fill):
    _same_device(src, index, "cpshard.index_gather")
    dim = dim % src.dim()
    shape = list(src.shape)
    shape[dim] = index.shape[0]
    return src.new_empty(shape)


@torch.library.register_fake("cpshard::index_scatter_add")
def _index_scatter_add_fake(grad, index, dim, dim_size):
    _same_device(grad, index, "cpshard.index_scatter_add")
    dim = dim % grad.dim()
    shape = list(grad.shape)
    shape[dim] = dim_size
    return grad.new_empty(shape)


@torch.library.register_fake("cpshard::document_segments")
def _document_segments_fake(doc_ids, start, end):
    n = torch.library.get_ctx().new_dynamic_size()
    return tuple(doc_ids.new_empty([n], dtype=torch.int64) for _ in range(4))


# ---------------------------------------------------------------- autograd: adjoint moves


def _save_args(names: tuple[str, ...]):
    """setup_context that keeps the named op arguments (plus the first input's shape) on ctx."""

    def setup_context(ctx, inputs, output):
        params = dict(zip(("first", *names), inputs))
        for name in names:
            setattr(ctx, name, params[name])
        ctx.first_shape = list(inputs[0].shape)

    return setup_context


def _pack_ragged_backward(ctx, grad):
    out = _ops.unpack_ragged(grad.contiguous(), ctx.counts, ctx.dim, ctx.pad_to, ctx.first_shape)
    return out, None, None, None, None


def _unpack_ragged_backward(ctx, grad):
    packed = _ops.pack_ragged(grad, ctx.counts, ctx.dim, ctx.pad_to, 0)
    return packed.reshape(ctx.first_shape), None, None, None, None


def _interleave_backward(ctx, grad):
    if ctx.first_shape[0] == 0:  # no ranks: nothing to route back
        return grad.new_zeros(ctx.first_shape), None
    return _ops.deinterleave_sequence(grad, ctx.first_shape[0], ctx.dim), None


def _deinterleave_backward(ctx, grad):
    return _ops.interleave_sequence(grad, ctx.dim), None, None


def _index_gather_backward(ctx, grad):
    size = ctx.first_shape[ctx.dim]
    return _ops.index_scatter_add(grad, ctx.index, ctx.dim, size), None, None, None


def _index_scatter_add_backward(ctx, grad):
    return _ops.index_gather(grad, ctx.index, ctx.dim, 0), None, None, None


torch.library.register_autograd(
    "cpshard::pack_ragged", _pack_ragged_backward, setup_context=_save_args(("counts", "dim", "pad_to"))
)
torch.library.register_autograd(
    "cpshard::unpack_ragged", _unpack_ragged_backward, setup_context=_save_args(("counts", "dim", "pad_to"))
)
torch.library.register_autograd(
    "cpshard::interleave_sequence", _interleave_backward, setup_context=_save_args(("dim",))
)
torch.library.register_autograd(
    "cpshard::deinterleave_sequence", _deinterleave_backward, setup_context=_save_args(("world", "dim"))
)
torch.library.register_autograd(
    "cpshard::index_gather", _index_gather_backward, setup_context=_save_args(("index", "dim"))
)
torch.library.register_autograd(
    "cpshard::index_scatter_add", _index_scatter_add_backward, setup_context=_save_args(("index", "dim"))
)
