"""A step's runs cut into fixed-size chunks that never cross a document start: what a chunked
recurrence (the gated delta rule, Mamba2's SSD) computes over, all runs at once.

Each run (one document's positions on this rank) is cut into chunks of ``chunk`` tokens; the
last chunk of a run is filled with padding slots that read zeros (a recurrence's inputs there
are zero, which leaves its state untouched). Within a chunk a recurrence is solved in closed
form for all chunks together; across chunks a scan carries the state, stepping through chunk
``j`` of every run at once (:attr:`ChunkTable.steps`). The tables are host work, once per step
and run set, kept in the step's :class:`~cpshard.mixers.runs.RecurrenceRuns`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.mixers.runs import RecurrenceRuns, Run

CHUNK = 64


@dataclass(frozen=True)
class ChunkTable:
    """Where the chunks of a set of runs come from.

    ``tokens``: ``[N, C]`` flat token index (``row * L + position``) of each chunk slot, the pad
    index ``B * L`` after a run's end; ``steps[j]``: ``(chunks, runs)``, chunk ``j`` of every run
    that has one, and those runs' indices; ``owners``: ``[N]`` the run of each chunk;
    ``step_slots``: ``[N]`` where each chunk sits in the steps' chunks laid end to end;
    ``valid``: the flattened slots that hold tokens and ``targets`` their token indices (for the
    scatter back); ``runs``: how many runs."""

    tokens: torch.Tensor
    steps: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    owners: torch.Tensor
    step_slots: torch.Tensor
    valid: torch.Tensor
    targets: torch.Tensor
    runs: int

    def to(self, device: torch.device) -> ChunkTable:
        if self.tokens.device == device:
            return self
        return ChunkTable(
            self.tokens.to(device),
            tuple((c.to(device), r.to(device)) for c, r in self.steps),
            self.owners.to(device),
            self.step_slots.to(device),
            self.valid.to(device),
            self.targets.to(device),
            self.runs,
        )


def chunk_table(runs: tuple[Run, ...], local_len: int, batch_size: int, chunk: int) -> ChunkTable:
    """The :class:`ChunkTable` of ``runs`` (host)."""
    pad = batch_size * local_len
    slots, per_run = [], []
    for run in runs:
        count = -(-run.n // chunk)
        per_run.append(count)
        base = run.row * local_len + run.q
        for c in range(count):
            start = c * chunk
            width = min(chunk, run.n - start)
            slots.append(list(range(base + start, base + start + width)) + [pad] * (chunk - width))
    tokens = torch.tensor(slots, dtype=torch.int64).reshape(-1, chunk)
    first = [0]
    for count in per_run[:-1]:
        first.append(first[-1] + count)
    steps = []
    for j in range(max(per_run, default=0)):
        live = [i for i, count in enumerate(per_run) if count > j]
        steps.append(
            (
                torch.tensor([first[i] + j for i in live], dtype=torch.int64),
                torch.tensor(live, dtype=torch.int64),
            )
        )
    owners = torch.repeat_interleave(
        torch.arange(len(per_run)), torch.tensor(per_run, dtype=torch.int64)
    )
    order = torch.cat([c for c, _ in steps]) if steps else torch.zeros(0, dtype=torch.int64)
    step_slots = torch.empty_like(order)
    step_slots[order] = torch.arange(len(order))
    flat = tokens.flatten()
    valid = torch.nonzero(flat != pad).flatten()
    return ChunkTable(tokens, tuple(steps), owners, step_slots, valid, flat[valid], len(runs))


def run_table(runs: RecurrenceRuns, which: str, device: torch.device) -> ChunkTable:
    """The chunk table of this rank's runs (``"all"``), its exported runs (``"exported"``) or
    the exported runs that continue their document (``"middle"``), cached for the step."""
    key = (which, device)
    table = runs._tables.get(key)
    if table is None:
        host = runs._tables.get((which, None))
        if host is None:
            host = runs._tables[(which, None)] = chunk_table(
                _select(runs, which), runs.local_len, runs.batch_size, CHUNK
            )
        table = runs._tables[key] = host.to(device)
    assert isinstance(table, ChunkTable)
    return table


def _select(runs: RecurrenceRuns, which: str) -> tuple[Run, ...]:
    mine = runs.mine
    if which == "all":
        return mine
    exported = [mine[i] for i in runs.exported[runs.rank]]
    return tuple(exported if which == "exported" else [r for r in exported if r.incoming])


def to_chunks(x: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """``[B, L, ...]`` -> ``[N, C, ...]`` by the table (zeros in padding slots)."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    return flat[table.tokens]


def from_chunks(
    per_step: list[torch.Tensor], table: ChunkTable, tokens: int, anchor: torch.Tensor
) -> torch.Tensor:
    """The scan's outputs ``per_step[j]`` ``[n_j, H, C, d]`` (chunk ``j`` of every run, step
    order) back at their tokens: ``[tokens, H, d]``, zeros outside the runs. ``anchor``: a
    tensor of the computation (the output of a rank with no runs still depends on it, so its
    backward runs like every other rank's)."""
    if not per_step:
        return anchor.new_zeros(tokens, *anchor.shape[-2:]) + anchor.sum() * 0
    done = torch.cat(per_step).index_select(0, table.step_slots)  # [N, H, C, d] chunk order
    heads, d = done.shape[1], done.shape[-1]
    per_slot = done.transpose(1, 2).reshape(-1, heads, d)
    out = done.new_zeros(tokens, heads, d)
    return out.index_copy(0, table.targets, per_slot.index_select(0, table.valid))
