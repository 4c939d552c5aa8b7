"""Multi-process tests of the differentiable sequence transport (the ``gather_*`` verbs of
``cpshard.transport``) on gloo.

Every gather is compared with an independent single-process reference written here in plain
PyTorch: each rank builds the FULL tensor from a fixed seed (the same on every rank), takes its
own part as the input, and checks

* forward: the gathered output equals the reference slice/cat bit for bit (``torch.equal``),
  for float64, float32, bfloat16, int64 and bool;
* backward (float64): the gradient of rank r's input equals, within 1e-10, the sum over ranks q
  of the rows of rank q's upstream gradient that came from rank r's part.

Each rank of a pool runs a whole grid of cases per ``pool.run`` call (spawning costs seconds, a
run milliseconds) and returns the list of mismatches it found; the parent asserts the list is
empty. Case grids are pure functions of the world size, so the parent can count them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard import gather_halo, gather_metadata, gather_ragged, gather_sequence
from tests.helpers import assert_no_mismatches

WORLDS = [1, 2, 3, 4]
F64, F32, BF16, I64 = torch.float64, torch.float32, torch.bfloat16, torch.int64
ATOL = 1e-10

# --------------------------------------------------------------------------- helpers (both sides)


def _rand(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype)


def _layout(t: torch.Tensor, noncontig: bool) -> torch.Tensor:
    """A fresh tensor equal to t; with ``noncontig``, a strided view (every other element of the
    last dim of a larger buffer), so the library must not assume contiguity."""
    if not noncontig:
        return t.clone()
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    view = buf[..., ::2]
    view.copy_(t)
    return view.detach()


def _upstream(shape: Sequence[int], seed: int, kind: str) -> torch.Tensor:
    """Rank q's upstream gradient: contiguous, strided ('nc') or a stride-0 expansion."""
    if kind == "expanded":
        return torch.tensor(0.25 + seed % 7, dtype=F64).expand(tuple(shape))
    return _layout(_rand(shape, F64, seed), kind == "nc")


def _with_dim(shape: Sequence[int | None], dim: int, n: int) -> list[int]:
    out = list(shape)
    out[dim % len(out)] = n
    return out


def _offsets(counts: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(counts, initial=0))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = a.shape == b.shape and a.dtype == b.dtype
    return same and bool(torch.allclose(a, b, rtol=0, atol=ATOL))


def _tag(**kw) -> str:
    return ", ".join(f"{k}={v}" for k, v in kw.items())


# --------------------------------------------------------------------------- case grids (pure)

# (shape with None at the token dim, token dim as passed)
RAGGED_LAYOUTS = [
    ((None,), 0),
    ((None, 5), 0),
    ((3, None), 1),
    ((None, 2, 3), 0),
    ((2, None, 4), 1),  # B > 1
    ((2, 3, None), 2),
    ((2, 3, None), -1),
    ((3, None, 17), -2),
    ((2, 1, None, 3), 2),
    ((None, 1), 0),  # hidden 1
    ((1, None, 64), 1),  # token slot contiguous although dim = 1
    ((2, None, 64), -2),
]

# (dtype, noncontiguous x, upstream gradient kind) variants run for every (counts, layout)
VARIANTS = [
    (F64, False, "contig"),
    (F64, True, "nc"),
    (F64, False, "expanded"),
    (BF16, True, None),
    (I64, False, None),
    (torch.bool, True, None),
]


def _count_sets(world: int) -> list[list[int]]:
    return [
        [3, 1, 4, 2][:world],  # uneven
        [0, 3, 0, 2][:world],  # zero-count ranks
        [0] * (world - 1) + [5],  # the last rank holds everything
        [5] + [0] * (world - 1),  # rank 0 holds everything
        [0] * world,  # all ranks empty
        [2] * world,  # equal
        [37, 0, 64, 5][:world],  # larger
    ]


