"""How a step's spans are attended: ONE launch of a varlen kernel over every span of a kind
packed back to back where a flash kernel serves the queries, the explicit varlen kernel in
chunks of many spans where none does (:class:`Varlen` either way), else a loop over spans
(:class:`Loop`: a step with no packing). A mask description's state may mix kinds (causal,
windows, every key visible: a launch each) with pieces whose queries see per-query key ranges,
which the loop attends next to the launches (:class:`Together`).

The loop splits a span whose document starts before the run into a non-causal prefix part and
a causal square part, merged by their log-sum-exp (flash-attention's decomposition), so no
``[L, S]`` mask is ever built; a long span goes in tiles of its queries (at most
:data:`TILES`, each of at least :data:`TILE_ROWS`), the prefix of each in pieces alike, each
part merged into the output as it comes, so the loop holds one tile's results and gradients
at a time; runs of a few tokens (``stripe`` gives single-token runs) go in
blocks of one document, one masked call each, and so do the tiles of a run a sliding window
cuts (:mod:`cpshard.attention.blocks`). Each span packs
its document's prefix, so a step whose packing would exceed ``PACKED_KEYS_PER_ROW`` key rows per
buffer row (many short runs per document) has no packing and runs the loop.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cpshard.attention.blocks import Block, Blocks
from cpshard.attention.choice import capped_varlen_kernel, math_varlen, part_kernel, varlen_kernel
from cpshard.attention.kernels import (
    Grads,
    Part,
    T,
    Tensors,
    VarlenKernel,
    fold_heads,
    lse_dtype,
    repeat_heads,
)
from cpshard.attention.packing import Packing
from cpshard.attention.state import AttentionState
from cpshard.planning.spans import Span

TILES = 16  # the most tiles a long span's queries (and the keys before its square) go in
TILE_ROWS = 128  # the fewest queries (keys) of a tile: shorter spans go whole


def _parts(
    item: Span | Block, causal: bool, blocks: Blocks, dtype: torch.dtype, key_step: int
) -> list[Part]:
    """Key ranges (of the row's key buffer) of a span or block, and which keys its queries see:
    a span's keys before its causal square in pieces of at most ``key_step``."""
    if isinstance(item, Block):
        return [(slice(item.k, item.k + item.width), blocks.mask(item, dtype))]
    parts: list[Part] = [
        (slice(lo, min(lo + key_step, item.split)), False)
        for lo in range(item.k, item.split, key_step)
    ]
    if causal:
        parts.append((slice(item.split, item.split + item.n), True))
    return parts


def _step(rows: int) -> int:
    """The rows of a tile of ``rows`` queries or keys: at most :data:`TILES` tiles, each of at
    least :data:`TILE_ROWS` rows."""
    return max(TILE_ROWS, -(-rows // TILES))


def _tiles(span: Span, causal: bool) -> Iterator[Span]:
    """A span as consecutive pieces of its queries, each a span of its own (a causal piece's
    square starts at its first query's key)."""
    step = _step(span.n)
    for at in range(0, span.n, step):
        split = span.split + at if causal else span.split
        yield span._replace(q=span.q + at, n=min(step, span.n - at), split=split)


class Loop:
    """The per-span loop: each long span's parts and each block of short spans
    (:mod:`cpshard.attention.blocks`) through the part kernel, parts merged by LSE. A long
    span goes in tiles (:func:`_tiles`, its keys before the causal square in pieces too), so a
    part's results and gradients (and the kernel's own copies) are a tile's, not a span's: the
    call holds its output, the key buffer and their gradients plus one tile's."""

    def __init__(self, blocks: Blocks, q: torch.Tensor, softcap: float | None) -> None:
        self.kern, self.heads = part_kernel(q, softcap), q.shape[1]
        self.blocks, self.dtype = blocks, q.dtype
        self.name = self.kern.name

    def _items(self) -> Iterator[tuple[tuple[slice, ...], list[Part]]]:
        """Each tile of a span and each block: its query rows' index into ``[B, H, L, ...]``
        and its parts."""
        for it, causal in zip(self.blocks.items, self.blocks.causal, strict=True):
            if isinstance(it, Block):
                pieces: Iterator[Span | Block] = iter((it,))
                key_step = 0
            else:
                pieces, key_step = _tiles(it, causal), _step(it.split - it.k + it.n)
            for piece in pieces:
                rows = (slice(it.row, it.row + 1), slice(None), slice(piece.q, piece.q + piece.n))
                yield rows, _parts(piece, causal, self.blocks, self.dtype, key_step)

    def _keys(self, t: T, at: tuple[slice, slice, slice]) -> T:
        """A part's keys or values as the kernel takes them: a view for a kernel with GQA and
        strides of its own, else KV heads repeated for the queries' heads, per part, so the
        repeat never holds the whole key buffer."""
        if self.kern.grouped:
            return t[at]
        return repeat_heads(t[at], self.heads).contiguous()

    def _whole(self, q: T) -> Part | None:
        """The one part when the step's only item is every query of a one-row batch over one key
        range (a single document, as head-parallel attention attends it): the kernel then takes
        the whole tensors, with no zero-filled results to add its own into."""
        items = self.blocks.items
        if q.shape[0] != 1 or len(items) != 1 or isinstance(items[0], Block):
            return None
        span = items[0]
        if span.q != 0 or span.n != q.shape[2]:
            return None
        parts = _parts(span, self.blocks.causal[0], self.blocks, self.dtype, max(span.split, 1))
        return parts[0] if len(parts) == 1 else None

    def forward(self, q: T, k: T, v: T, scale: float | None) -> Tensors:
        whole = self._whole(q)
        if whole is not None:
            at = (slice(None), slice(None), whole[0])
            out, lse = self.kern.forward(q, self._keys(k, at), self._keys(v, at), whole[1], scale)
            return out, lse.to(lse_dtype(q.dtype))
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=lse_dtype(q.dtype))
        for rows, parts in self._items():
            qs = q[rows]
            for i, (keys, how) in enumerate(parts):
                at = (rows[0], slice(None), keys)
                o, part_lse = self.kern.forward(
                    qs, self._keys(k, at), self._keys(v, at), how, scale
                )
                if i == 0:
                    out[rows], lse[rows] = o, part_lse
                else:
                    merge_part(out[rows], lse[rows], o, part_lse.to(lse.dtype))
                del o, part_lse  # one part's results held at a time
        return out, lse

    def backward(self, grad: T, q: T, k: T, v: T, out: T, lse: T, scale: float | None) -> Grads:
        kv_heads = k.shape[1]
        whole = self._whole(q)
        if whole is not None and whole[0] == slice(0, k.shape[2]):
            at = (slice(None), slice(None), whole[0])
            dq, dk, dv = self.kern.backward(
                grad, q, self._keys(k, at), self._keys(v, at), out, lse, whole[1], scale
            )
            return dq, fold_heads(dk, kv_heads), fold_heads(dv, kv_heads)
        dq = torch.zeros_like(q)
        dk, dv = gradient_zeros(k, v)
        for rows, parts in self._items():
            # the tile's views, its output gradient laid out token-major once (the CPU flash
            # kernels' layout, which they would otherwise copy for every part)
            g, qs, os_, ls = token_major(grad[rows]), q[rows], out[rows], lse[rows]
            for keys, how in parts:
                at = (rows[0], slice(None), keys)
                dqs, dks, dvs = self.kern.backward(
                    g, qs, self._keys(k, at), self._keys(v, at), os_, ls, how, scale
                )
                dq[rows] += dqs
                dk[at] += fold_heads(dks, kv_heads)
                dv[at] += fold_heads(dvs, kv_heads)
                del dqs, dks, dvs  # freed before the next part's are made
            del g, qs, os_, ls
        return dq, dk, dv


def token_major(t: T) -> T:
    """``[B, H, N, D]`` ``t`` copied to a token-major layout (``[B, N, H, D]`` in memory)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def merge_part(out: T, lse: T, o: T, part_lse: T) -> None:
    """Adds one more key part's output ``o`` and log-sum-exp to ``out`` and ``lse`` (the parts
    so far), in place: each weighed by its share of the joint softmax (flash-attention's
    merge, one part at a time, so only one part's results are held); ``o`` is overwritten."""
    total = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1).to(out.dtype))
    out.add_(o.mul_(torch.exp(part_lse - total).unsqueeze(-1).to(o.dtype)))
    lse.copy_(total)


