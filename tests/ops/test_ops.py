"""Forward, backward and registration tests of every op in ``cpshard.ops``.

Every expected value comes from an independent plain-PyTorch (or plain-Python) reference written
in this file (torch.split / torch.cat / torch.full / torch.stack / narrow / index_select /
index_add_ / itertools.groupby), never from cpshard itself. The grids are wide on purpose
(flash-attention style): rank 1..4, every token dim (negative ones included), every element size
and the dtypes users meet, ragged counts with empty ranks, empty tensors, non-contiguous inputs,
fill values that are not zero.

Data moves are compared bit for bit (:func:`assert_identical`); sums (scatter-add) with a
tolerance tied to the dtype. The big grids run on CUDA too when the machine has a GPU and the
extension has CUDA kernels; a few targeted tests carry an explicit (skipped here) CUDA variant.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import cpshard
import cpshard.ops as ops

# ---------------------------------------------------------------- grids

HAS_CUDA = torch.cuda.is_available() and bool(getattr(cpshard._C, "cuda_kernels", False))
_CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and cpshard CUDA kernels"),
    ],
)
DEVICES = ["cpu", _CUDA]  # targeted tests: the CUDA variant shows up as skipped without a GPU
GRID_DEVICES = ["cpu", _CUDA] if HAS_CUDA else ["cpu"]  # the big grids: no thousands of skips

# Every element size the byte-moving kernels specialise on (1, 2, 4, 8, 16 bytes), and the
# dtypes a user meets: floats, ints, bool, complex.
DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
NUMERIC_DTYPES = [d for d in DTYPES if d != torch.bool]
# One dtype per element size (plus bool), for grids that only move bytes.
ELEMENT_SIZE_DTYPES = [
    torch.uint8,
    torch.bool,
    torch.float16,
    torch.float32,
    torch.int64,
    torch.complex128,
]

# Non-token sizes per rank; the token dim is inserted at ``dim`` (every dim, negative ones too).
_OTHER_SIZES = {1: (), 2: (3,), 3: (2, 3), 4: (2, 1, 3)}
SHAPE_DIMS = [
    pytest.param(_OTHER_SIZES[rank], dim, id=f"rank{rank}-dim{dim}")
    for rank in (1, 2, 3, 4)
    for dim in range(-rank, rank)
]
SHAPE_DIMS_2PLUS = [p for p in SHAPE_DIMS if len(p.values[0]) >= 1]
# One non-token size 0 (an empty tensor whose token dim is not empty), every dim.
SHAPE_DIMS_EMPTY = [
    pytest.param(other, dim, id=f"{'x'.join(map(str, other))}-dim{dim}")
    for other in ((0,), (2, 0), (0, 1, 3))
    for dim in range(-len(other) - 1, len(other) + 1)
]

# Per-rank counts: an empty rank inside, all empty, W=1, one rank holding everything, many ranks.
COUNTS = [[2, 0, 3], [0, 0, 0], [4], [0, 5, 0], [3, 1, 0, 2, 1]]
# pad_to as a function of the counts: exact offsets, tight padding, padding larger than any count.
PAD_MODES = ["exact", "tight", "loose"]
LAYOUTS = ["transposed", "sliced", "expanded"]


def _pad_to(mode: str, counts: list[int]) -> int | None:
    return {"exact": None, "tight": max(counts), "loose": max(counts) + 3}[mode]


def _fill_for(dtype: torch.dtype):
    """A non-zero fill value that fits dtype (negative where the dtype has negatives)."""
    if dtype == torch.bool:
        return True
    if dtype == torch.uint8:
        return 200
    if dtype.is_complex:
        return complex(-2.5, 1)
    if dtype.is_floating_point:
        return -100.5
    return -100


# ---------------------------------------------------------------- inputs


def _full_shape(other: tuple[int, ...], dim: int, tokens: int) -> tuple[int, ...]:
    shape = list(other)
    shape.insert(dim % (len(other) + 1), tokens)
    return tuple(shape)


def _random(
    shape, dtype: torch.dtype, gen: torch.Generator, *, small: bool = False
) -> torch.Tensor:
    """Random CPU values of dtype; ``small`` keeps integers in [-4, 4] (sums cannot overflow)."""
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = (-4, 4) if small else (-100, 100)
    lo, hi = max(lo, info.min), min(hi, info.max)
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int64).to(dtype)


def make_input(
    shape, dtype, device, *, seed: int = 0, layout: str = "contiguous", small: bool = False
):
    """A tensor of ``shape``: contiguous, or a transposed / sliced / expanded (stride 0) view."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if layout == "contiguous":
        return _random(shape, dtype, gen, small=small).to(device)
    if layout == "transposed" and len(shape) >= 2:
        base = _random(shape[::-1], dtype, gen, small=small).to(device)
        out = base.permute(*reversed(range(len(shape))))
    elif layout in ("sliced", "transposed"):
        base = _random((*shape[:-1], 2 * shape[-1] + 1), dtype, gen, small=small).to(device)
        out = base[..., 1::2]
    elif layout == "expanded":
        base = _random((*shape[:-1], 1), dtype, gen, small=small).to(device)
        out = base.expand(shape)
    else:
        raise AssertionError(layout)
    assert out.shape == shape
    return out


def _fill_tensor(shape, fill, like: torch.Tensor) -> torch.Tensor:
    return torch.full(tuple(shape), fill, dtype=like.dtype, device=like.device)


# ---------------------------------------------------------------- independent references


def ref_pack(x: torch.Tensor, counts, dim: int, pad_to: int | None, fill) -> torch.Tensor:
    """torch.split into per-rank blocks; exact: flatten and concatenate; padded: torch.cat a
    torch.full block of padding rows to each, then torch.stack."""
    dim %= x.dim()
    pieces = torch.split(x, list(counts), dim)
    if pad_to is None:
        return torch.cat([p.reshape(-1) for p in pieces])
    padded = []
    for piece, c in zip(pieces, counts, strict=True):
        shape = list(piece.shape)
        shape[dim] = pad_to - c
        padded.append(torch.cat([piece, _fill_tensor(shape, fill, x)], dim))
    return torch.stack(padded)