def _ragged_grid(world: int) -> list[tuple]:
    """Every (counts, layout) pair once in float64 with gradients and once in bf16, int64 or
    bool; the x layout / upstream-gradient kind rotates across pairs so that each meets every
    count set."""
    grid = []
    for k, counts in enumerate(_count_sets(world)):
        for j, (shape, dim) in enumerate(RAGGED_LAYOUTS):
            i = j + k  # shifts with the count set, so each layout meets every variant
            for dtype, nc, gk in (VARIANTS[i % 3], VARIANTS[3 + i % 3]):
                grid.append((counts, shape, dim, dtype, nc, gk))
    return grid


SEQ_LAYOUTS = [
    ((None,), 0),
    ((None, 4), 0),
    ((2, None), 1),
    ((1, None, 8), 1),
    ((3, None, 1), 1),  # B > 1, hidden 1
    ((2, None, 5), -2),
    ((2, 4, None), 2),
    ((2, 4, None), -1),
    ((None, 2, 3), 0),
    ((2, 3, None, 2), 2),
]
SEQ_VARIANTS = [
    (F64, False, "contig"),
    (F64, True, "nc"),
    (F64, False, "expanded"),
    (BF16, True, None),
    (F32, False, None),
]


def _sequence_grid(world: int) -> list[tuple]:
    return [
        (length, shape, dim, dtype, nc, gk)
        for length in (1, 3, 0)
        for shape, dim in SEQ_LAYOUTS
        for dtype, nc, gk in SEQ_VARIANTS
    ]


def _metadata_grid(world: int) -> list[tuple]:
    return [
        (length, shape, dim, kind, nc)
        for length in (1, 4)
        for shape, dim in SEQ_LAYOUTS
        for kind in ("positions", "mask", "float")
        for nc in (False, True)
    ]


HALO_LAYOUTS = [
    ((None,), 0),
    ((None, 4), 0),
    ((2, None, 3), 1),  # B > 1
    ((1, None, 5), 1),
    ((2, 3, None), 2),
    ((2, 3, None), -1),
]


def _halo_sizes(world: int, length: int) -> list:
    sizes = sorted({0, 1, max(length - 1, 0), length, length + 1, 2 * length + 1, 3 * length, 1000})
    lists = [
        [5, 0, 2 * length + 1, length][:world],
        [0, length, 1, 3 * length + 2][:world],
    ]
    return sizes + lists


def _halo_grid(world: int) -> list[tuple]:
    grid = []
    k = 0
    for length in (3, 1, 0):
        for halo in _halo_sizes(world, length):
            for left in (0, 2):
                k += 1
                for j, (shape, dim) in enumerate(HALO_LAYOUTS):
                    i = j + k  # shifts per (length, halo, left), so each layout meets every variant
                    variants = [VARIANTS[i % 3]]  # float64, rotating x layout / upstream kind
                    if i % 2 == 0:
                        variants.append((BF16, i % 4 == 0, None))
                    if i % 3 == 0:
                        variants.append((I64, False, None))
                    for dtype, nc, gk in variants:
                        grid.append((length, halo, left, shape, dim, dtype, nc, gk))
    return grid


# --------------------------------------------------------------------------- single-case checks


def _check_ragged(group, rank, world, counts, shape, dim, dtype, nc, gk, seed=0) -> list[str]:
    tag = _tag(fn="ragged", W=world, counts=counts, shape=shape, dim=dim, dtype=dtype, nc=nc,
               grad=gk)
    d = dim % len(shape)
    offs = _offsets(counts)
    full_shape = _with_dim(shape, d, offs[-1])
    full = _rand(full_shape, dtype, seed)
    grad = dtype == F64
    x = _layout(full.narrow(d, offs[rank], counts[rank]), nc).requires_grad_(grad)
    y = gather_ragged(x, group, counts, dim)
    errs = []
    if world == 1 and y is not x:
        errs.append(f"{tag}: world 1 did not return x itself")
    if y.dtype != dtype or not torch.equal(y.detach(), full):
        errs.append(f"{tag}: forward differs from the reference")
    if grad:
        ups = [_upstream(full_shape, seed * 31 + q, gk) for q in range(world)]
        y.backward(ups[rank])
        ref = sum(g.narrow(d, offs[rank], counts[rank]) for g in ups)
        if x.grad is None or not _close(x.grad, ref):
            errs.append(f"{tag}: grad differs from the reference")
    elif y.requires_grad:
        errs.append(f"{tag}: output of a non-differentiable input requires grad")
    return errs


