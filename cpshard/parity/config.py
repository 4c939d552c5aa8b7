"""What a parity check runs: the model and batch (:class:`Setup`) and its cases."""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.layouts import LAYOUTS
from cpshard.parity.batches import BatchSpec
from cpshard.parity.models import ModelSpec

BLOCKDIAG = "blockdiag"
CASE_LAYOUTS = (BLOCKDIAG, *LAYOUTS)
FSDP_MODES = ("flat", "hsdp", "dp")
DEFAULT_LAYOUTS = (BLOCKDIAG, "head_tail", "stripe", "balanced")
DEFAULT_TOL = 1e-9


@dataclass(frozen=True)
class Setup:
    """The model, the batch, the loss (``module:function`` called as ``fn(logits, batch,
    group)`` returning the loss or ``(loss, labels used)``; None: the loss of the sharded
    batch's targets as ``CPTrainer`` computes it, :func:`cpshard.cp_linear_cross_entropy` from
    the final hidden states where the LM head allows, else :func:`cpshard.cp_cross_entropy` of
    the logits) and the tolerance of "exact" (absolute, scaled by the reference's magnitude when
    it exceeds 1)."""

    model: ModelSpec
    batch: BatchSpec = BatchSpec()
    loss: str | None = None
    tol: float = DEFAULT_TOL

    def __post_init__(self) -> None:
        # a negative tolerance would call every case different, and blame a module for it
        if not 0 <= self.tol < float("inf"):
            raise ValueError(f"tol: must be finite and >= 0, got {self.tol!r}")


@dataclass(frozen=True)
class Case:
    """One CP step: ``layout`` (``"blockdiag"`` or a sharder layout) on ``world`` ranks; with
    ``dp > 1`` or ``fsdp`` set, a (dp, cp) mesh with ``world // dp`` CP ranks and FSDP2 as
    ``fsdp`` says (``"flat"``, ``"hsdp"``, ``"dp"``; None: no FSDP2, ``reduce_cp_gradients``)."""

    layout: str
    world: int
    dp: int = 1
    fsdp: str | None = None

    def __post_init__(self) -> None:
        if self.layout not in CASE_LAYOUTS:
            raise ValueError(f"layout: {self.layout!r} is not one of {', '.join(CASE_LAYOUTS)}")
        if self.world < 1 or self.dp < 1 or self.world % self.dp:
            raise ValueError(f"world {self.world} must be >= 1 and a multiple of dp {self.dp}")
        if self.fsdp is not None and self.fsdp not in FSDP_MODES:
            raise ValueError(f"fsdp: {self.fsdp!r} is not one of {', '.join(FSDP_MODES)}")

    @property
    def cp(self) -> int:
        return self.world // self.dp

    @property
    def name(self) -> str:
        mesh = f" dp{self.dp}xcp{self.cp}" if self.dp > 1 or self.fsdp else ""
        fsdp = f" fsdp={self.fsdp}" if self.fsdp else ""
        return f"{self.layout} W={self.world}{mesh}{fsdp}"
