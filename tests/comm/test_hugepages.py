"""Huge-page advice for the transport's large CPU buffers (cpshard.comm.hugepages)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cpshard.comm.hugepages import HUGE_PAGE, MIN_BYTES, new_buffer

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@linux_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_large_buffer_interior_is_advised(dtype):
    like = torch.zeros(3, dtype=dtype)
    n = (32 << 20) // like.element_size() + 5
    buf = new_buffer(like, n)
    assert buf.shape == (n,) and buf.dtype == dtype and buf.is_contiguous()
    first_whole_page = (buf.data_ptr() + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    assert "hg" in _vm_flags(first_whole_page)  # MADV_HUGEPAGE recorded on the mapping
    assert "hg" in _vm_flags(first_whole_page + 8 * HUGE_PAGE)
    buf.fill_(1)  # writable and whole
    assert bool((buf == 1).all())


@linux_only
def test_small_buffer_and_shapes_untouched():
    like = torch.zeros(1)
    small = new_buffer(like, (MIN_BYTES // 4 - 1,))
    assert small.numel() == MIN_BYTES // 4 - 1
    assert new_buffer(like, (2, 0, 3)).shape == (2, 0, 3)
    assert new_buffer(like, [4, 5]).shape == (4, 5)


def test_fake_tensors_pass_through():
    with FakeTensorMode():
        like = torch.empty(4)
        out = new_buffer(like, (64 << 20,))
    assert out.shape == (64 << 20,)