def ref_unpack(
    packed: torch.Tensor, counts, out_shape, dim: int, pad_to: int | None
) -> torch.Tensor:
    out_shape = list(out_shape)
    dim %= len(out_shape)
    if pad_to is None:
        per_row = math.prod(s for i, s in enumerate(out_shape) if i != dim)
        pieces = []
        for chunk, c in zip(
            torch.split(packed.reshape(-1), [c * per_row for c in counts]), counts, strict=True
        ):
            shape = list(out_shape)
            shape[dim] = c
            pieces.append(chunk.reshape(shape))
    else:
        shape = list(out_shape)
        shape[dim] = pad_to
        blocks = packed.reshape([len(counts), *shape])
        pieces = [blocks[r].narrow(dim, 0, c) for r, c in enumerate(counts)]
    return torch.cat(pieces, dim)


def ref_interleave(x: torch.Tensor, dim: int) -> torch.Tensor:
    dim %= x.dim() - 1
    if x.shape[0] == 0:
        shape = list(x.shape[1:])
        shape[dim] = 0
        return x.new_empty(shape)
    return torch.cat(list(x.unbind(0)), dim)


def ref_deinterleave(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    dim %= x.dim()
    length = x.shape[dim] // world
    return torch.stack([x.narrow(dim, r * length, length) for r in range(world)])


def ref_gather(src: torch.Tensor, index: torch.Tensor, dim: int, fill) -> torch.Tensor:
    """index_select from src with one torch.full row appended; negative indices pick that row."""
    dim %= src.dim()
    shape = list(src.shape)
    shape[dim] = 1
    extended = torch.cat([src, _fill_tensor(shape, fill, src)], dim)
    safe = torch.where(index < 0, src.shape[dim], index.long())
    return extended.index_select(dim, safe)


def ref_scatter_add(
    grad: torch.Tensor, index: torch.Tensor, dim: int, dim_size: int, acc=None
) -> torch.Tensor:
    """index_add_ of the rows whose index is non-negative, accumulated in ``acc`` (default:
    grad's dtype)."""
    dim %= grad.dim()
    acc = acc or grad.dtype
    shape = list(grad.shape)
    shape[dim] = dim_size
    out = torch.zeros(shape, dtype=acc, device=grad.device)
    keep = (index >= 0).nonzero().squeeze(1)
    out.index_add_(dim, index.long()[keep], grad.index_select(dim, keep).to(acc))
    return out


def ref_segments(ids: torch.Tensor, start: int, end: int):
    """Documents = maximal runs of one non-zero id over the WHOLE row (itertools.groupby);
    each one that overlaps [start, end) contributes its clipped part."""
    rows, begins, lengths, doc_starts = [], [], [], []
    for b, row in enumerate(ids.tolist()):
        pos = 0
        for value, run in itertools.groupby(row):
            doc_begin = pos
            pos += len(list(run))
            if value == 0:
                continue
            lo, hi = max(doc_begin, start), min(pos, end)
            if lo < hi:
                rows.append(b)
                begins.append(lo)
                lengths.append(hi - lo)
                doc_starts.append(doc_begin)
    return tuple(torch.tensor(v, dtype=torch.int64) for v in (rows, begins, lengths, doc_starts))


# ---------------------------------------------------------------- comparisons

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t
    size = t.element_size()
    return t.view(_BITS[min(size, 8)])


def assert_identical(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same shape, dtype and device, and bit-identical values (a data move copies bits)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.device == expected.device, (actual.device, expected.device)
    if not torch.equal(_bits(actual), _bits(expected)):
        raise AssertionError(f"values differ:\n{actual}\n{expected}")


def assert_near(actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float) -> None:
    """|actual - expected| <= atol + rtol * |expected| elementwise (a cheap assert_close)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (actual, expected)
    err = (actual - expected).abs()
    bound = atol + rtol * expected.abs()
    if not bool((err <= bound).all()):
        raise AssertionError(f"max error {err.max()} over the bound:\n{actual}\n{expected}")


# ---------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS)
def test_pack_unpack_ragged(other, dim, dtype, device):
    fill = _fill_for(dtype)
    for counts, mode in itertools.product(COUNTS, PAD_MODES):
        x = make_input(
            _full_shape(other, dim, sum(counts)), dtype, device, seed=sum(counts) + len(other)
        )
        pad_to = _pad_to(mode, counts)
        packed = ops.pack_ragged(x, counts, dim, pad_to=pad_to, fill=fill)
        assert_identical(packed, ref_pack(x, counts, dim, pad_to, fill))
        assert packed.is_contiguous()
        # round trip, and unpack of a buffer that did not come from pack (garbage in the padding)
        assert_identical(ops.unpack_ragged(packed, counts, x.shape, dim, pad_to=pad_to), x)
        other_buffer = make_input(packed.shape, dtype, device, seed=7)
        assert_identical(
            ops.unpack_ragged(other_buffer, counts, x.shape, dim, pad_to=pad_to),
            ref_unpack(other_buffer, counts, x.shape, dim, pad_to),
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_EMPTY)
def test_pack_unpack_ragged_empty(other, dim, device):
    for counts, mode in itertools.product(COUNTS, PAD_MODES):
        x = make_input(_full_shape(other, dim, sum(counts)), torch.float32, device)
        pad_to = _pad_to(mode, counts)
        packed = ops.pack_ragged(x, counts, dim, pad_to=pad_to, fill=3.0)
        assert_identical(packed, ref_pack(x, counts, dim, pad_to, 3.0))
        assert packed.numel() == 0
        assert_identical(ops.unpack_ragged(packed, counts, x.shape, dim, pad_to=pad_to), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.int8, torch.complex128], ids=str
)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_2PLUS)
def test_pack_unpack_ragged_noncontiguous(other, dim, dtype, device):
    counts = [2, 0, 3, 1]
    fill = _fill_for(dtype)
    for layout, mode in itertools.product(LAYOUTS, PAD_MODES):
        x = make_input(_full_shape(other, dim, sum(counts)), dtype, device, layout=layout, seed=3)
        pad_to = _pad_to(mode, counts)
        packed = ops.pack_ragged(x, counts, dim, pad_to=pad_to, fill=fill)
        assert_identical(packed, ref_pack(x, counts, dim, pad_to, fill))
        # unpack reads a non-contiguous packed buffer too
        strided = make_input(packed.shape, dtype, device, layout=layout, seed=4)
        assert_identical(
            ops.unpack_ragged(strided, counts, x.shape, dim, pad_to=pad_to),
            ref_unpack(strided, counts, x.shape, dim, pad_to),
        )


FILLS = {
    torch.float32: [
        0,
        0.0,
        -0.0,
        1.5,
        -100,
        float("-inf"),
        float("inf"),
        float("nan"),
        True,
        3.4e38,
    ],
    torch.float64: [-1e300, 7, float("-inf"), 5e-324],
    torch.bfloat16: [-100, 0.5, float("-inf")],
    torch.float16: [-100, 65504.0, float("nan"), -0.0],
    torch.int64: [-100, 2**63 - 1, -(2**63), 0],
    torch.int32: [-100, 2**31 - 1, -(2**31)],
    torch.int8: [-100, 127, -128],
    torch.uint8: [0, 255, 7],
    torch.bool: [True, False, 1, 0],
    torch.complex64: [-100, 2.5, complex(1, -2), complex(float("inf"), 0)],
    torch.complex128: [complex(-3, 4), 0],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype, fill", [pytest.param(d, f, id=f"{d}-{f}") for d, fs in FILLS.items() for f in fs]
)
def test_fill_values(dtype, fill, device):
    """Padding rows of pack_ragged and rows of index_gather with a negative index hold exactly
    the fill value (extremes, -0.0, NaN, inf included)."""
    counts = [1, 0, 3]
    x = make_input((2, 4, 3), dtype, device, seed=11)
    expected_fill = torch.full((), fill, dtype=dtype, device=device)
    for pad_to in (3, 5):
        packed = ops.pack_ragged(x, counts, 1, pad_to=pad_to, fill=fill)
        assert_identical(packed, ref_pack(x, counts, 1, pad_to, fill))
        pad_region = torch.cat([packed[r, :, c:].reshape(-1) for r, c in enumerate(counts)])
        assert pad_region.numel() == 2 * 3 * sum(pad_to - c for c in counts)
        assert_identical(pad_region, expected_fill.expand(pad_region.shape))
    index = torch.tensor([-1, 2, -5], device=device)
    out = ops.index_gather(x, index, 1, fill=fill)
    assert_identical(out, ref_gather(x, index, 1, fill))
    assert_identical(out[:, 0], expected_fill.expand(2, 3))


@pytest.mark.parametrize("device", DEVICES)
def test_pack_unpack_argument_forms(device):
    """counts as a list, a tuple or a tensor, out_shape as a torch.Size or a list, default
    dim (0) and fill (0), a packed buffer of any shape with the right number of elements."""
    x = make_input((3, 6), torch.float32, device)
    for mode in PAD_MODES:
        pad_to = _pad_to(mode, [1, 5, 0])
        expected = ref_pack(x, [1, 5, 0], 1, pad_to, 0)
        for counts in ([1, 5, 0], (1, 5, 0), torch.tensor([1, 5, 0])):
            assert_identical(ops.pack_ragged(x, counts, 1, pad_to=pad_to), expected)
            for out_shape in (x.shape, [3, 6], (3, 6)):
                assert_identical(
                    ops.unpack_ragged(expected, counts, out_shape, 1, pad_to=pad_to), x
                )
            assert_identical(
                ops.unpack_ragged(expected.reshape(-1), counts, (3, 6), -1, pad_to=pad_to), x
            )
    assert_identical(ops.pack_ragged(x, [2, 1], pad_to=3), ref_pack(x, [2, 1], 0, 3, 0))
    assert_identical(ops.unpack_ragged(ops.pack_ragged(x, [0, 3]), [0, 3], (3, 6)), x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.complex128], ids=str)
def test_pack_unpack_ragged_large(dtype, device):
    """Rows longer than the CPU kernel's 256 KiB chunk (one row split over several tasks, the
    real/padding boundary inside a chunk), over several threads."""
    chunk = (256 * 1024) // torch.empty((), dtype=dtype).element_size()  # elements per CPU task
    counts = [chunk + 1, 0, 2 * chunk + 3, 5]
    x = make_input((2, sum(counts)), dtype, device, seed=5)
    fill = _fill_for(dtype)
    for pad_to in (None, max(counts), 3 * chunk + 7):
        packed = ops.pack_ragged(x, counts, 1, pad_to=pad_to, fill=fill)
        assert_identical(packed, ref_pack(x, counts, 1, pad_to, fill))
        assert_identical(ops.unpack_ragged(packed, counts, x.shape, 1, pad_to=pad_to), x)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_ragged_does_not_alias_or_mutate(device):
    x = make_input((4, 3), torch.float32, device)
    before = x.clone()
    for pad_to in (None, 4):
        packed = ops.pack_ragged(x, [4], 0, pad_to=pad_to)
        packed.zero_()
        assert_identical(x, before)
        out = ops.unpack_ragged(before.clone(), [4], (4, 3), 0, pad_to=pad_to)
        assert out.data_ptr() != x.data_ptr()


# ---------------------------------------------------------------- interleave / deinterleave

WORLD_LENGTHS = [(1, 3), (3, 2), (4, 0), (2, 1)]


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("dtype", ELEMENT_SIZE_DTYPES, ids=str)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS)
def test_interleave_deinterleave(other, dim, dtype, device):
    for world, length in WORLD_LENGTHS:
        x = make_input(
            (world, *_full_shape(other, dim, length)), dtype, device, seed=world + length
        )
        y = ops.interleave_sequence(x, dim)
        assert_identical(y, ref_interleave(x, dim))
        assert_identical(ops.deinterleave_sequence(y, world, dim), x)
        z = make_input(y.shape, dtype, device, seed=9)
        assert_identical(ops.deinterleave_sequence(z, world, dim), ref_deinterleave(z, world, dim))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_2PLUS)
def test_interleave_deinterleave_noncontiguous(other, dim, device):
    for layout in LAYOUTS:
        x = make_input(
            (3, *_full_shape(other, dim, 2)), torch.float64, device, layout=layout, seed=1
        )
        assert_identical(ops.interleave_sequence(x, dim), ref_interleave(x, dim))
        z = make_input(_full_shape(other, dim, 6), torch.float64, device, layout=layout, seed=2)
        assert_identical(ops.deinterleave_sequence(z, 3, dim), ref_deinterleave(z, 3, dim))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_EMPTY)
def test_interleave_deinterleave_empty(other, dim, device):
    x = make_input((2, *_full_shape(other, dim, 3)), torch.float32, device)
    y = ops.interleave_sequence(x, dim)
    assert_identical(y, ref_interleave(x, dim))
    assert_identical(ops.deinterleave_sequence(y, 2, dim), x)


@pytest.mark.parametrize("device", DEVICES)
def test_interleave_empty_world(device):
    """W = 0 slots give an empty sequence."""
    x = torch.zeros(0, 2, 3, device=device)
    assert_identical(ops.interleave_sequence(x, 1), torch.zeros(2, 0, device=device))
    assert_identical(ops.interleave_sequence(x, 0), torch.zeros(0, 3, device=device))


def test_interleave_empty_world_backward():
    x = torch.zeros(0, 2, 3, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(
        ops.interleave_sequence(x, 1), x, torch.zeros(2, 0, dtype=torch.float64)
    )
    assert_identical(grad, torch.zeros_like(x))


def test_interleave_is_unpack_with_equal_counts():
    """The documented identity: (de)interleave == ragged (un)pack with equal counts padded to L."""
    x = make_input((4, 2, 3, 5), torch.float32, "cpu")
    assert_identical(
        ops.interleave_sequence(x, 1), ops.unpack_ragged(x, [3] * 4, (2, 12, 5), 1, pad_to=3)
    )
    y = make_input((2, 12, 5), torch.float32, "cpu")
    assert_identical(ops.deinterleave_sequence(y, 4, 1), ops.pack_ragged(y, [3] * 4, 1, pad_to=3))


# ---------------------------------------------------------------- index gather / scatter-add

INDEX_KINDS = [
    "mixed",
    "mixed-int32",
    "permutation",
    "all-negative",
    "empty",
    "one-target",
    "strided",
]


def _index(kind: str, n_rows: int, device, seed: int = 0) -> torch.Tensor:
    """A 1-D index into n_rows rows: duplicates and negatives (dropped / filled) in "mixed"."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "mixed":
        idx = torch.randint(-2, n_rows, (3 * n_rows + 1,), generator=gen)
    elif kind == "mixed-int32":
        idx = torch.randint(-2, n_rows, (2 * n_rows,), generator=gen).int()
    elif kind == "permutation":
        idx = torch.randperm(n_rows, generator=gen)
    elif kind == "all-negative":
        idx = torch.tensor([-1, -7, -(2**40)])
    elif kind == "empty":
        idx = torch.zeros(0, dtype=torch.int64)
    elif kind == "one-target":
        idx = torch.full((9,), n_rows - 1)
    elif kind == "strided":  # a non-contiguous index view
        return torch.randint(-1, n_rows, (12,), generator=gen).to(device)[::3]
    else:
        raise AssertionError(kind)
    return idx.to(device)


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS)
def test_index_gather(other, dim, dtype, device):
    n_rows = 5
    src = make_input(_full_shape(other, dim, n_rows), dtype, device, seed=len(other))
    fill = _fill_for(dtype)
    for kind in INDEX_KINDS:
        index = _index(kind, n_rows, device, seed=dim + 10)
        out = ops.index_gather(src, index, dim, fill=fill)
        assert_identical(out, ref_gather(src, index, dim, fill))
        assert out.is_contiguous()
    assert_identical(
        ops.index_gather(src, index, dim), ref_gather(src, index, dim, 0)
    )  # default fill


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_2PLUS)
def test_index_gather_noncontiguous(other, dim, device):
    index = torch.tensor([3, -1, 0, 0, 2, -3], device=device)
    for layout in LAYOUTS:
        src = make_input(_full_shape(other, dim, 4), torch.float32, device, layout=layout)
        assert_identical(
            ops.index_gather(src, index, dim, fill=-1), ref_gather(src, index, dim, -1)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_EMPTY + [pytest.param((2, 3), 1, id="2x3-dim1")])
