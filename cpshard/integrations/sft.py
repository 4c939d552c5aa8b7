"""TRL's ``SFTTrainer`` under cpshard context parallelism: :class:`CPSFTTrainer`, used exactly
like ``SFTTrainer`` plus ``cp_size`` (``layout``, ``strategy``); ``packing=True`` (padding-free
rows of several documents) is what it is for. See :mod:`cpshard.integrations.trainer`.

What differs from the plain ``Trainer`` is TRL's own bookkeeping: its token count (``num_tokens``)
reads the length of the batch the model gets, and its evaluation loss is each rank's token mean
of its batch; both are restated here for the full batch of a CP group.
"""

from __future__ import annotations

from typing import Any

import torch

from cpshard.integrations.trainer import ContextParallelMixin

try:
    from trl import SFTTrainer
except ImportError as exc:
    raise ImportError(
        "cpshard's CPSFTTrainer needs TRL (SFTTrainer): pip install 'cpshard[trl]' "
        "(CPTrainer, for transformers' Trainer, does not)"
    ) from exc

__all__ = ["CPSFTTrainer"]


class CPSFTTrainer(ContextParallelMixin, SFTTrainer):
    """``trl.SFTTrainer`` under cpshard CP (``cp_size``, ``layout``, ``strategy``)."""

    _trainer_cp_loss = "trl_fused_lm_head"  # TRL's loss from the hidden states

    def _prepare_context_parallel_inputs(
        self, model: torch.nn.Module, inputs: dict[str, Any]
    ) -> tuple[Any, dict[str, Any]]:
        """The CP hook, remembering the full batch's length as TRL counts it (before sharding)."""
        if self.cp_size > 1:
            mask = inputs.get("attention_mask")
            self._full_batch_tokens = (
                int(mask.sum()) if mask is not None else inputs["position_ids"].size(1)
            )
        return super()._prepare_context_parallel_inputs(model, inputs)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        """TRL's loss; in training under CP its ``num_tokens`` counts each CP group's full
        batch once, gathered as TRL gathers it (TRL would add up the shards' padded lengths over
        every rank)."""
        if self.cp_size == 1 or not self.model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        before = self._total_train_tokens
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        full = torch.tensor([self._full_batch_tokens], device=self.args.device)
        self._total_train_tokens = before + self._gather_per_cp_group(full).sum().item() // self._tp_size
        self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result

    def _cp_prediction_loss(
        self, model: torch.nn.Module, inputs: dict[str, Any], ignore_keys: list[str] | None
    ) -> torch.Tensor | None:
        """TRL's evaluation loss is the token mean of the rank's batch. Under CP, TRL's loss of
        the shard (the mean over the shard's labelled targets) times their count is the shard's
        summed loss; over the batch's count, times ``cp``, the CP group's mean is the batch's."""
        if "labels" not in inputs:
            return None
        inputs = self._prepare_inputs(inputs)
        targets = inputs.get("shift_labels")
        targets = inputs["labels"][..., 1:] if targets is None else targets
        batch_count = targets.ne(-100).sum().clamp(min=1)
        ctx, local = self._prepare_context_parallel_inputs(model, inputs)
        with torch.no_grad(), self.compute_loss_context_manager(), ctx():
            shard_mean = self.compute_loss(model, local)
        shard_count = local["shift_labels"].ne(-100).sum()
        return (shard_mean * shard_count * self.cp_size / batch_count).detach()