def _check_sequence(group, rank, world, length, shape, dim, dtype, nc, gk, seed=0) -> list[str]:
    tag = _tag(fn="sequence", W=world, L=length, shape=shape, dim=dim, dtype=dtype, nc=nc, grad=gk)
    d = dim % len(shape)
    full_shape = _with_dim(shape, d, world * length)
    full = _rand(full_shape, dtype, seed)
    grad = dtype == F64
    x = _layout(full.narrow(d, rank * length, length), nc).requires_grad_(grad)
    y = gather_sequence(x, group, seq_dim=dim)
    errs = []
    if world == 1 and y is not x:
        errs.append(f"{tag}: world 1 did not return x itself")
    if y.dtype != dtype or not torch.equal(y.detach(), full):
        errs.append(f"{tag}: forward differs from the reference")
    if grad:
        ups = [_upstream(full_shape, seed * 31 + q, gk) for q in range(world)]
        y.backward(ups[rank])
        ref = sum(g.narrow(d, rank * length, length) for g in ups)
        if x.grad is None or not _close(x.grad, ref):
            errs.append(f"{tag}: grad differs from the reference")
    return errs


def _meta_full(kind: str, full_shape: list[int], d: int, seed: int) -> torch.Tensor:
    if kind == "positions":  # int64 positions along the token dim, broadcast over the rest
        view = [1] * len(full_shape)
        view[d] = full_shape[d]
        pos = torch.arange(full_shape[d], dtype=I64).view(view) * 3 + seed
        return pos.expand(full_shape).clone()
    if kind == "mask":
        return _rand(full_shape, torch.bool, seed)
    return _rand(full_shape, F32, seed)


def _check_metadata(group, rank, world, length, shape, dim, kind, nc, seed=0) -> list[str]:
    tag = _tag(fn="metadata", W=world, L=length, shape=shape, dim=dim, kind=kind, nc=nc)
    d = dim % len(shape)
    full_shape = _with_dim(shape, d, world * length)
    full = _meta_full(kind, full_shape, d, seed)
    x = _layout(full.narrow(d, rank * length, length), nc)
    y = gather_metadata(x, group, seq_dim=dim)
    errs = []
    if world == 1 and y is not x:
        errs.append(f"{tag}: world 1 did not return x itself")
    if y.requires_grad or y.dtype != full.dtype or not torch.equal(y, full):
        errs.append(f"{tag}: forward differs from the reference")
    return errs


def _halo_reference(
    full: torch.Tensor, d: int, length: int, halos: list[int], left: int, q: int
) -> torch.Tensor:
    h = min(q * length, halos[q])
    pad_shape = list(full.shape)
    pad_shape[d] = left
    return torch.cat([full.new_zeros(pad_shape), full.narrow(d, q * length - h, h + length)], d)