def test_index_gather_empty(other, dim, device):
    src = make_input(_full_shape(other, dim, 3), torch.float32, device)
    index = torch.tensor([2, -1, 0], device=device)
    assert_identical(ops.index_gather(src, index, dim, fill=5), ref_gather(src, index, dim, 5))
    # a source with no rows at all: only negative indices are valid, every row is fill
    empty_src = make_input(_full_shape(other, dim, 0), torch.float32, device)
    negative = torch.tensor([-1, -2], device=device)
    assert_identical(
        ops.index_gather(empty_src, negative, dim, fill=5), ref_gather(empty_src, negative, dim, 5)
    )


def _assert_scatter_matches(
    out: torch.Tensor, grad: torch.Tensor, index: torch.Tensor, dim: int, dim_size: int
):
    dtype = grad.dtype
    assert out.is_contiguous()
    if dtype in (torch.float16, torch.bfloat16):
        # The kernel accumulates in fp32 and rounds once: compare with the fp32 reference rounded
        # to dtype. The two fp32 sums may differ by summation order (<= 2 n eps32 sum|g|), after
        # which rounding to dtype may differ by one ulp (<= eps * |ref|).
        ref = ref_scatter_add(grad, index, dim, dim_size, acc=torch.float32).to(dtype)
        abs32 = ref_scatter_add(grad.abs(), index, dim, dim_size, acc=torch.float32)
        n = max(int((index >= 0).sum()), 1)
        bound = (
            torch.finfo(dtype).eps * ref.float().abs()
            + 2 * n * torch.finfo(torch.float32).eps * abs32
        )
        assert out.dtype == dtype and out.shape == ref.shape
        err = (out.float() - ref.float()).abs()
        assert bool((err <= bound).all()), (
            f"max error {err.max()} exceeds the {dtype} rounding bound"
        )
    elif dtype.is_floating_point or dtype.is_complex:
        eps = torch.finfo(dtype).eps
        assert_near(out, ref_scatter_add(grad, index, dim, dim_size), rtol=16 * eps, atol=16 * eps)
    else:  # integers (small values, no overflow): exact
        assert_identical(out, ref_scatter_add(grad, index, dim, dim_size))