def _halves_of(a: T, b: T) -> T | None:
    """The contiguous tensor whose last dim is ``a`` then ``b`` where they are exactly its two
    halves (views), else None."""
    base = a._base
    if (
        base is None
        or b._base is not base
        or not base.is_contiguous()
        or not a.shape[:-1] == b.shape[:-1] == base.shape[:-1]
        or a.shape[-1] + b.shape[-1] != base.shape[-1]
    ):
        return None
    ends = (a.data_ptr() - base.data_ptr(), b.data_ptr() - base.data_ptr())
    return base if ends == (0, a.shape[-1] * a.element_size()) else None


def gradient_zeros(k: T, v: T) -> tuple[T, T]:
    """Zeros for the gradients of ``k`` and ``v`` laid out as they are: the two halves of one
    tensor where they are (the exchange's key buffer), so that the buffer's gradient goes back
    joined with no copy (:func:`joined`)."""
    if _halves_of(k, v) is None:
        return torch.zeros_like(k), torch.zeros_like(v)
    both = k.new_zeros(*k.shape[:3], k.shape[3] + v.shape[3])
    return both[..., : k.shape[3]], both[..., k.shape[3] :]


def joined(a: T, b: T) -> T:
    """``torch.cat([a, b], -1)``: the tensor whose halves they are where they are exactly that
    (:func:`gradient_zeros`), else a copy."""
    base = _halves_of(a, b)
    return torch.cat([a, b], dim=-1) if base is None else base


