"""The transport verbs for device tensors over a backend that moves host memory only (gloo):
each transfer staged through host copies.

gloo's point-to-point and all-to-all take CPU tensors only. With CUDA tensors on a gloo group
(several ranks sharing one GPU, where NCCL refuses two ranks on one device: the GPU check's
multi-rank stages), every verb copies its inputs to host buffers, runs the host transport, and
copies the results back into the device outputs. The copies wait for the device, so the staging
runs with the CUDA sync-debug mode suspended: it stands in for a device transport, and
whatever runs around it (the kernels, the attention, the per-step metadata) stays checked.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from cpshard.comm.verbs import Transport


@contextmanager
def _syncs_allowed() -> Iterator[None]:
    """The CUDA sync-debug mode off inside (restored after): the staging's copies must wait."""
    mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if mode:
        torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        if mode:
            torch.cuda.set_sync_debug_mode(mode)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``t``."""
    return t.detach().to("cpu", copy=True).contiguous()


class HostStagedTransport:
    """``inner``'s verbs (a host transport) on tensors of any device, staged through host
    copies: inputs copied to the host, outputs written back in place."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    def all_gather(self, out: torch.Tensor, local: torch.Tensor, key: int | None = None) -> None:
        with _syncs_allowed():
            staged = torch.empty(out.shape, dtype=out.dtype)
            self.inner.all_gather(staged, _host(local), key)
            out.copy_(staged)

    def all_gather_v(
        self, out: torch.Tensor, local: torch.Tensor, sizes: Sequence[int], key: int | None = None
    ) -> None:
        with _syncs_allowed():
            staged = torch.empty(out.shape, dtype=out.dtype)
            self.inner.all_gather_v(staged, _host(local), sizes, key)
            out.copy_(staged)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        with _syncs_allowed():
            staged = torch.empty(out.shape, dtype=out.dtype)
            self.inner.reduce_scatter(staged, _host(full))
            out.copy_(staged)

    def reduce_scatter_v(self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]) -> None:
        with _syncs_allowed():
            staged = torch.empty(out.shape, dtype=out.dtype)
            self.inner.reduce_scatter_v(staged, _host(full), sizes)
            out.copy_(staged)

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        key: int | None = None,
    ) -> None:
        with _syncs_allowed():
            staged = [(r, torch.empty(t.shape, dtype=t.dtype)) for r, t in recvs]
            self.inner.send_recv([(r, _host(t)) for r, t in sends], staged, key)
            for (_, t), (_, host) in zip(recvs, staged, strict=True):
                t.copy_(host)
