"""The NCCL libraries loaded in this process and the version each reports at run time.

Splitting from torch's communicator needs torch's ``ncclComm_t`` and cpshard's calls to belong to
the same NCCL. torch's ``torch.cuda.nccl.version()`` is the version torch was *compiled* against,
not the library it runs: an image whose NCCL wheel differs from torch's build would look
mismatched (or matched) for the wrong reason. What counts is ``ncclGetVersion`` of every NCCL
library mapped into the process (read from ``/proc/self/maps``, opened without loading anything
new), compared with the version cpshard's communicator reports from the library it is linked to.
(A torch that linked NCCL statically maps no library of its own: the check cannot see it. The
CUDA torch wheels link torch's NCCL wheel dynamically.)
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

_NCCL_FILE = re.compile(r"(^|/)libnccl\.so(\.[0-9]+)*$")  # not plugins (libnccl-net.so)


def mapped_libraries(maps: str | None = None) -> list[str]:
    """Paths of the NCCL libraries mapped into this process, in first-mapped order, from
    ``maps`` (the text of ``/proc/self/maps``; read now when None). Empty where the process has
    none or the platform has no ``/proc``."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        path = fields[5].strip() if len(fields) == 6 else ""
        if _NCCL_FILE.search(path) and path not in found:
            found.append(path)
    return found


def library_version(path: str) -> int:
    """``ncclGetVersion`` of the already-loaded library at ``path`` (e.g. 22809). Raises
    ``OSError`` when it is not loaded (nothing is loaded by asking) or reports an error."""
    library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    get_version = library.ncclGetVersion
    get_version.argtypes = [ctypes.POINTER(ctypes.c_int)]
    get_version.restype = ctypes.c_int
    code = ctypes.c_int(0)
    status = get_version(ctypes.byref(code))
    if status != 0:
        raise OSError(f"ncclGetVersion of {path} returned NCCL error {status}")
    return int(code.value)


def loaded_versions(maps: str | None = None) -> dict[str, int]:
    """Every NCCL library loaded in this process and its run-time version code."""
    return {path: library_version(path) for path in mapped_libraries(maps)}


def version_triple(code: int) -> tuple[int, int, int]:
    """(major, minor, patch) of an NCCL version code (``22809`` -> ``(2, 28, 9)``)."""
    return code // 10000, code // 100 % 100, code % 100


def mismatch(ours: int, loaded: dict[str, int]) -> str:
    """Why cpshard's NCCL (version code ``ours``) cannot split from torch's communicator given
    the ``loaded`` libraries, or ``""`` when every one reports ``ours``."""
    if not loaded:
        return "no NCCL library is mapped into this process"
    other = {path: code for path, code in loaded.items() if code != ours}
    if not other:
        return ""
    named = ", ".join(f"{p} ({'.'.join(map(str, version_triple(c)))})" for p, c in other.items())
    return (
        f"cpshard's communicator runs NCCL {'.'.join(map(str, version_triple(ours)))}, "
        f"but this process also has {named} loaded"
    )
