"""Facts about the machine the GPU check runs on that only the machine can tell, read with torch
alone (no cpshard): the device (name, compute capability, memory), the NCCL torch was built
with, and which attention kernels torch runs there.

The attention facts answer what no CPU run can: which kernel torch's flash op
(``aten._flash_attention_forward``, the op cpshard's varlen path calls) and
``F.scaled_dot_product_attention`` actually launch on this GPU (the kernel names a profiler
sees), which backend SDPA's dispatcher picks (``torch._fused_sdp_choice``), and whether torch's
flash-attention registry (``torch.nn.attention.list_flash_attention_impls``, present in torch
2.11 to 2.13 at least) can route the flash op to FlashAttention-3 / -4 here: activation
imports an external package (``flash_attn_interface`` / ``flash_attn.cute.interface``); without
it torch runs its bundled FlashAttention-2 kernels. When FA3 can be activated, the flash op is
profiled again under it and torch's default restored. On CPU the same calls run on CPU tensors
and say so (the varlen flash op has no CPU kernel).
"""

from __future__ import annotations

import importlib.util
import os
import platform
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

# (module that activation imports, registry name) of the implementations torch knows
FLASH_IMPLS = {"FA3": "flash_attn_interface", "FA4": "flash_attn.cute.interface"}


def _importable(module: str) -> bool:
    """Whether ``module`` can be imported here (its parent packages are imported to tell)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _kernels(fn: Callable[[], object], device: str) -> list[str]:
    """The names of the device's kernels (CPU: its top-level aten ops) one call of ``fn`` runs."""
    fn()  # warm-up: the first call may choose or load kernels
    cuda = device == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    names = {e.name for e in prof.events() if e.device_type == kind}
    if not cuda:
        names = {n for n in names if n.startswith("aten::_scaled_dot_product")}
    return sorted(names)


def _flash_calls(device: str) -> dict[str, Callable[[], object]]:
    """One bf16 (float32 on CPU) causal call of each attention entry point cpshard relies on."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, 1024, 64, generator=g).to(device, dtype) for _ in range(3))
    calls: dict[str, Callable[[], object]] = {
        "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    if device == "cuda":  # the varlen flash op: two documents of 512 tokens, [tokens, heads, dim]
        qv, kv, vv = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
        cu = torch.tensor([0, 512, 1024], dtype=torch.int32, device=device)
        calls["flash_attention_forward_varlen"] = lambda: torch.ops.aten._flash_attention_forward(
            qv, kv, vv, cu, cu, 512, 512, 0.0, True, False
        )
    return calls


def _profiled(device: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, call in _flash_calls(device).items():
        try:
            out[name] = _kernels(call, device)
        except Exception as e:  # noqa: BLE001  (a fact too: the call failed here)
            out[name] = f"error: {type(e).__name__}: {e}"
    return out


def attention(device: str) -> dict[str, object]:
    """Which attention kernels torch runs on ``device`` and which flash implementations it can
    switch to."""
    import torch.nn.attention as attn

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 8, 1024, 64, device=device, dtype=dtype)
    choice = int(torch._fused_sdp_choice(q, q, q, is_causal=True))
    record: dict[str, object] = {
        "device": device,
        "sdpa_choice_bf16_causal" if device == "cuda" else "sdpa_choice_f32_causal": (
            attn.SDPBackend(choice).name
        ),
        "sdpa_enabled": {
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
        },
        "kernels": _profiled(device),
    }
    if not hasattr(attn, "list_flash_attention_impls"):
        record["flash_impl_registry"] = "absent in this torch"
        return record
    impls = attn.list_flash_attention_impls()
    record["flash_impl_registry"] = {
        "registered": impls,
        "active": attn.current_flash_attention_impl(),
        "package_importable": {i: _importable(m) for i, m in FLASH_IMPLS.items() if i in impls},
    }
    if device == "cuda" and "FA3" in impls:
        try:
            attn.activate_flash_attention_impl("FA3")
        except Exception as e:  # noqa: BLE001  (why FA3 cannot serve the flash op here)
            record["fa3"] = f"not activatable: {type(e).__name__}: {e}"
        else:
            try:
                record["fa3"] = {"activated": True, "kernels": _profiled(device)}
            finally:
                attn.restore_flash_attention_impl()
    return record


def facts(device: str) -> dict[str, object]:
    """The device, torch, the NCCL torch was built with and the attention facts."""
    record: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        record["device"] = {
            "name": props.name,
            "capability": "%d.%d" % (props.major, props.minor),
            "memory_gib": round(props.total_memory / 2**30, 1),
            "count": torch.cuda.device_count(),
        }
        # compile-time: the NCCL library loaded at run time is read after the build
        # (steady_state.json), with cpshard's own reader
        record["nccl_torch_compiled"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        record["device"] = {"name": "cpu", "why": "dry run: no GPU facts measured"}
    try:
        record["attention"] = attention(device)
    except Exception as e:  # noqa: BLE001  (recorded; the smoke test decides the stage)
        record["attention"] = f"error: {type(e).__name__}: {e}"
    return record
