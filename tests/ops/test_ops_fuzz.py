"""Property-based fuzzing of every native op, through the validated wrappers in ``cpshard.ops``
and through the raw ``torch.ops.cpshard`` operators (which skip the Python checks).

Properties:

* valid arguments give exactly (bit for bit) what a plain-PyTorch reference in this file gives;
* invalid arguments raise -- ``ValueError``/``TypeError`` from a wrapper, an ordinary exception
  (``RuntimeError``, or ``IndexError`` for an out-of-range dim, as torch does) from a raw op --
  and never crash the process.

Arguments are drawn from a mixture of valid and broken values: random shapes (rank 1-4, sizes
0-7, contiguous or not), dims, dtypes of every element size (1, 2, 4, 8, 16 bytes), counts
(negative, wrong sum, too long/short, near 2**62), pad_to (-1, too small, huge), out_shapes,
indices (fill, out of range, huge), dim_size, doc ids and token ranges. Whether a drawn call is
valid is decided by a small model of each op's contract (``*_problem`` below), not by the op.

Run under the sanitizers by ``.ci/sanitize.sh``. ``CPSHARD_FUZZ_EXAMPLES`` sets hypothesis'
``max_examples`` per property (default 60, so the normal suite stays fast). The number of
examples executed is printed in pytest's terminal summary and, when ``CPSHARD_FUZZ_REPORT`` names
a file, written there as JSON.

Known library bugs (``_skip_known`` predicates) are kept out of the properties, so that the
sanitizer run stays clean, and are pinned by strict-xfail repro tests run in a subprocess (a
crash there cannot take pytest down). ``CPSHARD_FUZZ_KNOWN_BUGS=1`` lets the properties draw
them again. Fixed bugs keep a regression test.
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

from cpshard import ops
from tests.helpers import REPO

pytestmark = pytest.mark.fuzz

RAW = torch.ops.cpshard
EXAMPLES = max(1, int(os.environ.get("CPSHARD_FUZZ_EXAMPLES", "60")))
INCLUDE_KNOWN_BUGS = os.environ.get("CPSHARD_FUZZ_KNOWN_BUGS") == "1"
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
    print_blob=True,
)
# Fewer examples for the properties on large (multi-threaded, chunked) tensors.
FUZZ_LARGE = settings(FUZZ, max_examples=max(1, EXAMPLES // 8))

WRAPPER_ERRORS = (ValueError, TypeError)
# What a raw op may raise: TORCH_CHECK -> RuntimeError, c10::maybe_wrap_dim -> IndexError, a bad
# Python argument type at the dispatcher -> RuntimeError/TypeError (OverflowError for an int outside
# int64), std::length_error -> ValueError.
RAW_ERRORS = (RuntimeError, IndexError, TypeError, ValueError, OverflowError)

# ------------------------------------------------------------------ counting executed examples

EXECUTED: collections.Counter[str] = collections.Counter()


def _count(name: str) -> None:
    EXECUTED[name] += 1


class _ExampleReport:
    """Registered as a pytest plugin by the fixture below: prints the counts at the end."""

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        total = sum(EXECUTED.values())
        terminalreporter.section("cpshard fuzz")
        terminalreporter.write_line(
            f"fuzz examples executed: {total} (max_examples per property = {EXAMPLES}, "
            f"known bugs {'included' if INCLUDE_KNOWN_BUGS else 'excluded'})"
        )
        for name, n in sorted(EXECUTED.items()):
            terminalreporter.write_line(f"  {name:<40} {n}")
        path = os.environ.get("CPSHARD_FUZZ_REPORT")
        if path:
            with open(path, "w") as f:
                json.dump(
                    {"total": total, "max_examples": EXAMPLES, "per_property": dict(EXECUTED)}, f
                )


@pytest.fixture(scope="module", autouse=True)
def _report_examples(request):
    plugin = _ExampleReport()
    if not request.config.pluginmanager.is_registered(plugin):
        request.config.pluginmanager.register(plugin, "cpshard-fuzz-report")
    yield


# ------------------------------------------------------------------ known library bugs


# None open at the moment: the four found so far (ragged world * pad_to overflow, scatter_add
# dim_size on empty outputs, O(size) host vectors for empty tensors, fill checks on float8 /
# uint16+) are fixed and pinned by the test_regression_* tests at the end. A new one gets a
# predicate here, ``_skip_known(predicate(...))`` in the property that draws it, and a strict-xfail
# repro test.


def _skip_known(bug: bool) -> None:
    if not INCLUDE_KNOWN_BUGS:
        assume(not bug)


# ------------------------------------------------------------------ helpers and references

DTYPES = [
    torch.uint8,
    torch.bool,
    torch.int8,  # 1 byte
    torch.float16,
    torch.bfloat16,
    torch.int16,  # 2
    torch.float32,
    torch.int32,  # 4
    torch.float64,
    torch.int64,
    torch.complex64,  # 8
    torch.complex128,  # 16
]
NUMERIC_DTYPES = [d for d in DTYPES if d != torch.bool]
HUGE = [2**62, 2**62 + 1, 2**61, 2**63 - 1, 2**62 - 1, 2**53, 2**40]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so NaN payloads, -0.0 and padding compare exactly)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    # a fresh tensor: .contiguous() may keep an odd stride on a size-1 dim, which view() rejects
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert isinstance(got, torch.Tensor)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert tuple(got.shape) == tuple(want.shape), (tuple(got.shape), tuple(want.shape))
    assert got.is_contiguous()
    assert torch.equal(bits(got), bits(want)), f"\ngot  {got}\nwant {want}"


def random_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int, layout: str) -> torch.Tensor:
    """Random bytes of ``dtype`` (any bit pattern; 0/1 for bool) in the given memory layout:
    contiguous, strided (every other element of a wider tensor), transposed, or expanded."""
    g = torch.Generator().manual_seed(seed)
    shape = list(shape)

    def make(s: list[int]) -> torch.Tensor:
        n = math.prod(s)
        if dtype == torch.bool:
            return torch.randint(0, 2, s, generator=g).bool()
        size = torch.empty(0, dtype=dtype).element_size()
        raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
        return raw.view(dtype).reshape(s)

    if layout == "strided":
        return make(shape + [2])[..., 1]
    if layout == "transposed" and len(shape) >= 2:
        return make(shape[::-1]).permute(*reversed(range(len(shape))))
    if layout == "expanded" and shape:
        small = [1 if i == 0 else s for i, s in enumerate(shape)]
        return make(small).expand(shape)
    return make(shape)


def numeric_tensor(
    shape: Sequence[int], dtype: torch.dtype, seed: int, layout: str
) -> torch.Tensor:
    """Small integer values (exact in every dtype, sums included) in the given layout."""
    g = torch.Generator().manual_seed(seed)
    lo = 0 if dtype in (torch.uint8, torch.bool) else -8
    hi = 2 if dtype == torch.bool else 9
    base = torch.randint(lo, hi, list(shape) + [2], generator=g).to(dtype)
    if layout == "contiguous":
        return base[..., 0].contiguous()
    return base[..., 1]


def fill_value(dtype: torch.dtype, draw) -> Any:
    """A fill value that converts to ``dtype`` exactly."""
    if dtype == torch.bool:
        return draw(st.booleans())
    if dtype.is_complex:
        return (
            complex(draw(st.integers(-4, 4)), draw(st.integers(-4, 4)))
            if draw(st.booleans())
            else draw(st.floats(-1e3, 1e3, allow_nan=False, width=16))
        )
    if dtype.is_floating_point:
        return draw(
            st.one_of(
                st.integers(-100, 100),
                st.sampled_from([0.5, -2.25, float("inf"), float("-inf"), float("nan")]),
            )
        )
    info = torch.iinfo(dtype)
    return draw(st.one_of(st.integers(max(info.min, -5), 5), st.sampled_from([info.min, info.max])))


def tokens_shape(x_shape: Sequence[int], dim: int, n: int) -> list[int]:
    s = list(x_shape)
    s[dim] = n
    return s


def ref_pack(x: torch.Tensor, counts: list[int], dim: int, pad: int | None, fill) -> torch.Tensor:
    dim %= x.dim()
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    if pad is None:
        return torch.cat([x.narrow(dim, offs[r], c).reshape(-1) for r, c in enumerate(counts)])
    out = torch.full([len(counts), *tokens_shape(x.shape, dim, pad)], fill, dtype=x.dtype)
    for r, c in enumerate(counts):
        out[r].narrow(dim, 0, c).copy_(x.narrow(dim, offs[r], c))
    return out


def ref_unpack(
    packed: torch.Tensor, counts: list[int], out_shape: list[int], dim: int, pad: int | None
):
    dim %= len(out_shape)
    if math.prod(out_shape) == 0:  # (slicing views of e.g. [3, 0, 2**62] overflows offsets)
        return torch.empty(out_shape, dtype=packed.dtype)
    flat = packed.reshape(-1)
    pieces = []
    if pad is None:
        at = 0
        for c in counts:
            s = tokens_shape(out_shape, dim, c)
            pieces.append(flat[at : at + math.prod(s)].reshape(s))
            at += math.prod(s)
    else:
        blocks = flat.reshape([len(counts), *tokens_shape(out_shape, dim, pad)])
        pieces = [blocks[r].narrow(dim, 0, c) for r, c in enumerate(counts)]
    return torch.cat(pieces, dim)


def ref_interleave(x: torch.Tensor, dim: int) -> torch.Tensor:
    dim %= x.dim() - 1
    if x.shape[0] == 0:
        return torch.empty(tokens_shape(x.shape[1:], dim, 0), dtype=x.dtype)
    return torch.cat(list(x.unbind(0)), dim)


def ref_deinterleave(x: torch.Tensor, world: int, dim: int) -> torch.Tensor:
    dim %= x.dim()
    n = x.shape[dim] // world
    if x.numel() == 0:  # (a huge world is fine then: no rows to stack)
        return torch.empty([world, *tokens_shape(x.shape, dim, n)], dtype=x.dtype)
    return torch.stack([x.narrow(dim, w * n, n) for w in range(world)])


def ref_gather(src: torch.Tensor, index: torch.Tensor, dim: int, fill) -> torch.Tensor:
    dim %= src.dim()
    out = torch.full(tokens_shape(src.shape, dim, index.numel()), fill, dtype=src.dtype)
    for i, j in enumerate(index.tolist()):
        if j >= 0:
            out.narrow(dim, i, 1).copy_(src.narrow(dim, j, 1))
    return out


def ref_scatter_add(
    grad: torch.Tensor, index: torch.Tensor, dim: int, dim_size: int
) -> torch.Tensor:
    dim %= grad.dim()
    acc_dtype = (
        torch.complex128
        if grad.dtype.is_complex
        else torch.float64
        if grad.dtype.is_floating_point
        else torch.int64
    )
    acc = torch.zeros(tokens_shape(grad.shape, dim, dim_size), dtype=acc_dtype)
    for i, j in enumerate(index.tolist()):
        if j >= 0:
            acc.narrow(dim, j, 1).add_(grad.narrow(dim, i, 1).to(acc_dtype))
    return acc.to(grad.dtype)


def ref_segments(ids: torch.Tensor, start: int, end: int) -> list[torch.Tensor]:
    rows, begins, lengths, docs = [], [], [], []
    for b, row in enumerate(ids.to(torch.int64).tolist()):
        i = start
        while i < end:
            if row[i] == 0:
                i += 1
                continue
            stop = i + 1
            while stop < end and row[stop] == row[i]:
                stop += 1
            doc = i
            while doc > 0 and row[doc - 1] == row[i]:
                doc -= 1
            rows.append(b), begins.append(i), lengths.append(stop - i), docs.append(doc)
            i = stop
    return [torch.tensor(v, dtype=torch.int64) for v in (rows, begins, lengths, docs)]


def check_call(call, problem: str | None, errors, reference=None, compare=assert_same):
    """Run ``call``: when ``problem`` is None it must match ``reference()`` (if the reference
    itself cannot be built, e.g. an impossible allocation, the op must raise too);
    otherwise it must raise one of ``errors``."""
    note(f"problem: {problem}")
    if problem is not None:
        with pytest.raises(errors):
            out = call()
            note(f"unexpectedly returned {out!r}")
        return
    try:
        want = reference()
    except (RuntimeError, OverflowError) as e:  # "Storage size calculation overflowed", a
        # fill int outside int64 (torch.full cannot take it either), ...
        note(f"reference raised {type(e).__name__}: {e}")
        # the op must refuse it too: natively, at the dispatcher or in the wrapper's size check
        with pytest.raises(tuple({*errors, RuntimeError, OverflowError})):
            call()
        return
    compare(call(), want)


# ------------------------------------------------------------------ argument strategies


def pick(draw, *options):
    """Draw from one of ``(weight, strategy)`` options; shrinks towards the first (valid) one."""
    k = draw(st.integers(0, sum(w for w, _ in options) - 1))
    for w, strategy in options:
        if k < w:
            return draw(strategy)
        k -= w
    raise AssertionError


shapes = st.lists(st.integers(0, 7), min_size=1, max_size=4)
layouts = st.sampled_from(["contiguous", "strided", "transposed", "expanded"])
seeds = st.integers(0, 2**32 - 1)


@st.composite
def partitions(draw, total: int) -> list[int]:
    """A valid counts list summing to ``total`` (1-8 ranks, zeros allowed)."""
    world = draw(st.integers(1, 8))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    edges = [0, *cuts, total]
    return [edges[i + 1] - edges[i] for i in range(world)]


@st.composite
def counts_for(draw, total: int) -> tuple[list, str]:
    """Counts for ``total`` tokens: valid, or broken in one of several ways."""
    counts = draw(partitions(total))
    kind = draw(
        st.sampled_from(
            ["valid"] * 14 + ["negative", "wrong_sum", "longer", "shorter", "huge", "empty", "type"]
        )
    )
    if kind == "negative":
        r = draw(st.integers(0, len(counts) - 1))
        counts[r] = -draw(st.integers(1, 2**62))
    elif kind == "wrong_sum":
        r = draw(st.integers(0, len(counts) - 1))
        counts[r] += draw(st.integers(1, 3))
    elif kind == "longer":
        counts.append(draw(st.integers(0, 2)))
    elif kind == "shorter":
        counts.pop(draw(st.integers(0, len(counts) - 1)))
    elif kind == "huge":
        r = draw(st.integers(0, len(counts) - 1))
        counts[r] = draw(st.sampled_from(HUGE))
        if draw(st.booleans()):
            counts.append(draw(st.sampled_from([2**62, 2**63 - 1, -(2**62)])))
    elif kind == "empty":
        counts = []
    elif kind == "type":
        r = draw(st.integers(0, len(counts) - 1))
        counts[r] = draw(st.sampled_from([float(counts[r]), True, str(counts[r])]))
    return counts, kind


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def as_raw(v: Any) -> Any:
    """How the dispatcher reads an ``int`` argument: a bool is an int there (not in wrappers)."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, list):
        return [as_raw(e) for e in v]
    return v