@pytest.mark.parametrize("device", GRID_DEVICES)
@pytest.mark.parametrize("dtype", NUMERIC_DTYPES, ids=str)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS)
def test_index_scatter_add(other, dim, dtype, device):
    for kind, dim_size in itertools.product(INDEX_KINDS, (5, 7)):
        index = _index(kind, 5, device, seed=dim + 20)
        grad = make_input(
            _full_shape(other, dim, index.numel()), dtype, device, seed=len(other), small=True
        )
        out = ops.index_scatter_add(grad, index, dim, dim_size)
        _assert_scatter_matches(out, grad, index, dim, dim_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=str)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_2PLUS)
def test_index_scatter_add_noncontiguous(other, dim, dtype, device):
    index = torch.tensor([3, -1, 0, 0, 2, 3, 3], device=device)
    for layout in LAYOUTS:
        grad = make_input(_full_shape(other, dim, 7), dtype, device, layout=layout, small=True)
        _assert_scatter_matches(ops.index_scatter_add(grad, index, dim, 6), grad, index, dim, 6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("other, dim", SHAPE_DIMS_EMPTY)
def test_index_scatter_add_empty(other, dim, device):
    index = torch.tensor([2, -1, 0, 2], device=device)
    grad = make_input(_full_shape(other, dim, 4), torch.float32, device)
    _assert_scatter_matches(ops.index_scatter_add(grad, index, dim, 3), grad, index, dim, 3)
    negative = torch.tensor([-1, -1, -5, -2], device=device)  # dim_size 0: every row dropped
    assert_identical(
        ops.index_scatter_add(grad, negative, dim, 0), ref_scatter_add(grad, negative, dim, 0)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_index_scatter_add_dropped_rows_never_reach_the_output(device):
    grad = torch.full((4, 3), float("nan"), device=device)
    grad[1] = 1.0
    grad[3] = 2.0
    out = ops.index_scatter_add(grad, torch.tensor([-1, 1, -1, 1], device=device), 0, 4)
    expected = torch.zeros(4, 3, device=device)
    expected[1] = 3.0
    assert_identical(out, expected)  # untouched rows are exactly 0, the NaN rows are dropped


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_index_scatter_add_accumulates_in_fp32(dtype, device):
    """4096 ones onto one row: an fp16 / bf16 accumulator would stall at 2048 / 256."""
    grad = torch.ones(4096, 3, dtype=dtype, device=device)
    out = ops.index_scatter_add(grad, torch.zeros(4096, dtype=torch.int64, device=device), 0, 2)
    assert_identical(out, torch.tensor([[4096.0] * 3, [0.0] * 3], dtype=dtype, device=device))
    # exactly representable addends: the result is the exact sum rounded once
    gen = torch.Generator().manual_seed(0)
    grad = (torch.randint(-64, 64, (3000, 5), generator=gen).float() / 64).to(dtype).to(device)
    index = torch.randint(-1, 4, (3000,), generator=gen).to(device)
    expected = ref_scatter_add(grad.double(), index, 0, 4).to(dtype)
    assert_identical(ops.index_scatter_add(grad, index, 0, 4), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_index_scatter_add_deterministic(device):
    """Many duplicates in fp32: bit-identical on repeat and across thread counts, and equal to
    the documented order (ascending source row, left-to-right fp32 additions)."""
    gen = torch.Generator().manual_seed(1)
    n, dim_size, post = 3000, 5, 64
    grad = (torch.randn(n, post, generator=gen) * torch.logspace(-6, 6, post)).to(device)
    index = torch.randint(-1, dim_size, (n,), generator=gen).to(device)
    first = ops.index_scatter_add(grad, index, 0, dim_size)
    for _ in range(3):
        assert_identical(ops.index_scatter_add(grad, index, 0, dim_size), first)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert_identical(ops.index_scatter_add(grad, index, 0, dim_size), first)
    finally:
        torch.set_num_threads(threads)
    expected = torch.zeros(dim_size, post, device=device)
    for j in range(dim_size):
        acc = torch.zeros(post, device=device)
        for row in grad[index == j]:  # ascending source order, fp32 all the way
            acc = acc + row
        expected[j] = acc
    assert_identical(first, expected)
    # the same along an inner dim
    assert_identical(ops.index_scatter_add(grad.t(), index, 1, dim_size), expected.t().contiguous())


@pytest.mark.parametrize("device", DEVICES)
def test_index_ops_large(device):
    """Enough rows for several parallel tasks."""
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(50_000, 8, generator=gen).to(device)
    index = torch.randint(-1, 50_000, (120_000,), generator=gen).to(device)
    assert_identical(ops.index_gather(src, index, 0, fill=-1), ref_gather(src, index, 0, -1))
    # small integers in fp32: every summation order is exact
    grad = torch.randint(-4, 5, (120_000, 8), generator=gen).float().to(device)
    assert_identical(
        ops.index_scatter_add(grad, index, 0, 50_000), ref_scatter_add(grad, index, 0, 50_000)
    )


# ---------------------------------------------------------------- document segments


def _rows(*rows):
    return torch.tensor(rows, dtype=torch.int64)


SEGMENT_CASES = {
    "pads-inside": _rows([1, 1, 0, 0, 2, 2, 2, 0, 3, 3]),
    "leading-trailing-pads": _rows([0, 0, 4, 4, 4, 5, 5, 0, 0, 0]),
    "reused-ids": _rows([7, 7, 8, 8, 7, 7, 0, 7, 7, 7]),
    "whole-row": _rows([9] * 10),
    "all-pads": _rows([0] * 10),
    "singletons": _rows([1, 2, 3, 1, 2, 3, 1, 2, 3, 1]),
    "alternating-pads": _rows([1, 0, 1, 0, 1, 0, 1, 0, 1, 0]),
    "batch": _rows(
        [1, 1, 1, 2, 2, 0, 3, 3, 3],
        [0, 0, 0, 0, 0, 0, 0, 0, 0],
        [5, 5, 5, 5, 5, 5, 5, 5, 5],
        [0, 6, 6, 0, 6, 6, 0, 6, 6],
        [2, 1, 2, 1, 2, 1, 2, 1, 2],
    ),
    "random": torch.randint(0, 4, (6, 11), generator=torch.Generator().manual_seed(3)),
    "random-long-docs": torch.randint(
        0, 3, (3, 14), generator=torch.Generator().manual_seed(4)
    ).repeat_interleave(3, dim=1)[:, :40],
    "one-token": _rows([4]),
    "one-pad": _rows([0]),
}
SEGMENT_DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool]


def _ranges(seq: int):
    """Every [start, end) for short rows (start == end, start == 0, end == S included); a
    stride-3 subset plus the edges for long ones."""
    points = range(seq + 1) if seq <= 12 else sorted({*range(0, seq + 1, 3), 1, seq - 1, seq})
    return [(s, e) for s in points for e in points if s <= e]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", SEGMENT_DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SEGMENT_CASES))
def test_document_segments(case, dtype, device):
    ids = SEGMENT_CASES[case]
    if dtype == torch.bool:
        ids = ids % 2  # documents survive as alternating runs of True
    ids = ids.to(dtype).to(device)
    for start, end in _ranges(ids.shape[1]):
        out = ops.document_segments(ids, start, end)
        assert isinstance(out, ops.DocumentSegments)
        for name, got, want in zip(
            out._fields, out, ref_segments(ids.cpu(), start, end), strict=True
        ):
            assert got.dtype == torch.int64 and got.device == ids.device, name
            assert torch.equal(got.cpu(), want), (case, start, end, name, got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_document_segments_other_dtypes_and_layouts(device):
    """Signed ids (negative ids are documents), int8 / int16, a transposed (non-contiguous) view,
    and empty batches / sequences."""
    signed = torch.tensor([[-1, -1, 0, 3, -3, -3, 0, 0, -1]], device=device)
    base = torch.tensor([[1, 0, 2, 2], [1, 3, 2, 0], [1, 3, 0, 0]], device=device)
    for ids in (signed.to(torch.int8), signed.to(torch.int16), base.t()):
        for start, end in _ranges(ids.shape[1]):
            out = ops.document_segments(ids, start, end)
            for got, want in zip(out, ref_segments(ids.cpu(), start, end), strict=True):
                assert torch.equal(got.cpu(), want), (ids, start, end)
    for shape in [(0, 5), (3, 0), (0, 0)]:
        out = ops.document_segments(
            torch.zeros(shape, dtype=torch.int64, device=device), 0, shape[1]
        )
        assert all(t.shape == (0,) and t.dtype == torch.int64 for t in out)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_document_segments_partition(world):
    """Over the ranks of a partition of [0, S), the segments tile every non-pad token exactly
    once and agree on each document's start."""
    ids = SEGMENT_CASES["random-long-docs"]
    seq = ids.shape[1]
    bounds = [seq * r // world for r in range(world + 1)]
    covered = torch.zeros_like(ids)
    for r in range(world):
        seg = ops.document_segments(ids, bounds[r], bounds[r + 1])
        for b, begin, length, doc in zip(*(t.tolist() for t in seg), strict=True):
            assert bounds[r] <= begin and begin + length <= bounds[r + 1]
            covered[b, begin : begin + length] += 1
            assert doc <= begin
            assert (ids[b, doc : begin + length] == ids[b, begin]).all()
            assert doc == 0 or ids[b, doc - 1] != ids[b, begin]
    assert torch.equal(covered, (ids != 0).long())


# ---------------------------------------------------------------- gradients


def _grad_cases():
    """(id, op as a function of one float64 tensor, input shape, the plain-PyTorch reference)."""
    cases = []
    shape_dims = [
        (p.values[0], p.values[1]) for p in SHAPE_DIMS if len(p.values[0]) <= 2
    ]  # rank 1..3
    for other, dim in shape_dims:
        tag = f"rank{len(other) + 1}-dim{dim}"
        for counts, mode in [([2, 0, 3], m) for m in PAD_MODES] + [
            ([0, 0, 0], "loose"),
            ([3], "exact"),
        ]:
            pad_to = _pad_to(mode, counts)
            shape = _full_shape(other, dim, sum(counts))
            packed_shape = tuple(ref_pack(torch.zeros(shape), counts, dim, pad_to, 0).shape)
            cases.append(
                (
                    f"pack-{mode}-{counts}-{tag}",
                    lambda x, c=counts, d=dim, p=pad_to: ops.pack_ragged(
                        x, c, d, pad_to=p, fill=-3.0
                    ),
                    shape,
                    lambda x, c=counts, d=dim, p=pad_to: ref_pack(x, c, d, p, -3.0),
                )
            )
            cases.append(
                (
                    f"unpack-{mode}-{counts}-{tag}",
                    lambda p, c=counts, s=shape, d=dim, pt=pad_to: ops.unpack_ragged(
                        p, c, s, d, pad_to=pt
                    ),
                    packed_shape,
                    lambda p, c=counts, s=shape, d=dim, pt=pad_to: ref_unpack(p, c, s, d, pt),
                )
            )
        for world in (1, 3):
            cases.append(
                (
                    f"interleave-W{world}-{tag}",
                    lambda x, d=dim: ops.interleave_sequence(x, d),
                    (world, *_full_shape(other, dim, 2)),
                    lambda x, d=dim: ref_interleave(x, d),
                )
            )
            cases.append(
                (
                    f"deinterleave-W{world}-{tag}",
                    lambda x, w=world, d=dim: ops.deinterleave_sequence(x, w, d),
                    _full_shape(other, dim, 2 * world),
                    lambda x, w=world, d=dim: ref_deinterleave(x, w, d),
                )
            )
        for kind in ("mixed", "all-negative", "empty", "permutation"):
            index = _index(kind, 4, "cpu", seed=dim)
            cases.append(
                (
                    f"gather-{kind}-{tag}",
                    lambda x, i=index, d=dim: ops.index_gather(x, i, d, fill=2.5),
                    _full_shape(other, dim, 4),
                    lambda x, i=index, d=dim: ref_gather(x, i, d, 2.5),
                )
            )
            cases.append(
                (
                    f"scatter-{kind}-{tag}",
                    lambda g, i=index, d=dim: ops.index_scatter_add(g, i, d, 4),
                    _full_shape(other, dim, index.numel()),
                    lambda g, i=index, d=dim: ref_scatter_add(g, i, d, 4),
                )
            )
    return [pytest.param(fn, shape, ref, id=name) for name, fn, shape, ref in cases]


GRAD_CASES = _grad_cases()


@pytest.mark.parametrize("fn, shape, ref", GRAD_CASES)
def test_gradcheck(fn, shape, ref):
    """float64 gradcheck, and the backward equals the reference's backward for a random
    cotangent."""
    x = make_input(shape, torch.float64, "cpu", seed=13).requires_grad_()
    assert torch.autograd.gradcheck(fn, (x,), fast_mode=True)
    out = fn(x)
    x_ref = x.detach().clone().requires_grad_()
    out_ref = ref(x_ref)
    assert_near(out.detach(), out_ref.detach(), rtol=1e-12, atol=1e-12)
    cotangent = make_input(out.shape, torch.float64, "cpu", seed=14)
    (grad,) = torch.autograd.grad(out, x, cotangent, allow_unused=True)
    (grad_ref,) = torch.autograd.grad(out_ref, x_ref, cotangent, allow_unused=True)
    grad = torch.zeros_like(x) if grad is None else grad
    grad_ref = torch.zeros_like(x) if grad_ref is None else grad_ref
    assert_near(grad, grad_ref, rtol=1e-12, atol=1e-12)


# one full-mode gradcheck + gradgradcheck per op kind (the backward of the backward is again a
# cpshard op, so this checks the registered formulas are differentiable themselves)
_GRADGRAD = [
    p
    for p in GRAD_CASES
    if p.id
    in {
        "pack-exact-[2, 0, 3]-rank3-dim-2",
        "pack-loose-[2, 0, 3]-rank2-dim1",
        "unpack-tight-[2, 0, 3]-rank3-dim1",
        "unpack-exact-[2, 0, 3]-rank2-dim-1",
        "interleave-W3-rank3-dim-1",
        "deinterleave-W3-rank2-dim0",
        "gather-mixed-rank3-dim1",
        "scatter-mixed-rank2-dim-2",
    }
]


@pytest.mark.parametrize("fn, shape, ref", _GRADGRAD)
def test_gradgradcheck(fn, shape, ref):
    x = make_input(shape, torch.float64, "cpu", seed=15).requires_grad_()
    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,), fast_mode=True)


def test_gradgradcheck_covers_every_op():
    assert len(_GRADGRAD) == 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64], ids=str)
