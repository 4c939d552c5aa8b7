"""The verbs staged through host copies (``cpshard.comm.host_staged``) give what the host
transport gives, at W = 2 and 3 on gloo, and device tensors on a gloo group are routed to them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard.comm import TorchTransport, resolve_group, transport_for
from cpshard.comm.host_staged import HostStagedTransport


def _verbs(transport, rank: int, world: int) -> list[torch.Tensor]:
    sizes = [2 + 3 * r for r in range(world)]
    total = sum(sizes)
    local = torch.arange(sizes[rank], dtype=torch.float64) + 100 * rank
    equal = torch.arange(4, dtype=torch.float64) + 10 * rank
    full = torch.arange(total, dtype=torch.float64) * (rank + 1)
    full_eq = torch.arange(4 * world, dtype=torch.float64) * (rank + 1)
    outs = [
        torch.full((4 * world,), -1.0, dtype=torch.float64),
        torch.full((total,), -1.0, dtype=torch.float64),
        torch.full((4,), -1.0, dtype=torch.float64),
        torch.full((sizes[rank],), -1.0, dtype=torch.float64),
        torch.full((3,), -1.0, dtype=torch.float64),
    ]
    transport.all_gather(outs[0], equal)
    transport.all_gather_v(outs[1], local, sizes)
    transport.reduce_scatter(outs[2], full_eq)
    transport.reduce_scatter_v(outs[3], full, sizes)
    ring = torch.arange(3, dtype=torch.float64) + rank
    transport.send_recv([((rank + 1) % world, ring)], [((rank - 1) % world, outs[4])])
    return outs


def _staged_equals_host(rank: int, world: int) -> list[bool]:
    group = resolve_group(dist.group.WORLD, "test")
    host = _verbs(TorchTransport(group), rank, world)
    staged = _verbs(HostStagedTransport(TorchTransport(group)), rank, world)
    routed = transport_for(group, torch.empty(0, device="meta"))  # a non-host tensor
    return [torch.equal(a, b) for a, b in zip(host, staged, strict=True)] + [
        isinstance(routed, HostStagedTransport),
        isinstance(transport_for(group, host[0]), TorchTransport),
    ]


@pytest.mark.parametrize("world", [2, 3])
def test_staged_verbs_equal_the_host_transports(pools, world: int) -> None:
    for same in pools(world).run(_staged_equals_host):
        assert all(same), same
