"""Mamba's selective scan (Mamba v1: a diagonal decay per channel and state entry) over a step's
runs, with every document's state carried across ranks.

Per channel ``d`` and state entry ``n``, with step ``dt_t > 0`` (per channel) and rate
``A[d, n] < 0``: ``S_t[d, n] = exp(dt_t[d] A[d, n]) S_{t-1}[d, n] + dt_t[d] x_t[d] B_t[n]`` and
``y_t[d] = sum_n S_t[d, n] C_t[n] + D[d] x_t[d]``. The state is ``channels x d_state`` per
token, so the scan steps through the tokens, all runs at once: chunk ``j`` of every run per step
(:mod:`cpshard.mixers.chunks`), its tokens one after the other. Padding inside a run's last chunk
has ``dt = 0``: decay 1, nothing written, the state untouched.

The end state is affine in the start state: ``S_end = T * S_0 + E`` with ``T = exp(A sum_t
dt_t)`` elementwise; with ``E`` from a zero start it is what
:func:`cpshard.mixers.carry.carry_states` composes across ranks (as for Mamba2's SSD, whose decay
is a scalar per head instead).
"""

from __future__ import annotations

import torch

from cpshard.comm import Group
from cpshard.guard.reach import note_cpshard_mixing
from cpshard.mixers.carry import carry_states
from cpshard.mixers.chunks import ChunkTable, from_chunks, run_table, to_chunks
from cpshard.mixers.runs import RecurrenceRuns

_WHAT = "cpshard CP selective scan"


def scanned(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    table: ChunkTable,
    initial: torch.Tensor | None,
    want_output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The scan over the table's runs. ``x``, ``dt`` ``[B, L, D]``, ``A`` ``[D, N]``, ``B``,
    ``C`` ``[B, L, N]``, one working dtype; ``initial`` ``[R, D, N]`` or None (zeros). Returns
    (``y`` without the ``D`` term, ``[B * L, 1, D]`` — zeros outside the runs — or None, end
    states ``[R, D, N]``)."""
    batch, length, channels = x.shape
    uc = to_chunks(x * dt, table)  # [chunks, C, D]: dt_t x_t
    dc, bc, cc = (to_chunks(t, table) for t in (dt, B, C))
    state = initial if initial is not None else x.new_zeros(table.runs, channels, A.shape[1])
    outs = []
    for chunks, runs in table.steps:
        s = state.index_select(0, runs)
        d, u, b, c = (t.index_select(0, chunks) for t in (dc, uc, bc, cc))
        ys = []
        for i in range(d.shape[1]):
            s = (d[:, i, :, None] * A).exp() * s + u[:, i, :, None] * b[:, i, None, :]
            if want_output:
                ys.append((s * c[:, i, None, :]).sum(-1))
        state = state.index_copy(0, runs, s)
        if want_output:
            outs.append(torch.stack(ys, 1)[:, None])  # [n, 1, C, D]
    if not want_output:
        return None, state
    return from_chunks(outs, table, batch * length, x[..., None, :]), state


def _check(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    runs: RecurrenceRuns,
) -> None:
    """Raise ``ValueError`` naming the argument and the rank when the shapes do not fit the
    step's shard (the same arguments on every rank raise alike, before any transfer)."""
    where = f"{_WHAT}: rank {runs.rank}"
    if x.dim() != 3 or tuple(x.shape[:2]) != (runs.batch_size, runs.local_len):
        raise ValueError(
            f"{where}: x must be [B, L, channels] with [B, L] = [{runs.batch_size}, "
            f"{runs.local_len}] (this rank's shard), got {tuple(x.shape)}"
        )
    channels = x.shape[2]
    if dt.shape != x.shape:
        raise ValueError(f"{where}: dt must be {tuple(x.shape)}, got {tuple(dt.shape)}")
    if A.dim() != 2 or A.shape[0] != channels:
        raise ValueError(f"{where}: A must be [{channels}, d_state], got {tuple(A.shape)}")
    if D is not None and tuple(D.shape) != (channels,):
        raise ValueError(f"{where}: D must be [{channels}] or None, got {tuple(D.shape)}")
    state = (*x.shape[:2], A.shape[1])
    for name, t in (("B", B), ("C", C)):
        if tuple(t.shape) != state:
            raise ValueError(f"{where}: {name} must be {state} ([B, L, d_state]), got {tuple(t.shape)}")


def cp_selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    runs: RecurrenceRuns,
    group: Group,
) -> torch.Tensor:
    """Mamba's selective scan over this rank's shard of a CP step: every document from a zero
    state, documents that continue from other ranks from the state those ranks leave.

    ``x`` ``[B, L, D]``; ``dt`` ``[B, L, D]``, the step as the layer uses it (bias and softplus
    applied); ``A`` ``[D, N]`` (negative); ``B``, ``C`` ``[B, L, N]``; ``D`` ``[D]`` or None.
    Returns ``y`` ``[B, L, D]`` in the working dtype, float32 at least. Collective over
    ``group`` when a document spans ranks (every rank calls it alike)."""
    note_cpshard_mixing()
    _check(x, dt, A, B, C, D, runs)
    work = torch.promote_types(x.dtype, torch.float32)
    xx, dd, aa, bb, cc = (t.to(work) for t in (x, dt, A, B, C))
    device = xx.device
    initial, tie = None, None
    if runs.carries:
        _, ends = scanned(
            xx, dd, aa, bb, cc, run_table(runs, "exported", device), None, want_output=False
        )
        middle = run_table(runs, "middle", device)
        per_chunk = to_chunks(dd, middle).sum(1)  # [chunks, D]: each chunk's summed step
        steps = per_chunk.new_zeros(middle.runs, xx.shape[2]).index_add(0, middle.owners, per_chunk)
        transitions = (steps[:, :, None] * aa).exp()  # [M, D, N]
        initial, tie = carry_states(runs, group, ends, transitions, torch.mul, xx)
    out, _ = scanned(xx, dd, aa, bb, cc, run_table(runs, "all", device), initial)
    y = out.view(*xx.shape)
    if D is not None:
        y = y + D.to(work) * xx
    if tie is not None:
        y = y + tie
    return y