def test_backward_other_dtypes(dtype, device):
    """The backward of every op in a non-float64 dtype equals the reference's backward."""
    counts, index = [2, 0, 3], torch.tensor([4, -1, 0, 4, 2], device=device)
    cases = [
        (
            lambda x: ops.pack_ragged(x, counts, 1, pad_to=4, fill=1),
            lambda x: ref_pack(x, counts, 1, 4, 1),
            (3, 5, 2),
        ),
        (
            lambda x: ops.pack_ragged(x, counts, -1),
            lambda x: ref_pack(x, counts, -1, None, 0),
            (3, 5),
        ),
        (
            lambda p: ops.unpack_ragged(p, counts, (3, 5, 2), 1, pad_to=4),
            lambda p: ref_unpack(p, counts, (3, 5, 2), 1, 4),
            (3, 3, 4, 2),
        ),
        (lambda x: ops.interleave_sequence(x, 1), lambda x: ref_interleave(x, 1), (3, 2, 4, 2)),
        (lambda x: ops.deinterleave_sequence(x, 2, 0), lambda x: ref_deinterleave(x, 2, 0), (6, 2)),
        (
            lambda x: ops.index_gather(x, index, 1, fill=7),
            lambda x: ref_gather(x, index, 1, 7),
            (2, 5, 3),
        ),
        (
            lambda g: ops.index_scatter_add(g, index, 0, 6),
            lambda g: ref_scatter_add(g, index, 0, 6),
            (5, 3),
        ),
    ]
    for fn, ref, shape in cases:
        x = make_input(shape, dtype, device, seed=21).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        out, out_ref = fn(x), ref(x_ref)
        cotangent = make_input(out.shape, dtype, device, seed=22)
        (grad,) = torch.autograd.grad(out, x, cotangent)
        (grad_ref,) = torch.autograd.grad(out_ref, x_ref, cotangent)
        assert grad.dtype == dtype and grad.shape == x.shape
        torch.testing.assert_close(grad, grad_ref)


