"""Lightning attention (MiniMax's linear attention: a scalar decay per head) over a step's runs,
with every document's state carried across ranks.

Per head ``h``, with state ``S`` (``d_k x d_v``) and rate ``slope_h > 0``:
``S_t = exp(-slope_h) S_{t-1} + k_t^T v_t`` and ``o_t = q_t S_t``, i.e.
``o_t = sum_{s <= t} exp(-slope_h (t - s)) (q_t . k_s) v_s`` within the document. This is
Mamba2's state-space recurrence with a unit step: values as its ``x``, keys as its ``B``,
queries as its ``C``, ``A = -slope`` and no ``D`` term, so it runs through
:func:`cpshard.mixers.ssd.cp_ssd` (chunks that never cross a document start, states carried by
:func:`cpshard.mixers.carry.carry_states`); this module checks the arguments under their own
names and maps them.
"""

from __future__ import annotations

import torch

from cpshard.comm import Group
from cpshard.mixers.runs import RecurrenceRuns
from cpshard.mixers.ssd import cp_ssd

_WHAT = "cpshard CP lightning attention"


def _check(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, runs: RecurrenceRuns
) -> None:
    """Raise ``ValueError`` naming the argument and the rank when the shapes do not fit the
    step's shard (the same arguments on every rank raise alike, before any transfer)."""
    where = f"{_WHAT}: rank {runs.rank}"
    if q.dim() != 4 or tuple(q.shape[:2]) != (runs.batch_size, runs.local_len):
        raise ValueError(
            f"{where}: q must be [B, L, heads, head_dim] with [B, L] = [{runs.batch_size}, "
            f"{runs.local_len}] (this rank's shard), got {tuple(q.shape)}"
        )
    if k.shape != q.shape:
        raise ValueError(f"{where}: k must be {tuple(q.shape)} (q's shape), got {tuple(k.shape)}")
    if v.dim() != 4 or tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(
            f"{where}: v must be [B, L, heads, head_dim_v] with [B, L, heads] = "
            f"{list(q.shape[:3])} (q's), got {tuple(v.shape)}"
        )
    if slope.dim() != 1 or slope.shape[0] != q.shape[2]:
        raise ValueError(
            f"{where}: slope must be [{q.shape[2]}] (one decay rate per head), got "
            f"{tuple(slope.shape)}"
        )


def cp_lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slope: torch.Tensor,
    runs: RecurrenceRuns,
    group: Group,
) -> torch.Tensor:
    """Lightning attention over this rank's shard of a CP step: every document from a zero
    state, documents that continue from other ranks from the state those ranks leave.

    ``q``, ``k`` ``[B, L, H, D]``; ``v`` ``[B, L, H, Dv]``; ``slope`` ``[H]``, each head's decay
    rate (a token's state is multiplied by ``exp(-slope)`` per position). Returns ``o``
    ``[B, L, H, Dv]`` in the working dtype, float32 at least; zeros on padding. Collective over
    ``group`` when a document spans ranks (every rank calls it alike)."""
    _check(q, k, v, slope, runs)
    step = v.new_ones(v.shape[:3])
    return cp_ssd(v, step, -slope, k, q, None, runs, group)
