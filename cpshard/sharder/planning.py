"""The step's batch planning, shared by :class:`~cpshard.sharder.ContextParallelSharder` and
:func:`~cpshard.make_cp_blockdiag_batch_and_ctx`: :class:`BatchPlanner` is the built-in
``shard_batch`` of a layout (validation, padding, positions, targets, the layout, the per-step
consensus fields every rank agrees on, the step's CP attention state, and the rows' token types
kept in it for the model's mask: :mod:`cpshard.batch.token_types`), :class:`_BatchPlan` shards
a planned batch for one rank.

Every sequence-aligned entry is sharded like the inputs: the ones the planner knows
(``input_ids``, ``inputs_embeds``, ``labels``, ``loss_mask``, ``position_ids``), the ones named
in ``extra_seq_buffers`` (any seq dim), and every other ``[B, S, ...]`` tensor of the batch
(seq dim 1, padded with 0), so that no sequence-aligned entry reaches the model whole."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cpshard.attention.activation import activated
from cpshard.attention.state import STRATEGIES
from cpshard.attention.step import state_from_plan
from cpshard.attention.tokens import register_tokens
from cpshard.batch.documents import DocumentError, document_positions_at, read_documents
from cpshard.batch.padding import IGNORE_INDEX, pad_sequence, pad_value, sequence_dim
from cpshard.batch.targets import CONSUMED_KEYS, BatchTargets, ShardedBatch, shift_targets
from cpshard.batch.token_types import (
    keep_for_step,
    pad_token_types,
    read_token_types,
    token_types_field,
)
from cpshard.comm import Group, GroupLike, resolve_group
from cpshard.consensus import agree
from cpshard.fingerprints import digest
from cpshard.layouts import ShardLayout, is_closed_form, make_layout, padded_seq_len
from cpshard.planning import StepPlan, plan_step
from cpshard.sharder.partition import gather_rows
from cpshard.validation import Problem, dim_arg, tensor_arg

# Keys the sharder handles itself (extra_seq_buffers may not name them).
KNOWN_KEYS = ("input_ids", "inputs_embeds", "position_ids", *CONSUMED_KEYS)


def check_strategy(strategy: object, mesh: tuple[Group, Group] | None, where: str) -> None:
    """``strategy`` is one of ``STRATEGIES``, and ``hierarchical`` has its 2-D mesh."""
    if strategy not in STRATEGIES:
        raise ValueError(f"{where}: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "hierarchical" and mesh is None:
        raise ValueError(
            f"{where}: strategy='hierarchical' needs a 2-D CP DeviceMesh (inter, intra) as the "
            "group"
        )


class BatchPlanner:
    """The built-in ``shard_batch`` of a layout: ``layout`` (canonical name, or None for a
    sharder in the direct form, which has no built-in one), ``num_chunks``, ``pad_multiple``,
    ``extra_seq_buffers`` / ``extra_pad_values`` and ``shift_labels`` as the sharder takes them
    (checked there). ``what`` names the entry point in errors. ``strategy``: the attention
    exchange's (:mod:`cpshard.attention.strategy`); ``mesh``: the ``(inter, intra)`` groups
    of a 2-D CP mesh (:func:`cpshard.comm.split_cp_mesh`)."""

    def __init__(
        self,
        layout: str | None,
        num_chunks: int | None,
        pad_multiple: int,
        extra_seq_buffers: dict[str, int],
        extra_pad_values: dict[str, Any],
        shift_labels: bool,
        what: str = "cpshard.ContextParallelSharder.shard",
        strategy: str = "auto",
        mesh: tuple[Group, Group] | None = None,
    ) -> None:
        self.layout, self.num_chunks, self.pad_multiple = layout, num_chunks, pad_multiple
        self.extra_seq_buffers, self.extra_pad_values = extra_seq_buffers, extra_pad_values
        self.shift_labels, self.what = shift_labels, what
        self.strategy, self.mesh = strategy, mesh

    def shard_batch(
        self,
        cp_mesh: GroupLike,
        tp_mesh: Any,
        batch: dict[str, Any],
        *,
        loss_mask: torch.Tensor | None = None,
        padding_token_id: int = 0,
        step_plan: StepPlan | None = None,
    ) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any], ShardLayout]:
        """Shard ``batch`` for this rank of ``cp_mesh`` (NeMo's ``shard_batch`` signature; ``tp_mesh``
        is unused): ``(ctx_factory, sharded batch, layout)``; every rank raises on a bad batch.
        ``step_plan``: this rank's plan of the step made ahead by :meth:`plan` (a plan made for
        another batch, layout, rank, world size or strategy raises on every rank)."""
        what = self.what
        g = resolve_group(cp_mesh, what)
        problem, plan = None, None
        try:
            plan = self._plan_batch(batch, loss_mask, padding_token_id, g.world, step_plan)
            if step_plan is not None:
                self._check_step_plan(step_plan, plan, g)
        except Problem as p:
            problem = str(p)
        fields = {
            "batch size": [plan.rows if plan else 0],
            "sequence length": [plan.seq_len if plan else 0],
            "padded length": [plan.layout.padded_seq_len if plan else 0],
            "partition": digest(plan.layout.partition_key() if plan else None),
            "document ids": digest(plan.documents if plan else None),
            # the masks read the row's token types like the documents (cpshard.batch.token_types)
            "token types": token_types_field(plan.token_types if plan else {}),
            # ranks on other strategies (or meshes) would issue other collectives and hang
            "attention strategy": [
                STRATEGIES.index(self.strategy),
                *((m.world for m in self.mesh) if self.mesh else (0, 0)),
            ],
        }
        # One small all-gather: every rank raises if any rank's batch is bad, and ranks whose
        # batches (hence data-dependent partitions, or documents) differ are named instead of
        # silently mixed.
        agree(g, what, problem, fields)
        if step_plan is None:
            step_plan = plan_step(g.rank, plan.layout, plan.padded_documents(), self.strategy,
                                  self._mesh_dims())  # fmt: skip
        state = state_from_plan(g, step_plan, plan.device, self.mesh)
        if plan.token_types:  # the whole padded row's, for the model's mask (global order)
            padded = pad_token_types(plan.token_types, plan.layout.padded_seq_len)
            keep_for_step(state.derived, padded)
        sharded = plan.apply(g.rank)
        register_tokens(sharded["position_ids"], state)  # attention checks whose tokens they are
        return lambda: activated(state), sharded, plan.layout

    def step_planner(self, rank: int, world: int) -> StepPlanner:
        """``rank``'s plan of a step, for ``world`` ranks, as a picklable callable (no groups
        held): host work only, no communication. It raises ``ValueError`` / ``TypeError`` on a
        bad batch (on this rank alone; :meth:`shard_batch` checks it again on every rank)."""
        settings = copy.copy(self)
        settings.mesh = None  # groups do not cross processes; the plan needs only their sizes
        return StepPlanner(settings, rank, world, self._mesh_dims())

    def _mesh_dims(self) -> tuple[int, int] | None:
        return None if self.mesh is None else (self.mesh[0].world, self.mesh[1].world)

    def _check_step_plan(self, step_plan: object, planned: _BatchPlan, g: Group) -> None:
        """``step_plan`` must be this rank's plan of this batch, layout and strategy."""
        if not isinstance(step_plan, StepPlan):
            raise Problem(
                f"plan must be a StepPlan (from sharder.plan(batch)), got "
                f"{type(step_plan).__name__}", TypeError
            )  # fmt: skip
        made = (step_plan.rank, step_plan.world, step_plan.strategy, step_plan.mesh)
        here = (g.rank, g.world, self.strategy, self._mesh_dims())
        if made != here:
            raise Problem(
                f"the plan was made for (rank, world, strategy, mesh) = {made}, this step is "
                f"{here}"
            )
        lay, n = step_plan.layout, planned.seq_len
        padded = padded_seq_len(n, self.layout, g.world, self.num_chunks, self.pad_multiple)
        made = (lay.name, lay.num_chunks, lay.original_seq_len, lay.padded_seq_len)
        here = (self.layout, self.num_chunks, n, padded)
        if made != here:
            raise Problem(
                f"the plan was made for (layout, num_chunks, seq_len, padded_seq_len) = {made}, "
                f"this step is {here}"
            )
        if not torch.equal(step_plan.documents, planned.padded_documents()):
            raise Problem("the plan was made for another batch (its documents differ)")

    def _plan_batch(
        self,
        batch: object,
        loss_mask,
        padding_token_id: int,
        world: int,
        step_plan: object | None = None,
    ) -> _BatchPlan:
        if not isinstance(batch, Mapping):
            raise Problem(
                f"batch must be a dict of tensors, got {type(batch).__name__}", TypeError
            )
        if self.layout is None:
            raise Problem("the sharder has no built-in layout (layout=None)")
        ref = next(
            (k for k in ("input_ids", "inputs_embeds", "labels") if batch.get(k) is not None), None
        )
        if ref is None:
            raise Problem(
                "batch has none of input_ids, inputs_embeds, labels: nothing gives the sequence "
                "length"
            )
        ref_t = tensor_arg(batch[ref], f"batch[{ref!r}]")
        if ref_t.dim() < 2:
            raise Problem(f"batch[{ref!r}] must be [B, S, ...], got shape {tuple(ref_t.shape)}")
        rows, seq_len = int(ref_t.shape[0]), int(ref_t.shape[1])
        plan = _BatchPlan(batch, rows, seq_len, ref_t.device)

        def add(
            key: str, t: object, seq_dim: int, min_dim: int = 2, max_dim: int | None = 2
        ) -> None:
            t = tensor_arg(t, f"batch[{key!r}]" if key != "loss_mask" else "loss_mask")
            if t.dim() < min_dim or (max_dim is not None and t.dim() > max_dim):
                raise Problem(
                    f"{key} must be [B, S{', ...' if max_dim is None else ''}], got shape "
                    f"{tuple(t.shape)}"
                )
            d = dim_arg(t, seq_dim, f"the seq dim of {key}")
            if t.shape[d] != seq_len:
                raise Problem(
                    f"{key} has {t.shape[d]} positions along dim {d}, but {ref} has {seq_len}"
                )
            if d > 0 and key in KNOWN_KEYS and t.shape[d - 1] not in (rows, 1):
                raise Problem(f"{key} has batch size {t.shape[d - 1]}, but {ref} has {rows}")
            fill = self.extra_pad_values.get(key, 0) if key in self.extra_seq_buffers else None
            if fill is None:
                fill = pad_value(key, padding_token_id)
            plan.items.append((key, t, d, fill))

        if batch.get("input_ids") is not None:
            add("input_ids", batch["input_ids"], 1)
        if batch.get("inputs_embeds") is not None:
            add("inputs_embeds", batch["inputs_embeds"], 1, max_dim=None)
        labels = batch.get("labels")
        mask = loss_mask if loss_mask is not None else batch.get("loss_mask")
        for key, t in (("labels", labels), ("loss_mask", mask)):
            if t is not None:
                tensor_arg(t, f"batch[{key!r}]" if key != "loss_mask" else "loss_mask")
                if tuple(t.shape) != (rows, seq_len):
                    raise Problem(
                        f"{key} must be [B, S] = [{rows}, {seq_len}], got shape {tuple(t.shape)}"
                    )
        try:
            doc_ids, pad = read_documents(batch, rows, seq_len)
        except DocumentError as exc:
            raise Problem(str(exc)) from None
        if self.shift_labels:
            labels, mask = shift_targets(labels, mask, doc_ids)
        if labels is not None:
            add("labels", labels, 1)
        if mask is not None:
            add("loss_mask", mask, 1)
        for key, d in self.extra_seq_buffers.items():
            if batch.get(key) is not None:
                add(key, batch[key], d, min_dim=1, max_dim=None)
        for key, value in batch.items():  # every other [B, S, ...] entry, like the inputs
            if key in KNOWN_KEYS or key in self.extra_seq_buffers:
                continue
            if sequence_dim(key, value, rows, seq_len) is not None:
                add(key, value, 1, max_dim=None)

        pos = batch.get("position_ids")
        if pos is not None:
            pos = tensor_arg(pos, "batch['position_ids']")
            if (
                pos.dim() not in (1, 2, 3)
                or pos.shape[-1] != seq_len
                or (pos.dim() > 1 and pos.shape[-2] not in (rows, 1))
            ):
                raise Problem(
                    f"position_ids must be [B, S] or [3, B, S] (mRoPE) with S = {seq_len}, got "
                    f"shape {tuple(pos.shape)}"
                )
            if pos.dtype.is_floating_point or pos.dtype == torch.bool:
                raise Problem(f"position_ids must hold integers, got {pos.dtype}", TypeError)
        if pos is not None:  # else each rank counts its own positions per document (apply)
            plan.positions = pos[None] if pos.dim() == 1 else pos
        plan.padding = pad.to(ref_t.device)
        plan.documents = doc_ids
        plan.token_types = read_token_types(batch, rows, seq_len)
        if labels is not None:
            plan.num_labelled = (labels != IGNORE_INDEX).sum()
        if isinstance(step_plan, StepPlan) and step_plan.layout.original_seq_len == seq_len:
            plan.layout = step_plan.layout  # planned ahead: checked against the batch after
            return plan
        try:
            plan.layout = make_layout(
                self.layout, world, seq_len,
                doc_ids=None if is_closed_form(self.layout) else doc_ids,
                num_chunks=self.num_chunks, rank_multiple=self.pad_multiple,
            )
        except (TypeError, ValueError) as exc:
            raise Problem(str(exc)) from None
        return plan


