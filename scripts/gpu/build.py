"""The GPU check's build stage: the extension built in place in this checkout, as a fresh clone
on the lent machine must (``setup.py build_ext --inplace``: CUDA kernels and the NCCL
communicator on a GPU, for its architecture only; the CPU extension in the dry run), then
imported from this checkout (never from an installed cpshard), its build info and build time in
``OUT/build.json``. On a GPU it must be the CUDA + NCCL build, for this GPU.

    python scripts/gpu/build.py --out DIR [--device cuda|cpu]
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import stage_args  # this folder's: the script's own, first on sys.path

REPO = Path(__file__).resolve().parents[2]


def runs_on(archs: str, capability: tuple[int, int]) -> bool:
    """Whether kernels built for ``archs`` (TORCH_CUDA_ARCH_LIST, space-separated) load on a
    GPU of ``capability``: its own architecture, or PTX of an older one."""
    for arch in archs.split():
        version = tuple(int(v) for v in arch.removesuffix("+PTX").split("."))
        if version == capability or (arch.endswith("+PTX") and version <= capability):
            return True
    return False


def problems(device: str, info: dict, extension: Path) -> list[str]:
    """What makes the built extension unfit for the check's later stages on ``device``."""
    found = []
    if REPO not in extension.parents:
        found.append(f"cpshard was imported from {extension}, not this checkout ({REPO})")
    if device == "cuda":
        if not (info["cuda_kernels"] and info["nccl"]):
            found.append("not the CUDA + NCCL build")
        elif not runs_on(info["cuda_archs"], torch.cuda.get_device_capability(0)):
            capability = torch.cuda.get_device_capability(0)
            found.append(f"built for {info['cuda_archs']!r}, not this GPU's {capability}")
    return found


def main(argv: list[str] | None = None) -> int:
    args = stage_args.parse(stage_args.parser(__doc__), argv)
    if args is None:
        return 1
    env = dict(os.environ, CPSHARD_CUDA="1" if args.device == "cuda" else "0")
    start = time.monotonic()
    built = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"], cwd=REPO, env=env, check=False
    )
    record: dict = {"build_s": round(time.monotonic() - start, 1), "build_exit": built.returncode}
    if built.returncode == 0:
        sys.path.insert(0, str(REPO))  # the checkout's cpshard, never an installed one
        cpshard = importlib.import_module("cpshard")
        record.update(asdict(cpshard.build_info()))
        record["extension"] = str(Path(cpshard._C.__file__).resolve())
        record["problems"] = problems(args.device, record, Path(record["extension"]))
    else:
        record["problems"] = [f"setup.py build_ext --inplace exited {built.returncode}"]
    record["ok"] = not record["problems"]
    (args.out / "build.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    print(json.dumps(record))
    what = "CUDA + NCCL" if record.get("cuda_kernels") and record.get("nccl") else "CPU"
    verdict = "; ".join(record["problems"]) or f"{what} extension built in place"
    print(f"{'ok' if record['ok'] else 'FAILED'} in {record['build_s']} s: {verdict}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
