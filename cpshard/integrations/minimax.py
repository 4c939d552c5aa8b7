"""transformers' lightning attention layers (MiniMax: a decayed linear attention beside its
softmax-attention layers) under CP, with no change to the model.

Unlike the other hybrid layers, MiniMax's lightning attention computes its recurrence inline in
its ``forward`` (block by block, with the decay tables it keeps as buffers), calling no function
of its modeling module that a dispatcher could replace. :data:`FAMILY` therefore puts a
dispatcher in place of the layer class's ``forward``: outside a CP attention context it is the
original method; inside one it runs the layer's own projections, activation, output norm and
gate around :func:`cpshard.mixers.cp_lightning_attention` (each document from a zero state, its
state carried across ranks), with the same arithmetic as the original. The padding mask is not
read under CP (the step's documents say which tokens are padding, and padding belongs to no
document); a cached (generation) call is refused, CP shards training steps.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.integrations.dispatch import cache_refused, mixing_state
from cpshard.integrations.hooks import Family, Hook
from cpshard.mixers import cp_lightning_attention, recurrence_runs

_WHAT = "cpshard.integrations.transformers (lightning attention)"
# modeling module -> the lightning attention class in it
MODULES = {"transformers.models.minimax.modeling_minimax": "MiniMaxLightningAttention"}


def _forward(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        state = mixing_state(_WHAT)
        if state is None:
            return original(
                self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs
            )
        if cache is not None or kwargs.get("past_key_values") is not None:
            raise cache_refused(state, _WHAT, "lightning attention")
        runs = recurrence_runs(state, _WHAT)
        batch, length, _ = hidden_states.shape
        heads, dim = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(batch, length, heads, 3 * dim)
        q, k, v = torch.split(qkv, dim, dim=3)
        out = cp_lightning_attention(q, k, v, self.slope_rate.reshape(heads), runs, state.group)
        out = self.norm(out.to(hidden_states.dtype).reshape(batch, length, heads * dim))
        out = F.sigmoid(self.output_gate(hidden_states)) * out
        return self.out_proj(out), None

    return forward


FAMILY = Family(
    "lightning attention",
    MODULES,
    methods={
        "forward": Hook(_forward, ("self", "hidden_states", "position_embeddings", "attention_mask"))
    },
)
