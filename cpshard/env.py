"""``cpshard env``: the report users paste into a bug — cpshard's version and build, torch, CUDA,
the NCCL library this process runs, Python, the Hugging Face libraries cpshard integrates with,
and which of cpshard's transformers hooks are active here (and why the others are not).

Everything is read, nothing is required: each part says what it could not find instead of
failing (a broken build, a machine without transformers or without a GPU)."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from cpshard.declared import declared_requirements

_LIBRARIES = ("transformers", "trl", "accelerate", "datasets")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _build() -> dict[str, Any]:
    try:
        from cpshard._build import build_info
    except ImportError as exc:  # the extension is not built, or does not load
        return {"error": f"cpshard._C does not load: {exc}"}
    info = build_info()
    return {
        "cuda_kernels": info.cuda_kernels,
        "cuda_archs": info.cuda_archs or None,
        "nccl_communicator": info.nccl,
        "sanitized": info.sanitized,
        "built_against_torch": info.torch_version,
    }


def _torch() -> dict[str, Any]:
    import torch

    from cpshard.comm.nccl_runtime import loaded_versions, version_triple

    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {
        "version": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
        "nccl_loaded": {
            path: ".".join(map(str, version_triple(code)))
            for path, code in loaded_versions().items()
        },
    }
    if torch.distributed.is_available() and torch.distributed.is_nccl_available():
        out["nccl_torch_built_with"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def _hooks() -> dict[str, Any]:
    """Register the transformers integration here and read what it installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return {"error": "transformers is not installed (pip install 'cpshard[transformers]')"}
    try:
        from cpshard.integrations import hooks, refused_layers
        from cpshard.integrations import transformers as cp_transformers

        cp_transformers.register()
    except Exception as exc:  # noqa: BLE001 - the report says what failed, whatever it is
        return {"error": f"register() failed: {type(exc).__name__}: {exc}"}
    return {
        "families": [
            {"family": s.family, "module": s.module, "layer": s.layer, "state": s.state,
             "reason": s.reason}
            for s in hooks.hook_report()
        ],  # fmt: skip
        "refused": refused_layers.refused_classes(),
    }


def collect() -> dict[str, Any]:
    """The whole report as a JSON-ready dict."""
    import cpshard

    return {
        "cpshard": {
            "version": _version("cpshard") or "not installed (a source tree on the path)",
            "location": cpshard.__path__[0],
            "build": _build(),
        },
        "python": f"{platform.python_version()} ({platform.python_implementation()}) "
        f"on {platform.system()}-{platform.machine()}",
        "torch": _torch(),
        "libraries": {name: _version(name) for name in _LIBRARIES},
        "declared": declared_requirements(),
        "transformers_hooks": _hooks(),
    }


def render(report: dict[str, Any]) -> str:
    """The report as text, one fact a line."""
    cp, tor = report["cpshard"], report["torch"]
    build = cp["build"]
    if "error" in build:
        built = build["error"]
    else:
        cuda = f"yes ({build['cuda_archs']})" if build["cuda_kernels"] else "no"
        built = (
            f"CUDA kernels {cuda}, NCCL communicator {'yes' if build['nccl_communicator'] else 'no'}"
            f", sanitized {'yes' if build['sanitized'] else 'no'}, built against torch "
            f"{build['built_against_torch']}"
        )
    nccl = ", ".join(f"{v} ({p})" for p, v in tor["nccl_loaded"].items()) or "none loaded"
    lines = [
        "cpshard environment (paste into a bug report)",
        f"cpshard: {cp['version']} at {cp['location']}",
        f"cpshard build: {built}",
        f"torch: {tor['version']} (CUDA build {tor['cuda_build'] or 'none'}, "
        f"GPU available: {tor['cuda_available']}{': ' + ', '.join(tor['devices']) if tor['devices'] else ''})",
        f"NCCL runtime: {nccl}"
        + (f"; torch built with {tor['nccl_torch_built_with']}" if "nccl_torch_built_with" in tor else ""),
        f"Python: {report['python']}",
    ]
    lines += [f"{name}: {v or 'not installed'}" for name, v in report["libraries"].items()]
    declared = [d.split(";")[0].strip() for d in report["declared"]]
    lines.append(f"declared: {', '.join(dict.fromkeys(declared)) or 'unknown (not installed)'}")
    hooks = report["transformers_hooks"]
    lines.append("transformers hooks:")
    if "error" in hooks:
        lines.append(f"  {hooks['error']}")
    else:
        for f in hooks["families"]:
            why = f" - {f['reason']}" if f["state"] != "active" else ""
            lines.append(f"  {f['state']:<8} {f['family']}: {f['module']} ({f['layer']}){why}")
        refused = hooks["refused"]
        lines.append(f"  refused  under CP, with the reason: {len(refused)} layer classes "
                     "(sparse-attention indexers, attention in the model's own code)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, prog: str = "cpshard env") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write it as JSON")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    report = collect()
    print(render(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0
