"""The single-process reference of a parity check: the same model, each document of each
data-parallel replica's batch run alone, the token-mean loss of every replica averaged, one
backward. What it records is laid out in the packed batch's coordinates, for comparison with
the CP step's gathered tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.parity.batches import IGNORE, documents, reference_targets
from cpshard.parity.models import ModelSpec, forward
from cpshard.parity.probes import recording


@dataclass
class ReplicaReference:
    """One replica's reference: loss, labelled-token count, logits and module tensors
    ``[B, S, ...]`` (zeros off the documents), and which positions hold document tokens."""

    loss: float
    count: int
    logits: torch.Tensor
    valid: torch.Tensor  # [B, S] bool
    modules: dict[str, list[torch.Tensor | None]] = field(default_factory=dict)  # output first


@dataclass
class Reference:
    """Every replica's reference and the gradients of their mean loss, by parameter name."""

    replicas: list[ReplicaReference]
    grads: dict[str, torch.Tensor]

    @property
    def loss(self) -> float:
        return sum(r.loss for r in self.replicas) / len(self.replicas)


def _place(
    store: dict, key: tuple, t: torch.Tensor | None, shape: tuple[int, int], doc: Any
) -> None:
    """Put document ``doc``'s tensor ``t`` ``[1, n, ...]`` into the full tensor under ``key``
    (made on first use; None once any document's tensor does not fit)."""
    if key in store and store[key] is None:
        return
    if t is None:
        store[key] = None
        return
    full = store.get(key)
    if full is None:
        full = store[key] = torch.zeros(*shape, *t.shape[2:], dtype=t.dtype)
    if tuple(full.shape[2:]) != tuple(t.shape[2:]):
        store[key] = None
        return
    full[doc.row, doc.start : doc.end] = t[0]


def replica_reference(
    model: torch.nn.Module, spec: ModelSpec, batch: dict[str, Any]
) -> tuple[ReplicaReference, torch.Tensor]:
    """One replica's record and its loss (a graph to back-propagate)."""
    ids = batch["input_ids"]
    shape = (ids.shape[0], ids.shape[1])
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    logits_full: dict = {}
    store: dict = {}
    names: set[str] = set()
    valid = torch.zeros(shape, dtype=torch.bool)
    for doc in documents(batch):
        n = doc.end - doc.start
        x = ids[doc.row : doc.row + 1, doc.start : doc.end]
        with recording(model, 1, n) as rec:
            logits = forward(model, spec, x, torch.arange(n).view(1, n))
        targets = reference_targets(batch, doc)
        total = total + F.cross_entropy(logits[0], targets, ignore_index=IGNORE, reduction="sum")
        count += int((targets != IGNORE).sum())
        _place(logits_full, ("logits",), logits.detach(), shape, doc)
        valid[doc.row, doc.start : doc.end] = True
        for name, call in rec.by_name().items():
            names.add(name)
            _place(store, (name, -1), call.output, shape, doc)
            for i, t in enumerate(call.inputs):
                _place(store, (name, i), t, shape, doc)
    modules: dict[str, list[torch.Tensor | None]] = {}
    for name in names:
        slots = sorted(i for (m, i) in store if m == name and i >= 0)
        modules[name] = [store.get((name, -1))] + [store.get((name, i)) for i in slots]
    loss = total / max(count, 1)
    record = ReplicaReference(float(loss.detach()), count, logits_full[("logits",)], valid, modules)
    return record, loss


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (checkpoint wrapper, compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def reference(
    model: torch.nn.Module, spec: ModelSpec, batches: list[dict[str, Any]], cp: int = 1
) -> Reference:
    """The reference of ``batches`` (one per data-parallel replica) on ``model``. The loss is
    back-propagated scaled by the CP size ``cp`` and the gradients divided back, as the ranks'
    ``cp_cross_entropy`` scale theirs: the same arithmetic, so that models computing in float32
    inside (transformers' RMSNorm) round alike at a CP size that is not a power of two."""
    records, losses = [], []
    for batch in batches:
        record, loss = replica_reference(model, spec, batch)
        records.append(record)
        losses.append(loss)
    (sum(losses) / len(losses) * cp).backward()
    grads = {
        plain_name(n): (p.grad.detach() / cp if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return Reference(records, grads)
