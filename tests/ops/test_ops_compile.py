"""``torch.compile(fullgraph=True)`` over functions that call the ``cpshard.ops`` wrappers.

Compiled outputs and gradients must equal eager ones bit for bit (the compiled graph calls the
same native kernels; the fake kernels only have to get shapes right). ``dynamic=True`` runs each
function on two input sizes; where the op schema allows it (every size argument an int that does
not come from a tensor size) the second call must not recompile.

Backends: ``aot_eager`` for every op; ``inductor`` for one graph holding every op (static and
dynamic), for document_segments (data-dependent output size) and for one graph with pointwise ops
fused around the ops. Inductor's one-time start-up costs seconds (its compile worker pool is
switched off for this module) and every C++ kernel it emits costs a compiler run, so the graphs
are few.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import cpshard
import cpshard.ops as ops

HAS_CUDA = torch.cuda.is_available() and bool(getattr(cpshard._C, "cuda_kernels", False))
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU and cpshard CUDA kernels"),
        ],
    ),
]


@pytest.fixture(autouse=True, scope="module")
def _inductor_without_worker_pool():
    import torch._inductor.config as inductor_config

    with inductor_config.patch(compile_threads=1):
        yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _randn(*shape, seed=0, grad=True, dtype=torch.float32):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t.requires_grad_(grad)


def _t(*values):
    return torch.tensor(values)


# ---------------------------------------------------------------- functions under test
# Each function calls wrappers the way library code does (keyword pad_to / fill, negative dims,
# sizes read from tensors). They hold no pointwise ops, so inductor emits no C++ kernel for them
# (a cold C++ compile costs seconds); test_compile_inductor_fused covers fusion around the ops.


def pack_exact(x):
    return ops.pack_ragged(x, [2, 0, 3], -2)


def pack_padded(x):
    return ops.pack_ragged(x, [2, 0, 3], 1, pad_to=4, fill=-1.5)


def unpack_exact(x):
    packed = ops.pack_ragged(x, [0, 4, 1], 1)
    return ops.unpack_ragged(packed, [0, 4, 1], x.shape, 1)


def unpack_padded(x):
    packed = ops.pack_ragged(x, [2, 0, 3], -2, pad_to=6, fill=float("-inf"))
    return ops.unpack_ragged(packed, [2, 0, 3], x.shape, -2, pad_to=6), packed


def interleave(x):
    return ops.interleave_sequence(x, -2)


def deinterleave(x):
    return ops.deinterleave_sequence(x, 3, 1)


def gather(x, index):
    return ops.index_gather(x, index, -2, fill=0.5)


def scatter_add(x, index):
    return ops.index_scatter_add(x, index, 1, 7)


def gather_scatter(x, index):
    """The usual pair: gather rows, scatter their gradients back (dim_size read from x)."""
    return ops.index_scatter_add(ops.index_gather(x, index, 1, fill=0.0), index, 1, x.shape[1])


def segments(ids):
    return tuple(ops.document_segments(ids, 1, 5))


def all_ops(x, index):
    """Every data-moving op in one graph."""
    g = ops.index_gather(x, index, 1, fill=0.25)  # [B, 8, H]
    d = ops.deinterleave_sequence(g, 2, 1)  # [2, B, 4, H]
    p = ops.pack_ragged(d, [1, 3, 0, 0], 2, pad_to=5, fill=1.0)  # [4, 2, B, 5, H]
    u = ops.unpack_ragged(p, [1, 3, 0, 0], d.shape, 2, pad_to=5)
    e = ops.pack_ragged(u, [1, 1], 0)  # exact layout, flat
    i = ops.interleave_sequence(ops.unpack_ragged(e, [1, 1], u.shape, 0), 1)  # [B, 8, H]
    return ops.index_scatter_add(i, index, 1, 6), p


# name -> (function, two argument sets of different sizes, whether dynamic=True must not recompile)
CASES = {
    "pack_exact": (
        pack_exact,
        [lambda: (_randn(3, 5, 2),), lambda: (_randn(4, 5, 3, seed=1),)],
        True,
    ),
    "pack_padded": (
        pack_padded,
        [lambda: (_randn(3, 5, 2),), lambda: (_randn(2, 5, 4, seed=1),)],
        True,
    ),
    "unpack_exact": (
        unpack_exact,
        [lambda: (_randn(3, 5, 2),), lambda: (_randn(4, 5, 3, seed=1),)],
        True,
    ),
    "unpack_padded": (
        unpack_padded,
        [lambda: (_randn(3, 5, 2),), lambda: (_randn(2, 5, 6, seed=1),)],
        True,
    ),
    # interleave's backward passes W (a tensor size) to deinterleave's `int world`: specialised
    "interleave": (
        interleave,
        [lambda: (_randn(3, 2, 4, 2),), lambda: (_randn(4, 3, 5, 2, seed=1),)],
        False,
    ),
    "deinterleave": (
        deinterleave,
        [lambda: (_randn(2, 6, 3),), lambda: (_randn(3, 9, 2, seed=1),)],
        True,
    ),
    # gather's backward passes src.shape[dim] to index_scatter_add's `int dim_size`: specialised
    "gather": (
        gather,
        [
            lambda: (_randn(2, 5, 3), _t(0, -1, 4, 4)),
            lambda: (_randn(3, 7, 2, seed=1), _t(0, -1, 6, 4, 1, 1)),
        ],
        False,
    ),
    "scatter_add": (
        scatter_add,
        [
            lambda: (_randn(2, 4, 3), _t(0, -1, 6, 6)),
            lambda: (_randn(3, 6, 2, seed=1), _t(0, -1, 6, 4, 1, 1)),
        ],
        True,
    ),
    "gather_scatter": (
        gather_scatter,
        [
            lambda: (_randn(2, 5, 3), _t(0, -1, 4, 4)),
            lambda: (_randn(3, 7, 2, seed=1), _t(0, -1, 6, 4, 1, 1)),
        ],
        False,
    ),
    "segments": (
        segments,
        [
            lambda: (_t([1, 1, 0, 2, 2, 3]),),
            lambda: (_t([1, 1, 0, 2, 2, 3, 3], [0, 4, 4, 4, 0, 5, 5]),),
        ],
        False,
    ),
    "all_ops": (
        all_ops,
        [
            lambda: (_randn(2, 6, 3, dtype=torch.float64), _t(5, 0, -1, 5, 2, 3, 3, 1)),
            lambda: (_randn(3, 6, 5, seed=1, dtype=torch.float64), _t(1, 1, -1, 4, 2, 0, 3, 5)),
        ],
        True,
    ),
}
# dynamic=True for pack / unpack and the index ops
DYNAMIC_CASES = ["pack_padded", "unpack_padded", "gather", "scatter_add", "all_ops"]


def _to(args, device):
    return tuple(
        a.detach().to(device).requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
        for a in args
    )


def _run(fn, args):
    """Outputs (a tuple) and the gradient of every differentiable input for a fixed cotangent."""
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = ()
    if inputs:
        cotangent = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(5)).to(
            outs[0].device
        )
        grads = torch.autograd.grad(outs[0], inputs, cotangent)
    return tuple(o.detach() for o in outs), grads


def _assert_same(compiled, eager):
    (outs_c, grads_c), (outs_e, grads_e) = compiled, eager
    assert len(outs_c) == len(outs_e) and len(grads_c) == len(grads_e)
    for c, e in zip(outs_c + grads_c, outs_e + grads_e, strict=True):
        assert c.shape == e.shape and c.dtype == e.dtype and c.device == e.device, (c, e)
        assert torch.equal(c, e), (c, e)


def _check(name, backend, dynamic, device):
    fn, arg_sets, no_recompile = CASES[name]
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=dynamic)
    runs = arg_sets if dynamic else arg_sets[:1]
    for make_args in runs:
        args = _to(make_args(), device)
        _assert_same(_run(compiled, args), _run(fn, args))
    if dynamic and no_recompile:
        assert counter.frame_count == 1, f"{name} recompiled for a new size under dynamic=True"
    assert counter.frame_count >= 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_compile_aot_eager(name, device):
    _check(name, "aot_eager", False, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DYNAMIC_CASES)
def test_compile_aot_eager_dynamic(name, device):
    _check(name, "aot_eager", True, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("name", ["all_ops", "segments"])
def test_compile_inductor(name, dynamic, device):
    _check(name, "inductor", dynamic, device)


def test_compile_inductor_fused():
    """Every data-moving op in one graph with pointwise ops around them for inductor to fuse,
    forward and backward."""

    def chain(x, index):
        g = ops.index_gather(x, index, 1, fill=0.25)  # [B, 8, H]
        d = ops.deinterleave_sequence(g, 2, 1)  # [2, B, 4, H]
        p = ops.pack_ragged(d, [1, 3, 0, 0], 2, pad_to=5, fill=1.0)  # [4, 2, B, 5, H]
        u = ops.unpack_ragged(p.sin(), [1, 3, 0, 0], d.shape, 2, pad_to=5)
        i = ops.interleave_sequence(u, 1)  # [B, 8, H]
        return ops.index_scatter_add(i, index, 1, 6)

    index = _t(5, 0, -1, 5, 2, 3, 3, 1)
    compiled = torch.compile(chain, backend="inductor", fullgraph=True)
    for shape in [(2, 6, 3)]:
        x = _randn(*shape, dtype=torch.float64)
        (out_c,), (grad_c,) = _run(compiled, (x, index))
        (out_e,), (grad_e,) = _run(chain, (x, index))
        # inductor may fuse sin() differently from eager: allow float64 rounding
        torch.testing.assert_close(out_c, out_e, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad_c, grad_e, rtol=1e-12, atol=1e-12)


def test_compile_dtypes_aot_eager():
    """Integer / bool / bf16 data and int32 indices through compiled wrappers."""

    def fn(x, index):
        return (
            ops.pack_ragged(x, [1, 2], 0, pad_to=3, fill=-100 if x.dtype.is_signed else 1),
            ops.index_gather(x, index, 0, fill=1),
            ops.interleave_sequence(x.unsqueeze(0).expand(2, -1, -1), 0),
        )

    index = torch.tensor([2, -1, 0], dtype=torch.int32)
    for dtype in (torch.int8, torch.bool, torch.bfloat16):
        x = (torch.arange(6).reshape(3, 2) % 3).to(dtype)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        for c, e in zip(compiled(x, index), fn(x, index), strict=True):
            assert c.dtype == e.dtype and torch.equal(c, e)


# The raw ops take negative dims (the native kernels wrap them); the fake kernels must agree.
# The graph reads the output's shape (new_zeros), so a wrong fake shape shows at runtime.
_RAW_NEGATIVE_DIM = {
    "pack_ragged-padded": lambda x: torch.ops.cpshard.pack_ragged(x, [2, 3], -1, 4, 0.0),
    "unpack_ragged": lambda x: torch.ops.cpshard.unpack_ragged(x, [2, 3], -1, -1, [2, 5]),
    "interleave_sequence": lambda x: torch.ops.cpshard.interleave_sequence(x.reshape(5, 2, 1), -1),
    "deinterleave_sequence": lambda x: torch.ops.cpshard.deinterleave_sequence(x, 5, -1),
    "index_scatter_add": lambda x: torch.ops.cpshard.index_scatter_add(
        x, torch.tensor([0, 1, 0, -1, 1]), -1, 3
    ),
}


@pytest.mark.parametrize(
    "case",
    [
        k
        for k in _RAW_NEGATIVE_DIM
    ],
)
def test_compile_raw_ops_negative_dim(case):
    op = _RAW_NEGATIVE_DIM[case]

    def fn(x):
        y = op(x)
        return y, y.new_zeros(y.shape)

    x = _randn(2, 5, grad=False)
    expected = fn(x)
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    for o, e in zip(out, expected, strict=True):
        assert o.shape == e.shape and torch.equal(o, e)
