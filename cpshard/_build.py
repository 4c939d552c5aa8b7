"""How the native extension was built: which kernels and transports this install can use."""

from __future__ import annotations

from dataclasses import dataclass

from cpshard import _C


@dataclass(frozen=True)
class BuildInfo:
    """What ``cpshard._C`` was compiled with."""

    cuda_kernels: bool  # CUDA implementations of every op are registered
    cuda_archs: str  # the GPU architectures they were compiled for (TORCH_CUDA_ARCH_LIST)
    nccl: bool  # the native NCCL communicator is compiled in
    sanitized: bool  # CPU kernels built with AddressSanitizer + UBSan
    torch_version: str  # major.minor of the torch the extension was compiled against


def build_info() -> BuildInfo:
    """The build configuration of the loaded extension."""
    return BuildInfo(
        cuda_kernels=bool(_C.cuda_kernels),
        cuda_archs=str(_C.cuda_archs),
        nccl=bool(_C.nccl),
        sanitized=bool(_C.sanitized),
        torch_version=str(_C.torch_version),
    )
