"""transformers' Gated DeltaNet layers (Qwen3.5 text and VLM, Qwen3.5-MoE, Qwen3-Next) under CP,
with no change to the model.

Those layers call two functions of their modeling module: ``causal_conv1d_fn`` (the short
convolution in front of the recurrence) and ``torch_chunk_gated_delta_rule`` (the recurrence).
:data:`FAMILY` puts a dispatcher in their place (:mod:`cpshard.integrations.dispatch`): outside
a CP attention context it is the original function; inside one it is cpshard's per-document
convolution and gated delta rule over the step's shards (:mod:`cpshard.mixers`), states carried
across ranks. A cached (generation) call under CP is refused: CP shards training steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from cpshard.integrations.dispatch import conv_hook, mixing_state
from cpshard.integrations.hooks import Family, Hook
from cpshard.mixers import cp_gated_delta_rule, recurrence_runs

_WHAT = "cpshard.integrations.transformers (Gated DeltaNet)"
# modeling module -> the Gated DeltaNet class in it
MODULES = {
    "transformers.models.qwen3_5.modeling_qwen3_5": "Qwen3_5GatedDeltaNet",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet",
    "transformers.models.qwen3_next.modeling_qwen3_next": "Qwen3NextGatedDeltaNet",
}


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
        state = mixing_state(_WHAT)
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

    return torch_chunk_gated_delta_rule


_RULE_PARAMS = (
    "query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
    "use_qk_l2norm_in_kernel",
)  # fmt: skip

FAMILY = Family(
    "Gated DeltaNet",
    MODULES,
    functions={
        "causal_conv1d_fn": conv_hook(_WHAT),
        "torch_chunk_gated_delta_rule": Hook(_rule, _RULE_PARAMS),
    },
)
