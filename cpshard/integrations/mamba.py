"""transformers' Mamba layers (Mamba, Falcon-Mamba, and the Mamba layers of the Jamba hybrid:
Mamba v1's selective scan) under CP, with no change to the model.

The layer projects its input, convolves it causally, makes the scan's step, ``B`` and ``C``
from it, runs the selective scan and gates it, all in its own forward except for the functions
of its modeling module it calls for the token mixing. :data:`FAMILY` puts dispatchers in their
place (:mod:`cpshard.integrations.dispatch`); outside a CP attention context each is the
original function, inside one:

* ``causal_conv1d_fn``: cpshard's per-document convolution
  (:func:`cpshard.mixers.cp_causal_conv1d`);
* ``mamba_selective_scan``: the step made as the original makes it (bias, softplus), then
  :func:`cpshard.mixers.cp_selective_scan`, states carried across ranks, then the ``D`` term
  and the gate as the original applies them;
* ``mamba_inner_fn`` (a fused kernel, when one is installed; releases whose layer has no fused
  path have no such function): None, so the layer takes the path above;
* ``apply_mask_to_padding_states``: the hidden states unmasked (the step's documents say which
  tokens are padding);
* ``causal_conv1d_update`` and ``mamba_selective_state_update`` (token-by-token decoding), and
  the scan asked for its last state (a cache): refused, CP shards training steps.
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
from cpshard.mixers import cp_selective_scan, recurrence_runs

_WHAT = "cpshard.integrations.transformers (Mamba)"
# modeling module -> the Mamba layer class in it
MODULES = {
    "transformers.models.mamba.modeling_mamba": "MambaMixer",
    "transformers.models.falcon_mamba.modeling_falcon_mamba": "FalconMambaMixer",
    "transformers.models.jamba.modeling_jamba": "JambaMambaMixer",
}


def _scan(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def mamba_selective_scan(
        hidden_states: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        B: torch.Tensor,
        C: torch.Tensor,
        D: torch.Tensor | None = None,
        z: torch.Tensor | None = None,
        delta_bias: torch.Tensor | None = None,
        delta_softplus: bool = False,
        return_last_state: bool = False,
        **kwargs: Any,
    ) -> Any:
        state = mixing_state(_WHAT)
        if state is None:
            return original(
                hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                delta_softplus=delta_softplus, return_last_state=return_last_state, **kwargs,
            )  # fmt: skip
        if return_last_state:
            raise cache_refused(state, _WHAT, "Mamba")
        runs = recurrence_runs(state, _WHAT)
        if delta_bias is not None:
            dt = dt + delta_bias.to(dt.dtype)[..., None]
        if delta_softplus:
            dt = F.softplus(dt)
        # the layer's layout is [B, channels, L] (B and C: [B, d_state, L])
        x, step, b, c = (t.transpose(1, 2) for t in (hidden_states, dt, B, C))
        y = cp_selective_scan(x, step, A, b, c, D, runs, state.group).transpose(1, 2)
        if z is not None:
            y = y * F.silu(z)
        return y

    return mamba_selective_scan


_SCAN_PARAMS = (
    "hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
    "return_last_state",
)  # fmt: skip

FAMILY = Family(
    "Mamba",
    MODULES,
    functions={
        **padded_conv_hooks(_WHAT, "Mamba"),
        "mamba_selective_scan": Hook(_scan, _SCAN_PARAMS),
        "mamba_selective_state_update": decoding_hook(_WHAT, "Mamba"),
    },
    fused={"mamba_inner_fn": unfused(_WHAT)},
)
