"""A parity report as a terminal table and as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from cpshard.parity.runner import ParityReport


def _num(x: float | None, fmt: str = ".1e") -> str:
    return "-" if x is None else format(x, fmt)


def _kib(values: list[int | None]) -> str:
    known = [v for v in values if v is not None]
    return "-" if not known else f"{max(known) / 1024:.1f}"


def table(report: ParityReport) -> str:
    """One line per case (verdict, errors, counts, gradient-norm ratio, balance, the largest
    per-rank K/V KiB received per step), then the diagnoses and the run time."""
    head = (
        f"{'case':<34} {'verdict':<8} {'loss err':>8} {'logits':>8} {'grad err':>8} "
        f"{'tokens cp/ref':>13} {'|g| ratio':>9} {'balance':>7} {'K/V KiB':>8}  worst gradient"
    )
    losses = sorted(
        {r.loss_fn + (f" ({r.loss_reason})" if r.loss_reason else "") for r in report.results
         if r.loss_fn}
    )  # fmt: skip
    lines = [
        f"cpshard parity: {report.setup.model.value} (float64, gloo, CPU)"
        + (f"; loss: {', '.join(losses)}" if losses else ""),
        head,
        "-" * len(head),
    ]
    for r in report.results:
        tokens = "-" if r.count is None else f"{r.count}/{r.ref_count}"
        lines.append(
            f"{r.case:<34} {r.verdict:<8} {_num(r.loss_err):>8} {_num(r.logits_err):>8} "
            f"{_num(r.grad_err):>8} {tokens:>13} {_num(r.grad_norm_ratio, '.6f'):>9} "
            f"{_num(r.balance, '.3f'):>7} {_kib(r.kv_bytes):>8}  {r.grad_worst or '-'}"
        )
    notes = [f"  {r.case}: {r.verdict}: {r.diagnosis}" for r in report.results if r.diagnosis]
    if notes:
        lines += ["", *notes]
    exact = sum(r.verdict == "exact" for r in report.results)
    lines.append(f"\n{exact}/{len(report.results)} cases exact in {report.seconds:.1f} s")
    return "\n".join(lines)


def write_json(report: ParityReport, path: str | Path) -> None:
    """The report as JSON at ``path``."""
    Path(path).write_text(json.dumps(report.as_dict(), indent=2, default=str) + "\n")
