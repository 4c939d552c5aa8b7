"""A parity case's verdict from its ranks' measurements: exact, differs (with the first
quantity and module that differ, and a likely cause), refused (cpshard declined the step, with
its reason) or crashed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from cpshard.parity.config import Case

EXACT, DIFFERS, REFUSED, CRASHED = "exact", "differs", "refused", "crashed"


@dataclass
class CaseResult:
    """One case: its verdict, the diagnosis (empty when exact), the worst measurements over the
    ranks, the per-rank attention cost and received K/V bytes, and the loss the step ran."""

    case: str
    world: int
    verdict: str
    diagnosis: str = ""
    loss: float | None = None
    ref_loss: float | None = None
    loss_err: float | None = None
    logits_err: float | None = None
    grad_err: float | None = None
    grad_worst: str | None = None
    grad_norm_ratio: float | None = None
    count: int | None = None
    ref_count: int | None = None
    first_layer: str | None = None
    cost: list[int] = field(default_factory=list)
    kv_bytes: list[int | None] = field(default_factory=list)
    loss_fn: str | None = None  # the loss the CP step computed
    loss_reason: str | None = None  # why not cp_linear_cross_entropy

    @property
    def balance(self) -> float | None:
        """Largest per-rank attention cost over the mean (1.0 = perfectly balanced)."""
        if not self.cost or sum(self.cost) == 0:
            return None
        return max(self.cost) / (sum(self.cost) / len(self.cost))

    def as_dict(self) -> dict[str, Any]:
        return dict(asdict(self), balance=self.balance)


def _failure(case: Case, ranks: list[dict[str, Any]]) -> CaseResult | None:
    failed = [(r, m) for r, m in enumerate(ranks) if "error" in m]
    if not failed:
        return None
    rank, m = failed[0]
    text = m["error"].strip().splitlines()[0] if m["error"].strip() else m["error_type"]
    cpshard_said = text.startswith("cpshard") and m["error_type"] in (
        "ValueError",
        "TypeError",
        "NotImplementedError",
    )
    verdict = REFUSED if cpshard_said else CRASHED
    return CaseResult(case.name, case.world, verdict, f"rank {rank}: {m['error_type']}: {text}")


def _factor(ratio: float, cp: int) -> str:
    """A likely cause for gradients a uniform factor off."""
    for k, what in ((cp, "cp"), (1 / cp, "1/cp")):
        if cp > 1 and abs(ratio - k) < 1e-6 * k:
            return (
                f"gradients are uniformly {ratio:.4g}x the reference's (= {what}): a CP factor "
                "is missing or doubled; the ranks' losses must average to the loss (as "
                "cp_cross_entropy's do) when FSDP2 / DDP / reduce_cp_gradients average"
            )
    return f"gradients are uniformly {ratio:.4g}x the reference's"


def judge(case: Case, ranks: list[dict[str, Any]], tol: float) -> CaseResult:
    """The case's result from every rank's measurements (or errors)."""
    failure = _failure(case, ranks)
    if failure is not None:
        return failure
    r0 = ranks[0]
    loss_err = max(abs(m["loss"] - m["ref_loss"]) / max(1.0, abs(m["ref_loss"])) for m in ranks)
    worst = max(ranks, key=lambda m: m["grad_err"])
    ratio = max((m["grad_norm_ratio"] for m in ranks), key=lambda x: abs(x - 1))
    cosine = min(m["grad_cosine"] for m in ranks)
    counts = [m for m in ranks if m["count"] != m["ref_count"]]
    layers = [m["first_layer"] for m in ranks if m["first_layer"]]
    result = CaseResult(
        case.name,
        case.world,
        EXACT,
        loss=r0["loss"],
        ref_loss=r0["ref_loss"],
        loss_err=loss_err,
        logits_err=max(m["logits_err"] for m in ranks),
        grad_err=worst["grad_err"],
        grad_worst=worst["grad_worst"],
        grad_norm_ratio=ratio,
        count=(counts[0] if counts else r0)["count"],
        ref_count=(counts[0] if counts else r0)["ref_count"],
        first_layer=layers[0] if layers else None,
        cost=[m["cost"] for m in ranks],
        kv_bytes=[m["kv_bytes"] for m in ranks],
        loss_fn=r0["loss_fn"],
        loss_reason=r0["loss_reason"],
    )
    findings = []
    if layers:
        findings.append(
            f"forward differs first at module {layers[0]!r} (its inputs equal the reference's, "
            "its output does not)"
        )
    elif result.logits_err > tol:
        findings.append(
            f"logits differ by {result.logits_err:.3g} (no module output differs before them)"
        )
    if counts:
        findings.append(
            f"labelled-token count {result.count} vs the reference's {result.ref_count}: the "
            "loss's labels are not the batch's targets (labels shifted per shard? use the "
            "sharded batch's targets.labels, shifted once before sharding)"
        )
    if loss_err > tol:
        why = ""
        if not layers and result.logits_err <= tol and not counts:
            why = (
                " with exact logits and the same token count: the loss is not the token mean "
                "over the whole CP group (a per-rank mean? use cp_cross_entropy)"
            )
        findings.append(f"loss {result.loss!r} vs the reference's {result.ref_loss!r}{why}")
    if result.grad_err > tol:
        if cosine > 1 - 1e-9 and abs(ratio - 1) > 1e-6:
            findings.append(_factor(ratio, r0["cp"]))
        findings.append(
            f"gradients differ by up to {result.grad_err:.3g} (worst: {result.grad_worst})"
        )
    if findings:
        result.verdict = DIFFERS
        result.diagnosis = "; ".join(findings)
    return result
