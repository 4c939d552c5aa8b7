"""GPU checks (skipped without a CUDA device and cpshard's CUDA build): the CUDA kernels against
their CPU twins, and the native NCCL communicator at world size 1 against torch.distributed.

NCCL refuses two ranks on one GPU, so multi-rank NCCL is exercised by ``cpshard bench`` on
multi-GPU machines; here one rank checks every verb end to end.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not cpshard.build_info().cuda_kernels,
        reason="needs a GPU and cpshard's CUDA build",
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_cuda_kernels_match_cpu(dtype: torch.dtype) -> None:
    x = (torch.arange(2 * 11 * 5) % 7).reshape(2, 11, 5).to(dtype)
    counts, idx = [3, 0, 8], torch.tensor([4, -1, 0, 10, 4])
    for pad in (None, 9):
        want = ops.pack_ragged(x, counts, 1, pad_to=pad, fill=1)
        got = ops.pack_ragged(x.cuda(), counts, 1, pad_to=pad, fill=1)
        assert torch.equal(got.cpu(), want)
        back = ops.unpack_ragged(got, counts, x.shape, 1, pad_to=pad)
        assert torch.equal(back.cpu(), x)
    w = x[:, :10].reshape(2, 2, 5, 5).transpose(0, 1).contiguous()
    assert torch.equal(ops.interleave_sequence(w.cuda(), 1).cpu(), ops.interleave_sequence(w, 1))
    assert torch.equal(ops.deinterleave_sequence(x[:, :10].cuda(), 2, 1).cpu(), ops.deinterleave_sequence(x[:, :10], 2, 1))
    assert torch.equal(ops.index_gather(x.cuda(), idx.cuda(), 1, fill=0).cpu(), ops.index_gather(x, idx, 1, fill=0))
    if dtype != torch.bool:
        g = torch.randn(2, 5, 5).to(dtype)
        want = ops.index_scatter_add(g, idx, 1, 11)
        got = ops.index_scatter_add(g.cuda(), idx.cuda(), 1, 11).cpu()
        assert torch.equal(got, want) if not dtype.is_floating_point else torch.allclose(got.float(), want.float(), atol=1e-2)


def test_cuda_document_segments_match_cpu() -> None:
    doc = torch.tensor([[1, 1, 0, 2, 2, 2, 3, 0, 3, 3], [5] * 10, [0] * 10])
    for start, end in [(0, 10), (1, 6), (4, 9), (3, 3)]:
        want = ops.document_segments(doc, start, end)
        got = ops.document_segments(doc.cuda(), start, end)
        for a, b in zip(want, got):
            assert torch.equal(a, b.cpu())


@pytest.fixture
def nccl_world1():
    if not cpshard.build_info().nccl:
        pytest.skip("cpshard was built without the NCCL communicator")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_native_nccl_verbs_at_world_1(nccl_world1) -> None:
    from cpshard._nccl import communicator
    from cpshard.comm import resolve_group

    comm = communicator(resolve_group(nccl_world1, "test"))
    x = torch.randn(37, device="cuda")
    out = torch.empty(37, device="cuda")
    comm.all_gather(out, x)
    ref = torch.empty(37, device="cuda")
    dist.all_gather_into_tensor(ref, x, group=nccl_world1)
    assert torch.equal(out, ref)
    comm.all_gather_v(out, x, [37])
    assert torch.equal(out, x)
    comm.reduce_scatter(out, x)
    dist.reduce_scatter_tensor(ref, x, group=nccl_world1)
    assert torch.equal(out, ref)
    comm.reduce_scatter_v(out, x, [37])
    assert torch.equal(out, x)
    comm.send_recv([], [])
    torch.cuda.synchronize()


def test_transport_through_nccl_at_world_1(nccl_world1) -> None:
    """World size 1 aliases, as on CPU; the transport picks the native communicator."""
    from cpshard.comm import resolve_group, transport_for

    x = torch.randn(2, 5, 8, device="cuda", requires_grad=True)
    assert cpshard.gather_sequence(x, nccl_world1) is x
    assert cpshard.gather_ragged(x, nccl_world1, [5], dim=1) is x
    assert type(transport_for(resolve_group(nccl_world1, "test"), x)).__name__ == "NcclTransport"
