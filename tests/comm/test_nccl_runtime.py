"""The NCCL version check on the libraries loaded at run time (``cpshard.comm.nccl_runtime``):
a stand-in ``libnccl.so.2`` (one function, ``ncclGetVersion``) is compiled, loaded into a fresh
process, found in its ``/proc/self/maps`` and asked for its version, and a mismatch with the
version cpshard's communicator reports is named."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cpshard.comm import nccl_runtime

ROOT = Path(__file__).resolve().parents[2]


def _stand_in(tmp: Path, code: int) -> Path:
    """A shared library named like NCCL's whose ncclGetVersion reports ``code``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in NCCL library")
    source = tmp / "nccl_stand_in.c"
    source.write_text(f"int ncclGetVersion(int* v) {{ *v = {code}; return 0; }}\n")
    library = tmp / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    library.parent.mkdir(parents=True)
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60
    )
    return library


def test_the_loaded_librarys_own_version_is_read_and_a_mismatch_named(tmp_path: Path) -> None:
    library = _stand_in(tmp_path, 22809)
    code = textwrap.dedent(
        f"""
        import ctypes
        from cpshard.comm import nccl_runtime as rt
        before = rt.loaded_versions()  # a CUDA build's extension has loaded NCCL already
        assert {str(library)!r} not in before, before
        ctypes.CDLL({str(library)!r})  # as torch loads its NCCL
        found = rt.loaded_versions()
        assert found == {{**before, {str(library)!r}: 22809}}, found
        assert rt.mismatch(22809, {{{str(library)!r}: 22809}}) == ""
        print(rt.mismatch(23007, found))
        """
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip()
    assert message.startswith("cpshard's communicator runs NCCL 2.30.7, but this process also has")
    assert f"{library} (2.28.9)" in message and message.endswith("loaded"), message


def test_a_library_not_loaded_is_never_loaded_by_asking(tmp_path: Path) -> None:
    library = _stand_in(tmp_path, 22809)
    with pytest.raises(OSError):
        nccl_runtime.library_version(str(library))
    assert str(library) not in nccl_runtime.mapped_libraries()


def test_mapped_libraries_reads_the_maps_text() -> None:
    maps = "\n".join(
        [
            "7f00-7f10 r-xp 00000000 fd:01 11 /site/nvidia/nccl/lib/libnccl.so.2",
            "7f10-7f20 r--p 00010000 fd:01 11 /site/nvidia/nccl/lib/libnccl.so.2",
            "7f20-7f30 r-xp 00000000 fd:01 12 /opt/nccl/lib/libnccl.so",
            "7f30-7f40 r-xp 00000000 fd:01 13 /usr/lib/libnccl-net.so",
            "7f40-7f50 r-xp 00000000 fd:01 14 /site/torch/lib/libtorch_cuda.so",
            "7f50-7f60 rw-p 00000000 00:00 0 ",
        ]
    )
    assert nccl_runtime.mapped_libraries(maps) == [
        "/site/nvidia/nccl/lib/libnccl.so.2",
        "/opt/nccl/lib/libnccl.so",
    ]  # a network plugin (libnccl-net.so) is not NCCL


def test_mismatch_with_no_library_loaded_is_named() -> None:
    assert nccl_runtime.mismatch(23007, {}) == "no NCCL library is mapped into this process"
    assert nccl_runtime.version_triple(22809) == (2, 28, 9)
