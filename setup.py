"""Build cpshard._C with CMake + Ninja.

Environment switches:
  CPSHARD_CUDA      auto (default) | 0 | 1. `auto` builds the CUDA kernels when the installed
                    torch has CUDA and a CUDA compiler is found; `1` fails if it cannot.
  CPSHARD_SANITIZE  1 builds the CPU kernels with AddressSanitizer + UBSan.
  CPSHARD_BUILD_TYPE  CMake build type (default Release).
  MAX_JOBS          parallel compile jobs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
# GPU architectures of a CUDA build when TORCH_CUDA_ARCH_LIST is unset: A100 (8.0), H100/H200
# (9.0), B200 (10.0), and PTX for 10.0 so newer GPUs JIT-compile it.
DEFAULT_CUDA_ARCHS = "8.0;9.0;10.0+PTX"


def _cuda_home() -> Path | None:
    """The CUDA toolkit root: CUDA_HOME / CUDA_PATH, else the directory above a real nvcc."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return Path(os.environ[var])
    default = Path("/usr/local/cuda")
    if (default / "bin" / "nvcc").exists():
        return default
    return None


def _want_cuda() -> bool:
    mode = os.environ.get("CPSHARD_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"CPSHARD_CUDA must be auto, 0 or 1, got {mode!r}")
    if mode == "0":
        return False
    import torch

    reasons = []
    if torch.version.cuda is None:
        reasons.append(f"the installed torch {torch.__version__} has no CUDA")
    home = _cuda_home()
    if home is None or not (home / "bin" / "nvcc").exists():
        reasons.append("no CUDA compiler found (set CUDA_HOME)")
    if reasons and mode == "1":
        raise RuntimeError("CPSHARD_CUDA=1 but the CUDA build is impossible: " + "; ".join(reasons))
    return not reasons


def _cuda_args() -> list[str]:
    """CMake arguments for the CUDA build (toolkit, NCCL from torch's wheel, arch list)."""
    import torch

    home = _cuda_home()
    assert home is not None
    site = Path(torch.__file__).resolve().parent.parent
    cuda_major = torch.version.cuda.split(".")[0]
    nvidia = site / "nvidia"
    extra_include = [p for p in (nvidia / f"cu{cuda_major}" / "include",) if p.exists()]
    args = [
        f"-DCPSHARD_WITH_CUDA=ON",
        f"-DCUDAToolkit_ROOT={home}",
        f"-DCUDA_TOOLKIT_ROOT_DIR={home}",
        f"-DCMAKE_CUDA_COMPILER={home / 'bin' / 'nvcc'}",
        f"-DCPSHARD_NVIDIA_SITE={nvidia}",
    ]
    if extra_include:
        args.append("-DCPSHARD_EXTRA_CUDA_INCLUDE=" + ";".join(map(str, extra_include)))
    nvrtc = sorted((nvidia / f"cu{cuda_major}" / "lib").glob("libnvrtc.so*"))
    if nvrtc:
        args.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc[0]}")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_CUDA_ARCHS)
    os.environ.setdefault("CUDA_HOME", str(home))
    return args


def _cpu_args() -> list[str]:
    """CMake arguments for the CPU build: the installed torch's folder and C++ ABI, which
    CMakeLists.txt reads instead of torch's CMake package (that one demands a CUDA toolkit for a
    CUDA torch)."""
    import torch

    return [
        "-DCPSHARD_WITH_CUDA=OFF",
        f"-DCPSHARD_TORCH_DIR={Path(torch.__file__).resolve().parent}",
        f"-DCPSHARD_TORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
    ]


def _tool(name: str) -> str:
    """A build tool, preferring the one installed beside this Python (pip's cmake/ninja)."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is required to build cpshard (pip install {name})")
    return found


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configure and build the one CMake target, placing _C where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        import torch.utils

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        ninja = _tool("ninja")
        cmake = _tool("cmake")
        args = [
            "-G", "Ninja",
            f"-DCMAKE_MAKE_PROGRAM={ninja}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            f"-DCPSHARD_OUTPUT_DIR={out_dir}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('CPSHARD_BUILD_TYPE', 'Release')}",
            f"-DCPSHARD_SANITIZE={'ON' if os.environ.get('CPSHARD_SANITIZE') == '1' else 'OFF'}",
        ]
        args += _cuda_args() if _want_cuda() else _cpu_args()
        subprocess.run([cmake, str(ROOT), *args], cwd=build_dir, check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run([cmake, "--build", ".", "-j", jobs], cwd=build_dir, check=True)


setup(
    ext_modules=[CMakeExtension("cpshard._C")],
    cmdclass={"build_ext": CMakeBuild},
)