def counts_problem(counts: list, total: int, raw: bool) -> str | None:
    if not counts:
        return "no ranks"
    if not all(is_int(c) for c in counts):
        return "counts type"
    if raw and not all(-(2**63) <= c < 2**63 for c in counts):
        return "count outside int64"
    if any(c < 0 for c in counts):
        return "negative count"
    if sum(counts) != total:
        return "counts sum"
    return None


@st.composite
def pads_for(draw, counts: list) -> Any:
    """A wrapper pad_to: None, valid, too small, negative, huge or of a wrong type."""
    top = max([c for c in counts if is_int(c)], default=0)
    return pick(
        draw,
        (25, st.none()),
        (30, st.integers(top, top + 3)),
        (15, st.integers(-3, max(top - 1, -3))),
        (20, st.sampled_from(HUGE)),
        (10, st.sampled_from([1.0, True, "3"])),
    )


def pad_problem(pad: Any, counts: list, raw: bool) -> str | None:
    """pad_to problems (raw: -1 is the exact layout, None is not allowed)."""
    if raw:
        if not is_int(pad) or not -(2**63) <= pad < 2**63:
            return "pad type"
        if pad == -1:
            return None
    elif pad is None:
        return None
    elif not is_int(pad):
        return "pad type"
    ints = [c for c in counts if is_int(c)]
    if pad < max(ints, default=0) or pad < 0:
        return "pad too small"
    return None


