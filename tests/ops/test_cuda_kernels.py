"""The CUDA kernels of the native ops against their CPU twins: every op and dtype, no host sync
in the index ops, an out-of-range index failing on the device. Skipped without a CUDA device and
cpshard's CUDA build."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import cpshard
from cpshard import ops

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not cpshard.build_info().cuda_kernels,
    reason="needs a GPU and cpshard's CUDA build",
)


@needs_gpu
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
    assert torch.equal(
        ops.deinterleave_sequence(x[:, :10].cuda(), 2, 1).cpu(),
        ops.deinterleave_sequence(x[:, :10], 2, 1),
    )
    assert torch.equal(
        ops.index_gather(x.cuda(), idx.cuda(), 1, fill=0).cpu(), ops.index_gather(x, idx, 1, fill=0)
    )
    if dtype != torch.bool:
        g = torch.randn(2, 5, 5).to(dtype)
        want = ops.index_scatter_add(g, idx, 1, 11)
        got = ops.index_scatter_add(g.cuda(), idx.cuda(), 1, 11).cpu()
        assert (
            torch.equal(got, want)
            if not dtype.is_floating_point
            else torch.allclose(got.float(), want.float(), atol=1e-2)
        )


@needs_gpu
def test_ragged_moves_beyond_the_inline_ranks_reuse_a_device_table() -> None:
    """At W > 64 the counts travel in a device table made once per distinct counts: calls with
    the same counts upload nothing (no sync either), and a captured CUDA graph replays its
    table after other counts have had their own tables made and used."""
    world = 80
    counts = [(r * 7) % 5 for r in range(world)]
    other = [(r * 3) % 4 + 1 for r in range(world)]
    x = torch.randn(2, sum(counts), 3)
    want = ops.pack_ragged(x, counts, 1, pad_to=5, fill=0)
    xc = x.cuda()
    assert torch.equal(ops.pack_ragged(xc, counts, 1, pad_to=5, fill=0).cpu(), want)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = ops.pack_ragged(xc, counts, 1, pad_to=5, fill=0)
        back = ops.unpack_ragged(again, counts, xc.shape, 1, pad_to=5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again.cpu(), want) and torch.equal(back.cpu(), x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.pack_ragged(xc, counts, 1, pad_to=5, fill=0)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.pack_ragged(xc, counts, 1, pad_to=5, fill=0)
    y = torch.randn(2, sum(other), 3, device="cuda")
    for _ in range(3):  # other counts' tables made and used meanwhile
        ops.pack_ragged(y, other, 1, pad_to=5, fill=0)
    xc.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.cpu(), ops.pack_ragged(x * 2, counts, 1, pad_to=5, fill=0))


@needs_gpu
def test_cuda_index_ops_do_not_sync() -> None:
    """The bounds check is on the device: no host read of the index per call."""
    src = torch.randn(3, 40, 32, device="cuda")  # rows of 128 bytes: the row kernel
    idx = torch.tensor([5, -1, 39, 0, 5], device="cuda")
    idx32 = idx.to(torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = ops.index_gather(src, idx, 1, fill=0)
        ops.index_gather(src[:, :, :1].contiguous(), idx32, 1, fill=0)  # the per-element kernel
        grad = ops.index_scatter_add(out, idx, 1, 40)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(grad.cpu(), ops.index_scatter_add(out.cpu(), idx.cpu(), 1, 40))


_OUT_OF_RANGE = """
import torch
from cpshard import ops
src = torch.randn(2, 4, {post}, device="cuda")
idx = torch.tensor([0, 4], device="cuda")
{call}
torch.cuda.synchronize()
"""


@needs_gpu
@pytest.mark.parametrize(
    "post, call",
    [
        (3, "ops.index_gather(src, idx, 1)"),  # per-element kernel
        (64, "ops.index_gather(src, idx, 1)"),  # row kernel
        (3, "ops.index_scatter_add(src[:, :2].contiguous(), idx, 1, 4)"),
    ],
)
def test_cuda_index_out_of_range_fails_on_the_device(post: int, call: str) -> None:
    """An index beyond the bound fails a device-side assertion (in a child process: it poisons
    the CUDA context) instead of reading or writing out of bounds."""
    code = _OUT_OF_RANGE.format(post=post, call=call)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    told = run.stderr + run.stdout
    assert run.returncode != 0, told[-2000:]
    assert "device-side assert" in told or "an index is >=" in told, told[-2000:]


@needs_gpu
def test_cuda_document_segments_match_cpu() -> None:
    doc = torch.tensor([[1, 1, 0, 2, 2, 2, 3, 0, 3, 3], [5] * 10, [0] * 10])
    for start, end in [(0, 10), (1, 6), (4, 9), (3, 3)]:
        want = ops.document_segments(doc, start, end)
        got = ops.document_segments(doc.cuda(), start, end)
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b.cpu())
