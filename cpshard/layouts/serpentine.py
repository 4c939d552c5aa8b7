"""The serpentine deal of chunks over ranks, shared by ``head_tail`` (over the whole sequence),
``per_document_head_tail`` (inside every run of a row) and ``balanced`` (for the documents it
zig-zags).

Chunk ``k`` of pass ``t = k // W`` goes to rank ``k % W`` on even passes and to
``W - 1 - k % W`` on odd ones; with the default ``C = 2W`` chunks rank ``r`` holds chunks ``r``
and ``2W - 1 - r``, a cheap head and a costly tail of causal attention, which balances the
per-rank cost.
"""

from __future__ import annotations

from cpshard.layouts.owners import Piece

__all__ = ["chunk_rank", "default_num_chunks", "zigzag_run"]

CHUNKS_PER_RANK = 2  # the default chunk count is 2W: one head and one tail chunk per rank


def default_num_chunks(world: int) -> int:
    """The default chunk count ``2W``."""
    return CHUNKS_PER_RANK * world


def chunk_rank(k: int, world: int) -> int:
    """Owner of chunk ``k`` in a serpentine deal of chunks over ``world`` ranks."""
    p, i = divmod(k, world)
    return i if p % 2 == 0 else world - 1 - i


def zigzag_run(
    start: int, n: int, world: int, chunks: int, counter: int
) -> tuple[list[Piece], int]:
    """Pieces of a run of ``n`` tokens at ``start``, zig-zagged over ``chunks`` chunks, and the
    counter after dealing the run's ``n % chunks`` extra tokens.

    The run is cut into ``chunks`` chunks of ``n // chunks`` tokens; the extras go one each to
    ranks ``counter, counter + 1, ...`` (mod ``world``), each widening that rank's next chunk of
    the run. A counter running along a row deals every rank the same number of extras."""
    q, m = divmod(n, chunks)
    sizes = [q] * chunks
    for i in range(m):
        rank = (counter + i) % world
        t = i // world  # this rank's t-th extra token in the run -> its t-th chunk
        sizes[t * world + (rank if t % 2 == 0 else world - 1 - rank)] += 1
    pieces, pos = [], start
    for k, size in enumerate(sizes):
        if size:
            pieces.append((pos, size, chunk_rank(k, world)))
            pos += size
    return pieces, counter + m