def raw_pad(pad: Any) -> Any:
    return -1 if pad is None else pad


@st.composite
def dims_for(draw, ndim: int) -> Any:
    return pick(
        draw,
        (17, st.integers(-ndim, ndim - 1)),
        (2, st.sampled_from([ndim, -ndim - 1, ndim + 3, 2**62])),
        (1, st.sampled_from([0.0, True])),
    )


def dim_problem(dim: Any, ndim: int) -> str | None:
    if not is_int(dim):
        return "dim type"
    if not -ndim <= dim < ndim:
        return "dim range"
    return None


def ragged_size_overflow(shape: Sequence[int], d: int, world: int, pad: int | None) -> bool:
    """Whether make_ragged_geometry / token_view refuse the sizes: they multiply (checked, in
    int64) the sizes before the token dim, those after it, world * pad, and pre * max(total,
    world * pad) * post, even when a zero size makes the tensor empty (torch allows that)."""

    def overflows(*factors: int) -> bool:
        p = 1
        for f in factors:
            p *= f
            if p >= 2**63:
                return True
        return False

    padded = world * max(pad or 0, 0)
    pre, post = math.prod(shape[:d]), math.prod(shape[d + 1 :])
    return (
        overflows(*shape[:d])
        or overflows(*shape[d + 1 :])
        or overflows(world, max(pad or 0, 0))
        or overflows(pre, max(shape[d], padded), post)
    )


def overflows_before_zero(sizes: Sequence[int]) -> bool:
    """Whether multiplying ``sizes`` in order overflows int64 before a zero makes it 0."""
    p = 1
    for s in sizes:
        if s == 0:
            return False
        p *= s
        if p >= 2**63:
            return True
    return False


def first(*problems: str | None) -> str | None:
    return next((p for p in problems if p is not None), None)


# ------------------------------------------------------------------ pack_ragged


