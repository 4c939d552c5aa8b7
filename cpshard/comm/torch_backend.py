"""The transport verbs on ``torch.distributed`` (gloo on CPU; NCCL through torch for CUDA
tensors when the extension has no native communicator)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from cpshard.comm.backend_name import device_backend
from cpshard.comm.group import Group
from cpshard.comm.hugepages import new_buffer
from cpshard.comm.torch_compat import all_gather_single, reduce_scatter_single
from cpshard.comm.verbs import offsets


def _flat(t: torch.Tensor) -> torch.Tensor:
    """t as a contiguous 1-D tensor (gloo silently corrupts non-contiguous tensors)."""
    return t.contiguous().view(-1)


# reduce_scatter_v: one all-to-all while its [W, max n] staging buffer stays under this; above,
# pipelined point-to-point rounds through two buffers of at most half of it.
A2A_STAGING_BYTES = 16 << 20

# Point-to-point tags: untagged transfers use 0 and the pipelined reduce-scatter its round
# numbers (< 2**20); a fingerprinted transfer uses its fingerprint folded into [2**20, 2**31).
_KEY_TAG_BASE = 1 << 20


def key_tag(key: int) -> int:
    """The point-to-point tag of a transfer whose arguments have fingerprint ``key``."""
    return _KEY_TAG_BASE + key % ((1 << 31) - _KEY_TAG_BASE)


class TorchTransport:
    """The verbs on ``torch.distributed``.

    Strategy (measured by ``cpshard bench --ops strategies`` on gloo over loopback, where the
    bytes copied dominate; figures in the README):

    * gathers (equal or uneven) go by batched point-to-point straight into each rank's slot of
      the output: no padding, no staging (on gloo this also beats its all-gather, which stages);
      equal gathers on NCCL through torch use the in-place all-gather;
    * reduce-scatters go by one ``all_to_all_single`` with exact splits into a ``[W, n_rank]``
      buffer when ``W * max(n) * elem`` is at most :data:`A2A_STAGING_BYTES`, else by pipelined
      point-to-point rounds: rank r's part is cut into pieces that fit a ``[W, piece]`` buffer of
      half that size, two such buffers alternate so the sum of one round overlaps the transfer
      of the next; peak staging stays at 16 MiB instead of ``W * n``. Both sum the W
      contributions in rank order (a sum over dim 0), so results are deterministic and
      identical between the two routes. Equal reduce-scatters on gloo take the same routes,
      since gloo emulates its reduce-scatter with a full all-reduce (twice the traffic).

    torch's collectives are called by their newest names on every supported torch
    (:mod:`cpshard.comm.torch_compat`).
    """

    def __init__(self, group: Group) -> None:
        assert group.pg is not None
        self.group = group
        self.pg = group.pg

    def uses_gloo(self, device: torch.device) -> bool:
        """Whether the group moves tensors on ``device`` over gloo, whatever form its backend
        string takes (``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ``"undefined"`` with gloo bound to
        that device type): gloo takes the point-to-point routes, others the collectives."""
        return device_backend(self.group.backend, self.pg, device.type) == "gloo"

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.pg, rank)

    def all_gather(self, out: torch.Tensor, local: torch.Tensor, key: int | None = None) -> None:
        self.all_gather_v(out, local, [local.numel()] * self.group.world, key)

    def all_gather_v(
        self, out: torch.Tensor, local: torch.Tensor, sizes: Sequence[int], key: int | None = None
    ) -> None:
        offs = offsets(sizes)
        me = self.group.rank
        out[offs[me] : offs[me + 1]].copy_(_flat(local))
        if len(set(sizes)) > 1 or self.uses_gloo(out.device):
            peers = [r for r in range(self.group.world) if r != me]
            self.send_recv(
                [(r, out[offs[me] : offs[me + 1]]) for r in peers if sizes[me]],
                [(r, out[offs[r] : offs[r + 1]]) for r in peers if sizes[r]],
                key,
            )
        else:
            # In place: this rank's slot is the input (NCCL reads it before writing others).
            all_gather_single(out, out[offs[me] : offs[me + 1]], group=self.pg)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        if self.uses_gloo(out.device):
            self.reduce_scatter_v(out, full, [out.numel()] * self.group.world)
        else:
            reduce_scatter_single(out, _flat(full), group=self.pg)

    def reduce_scatter_v(self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]) -> None:
        full = _flat(full)
        if self.group.world * max(sizes) * full.element_size() <= A2A_STAGING_BYTES:
            self._reduce_scatter_all_to_all(out, full, sizes)
        else:
            self._reduce_scatter_pipelined(out, full, sizes)

    def _reduce_scatter_all_to_all(
        self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]
    ) -> None:
        world, n = self.group.world, sizes[self.group.rank]
        stage = new_buffer(full, world * n)
        dist.all_to_all_single(
            stage, full, output_split_sizes=[n] * world, input_split_sizes=list(sizes), group=self.pg
        )
        torch.sum(stage.view(world, n), dim=0, out=out.view(n))

    def _reduce_scatter_pipelined(
        self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]
    ) -> None:
        """Round k moves piece k of every rank's part (pieces of ``piece`` elements, the same
        cut on every rank) and sums the previous round's pieces meanwhile."""
        world, me = self.group.world, self.group.rank
        offs = offsets(sizes)
        piece = max(1, A2A_STAGING_BYTES // 2 // (world * full.element_size()))
        rounds = [-(-s // piece) for s in sizes]
        width = min(piece, sizes[me])
        bufs = [new_buffer(full, (world, width)) for _ in range(min(2, rounds[me]))]
        peers = [r for r in range(world) if r != me]
        pending: tuple[int, int, torch.Tensor, list] | None = None
        for k in range(max(rounds) + 1):
            works: list = []
            current = None
            if k < max(rounds):
                ops = [
                    dist.P2POp(
                        dist.isend,
                        full[offs[r] + k * piece : offs[r] + min(sizes[r], (k + 1) * piece)],
                        self._peer(r),
                        self.pg,
                        tag=k,
                    )
                    for r in peers
                    if k < rounds[r]
                ]
                if k < rounds[me]:
                    lo, hi = k * piece, min(sizes[me], (k + 1) * piece)
                    stage = bufs[k % 2][:, : hi - lo]
                    stage[me].copy_(full[offs[me] + lo : offs[me] + hi])
                    ops += [
                        dist.P2POp(dist.irecv, stage[r], self._peer(r), self.pg, tag=k)
                        for r in peers
                    ]
                    current = (lo, hi, stage)
                works = dist.batch_isend_irecv(ops) if ops else []
            if pending is not None:
                lo, hi, stage, done = pending
                for work in done:
                    work.wait()
                torch.sum(stage, dim=0, out=out[lo:hi])
                pending = None
            if current is not None:
                pending = (*current, works)
            else:
                for work in works:
                    work.wait()

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        key: int | None = None,
    ) -> None:
        """Batched point-to-point. A ``key`` becomes the messages' tag (see :func:`key_tag`): a
        message only matches a receive posted with the same fingerprint, so ranks that disagree
        on the call's arguments never exchange data (they fail by the group's timeout) instead
        of silently receiving the wrong rows, at no extra message."""
        for r, t in recvs:
            if not t.is_contiguous():
                raise RuntimeError(f"send_recv: receive buffer from rank {r} must be contiguous")
        tag = 0 if key is None else key_tag(key)
        ops = [dist.P2POp(dist.isend, _flat(t), self._peer(r), self.pg, tag=tag) for r, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self._peer(r), self.pg, tag=tag) for r, t in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
