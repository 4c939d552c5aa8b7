"""A FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over the global positions of a
packed batch, planned on the host block by block.

The mask is evaluated for every (query, key) of a row, a band of query blocks at a time (whole
tensors, bounded memory), and each (query block, key block) is classified empty, partial or
full; per query block, the key ranges its queries reach — maximal runs of non-empty key blocks,
trimmed to the first and last key any of its queries sees — are the rows a planner needs: a
superset of each query's keys, exact once the partial blocks are masked inside.

``mask_mod`` is called once per band with broadcasting index tensors (``b`` ``[B, 1, 1, 1]``,
``h`` ``[1, H, 1, 1]``, ``q_idx`` ``[1, 1, Q, 1]``, ``kv_idx`` ``[1, 1, 1, S]``), as a vmapped
FlexAttention ``mask_mod`` sees them; it must be written with tensor operations. With
``documents``, a query sees only keys of its own document (pad queries see nothing); without,
the mask function says everything itself (it may reach across documents).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

EMPTY, PARTIAL, FULL = 0, 1, 2
_BAND_ELEMENTS = 1 << 24  # (batch x heads x queries x keys) evaluated at once


@dataclass(frozen=True, eq=False)
class MaskModPlan:
    """A mask_mod planned at ``block`` tokens: ``kinds`` ``[B, Q, K]`` int8 (``EMPTY``,
    ``PARTIAL``, ``FULL``: no head sees, some pairs are seen, every head sees every pair of the
    (query block, key block)); the key ranges ``[lo, hi)`` each query block of batch row
    ``row`` reaches (``qblock``), sorted by row, query block and ``lo``."""

    block: int
    kinds: torch.Tensor
    row: torch.Tensor
    qblock: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor


MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def band_rows(rows: int, heads: int, length: int) -> int:
    """How many query positions one evaluation of a mask_mod takes (bounded memory)."""
    return max(1, _BAND_ELEMENTS // max(rows * heads * length, 1))


def evaluate_mask_mod(
    mask_mod: MaskMod,
    rows: int,
    length: int,
    queries: torch.Tensor,
    documents: torch.Tensor | None = None,
    heads: int = 1,
) -> torch.Tensor:
    """``[rows, heads', Q, length]`` bool: which keys the query positions ``queries`` ``[Q]``
    see under ``mask_mod`` (called once with broadcasting index tensors: module doc), and
    under ``documents`` when given; ``heads'`` is 1 when the returned tensor has no head
    extent (the mask is every head's), else ``heads``. Raises ``ValueError`` when it does not
    return a bool tensor that broadcasts to ``[rows, heads, Q, length]`` (e.g. a Python bool)."""
    b = torch.arange(rows).view(rows, 1, 1, 1)
    h = torch.arange(heads).view(1, heads, 1, 1)
    kv = torch.arange(length).view(1, 1, 1, length)
    shape = (rows, heads, queries.numel(), length)
    got = mask_mod(b, h, queries.view(1, 1, -1, 1), kv)
    if not isinstance(got, torch.Tensor) or got.dtype != torch.bool:
        what = f"a {got.dtype} tensor" if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"mask_mod must return a bool tensor of shape {list(shape)}, got {what}")
    try:
        fits = torch.broadcast_shapes(got.shape, shape) == torch.Size(shape)
    except RuntimeError:  # not broadcastable
        fits = False
    if not fits:
        raise ValueError(
            f"mask_mod must return a bool tensor of shape {list(shape)} (or one that "
            f"broadcasts to it), got {list(got.shape)}"
        )
    per_head = got.dim() == 4 and got.shape[1] != 1
    seen = torch.broadcast_to(got, (rows, heads if per_head else 1, *shape[2:]))
    if documents is not None:
        dq = documents[:, queries]
        same = (dq[:, :, None] == documents[:, None, :]) & (dq != 0)[:, :, None]
        seen = seen & same[:, None]
    return seen


def plan_mask_mod(
    mask_mod: MaskMod,
    rows: int,
    length: int,
    documents: torch.Tensor | None = None,
    heads: int = 1,
    block: int = 128,
) -> MaskModPlan:
    """The :class:`MaskModPlan` of ``mask_mod`` over ``rows`` rows of ``length`` positions (and
    ``heads`` heads), combined with ``documents`` ``[rows, length]`` (int64 ids, 0 = pad) when
    given (module doc)."""
    if block < 1 or heads < 1:
        raise ValueError(f"block and heads must be >= 1, got {block} and {heads}")
    if documents is not None and tuple(documents.shape) != (rows, length):
        raise ValueError(
            f"documents must be [{rows}, {length}], got {tuple(documents.shape)}"
        )
    nq = (length + block - 1) // block
    padded = nq * block
    pos = torch.arange(padded)
    band = max(1, band_rows(rows, heads, length) // block)
    parts: list[tuple[torch.Tensor, ...]] = []
    for first in range(0, nq, band):
        q = torch.arange(first * block, min((first + band) * block, length))
        seen = evaluate_mask_mod(mask_mod, rows, length, q, documents, heads)
        blocks = (q.numel() + block - 1) // block
        pad = (0, padded - length, 0, blocks * block - q.numel())
        shape = (rows, blocks, block, nq, block)
        seen_any = torch.nn.functional.pad(seen.any(1), pad, value=False).view(shape)
        seen_all = torch.nn.functional.pad(seen.all(1), pad, value=True).view(shape)
        keys = seen_any.any(2).view(rows, blocks, padded)  # seen by some query of the block
        parts.append((
            seen_any.any(4).any(2),
            seen_all.all(4).all(2),
            torch.where(keys, pos, padded).view(rows, blocks, nq, block).amin(3),
            torch.where(keys, pos, -1).view(rows, blocks, nq, block).amax(3),
        ))  # fmt: skip
    if not parts:  # no positions
        none = torch.zeros(0, dtype=torch.int64)
        return MaskModPlan(block, torch.zeros(rows, 0, 0, dtype=torch.int8), none, none, none, none)
    some, every, first_key, last_key = (torch.cat(t, 1) for t in zip(*parts, strict=True))
    kinds = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)

    # per query block, the runs of non-empty key blocks, trimmed to their first and last seen keys
    before = torch.nn.functional.pad(some, (1, 0), value=False)[..., :-1]
    after = torch.nn.functional.pad(some, (0, 1), value=False)[..., 1:]
    starts = torch.nonzero(some & ~before)
    ends = torch.nonzero(some & ~after)
    row, qblock = starts[:, 0], starts[:, 1]
    lo = first_key[row, qblock, starts[:, 2]]
    hi = last_key[row, qblock, ends[:, 2]] + 1
    return MaskModPlan(block, kinds, row, qblock, lo, hi)

