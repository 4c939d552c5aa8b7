"""Llama 4's attention temperature tuning under CP, exact.

Llama 4's layers without RoPE scale their queries by ``1 + attn_scale * log1p(floor((p + 1) /
floor_scale))`` of each token's position ``p``, which transformers counts in the tensor it is
given (``arange`` of its length, or the cache position): under CP that is the rank's shard of
a packed row, not the token's document, and the step would train wrong with no error. A
document alone counts from 0, as its ``position_ids`` do under CP.

:data:`FAMILY` puts a dispatcher in place of the attention class's ``forward``: outside a CP
step (and its recompute) it is the original; inside one it runs the original with the
layer's own scaling off and marks the layer, and :func:`scaled_queries` (called by cpshard's
attention function) applies the same scaling on the document positions. A tuned layer that
reaches cpshard's attention without the mark (a transformers whose attention class does not
match the hook) is refused there, on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from cpshard.attention.state import active_state
from cpshard.attention.tokens import state_for_tokens, step_positions
from cpshard.integrations.hooks import Family, Hook

MODULES = {"transformers.models.llama4.modeling_llama4": "Llama4TextAttention"}
_MARK = "cpshard_document_temperature"


def tuned(module: torch.nn.Module) -> bool:
    """Whether ``module`` scales its queries by position (temperature tuning, no RoPE)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(
        module, "use_rope", True
    )


def _forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        under_cp = state_for_tokens(kwargs.get("position_ids"), active_state()) is not None
        if not (under_cp and tuned(self)):
            return original(self, *args, **kwargs)
        self.attn_temperature_tuning = False  # the attention function scales instead
        setattr(self, _MARK, True)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.attn_temperature_tuning = True
            delattr(self, _MARK)

    return forward


FAMILY = Family(
    "Llama 4 attention temperature",
    MODULES,
    methods={"forward": Hook(_forward, ("self", "hidden_states"))},
    mixer=False,  # its attention reaches cpshard; scaled_queries refuses what is not hooked
)


def scaled_queries(
    module: torch.nn.Module, query: torch.Tensor, position_ids: torch.Tensor | None, where: str
) -> torch.Tensor:
    """``query`` (``[B, H, L, D]``) as the layer scales it for a document alone: by the
    temperature of each token's document position (``position_ids``, ``[B, L]``; where the
    model passes none to its attention, the step's sharded batch's), computed as transformers
    computes it; unchanged for a layer that does not scale. Raises ``ValueError`` for a tuned
    layer whose own scaling the hook did not turn off, or whose positions are unknown."""
    if getattr(module, _MARK, False):
        state = state_for_tokens(position_ids, active_state())
        if position_ids is None and state is not None:
            position_ids = step_positions(state)
        if position_ids is None or position_ids.shape != (query.shape[0], query.shape[2]):
            raise ValueError(
                f"{where}: {type(module).__name__} scales its queries by attention temperature "
                "tuning, which under CP needs each token's document position as [batch, tokens] "
                f"position_ids, and none of that shape reached it: set "
                "attn_temperature_tuning=False or train this model without CP"
            )
        p = position_ids.to(query.device).float()
        scales = torch.log1p(torch.floor((p + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
        return (query * scales[:, None, :, None]).to(query.dtype)
    if tuned(module):
        raise ValueError(
            f"{where}: {type(module).__name__} scales its queries by attention temperature "
            "tuning over positions it counts in this rank's shard, not in each document, and "
            "cpshard's hook that makes it exact is not active for this transformers (`cpshard "
            "env` says why): set attn_temperature_tuning=False or train this model without CP"
        )
    return query
