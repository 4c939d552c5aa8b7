"""Shard layouts: which global token positions each CP rank holds (pure functions, no collectives).

A layout maps the positions ``0 .. P-1`` of a padded sequence of length ``P`` to ranks; every rank
holds its positions **in ascending order**, and every layout gives every rank the same number
``L = P / W`` of positions (of every row), so that un-sharding is one equal all-gather followed by
one index gather with the inverse permutation.

==========================  =====================================================  ============
layout (aliases)            rank r holds                                           P multiple of
==========================  =====================================================  ============
``contiguous``              ``[r L, (r+1) L)``                                     ``W``
(``sequential``)
``head_tail``               chunks of ``P / C`` tokens dealt in a serpentine:      ``C``
(``zigzag``,                chunk ``k`` of pass ``t = k // W`` goes to ``k % W``
``round_robin``)            on even passes, ``W - 1 - k % W`` on odd ones; with
                            the default ``C = 2W``: chunks ``r`` and ``2W-1-r``
``stripe``                  positions ``i`` with ``i % W == r``                    ``W``
``per_document_head_tail``  zig-zag inside every document of a packed row          ``W``
                            (:mod:`cpshard.balance`); data-dependent
``balanced``                documents split so that the per-rank causal cost is    ``W``
                            balanced (:mod:`cpshard.balance`); data-dependent
==========================  =====================================================  ============

The first three are closed-form: :func:`local_token_global_indices` and
:func:`rank_major_inverse` compute them from the sizes alone. The data-dependent ones are
computed from the batch's document ids by :func:`make_layout`, identically on every rank, and
their indices travel in the :class:`ShardLayout`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cpshard import balance
from cpshard.validation import check_int

__all__ = [
    "CLOSED_FORM_LAYOUTS",
    "DATA_DEPENDENT_LAYOUTS",
    "LAYOUTS",
    "LAYOUT_ALIASES",
    "ShardLayout",
    "canonical_layout_name",
    "local_token_global_indices",
    "make_layout",
    "pad_multiple",
    "padded_seq_len",
    "rank_major_inverse",
    "resolve_num_chunks",
    "token_owner",
]

CLOSED_FORM_LAYOUTS = ("contiguous", "head_tail", "stripe")
DATA_DEPENDENT_LAYOUTS = ("per_document_head_tail", "balanced")
LAYOUTS = CLOSED_FORM_LAYOUTS + DATA_DEPENDENT_LAYOUTS
LAYOUT_ALIASES = {"sequential": "contiguous", "zigzag": "head_tail", "round_robin": "head_tail"}
_CHUNKED = ("head_tail", "per_document_head_tail")  # the layouts that take num_chunks

_WHAT = "cpshard.layout"


def canonical_layout_name(name: object, what: str = _WHAT) -> str:
    """The canonical name of a built-in layout (aliases resolved); ValueError for unknown names."""
    if not isinstance(name, str):
        raise TypeError(f"{what}: layout must be a layout name (str), got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    key = LAYOUT_ALIASES.get(key, key)
    if key not in LAYOUTS:
        names = (
            ", ".join(LAYOUTS)
            + " (aliases: "
            + ", ".join(f"{a} = {c}" for a, c in LAYOUT_ALIASES.items())
            + ")"
        )
        raise ValueError(f"{what}: unknown layout {name!r}; choose one of {names}")
    return key


def resolve_num_chunks(
    layout: str, world: int, num_chunks: int | None, what: str = _WHAT
) -> int | None:
    """``num_chunks`` checked for ``layout`` (default ``2W`` where it applies, None elsewhere)."""
    name = canonical_layout_name(layout, what)
    world = check_int(world, "world", what, low=1)
    if name not in _CHUNKED:
        if num_chunks is not None:
            raise ValueError(
                f"{what}: num_chunks applies to {' and '.join(_CHUNKED)} only, not to {name!r}"
            )
        return None
    if num_chunks is None:
        return 2 * world
    num_chunks = check_int(num_chunks, "num_chunks", what, low=1)
    if num_chunks % world:
        raise ValueError(
            f"{what}: num_chunks = {num_chunks} must be a positive multiple of world = {world}"
        )
    return num_chunks


def pad_multiple(layout: str, world: int, num_chunks: int | None = None, rank_multiple: int = 1) -> int:
    """The multiple the sequence is padded to for ``layout``, such that every rank's shard
    length is also a multiple of ``rank_multiple`` (e.g. a model's compression ratio)."""
    name = canonical_layout_name(layout)
    chunks = resolve_num_chunks(name, world, num_chunks)
    rank_multiple = check_int(rank_multiple, "rank_multiple", _WHAT, low=1)
    return math.lcm(chunks if name == "head_tail" else world, world * rank_multiple)


def padded_seq_len(
    seq_len: int, layout: str, world: int, num_chunks: int | None = None, rank_multiple: int = 1
) -> int:
    """``seq_len`` rounded up to :func:`pad_multiple`."""
    seq_len = check_int(seq_len, "seq_len", _WHAT, 0)
    m = pad_multiple(layout, world, num_chunks, rank_multiple)
    return -(-seq_len // m) * m


def _closed_form(
    layout: object, world: int, padded: int, num_chunks: int | None, rank: int | None, what: str
):
    """Validated (name, world, P, C) of a closed-form layout; ``layout`` may be a ShardLayout."""
    if isinstance(layout, ShardLayout):
        if layout.local_token_global_indices is not None or layout.name not in CLOSED_FORM_LAYOUTS:
            raise ValueError(
                f"{what}: layout {layout.name!r} is not closed-form; use its "
                "local_token_global_indices"
            )
        num_chunks = layout.num_chunks if num_chunks is None else num_chunks
        layout = layout.name
    name = canonical_layout_name(layout, what)
    if name not in CLOSED_FORM_LAYOUTS:
        raise ValueError(
            f"{what}: layout {name!r} is data-dependent: its indices come with the ShardLayout "
            "that make_layout / ContextParallelSharder.shard computes from the batch's documents"
        )
    world = check_int(world, "world", what, low=1)
    padded = check_int(padded, "padded_seq_len", what, 0)
    if rank is not None:
        rank = check_int(rank, "rank", what, 0)
        if rank >= world:
            raise ValueError(f"{what}: rank = {rank} is out of range for world = {world}")
    chunks = resolve_num_chunks(name, world, num_chunks, what)
    multiple = chunks if name == "head_tail" else world
    if padded % multiple:
        raise ValueError(
            f"{what}: padded_seq_len = {padded} is not a multiple of {multiple} (layout {name!r}, "
            f"world {world}{f', num_chunks {chunks}' if chunks else ''})"
        )
    return name, world, padded, chunks


def local_token_global_indices(
    layout: str | ShardLayout,
    rank: int,
    world: int,
    padded_seq_len: int,
    *,
    num_chunks: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global positions (int64, ascending) that ``rank`` holds under a closed-form layout.

    ``layout`` is a layout name (``contiguous``, ``head_tail``/``zigzag``/``round_robin``,
    ``stripe``) or a closed-form :class:`ShardLayout`. Data-dependent layouts raise: their
    indices are in their ShardLayout (:meth:`ShardLayout.indices`)."""
    what = "cpshard.local_token_global_indices"
    name, world, padded, chunks = _closed_form(
        layout, world, padded_seq_len, num_chunks, rank, what
    )
    length = padded // world
    if name == "contiguous":
        return torch.arange(rank * length, (rank + 1) * length, device=device)
    if name == "stripe":
        return torch.arange(length, device=device) * world + rank
    size = padded // chunks
    passes = torch.arange(chunks // world, device=device)
    chunk = passes * world + torch.where(passes % 2 == 0, rank, world - 1 - rank)
    return (chunk[:, None] * size + torch.arange(size, device=device)).reshape(-1)


def rank_major_inverse(
    layout: str | ShardLayout,
    world: int,
    padded_seq_len: int,
    *,
    num_chunks: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``inv`` ``[P]``: where global position ``p`` sits in the rank-major concatenation of all
    ranks' local shards (rank 0's ``L`` tokens, then rank 1's, ...), in closed form; so
    ``full = gathered[inv]``."""
    what = "cpshard.rank_major_inverse"
    name, world, padded, chunks = _closed_form(
        layout, world, padded_seq_len, num_chunks, None, what
    )
    p = torch.arange(padded, device=device)
    length = padded // world
    if name == "contiguous" or padded == 0:
        return p
    if name == "stripe":
        return (p % world) * length + p // world
    size = padded // chunks
    k, offset = p // size, p % size
    t, i = k // world, k % world
    rank = torch.where(t % 2 == 0, i, world - 1 - i)
    return rank * length + t * size + offset


def token_owner(
    layout: str | ShardLayout,
    world: int,
    padded_seq_len: int,
    *,
    num_chunks: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``[P]``: the rank that holds each global position under a closed-form layout."""
    inv = rank_major_inverse(layout, world, padded_seq_len, num_chunks=num_chunks, device=device)
    return inv // max(1, inv.numel() // world)


# ---------------------------------------------------------------------------------- ShardLayout


Indices = torch.Tensor | tuple[torch.Tensor, ...]


@dataclass(frozen=True, eq=False)
class ShardLayout:
    """How a batch was sharded, so that token-aligned tensors can follow it.

    Attributes:
        name: the layout's name (a built-in layout or any name a custom ``shard_batch`` reports).
        world_size: the CP world size it was computed for.
        original_seq_len: the sequence length of the caller's tensors before padding (for a flat
            THD stream, the stream's length ``B * S``; with a position map, ``S_in``).
        padded_seq_len: ``P``, the length the ranks' shards partition.
        local_token_global_indices: ``None`` for closed-form layouts; otherwise every rank's
            global positions, ascending: ``[W, L]`` (the same for every row), ``[W, B, L]``
            (per row), or a tuple of ``W`` 1-D tensors when ranks hold different counts.
        input_row_shape: ``(B, S)`` of the caller's rows when they were flattened into one
            stream (THD) before padding; the model's tensors are then ``[1, T]`` streams.
        position_map: ``[B, S_in]`` or ``[S_in]`` int64: the padded position of every input
            position (``-1``: the token was dropped) for layouts that reposition rows.
        num_chunks: the chunk count of ``head_tail`` / ``per_document_head_tail``.
    """

    name: str
    world_size: int
    original_seq_len: int
    padded_seq_len: int
    local_token_global_indices: Indices | None = None
    input_row_shape: tuple[int, int] | None = None
    position_map: torch.Tensor | None = None
    num_chunks: int | None = None

    def __post_init__(self) -> None:
        what = "cpshard.ShardLayout"
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{what}: name must be a non-empty str, got {self.name!r}")
        world = check_int(self.world_size, "world_size", what, low=1)
        original = check_int(self.original_seq_len, "original_seq_len", what, 0)
        padded = check_int(self.padded_seq_len, "padded_seq_len", what, 0)
        if self.num_chunks is not None:
            check_int(self.num_chunks, "num_chunks", what, low=1)
        if self.input_row_shape is not None and self.position_map is not None:
            raise ValueError(f"{what}: give input_row_shape (THD) or position_map, not both")
        if self.input_row_shape is not None:
            shape = self.input_row_shape
            if not isinstance(shape, Sequence) or len(shape) != 2:
                raise ValueError(f"{what}: input_row_shape must be (B, S), got {shape!r}")
            rows, cols = (check_int(v, "input_row_shape", what, 0) for v in shape)
            object.__setattr__(self, "input_row_shape", (rows, cols))
            if rows * cols != original:
                raise ValueError(
                    f"{what}: input_row_shape {(rows, cols)} flattens to {rows * cols} tokens but "
                    f"original_seq_len = {original}"
                )
        if self.position_map is not None:
            self._check_position_map(what, original, padded)
        elif original > padded:
            raise ValueError(
                f"{what}: original_seq_len = {original} exceeds padded_seq_len = {padded}"
            )
        idx = self.local_token_global_indices
        if idx is None:
            if self.name in CLOSED_FORM_LAYOUTS:
                _closed_form(self.name, world, padded, self.num_chunks, None, what)
            return
        if isinstance(idx, torch.Tensor):
            self._check_equal_indices(idx, what, world, padded)
        elif isinstance(idx, Sequence) and not isinstance(idx, str):
            self._check_ragged_indices(tuple(idx), what, world, padded)
        else:
            raise TypeError(
                f"{what}: local_token_global_indices must be a tensor, a tuple of tensors or None"
            )

    def _check_position_map(self, what: str, original: int, padded: int) -> None:
        pm = self.position_map
        if (
            not isinstance(pm, torch.Tensor)
            or pm.dtype not in (torch.int64, torch.int32)
            or pm.dim() not in (1, 2)
        ):
            raise TypeError(f"{what}: position_map must be an int64 tensor [B, S_in] or [S_in]")
        if pm.shape[-1] != original:
            raise ValueError(
                f"{what}: position_map has {pm.shape[-1]} input positions but original_seq_len = "
                f"{original}"
            )
        pm = pm.detach().to("cpu", torch.int64)
        rows = pm.reshape(-1, original) if pm.dim() == 2 else pm.reshape(1, -1)
        if rows.numel() and (int(rows.min()) < -1 or int(rows.max()) >= padded):
            raise ValueError(
                f"{what}: position_map values must lie in [-1, padded_seq_len = {padded})"
            )
        for r, row in enumerate(rows):
            kept = row[row >= 0]
            if kept.numel() != torch.unique(kept).numel():
                raise ValueError(
                    f"{what}: position_map row {r} maps two input positions to one padded position"
                )
        object.__setattr__(self, "position_map", self.position_map.to(torch.int64))

    def _check_equal_indices(self, idx: torch.Tensor, what: str, world: int, padded: int) -> None:
        if (
            idx.dtype not in (torch.int64, torch.int32)
            or idx.dim() not in (2, 3)
            or idx.shape[0] != world
        ):
            raise ValueError(
                f"{what}: local_token_global_indices must be an integer tensor [W, L] or [W, B, "
                f"L] with W = world_size = {world}, got {idx.dtype} {tuple(idx.shape)}"
            )
        if idx.shape[-1] * world != padded:
            raise ValueError(
                f"{what}: local_token_global_indices hold {idx.shape[-1]} positions per rank, but "
                f"padded_seq_len / world_size = {padded} / {world}"
            )
        idx = idx.detach().to(torch.int64)
        rows = idx.reshape(world, 1, -1) if idx.dim() == 2 else idx
        _check_partition(rows.permute(1, 0, 2).reshape(rows.shape[1], -1), padded, what)
        object.__setattr__(self, "local_token_global_indices", idx)

    def _check_ragged_indices(self, idx: tuple, what: str, world: int, padded: int) -> None:
        if len(idx) != world or not all(
            isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype in (torch.int64, torch.int32)
            for t in idx
        ):
            raise ValueError(
                f"{what}: local_token_global_indices must hold {world} 1-D integer tensors, one "
                "per rank"
            )
        idx = tuple(t.detach().to(torch.int64) for t in idx)
        _check_partition(torch.cat([t.cpu() for t in idx]).reshape(1, -1), padded, what)
        object.__setattr__(self, "local_token_global_indices", idx)

    # -- queries ---------------------------------------------------------------------------

    @property
    def closed_form(self) -> bool:
        """True when the partition follows from the sizes alone (no indices carried)."""
        return self.local_token_global_indices is None and self.name in CLOSED_FORM_LAYOUTS

    @property
    def counts(self) -> list[int]:
        """Tokens (per row) every rank holds."""
        idx = self.local_token_global_indices
        if isinstance(idx, tuple):
            return [t.numel() for t in idx]
        return [self.padded_seq_len // self.world_size] * self.world_size

    @property
    def per_row(self) -> bool:
        """True when the partition differs between batch rows (indices ``[W, B, L]``, B > 1)."""
        idx = self.local_token_global_indices
        return isinstance(idx, torch.Tensor) and idx.dim() == 3 and idx.shape[1] > 1

    def indices(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``rank``'s global positions: ``[L]``, or ``[B, L]`` for a per-row layout."""
        what = "cpshard.ShardLayout.indices"
        rank = check_int(rank, "rank", what, 0)
        if rank >= self.world_size:
            raise ValueError(
                f"{what}: rank = {rank} is out of range for world_size = {self.world_size}"
            )
        idx = self.local_token_global_indices
        if idx is None:
            return local_token_global_indices(
                self.name,
                rank,
                self.world_size,
                self.padded_seq_len,
                num_chunks=self.num_chunks,
                device=device,
            )
        out = idx[rank]
        if out.dim() == 2 and out.shape[0] == 1:
            out = out[0]
        return out.to(device) if device is not None else out

    def rank_major_inverse(self, device: torch.device | str | None = None) -> torch.Tensor:
        """``[P]`` (or ``[B, P]`` per row): each global position's slot in the rank-major
        concatenation of the ranks' shards. Computed locally (closed form or from the carried
        indices): no communication."""
        idx = self.local_token_global_indices
        if idx is None:
            return rank_major_inverse(
                self.name,
                self.world_size,
                self.padded_seq_len,
                num_chunks=self.num_chunks,
                device=device,
            )
        if isinstance(idx, tuple):
            flat = torch.cat([t.to(idx[0].device) for t in idx])
        elif idx.dim() == 2:  # [W, L] -> [W*L]
            flat = idx.reshape(-1)
        else:  # [W, B, L] -> [B, W*L]
            flat = idx.permute(1, 0, 2).reshape(idx.shape[1], -1)
            if flat.shape[0] == 1:
                flat = flat[0]
        flat = flat.to(device) if device is not None else flat
        inv = torch.empty_like(flat)
        src = torch.arange(flat.shape[-1], device=flat.device).expand_as(flat)
        return inv.scatter_(-1, flat, src)


def _check_partition(rows: torch.Tensor, padded: int, what: str) -> None:
    """Every row of ``rows`` [R, P] must be a permutation of 0..P-1."""
    rows = rows.cpu()
    if rows.numel() == 0:
        if padded != 0:
            raise ValueError(
                f"{what}: local_token_global_indices are empty but padded_seq_len = {padded}"
            )
        return
    if rows.shape[1] != padded or int(rows.min()) < 0 or int(rows.max()) >= padded:
        raise ValueError(
            f"{what}: local_token_global_indices must lie in [0, padded_seq_len = {padded})"
        )
    seen = torch.zeros(rows.shape[0], padded, dtype=torch.int64).scatter_add_(
        1, rows, torch.ones_like(rows)
    )
    if not bool((seen == 1).all()):
        raise ValueError(
            f"{what}: local_token_global_indices must hold every position 0..{padded - 1} of "
            "every row exactly once"
        )


def make_layout(
    layout: str,
    world: int,
    seq_len: int,
    *,
    doc_ids: torch.Tensor | None = None,
    num_chunks: int | None = None,
    tolerance: float = 0.02,
    rank_multiple: int = 1,
) -> ShardLayout:
    """The :class:`ShardLayout` of a built-in layout for sequences of ``seq_len`` tokens.

    Closed-form layouts need only the sizes. Data-dependent ones need ``doc_ids`` ``[B, S]``
    (0 = padding, a document = a maximal run of one non-zero id); their per-row indices
    ``[W, B, L]`` are planned here, identically on every rank that passes the same ids.
    ``rank_multiple``: pad further so that every rank's shard length is a multiple of it."""
    what = "cpshard.make_layout"
    name = canonical_layout_name(layout, what)
    world = check_int(world, "world", what, low=1)
    seq_len = check_int(seq_len, "seq_len", what, 0)
    chunks = resolve_num_chunks(name, world, num_chunks, what)
    padded = padded_seq_len(seq_len, name, world, num_chunks, rank_multiple)
    if name in CLOSED_FORM_LAYOUTS:
        return ShardLayout(name, world, seq_len, padded, num_chunks=chunks)
    if not isinstance(doc_ids, torch.Tensor) or doc_ids.dim() != 2 or doc_ids.shape[1] != seq_len:
        got = tuple(doc_ids.shape) if isinstance(doc_ids, torch.Tensor) else type(doc_ids).__name__
        raise ValueError(
            f"{what}: layout {name!r} is data-dependent and needs doc_ids [B, {seq_len}], got {got}"
        )
    ids = doc_ids.detach().to("cpu", torch.int64)
    ids = torch.cat([ids, ids.new_zeros(ids.shape[0], padded - seq_len)], dim=1)
    if name == "per_document_head_tail":
        owner = balance.plan_per_document_head_tail(ids, world, chunks)
    else:
        owner = balance.plan_balanced(ids, world, tolerance)
    indices = balance.owner_to_indices(owner, world)
    return ShardLayout(name, world, seq_len, padded, indices, num_chunks=chunks)
