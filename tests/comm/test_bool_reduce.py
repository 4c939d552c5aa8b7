"""A bool reduce-scatter is a logical or, on every path: torch's transport (gloo here; torch's
NCCL backend maps a bool SUM to MAX) and the native NCCL communicator (a MAX of 0/1 bytes,
checked in ``tests/comm/test_nccl.py`` on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard.comm import TorchTransport, resolve_group


def _bool_reduce(rank: int, world: int, staging: int | None) -> tuple[list[bool], list[bool]]:
    from cpshard.comm import torch_backend

    g = resolve_group(dist.group.WORLD, "test")
    transport = TorchTransport(g)
    saved = torch_backend.A2A_STAGING_BYTES
    if staging is not None:
        torch_backend.A2A_STAGING_BYTES = staging  # the pipelined path
    try:
        # rank r sets element i when (i + r) % 4 == 0: element i's or is over ranks
        sizes = [3, 1, 4][:world]
        full = torch.tensor([(i + rank) % 4 == 0 for i in range(sum(sizes))])
        out_v = torch.empty(sizes[rank], dtype=torch.bool)
        transport.reduce_scatter_v(out_v, full, sizes)
        even = torch.tensor([(i + rank) % 4 == 0 for i in range(2 * world)])
        out = torch.empty(2, dtype=torch.bool)
        transport.reduce_scatter(out, even)
    finally:
        torch_backend.A2A_STAGING_BYTES = saved
    return out_v.tolist(), out.tolist()


@pytest.mark.parametrize("staging", [None, 2])
def test_bool_reduce_scatter_is_a_logical_or(pools, staging: int | None) -> None:
    world = 3
    sizes = [3, 1, 4]
    offs = [0, 3, 4, 8]
    for rank, (got_v, got) in enumerate(pools(world).run(_bool_reduce, staging)):
        want_v = [
            any((i + r) % 4 == 0 for r in range(world)) for i in range(offs[rank], offs[rank + 1])
        ]
        want = [any((i + r) % 4 == 0 for r in range(world)) for i in range(2 * rank, 2 * rank + 2)]
        assert got_v == want_v and got == want, (rank, got_v, got)
        assert len(got_v) == sizes[rank]
