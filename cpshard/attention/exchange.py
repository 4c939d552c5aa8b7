"""The protocol of a step's K/V exchange: how a rank's own K/V become the key buffer its query
spans index, and how the buffer's gradients go back to their owners.

Two implementations: the multi-hop halo (:mod:`cpshard.attention.halo`: contiguous shards, each
rank receives the rows before its first token that its documents reach back to) and the
needed-rows all-to-all-v (:mod:`cpshard.attention.needed_rows`: any layout, each rank receives
exactly the rows its runs reach). Each is a pair of ``torch.library`` custom ops keyed by the
step state's registry key, with fake kernels; :func:`register_exchange_autograd` makes the
adjoint op the backward of the forward one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class KVExchange(Protocol):
    """A step's K/V exchange for this rank (host metadata made once per step)."""

    @property
    def key_len(self) -> int:
        """Rows per batch row of the key buffer :meth:`extend` returns."""
        ...

    @property
    def plan(self) -> tuple[int, ...]:
        """Integers every rank derives alike from the step (the checked-mode consensus, and the
        transfers' fingerprint)."""
        ...

    @property
    def received_rows(self) -> int:
        """K/V rows (over every batch row) this rank receives from the others per exchange."""
        ...

    @property
    def most_rows_moved(self) -> int:
        """The most K/V rows (over every batch row) any rank receives over a training step's
        three transfers: the forward exchange, the backward's re-exchange and the gradients'
        return (alike on every rank: the cost model's figure)."""
        ...

    @property
    def most_rows_received(self) -> int:
        """The most K/V rows (over every batch row) any rank receives per exchange (alike on
        every rank: the memory model's figure)."""
        ...

    @property
    def keeps_local(self) -> bool:
        """True when the key buffer is this rank's own K/V as they are (nothing exchanged: a
        group of one), so the attention takes K and V apart, unjoined."""
        ...

    def extend(self, kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """This rank's K/V ``[B, H, L, D]`` -> the key buffer ``[B, H, key_len, D]`` (``key``:
        the step state's registry key, which the exchange's custom op takes)."""
        ...

    def restore(self, grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
        """Adjoint of :meth:`extend`: the buffer's gradient -> this rank's ``[B, H, length, D]``,
        each row's gradients added by its owner."""
        ...

    def place_on(self, device: torch.device) -> None:
        """Copy the exchange's tables to ``device`` (once per step, at the step's setup)."""
        ...


def register_exchange_autograd(
    op: torch.library.CustomOpDef,
    adjoint: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
) -> None:
    """The autograd of a K/V exchange op ``op(kv, key)`` of the step ``key``: its adjoint op
    ``adjoint(grad, key, length)`` (``length``: the tokens of ``kv``)."""

    def keep(ctx, inputs, output) -> None:
        kv, ctx.key = inputs
        ctx.length = kv.shape[2]

    def backward(ctx, grad: torch.Tensor):
        return adjoint(grad, ctx.key, ctx.length), None

    op.register_autograd(backward, setup_context=keep)
