"""Sequence mixers other than attention under CP: causal convolutions and linear recurrences.

Hybrid models (Qwen3.5 and Qwen3-Next: Gated DeltaNet linear attention behind a short causal
convolution; Mamba2 and its hybrids, Mamba and Jamba: a state-space scan behind one; MiniMax:
lightning attention, a decayed linear attention) mix tokens along the sequence outside
attention. Under CP each rank holds a slice of every packed sequence, so these layers need,
like attention, what the rest of each document contributes: the convolution the few tokens
before each run (:mod:`~cpshard.mixers.conv`), the recurrence the state its
document's earlier runs leave (:mod:`~cpshard.mixers.runs`, :mod:`~cpshard.mixers.carry`,
:mod:`~cpshard.mixers.chunks`, :mod:`~cpshard.mixers.delta_rule`, :mod:`~cpshard.mixers.ssd`,
:mod:`~cpshard.mixers.selective_scan`, :mod:`~cpshard.mixers.lightning`).
They read the step's documents and layout from the active CP attention state (planned once per
step, on first use) and reset at every document start, so a packed batch equals its documents
run alone.
"""

from __future__ import annotations

from cpshard.mixers.conv import cp_causal_conv1d
from cpshard.mixers.delta_rule import cp_gated_delta_rule
from cpshard.mixers.lightning import cp_lightning_attention
from cpshard.mixers.runs import RecurrenceRuns, plan_recurrence_runs, recurrence_runs
from cpshard.mixers.selective_scan import cp_selective_scan
from cpshard.mixers.ssd import cp_ssd

__all__ = [
    "RecurrenceRuns",
    "cp_causal_conv1d",
    "cp_gated_delta_rule",
    "cp_lightning_attention",
    "cp_selective_scan",
    "cp_ssd",
    "plan_recurrence_runs",
    "recurrence_runs",
]
