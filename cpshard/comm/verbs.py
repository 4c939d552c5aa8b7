"""The collective verbs every transport backend implements, on flat contiguous tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Transport(Protocol):
    """The collective verbs, all on flat contiguous tensors of one dtype.

    ``sizes[r]`` is rank r's number of elements; ``out``/``full`` hold every rank's part back to
    back in rank order (exact offsets, no padding). Every verb issues its data transfer and
    nothing else: argument agreement across ranks is the caller's (per step, or per call in
    checked mode). ``key`` is a fingerprint of the caller's arguments: a backend that can make
    it part of how messages match (gloo: the point-to-point tag) keeps ranks that disagree from
    exchanging data; others ignore it.
    """

    def all_gather(self, out: torch.Tensor, local: torch.Tensor, key: int | None = None) -> None: ...
    def all_gather_v(
        self, out: torch.Tensor, local: torch.Tensor, sizes: Sequence[int], key: int | None = None
    ) -> None: ...
    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None: ...
    def reduce_scatter_v(self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]) -> None: ...
    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        key: int | None = None,
    ) -> None: ...


def offsets(sizes: Sequence[int]) -> list[int]:
    """Where each rank's part starts in a buffer that holds them back to back, and the end."""
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def all_to_all_v(
    comm: Transport,
    rank: int,
    out: torch.Tensor,
    x: torch.Tensor,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    key: int | None = None,
) -> None:
    """An all-to-all-v on any transport, as point-to-point: ``x`` holds the parts for every rank
    back to back (``send_sizes[r]`` elements for rank r), ``out`` receives every rank's part for
    this one (``recv_sizes[r]`` from rank r). This rank's own part is copied, the others go in
    one batched :meth:`Transport.send_recv` (no padding, empty parts left out)."""
    x = x.contiguous().view(-1)
    so, ro = offsets(send_sizes), offsets(recv_sizes)
    out[ro[rank] : ro[rank + 1]].copy_(x[so[rank] : so[rank + 1]])
    peers = [r for r in range(len(send_sizes)) if r != rank]
    comm.send_recv(
        [(r, x[so[r] : so[r + 1]]) for r in peers if send_sizes[r]],
        [(r, out[ro[r] : ro[r + 1]]) for r in peers if recv_sizes[r]],
        key,
    )
