"""Memory-bounded sequence transport for Step-5 context parallelism (mirror of
``nemo_automodel.components.models.step5.cp``).

The functions are cpshard's own transport (:mod:`cpshard.transport`): their NeMo signatures are
a prefix of cpshard's (which add ``seq_dim``, per-rank halo sizes and multi-hop halos), and
``group`` may also be a 1-D ``DeviceMesh``. The ``Function`` classes run the same functions
(:mod:`cpshard.nemo._autograd`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx

from cpshard.nemo._autograd import reentrant_backward, reentrant_forward
from cpshard.transport import gather_halo, gather_metadata, gather_sequence

__all__ = ["gather_halo", "gather_metadata", "gather_sequence"]


class _GatherSequence(torch.autograd.Function):
    """Gather directly into one allocation; reduce-scatter the backward gradient."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return reentrant_forward(ctx, gather_sequence, x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return reentrant_backward(ctx, grad_output, 1)


class _GatherHalo(torch.autograd.Function):
    """Exchange only the preceding window and return its gradients to its owners."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup, halo_size: int, left_padding: int
    ) -> torch.Tensor:
        return reentrant_forward(ctx, gather_halo, x, group, halo_size, left_padding)

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return reentrant_backward(ctx, grad_output, 3)