def _check_halo(
    group, rank, world, length, halo, left, shape, dim, dtype, nc, gk, seed=0
) -> list[str]:
    tag = _tag(fn="halo", W=world, L=length, halo=halo, left=left, shape=shape, dim=dim,
               dtype=dtype, nc=nc, grad=gk)
    d = dim % len(shape)
    halos = list(halo) if isinstance(halo, list) else [halo] * world
    full_shape = _with_dim(shape, d, world * length)
    full = _rand(full_shape, dtype, seed)
    grad = dtype == F64
    x = _layout(full.narrow(d, rank * length, length), nc).requires_grad_(grad)
    y = gather_halo(x, group, halo, left_padding=left, seq_dim=dim)
    errs = []
    if world == 1 and left == 0 and y is not x:
        errs.append(f"{tag}: world 1 without padding did not return x itself")
    expected_len = left + min(rank * length, halos[rank]) + length
    ref = _halo_reference(full, d, length, halos, left, rank)
    if y.shape[d] != expected_len or y.dtype != dtype or not torch.equal(y.detach(), ref):
        errs.append(f"{tag}: forward differs from the reference")
    if left and not torch.all(y.detach().narrow(d, 0, left) == 0):
        errs.append(f"{tag}: left padding is not zero")
    if grad:
        acc = torch.zeros(full_shape, dtype=F64)
        ups = []
        for q in range(world):
            h = min(q * length, halos[q])
            out_shape = _with_dim(full_shape, d, left + h + length)
            up = _upstream(out_shape, seed * 31 + q, gk)
            ups.append(up)
            # The left padding's gradient is dropped.
            acc.narrow(d, q * length - h, h + length).add_(up.narrow(d, left, h + length))
        y.backward(ups[rank])
        if x.grad is None or not _close(x.grad, acc.narrow(d, rank * length, length)):
            errs.append(f"{tag}: grad differs from the reference")
    return errs


# --------------------------------------------------------------------------- worker functions


def _world_group():
    return dist.group.WORLD


def _run_ragged_grid(rank: int, world: int) -> tuple[int, list[str]]:
    grid = _ragged_grid(world)
    errs = []
    for i, case in enumerate(grid):
        errs += _check_ragged(_world_group(), rank, world, *case, seed=i)
    return len(grid), errs


def _run_sequence_grid(rank: int, world: int) -> tuple[int, list[str]]:
    grid = _sequence_grid(world)
    errs = []
    for i, case in enumerate(grid):
        errs += _check_sequence(_world_group(), rank, world, *case, seed=i)
    for i, case in enumerate(_metadata_grid(world)):
        errs += _check_metadata(_world_group(), rank, world, *case, seed=i)
    return len(grid) + len(_metadata_grid(world)), errs


def _run_halo_grid(rank: int, world: int) -> tuple[int, list[str]]:
    grid = _halo_grid(world)
    errs = []
    for i, case in enumerate(grid):
        errs += _check_halo(_world_group(), rank, world, *case, seed=i)
    return len(grid), errs


def _metadata_rejects_grad(rank: int, world: int) -> list[str]:
    """Every rank passes a tensor that requires grad: every rank raises its own ValueError."""
    msgs = []
    for group in (_world_group(), None):
        x = torch.zeros(2, 3, dtype=F64, requires_grad=True)
        try:
            gather_metadata(x, group, seq_dim=1)
        except ValueError as exc:
            msgs.append(str(exc))
        else:
            msgs.append("<no error>")
    return msgs


def _representative_cases(group, rank: int, world: int, seed: int) -> list[str]:
    """One case of each function, with the group's own rank and world."""
    counts = [3, 0, 4, 2][:world] if world > 1 else [3]
    errs = _check_ragged(group, rank, world, counts, (2, None, 4), 1, F64, False, "contig", seed)
    errs += _check_ragged(group, rank, world, counts, (None, 3), 0, F64, True, "nc", seed + 1)
    errs += _check_sequence(group, rank, world, 2, (2, None, 3), 1, F64, False, "contig", seed + 2)
    errs += _check_sequence(group, rank, world, 2, (2, 3, None), 2, F64, False, "expanded",
                            seed + 3)
    errs += _check_metadata(group, rank, world, 2, (2, None), 1, "positions", False, seed + 4)
    errs += _check_halo(group, rank, world, 2, 5, 1, (2, None, 3), 1, F64, False, "contig",
                        seed + 5)
    errs += _check_halo(group, rank, world, 2, 1, 0, (None, 3), 0, F64, False, "contig", seed + 6)
    return errs


