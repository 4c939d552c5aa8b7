"""transformers' Gated DeltaNet layers (Qwen3.5 text and VLM, Qwen3.5-MoE, Qwen3-Next) under CP,
with no change to the model.

Those layers call two functions of their modeling module: ``causal_conv1d_fn`` (the short
convolution in front of the recurrence) and ``torch_chunk_gated_delta_rule`` (the recurrence).
:func:`install` puts a dispatcher in their place: outside a CP attention context it is the
original function; inside one it is cpshard's per-document convolution and gated delta rule
over the step's shards (:mod:`cpshard.mixers`), states carried across ranks. The layer's class is
marked ``cpshard_sequence_mixer`` so that the check refusing token mixers CP does not shard lets
it run. A cached (generation) call under CP is refused: CP shards training steps.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from cpshard.attention.state import AttentionState, active_state
from cpshard.mixers import cp_causal_conv1d, cp_gated_delta_rule, recurrence_runs

_WHAT = "cpshard.integrations.transformers (Gated DeltaNet)"
# modeling module -> the Gated DeltaNet class in it
MODULES = {
    "transformers.models.qwen3_5.modeling_qwen3_5": "Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
    "transformers.models.qwen3_next.modeling_qwen3_next": "Qwen3NextGatedDeltaNet",
}
_CONV, _RULE = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"


def _state() -> AttentionState | None:
    return active_state()


def _conv(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def causal_conv1d_fn(
        hidden_states: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        state = _state()
        if state is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        recurrence_runs(state, _WHAT)  # refuses an unsupported layout before any transfer
        x = hidden_states.transpose(1, 2).to(weight.dtype)  # [B, L, C]
        y = cp_causal_conv1d(x, weight, bias, state, activation)
        return y.transpose(1, 2).to(hidden_states.dtype)

    causal_conv1d_fn.cpshard_original = original  # type: ignore[attr-defined]
    return causal_conv1d_fn


def _rule(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def torch_chunk_gated_delta_rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        chunk_size: int = 64,
        initial_state: torch.Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        state = _state()
        if state is None:
            return original(
                query, key, value, g=g, beta=beta, chunk_size=chunk_size,
                initial_state=initial_state, output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs,
            )  # fmt: skip
        if initial_state is not None or output_final_state:
            raise ValueError(
                f"{_WHAT}: rank {state.group.rank}: a Gated DeltaNet layer ran with a cache "
                "(initial_state / output_final_state) inside a CP context; CP shards training "
                "steps: call the model with use_cache=False"
            )
        runs = recurrence_runs(state, _WHAT)
        out = cp_gated_delta_rule(
            query, key, value, g, beta, runs, state.group, use_qk_l2norm_in_kernel
        )
        return out, None

    torch_chunk_gated_delta_rule.cpshard_original = original  # type: ignore[attr-defined]
    return torch_chunk_gated_delta_rule


def install() -> None:
    """Put the dispatchers into every Gated DeltaNet modeling module transformers has and mark
    its layer class (idempotent; modules this transformers lacks are skipped)."""
    for name, cls_name in MODULES.items():
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for attr, make in ((_CONV, _conv), (_RULE, _rule)):
            fn = getattr(module, attr, None)
            if fn is None:
                raise ImportError(f"{_WHAT}: {name} has no {attr}; this transformers is unsupported")
            if not hasattr(fn, "cpshard_original"):
                setattr(module, attr, make(fn))
        getattr(module, cls_name).cpshard_sequence_mixer = True
