"""``cpshard bench [options]`` (also ``python -m cpshard.bench``): its arguments, checked into a
:class:`~cpshard.bench.config.BenchConfig`, and the launch. The ``cpshard`` command's other
tools have modules of their own (:mod:`cpshard.cli` dispatches)."""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import Sequence

from cpshard.bench.config import (
    BACKENDS,
    DEFAULT_HIDDEN,
    DEFAULT_OPS,
    DEFAULT_SIZES,
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


def build_parser(prog: str = "cpshard bench") -> argparse.ArgumentParser:
    bench = argparse.ArgumentParser(
        prog=prog,
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
        "planning, memory and heads_memory, which run only when named)",
    )
    bench.add_argument(
        "--full",
        action="store_true",
        help="every section's whole grid (the attention section: every layout and head shape, "
        "sliding windows, soft-capping and sinks; heads_memory: S = 16384 too); without --ops, "
        "every op but planning, memory and heads_memory",
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
        help="tiny problems for the planner, vision, layouts, blockdiag, attention, mixers and "
        "heads_memory sections (a smoke test: their figures mean nothing)",
    )
    bench.add_argument(
        "--timeout",
        dest="timeout_s",
        type=_seconds,
        default=600.0,
        help="process-group timeout in seconds (default: 600)",
    )
    return bench


def _check_output(parser: argparse.ArgumentParser, path: str | None, flag: str) -> None:
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        parser.error(f"{flag}: folder {folder} does not exist")


def parse_config(argv: Sequence[str], prog: str = "cpshard bench") -> BenchConfig:
    """``argv`` after ``bench`` as a :class:`BenchConfig`; exits with status 2 on bad values."""
    bench_parser = build_parser(prog)
    args = bench_parser.parse_args(list(argv))
    _check_output(bench_parser, args.json_path, "--json")
    _check_output(bench_parser, args.plot_path, "--plot")
    if args.plot_path is not None and importlib.util.find_spec("matplotlib") is None:
        bench_parser.error(
            "--plot needs matplotlib, which is not installed (pip install 'cpshard[bench]'); "
            "--json writes the same figures"
        )
    fields = dict(vars(args))
    if fields["ops"] is None:
        fields["ops"] = FULL_OPS if args.full else DEFAULT_OPS
    return BenchConfig(**fields)


def main(argv: Sequence[str], prog: str = "cpshard bench") -> int:
    """``cpshard bench ARGV``: run the benchmark; returns the exit status."""
    cfg = parse_config(argv, prog)
    from cpshard.bench.launch import launch

    return launch(cfg)
