"""transformers' Mamba2 layers (Mamba2, and the Mamba2 layers of the NemotronH, Bamba,
GraniteMoeHybrid, Zamba2 and Falcon-H1 hybrids) under CP, with no change to the model.

The layer projects its input, convolves the x, B and C channels causally, runs the state-space
recurrence (SSD) and a gated norm, all in its own forward, except for the functions of its
modeling module it calls for the token mixing. :data:`FAMILY` puts dispatchers in their place
(:mod:`cpshard.integrations.dispatch`); outside a CP attention context each is the original
function, inside one:

* ``causal_conv1d_fn``: cpshard's per-document convolution
  (:func:`cpshard.mixers.cp_causal_conv1d`);
* ``mamba2_chunk_scan``: the step ``dt`` made as the original makes it (bias, softplus, clamp to
  the layer's limits), then :func:`cpshard.mixers.cp_ssd`, states carried across ranks;
* ``mamba2_split_conv1d_scan_combined`` (a fused kernel, when one is installed, that would scan
  the shard alone): None, so the layer takes the path above;
* ``apply_mask_to_padding_states``: the hidden states unmasked (the step's documents say which
  tokens are padding: :func:`~cpshard.integrations.dispatch.unmasked`);
* ``causal_conv1d_update`` and ``mamba2_selective_state_update`` (token-by-token decoding), and
  ``mamba2_chunk_scan`` with a cache's state: refused, CP shards training steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.integrations.dispatch import (
    cache_refused,
    decoding_hook,
    mixing_state,
    padded_conv_hooks,
    unfused,
)
from cpshard.integrations.hooks import Family, Hook
from cpshard.mixers import cp_ssd, recurrence_runs

_WHAT = "cpshard.integrations.transformers (Mamba2)"
# modeling module -> the Mamba2 layer class in it
MODULES = {
    "transformers.models.mamba2.modeling_mamba2": "Mamba2Mixer",
    "transformers.models.nemotron_h.modeling_nemotron_h": "NemotronHMamba2Mixer",
    "transformers.models.bamba.modeling_bamba": "BambaMixer",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "transformers.models.zamba2.modeling_zamba2": "Zamba2MambaMixer",
    "transformers.models.falcon_h1.modeling_falcon_h1": "FalconH1Mixer",
}


def _scan(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def mamba2_chunk_scan(
        hidden_states: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        chunk_size: int,
        D: torch.Tensor | None = None,
        dt_bias: torch.Tensor | None = None,
        initial_states: torch.Tensor | None = None,
        dt_softplus: bool = False,
        dt_limit: tuple[float, float] = (0.0, float("inf")),
        return_final_states: bool = False,
        **kwargs: Any,
    ) -> Any:
        state = mixing_state(_WHAT)
        if state is None:
            return original(
                hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                return_final_states=return_final_states, **kwargs,
            )  # fmt: skip
        if initial_states is not None or return_final_states:
            raise cache_refused(state, _WHAT, "Mamba2")
        runs = recurrence_runs(state, _WHAT)
        if dt_bias is not None:
            dt = dt + dt_bias.to(dt.dtype)
        if dt_softplus:
            dt = F.softplus(dt)
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
        return cp_ssd(hidden_states, dt, A, B, C, D, runs, state.group)

    return mamba2_chunk_scan


_SCAN_PARAMS = (
    "hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states",
    "dt_softplus", "dt_limit", "return_final_states",
)  # fmt: skip

FAMILY = Family(
    "Mamba2",
    MODULES,
    functions={
        **padded_conv_hooks(_WHAT, "Mamba2"),
        "mamba2_chunk_scan": Hook(_scan, _SCAN_PARAMS),
        "mamba2_selective_state_update": decoding_hook(_WHAT, "Mamba2"),
    },
    fused={"mamba2_split_conv1d_scan_combined": unfused(_WHAT)},
)
