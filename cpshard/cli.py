"""The ``cpshard`` command (also ``python -m cpshard``): one dispatcher for every tool, each in
the module that owns it and imported only when its command runs."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# command -> (module whose main(argv, prog) runs it, one-line help)
COMMANDS = {
    "bench": ("cpshard.bench.cli", "benchmark the sequence transport, the layouts and attention"),
    "kernels": ("cpshard.bench.kernels", "throughput of cpshard's kernels next to copy_"),
    "nccl-world1": (
        "cpshard.bench.nccl_world1",
        "native NCCL communicator vs torch.distributed at world size 1 (GPU)",
    ),
    "parity": ("cpshard.parity.cli", "check a model's CP training step against one process"),
    "plan": ("cpshard.simulation.cli", "simulate every rank's step planning in one process"),
    "env": ("cpshard.env", "the environment report to paste into a bug report"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return (
        "usage: cpshard COMMAND [options]   (cpshard COMMAND --help for its options)\n\n"
        "cpshard command-line tools:\n" + "\n".join(lines)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cpshard`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        got = f"unknown command {argv[0]!r}; " if argv else ""
        print(f"cpshard: error: {got}expected one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:], prog=f"cpshard {argv[0]}"))
