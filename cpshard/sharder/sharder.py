"""The :class:`ContextParallelSharder` class: its arguments and the per-step
:meth:`~ContextParallelSharder.shard`, composed of the step's batch planning
(:mod:`~cpshard.sharder.planning`), the partition it follows (:mod:`~cpshard.sharder.partition`)
and the token verbs (:mod:`~cpshard.sharder.token_verbs`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cpshard.comm import GroupLike, resolve_group, split_cp_mesh
from cpshard.layouts import (
    ShardLayout,
    canonical_layout_name,
    is_closed_form,
    resolve_num_chunks,
)
from cpshard.planning import StepPlan
from cpshard.sharder.partition import Partition
from cpshard.sharder.planning import KNOWN_KEYS, BatchPlanner, StepPlanner, check_strategy
from cpshard.sharder.token_verbs import TokenVerbs
from cpshard.validation import check_bool, check_int, is_int

__all__ = ["ContextParallelSharder"]


class ContextParallelSharder:
    """Shard batches over a CP group and move token-aligned tensors in and out of the layout.

    Args:
        group_or_mesh: the CP group (``ProcessGroup``, 1-D ``DeviceMesh`` or ``None``), or a 2-D
            ``DeviceMesh`` ``(inter, intra)`` whose flattening is the CP group (rank ``inter *
            intra_size + intra``) and whose dims the ``hierarchical`` strategy uses.
        layout: ``"head_tail"`` (default; aliases ``zigzag``, ``round_robin``), ``"contiguous"``
            (``sequential``), ``"stripe"``, ``"per_document_head_tail"`` or ``"balanced"`` (see
            :mod:`cpshard.layouts`). In the direct form, the closed-form layout the caller's
            ``shard_batch`` follows (used when it reports no layout), or ``None``.
        padding_token_id: the ``input_ids`` value of padded positions.
        loss_mask: a ``[B, S]`` loss mask (aligned with ``labels``), sharded into
            ``batch.targets.loss_mask`` (padded with 0); overrides one in the batch.
        extra_seq_buffers: ``{key: seq_dim}`` of further sequence-aligned batch entries to shard
            (padded with 0 / False); keys absent from a batch are skipped.
        num_chunks: chunks of ``head_tail`` (per document for ``per_document_head_tail``), a
            multiple of the world size; default ``2W``.
        pad_multiple: every rank's shard length is padded to a multiple of it (e.g. a model's
            compression ratio); default 1.
        extra_pad_values: ``{key: value}`` pad values of ``extra_seq_buffers`` entries (default 0).
        tp_mesh: passed through to a caller-supplied ``shard_batch``.
        shard_batch: direct form: ``(cp_mesh, tp_mesh, batch, *, loss_mask, padding_token_id)
            -> (ctx_factory, batch, ShardLayout | None)``.
        local_token_global_indices: direct form: ``(cp_mesh, padded_seq_len, device) ->
            LongTensor`` of this rank's global positions.
        shard_layout: a layout to start from (e.g. the one a previous sharder reported).
        shift_labels: shift ``labels`` (and ``loss_mask``) once over the whole sequence before
            sharding (default True: labels as a causal LM takes them); False for labels that
            are already targets.
        strategy: how CP attention exchanges (:mod:`cpshard.attention.strategy`):
            ``"needed_rows"`` (each rank receives the K/V rows its queries reach),
            ``"heads"`` (head parallel: an all-to-all before and after attention),
            ``"hierarchical"`` (heads inside ``intra``, needed rows across ``inter``; a 2-D
            mesh), or ``"auto"`` (default: per step and head shape, the one whose busiest rank
            receives the fewest bytes). The model's code is the same under each.

    The built-in ``shard`` returns a :class:`~cpshard.batch.targets.ShardedBatch`: the model's inputs
    as keys (``model(**batch)``), and ``batch.targets`` with this rank's shifted labels, the
    global count of labelled tokens, ``loss_mask``, ``padding_mask`` and document ids (see
    :mod:`cpshard.batch.targets` for exactly which keys are kept). Documents come from
    :func:`cpshard.batch.documents.read_documents` (``_packed_seq_ids``, ``seq_idx``, ``cu_seqlens``,
    masks, ``position_ids`` restarts; contradictions raise on every rank).

    Padding (the same for every layout): ``input_ids`` = ``padding_token_id``, ``labels`` =
    -100, ``position_ids`` continue (last + 1, + 2, ...; created per document, restarting at 0,
    when absent), ``loss_mask`` = 0, ``padding_mask`` = True, document ids = 0,
    ``inputs_embeds`` and extra buffers = 0.
    """

    def __init__(
        self,
        group_or_mesh: GroupLike = None,
        layout: str | None = "head_tail",
        *,
        padding_token_id: int = 0,
        loss_mask: torch.Tensor | None = None,
        extra_seq_buffers: Mapping[str, int] | None = None,
        num_chunks: int | None = None,
        tp_mesh: Any = None,
        shard_batch: Callable[..., tuple] | None = None,
        local_token_global_indices: Callable[..., torch.Tensor] | None = None,
        shard_layout: ShardLayout | None = None,
        pad_multiple: int = 1,
        extra_pad_values: Mapping[str, Any] | None = None,
        shift_labels: bool = True,
        strategy: str = "auto",
    ) -> None:
        what = "cpshard.ContextParallelSharder"
        group_or_mesh, mesh = split_cp_mesh(group_or_mesh, what)
        self._group = resolve_group(group_or_mesh, what)
        where = f"{what}: rank {self._group.rank}"
        check_strategy(strategy, mesh, where)
        layout, num_chunks = _layout_arguments(
            layout, num_chunks, shard_batch, self._group.world, where
        )
        check_int(padding_token_id, "padding_token_id", where)
        check_bool(shift_labels, "shift_labels", where)
        if loss_mask is not None and not isinstance(loss_mask, torch.Tensor):
            raise TypeError(
                f"{where}: loss_mask must be a tensor or None, got {type(loss_mask).__name__}"
            )
        if not is_int(pad_multiple) or pad_multiple < 1:
            raise ValueError(f"{where}: pad_multiple must be an int >= 1, got {pad_multiple!r}")
        extras, pad_values = _buffer_arguments(extra_seq_buffers, extra_pad_values, where)
        _direct_form_arguments(
            shard_batch, local_token_global_indices, shard_layout, self._group.world, where
        )
        self._cp_mesh = group_or_mesh
        self._tp_mesh = tp_mesh
        self._loss_mask = loss_mask
        self._padding_token_id = padding_token_id
        self._planner = BatchPlanner(
            layout, num_chunks, pad_multiple, extras, pad_values, shift_labels,
            strategy=strategy, mesh=mesh,
        )  # fmt: skip
        self._partition = Partition(
            self._group,
            group_or_mesh,
            layout,
            num_chunks,
            local_token_global_indices,
            shard_layout,
        )
        self._verbs = TokenVerbs(self._partition)
        self.shard_batch = shard_batch if shard_batch is not None else self._planner.shard_batch
        if local_token_global_indices is not None:
            self.local_token_global_indices = local_token_global_indices
        elif is_closed_form(layout):
            self.local_token_global_indices = self._partition.closed_form_indices
        else:
            self.local_token_global_indices = None

    # ------------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def world_size(self) -> int:
        return self._group.world

    @property
    def layout(self) -> str | None:
        """The built-in layout's canonical name (None in the direct form)."""
        return self._partition.layout

    @property
    def num_chunks(self) -> int | None:
        return self._partition.num_chunks

    @property
    def shard_layout(self) -> ShardLayout | None:
        """The layout of the last shard (or the one given to start from): the token verbs
        follow it."""
        return self._partition.shard_layout

    @shard_layout.setter
    def shard_layout(self, layout: ShardLayout | None) -> None:
        self._partition.shard_layout = layout

    @property
    def extra_seq_buffers(self) -> dict[str, int]:
        return self._planner.extra_seq_buffers

    @property
    def extra_pad_values(self) -> dict[str, Any]:
        return self._planner.extra_pad_values

    @property
    def pad_multiple(self) -> int:
        return self._planner.pad_multiple

    @property
    def shift_labels(self) -> bool:
        return self._planner.shift_labels

    def _where(self, what: str) -> str:
        return self._partition.where(what)

    def _indices(self, padded_seq_len: int, device) -> torch.Tensor:
        """This rank's global positions for ``padded_seq_len`` (``[L]``, or ``[B, L]`` per row)."""
        return self._partition.indices(padded_seq_len, device)

    # ------------------------------------------------------------------ token verbs

    def shard_token_tensor(
        self, tensor: torch.Tensor, seq_dim: int = 1, fill: float | int | None = None
    ) -> torch.Tensor:
        """Shard a full-length token-aligned tensor exactly like the model inputs
        (differentiably); see :meth:`cpshard.sharder.token_verbs.TokenVerbs.shard_token_tensor`."""
        return self._verbs.shard_token_tensor(tensor, seq_dim, fill)

    def gather_token_tensor(
        self,
        tensor: torch.Tensor,
        seq_dim: int = 1,
        trim: bool = False,
        fill: float | int | None = None,
    ) -> torch.Tensor:
        """Differentiably gather a token-aligned local shard to global order; see
        :meth:`cpshard.sharder.token_verbs.TokenVerbs.gather_token_tensor`."""
        return self._verbs.gather_token_tensor(tensor, seq_dim, trim, fill)

    # ------------------------------------------------------------------ shard

    def plan(self, batch: dict[str, Any]) -> StepPlan:
        """This rank's plan of the step for ``batch``: its layout and every table its CP
        attention uses, host work only (no communication, no device), picklable. Make it where
        the batch is made (in a ``DataLoader`` worker's collate function) and pass it to
        :meth:`shard`, which then does only the step's consensus round and the sharding. A bad
        batch raises here on this rank alone (and again in :meth:`shard`, on every rank)."""
        return self._step_planner("plan")(batch)

    def planner(self) -> StepPlanner:
        """:meth:`plan` as a picklable callable for this rank (``planner(batch)`` returns the
        same plan), for a ``DataLoader`` worker in a process of its own (``spawn``): it holds
        the sharder's settings and this rank's place in the group, not the group."""
        return self._step_planner("planner")

    def _step_planner(self, method: str) -> StepPlanner:
        """This rank's built-in planning (a sharder in the direct form has none)."""
        if self.shard_batch != self._planner.shard_batch:
            raise TypeError(
                f"{self._where(method)}: a sharder in the direct form (its own shard_batch) has "
                "no built-in planning"
            )
        return self._planner.step_planner(self.rank, self.world_size)

    def shard(
        self, batch: dict[str, Any], plan: StepPlan | None = None
    ) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any]]:
        """Shard ``batch`` (pad, shard every sequence-aligned tensor) and keep its layout in
        :attr:`shard_layout` for the token verbs. Returns ``(ctx_factory, sharded_batch)``; the
        input batch is not modified. The built-in ``shard_batch`` registers the sharded
        ``position_ids`` as this step's tokens: CP attention given them
        (:mod:`cpshard.attention.tokens`) raises under another context or outside any.
        ``plan``: the step's plan made ahead by :meth:`plan` for this batch (a plan made for
        another batch, layout, rank, world size or strategy raises on every rank)."""
        if plan is not None and self.shard_batch != self._planner.shard_batch:
            raise TypeError(
                f"{self._where('shard')}: plan= needs the built-in shard_batch (this sharder is "
                "in the direct form)"
            )
        extra = {} if plan is None else {"step_plan": plan}
        result = self.shard_batch(
            self._cp_mesh,
            self._tp_mesh,
            batch,
            loss_mask=self._loss_mask,
            padding_token_id=self._padding_token_id,
            **extra,
        )
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(
                f"{self._where('shard')}: shard_batch must return (ctx_factory, batch, "
                "ShardLayout | None)"
            )
        ctx, out, layout = result
        if layout is not None:
            if not isinstance(layout, ShardLayout):
                raise TypeError(
                    f"{self._where('shard')}: shard_batch reported a {type(layout).__name__}, not "
                    "a ShardLayout"
                )
            if layout.world_size != self.world_size:
                raise ValueError(
                    f"{self._where('shard')}: shard_batch reported a layout for world size "
                    f"{layout.world_size}, the group has {self.world_size}"
                )
        self.shard_layout = layout
        return ctx, out


