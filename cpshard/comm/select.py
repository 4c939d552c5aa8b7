"""Which backend moves a tensor: the native NCCL communicator or torch.distributed."""

from __future__ import annotations

import torch

from cpshard._build import build_info
from cpshard.comm.group import Group
from cpshard.comm.torch_backend import TorchTransport
from cpshard.comm.verbs import Transport


def transport_for(group: Group, like: torch.Tensor) -> Transport:
    """The native NCCL communicator for CUDA tensors on an NCCL group when the extension was
    built with it, else ``torch.distributed``."""
    assert group.pg is not None
    if like.is_cuda and group.backend == "nccl" and build_info().nccl:
        from cpshard.comm import nccl

        return nccl.communicator(group, like.device)
    return TorchTransport(group)
