"""One rank's CP step of a parity case, and what it measures: the loss, the labelled-token
count, the gathered logits and module tensors compared with the reference, every gradient, and
the step's per-rank attention cost and K/V bytes. Runs on every rank of a
:class:`cpshard.testing.RankPool`; returns plain data."""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch
import torch.distributed as dist

from cpshard.attention.state import active_state
from cpshard.integrations import linear_head
from cpshard.loss import cp_cross_entropy, reduce_cp_gradients
from cpshard.parity.batches import IGNORE, make_batch
from cpshard.parity.config import BLOCKDIAG, Case, Setup
from cpshard.parity.models import build_model, forward, kv_row_bytes, load_object, vocab_size
from cpshard.parity.probes import origin, recording
from cpshard.parity.reference import Reference, ReplicaReference, plain_name
from cpshard.sharder import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx


def error(got: torch.Tensor, want: torch.Tensor | None, valid: torch.Tensor) -> float:
    """Largest |got - want| over the document positions, relative to the reference's magnitude
    where it exceeds 1 (inf for tensors that cannot be compared)."""
    if want is None or tuple(got.shape) != tuple(want.shape):
        return math.inf
    diff = (got.to(torch.float64) - want.to(torch.float64))[valid]
    scale = max(1.0, float(want.to(torch.float64)[valid].abs().max())) if diff.numel() else 1.0
    return float(diff.abs().max()) / scale if diff.numel() else 0.0


def _groups(case: Case) -> tuple[Any, Any, int]:
    """``(CP group, the device mesh or None, this rank's data-parallel replica)``."""
    if case.dp == 1 and case.fsdp is None:
        return dist.group.WORLD, None, 0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (case.dp, case.cp), mesh_dim_names=("dp", "cp"))
    return mesh["cp"].get_group(), mesh, mesh.get_local_rank("dp")


def _fsdp(model: torch.nn.Module, mesh: Any, mode: str) -> None:
    """FSDP2 on every child of a ``ModuleList`` (the layers) and the root, over ``mode``'s mesh."""
    from torch.distributed.fsdp import fully_shard

    target = {
        "flat": lambda: mesh["dp", "cp"]._flatten("dp_cp"),
        "hsdp": lambda: mesh,
        "dp": lambda: mesh["dp"],
    }[mode]()
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            for layer in m:
                fully_shard(layer, mesh=target)
    fully_shard(model, mesh=target)


CHUNKED_LOSS = "cp_linear_cross_entropy"
LOGITS_LOSS = "cp_cross_entropy"


def loss_choice(setup: Setup, model: torch.nn.Module) -> tuple[str, str | None]:
    """The loss the step computes and, where it is not the chunked one, why: the user's
    ``--loss``; else, as ``CPTrainer`` chooses, :func:`cpshard.cp_linear_cross_entropy` from the
    final hidden states where the model's LM head allows it
    (:func:`cpshard.integrations.linear_head.head_problem`), else
    :func:`cpshard.cp_cross_entropy` of the logits."""
    if setup.loss is not None:
        return setup.loss, "the loss given"
    problem = linear_head.head_problem(model)
    return (CHUNKED_LOSS, None) if problem is None else (LOGITS_LOSS, problem)


def _chunked_loss(
    model: torch.nn.Module, ids: torch.Tensor, local: Any, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss as ``CPTrainer`` computes it through the model's installed forward
    (:func:`cpshard.integrations.linear_head.install`): the batch's targets as ``shift_labels``,
    the CP group's labelled-token count as ``num_items_in_batch``, each rank's share times the
    group's size (what the Trainer's CP arithmetic makes of it); and the labels it used."""
    labels = local.targets.labels
    count = (labels != IGNORE).sum()
    dist.all_reduce(count, group=group)
    out = model(
        input_ids=ids, position_ids=local["position_ids"], shift_labels=labels,
        num_items_in_batch=count, use_cache=False, **{linear_head.LINEAR_LOSS_KWARG: True},
    )  # fmt: skip
    return out.loss * dist.get_world_size(group), labels


def _loss(
    setup: Setup, logits: torch.Tensor, local: Any, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the labels it used (the user's loss, else cpshard's)."""
    if setup.loss is None:
        labels = local.targets.labels
        return cp_cross_entropy(logits, labels, group), labels
    out = load_object(setup.loss, "loss")(logits, local, group)
    if isinstance(out, tuple):
        return out[0], out[1]
    return out, local.targets.labels


