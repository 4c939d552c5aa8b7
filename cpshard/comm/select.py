"""Which backend moves a tensor: the native NCCL communicator or torch.distributed."""

from __future__ import annotations

import torch

from cpshard._build import build_info
from cpshard.comm.backend_name import device_backend
from cpshard.comm.group import Group
from cpshard.comm.host_staged import HostStagedTransport
from cpshard.comm.torch_backend import TorchTransport
from cpshard.comm.verbs import Transport


def uses_native_nccl(group: Group, like: torch.Tensor) -> bool:
    """Whether ``like``'s transfers over ``group`` go through the native NCCL communicator: a
    CUDA tensor, a group whose CUDA backend is NCCL (whatever form its backend string takes:
    ``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ``"undefined"`` with NCCL bound to CUDA), and an
    extension built with the communicator."""
    if group.pg is None or not like.is_cuda or not build_info().nccl:
        return False
    return device_backend(group.backend, group.pg, "cuda") == "nccl"


def transport_for(group: Group, like: torch.Tensor) -> Transport:
    """The native NCCL communicator for CUDA tensors on an NCCL group when the extension was
    built with it, else ``torch.distributed``: staged through host copies for device tensors
    on a group that moves them over gloo (host memory only)."""
    assert group.pg is not None
    if uses_native_nccl(group, like):
        from cpshard.comm import nccl

        return nccl.communicator(group, like.device)
    torch_transport = TorchTransport(group)
    if like.device.type != "cpu" and torch_transport.uses_gloo(like.device):
        return HostStagedTransport(torch_transport)
    return torch_transport
