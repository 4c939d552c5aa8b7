"""The transport backends: the only package that calls ``torch.distributed`` collectives or
the native NCCL communicator.

* :mod:`~cpshard.comm.group`: ``group`` arguments resolved to a :class:`Group`;
* :mod:`~cpshard.comm.verbs`: the verbs' protocol (flat tensors, exact offsets, no shapes);
* :mod:`~cpshard.comm.torch_backend`: the verbs on ``torch.distributed``;
* :mod:`~cpshard.comm.host_staged`: the verbs for device tensors over gloo, through host copies;
* :mod:`~cpshard.comm.nccl`: the verbs on the native NCCL communicator (CUDA builds);
* :mod:`~cpshard.comm.nccl_runtime`: the NCCL libraries loaded at run time and their versions;
* :mod:`~cpshard.comm.select`: which backend serves a tensor;
* :mod:`~cpshard.comm.host`: the host-side channel of the per-step consensus;
* :mod:`~cpshard.comm.reduce`: sum reductions (a loss's token count, parameter gradients);
* :mod:`~cpshard.comm.hugepages`: fresh CPU buffers backed by transparent huge pages;
* :mod:`~cpshard.comm.collectives`: the verbs as ``torch.library`` custom ops keyed by group
  name, with fake kernels and autograd, so ``torch.compile`` traces the transport;
* :mod:`~cpshard.comm.heads`: the sequence <-> head all-to-alls of head-parallel attention, the
  same kind of ops.
"""

from cpshard.comm.group import Group, GroupLike, group_from_name, resolve_group, split_cp_mesh
from cpshard.comm.host import all_gather_bytes, all_gather_small
from cpshard.comm.nvtx import nvtx_range
from cpshard.comm.reduce import all_reduce_sum_
from cpshard.comm.select import transport_for
from cpshard.comm.torch_backend import TorchTransport
from cpshard.comm.verbs import Transport, offsets

__all__ = [
    "Group",
    "GroupLike",
    "TorchTransport",
    "Transport",
    "all_gather_bytes",
    "all_gather_small",
    "all_reduce_sum_",
    "group_from_name",
    "nvtx_range",
    "offsets",
    "resolve_group",
    "split_cp_mesh",
    "transport_for",
]