# ------------------------------------------------------------------ the varlen path


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` -> ``[B * N, H, D]``."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _unflat(flat: torch.Tensor, b: int) -> torch.Tensor:
    """``[B * N, H, D]`` -> ``[B, H, N, D]``."""
    return flat.view(b, -1, *flat.shape[1:]).transpose(1, 2)


def _scatter(rows: torch.Tensor, packed: torch.Tensor, n: int, add: bool = False) -> torch.Tensor:
    """``[n, ...]`` zeros with ``packed`` at ``rows``: copied (distinct rows: deterministic, no
    atomics), or added where rows repeat (``add``)."""
    out = packed.new_zeros(n, *packed.shape[1:])
    return out.index_add(0, rows, packed) if add else out.index_copy(0, rows, packed)


class Varlen:
    """Every span of the packings in one launch of a varlen kernel each (one packing per kind of
    span: causal, with a window, or every key visible): segment queries and their keys packed
    as ``[tokens, heads, D]`` (GQA left to the kernel), results put back. Each query belongs to
    one span of one packing, so their outputs land on distinct rows."""

    def __init__(self, kern: VarlenKernel, packings: tuple[Packing, ...]) -> None:
        self.kern, self.packings = kern, packings
        self.name = kern.name

    @staticmethod
    def _packed(p: Packing, q: T, k: T, v: T) -> tuple[T, T, T]:
        return (
            _flat(q).index_select(0, p.q_rows),
            _flat(k).index_select(0, p.k_rows),
            _flat(v).index_select(0, p.k_rows),
        )

    def forward(self, q: T, k: T, v: T, scale: float | None) -> Tensors:
        b, heads, length, _ = q.shape
        out: T | None = None
        full_lse: T | None = None
        for p in self.packings:
            part, lse = self.kern.forward(*self._packed(p, q, k, v), p, scale)
            if out is None or full_lse is None:
                out = _scatter(p.q_rows, part, b * length)
                full_lse = lse.new_full((b * length, heads), float("-inf"))
            else:
                out.index_copy_(0, p.q_rows, part)
            full_lse.index_copy_(0, p.q_rows, lse.t())
        assert out is not None and full_lse is not None, "a varlen path has a packing"
        return _unflat(out, b), full_lse.view(b, length, heads).transpose(1, 2)

    def backward(self, grad: T, q: T, k: T, v: T, out: T, lse: T, scale: float | None) -> Grads:
        b, heads, length, _ = q.shape
        ext = b * k.shape[2]  # copies where each key row serves one span (the contiguous split)
        total: list[T] = []
        for p in self.packings:
            packed_lse = (
                lse.transpose(1, 2).reshape(-1, heads).index_select(0, p.q_rows).t().contiguous()
            )
            dq, dk, dv = self.kern.backward(
                _flat(grad).index_select(0, p.q_rows), *self._packed(p, q, k, v),
                _flat(out).index_select(0, p.q_rows), packed_lse, p, scale,
            )  # fmt: skip
            grads = (
                _scatter(p.q_rows, dq, b * length),
                _scatter(p.k_rows, dk, ext, p.shared_keys),
                _scatter(p.k_rows, dv, ext, p.shared_keys),
            )
            total = list(grads) if not total else [a + g for a, g in zip(total, grads, strict=True)]
        dq, dk, dv = (_unflat(t, b) for t in total)
        return dq, dk, dv


class Together:
    """The varlen path for the spans it can state and the loop for the rest (a mask
    description's pieces whose queries see per-query key ranges): each query is in one of the
    two, so the outputs add up (zeros elsewhere), the log-sum-exps take the larger (-inf
    elsewhere), and the gradients add up."""

    def __init__(self, varlen: Varlen, loop: Loop) -> None:
        self.varlen, self.loop = varlen, loop
        self.name = f"{varlen.name} + {loop.name}"

    def forward(self, q: T, k: T, v: T, scale: float | None) -> Tensors:
        out, lse = self.varlen.forward(q, k, v, scale)
        rest_out, rest_lse = self.loop.forward(q, k, v, scale)
        return out + rest_out, torch.maximum(lse, rest_lse)

    def backward(self, grad: T, q: T, k: T, v: T, out: T, lse: T, scale: float | None) -> Grads:
        grads = self.varlen.backward(grad, q, k, v, out, lse, scale)
        rest = self.loop.backward(grad, q, k, v, out, lse, scale)
        dq, dk, dv = (a + r for a, r in zip(grads, rest, strict=True))
        return dq, dk, dv


# The kernel the latest call of this process ran (:func:`attention_kernel`): a name kept on the
# host when the call picks its kernel, so reading it syncs nothing.
_latest_kernel: str | None = None


def attention_kernel() -> str | None:
    """Which kernel the latest CP attention call of this process ran, forward or backward
    (``"fa3_varlen"``, ``"torch_flash_varlen"``, ``"flash_attn_varlen"``, ``"math_varlen"``,
    ``"cpu_flash"``, ``"fa3_part"``, ``"math_part"``; the varlen kernel and the loop's joined
    by ``" + "`` where a step needs both), or None before any call."""
    return _latest_kernel


def implementation(
    state: AttentionState, q: torch.Tensor, d: int, softcap: float | None
) -> Loop | Varlen | Together:
    """The varlen path where the rank has spans and the step a packing: one launch of a flash
    kernel per kind of span that serves q with head dim ``d`` (soft-capped logits: one that
    takes the soft-cap), else the explicit varlen kernel in chunks where the loop would run the
    explicit part kernel; the loop for the spans no packing states
    (:attr:`AttentionState.rest`) and for a step with no packing. Records the choice
    (:func:`attention_kernel`)."""
    global _latest_kernel
    impl = _implementation(state, q, d, softcap)
    _latest_kernel = impl.name
    return impl


def _implementation(
    state: AttentionState, q: torch.Tensor, d: int, softcap: float | None
) -> Loop | Varlen | Together:
    kern: VarlenKernel | None = (
        varlen_kernel(q, d, d) if softcap is None else capped_varlen_kernel(q, d, softcap)
    )
    if kern is None:
        kern = math_varlen(part_kernel(q, softcap))
    packed = state.packing_on(q.device) if kern is not None and len(state.span_table) else None
    if kern is None or packed is None:
        return Loop(state.blocks_on(q.device), q, softcap)
    rest = state.rest_on(q.device)
    if rest is None:
        return Varlen(kern, packed.packings)
    if not packed.packings:
        return Loop(rest, q, softcap)
    return Together(Varlen(kern, packed.packings), Loop(rest, q, softcap))