@dataclass(frozen=True)
class StepPlanner:
    """One rank's step planning, picklable: ``planner(batch)`` is the rank's
    :class:`~cpshard.planning.StepPlan` of ``batch`` (host work, no communication), in any
    process: a ``DataLoader`` worker started by ``spawn`` or ``forkserver`` as well as a forked
    one. Made by :meth:`cpshard.ContextParallelSharder.planner`."""

    settings: BatchPlanner  # the sharder's batch settings, without its groups
    rank: int
    world: int
    mesh: tuple[int, int] | None  # (nodes, ranks per node) of a 2-D CP mesh

    def __call__(self, batch: object) -> StepPlan:
        settings = self.settings
        try:
            planned = settings._plan_batch(batch, None, 0, self.world)
        except Problem as p:
            raise p.kind(f"{settings.what}: rank {self.rank}: {p}") from None
        documents = planned.padded_documents()
        return plan_step(self.rank, planned.layout, documents, settings.strategy, self.mesh)


class _BatchPlan:
    """A validated batch and its layout; :meth:`apply` shards it for one rank (no communication)."""

    def __init__(self, batch: Mapping, rows: int, seq_len: int, device: torch.device) -> None:
        self.batch, self.rows, self.seq_len, self.device = batch, rows, seq_len, device
        self.items: list[tuple[str, torch.Tensor, int, Any]] = []
        self.positions: torch.Tensor | None = None  # given, or created per document
        self.padding: torch.Tensor | None = None
        self.documents: torch.Tensor | None = None  # on the host
        self.token_types: dict[str, torch.Tensor] = {}  # the rows' [B, S], on the host
        self.num_labelled: torch.Tensor | None = None
        self.layout: ShardLayout | None = None

    def padded_documents(self) -> torch.Tensor:
        """The document ids padded to the layout's length (host int64, 0 = padding)."""
        return pad_sequence("_packed_seq_ids", self.documents, 1, self.layout.padded_seq_len)

    def apply(self, rank: int) -> ShardedBatch:
        lay = self.layout
        padded, n = lay.padded_seq_len, self.seq_len
        by_device: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def index(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            key = str(device)
            if key not in by_device:
                mine = lay.indices(rank, device)
                by_device[key] = (mine, torch.where(mine < n, mine, torch.full_like(mine, -1)))
            return by_device[key]

        def shard(t: torch.Tensor, d: int, fill: Any) -> torch.Tensor:
            return gather_rows(t, d, index(t.device)[1], fill)

        out = {k: v for k, v in self.batch.items() if k not in CONSUMED_KEYS}
        side: dict[str, torch.Tensor] = {}
        for key, t, d, fill in self.items:
            (side if key in CONSUMED_KEYS else out)[key] = shard(t, d, fill)
        if self.positions is None:
            mine = document_positions_at(self.documents, lay.indices(rank))
            out["position_ids"] = mine.to(self.device)
        else:
            pos = pad_sequence("position_ids", self.positions, self.positions.dim() - 1, padded)
            out["position_ids"] = gather_rows(pos, pos.dim() - 1, index(pos.device)[0], 0)
        targets = BatchTargets(
            labels=side.get("labels"),
            num_labelled=self.num_labelled,
            loss_mask=side.get("loss_mask"),
            padding_mask=shard(self.padding, 1, pad_value("padding_mask", 0)),
            document_ids=shard(self.documents.to(self.device), 1, 0),
        )
        return ShardedBatch(out, targets)