@st.composite
def pack_args(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    x = random_tensor(shape, dtype, draw(seeds), draw(layouts))
    dim = draw(dims_for(x.dim()))
    total = (
        x.shape[dim % x.dim()]
        if is_int(dim) and -x.dim() <= dim < x.dim()
        else draw(st.integers(0, 7))
    )
    counts, _ = draw(counts_for(total))
    pad = draw(pads_for(counts))
    return x, counts, dim, pad, fill_value(dtype, draw)


@FUZZ
@given(args=pack_args(), raw=st.booleans())
def test_pack_ragged(args, raw):
    _count("pack_ragged")
    x, counts, dim, pad, fill = args
    note(
        f"x {x.dtype} {tuple(x.shape)} stride {x.stride()} counts={counts} dim={dim} pad={pad} "
        f"fill={fill}"
    )
    if raw:
        call = lambda: RAW.pack_ragged(x, counts, dim, raw_pad(pad), fill)  # noqa: E731
        counts, dim, pad = as_raw(counts), as_raw(dim), as_raw(raw_pad(pad))
    else:
        call = lambda: ops.pack_ragged(x, counts, dim, pad_to=pad, fill=fill)  # noqa: E731
    dp = dim_problem(dim, x.dim())
    total = x.shape[dim] if dp is None else -1
    problem = first(dp, counts_problem(counts, total, raw), pad_problem(pad, counts, raw))
    exact_pad = None if pad in (None, -1) else pad
    errors = RAW_ERRORS if raw else WRAPPER_ERRORS
    if problem is None and ragged_size_overflow(x.shape, dim % x.dim(), len(counts), exact_pad):
        problem = "size overflow"  # world * pad_to over int64: wrapper or native refuse it
        errors = (*errors, RuntimeError)
    check_call(
        call,
        problem,
        errors,
        lambda: ref_pack(x, counts, dim, exact_pad, fill),
    )


# ------------------------------------------------------------------ unpack_ragged


@st.composite
def unpack_args(draw):
    dtype = draw(st.sampled_from(DTYPES))
    out_shape = draw(shapes)
    dim = draw(dims_for(len(out_shape)))
    d = dim % len(out_shape) if dim_problem(dim, len(out_shape)) is None else 0
    counts, _ = draw(counts_for(out_shape[d]))
    pad = draw(pads_for(counts))
    # packed: sized for the drawn counts/pad when they make sense, then maybe broken.
    good_counts = counts_problem(counts, out_shape[d], raw=True) is None
    good_pad = pad_problem(pad, counts, raw=False) is None and (pad is None or pad < 16)
    if good_counts and good_pad:
        rows = sum(counts) if pad is None else len(counts) * pad
        numel = rows * math.prod(tokens_shape(out_shape, d, 1))
    else:
        numel = draw(st.integers(0, 64))
    numel = max(0, numel + draw(st.sampled_from([0, 0, 0, 0, 1, -1, 5])))
    packed_shape = [numel]
    if good_counts and good_pad and pad is not None and draw(st.booleans()):
        packed_shape = [len(counts), *tokens_shape(out_shape, d, pad)]
        if math.prod(packed_shape) != numel:
            packed_shape = [numel]
    packed = random_tensor(packed_shape, dtype, draw(seeds), draw(layouts))
    kind = draw(st.sampled_from(["valid"] * 8 + ["negative", "empty", "huge", "type"]))
    out_shape = list(out_shape)
    if kind == "negative":
        out_shape[draw(st.integers(0, len(out_shape) - 1))] = -draw(st.integers(1, 3))
    elif kind == "empty":
        out_shape = []
    elif kind == "huge":
        out_shape[draw(st.integers(0, len(out_shape) - 1))] = draw(st.sampled_from(HUGE))
    elif kind == "type":
        out_shape[draw(st.integers(0, len(out_shape) - 1))] = draw(st.sampled_from(["2", "x", 2.0]))
    return packed, counts, out_shape, dim, pad


def unpack_problem(packed, counts, out_shape, dim, pad, raw) -> str | None:
    """(raw: pad already in the native encoding, -1 = exact)"""
    if not out_shape:
        return "empty out_shape"
    if not all(is_int(s) for s in out_shape):
        return "out_shape type"
    p = dim_problem(dim, len(out_shape))
    if p:
        return p
    d = dim % len(out_shape)
    p = first(counts_problem(counts, out_shape[d], raw), pad_problem(pad, counts, raw))
    if p:
        return p
    if any(s < 0 for s in out_shape):
        return "negative out_shape"
    rows = sum(counts) if pad in (None, -1) else len(counts) * pad
    if not raw and packed.numel() != rows * math.prod(tokens_shape(out_shape, d, 1)):
        return "packed numel"  # (the wrapper checks this first)
    if ragged_size_overflow(out_shape, d, len(counts), None if pad == -1 else pad):
        # e.g. [2**62, 4, 0]: torch makes such an (empty) tensor, the native size checks
        # refuse it (RuntimeError); so be it
        return "size overflow"
    rows = sum(counts) if pad in (None, -1) else len(counts) * pad
    if packed.numel() != rows * math.prod(tokens_shape(out_shape, d, 1)):
        return "packed numel"
    return None


@FUZZ
@given(args=unpack_args(), raw=st.booleans())
def test_unpack_ragged(args, raw):
    _count("unpack_ragged")
    packed, counts, out_shape, dim, pad = args
    note(
        f"packed {packed.dtype} {tuple(packed.shape)} counts={counts} out_shape={out_shape} "
        f"dim={dim} pad={pad}"
    )
    if raw:
        call = lambda: RAW.unpack_ragged(packed, counts, dim, raw_pad(pad), out_shape)  # noqa: E731
        counts, out_shape, dim, pad = (
            as_raw(counts),
            as_raw(out_shape),
            as_raw(dim),
            as_raw(raw_pad(pad)),
        )
    else:
        call = lambda: ops.unpack_ragged(packed, counts, out_shape, dim, pad_to=pad)  # noqa: E731
    problem = unpack_problem(packed, counts, out_shape, dim, pad, raw)
    errors = RAW_ERRORS
    if not raw:
        # An empty tensor whose other sizes overflow int64 passes the wrapper's checks and is
        # refused by the native size check (RuntimeError).
        errors = WRAPPER_ERRORS + ((RuntimeError,) if problem == "size overflow" else ())
    exact_pad = None if pad in (None, -1) else pad
    check_call(call, problem, errors, lambda: ref_unpack(packed, counts, out_shape, dim, exact_pad))


# ------------------------------------------------------------------ interleave / deinterleave


@st.composite
def interleave_args(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
    x = random_tensor(shape, dtype, draw(seeds), draw(layouts))
    return x, draw(dims_for(max(x.dim() - 1, 1)))


@FUZZ
@given(args=interleave_args(), raw=st.booleans())
def test_interleave_sequence(args, raw):
    _count("interleave_sequence")
    x, dim = args
    note(f"x {x.dtype} {tuple(x.shape)} stride {x.stride()} dim={dim}")
    call = (
        (lambda: RAW.interleave_sequence(x, dim))
        if raw
        else (lambda: ops.interleave_sequence(x, dim))
    )
    dim = as_raw(dim) if raw else dim
    problem = "rank < 2" if x.dim() < 2 else dim_problem(dim, x.dim() - 1)
    check_call(call, problem, RAW_ERRORS if raw else WRAPPER_ERRORS, lambda: ref_interleave(x, dim))


@st.composite
def deinterleave_args(draw):
    dtype = draw(st.sampled_from(DTYPES))
    x = random_tensor(draw(shapes), dtype, draw(seeds), draw(layouts))
    dim = draw(dims_for(x.dim()))
    n = x.shape[dim] if dim_problem(dim, x.dim()) is None else 7
    divisors = [w for w in range(1, 9) if n % w == 0]
    world = pick(
        draw,
        (6, st.sampled_from(divisors)),
        (2, st.integers(-3, 9)),
        (1, st.sampled_from(HUGE)),
        (1, st.sampled_from([2.0, True])),
    )
    return x, world, dim


@FUZZ
@given(args=deinterleave_args(), raw=st.booleans())
def test_deinterleave_sequence(args, raw):
    _count("deinterleave_sequence")
    x, world, dim = args
    note(f"x {x.dtype} {tuple(x.shape)} stride {x.stride()} world={world} dim={dim}")
    call = (
        (lambda: RAW.deinterleave_sequence(x, world, dim))
        if raw
        else (lambda: ops.deinterleave_sequence(x, world, dim))
    )
    if raw:
        world, dim = as_raw(world), as_raw(dim)
    problem = dim_problem(dim, x.dim())
    if problem is None:
        if not is_int(world) or (raw and world >= 2**63):
            problem = "world type"
        elif world < 1:
            problem = "world < 1"
        elif x.shape[dim] % world:
            problem = "not divisible"
        elif overflows_before_zero(
            [world, *x.shape[: dim % x.dim()], x.shape[dim] // world, *x.shape[dim % x.dim() + 1 :]]
        ):
            # an empty x divides by any world, but [W, ...] must be sized within int64
            problem = "size overflow"
    errors = RAW_ERRORS if raw else WRAPPER_ERRORS
    if not raw and problem == "world type":
        errors = (ValueError,)  # the wrapper reports a non-int world as a ValueError
    check_call(call, problem, errors, lambda: ref_deinterleave(x, world, dim))


# ------------------------------------------------------------------ index_gather / scatter_add


@st.composite
def index_for(draw, rows: int, length: int) -> tuple[torch.Tensor, str]:
    """A 1-D index into ``rows`` rows: valid (negative = fill), or broken."""
    values = draw(
        st.lists(
            st.integers(-3, rows - 1) if rows > 0 else st.integers(-(2**63), -1),
            min_size=length,
            max_size=length,
        )
    )
    kind = draw(
        st.sampled_from(
            ["valid"] * 10 + ["too_big", "huge", "min", "dtype", "rank", "noncontig", "noncontig"]
        )
    )
    dtype = draw(st.sampled_from([torch.int64, torch.int32]))
    if kind in ("too_big", "huge") and length:
        values[draw(st.integers(0, length - 1))] = (
            rows + draw(st.integers(0, 2)) if kind == "too_big" else draw(st.sampled_from(HUGE))
        )
    if kind == "min" and length:
        values[draw(st.integers(0, length - 1))] = -(2**63) if dtype == torch.int64 else -(2**31)
    if dtype == torch.int32 and any(not -(2**31) <= v < 2**31 for v in values):
        dtype = torch.int64
    index = torch.tensor(values, dtype=dtype)
    if kind == "dtype":
        index = index.to(
            draw(st.sampled_from([torch.float32, torch.int16, torch.uint8, torch.bool]))
        )
    elif kind == "rank":
        index = index.reshape(1, -1) if draw(st.booleans()) else index.sum()
    elif kind == "noncontig":
        index = torch.stack([index, index], 1)[:, 1]
    return index, kind


def index_problem(index: torch.Tensor, rows: int | None) -> str | None:
    """Rank and dtype problems, then (unless rows is None) the upper bound."""
    if index.dim() != 1:
        return "index rank"
    if index.dtype not in (torch.int64, torch.int32):
        return "index dtype"
    if rows is not None and index.numel() and index.max().item() >= rows:
        return "index out of range"
    return None


@st.composite
def gather_args(draw):
    dtype = draw(st.sampled_from(DTYPES))
    src = random_tensor(draw(shapes), dtype, draw(seeds), draw(layouts))
    dim = draw(dims_for(src.dim()))
    rows = src.shape[dim] if dim_problem(dim, src.dim()) is None else 3
    index, _ = draw(index_for(rows, draw(st.integers(0, 8))))
    return src, index, dim, fill_value(dtype, draw)


@FUZZ
@given(args=gather_args(), raw=st.booleans())
def test_index_gather(args, raw):
    _count("index_gather")
    src, index, dim, fill = args
    note(
        f"src {src.dtype} {tuple(src.shape)} stride {src.stride()} index={index!r} dim={dim} "
        f"fill={fill}"
    )
    if raw:
        call = lambda: RAW.index_gather(src, index, dim, fill)  # noqa: E731
        dim = as_raw(dim)
    problem = dim_problem(dim, src.dim())
    if problem is None:
        problem = index_problem(index, src.shape[dim])
    if raw:
        errors = RAW_ERRORS
    else:
        call = lambda: ops.index_gather(src, index, dim, fill)  # noqa: E731
        # The upper bound of the index is checked natively only (documented): RuntimeError.
        errors = (RuntimeError,) if problem == "index out of range" else WRAPPER_ERRORS
    check_call(call, problem, errors, lambda: ref_gather(src, index, dim, fill))


@st.composite
def scatter_args(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes)
    grad = numeric_tensor(
        shape, dtype, draw(seeds), draw(st.sampled_from(["contiguous", "strided"]))
    )
    dim = draw(dims_for(grad.dim()))
    n = grad.shape[dim] if dim_problem(dim, grad.dim()) is None else 3
    dim_size = pick(
        draw,
        (8, st.integers(0, 8)),
        (1, st.integers(-3, -1)),
        (1, st.sampled_from(HUGE)),
        (1, st.sampled_from([2.0, True])),
    )
    rows = dim_size if is_int(dim_size) and dim_size >= 0 else 4
    length = (
        n + draw(st.sampled_from([0, 0, 0, 0, 0, 1, -1]))
        if n
        else draw(st.sampled_from([0, 0, 0, 1]))
    )
    index, _ = draw(index_for(min(rows, 2**62), max(length, 0)))
    return grad, index, dim, dim_size


@FUZZ
@given(args=scatter_args(), raw=st.booleans())
def test_index_scatter_add(args, raw):
    _count("index_scatter_add")
    grad, index, dim, dim_size = args
    note(f"grad {grad.dtype} {tuple(grad.shape)} index={index!r} dim={dim} dim_size={dim_size}")
    call = (
        (lambda: RAW.index_scatter_add(grad, index, dim, dim_size))
        if raw
        else (lambda: ops.index_scatter_add(grad, index, dim, dim_size))
    )
    if raw:
        dim, dim_size = as_raw(dim), as_raw(dim_size)
    problem = "bool grad" if grad.dtype == torch.bool else dim_problem(dim, grad.dim())
    if problem is None:
        if not is_int(dim_size) or (raw and dim_size >= 2**63):
            problem = "dim_size type"
        elif dim_size < 0:
            problem = "dim_size < 0"
        else:  # the wrapper checks the length before the native op checks the bound
            problem = index_problem(index, None)
            if problem is None and index.numel() != grad.shape[dim]:
                problem = "index length"
            d = dim % grad.dim()
            out_shape = [*grad.shape[:d], dim_size, *grad.shape[d + 1 :]]
            if problem is None and overflows_before_zero(out_shape):
                problem = "size overflow"  # the wrapper checks it before the index bound
            problem = problem or index_problem(index, dim_size)
    if raw:
        errors = RAW_ERRORS
    else:
        errors = (RuntimeError,) if problem == "index out of range" else WRAPPER_ERRORS
        if problem == "dim_size type":
            errors = (ValueError,)  # the wrapper reports a non-int dim_size as a ValueError
    check_call(call, problem, errors, lambda: ref_scatter_add(grad, index, dim, dim_size))


# ------------------------------------------------------------------ document_segments


@st.composite
def segment_args(draw):
    dtype = draw(
        st.sampled_from(
            [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
        )
    )
    b, s = draw(st.integers(0, 5)), draw(st.integers(0, 12))
    alphabet = st.integers(0, 1) if dtype == torch.bool else st.integers(0, 3)
    values = draw(st.lists(st.lists(alphabet, min_size=s, max_size=s), min_size=b, max_size=b))
    ids = torch.tensor(values, dtype=torch.int64).reshape(b, s).to(dtype)
    layout = draw(
        st.sampled_from(["contiguous", "contiguous", "strided", "transposed", "rank", "float"])
    )
    if layout == "strided":
        ids = torch.stack([ids, ids], -1)[..., 1]
    elif layout == "transposed":
        ids = ids.t().contiguous().t()
    elif layout == "rank":
        ids = ids.reshape(-1) if draw(st.booleans()) else ids.reshape(b, s, 1)
    elif layout == "float":
        ids = ids.to(
            draw(st.sampled_from([torch.float32, torch.float64, torch.complex64, torch.bfloat16]))
        )

    def bound():
        return pick(
            draw,
            (8, st.integers(0, s)),
            (2, st.integers(-3, s + 3)),
            (1, st.sampled_from(HUGE + [-(2**62)])),
        )

    start, end = sorted([bound(), bound()]) if draw(st.integers(0, 3)) else (bound(), bound())
    if draw(st.integers(0, 9)) == 0:
        start = draw(st.sampled_from([True, 1.0, None]))
    return ids, start, end


@FUZZ
@given(args=segment_args(), raw=st.booleans())
def test_document_segments(args, raw):
    _count("document_segments")
    ids, start, end = args
    note(f"ids {ids.dtype} {tuple(ids.shape)}\n{ids}\nstart={start} end={end}")
    if raw:
        call = lambda: tuple(RAW.document_segments(ids, start, end))  # noqa: E731
        start, end = as_raw(start), as_raw(end)
    else:
        call = lambda: tuple(ops.document_segments(ids, start, end))  # noqa: E731
    if ids.dim() != 2:
        problem = "rank"
    elif ids.dtype.is_floating_point or ids.dtype.is_complex:
        problem = "dtype"
    elif not (is_int(start) and is_int(end)) or (raw and max(abs(start), abs(end)) >= 2**63):
        problem = "type"
    elif not 0 <= start <= end <= ids.shape[1]:
        problem = "range"
    else:
        problem = None

    def compare(got, want):
        assert len(got) == 4
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)

    check_call(
        call,
        problem,
        RAW_ERRORS if raw else WRAPPER_ERRORS,
        lambda: ref_segments(ids, start, end),
        compare,
    )


# ------------------------------------------------------------------ round trips, fills, odd dtypes


@FUZZ
@given(
    dtype=st.sampled_from(DTYPES),
    shape=shapes,
    seed=seeds,
    layout=layouts,
    data=st.data(),
)
def test_round_trips(dtype, shape, seed, layout, data):
    """unpack(pack(x)) == x, deinterleave(interleave(x)) == x, scatter_add(gather) adjoint."""
    _count("round_trips")
    x = random_tensor(shape, dtype, seed, layout)
    dim = data.draw(st.integers(-x.dim(), x.dim() - 1))
    counts = data.draw(partitions(x.shape[dim]))
    pad = data.draw(st.one_of(st.none(), st.integers(max(counts), max(counts) + 2)))
    packed = ops.pack_ragged(x, counts, dim, pad_to=pad)
    assert_same(ops.unpack_ragged(packed, counts, list(x.shape), dim, pad_to=pad), x.contiguous())
    world = len(counts)
    stacked = random_tensor([world, *shape], dtype, seed + 1, layout)
    d = data.draw(st.integers(0, len(shape) - 1))
    assert_same(
        ops.deinterleave_sequence(ops.interleave_sequence(stacked, d), world, d),
        stacked.contiguous(),
    )


@FUZZ
@given(
    dtype=st.sampled_from(DTYPES),
    fill=st.one_of(
        st.integers(-(2**70), 2**70),
        st.floats(allow_nan=True),
        st.complex_numbers(max_magnitude=1e300),
        st.booleans(),
        st.sampled_from([65504.0, 65520.0, 3.4e38, 3.5e38, 255, 256, -129, 2**63 - 1, 2**63]),
        st.sampled_from(["1", None]),
    ),
    raw=st.booleans(),
    op=st.sampled_from(["pack", "gather"]),
)
def test_fill_values(dtype, fill, raw, op):
    """Any Python scalar as fill: used if ``dtype`` holds it (``fill_problem``), else rejected."""
    _count("fill_values")
    x = random_tensor([3, 2], dtype, 7, "contiguous")
    problem = fill_problem(fill, dtype)
    note(f"fill={fill!r}: {problem}")
    if op == "pack":
        call = (
            (lambda: RAW.pack_ragged(x, [1, 2], 0, 3, fill))
            if raw
            else (lambda: ops.pack_ragged(x, [1, 2], 0, pad_to=3, fill=fill))
        )
        ref = lambda: ref_pack(x, [1, 2], 0, 3, fill)  # noqa: E731
    else:
        idx = torch.tensor([2, -1, 0])
        call = (
            (lambda: RAW.index_gather(x, idx, 0, fill))
            if raw
            else (lambda: ops.index_gather(x, idx, 0, fill))
        )
        ref = lambda: ref_gather(x, idx, 0, fill)  # noqa: E731
    # (a fill that is representable but not a valid Scalar, e.g. an int over int64 for float
    # data, fails in the reference too: check_call then wants any error)
    check_call(call, problem, RAW_ERRORS if raw else WRAPPER_ERRORS, ref)


def fill_problem(fill: Any, dtype: torch.dtype) -> str | None:
    """The fill contract (ops._fill, geometry.cpp representable): ``dtype`` must hold the value
    exactly in range; rounding a float is fine, wrapping, truncating or overflowing to inf not."""
    if isinstance(fill, bool):
        return None
    if not isinstance(fill, (int, float, complex)):
        return "fill type"
    if isinstance(fill, complex):
        return None if dtype.is_complex else "complex fill"
    if dtype.is_complex:
        return None
    if dtype == torch.bool:
        return None if fill in (0, 1) else "fill not 0/1"
    if not dtype.is_floating_point:
        if isinstance(fill, float) and not fill.is_integer():
            return "fractional fill"
        info = torch.iinfo(dtype)
        return None if info.min <= fill <= info.max else "fill out of range"
    if math.isfinite(fill) and abs(fill) > torch.finfo(dtype).max:
        return "fill overflows"
    return None


ODD_DTYPES = [
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.complex32,
    torch.uint16,
    torch.uint32,
    torch.uint64,
]


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@FUZZ
@given(
    dtype=st.sampled_from(ODD_DTYPES),
    shape=shapes,
    op=st.sampled_from(
        ["pack", "pack_padded", "unpack", "interleave", "deinterleave", "gather", "scatter"]
    ),
    raw=st.booleans(),
)
def test_odd_dtypes(dtype, shape, op, raw):
    """dtypes without full arithmetic support (float8, complex32, uint16+): the byte-moving ops
    move them exactly; scatter_add supports them or raises; nothing crashes."""
    _count("odd_dtypes")
    size = torch.empty(0, dtype=dtype).element_size()
    x = torch.randint(0, 256, [*shape, size], dtype=torch.uint8).view(dtype).reshape(shape)
    n = x.shape[0]
    f = (lambda w, r: w) if not raw else (lambda w, r: r)
    try:
        if op == "pack":
            out = f(lambda: ops.pack_ragged(x, [n]), lambda: RAW.pack_ragged(x, [n], 0, -1, 0))()
            assert torch.equal(bits(out), bits(x))
        elif op == "pack_padded":
            out = f(
                lambda: ops.pack_ragged(x, [n], pad_to=n), lambda: RAW.pack_ragged(x, [n], 0, n, 0)
            )()
            assert torch.equal(bits(out), bits(x))
        elif op == "unpack":
            out = f(
                lambda: ops.unpack_ragged(x, [n], list(shape)),
                lambda: RAW.unpack_ragged(x, [n], 0, -1, list(shape)),
            )()
            assert torch.equal(bits(out), bits(x))
        elif op == "interleave" and x.dim() >= 2:
            out = f(lambda: ops.interleave_sequence(x, 0), lambda: RAW.interleave_sequence(x, 0))()
            assert torch.equal(bits(out), bits(ref_interleave(x, 0)))
        elif op == "deinterleave":
            out = f(
                lambda: ops.deinterleave_sequence(x, 1, 0),
                lambda: RAW.deinterleave_sequence(x, 1, 0),
            )()
            assert torch.equal(bits(out), bits(x))
        elif op == "gather":
            idx = torch.arange(n - 1, -1, -1)
            out = f(lambda: ops.index_gather(x, idx), lambda: RAW.index_gather(x, idx, 0, 0))()
            rows_reversed = bits(x).reshape(n, -1).flip(0).reshape(-1) if x.numel() else bits(x)
            assert torch.equal(bits(out), rows_reversed)
        elif op == "scatter":
            idx = torch.arange(n)
            out = f(
                lambda: ops.index_scatter_add(x, idx, 0, n),
                lambda: RAW.index_scatter_add(x, idx, 0, n),
            )()
            assert torch.equal(bits(out), bits(x))
    except (RuntimeError, TypeError) as e:  # NotImplementedError is a RuntimeError
        note(f"raised {type(e).__name__}: {e}")
        assert op == "scatter", e


# ------------------------------------------------------------------ large tensors (threads, chunks)


@FUZZ_LARGE
@given(
    dtype=st.sampled_from([torch.uint8, torch.bfloat16, torch.float32, torch.complex128]),
    tokens=st.integers(0, 40),
    post=st.sampled_from([1, 3, 4099, 70001]),
    pre=st.integers(1, 3),
    seed=seeds,
    data=st.data(),
)
def test_large_moves(dtype, tokens, post, pre, seed, data):
    """Moves big enough to use several threads and 256 KiB chunks (kChunkBytes), incl. padding."""
    _count("large_moves")
    assume(pre * tokens * post * torch.empty(0, dtype=dtype).element_size() <= 24 << 20)
    x = random_tensor([pre, tokens, post], dtype, seed, "contiguous")
    counts = data.draw(partitions(tokens))
    pad = data.draw(st.one_of(st.none(), st.integers(max(counts), max(counts) + 3)))
    fill = fill_value(dtype, data.draw)
    packed = ops.pack_ragged(x, counts, 1, pad_to=pad, fill=fill)
    assert_same(packed, ref_pack(x, counts, 1, pad, fill))
    assert_same(ops.unpack_ragged(packed, counts, list(x.shape), 1, pad_to=pad), x)
    idx = torch.tensor(
        data.draw(st.lists(st.integers(-1, max(tokens - 1, -1)), min_size=0, max_size=12)),
        dtype=torch.int64,
    )
    assert_same(ops.index_gather(x, idx, 1, fill), ref_gather(x, idx, 1, fill))
    if dtype != torch.uint8 and idx.numel():
        g = numeric_tensor([pre, idx.numel(), post], dtype, seed, "contiguous")
        assert_same(ops.index_scatter_add(g, idx, 1, tokens), ref_scatter_add(g, idx, 1, tokens))


@FUZZ_LARGE
@given(b=st.integers(1, 8), s=st.integers(1, 70000), seed=seeds, data=st.data())
def test_large_segments(b, s, seed, data):
    _count("large_segments")
    g = torch.Generator().manual_seed(seed)
    run = data.draw(st.integers(1, 5000))
    ids = torch.randint(0, 4, (b, (s + run - 1) // run), generator=g).repeat_interleave(run, 1)[
        :, :s
    ]
    start = data.draw(st.integers(0, s))
    end = data.draw(st.integers(start, s))
    got = ops.document_segments(ids, start, end)
    # vectorised reference: a segment begins where the id is non-zero and differs from the left
    # neighbour (or at start)
    sub = ids[:, start:end]
    left = torch.cat([torch.full((b, 1), -1), sub[:, :-1]], 1) if end > start else sub
    begins = (sub != 0) & (sub != left)
    rows, cols = begins.nonzero(as_tuple=True)
    assert torch.equal(got.row, rows) and torch.equal(got.begin, cols + start)
    for k in range(min(len(rows), 20)):
        r, c = rows[k].item(), cols[k].item() + start
        v = ids[r, c].item()
        stop = c
        while stop < end and ids[r, stop].item() == v:
            stop += 1
        doc = c
        while doc > 0 and ids[r, doc - 1].item() == v:
            doc -= 1
        assert got.length[k].item() == stop - c and got.doc_start[k].item() == doc


# ------------------------------------------------------------------ known bugs, pinned


def _run_isolated(code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (a crash cannot take pytest down); any sanitizer
    report goes to the child's stderr, not to the log the sanitizer job checks."""
    env = dict(os.environ)
    for var in ("ASAN_OPTIONS", "UBSAN_OPTIONS"):
        opts = [o for o in env.get(var, "").split(":") if o and not o.startswith("log_path=")]
        env[var] = ":".join(opts)
    prelude = "import torch, cpshard\nfrom cpshard import ops\nRAW = torch.ops.cpshard\n"
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def _expect_clean_exit(code: str) -> None:
    proc = _run_isolated(code)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "runtime error" not in proc.stderr and "AddressSanitizer" not in proc.stderr, (
        proc.stderr[-4000:]
    )


def test_regression_unpack_pad_overflow():
    """world * pad_to used to overflow in make_ragged_geometry: a too-small packed tensor passed
    the numel check and the kernel read out of bounds (SIGSEGV). Fixed in 3d936bb."""
    _expect_clean_exit("""
        try:
            RAW.unpack_ragged(torch.empty(0), [1, 0, 0, 0], 0, 2**62, [1])
        except RuntimeError:
            pass
        else:
            raise SystemExit("no error")
    """)


def test_regression_pack_pad_overflow_ub():
    """pack_ragged(pad_to=2**62, 4 ranks) computed world * pad with signed overflow (UB, seen by
    UBSan) before raising. Fixed in 3d936bb."""
    _expect_clean_exit("""
        for call in (
            lambda: ops.pack_ragged(torch.zeros(1, 0), [1, 0, 0, 0], pad_to=2**62),
            lambda: RAW.pack_ragged(torch.zeros(1, 0), [1, 0, 0, 0], 0, 2**62, 0),
        ):
            try:
                call()
            except (RuntimeError, ValueError):
                pass
            else:
                raise SystemExit("no error")
    """)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "uint16"])
def test_regression_fill_dtype_dispatch(dtype):
    _expect_clean_exit(f"""
        x = torch.zeros(4, 2, dtype=torch.{dtype})
        ops.pack_ragged(x, [1, 3])
        ops.deinterleave_sequence(x, 2, 0)
        ops.index_gather(x, torch.tensor([1, -1]))
    """)


def test_regression_scatter_add_huge_dim_size_on_empty():
    _expect_clean_exit("""
        for size in (2**40, 2**63 - 1):
            empty = torch.zeros(0, dtype=torch.long)
            out = ops.index_scatter_add(torch.zeros(0, 0), empty, 0, size)
            assert out.shape == (size, 0), out.shape
    """)


@pytest.mark.parametrize(
    "code",
    [
        "out = ops.deinterleave_sequence(torch.zeros(0), 2**40, 0); assert out.shape == (2**40, 0)",
        "out = ops.interleave_sequence(torch.empty(2**40, 1, 0), 1); assert out.shape == (1, 0)",
        "out = ops.document_segments(torch.empty(2**40, 0, dtype=torch.long), 0, 0); "
        "assert out.row.numel() == 0",
    ],
    ids=["deinterleave_sequence", "interleave_sequence", "document_segments"],
)
def test_regression_huge_empty_dim(code):
    _expect_clean_exit(code)
