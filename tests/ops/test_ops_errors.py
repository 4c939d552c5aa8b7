"""Bad arguments raise a clear error naming the argument; they never crash or return garbage.

Twice over: through the Python wrappers (``TypeError`` / ``ValueError`` before the native op
runs) and through the raw ``torch.ops.cpshard`` ops, which bypass the Python checks and must
stop bad metadata with ``TORCH_CHECK`` (``RuntimeError``; ``IndexError`` for an out-of-range dim,
from ATen's dim wrapping). Calls that could corrupt memory (sizes near the int64 limit) run in a
forked child, so a crash fails one test instead of killing the session.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time

import pytest
import torch

import cpshard.ops as ops

raw = torch.ops.cpshard


def _x(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype)


IDX = torch.tensor([0, 2, -1])
BIG = 2**62

# ---------------------------------------------------------------- through the wrappers

# id -> (call, exception types, regex the message must match: it names the bad argument)
WRAPPER_CASES = {
    # pack_ragged
    "pack-x-not-tensor": (lambda: ops.pack_ragged([1.0, 2.0], [1, 1]), TypeError, r"\bx\b"),
    "pack-x-0d": (lambda: ops.pack_ragged(torch.tensor(1.0), [1]), ValueError, r"\bx\b"),
    "pack-negative-count": (lambda: ops.pack_ragged(_x(5), [2, -1, 4]), ValueError, r"counts\[1\]"),
    "pack-counts-sum": (lambda: ops.pack_ragged(_x(5), [2, 2]), ValueError, r"counts sum"),
    "pack-counts-sum-dim": (
        lambda: ops.pack_ragged(_x(5, 3), [1, 1], 1),
        ValueError,
        r"counts sum.*shape\[1\]",
    ),
    "pack-counts-empty": (lambda: ops.pack_ragged(_x(0), []), ValueError, r"counts"),
    "pack-counts-float": (lambda: ops.pack_ragged(_x(5), [2.0, 3]), TypeError, r"counts\[0\]"),
    "pack-counts-bool": (lambda: ops.pack_ragged(_x(2), [True, True]), TypeError, r"counts\[0\]"),
    "pack-counts-str": (lambda: ops.pack_ragged(_x(2), "11"), TypeError, r"counts"),
    "pack-counts-int": (lambda: ops.pack_ragged(_x(2), 2), TypeError, r"counts"),
    "pack-counts-overflow": (lambda: ops.pack_ragged(_x(4), [BIG, BIG]), ValueError, r"counts"),
    "pack-pad-small": (lambda: ops.pack_ragged(_x(5), [2, 3], pad_to=2), ValueError, r"pad_to"),
    "pack-pad-negative": (lambda: ops.pack_ragged(_x(5), [2, 3], pad_to=-1), ValueError, r"pad_to"),
    "pack-pad-float": (lambda: ops.pack_ragged(_x(5), [2, 3], pad_to=3.0), TypeError, r"pad_to"),
    "pack-pad-bool": (lambda: ops.pack_ragged(_x(2), [1, 1], pad_to=True), TypeError, r"pad_to"),
    "pack-dim-high": (lambda: ops.pack_ragged(_x(5, 3), [2, 3], 2), ValueError, r"\bdim\b"),
    "pack-dim-low": (lambda: ops.pack_ragged(_x(5, 3), [2, 3], -3), ValueError, r"\bdim\b"),
    "pack-dim-float": (lambda: ops.pack_ragged(_x(5, 3), [2, 3], 0.0), TypeError, r"\bdim\b"),
    # unpack_ragged
    "unpack-packed-not-tensor": (lambda: ops.unpack_ragged(None, [1], [1]), TypeError, r"packed"),
    "unpack-numel-exact": (
        lambda: ops.unpack_ragged(_x(14), [2, 3], [5, 3]),
        ValueError,
        r"packed has 14",
    ),
    "unpack-numel-padded": (
        lambda: ops.unpack_ragged(_x(15), [2, 3], [5, 3], pad_to=3),
        ValueError,
        r"packed has 15",
    ),
    "unpack-negative-count": (
        lambda: ops.unpack_ragged(_x(5), [6, -1], [5]),
        ValueError,
        r"counts\[1\]",
    ),
    "unpack-counts-sum": (
        lambda: ops.unpack_ragged(_x(5), [2, 2], [5]),
        ValueError,
        r"counts sum.*out_shape",
    ),
    "unpack-counts-overflow": (
        lambda: ops.unpack_ragged(_x(4), [BIG, BIG], [4]),
        ValueError,
        r"counts",
    ),
    "unpack-pad-small": (
        lambda: ops.unpack_ragged(_x(4), [2, 3], [5], pad_to=2),
        ValueError,
        r"pad_to",
    ),
    "unpack-out-shape-empty": (lambda: ops.unpack_ragged(_x(1), [1], []), ValueError, r"out_shape"),
    "unpack-out-shape-str": (lambda: ops.unpack_ragged(_x(2), [2], ["2"]), TypeError, r"out_shape\[0\]"),
    "unpack-out-shape-float": (lambda: ops.unpack_ragged(_x(2), [2], [2.7]), TypeError, r"out_shape\[0\]"),
    "unpack-out-shape-negative": (
        lambda: ops.unpack_ragged(_x(0), [0], [0, -2]),
        ValueError,
        r"out_shape\[1\] = -2 is negative",
    ),
    "unpack-dim-high": (
        lambda: ops.unpack_ragged(_x(15), [2, 3], [5, 3], 2),
        ValueError,
        r"\bdim\b",
    ),
    "unpack-dim-low": (
        lambda: ops.unpack_ragged(_x(15), [2, 3], [5, 3], -3),
        ValueError,
        r"\bdim\b",
    ),
    "unpack-huge-pad": (
        lambda: ops.unpack_ragged(_x(0), [1] * 4, [4], pad_to=BIG),
        ValueError,
        r"packed",
    ),
    # interleave_sequence / deinterleave_sequence
    "interleave-x-not-tensor": (lambda: ops.interleave_sequence(3), TypeError, r"\bx\b"),
    "interleave-1d": (lambda: ops.interleave_sequence(_x(4)), ValueError, r"\bx\b"),
    "interleave-dim-high": (
        lambda: ops.interleave_sequence(_x(2, 3, 4), 2),
        ValueError,
        r"\bdim\b",
    ),
    "interleave-dim-low": (
        lambda: ops.interleave_sequence(_x(2, 3, 4), -3),
        ValueError,
        r"\bdim\b",
    ),
    "deinterleave-not-divisible": (
        lambda: ops.deinterleave_sequence(_x(2, 5), 2, 1),
        ValueError,
        r"world",
    ),
    "deinterleave-world-zero": (
        lambda: ops.deinterleave_sequence(_x(2, 4), 0, 1),
        ValueError,
        r"world",
    ),
    "deinterleave-world-negative": (
        lambda: ops.deinterleave_sequence(_x(2, 4), -2, 1),
        ValueError,
        r"world",
    ),
    "deinterleave-world-float": (
        lambda: ops.deinterleave_sequence(_x(2, 4), 2.0, 1),
        (TypeError, ValueError),
        r"world",
    ),
    # found by the fuzzing: an empty grad with a dim_size that makes [2, 2**62, 0] overflow
    "scatter-add-empty-huge-dim-size": (
        lambda: ops.index_scatter_add(
            torch.empty(2, 0, 0, dtype=torch.uint8), torch.empty(0, dtype=torch.int64), 1, 2**62
        ),
        ValueError,
        r"dim_size makes a buffer",
    ),
    # found by the fuzzing: an empty x divides by any world, but [W, 2, 0] overflows int64
    "deinterleave-empty-huge-world": (
        lambda: ops.deinterleave_sequence(torch.empty(2, 0, dtype=torch.uint8), 2**62, 1),
        ValueError,
        r"world makes a buffer",
    ),
    "deinterleave-world-bool": (
        lambda: ops.deinterleave_sequence(_x(2, 4), True, 1),
        (TypeError, ValueError),
        r"world",
    ),
    "deinterleave-0d": (
        lambda: ops.deinterleave_sequence(torch.tensor(1.0), 1, 0),
        ValueError,
        r"\bx\b",
    ),
    "deinterleave-dim-high": (
        lambda: ops.deinterleave_sequence(_x(2, 4), 2, 2),
        ValueError,
        r"\bdim\b",
    ),
    # index_gather
    "gather-src-not-tensor": (lambda: ops.index_gather([1.0], IDX), TypeError, r"\bsrc\b"),
    "gather-src-0d": (lambda: ops.index_gather(torch.tensor(1.0), IDX), ValueError, r"\bsrc\b"),
    "gather-index-not-tensor": (lambda: ops.index_gather(_x(3), [0, 1]), TypeError, r"\bindex\b"),
    "gather-index-float": (
        lambda: ops.index_gather(_x(3), torch.tensor([0.0, 1.0])),
        TypeError,
        r"\bindex\b",
    ),
    "gather-index-bool": (
        lambda: ops.index_gather(_x(3), torch.tensor([True])),
        TypeError,
        r"\bindex\b",
    ),
    "gather-index-int16": (lambda: ops.index_gather(_x(3), IDX.short()), TypeError, r"\bindex\b"),
    "gather-index-2d": (
        lambda: ops.index_gather(_x(3), IDX.reshape(3, 1)),
        ValueError,
        r"\bindex\b",
    ),
    "gather-index-0d": (lambda: ops.index_gather(_x(3), torch.tensor(0)), ValueError, r"\bindex\b"),
    "gather-index-meta": (
        lambda: ops.index_gather(_x(3), IDX.to("meta")),
        ValueError,
        r"\bindex\b",
    ),
    "gather-dim-high": (lambda: ops.index_gather(_x(3, 2), IDX, 2), ValueError, r"\bdim\b"),
    "gather-dim-low": (lambda: ops.index_gather(_x(3, 2), IDX, -3), ValueError, r"\bdim\b"),
    # The wrappers leave the index upper bound to the native op (it costs a device sync on
    # CUDA), so this one is a RuntimeError naming the index.
    "gather-index-too-big": (
        lambda: ops.index_gather(_x(3), torch.tensor([0, 3])),
        (ValueError, RuntimeError),
        r"\bindex\b",
    ),
    "gather-index-too-big-dim": (
        lambda: ops.index_gather(_x(4, 2), torch.tensor([2]), 1),
        (ValueError, RuntimeError),
        r"\bindex\b",
    ),
    "gather-index-too-big-empty-src": (
        lambda: ops.index_gather(_x(0, 2), torch.tensor([-1, 0])),
        (ValueError, RuntimeError),
        r"\bindex\b",
    ),
    # index_scatter_add
    "scatter-grad-not-tensor": (
        lambda: ops.index_scatter_add(1.0, IDX, 0, 3),
        TypeError,
        r"\bgrad\b",
    ),
    "scatter-grad-bool": (
        lambda: ops.index_scatter_add(_x(3, dtype=torch.bool), IDX, 0, 3),
        TypeError,
        r"\bgrad\b",
    ),
    "scatter-grad-0d": (
        lambda: ops.index_scatter_add(torch.tensor(1.0), IDX, 0, 3),
        ValueError,
        r"\bgrad\b",
    ),
    "scatter-length-mismatch": (
        lambda: ops.index_scatter_add(_x(4), IDX, 0, 3),
        ValueError,
        r"\bindex\b",
    ),
    "scatter-length-mismatch-dim": (
        lambda: ops.index_scatter_add(_x(3, 2), IDX, 1, 3),
        ValueError,
        r"\bindex\b",
    ),
    "scatter-dim-size-negative": (
        lambda: ops.index_scatter_add(_x(3), IDX, 0, -1),
        ValueError,
        r"dim_size",
    ),
    "scatter-dim-size-float": (
        lambda: ops.index_scatter_add(_x(3), IDX, 0, 3.0),
        (TypeError, ValueError),
        r"dim_size",
    ),
    "scatter-dim-size-bool": (
        lambda: ops.index_scatter_add(_x(3), IDX, 0, True),
        (TypeError, ValueError),
        r"dim_size",
    ),
    "scatter-index-float": (
        lambda: ops.index_scatter_add(_x(3), IDX.double(), 0, 3),
        TypeError,
        r"\bindex\b",
    ),
    "scatter-index-2d": (
        lambda: ops.index_scatter_add(_x(3), IDX.reshape(1, 3), 0, 3),
        ValueError,
        r"\bindex\b",
    ),
    "scatter-index-meta": (
        lambda: ops.index_scatter_add(_x(3), IDX.to("meta"), 0, 3),
        ValueError,
        r"\bindex\b",
    ),
    "scatter-dim-high": (lambda: ops.index_scatter_add(_x(3), IDX, 1, 3), ValueError, r"\bdim\b"),
    "scatter-index-too-big": (
        lambda: ops.index_scatter_add(_x(3), IDX, 0, 2),
        (ValueError, RuntimeError),
        r"\bindex\b.*dim_size",
    ),
    # document_segments
    "segments-not-tensor": (lambda: ops.document_segments([[1, 2]], 0, 2), TypeError, r"doc_ids"),
    "segments-1d": (
        lambda: ops.document_segments(torch.ones(4, dtype=torch.long), 0, 4),
        ValueError,
        r"doc_ids",
    ),
    "segments-3d": (
        lambda: ops.document_segments(torch.ones(1, 2, 4, dtype=torch.long), 0, 4),
        ValueError,
        r"doc_ids",
    ),
    "segments-float": (
        lambda: ops.document_segments(torch.ones(1, 4), 0, 4),
        TypeError,
        r"doc_ids",
    ),
    "segments-complex": (
        lambda: ops.document_segments(torch.ones(1, 4, dtype=torch.cfloat), 0, 4),
        TypeError,
        r"doc_ids",
    ),
    "segments-start-gt-end": (
        lambda: ops.document_segments(torch.ones(1, 4, dtype=torch.long), 3, 2),
        ValueError,
        r"start",
    ),
    "segments-end-gt-s": (
        lambda: ops.document_segments(torch.ones(1, 4, dtype=torch.long), 0, 5),
        ValueError,
        r"end",
    ),
    "segments-start-negative": (
        lambda: ops.document_segments(torch.ones(1, 4, dtype=torch.long), -1, 2),
        ValueError,
        r"start",
    ),
    "segments-start-float": (
        lambda: ops.document_segments(torch.ones(1, 4, dtype=torch.long), 0.0, 2),
        TypeError,
        r"start",
    ),
    "segments-end-bool": (
        lambda: ops.document_segments(torch.ones(1, 4, dtype=torch.long), 0, True),
        TypeError,
        r"end",
    ),
}


@pytest.mark.parametrize("case", list(WRAPPER_CASES))
def test_wrapper_rejects(case):
    call, exc, pattern = WRAPPER_CASES[case]
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert re.search(pattern, message), f"{message!r} does not name the argument ({pattern})"
    assert message.startswith("cpshard."), f"{message!r} does not name the op"


# ---------------------------------------------------------------- through the raw ops

RAW_CASES = {
    # pack_ragged(x, counts, dim, pad_to, fill)
    "pack-x-0d": (lambda: raw.pack_ragged(torch.tensor(1.0), [1], 0, -1, 0), r"\bx\b"),
    "pack-negative-count": (lambda: raw.pack_ragged(_x(5), [2, -1, 4], 0, -1, 0), r"counts\[1\]"),
    "pack-counts-sum": (lambda: raw.pack_ragged(_x(5), [2, 2], 0, -1, 0), r"counts sum"),
    "pack-counts-empty": (lambda: raw.pack_ragged(_x(0), [], 0, -1, 0), r"counts"),
    "pack-counts-overflow": (
        lambda: raw.pack_ragged(_x(4), [BIG, BIG], 0, -1, 0),
        r"counts overflow",
    ),
    "pack-counts-overflow-many": (
        lambda: raw.pack_ragged(_x(4), [BIG] * 4 + [4], 0, -1, 0),
        r"counts overflow",
    ),
    "pack-pad-small": (lambda: raw.pack_ragged(_x(5), [2, 3], 0, 2, 0), r"pad_to"),
    "pack-pad-minus-two": (lambda: raw.pack_ragged(_x(5), [2, 3], 0, -2, 0), r"pad_to"),
    "pack-pad-small-all-zero": (lambda: raw.pack_ragged(_x(0), [0, 0], 0, -5, 0), r"pad_to"),
    "pack-dim-high": (lambda: raw.pack_ragged(_x(5, 3), [2, 3], 2, -1, 0), r"(?i)dim"),
    "pack-dim-low": (lambda: raw.pack_ragged(_x(5, 3), [2, 3], -3, -1, 0), r"(?i)dim"),
    "pack-size-overflow": (lambda: raw.pack_ragged(_x(2, 3), [1, 2], 1, BIG, 0), r"."),
    # unpack_ragged(packed, counts, dim, pad_to, out_shape)
    "unpack-numel-exact": (
        lambda: raw.unpack_ragged(_x(14), [2, 3], 0, -1, [5, 3]),
        r"packed has 14",
    ),
    "unpack-numel-padded": (
        lambda: raw.unpack_ragged(_x(15), [2, 3], 0, 3, [5, 3]),
        r"packed has 15",
    ),
    "unpack-negative-count": (
        lambda: raw.unpack_ragged(_x(5), [6, -1], 0, -1, [5]),
        r"counts\[1\]",
    ),
    "unpack-counts-sum": (
        lambda: raw.unpack_ragged(_x(5), [2, 2], 0, -1, [5]),
        r"counts sum.*out_shape",
    ),
    "unpack-counts-overflow": (
        lambda: raw.unpack_ragged(_x(4), [BIG, BIG], 0, -1, [4]),
        r"counts overflow",
    ),
    "unpack-pad-small": (lambda: raw.unpack_ragged(_x(4), [2, 3], 0, 2, [5]), r"pad_to"),
    "unpack-out-shape-empty": (lambda: raw.unpack_ragged(_x(1), [1], 0, -1, []), r"out_shape"),
    "unpack-out-shape-negative": (
        lambda: raw.unpack_ragged(_x(4), [2, 2], 1, -1, [-1, 4]),
        r"negative",
    ),
    "unpack-out-shape-overflow": (
        lambda: raw.unpack_ragged(_x(4), [2, 2], 1, -1, [BIG, 4]),
        r"overflow",
    ),
    "unpack-dim-high": (lambda: raw.unpack_ragged(_x(15), [2, 3], 2, -1, [5, 3]), r"(?i)dim"),
    # interleave_sequence(x, dim) / deinterleave_sequence(x, world, dim)
    "interleave-1d": (lambda: raw.interleave_sequence(_x(4), 0), r"\bx\b"),
    "interleave-dim-high": (lambda: raw.interleave_sequence(_x(2, 3, 4), 2), r"(?i)dim"),
    "deinterleave-not-divisible": (lambda: raw.deinterleave_sequence(_x(2, 5), 2, 1), r"world"),
    "deinterleave-world-zero": (lambda: raw.deinterleave_sequence(_x(2, 4), 0, 1), r"world"),
    "deinterleave-world-negative": (lambda: raw.deinterleave_sequence(_x(2, 4), -2, 1), r"world"),
    "deinterleave-0d": (lambda: raw.deinterleave_sequence(torch.tensor(1.0), 1, 0), r"\bx\b"),
    "deinterleave-dim-high": (lambda: raw.deinterleave_sequence(_x(2, 4), 2, 2), r"(?i)dim"),
    # index_gather(src, index, dim, fill)
    "gather-src-0d": (lambda: raw.index_gather(torch.tensor(1.0), IDX, 0, 0), r"\bsrc\b"),
    "gather-index-too-big": (
        lambda: raw.index_gather(_x(3), torch.tensor([0, 3]), 0, 0),
        r"\bindex\b",
    ),
    "gather-index-too-big-int32": (
        lambda: raw.index_gather(_x(3), torch.tensor([0, 3]).int(), 0, 0),
        r"\bindex\b",
    ),
    "gather-index-too-big-dim": (
        lambda: raw.index_gather(_x(4, 2), torch.tensor([2]), 1, 0),
        r"\bindex\b",
    ),
    "gather-index-too-big-empty-src": (
        lambda: raw.index_gather(_x(0, 2), torch.tensor([-1, 0]), 0, 0),
        r"\bindex\b",
    ),
    "gather-index-float": (
        lambda: raw.index_gather(_x(3), torch.tensor([0.0]), 0, 0),
        r"\bindex\b",
    ),
    "gather-index-bool": (
        lambda: raw.index_gather(_x(3), torch.tensor([True]), 0, 0),
        r"\bindex\b",
    ),
    "gather-index-2d": (lambda: raw.index_gather(_x(3), IDX.reshape(3, 1), 0, 0), r"\bindex\b"),
    "gather-dim-high": (lambda: raw.index_gather(_x(3, 2), IDX, 2, 0), r"(?i)dim"),
    # index_scatter_add(grad, index, dim, dim_size)
    "scatter-length-mismatch": (lambda: raw.index_scatter_add(_x(4), IDX, 0, 3), r"\bindex\b"),
    "scatter-dim-size-negative": (lambda: raw.index_scatter_add(_x(3), IDX, 0, -1), r"dim_size"),
    "scatter-index-too-big": (lambda: raw.index_scatter_add(_x(3), IDX, 0, 2), r"dim_size"),
    "scatter-grad-bool": (
        lambda: raw.index_scatter_add(_x(3, dtype=torch.bool), IDX, 0, 3),
        r"\bgrad\b",
    ),
    "scatter-index-float": (lambda: raw.index_scatter_add(_x(3), IDX.float(), 0, 3), r"\bindex\b"),
    "scatter-index-2d": (
        lambda: raw.index_scatter_add(_x(3), IDX.reshape(1, 3), 0, 3),
        r"\bindex\b",
    ),
    "scatter-dim-high": (lambda: raw.index_scatter_add(_x(3), IDX, 1, 3), r"(?i)dim"),
    "scatter-size-overflow": (lambda: raw.index_scatter_add(_x(3, 4), IDX, 0, BIG), r"."),
    # document_segments(doc_ids, start, end)
    "segments-1d": (
        lambda: raw.document_segments(torch.ones(4, dtype=torch.long), 0, 4),
        r"doc_ids",
    ),
    "segments-float": (lambda: raw.document_segments(torch.ones(1, 4), 0, 4), r"doc_ids"),
    "segments-start-gt-end": (
        lambda: raw.document_segments(torch.ones(1, 4, dtype=torch.long), 3, 2),
        r"start",
    ),
    "segments-end-gt-s": (
        lambda: raw.document_segments(torch.ones(1, 4, dtype=torch.long), 0, 5),
        r"end",
    ),
    "segments-start-negative": (
        lambda: raw.document_segments(torch.ones(1, 4, dtype=torch.long), -1, 2),
        r"start",
    ),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
def test_raw_op_rejects(case):
    call, pattern = RAW_CASES[case]
    with pytest.raises((RuntimeError, IndexError)) as info:
        call()
    message = str(info.value)
    assert re.search(pattern, message), f"{message!r} does not name the argument ({pattern})"




@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda: raw.index_gather(_x(3), IDX.to("meta"), 0, 0), id="gather"),
        pytest.param(lambda: raw.index_scatter_add(_x(3), IDX.to("meta"), 0, 3), id="scatter"),
    ],
)
def test_raw_op_rejects_index_on_another_device(call):
    with pytest.raises(RuntimeError, match=r"\bindex\b"):
        call()


# ---------------------------------------------------------------- fill values


def _fill_calls(dtype, fill):
    x = torch.zeros(4, 2, dtype=dtype)
    return {
        "pack": lambda: ops.pack_ragged(x, [1, 3], 0, pad_to=4, fill=fill),
        "pack-exact": lambda: ops.pack_ragged(x, [1, 3], 0, fill=fill),
        "gather": lambda: ops.index_gather(x, torch.tensor([-1, 0]), 0, fill=fill),
        "raw-pack": lambda: raw.pack_ragged(x, [1, 3], 0, 4, fill),
        "raw-gather": lambda: raw.index_gather(x, torch.tensor([-1, 0]), 0, fill),
    }


UNREPRESENTABLE_FILLS = [
    (torch.uint8, 300),
    (torch.uint8, 256),
    (torch.uint8, -256),
    (torch.int8, 128),
    (torch.int8, -129),
    (torch.int32, 2**31),
    (torch.int64, 2**63),
    (torch.float32, 1e39),
    (torch.int64, float("nan")),
    (torch.int32, float("inf")),
    (torch.float32, complex(1, 1)),
    (torch.uint8, -1),
    (torch.bool, 2),
    (torch.int64, 1.5),
    (torch.float16, 70000.0),
    (torch.bfloat16, 1e39),
]


@pytest.mark.parametrize("dtype, fill", UNREPRESENTABLE_FILLS)
def test_fill_that_does_not_fit_raises(dtype, fill):
    """A fill value dtype cannot hold raises rather than being wrapped / rounded into it."""
    for name, call in _fill_calls(dtype, fill).items():
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            call()
            pytest.fail(f"{name}: fill={fill!r} was accepted for {dtype}")


@pytest.mark.parametrize(
    "dtype, fill", [(torch.uint8, 300), (torch.int8, -129), (torch.float32, 1e39)]
)
def test_fill_error_names_the_argument(dtype, fill):
    calls = _fill_calls(dtype, fill)
    for name in ("pack", "gather"):
        with pytest.raises((TypeError, ValueError), match=r"\bfill\b"):
            calls[name]()
    for name in ("raw-pack", "raw-gather"):
        with pytest.raises(RuntimeError, match=r"\bfill\b"):
            calls[name]()


def test_fill_that_fits_is_accepted():
    for dtype, fill in [
        (torch.uint8, 255),
        (torch.int8, -128),
        (torch.float16, 65504.0),
        (torch.bool, True),
        (torch.float32, float("-inf")),
        (torch.int64, -(2**63)),
    ]:
        for call in _fill_calls(dtype, fill).values():
            call()


# ---------------------------------------------------------------- sizes near the int64 limit


def _in_forked_child(call, timeout: float = 30.0):
    """Run call() in a forked child: 'raised' (an exception of the expected kinds), 'returned',
    'other-exception', 'signal N' (a crash) or 'timeout'."""
    pid = os.fork()
    if pid == 0:  # child: never return into pytest; a crash report would only be noise
        faulthandler.disable()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        code = 0
        try:
            call()
            code = 2
        except (RuntimeError, ValueError, TypeError, IndexError):
            code = 0
        except BaseException:
            code = 3
        os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.005)
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return {0: "raised", 2: "returned", 3: "other-exception"}.get(os.WEXITSTATUS(status), "?")


HUGE_CASES = {
    "raw-unpack-pad-wraps-to-zero": lambda: raw.unpack_ragged(_x(0), [1, 1, 1, 1], 0, BIG, [4]),
    "raw-unpack-pad-wraps-to-zero-8": lambda: raw.unpack_ragged(_x(0), [1] * 8, 0, 2**61, [8]),
    "raw-unpack-pad-wraps-negative": lambda: raw.unpack_ragged(_x(0), [1, 1], 0, BIG, [2]),
    "raw-pack-pad-huge": lambda: raw.pack_ragged(_x(4), [1, 1, 1, 1], 0, BIG, 0),
    "raw-pack-pad-huge-2": lambda: raw.pack_ragged(_x(2, 3), [1, 2], 1, 2**61, 0),
    "wrapper-pack-pad-huge": lambda: ops.pack_ragged(_x(4), [1, 1, 1, 1], pad_to=BIG),
    "raw-pack-counts-overflow": lambda: raw.pack_ragged(_x(4), [BIG, BIG], 0, -1, 0),
    "raw-unpack-counts-overflow": lambda: raw.unpack_ragged(_x(4), [BIG, BIG], 0, -1, [4]),
    "raw-unpack-counts-wrap": lambda: raw.unpack_ragged(
        _x(4), [2**63 - 1, 2**63 - 1, 2, 4], 0, -1, [4]
    ),
    "raw-unpack-out-shape-huge": lambda: raw.unpack_ragged(_x(4), [2, 2], 1, -1, [BIG, 4]),
    "raw-scatter-dim-size-huge": lambda: raw.index_scatter_add(_x(3, 4), IDX, 0, BIG),
    "raw-deinterleave-world-huge": lambda: raw.deinterleave_sequence(_x(2, 4), BIG, 1),
    "raw-segments-end-huge": lambda: raw.document_segments(
        torch.ones(1, 4, dtype=torch.long), 0, BIG
    ),
}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize(
    "call",
    [v if not callable(v) else pytest.param(v) for v in HUGE_CASES.values()],
    ids=list(HUGE_CASES),
)
def test_huge_sizes_raise_without_crashing(call):
    assert _in_forked_child(call) == "raised"
