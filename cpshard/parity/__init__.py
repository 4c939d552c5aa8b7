"""``cpshard parity``: prove that a model, batch and loss train the same under CP as in one
process — one CP step on gloo ranks (CPU, float64) for chosen layouts, world sizes and FSDP2
meshes, against the single-process model run on every document alone; a difference is named
by the first quantity and module that differ.

* :mod:`~cpshard.parity.models`, :mod:`~cpshard.parity.batches`: what runs;
* :mod:`~cpshard.parity.config`: the setup and the cases;
* :mod:`~cpshard.parity.probes`: forward hooks that locate the first differing module;
* :mod:`~cpshard.parity.reference`: the single-process reference;
* :mod:`~cpshard.parity.step`: one rank's CP step and its measurements;
* :mod:`~cpshard.parity.verdict`: exact / differs / refused / crashed, and the diagnosis;
* :mod:`~cpshard.parity.runner`: :func:`run_parity`;
* :mod:`~cpshard.parity.report`, :mod:`~cpshard.parity.cli`: the table, JSON and the command.
"""

from cpshard.parity.batches import BatchSpec
from cpshard.parity.config import Case, Setup
from cpshard.parity.models import ModelSpec
from cpshard.parity.runner import ParityReport, default_cases, run_parity
from cpshard.parity.verdict import CaseResult

__all__ = [
    "BatchSpec",
    "Case",
    "CaseResult",
    "ModelSpec",
    "ParityReport",
    "Setup",
    "default_cases",
    "run_parity",
]
