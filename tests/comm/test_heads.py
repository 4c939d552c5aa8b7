"""The sequence <-> head all-to-alls against the same movement done on the full tensors in one
process: uneven, empty and overlapping head ranges (the loop over ranks), regular ones (the
strided passes: tiling, GQA replicas), several parts of different widths, no order or a global
order (one for every row, or per row), in one all-to-all or in rounds, forward and float64
backward, W = 1-4."""

from __future__ import annotations

import pytest
import torch

from cpshard.comm import heads
from cpshard.comm.heads import ROUND_BYTES, heads_to_seq, seq_to_heads

B, L = 2, 3


def _ranges(world: int, heads: int, overlap: bool) -> list[tuple[int, int]]:
    """Per rank (first head, count): uneven and possibly empty, or (``overlap``) sharing heads."""
    if overlap:  # every rank one head, ranks share them (GQA replicas)
        return [(r * heads // world, 1) for r in range(world)]
    cuts = [r * heads // world for r in range(world + 1)]
    return [(cuts[r], cuts[r + 1] - cuts[r]) for r in range(world)]


def _inputs(world: int, parts: list[tuple[int, int]], rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s parts ``[B, heads, L, width]`` (the same on every rank for a rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(B, h, L, d, dtype=torch.float64, generator=g) for h, d in parts]


def _order(world: int, per_row: bool) -> torch.Tensor | None:
    g = torch.Generator().manual_seed(7)
    if per_row:
        return torch.stack([torch.randperm(world * L, generator=g) for _ in range(B)])
    return torch.randperm(world * L, generator=g)


def _reference(
    full: list[torch.Tensor], ranges: list[list[tuple[int, int]]], order, rank: int
) -> list[torch.Tensor]:
    """``full`` parts ``[B, H, W * L, D]`` (rank-major tokens) -> ``rank``'s heads, reordered."""
    outs = []
    for x, part in zip(full, ranges):
        s, c = part[rank]
        y = x[:, s : s + c]
        if order is not None:
            index = order if order.dim() == 2 else order.expand(B, -1)
            y = torch.stack([y[b][:, index[b]] for b in range(B)])
        outs.append(y)
    return outs


CASES = [  # (parts as (heads, width), overlap, order)
    ([(4, 3)], False, None),
    ([(5, 2), (3, 4)], False, "shared"),
    ([(3, 2), (1, 5)], True, "per_row"),
    ([(6, 1), (2, 2)], False, "per_row"),
    ([(4, 3), (1, 5)], True, "shared"),
    ([(8, 2), (4, 3)], False, None),
]


def _distributed(rank: int, world: int, rounds: bool) -> list[tuple]:
    """Every case's outputs and gradients on this rank; ``rounds``: every call in rounds (each a
    chunk of one part's heads), else in one all-to-all (the tensors are small)."""
    try:
        if rounds:
            heads.ROUND_BYTES = 1
        return _cases(rank, world)
    finally:
        heads.ROUND_BYTES = ROUND_BYTES


def _cases(rank: int, world: int) -> list[tuple]:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    results = []
    for parts, overlap, order_kind in CASES:
        ranges = [_ranges(world, h, overlap and i > 0) for i, (h, _) in enumerate(parts)]
        flat = [v for part in ranges for rng in part for v in rng]
        order = None if order_kind is None else _order(world, order_kind == "per_row")
        xs = [x.requires_grad_() for x in _inputs(world, parts, rank)]
        ys = seq_to_heads(xs, name, flat, order, 5)
        weights = [torch.randn_like(y) for y in ys]
        sum(((y * w).sum() for y, w in zip(ys, weights)), torch.zeros(())).backward()
        # the adjoint: heads back to tokens (overlapping heads summed), and its backward
        hs = [y.detach().clone().requires_grad_() for y in ys]
        back = heads_to_seq(hs, name, flat, order, 6)
        sum((b.square().sum() for b in back), torch.zeros(())).backward()
        results.append(([y.detach() for y in ys], [x.grad for x in xs], weights,
                        [b.detach() for b in back], [h.grad for h in hs]))  # fmt: skip
    return results


@pytest.mark.parametrize("rounds", [False, True], ids=["one", "rounds"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_seq_heads_all_to_alls_match_the_full_tensors(pools, world: int, rounds: bool) -> None:
    got = pools(world).run(_distributed, rounds, timeout=300)
    for at, (parts, overlap, order_kind) in enumerate(CASES):
        ranges = [_ranges(world, h, overlap and i > 0) for i, (h, _) in enumerate(parts)]
        order = None if order_kind is None else _order(world, order_kind == "per_row")
        full = [
            torch.cat([_inputs(world, parts, r)[i] for r in range(world)], dim=2).requires_grad_()
            for i in range(len(parts))
        ]
        where = f"W={world} case {at}"
        refs = [_reference(full, ranges, order, r) for r in range(world)]
        for r in range(world):
            for y, want in zip(got[r][at][0], refs[r]):
                torch.testing.assert_close(y, want, rtol=0, atol=0, msg=f"{where} rank {r}")
        loss = sum((y * w).sum() for r in range(world) for y, w in zip(refs[r], got[r][at][2]))
        grads = torch.autograd.grad(loss, full)
        for r in range(world):
            for i, g in enumerate(grads):
                want = g[:, :, r * L : (r + 1) * L]
                torch.testing.assert_close(
                    got[r][at][1][i], want, rtol=0, atol=1e-12, msg=f"{where} grad rank {r}"
                )
        # heads_to_seq is the adjoint: <seq_to_heads(x), h> == <x, heads_to_seq(h)> summed
        # over ranks, with h the outputs themselves; its backward is seq_to_heads again
        outs = [got[r][at][0] for r in range(world)]
        backs = [got[r][at][3] for r in range(world)]
        inputs = [_inputs(world, parts, r) for r in range(world)]
        left = sum(float((y * y).sum()) for r in range(world) for y in outs[r])
        right = sum(float((x * b).sum()) for r in range(world) for x, b in zip(inputs[r], backs[r]))
        assert abs(left - right) <= 1e-9 * max(1.0, abs(left)), (where, left, right)
        for r in range(world):  # d/dh |heads_to_seq(h)|^2 = 2 seq_to_heads(heads_to_seq(h))
            again = _reference(
                [torch.cat([backs[q][i] for q in range(world)], 2) for i in range(len(parts))],
                ranges,
                order,
                r,
            )
            for g, want in zip(got[r][at][4], again):
                torch.testing.assert_close(g, 2 * want, rtol=0, atol=1e-12, msg=f"{where} adj")


def _opcheck(rank: int, world: int) -> None:
    import torch.distributed as dist

    name = dist.group.WORLD.group_name
    parts = [(3, 2), (1, 4)]
    ranges = [_ranges(world, 3, False), _ranges(world, 1, True)]
    flat = [v for part in ranges for rng in part for v in rng]
    xs = [x.requires_grad_() for x in _inputs(world, parts, rank)]
    order = _order(world, False)
    torch.library.opcheck(seq_to_heads, (xs, name, flat, order, 3))
    hs = [y.detach().requires_grad_() for y in seq_to_heads(xs, name, flat, order, 3)]
    torch.library.opcheck(heads_to_seq, (hs, name, flat, order, 4))


def test_opcheck(pool2) -> None:
    """Schemas, fake kernels and autograd registrations of both all-to-alls."""
    pool2.run(_opcheck, timeout=300)
