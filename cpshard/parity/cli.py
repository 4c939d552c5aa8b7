"""``cpshard parity``: check that a model's CP training step equals its single-process step.

Exit status 0 when every case is exact, 1 when any differs, is refused or crashed, 2 for bad
arguments: a CI job can gate on it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from cpshard.cli_args import mesh_shape
from cpshard.parity.batches import BatchSpec, check_lengths
from cpshard.parity.config import (
    CASE_LAYOUTS,
    DEFAULT_LAYOUTS,
    DEFAULT_TOL,
    FSDP_MODES,
    Case,
    Setup,
)
from cpshard.parity.models import ModelSpec, check_model_spec, load_object

_DESCRIPTION = """\
Run one training step of MODEL under context parallelism on W local gloo ranks (CPU, float64)
for every layout and world size, and compare it with the same model in one process where each
document of the packed batch runs alone: the loss, the logits, every parameter gradient, the
labelled-token count and the gradient-norm ratio; per rank, the attention cost and the K/V bytes
received. A difference is located at the first module whose inputs equal the reference's but
whose output does not. The loss, unless --loss gives one, is the one CPTrainer computes:
cp_linear_cross_entropy from the final hidden states (the logits never held) where the model's
LM head is a plain nn.Linear, else cp_cross_entropy of the logits; the report names it.

MODEL: a transformers class (LlamaForCausalLM, Qwen3ForCausalLM,
Qwen3VLForConditionalGeneration, ...) built tiny with a random config, a config.json, or
module:function returning an nn.Module whose forward takes input_ids and position_ids and
returns logits or an object with .logits (use cpshard.cp_attention in its attention).
"""


def _list(text: str, what: str, choices: Sequence[str] | None = None) -> tuple[str, ...]:
    items = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not items:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    bad = [s for s in items if choices is not None and s not in choices]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{what}: unknown {', '.join(bad)}; choose from {', '.join(choices)}"
        )
    return items


def _worlds(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in _list(text, "--worlds"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--worlds: {text!r} is not a list of integers") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError("--worlds: world sizes must be >= 1")
    return values


def _positive(what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: {text!r} is not an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{what}: must be >= 1, got {value}")
        return value

    return parse


def _tol(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tol: {text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"--tol: must be finite and >= 0, got {text}")
    return value


def _lengths(text: str) -> str:
    try:
        return check_lengths(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--{exc}") from None


def _mesh(text: str) -> tuple[int, int]:
    return mesh_shape(text, "DPxCP", "2x2")


def parser(prog: str = "cpshard parity") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="architecture, config.json or module:function")
    p.add_argument("--seed", type=int, default=0, help="parameter and batch seed")
    p.add_argument(
        "--lengths",
        type=_lengths,
        default=BatchSpec.lengths,
        help="document lengths: uniform:LO-HI, lognormal:MU,SIGMA or fixed:N,N,...",
    )
    p.add_argument(
        "--docs", type=_positive("--docs"), default=BatchSpec.docs, help="documents per row"
    )
    p.add_argument(
        "--rows", type=_positive("--rows"), default=BatchSpec.rows, help="rows of the batch"
    )
    p.add_argument(
        "--batch", help="a torch.save'd batch dict, or module:function(replica) -> batch"
    )
    p.add_argument(
        "--loss",
        help="module:function(logits, sharded batch, group) -> loss or (loss, labels) "
        "(default: cp_linear_cross_entropy where the LM head allows, else cp_cross_entropy)",
    )
    p.add_argument(
        "--layouts",
        type=lambda t: _list(t, "--layouts", CASE_LAYOUTS),
        default=DEFAULT_LAYOUTS,
        help=f"comma-separated, of {', '.join(CASE_LAYOUTS)}",
    )
    p.add_argument("--worlds", type=_worlds, default=(2, 4), help="comma-separated world sizes")
    p.add_argument("--mesh", type=_mesh, help="also run FSDP2 on a DPxCP mesh (e.g. 2x2)")
    p.add_argument(
        "--fsdp",
        type=lambda t: _list(t, "--fsdp", FSDP_MODES),
        default=("flat",),
        help="FSDP2 modes for --mesh: flat (the flattened mesh), hsdp, dp",
    )
    p.add_argument("--tol", type=_tol, default=DEFAULT_TOL, help="what counts as exact")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    return p


def cases_from(args: argparse.Namespace) -> list[Case]:
    """The cases the arguments ask for: every layout at every world, then the mesh's."""
    cases = [Case(layout, world) for world in args.worlds for layout in args.layouts]
    if args.mesh is not None:
        dp, cp = args.mesh
        cases += [Case(layout, dp * cp, dp, mode) for mode in args.fsdp for layout in args.layouts]
    return cases


def _check_loadable(setup: Setup) -> None:
    """``ValueError`` for a ``--model``, ``--loss`` or ``--batch`` that names nothing loadable
    (a bad argument, told apart from a model that fails the check)."""
    try:
        check_model_spec(setup.model)
        if setup.loss is not None:
            load_object(setup.loss, "loss")
        source = setup.batch.source
        if source is not None and not Path(source).exists():
            load_object(source, "batch")
    except ValueError as exc:  # "model: ...", "loss: ...", "batch: ...": the option's name
        raise ValueError(f"--{exc}") from None


def main(argv: Sequence[str] | None = None, prog: str = "cpshard parity") -> int:
    """Run the command; returns its exit status."""
    from cpshard.parity.report import table, write_json
    from cpshard.parity.runner import run_parity

    args = parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    if os.getcwd() not in sys.path:  # user modules named module:function, as `python -m` finds them
        sys.path.insert(0, os.getcwd())
    try:
        batch = BatchSpec(args.lengths, args.docs, args.rows, args.batch, args.seed)
        setup = Setup(ModelSpec.parse(args.model, args.seed), batch, args.loss, args.tol)
        _check_loadable(setup)
        cases = cases_from(args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    report = run_parity(setup, cases)
    print(table(report))
    if args.json:
        write_json(report, args.json)
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main())