def _aliases(group, n: int = 3) -> list[str]:
    """Without CP every function returns its input itself."""
    errs = []
    x = torch.randn(2, n, 4, dtype=F64, requires_grad=True)
    if gather_sequence(x, group, seq_dim=1) is not x:
        errs.append("gather_sequence")
    if gather_ragged(x, group, [n], dim=1) is not x:
        errs.append("gather_ragged")
    if gather_halo(x, group, 7, seq_dim=1) is not x:
        errs.append("gather_halo")
    if gather_halo(x, group, [7], seq_dim=1) is not x:
        errs.append("gather_halo (list)")
    m = torch.arange(n).view(1, n)
    if gather_metadata(m, group, seq_dim=1) is not m:
        errs.append("gather_metadata")
    return [f"{name} with a 1-rank group {group!r} did not alias its input" for name in errs]


def _run_group_kinds(rank: int, world: int) -> dict[str, list[str]]:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, list[str]] = {}
    out["ProcessGroup"] = _representative_cases(dist.group.WORLD, rank, world, 100)
    mesh = init_device_mesh("cpu", (world,))
    out["DeviceMesh"] = _representative_cases(mesh, rank, world, 200)
    out["new_group"] = _representative_cases(dist.new_group(list(range(world))), rank, world, 300)
    # A proper subgroup of ranks 1..W-1: group ranks differ from global ranks (p2p peers are
    # mapped), and rank 0 takes no part.
    sub_ranks = list(range(1, world))
    sub = dist.new_group(sub_ranks) if world >= 3 else None
    if sub is not None and rank in sub_ranks:
        out["subgroup 1..W-1"] = _representative_cases(sub, rank - 1, world - 1, 400)
    # Size-1 subgroups (every rank must create every group, in the same order) and None: aliases.
    singles = [dist.new_group([r]) for r in range(world)]
    mine = singles[rank]
    out["size-1 subgroup"] = _aliases(mine) + _representative_cases(mine, 0, 1, 500)
    out["None"] = _aliases(None) + _representative_cases(None, 0, 1, 600)
    # gather_halo with padding on a single rank: zero rows, no gradient into them.
    x = torch.randn(3, 2, dtype=F64, requires_grad=True)
    y = gather_halo(x, None, 9, left_padding=2, seq_dim=0)
    up = torch.randn(5, 2, dtype=F64)
    y.backward(up)
    y = y.detach()
    if not (torch.equal(y[:2], torch.zeros(2, 2, dtype=F64)) and torch.equal(y[2:], x.detach())
            and torch.equal(x.grad, up[2:])):
        out["None"].append("gather_halo(None, left_padding=2) differs from the reference")
    return out


def _run_twice(rank: int, world: int) -> list[str]:
    """Two identical calls give bit-identical outputs and gradients (float32 and float64)."""
    errs = []
    counts = [5, 0, 7, 3][:world]
    for dtype in (F32, F64):
        def ragged(x):
            return gather_ragged(x, dist.group.WORLD, counts, dim=1)

        def sequence(x):
            return gather_sequence(x, dist.group.WORLD, seq_dim=2)

        def halo(x):
            return gather_halo(x, dist.group.WORLD, [0, 7, 9, 4][:world], left_padding=1, seq_dim=1)

        cases = [
            ("ragged", ragged, (2, counts[rank], 6)),
            ("sequence", sequence, (2, 6, 4)),
            ("halo", halo, (2, 4, 6)),
        ]
        for name, fn, shape in cases:
            results = []
            for _ in range(2):
                x = _rand(shape, dtype, 7 + rank).requires_grad_()
                y = fn(x)
                up = _rand(y.shape, dtype, 11 + rank)
                # Upstream gradient through a nonlinearity, so float rounding would show.
                (torch.sin(y) * up).sum().backward()
                results.append((y.detach(), x.grad))
            (y1, g1), (y2, g2) = results
            if not (torch.equal(y1, y2) and torch.equal(g1, g2)):
                errs.append(f"{name} {dtype}: two identical calls differ")
    return errs