def test_gradcheck_complex():
    x = make_input((3, 5, 2), torch.complex128, "cpu").requires_grad_()
    index = torch.tensor([4, -1, 0, 4])
    assert torch.autograd.gradcheck(
        lambda t: ops.pack_ragged(t, [2, 0, 3], 1, pad_to=4, fill=1j), (x,), fast_mode=True
    )
    assert torch.autograd.gradcheck(
        lambda t: ops.index_gather(t, index, 1, fill=1), (x,), fast_mode=True
    )
    g = make_input((3, 4, 2), torch.complex128, "cpu").requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: ops.index_scatter_add(t, index, 1, 5), (g,), fast_mode=True
    )


def test_no_grad_for_integer_inputs_and_under_no_grad():
    assert not ops.pack_ragged(torch.arange(6), [2, 4], pad_to=4).requires_grad
    src = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        assert not ops.index_gather(src, torch.tensor([0, -1]), 0).requires_grad
    assert ops.index_gather(src, torch.tensor([0, -1]), 0).requires_grad


def test_chain_of_ops_backward():
    """gather -> deinterleave -> pack -> unpack -> interleave -> scatter against the same chain
    of references, forward, backward and gradcheck."""
    x = make_input((2, 6, 3), torch.float64, "cpu", seed=30).requires_grad_()
    index = torch.tensor([5, 0, -1, 5, 2, 3, 3, 1])

    def chain(t, gather, deinterleave, pack, unpack, interleave, scatter):
        g = gather(t, index, 1, 0.5)  # [2, 8, 3]
        d = deinterleave(g, 2, 1)  # [2, 2, 4, 3]
        p = pack(d.reshape(4, 4, 3), [1, 3, 0, 0], 1, 5, 1.0)
        u = unpack(p * 2, [1, 3, 0, 0], (4, 4, 3), 1, 5)
        i = interleave(u.reshape(2, 2, 4, 3), 1)  # [2, 8, 3]
        return scatter(i, index, 1, 6)

    mine = (
        lambda t, i, d, f: ops.index_gather(t, i, d, fill=f),
        ops.deinterleave_sequence,
        lambda t, c, d, p, f: ops.pack_ragged(t, c, d, pad_to=p, fill=f),
        lambda t, c, s, d, p: ops.unpack_ragged(t, c, s, d, pad_to=p),
        ops.interleave_sequence,
        ops.index_scatter_add,
    )
    refs = (ref_gather, ref_deinterleave, ref_pack, ref_unpack, ref_interleave, ref_scatter_add)
    out = chain(x, *mine)
    x_ref = x.detach().clone().requires_grad_()
    out_ref = chain(x_ref, *refs)
    torch.testing.assert_close(out, out_ref)
    cot = make_input(out.shape, torch.float64, "cpu", seed=31)
    torch.testing.assert_close(
        torch.autograd.grad(out, x, cot)[0], torch.autograd.grad(out_ref, x_ref, cot)[0]
    )
    assert torch.autograd.gradcheck(lambda t: chain(t, *mine), (x,))


