"""A recurrence's state carried across ranks: each run that continues a document starts from
the state the document's earlier runs leave, wherever they are.

The state after a run is affine in the state it starts from: ``S_end = T(S_0) + E`` with ``E``
the end state from a zero start and ``T`` the run's transition (a per-head matrix for a delta
rule, a per-head scalar decay for Mamba2's SSD). Every rank computes, for each run of its own
whose document goes on (exported), ``E`` and — if the run also continues its document — ``T``,
all from a zero start and all at once; ONE ragged all-gather moves them to every rank
(differentiable: its backward returns every rank's gradient to the owner); each rank then
composes, for each of its runs that continues a document, the chain of that document's earlier
runs (at most one run per rank in between: the scan is O(W) tiny products on the host's
schedule, no rank waits for another's recurrence). A sequential pass over ranks would carry the
same states with W times the latency of one rank's recurrence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from cpshard.comm import Group
from cpshard.mixers.runs import RecurrenceRuns, Run
from cpshard.transport import gather_ragged

Compose = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (transition, state) -> state


def _payload_sizes(runs: RecurrenceRuns, state_numel: int, transition_numel: int) -> list[int]:
    """Elements each rank contributes: an end state per exported run, a transition per exported
    run that continues its document."""
    out = []
    for rs, ex in zip(runs.runs, runs.exported, strict=True):
        middles = sum(rs[i].incoming for i in ex)
        out.append(len(ex) * state_numel + middles * transition_numel)
    return out


def carry_states(
    runs: RecurrenceRuns,
    group: Group,
    ends: torch.Tensor,
    transitions: torch.Tensor,
    compose: Compose,
    source: torch.Tensor,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The state each of this rank's runs starts from, ``[R, *state]`` in ``runs.mine`` order
    (zeros for a run that starts its document; None when none continues one), and a zero scalar
    ``tie`` the caller adds to its output: a rank none of whose runs continue a document uses
    nothing it received, yet its backward must still run the gather's adjoint (a collective)
    with the others.

    ``ends``: ``[E, *state]``, the zero-start end states of this rank's exported runs (in
    ``runs.exported[rank]`` order); ``transitions``: ``[M, *transition]``, the transitions of
    those exported runs that are also incoming (same order). ``compose(T, S)`` applies a
    transition to a state. Collective over ``group`` when ``group.world > 1`` (every rank calls
    it once per layer call). ``source``: a tensor the states derive from (the layer's input):
    a rank with nothing to send still sends a payload that requires grad exactly when the
    others' do (the transfer's fingerprint, and its backward, must agree on every rank)."""
    state_shape, transition_shape = tuple(ends.shape[1:]), tuple(transitions.shape[1:])
    sn, tn = math.prod(state_shape), math.prod(transition_shape)
    flat = torch.cat([ends.reshape(-1), transitions.reshape(-1), source.reshape(-1)[:0]])
    if group.world > 1:
        sizes = _payload_sizes(runs, sn, tn)
        everything = gather_ragged(flat.contiguous(), group, sizes, 0)
        parts: Sequence[torch.Tensor] = everything.split(sizes)
        tie = everything[:0].sum()
    else:
        parts, tie = [flat], flat[:0].sum()
    # Each rank's exported runs: (end state, transition or None), by slot.
    exported: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = []
    for rs, ex, part in zip(runs.runs, runs.exported, parts, strict=True):
        e = part[: len(ex) * sn].view(len(ex), *state_shape)
        t = part[len(ex) * sn :].view(-1, *transition_shape)
        slots, m = [], 0
        for slot, i in enumerate(ex):
            if rs[i].incoming:
                slots.append((e[slot], t[m]))
                m += 1
            else:
                slots.append((e[slot], None))
        exported.append(slots)

    memo: dict[tuple[int, int], torch.Tensor] = {}

    def end_state(rank: int, slot: int) -> torch.Tensor:
        """The true end state of exported run ``slot`` of ``rank`` (its document's earlier runs
        composed in)."""
        key = (rank, slot)
        if key not in memo:
            end, transition = exported[rank][slot]
            if transition is not None:
                run = runs.runs[rank][runs.exported[rank][slot]]
                end = end + compose(transition, end_state(*runs.previous(run)))
            memo[key] = end
        return memo[key]

    mine: tuple[Run, ...] = runs.mine
    if not any(run.incoming for run in mine):
        return None, tie
    zero = ends.new_zeros(state_shape)
    starts = [end_state(*runs.previous(run)) if run.incoming else zero for run in mine]
    return torch.stack(starts), tie
