"""The loss of a simulated training step, as a pluggable callable from the model's last hidden
states and its LM head: ``loss(hidden [B, L, D], head, labels [B, L], group) -> scalar``:
the full-logits loss, and the chunked one that never holds the logits (:data:`LOSSES`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cpshard.comm import GroupLike
from cpshard.linear_loss import cp_linear_cross_entropy
from cpshard.loss import cp_cross_entropy

StepLoss = Callable[[torch.Tensor, torch.nn.Module, torch.Tensor, GroupLike], torch.Tensor]


def full_logits_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, group: GroupLike
) -> torch.Tensor:
    """:func:`cpshard.cp_cross_entropy` of the full ``[B, L, V]`` logits ``head(hidden)``."""
    return cp_cross_entropy(head(hidden), labels, group)


def linear_cross_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor, group: GroupLike
) -> torch.Tensor:
    """:func:`cpshard.cp_linear_cross_entropy` from ``hidden`` and the head's weight and bias, a
    chunk of tokens at a time (no ``[B, L, V]`` logits)."""
    return cp_linear_cross_entropy(hidden, head.weight, labels, group, bias=head.bias)


LOSSES: dict[str, StepLoss] = {
    "cross_entropy": full_logits_cross_entropy,
    "linear_cross_entropy": linear_cross_entropy,
}


class LossModule(torch.nn.Module):
    """``loss(hidden, head, labels, group)`` as a module, so that torch's module tracking sees
    the loss's forward and backward (its memory is reported as the loss's)."""

    def __init__(self, head: torch.nn.Module, loss: StepLoss, group: GroupLike) -> None:
        super().__init__()
        self.head = head
        self.loss = loss
        self.group = group

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(hidden, self.head, labels, self.group)
