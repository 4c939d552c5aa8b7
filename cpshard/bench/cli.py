"""The ``cpshard`` console script: ``cpshard bench [options]`` (also ``python -m cpshard.bench``),
the model check ``cpshard parity``, and the single-process benchmarks ``cpshard kernels`` /
``cpshard nccl-world1`` (also
``python -m cpshard.bench.kernels`` / ``python -m cpshard.bench.nccl_world1``), each with its own
options."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

from cpshard.bench.config import (
    BACKENDS,
    DEFAULT_HIDDEN,
    DEFAULT_SIZES,
    DEFAULT_OPS,
    DEFAULT_WORLD_CPU,
    DTYPES,
    FULL_OPS,
    OPS,
    BenchConfig,
)

_DESCRIPTION = """\
Benchmark cpshard's sequence transport against what a user would write by hand.

For every op and size it prints an nccl-tests-style table: median time, algbw, busbw and peak
extra memory per rank of cpshard's op, of the straightforward baseline (pad to the max count +
all-gather + slice + cat for ragged blocks; list all-gather + cat for equal shards; all-gather of
the tails for halos; reduce-scatter backward), and of the wire floor (a bare point-to-point /
all-to-all transfer of exactly the useful bytes: no autograd, no copies), with the ratios.

Without a launcher it spawns --world local ranks (gloo on CPU; NCCL with one GPU per rank when
enough GPUs are visible). Under torchrun it uses the launcher's ranks:
  torchrun --nproc-per-node 8 -m cpshard.bench --ops ragged,sequence
"""


# command -> (module whose main(argv, prog) runs it, one-line help)
SINGLE_PROCESS = {
    "kernels": ("cpshard.bench.kernels", "throughput of cpshard's kernels next to copy_"),
    "nccl-world1": (
        "cpshard.bench.nccl_world1",
        "native NCCL communicator vs torch.distributed at world size 1 (GPU)",
    ),
    "parity": ("cpshard.parity.cli", "check a model's CP training step against one process"),
    "plan": ("cpshard.simulation.cli", "simulate every rank's step planning in one process"),
}
COMMANDS = ("bench", *SINGLE_PROCESS)


def _positive_int(text: str, what: str, low: int = 1) -> int:
    mult = 1
    t = text.strip()
    if t[-1:] in ("k", "K"):
        t, mult = t[:-1], 1024
    try:
        value = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: {text!r} is not an integer") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"{what}: {text!r} must be >= {low}")
    return value


def _ops(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("--ops: empty list")
    if "all" in names:
        return FULL_OPS
    bad = [n for n in names if n not in OPS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--ops: unknown op(s) {', '.join(bad)}; choose from {', '.join(OPS)}"
        )
    return tuple(dict.fromkeys(names))


def _sizes(text: str) -> tuple[int, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("--sizes: empty list")
    return tuple(dict.fromkeys(_positive_int(p, "--sizes") for p in parts))


def _world(text: str) -> int:
    return _positive_int(text, "--world", low=2)


def _count(low: int, what: str):
    return lambda text: _positive_int(text, what, low)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--timeout: {text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--timeout: {text!r} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpshard", description="cpshard command-line tools.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser(
        "bench",
        help="benchmark the sequence transport",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument(
        "--world",
        type=_world,
        default=None,
        help=f"ranks to spawn (default: {DEFAULT_WORLD_CPU} on CPU, every visible GPU "
        "with NCCL; under torchrun the launcher's world size)",
    )
    bench.add_argument(
        "--ops",
        type=_ops,
        default=None,
        help=f"comma-separated subset of {','.join(OPS)} (default: {','.join(DEFAULT_OPS)}, "
        "the attention section on one case; all, and the default with --full: every one but "
        "planning, which runs only when named)",
    )
    bench.add_argument(
        "--full",
        action="store_true",
        help="every section's whole grid (the attention section: every layout and head shape, "
        "sliding windows, soft-capping and sinks); without --ops, every op but planning",
    )
    bench.add_argument(
        "--sizes",
        type=_sizes,
        default=DEFAULT_SIZES,
        help="comma-separated tokens per rank (the mean for ragged counts); a k suffix "
        f"multiplies by 1024 (default: {','.join(map(str, DEFAULT_SIZES))})",
    )
    bench.add_argument("--dtype", choices=DTYPES, default="float32")
    counts = (  # flag, smallest value, default, help
        ("--hidden", 1, DEFAULT_HIDDEN, f"elements per token (default: {DEFAULT_HIDDEN})"),
        ("--repeats", 1, 5, "timed repeats; the median is reported (default: 5)"),
        ("--warmup", 0, 1, "untimed iterations before timing each op (default: 1)"),
        ("--iters", 0, 0, "iterations per repeat (default 0: enough for ~0.1 s per repeat)"),
    )
    for flag, low, default, what in counts:
        bench.add_argument(flag, type=_count(low, flag), default=default, help=what)
    bench.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="auto: NCCL when every rank gets its own GPU, else gloo on CPU",
    )
    bench.add_argument(
        "--json",
        dest="json_path",
        metavar="PATH",
        default=None,
        help="write every figure and the machine description to PATH",
    )
    bench.add_argument(
        "--plot",
        dest="plot_path",
        metavar="PNG",
        default=None,
        help="draw time vs size per op (cpshard, baseline, floor); needs matplotlib",
    )
    bench.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the peak-memory measurement (two profiled steps per op)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="tiny problems for the planner, vision, layouts, blockdiag, attention and mixers "
        "sections (a smoke test: their figures mean nothing)",
    )
    bench.add_argument(
        "--timeout",
        dest="timeout_s",
        type=_seconds,
        default=600.0,
        help="process-group timeout in seconds (default: 600)",
    )
    for name, (_, what) in SINGLE_PROCESS.items():
        sub.add_parser(name, help=f"{what} (options: cpshard {name} --help)", add_help=False)
    parser.bench = bench  # the subcommand's parser, for its error messages
    return parser


def _check_output(parser: argparse.ArgumentParser, path: str | None, flag: str) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{flag}: folder {folder} does not exist")


def parse_config(argv: Sequence[str]) -> BenchConfig:
    """``argv`` after ``bench`` as a :class:`BenchConfig`; exits with status 2 on bad values."""
    parser = build_parser()
    args = parser.parse_args(["bench", *argv])
    bench_parser = parser.bench
    _check_output(bench_parser, args.json_path, "--json")
    _check_output(bench_parser, args.plot_path, "--plot")
    if args.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        bench_parser.error(
            "--plot needs matplotlib, which is not installed (pip install 'cpshard[bench]'); "
            "--json writes the same figures"
        )
    fields = {k: v for k, v in vars(args).items() if k != "command"}
    if fields["ops"] is None:
        fields["ops"] = FULL_OPS if args.full else DEFAULT_OPS
    return BenchConfig(**fields)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cpshard`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        parser.print_usage(sys.stderr)
        print(f"cpshard: error: expected a command: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    if argv[0] in SINGLE_PROCESS:
        module = importlib.import_module(SINGLE_PROCESS[argv[0]][0])
        return module.main(argv[1:], prog=f"cpshard {argv[0]}")
    cfg = parse_config(argv[1:])
    from cpshard.bench.launch import launch

    return launch(cfg)