# ---------------------------------------------------------------- opcheck


def _opcheck_cases():
    """Representative argument sets per op (dims as the wrappers pass them, wrapped to >= 0),
    with requires_grad float64 inputs for the differentiable ops."""

    def t(*shape, grad=False, dtype=torch.float64):
        return make_input(shape, dtype, "cpu", seed=len(shape)).requires_grad_(grad)

    idx = torch.tensor([3, -1, 0, 3, 1])
    return {
        "pack_ragged": [
            (t(3, 5, 2, grad=True), [2, 0, 3], 1, -1, 0),
            (t(3, 2, 5, grad=True), [2, 0, 3], 2, 4, -1.5),
            (t(6, 2, dtype=torch.bool), [0, 6, 0], 0, 7, True),
        ],
        "unpack_ragged": [
            (t(30, grad=True), [2, 0, 3], 1, -1, [3, 5, 2]),
            (t(3, 3, 4, 2, grad=True), [2, 0, 3], 1, 4, [3, 5, 2]),
            (t(2, 4, dtype=torch.uint8), [1, 3], 0, 4, [4]),
        ],
        "interleave_sequence": [
            (t(3, 2, 4, grad=True), 1),
            (t(4, 2, 3, dtype=torch.bfloat16), 0),
        ],
        "deinterleave_sequence": [
            (t(2, 6, 3, grad=True), 3, 1),
            (t(4, 2, dtype=torch.int8), 4, 0),
        ],
        "index_gather": [
            (t(4, 3, grad=True), idx, 0, 2.0),
            (t(2, 4, dtype=torch.int64), idx.int(), 1, -100),
        ],
        "index_scatter_add": [
            (t(5, 3, grad=True), idx, 0, 4),
            (t(2, 5, dtype=torch.float16), idx.int(), 1, 6),
        ],
        "document_segments": [
            (torch.tensor([[1, 1, 0, 2, 2, 3], [0, 0, 4, 4, 4, 4]]), 1, 5),
            (torch.tensor([[True, False, True]]), 2, 2),
        ],
    }