def _cost(state: Any) -> int:
    """This rank's attention cost: query-key pairs over its spans."""
    if state is None:
        return 0
    return sum(
        s.n * (s.split - s.k) + (s.n * (s.n + 1) // 2 if state.causal else 0) for s in state.spans
    )


def _measure(setup: Setup, case: Case, ref: Reference) -> dict[str, Any]:
    group, mesh, replica = _groups(case)
    model = build_model(setup.model)
    if case.fsdp is not None:
        _fsdp(model, mesh, case.fsdp)
    loss_name, loss_reason = loss_choice(setup, model)
    chunked = loss_name == CHUNKED_LOSS
    if chunked:
        linear_head.install(model)
    batch = make_batch(setup.batch, vocab_size(model), replica)
    mine: ReplicaReference = ref.replicas[replica]
    gather = ContextParallelSharder(
        group, "contiguous" if case.layout == BLOCKDIAG else case.layout
    )
    if case.layout == BLOCKDIAG:
        gather.shard(batch)  # the same shards (the token verbs' partition only)
        ctx, local = make_cp_blockdiag_batch_and_ctx(group, None, batch)
    else:
        ctx, local = gather.shard(batch)
    ids = local["input_ids"]
    with ctx():
        state = active_state()
        with recording(model, ids.shape[0], ids.shape[1]) as rec:
            if chunked:
                loss, labels = _chunked_loss(model, ids, local, group)
            else:
                logits = forward(model, setup.model, ids, local["position_ids"])
        if chunked:  # the logits, never held by the loss, for the comparison only
            with torch.no_grad():
                logits = forward(model, setup.model, ids, local["position_ids"])
        else:
            loss, labels = _loss(setup, logits, local, group)
    loss.backward()
    if case.fsdp in (None, "dp"):
        reduce_cp_gradients(model, group)

    count = (labels != IGNORE).sum().reshape(1).to(torch.float64)
    mean_loss = loss.detach().reshape(1).to(torch.float64).clone()
    dist.all_reduce(count, group=group)
    dist.all_reduce(mean_loss, group=group)
    mean_loss /= dist.get_world_size(group)

    full = {}  # (name, slot) -> gathered tensor, same order on every rank
    for call in rec.calls:
        for slot, t in [(-1, call.output), *enumerate(call.inputs)]:
            if t is not None and t.dtype.is_floating_point:
                full[(call.name, slot)] = gather.gather_token_tensor(t, seq_dim=1, trim=True)
    logits_full = gather.gather_token_tensor(logits.detach(), seq_dim=1, trim=True)
    once = set(rec.by_name())

    def differs(name: str, slot: int, t: torch.Tensor) -> bool:
        slots = mine.modules.get(name)
        if name not in once or slots is None or (name, slot) not in full:
            return False
        want = slots[0] if slot == -1 else (slots[slot + 1] if slot + 1 < len(slots) else None)
        return error(full[(name, slot)], want, mine.valid) > setup.tol

    first_layer = origin(rec.calls, differs)

    worst_name, worst, dot, norm2, ref2 = None, 0.0, 0.0, 0.0, 0.0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if hasattr(g, "full_tensor") else g
        want = ref.grads[plain_name(name)]
        e = float((g - want).abs().max()) if g.numel() else 0.0
        if e > worst:
            worst_name, worst = plain_name(name), e
        norm2 += float((g * g).sum())
        ref2 += float((want * want).sum())
        dot += float((g * want).sum())
    rows = state.exchange.received_rows if state is not None else 0
    row_bytes = kv_row_bytes(model)
    return {
        "loss": float(mean_loss),
        "ref_loss": mine.loss,
        "count": int(count),
        "ref_count": mine.count,
        "logits_err": error(logits_full, mine.logits, mine.valid),
        "grad_err": worst,
        "grad_worst": worst_name,
        "grad_norm_ratio": math.sqrt(norm2 / ref2)
        if ref2 > 0
        else (1.0 if norm2 == 0 else math.inf),
        "grad_cosine": dot / math.sqrt(norm2 * ref2) if norm2 > 0 and ref2 > 0 else 1.0,
        "first_layer": first_layer,
        "cost": _cost(state),
        "kv_rows": rows,
        "kv_bytes": rows * row_bytes if row_bytes is not None else None,
        "cp": dist.get_world_size(group),
        "loss_fn": loss_name,
        "loss_reason": loss_reason,
    }


def run_case(rank: int, world: int, setup: Setup, case: Case, ref: Reference) -> dict[str, Any]:
    """This rank's measurements of ``case``, or ``{"error": ..., "error_type": ...,
    "traceback": ...}`` when the step raised here."""
    torch.manual_seed(setup.model.seed)
    try:
        return _measure(setup, case, ref)
    except Exception as exc:  # noqa: BLE001 - reported as the case's verdict
        return {
            "error": str(exc),
            "error_type": type(exc).__name__,
            "traceback": traceback.format_exc(),
        }
