"""A transformers causal LM's loss from its final hidden states and its LM head, under CP.

The model's own loss multiplies the hidden states by the LM head and keeps the ``[tokens, V]``
logits (upcast to float32) for the backward. :func:`install` wraps the model's ``forward``: called
with ``cp_linear_loss=True`` and labels, it runs the base model and computes the same loss with
:func:`cpshard.cp_linear_cross_entropy` (chunks of tokens, logits never held), the labels shifted
as the model's loss shifts them or given pre-shifted as ``shift_labels``, over the Trainer's
``num_items_in_batch``. Without that keyword the original ``forward`` runs, so generation and
plain calls are unchanged. :func:`head_problem` says why a model cannot be served this way (an LM
head that is not a plain ``nn.Linear``, logits scaled or combined with a router loss, no base
model), in which case the model's own loss is used.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.batch.padding import IGNORE_INDEX
from cpshard.linear_loss import cp_linear_cross_entropy

__all__ = ["LINEAR_LOSS_KWARG", "head_problem", "install"]

LINEAR_LOSS_KWARG = "cp_linear_loss"
# Config fields by which some families scale their logits before the loss (MPT's and Cohere's
# logit_scale, Granite's logits_scaling, Falcon-H1's lm_head_multiplier, ...): not served.
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")


def head_problem(model: torch.nn.Module) -> str | None:
    """Why ``model``'s loss cannot be computed from its hidden states by
    :func:`cpshard.cp_linear_cross_entropy`, or None."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return f"{type(model).__name__} is not a transformers model"
    head = model.get_output_embeddings()
    if _module_class(head) is not torch.nn.Linear:
        return f"its LM head is {type(head).__name__}, not a plain torch.nn.Linear"
    if model.base_model is model:
        return "it has no base model to run without its LM head"
    text = model.config.get_text_config()
    for name in _LOGIT_SCALES:
        value = getattr(text, name, None)
        if value is not None and value != 1:
            return f"its config scales the logits ({name}={value})"
    if getattr(text, "output_router_logits", False):
        return "its loss adds a router loss (output_router_logits)"
    return None


def _module_class(module: object) -> type:
    """``module``'s class, the one FSDP2's ``fully_shard`` derived its own from where sharded."""
    from torch.distributed.fsdp import FSDPModule

    cls = type(module)
    if isinstance(module, FSDPModule):
        return next(base for base in cls.__bases__ if base is not FSDPModule)
    return cls


def install(model: torch.nn.Module) -> None:
    """Wrap ``model.forward`` (a model :func:`head_problem` accepts) so that a call with
    ``cp_linear_loss=True`` computes its causal-LM loss from the final hidden states."""
    original = model.forward
    softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    @functools.wraps(type(model).forward)
    def forward(
        self: torch.nn.Module, *args: Any, cp_linear_loss: bool = False, **kwargs: Any
    ) -> Any:
        unlabelled = kwargs.get("labels") is None and kwargs.get("shift_labels") is None
        if not cp_linear_loss or unlabelled:
            return original(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        labels, shifted = kwargs.pop("labels", None), kwargs.pop("shift_labels", None)
        count = kwargs.pop("num_items_in_batch", None)
        kwargs.pop("logits_to_keep", None)
        out = self.base_model(*args, **dict(kwargs, use_cache=False))
        hidden = out.last_hidden_state
        if shifted is None:  # as transformers' causal-LM loss shifts them
            shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        head = self.get_output_embeddings()
        weight, bias = (_full(p) for p in (head.weight, head.bias))
        loss = cp_linear_cross_entropy(
            hidden, weight, shifted.to(hidden.device), None, num_labelled=count,
            bias=bias, softcap=softcap,
        )  # fmt: skip
        return CausalLMOutputWithPast(
            loss=loss,
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
        )

    model.forward = types.MethodType(forward, model)


def _full(p: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as a plain tensor: FSDP2's DTensor gathered (differentiably)."""
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p