_OPCHECK = [
    pytest.param(name, i, id=f"{name}-{i}")
    for name, arg_sets in _opcheck_cases().items()
    for i in range(len(arg_sets))
]


@pytest.mark.parametrize("name, case", _OPCHECK)
def test_opcheck(name, case):
    """Every opcheck utility on the first argument set of each op; the further sets skip the
    (slow, ~0.3 s) test_aot_dispatch_dynamic, which the first set and the compile tests cover."""
    args = _opcheck_cases()[name][case]
    utils = None if case == 0 else ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(
        getattr(torch.ops.cpshard, name).default, args, test_utils=utils or _ALL_OPCHECK_UTILS
    )


_ALL_OPCHECK_UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


# Native ops take any dim in [-ndim, ndim) (they wrap it), so the fake kernels used by
# torch.compile must agree on negative dims too.
_OPCHECK_NEGATIVE_DIM = {
    "pack_ragged-padded": (
        "pack_ragged",
        lambda: (torch.randn(2, 5, requires_grad=True), [2, 3], -1, 4, 0.0),
    ),
    "pack_ragged-exact": (
        "pack_ragged",
        lambda: (torch.randn(2, 5, requires_grad=True), [2, 3], -1, -1, 0.0),
    ),
    "unpack_ragged": (
        "unpack_ragged",
        lambda: (torch.randn(2, 2, 4, requires_grad=True), [2, 3], -1, 4, [2, 5]),
    ),
    "interleave_sequence": (
        "interleave_sequence",
        lambda: (torch.randn(5, 2, 1, requires_grad=True), -1),
    ),
    "deinterleave_sequence": (
        "deinterleave_sequence",
        lambda: (torch.randn(2, 5, requires_grad=True), 5, -1),
    ),
    "index_gather": (
        "index_gather",
        lambda: (torch.randn(2, 5, requires_grad=True), torch.tensor([0, -1]), -1, 0),
    ),
    "index_scatter_add": (
        "index_scatter_add",
        lambda: (torch.randn(2, 5, requires_grad=True), torch.tensor([0, 1, 0, -1, 1]), -1, 3),
    ),
}


@pytest.mark.filterwarnings("ignore:Error detected in")
@pytest.mark.parametrize(
    "case",
    [
        k
        for k in _OPCHECK_NEGATIVE_DIM
    ],
)
def test_opcheck_negative_dim(case):
    name, args = _OPCHECK_NEGATIVE_DIM[case]
    torch.library.opcheck(getattr(torch.ops.cpshard, name).default, args())


def test_every_op_has_an_opcheck():
    wrapped = {
        "pack_ragged",
        "unpack_ragged",
        "interleave_sequence",
        "deinterleave_sequence",
        "index_gather",
        "index_scatter_add",
        "document_segments",
    }
    for name in wrapped:
        assert isinstance(getattr(torch.ops.cpshard, name), torch._ops.OpOverloadPacket)
    assert set(_opcheck_cases()) == wrapped