def _run_chain(rank: int, world: int) -> list[str]:
    """x -> linear -> gather -> tanh -> loss on each rank, against the same chain on the full
    tensor in one process whose loss is the sum of every rank's loss."""
    errs = []
    hid, out_dim = 5, 3
    w0 = _rand((hid, out_dim), F64, 1)
    b0 = _rand((out_dim,), F64, 2)
    for kind in ("sequence", "ragged0", "ragged1", "halo"):
        if kind == "sequence":
            length = 3
            full_shape, d = (2, world * length, hid), 1
            parts = [(r * length, length) for r in range(world)]
        elif kind == "ragged0":
            counts = [4, 0, 6, 1][:world]
            full_shape, d = (sum(counts), hid), 0
            offs = _offsets(counts)
            parts = [(offs[r], counts[r]) for r in range(world)]
        elif kind == "ragged1":
            counts = [1, 5, 0, 3][:world]
            full_shape, d = (2, sum(counts), hid), 1
            offs = _offsets(counts)
            parts = [(offs[r], counts[r]) for r in range(world)]
        else:
            length, halos, left = 2, [0, 3, 5, 1][:world], 1
            full_shape, d = (2, world * length, hid), 1
            parts = [(r * length, length) for r in range(world)]
        x_full = _rand(full_shape, F64, 3)
        coeffs = []  # rank q's loss weights, shaped like rank q's transport output
        for q in range(world):
            if kind == "halo":
                h = min(q * length, halos[q])
                out_shape = _with_dim(full_shape[:-1] + (out_dim,), d, left + h + length)
                coeffs.append(_rand(out_shape, F64, 50 + q))
            else:
                coeffs.append(_rand(full_shape[:-1] + (out_dim,), F64, 50 + q))

        # The CP step on this rank.
        x = x_full.narrow(d, *parts[rank]).clone().requires_grad_()
        w, b = w0.clone().requires_grad_(), b0.clone().requires_grad_()
        h_local = x @ w + b
        if kind == "sequence":
            y = gather_sequence(h_local, dist.group.WORLD, seq_dim=d)
        elif kind.startswith("ragged"):
            y = gather_ragged(h_local, dist.group.WORLD, counts, dim=d)
        else:
            y = gather_halo(h_local, dist.group.WORLD, halos, left_padding=left, seq_dim=d)
        loss = (torch.tanh(y) * coeffs[rank]).sum()
        loss.backward()
        w_grad, b_grad = w.grad.clone(), b.grad.clone()
        dist.all_reduce(w_grad)
        dist.all_reduce(b_grad)

        # The same chain on the full tensor in one process.
        xf, wf, bf = (t.clone().requires_grad_() for t in (x_full, w0, b0))
        hf = xf @ wf + bf
        total = hf.new_zeros(())
        for q in range(world):
            if kind == "halo":
                out_q = _halo_reference(hf, d, length, halos, left, q)
            else:
                out_q = hf
            total = total + (torch.tanh(out_q) * coeffs[q]).sum()
        total.backward()
        ok = (
            _close(x.grad, xf.grad.narrow(d, *parts[rank]))
            and _close(w_grad, wf.grad)
            and _close(b_grad, bf.grad)
        )
        if not ok:
            errs.append(f"chain through {kind}: gradients differ from the single-process chain")
    return errs


