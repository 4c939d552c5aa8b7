"""The serpentine deal of chunks over ranks, shared by ``head_tail`` (over the whole sequence),
``per_document_head_tail`` (inside every run of a row) and ``balanced`` (for the documents it
zig-zags).

Chunk ``k`` of pass ``t = k // W`` goes to rank ``k % W`` on even passes and to
``W - 1 - k % W`` on odd ones; with the default ``C = 2W`` chunks rank ``r`` holds chunks ``r``
and ``2W - 1 - r``, a cheap head and a costly tail of causal attention, which balances the
per-rank cost.

Zig-zagging a run of ``n`` tokens cuts it into ``C`` chunks of ``n // C`` tokens; its
``n % C`` extra tokens go one each to ranks ``c, c + 1, ...`` (mod ``W``), ``c`` a counter
running along the runs from 0, each widening that rank's next chunk of the run (its ``t``-th
extra token of the run widens its chunk of pass ``t``). A counter running along a row deals
every rank the same number of extras.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_ranks", "default_num_chunks", "zigzag_pieces"]

CHUNKS_PER_RANK = 2  # the default chunk count is 2W: one head and one tail chunk per rank
BLOCK_ELEMENTS = 1 << 21  # runs x chunks handled at once by zigzag_pieces (bounds its memory)


def default_num_chunks(world: int) -> int:
    """The default chunk count ``2W``."""
    return CHUNKS_PER_RANK * world


def chunk_ranks(world: int, chunks: int) -> torch.Tensor:
    """``[C]`` int64: the owner of every chunk in a serpentine deal over ``world`` ranks."""
    k = torch.arange(chunks)
    i = k % world
    return torch.where((k // world) % 2 == 0, i, world - 1 - i)


def zigzag_pieces(
    starts: torch.Tensor, lengths: torch.Tensor, world: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces of runs at ``starts`` of ``lengths`` (int64 ``[R]``, in position order)
    zig-zagged over ``chunks`` chunks (module doc): start, offset in its run, length and rank of
    each (int64 vectors, in position order).

    Whole-tensor work over runs x chunks, a block of runs at a time. Empty chunks are pieces
    too (of length 0) unless they are most of a block (runs shorter than ``chunks``), which
    keeps the output within twice the tokens plus one block."""
    ranks = chunk_ranks(world, chunks)
    # Chunk k of pass t owned by rank r is widened by the run's extra token
    # t * W + (r - c) % W (c: the counter at the run) if the run has that many extras: that
    # index for every counter c mod W, [W, C].
    c = torch.arange(world)[:, None]
    extra_index = torch.arange(chunks) // world * world + (ranks - c) % world
    q, m = lengths // chunks, lengths % chunks
    counter = (torch.cumsum(m, 0) - m) % world
    block = max(1, BLOCK_ELEMENTS // chunks)
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for b in range(0, lengths.numel(), block):
        e = slice(b, b + block)
        sizes = q[e, None] + (extra_index[counter[e]] < m[e, None])
        offsets = torch.cumsum(sizes, 1) - sizes
        at, owner = starts[e, None] + offsets, ranks.expand_as(sizes)
        if sizes.numel() > 2 * int(lengths[e].sum()):
            keep = sizes > 0
            out.append((at[keep], offsets[keep], sizes[keep], owner[keep]))
        else:
            out.append((at.flatten(), offsets.flatten(), sizes.flatten(), owner.flatten()))
    if not out:
        out.append((torch.zeros(0, dtype=torch.int64),) * 4)
    if len(out) == 1:
        return out[0]  # no copy
    at, offsets, sizes, owner = (torch.cat(parts) for parts in zip(*out, strict=True))
    return at, offsets, sizes, owner
