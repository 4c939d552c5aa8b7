"""Mamba2's state-space recurrence (SSD: a scalar decay per head) over a step's runs, with every
document's state carried across ranks.

Per head ``h``, with state ``S`` (``head_dim x d_state``), step ``dt_t > 0`` and rate
``A_h < 0``: ``S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T`` and ``y_t = S_t C_t + D_h x_t``
(``B`` and ``C`` shared by the heads of a group). Each run (one document's positions on this
rank) is cut into chunks that never cross a document start (:mod:`cpshard.mixers.chunks`);
within a chunk the recurrence is its quadratic (attention-like) form, ``C B^T`` weighted by the
decay between positions, across chunks a scan carries ``S``. Padding inside a run's last chunk
has ``dt = 0``: decay 1, nothing written, the state untouched.

The end state is affine in the start state: ``S_end = T S_0 + E`` with ``T`` the run's total
decay ``exp(A_h sum_t dt_t)``, a scalar per head; with ``E`` from a zero start it is what
:func:`cpshard.mixers.carry.carry_states` composes across ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpshard.comm import Group
from cpshard.guard.reach import note_cpshard_mixing
from cpshard.mixers.carry import carry_states
from cpshard.mixers.chunks import ChunkTable, from_chunks, run_table, to_chunks
from cpshard.mixers.runs import RecurrenceRuns

_WHAT = "cpshard CP SSD"


def _segment_decay(a: torch.Tensor) -> torch.Tensor:
    """``[..., C, C]``: ``exp(a[s+1] + ... + a[l])`` at ``[l, s]`` for ``s <= l``, 0 above the
    diagonal. Summed per segment (a masked cumulative sum), not as a difference of prefix sums,
    which loses the short segments' precision in float32."""
    c = a.shape[-1]
    strict = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=a.device).tril()
    seg = a[..., :, None].expand(*a.shape, c).masked_fill(~strict, 0.0).cumsum(-2)
    return seg.masked_fill(~causal, float("-inf")).exp()


def chunked_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    table: ChunkTable,
    initial: torch.Tensor | None,
    want_output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The recurrence over the table's runs. ``x`` ``[B, L, H, P]``, ``dt`` and the log decay
    ``a = dt * A`` ``[B, L, H]``, ``b``, ``c`` ``[B, L, H, N]`` (heads repeated), one working
    dtype; ``initial`` ``[R, H, P, N]`` or None (zeros). Returns (``y`` without the ``D`` term,
    ``[B * L, H, P]`` — zeros outside the runs — or None, end states ``[R, H, P, N]``)."""
    batch, length, heads, p = x.shape
    xc = to_chunks(x * dt[..., None], table).transpose(1, 2)  # [N, H, C, P]: dt_t x_t
    bc, cc = (to_chunks(t, table).transpose(1, 2) for t in (b, c))  # [N, H, C, N]
    ac = to_chunks(a, table).transpose(1, 2)  # [N, H, C]
    after = F.pad(ac[..., 1:].flip(-1).cumsum(-1).flip(-1), (0, 1))  # log decay after each token
    written = xc.transpose(-1, -2) @ (bc * after.exp()[..., None])  # [N, H, P, N]
    chunk_decay = ac.sum(-1).exp()[..., None, None]  # [N, H, 1, 1]
    if want_output:
        attn = (cc @ bc.transpose(-1, -2)) * _segment_decay(ac)  # causal, diagonal included
        c_read = cc * ac.cumsum(-1).exp()[..., None]  # the start state decayed to each token

    state = initial if initial is not None else x.new_zeros(table.runs, heads, p, b.shape[-1])
    outs = []
    for chunks, runs in table.steps:
        s = state.index_select(0, runs)
        if want_output:
            outs.append(
                c_read.index_select(0, chunks) @ s.transpose(-1, -2)
                + attn.index_select(0, chunks) @ xc.index_select(0, chunks)
            )
        s = s * chunk_decay.index_select(0, chunks) + written.index_select(0, chunks)
        state = state.index_copy(0, runs, s)
    if not want_output:
        return None, state
    return from_chunks(outs, table, batch * length, x), state


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
    if x.dim() != 4 or tuple(x.shape[:2]) != (runs.batch_size, runs.local_len):
        raise ValueError(
            f"{where}: x must be [B, L, heads, head_dim] with [B, L] = [{runs.batch_size}, "
            f"{runs.local_len}] (this rank's shard), got {tuple(x.shape)}"
        )
    heads = x.shape[2]
    if tuple(dt.shape) != tuple(x.shape[:3]):
        raise ValueError(f"{where}: dt must be {tuple(x.shape[:3])}, got {tuple(dt.shape)}")
    if tuple(A.shape) != (heads,):
        raise ValueError(f"{where}: A must be [{heads}] (one rate per head), got {tuple(A.shape)}")
    if D is not None and tuple(D.shape) != (heads,):
        raise ValueError(f"{where}: D must be [{heads}] or None, got {tuple(D.shape)}")
    for name, t in (("B", B), ("C", C)):
        if t.dim() != 4 or tuple(t.shape[:2]) != tuple(x.shape[:2]) or heads % t.shape[2]:
            raise ValueError(
                f"{where}: {name} must be [B, L, groups, d_state] with [B, L] as x's and groups "
                f"dividing the {heads} heads, got {tuple(t.shape)}"
            )
    if B.shape != C.shape:
        raise ValueError(
            f"{where}: B and C must have one shape, got {tuple(B.shape)} and {tuple(C.shape)}"
        )


def cp_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    runs: RecurrenceRuns,
    group: Group,
) -> torch.Tensor:
    """Mamba2's SSD over this rank's shard of a CP step: every document from a zero state,
    documents that continue from other ranks from the state those ranks leave.

    ``x`` ``[B, L, H, P]``; ``dt`` ``[B, L, H]``, the step as the layer uses it (bias, softplus
    and clamp applied); ``A`` ``[H]`` (negative); ``B``, ``C`` ``[B, L, G, N]`` (``G`` groups
    dividing ``H``: head ``h`` reads group ``h // (H / G)``); ``D`` ``[H]`` or None. Returns
    ``y`` ``[B, L, H, P]`` in the working dtype, float32 at least (what Mamba2's gated norm
    reads). Collective over ``group`` when a document spans ranks (every rank calls it alike)."""
    note_cpshard_mixing()
    _check(x, dt, A, B, C, D, runs)
    work = torch.promote_types(x.dtype, torch.float32)
    heads, groups = x.shape[2], B.shape[2]
    xx, dd, bb, cc = (t.to(work) for t in (x, dt, B, C))
    if heads != groups:
        bb, cc = (t.repeat_interleave(heads // groups, dim=2) for t in (bb, cc))
    a = dd * A.to(work)
    device = xx.device
    initial, tie = None, None
    if runs.carries:
        _, ends = chunked_ssd(
            xx, dd, a, bb, cc, run_table(runs, "exported", device), None, want_output=False
        )
        middle = run_table(runs, "middle", device)
        per_chunk = to_chunks(a, middle).sum(1)  # [chunks, H]: each chunk's summed log decay
        transitions = per_chunk.new_zeros(middle.runs, heads).index_add(
            0, middle.owners, per_chunk
        ).exp()  # [M, H]
        initial, tie = carry_states(
            runs, group, ends, transitions, lambda t, s: t[:, None, None] * s, xx
        )
    out, _ = chunked_ssd(xx, dd, a, bb, cc, run_table(runs, "all", device), initial)
    y = out.view(*xx.shape)
    if D is not None:
        y = y + D.to(work)[:, None] * xx
    if tie is not None:
        y = y + tie
    return y