def _run_pipelined_reduce_scatter(rank: int, world: int) -> list[str]:
    """The reduce-scatter-v backward through the pipelined point-to-point route (forced by a
    tiny staging cap: pieces of 1, 3 and 7 float64 elements, so ranks need different numbers of
    rounds): gradients equal the reference and, bit for bit, the all-to-all route's."""
    from cpshard.comm import torch_backend as comm

    errs = []
    default_cap = comm.A2A_STAGING_BYTES
    for k, counts in enumerate(_count_sets(world)):
        for shape, dim in (((None, 3), 0), ((2, None, 5), 1)):
            grads = {}
            for piece in (None, 1, 3, 7):
                comm.A2A_STAGING_BYTES = default_cap if piece is None else 2 * world * 8 * piece
                try:
                    tag = _tag(fn="pipelined", W=world, counts=counts, shape=shape, piece=piece)
                    d = dim % len(shape)
                    offs = _offsets(counts)
                    full_shape = _with_dim(shape, d, offs[-1])
                    full = _rand(full_shape, F64, k)
                    x = full.narrow(d, offs[rank], counts[rank]).clone().requires_grad_(True)
                    ups = [_upstream(full_shape, 31 * k + q, "nc") for q in range(world)]
                    gather_ragged(x, _world_group(), counts, dim).backward(ups[rank])
                    ref = sum(g.narrow(d, offs[rank], counts[rank]) for g in ups)
                    if x.grad is None or not _close(x.grad, ref):
                        errs.append(f"{tag}: grad differs from the reference")
                    grads[piece] = x.grad
                finally:
                    comm.A2A_STAGING_BYTES = default_cap
            if any(g is None or not torch.equal(g, grads[None]) for g in grads.values()):
                errs.append(f"{tag}: the pipelined route's grad is not bit-identical to all-to-all's")
    return errs


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", WORLDS)
def test_gather_ragged_matches_reference(pools, world):
    results = pools(world).run(_run_ragged_grid, timeout=120)
    assert all(n == len(_ragged_grid(world)) for n, _ in results)
    assert_no_mismatches([errs for _, errs in results])


@pytest.mark.parametrize("world", WORLDS)
def test_gather_sequence_and_metadata_match_reference(pools, world):
    results = pools(world).run(_run_sequence_grid, timeout=120)
    assert_no_mismatches([errs for _, errs in results])


@pytest.mark.parametrize("world", WORLDS)
def test_gather_halo_matches_reference(pools, world):
    results = pools(world).run(_run_halo_grid, timeout=120)
    assert_no_mismatches([errs for _, errs in results])


@pytest.mark.parametrize("world", [1, 3])
def test_gather_metadata_rejects_requires_grad(pools, world):
    for msgs in pools(world).run(_metadata_rejects_grad, timeout=30):
        for msg in msgs:
            assert "requires grad" in msg and "gather_metadata" in msg


@pytest.mark.parametrize("world", WORLDS)
def test_group_kinds(pools, world):
    results = pools(world).run(_run_group_kinds, timeout=120)
    for rank, by_kind in enumerate(results):
        expected = {"ProcessGroup", "DeviceMesh", "new_group", "size-1 subgroup", "None"}
        if world >= 3 and rank > 0:
            expected.add("subgroup 1..W-1")
        assert set(by_kind) == expected
        errs = [f"rank {rank}, group {kind}: {e}" for kind, es in by_kind.items() for e in es]
        assert not errs, "\n".join(errs[:20])


@pytest.mark.parametrize("world", WORLDS)
def test_pipelined_reduce_scatter_matches_all_to_all(pools, world):
    assert_no_mismatches(pools(world).run(_run_pipelined_reduce_scatter, timeout=120))


@pytest.mark.parametrize("world", WORLDS)
def test_deterministic(pools, world):
    assert_no_mismatches(pools(world).run(_run_twice, timeout=60))


@pytest.mark.parametrize("world", WORLDS)
def test_autograd_chain_matches_single_process(pools, world):
    assert_no_mismatches(pools(world).run(_run_chain, timeout=60))


def test_exported_names():
    names = ("gather_sequence", "gather_metadata", "gather_ragged", "gather_halo",
             "raise_on_any_rank")
    for name in names:
        assert callable(getattr(cpshard, name)) and name in cpshard.__all__
