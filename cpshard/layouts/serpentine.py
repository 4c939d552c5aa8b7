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

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from cpshard.batch.runs import id_runs
from cpshard.ranges import ragged_arange

__all__ = [
    "chunk_ranks",
    "default_num_chunks",
    "owned_chunks",
    "ZigzagTable",
    "zigzag_pieces",
    "zigzag_sizes",
    "zigzag_table",
]

CHUNKS_PER_RANK = 2  # the default chunk count is 2W: one head and one tail chunk per rank
BLOCK_ELEMENTS = 1 << 21  # runs x chunks zig-zagged at once (bounds the memory)


def default_num_chunks(world: int) -> int:
    """The default chunk count ``2W``."""
    return CHUNKS_PER_RANK * world


def chunk_ranks(world: int, chunks: int) -> torch.Tensor:
    """``[C]`` int64: the owner of every chunk in a serpentine deal over ``world`` ranks."""
    k = torch.arange(chunks)
    i = k % world
    return torch.where((k // world) % 2 == 0, i, world - 1 - i)


def owned_chunks(world: int, chunks: int) -> torch.Tensor:
    """``[W, C / W]``: the chunks rank ``r`` owns, ascending (one per pass)."""
    return torch.argsort(chunk_ranks(world, chunks), stable=True).view(world, chunks // world)


@functools.lru_cache(maxsize=16)
def _deal(world: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' ranks ``[C]`` and, for every counter ``c`` (mod ``W``) at a run, the index
    of the run's extra token that widens each chunk ``[W, C]``: chunk ``k`` of pass ``t`` owned
    by rank ``r`` gets extra token ``t * W + (r - c) % W``, if the run has that many extras.
    Cached (read only): zig-zagging reuses them for every row and attempt."""
    ranks = chunk_ranks(world, chunks)
    c = torch.arange(world)[:, None]
    extra_index = torch.arange(chunks) // world * world + (ranks - c) % world
    # int32 where it fits: less memory traffic per run
    return ranks, extra_index.to(torch.int32 if chunks < 2**31 else torch.int64)


def zigzag_sizes(
    lengths: torch.Tensor, world: int, chunks: int, counter: torch.Tensor | None = None
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The chunk sizes ``[R, C]`` of runs of ``lengths`` (int64 ``[R]``, in position order)
    zig-zagged over ``chunks`` chunks (module doc), a block of runs at a time (whole-tensor
    work, bounded memory): yields the block's slice of the runs and its sizes. ``counter``:
    the extras counter at each run (mod ``W``; default: one counter running along these
    runs from 0)."""
    extra_index = _deal(world, chunks)[1]
    q, m = lengths // chunks, lengths % chunks
    if counter is None:
        counter = (torch.cumsum(m, 0) - m) % world
    block = max(1, BLOCK_ELEMENTS // chunks)
    for b in range(0, lengths.numel(), block):
        e = slice(b, b + block)
        yield e, q[e, None] + (extra_index[counter[e]] < m[e, None].to(extra_index.dtype))


def zigzag_pieces(
    starts: torch.Tensor, lengths: torch.Tensor, world: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces of runs at ``starts`` of ``lengths`` (int64 ``[R]``, in position order)
    zig-zagged over ``chunks`` chunks (:func:`zigzag_sizes`): start, length and rank of each
    (int64 vectors, in position order).

    Empty chunks (runs shorter than ``chunks``) are left out: every later pass over the pieces
    (the layout record's check and sort, the planners) costs by the piece."""
    ranks = _deal(world, chunks)[0]
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for e, sizes in zigzag_sizes(lengths, world, chunks):
        at = torch.cumsum(sizes, 1).sub_(sizes).add_(starts[e, None])  # one big temporary
        owner = ranks.expand_as(sizes)
        if bool((lengths[e] < chunks).any()):
            keep = sizes > 0
            out.append((at[keep], sizes[keep], owner[keep]))
        else:
            out.append((at.flatten(), sizes.flatten(), owner.flatten()))
    if not out:
        out.append((torch.zeros(0, dtype=torch.int64),) * 3)
    if len(out) == 1:
        return out[0]  # no copy
    at, sizes, owner = (torch.cat(parts) for parts in zip(*out, strict=True))
    return at, sizes, owner


@dataclass(frozen=True, eq=False)
class ZigzagTable:
    """Every run of one id of every row of padded ids ``[rows, padded]`` (documents and
    padding) zig-zagged over ``chunks`` chunks for ``world`` ranks, the extras counter
    restarting at every row: the runs' ``row``, ``start``, ``end`` and ``ids`` ``[R]`` (ordered
    by row and start: they are the ids, run by run), the extras counter at each run
    ``counter`` ``[R]`` (its first extra token goes to that rank) and every chunk's ``first``
    position and ``size`` ``[R, C]``."""

    rows: int
    padded: int
    world: int
    chunks: int
    row: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    ids: torch.Tensor
    counter: torch.Tensor
    first: torch.Tensor
    size: torch.Tensor

    def check(self, world: int, padded: int) -> None:
        """Raise ``ValueError`` unless the table partitions its rows into ``world`` equal
        shards of ``padded`` positions: runs tiling every row, chunks tiling every run (none
        negative), ``P / W`` tokens of every row per rank. O(runs x chunks), no pass over the
        positions."""
        if (self.world, self.padded) != (world, padded) or self.chunks % world:
            raise ValueError(
                f"the chunk table was made for {self.world} ranks, {self.padded} positions and "
                f"{self.chunks} chunks; the layout has {world} ranks and {padded} positions"
            )
        row, start, end = self.row, self.start, self.end
        if padded and self.rows:
            first_of_row = torch.ones_like(row, dtype=torch.bool)
            first_of_row[1:] = row[1:] != row[:-1]
            last_of_row = torch.roll(first_of_row, -1)
            previous_end = torch.roll(end, 1)
            tiled = (
                row.numel() > 0 and bool((torch.diff(row) >= 0).all())
                and torch.equal(row[first_of_row], torch.arange(self.rows))
                and bool((start == torch.where(first_of_row, 0, previous_end)).all())
                and bool((end[last_of_row] == padded).all()) and bool((end > start).all())
            )  # fmt: skip
        else:
            tiled = row.numel() == 0
        if not tiled:
            raise ValueError("the chunk table's runs do not tile every padded row")
        size, first = self.size, self.first
        if self.size.numel() and not (
            bool((size >= 0).all()) and torch.equal(size.sum(1), end - start)
            and torch.equal(first[:, 0], start)
            and torch.equal(torch.diff(first, dim=1), size[:, :-1])
        ):  # fmt: skip
            raise ValueError("the chunk table's chunks do not tile its runs")
        per_run = torch.zeros(row.numel(), world, dtype=torch.int64)
        per_run.index_add_(1, chunk_ranks(world, self.chunks), size)
        per_row = torch.zeros(self.rows, world, dtype=torch.int64).index_add_(0, row, per_run)
        if not bool((per_row == padded // world).all()):
            raise ValueError(
                f"the chunk table does not give every rank {padded // world} tokens of every row"
            )

    def key(self) -> torch.Tensor:
        """The table's runs and sizes (int64): equal for two tables iff their partitions are
        (the chunks follow from the runs)."""
        sizes = torch.tensor([self.rows, self.padded, self.world, self.chunks])
        return torch.cat([sizes, self.row, self.start, self.end, self.ids])

    def indices(self) -> torch.Tensor:
        """``[W, B, P / W]``: every rank's positions, listed rank by rank (its chunks of every
        run in row and position order: no sort; every rank holds ``P / W`` of every row)."""
        owned = owned_chunks(self.world, self.chunks)

        def rank_major(t: torch.Tensor) -> torch.Tensor:  # [R, C] -> [W, R, C / W], flat
            # chunk-major first: each rank's chunk of every run is then one contiguous read
            return t.T.contiguous()[owned].transpose(1, 2).reshape(-1)

        at, n = rank_major(self.first), rank_major(self.size)
        return ragged_arange(at, n).view(self.world, self.rows, -1)

    def row_pieces(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Every row's pieces: the start, length and rank of each non-empty chunk, in position
        order."""
        ranks = chunk_ranks(self.world, self.chunks)
        bounds = torch.searchsorted(self.row, torch.arange(self.rows + 1)).tolist()
        out = []
        for a, b in itertools.pairwise(bounds):
            size = self.size[a:b]
            keep = size > 0
            out.append((self.first[a:b][keep], size[keep], ranks.expand_as(size)[keep]))
        return out

    def describes(self, doc_ids: torch.Tensor) -> bool:
        """Whether the padded ids ``doc_ids`` ``[B, P]`` are the ones the table was made from
        (the same runs of the same ids)."""
        if tuple(doc_ids.shape) != (self.rows, self.padded):
            return False
        runs = id_runs(doc_ids)
        return all(
            torch.equal(a, b)
            for a, b in zip(runs, (self.row, self.start, self.end, self.ids), strict=True)
        )


def zigzag_table(doc_ids: torch.Tensor, world: int, chunks: int) -> ZigzagTable:
    """The :class:`ZigzagTable` of the padded ids ``doc_ids`` ``[B, P]`` (host int64)."""
    row, start, end, ids = id_runs(doc_ids)
    lengths = end - start
    m = lengths % chunks
    running = torch.cumsum(m, 0) - m
    counter = (running - running[torch.searchsorted(row, row)]) % world  # from 0 every row
    size = torch.cat(
        [s for _, s in zigzag_sizes(lengths, world, chunks, counter)]
        or [torch.zeros(0, chunks, dtype=torch.int64)]
    )
    first = torch.cumsum(size, 1).sub_(size).add_(start[:, None])
    b, padded = doc_ids.shape
    return ZigzagTable(b, padded, world, chunks, row, start, end, ids, counter, first, size)