def _layout_arguments(
    layout: object, num_chunks: object, shard_batch: object, world: int, where: str
) -> tuple[str | None, int | None]:
    """The canonical layout name and its chunk count (None, None in the direct form)."""
    if layout is None:
        if shard_batch is None:
            raise ValueError(f"{where}: layout=None needs a shard_batch function (the direct form)")
        return None, num_chunks
    name = canonical_layout_name(layout, where)
    return name, resolve_num_chunks(name, world, num_chunks, where)


def _buffer_arguments(
    extra_seq_buffers: object, extra_pad_values: object, where: str
) -> tuple[dict[str, int], dict[str, Any]]:
    """``extra_seq_buffers`` and ``extra_pad_values`` checked, as dicts."""
    if extra_seq_buffers is not None and not isinstance(extra_seq_buffers, Mapping):
        raise TypeError(f"{where}: extra_seq_buffers must map batch keys to their seq dim")
    extras = dict(extra_seq_buffers or {})
    for key, d in extras.items():
        if not isinstance(key, str) or not is_int(d):
            raise TypeError(
                f"{where}: extra_seq_buffers must map str keys to int seq dims, got {key!r}: {d!r}"
            )
        if key in KNOWN_KEYS:
            raise ValueError(
                f"{where}: extra_seq_buffers names {key!r}, which the sharder shards itself"
            )
    if extra_pad_values is not None and not isinstance(extra_pad_values, Mapping):
        raise TypeError(f"{where}: extra_pad_values must map extra_seq_buffers keys to pad values")
    pad_values = dict(extra_pad_values or {})
    unknown = sorted(set(pad_values) - set(extras), key=str)
    if unknown:
        raise ValueError(
            f"{where}: extra_pad_values names {unknown}, which extra_seq_buffers does not"
        )
    return extras, pad_values


def _direct_form_arguments(
    shard_batch: object,
    local_token_global_indices: object,
    shard_layout: object,
    world: int,
    where: str,
) -> None:
    """The direct form's callables and a starting layout checked."""
    for name, fn in (
        ("shard_batch", shard_batch),
        ("local_token_global_indices", local_token_global_indices),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{where}: {name} must be callable, got {type(fn).__name__}")
    if shard_layout is None:
        return
    if not isinstance(shard_layout, ShardLayout):
        raise TypeError(
            f"{where}: shard_layout must be a ShardLayout, got {type(shard_layout).__name__}"
        )
    if shard_layout.world_size != world:
        raise ValueError(
            f"{where}: shard_layout is for world size {shard_layout.world_size}, the group has "
            f"{world}"
        )
