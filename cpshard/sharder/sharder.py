"""The :class:`ContextParallelSharder` class: its arguments, state and the per-step
:meth:`~ContextParallelSharder.shard`; batch planning, index resolution and the token verbs
live in :mod:`~cpshard.sharder.batch_plan`, :mod:`~cpshard.sharder.indices` and
:mod:`~cpshard.sharder.token_verbs`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from cpshard.comm import GroupLike, resolve_group
from cpshard.layout import (
    CLOSED_FORM_LAYOUTS,
    ShardLayout,
    canonical_layout_name,
    resolve_num_chunks,
)
from cpshard.sharder.batch_plan import _KNOWN_KEYS, _BatchPlanning
from cpshard.sharder.indices import _IndexResolution
from cpshard.sharder.token_verbs import _TokenVerbs

__all__ = ["ContextParallelSharder"]


class ContextParallelSharder(_TokenVerbs, _BatchPlanning, _IndexResolution):
    """Shard batches over a CP group and move token-aligned tensors in and out of the layout.

    Args:
        group_or_mesh: the CP group (``ProcessGroup``, 1-D ``DeviceMesh`` or ``None``).
        layout: ``"head_tail"`` (default; aliases ``zigzag``, ``round_robin``), ``"contiguous"``
            (``sequential``), ``"stripe"``, ``"per_document_head_tail"`` or ``"balanced"`` (see
            :mod:`cpshard.layout`). In the direct form, the closed-form layout the caller's
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

    The built-in ``shard`` returns a :class:`~cpshard.targets.ShardedBatch`: the model's inputs
    as keys (``model(**batch)``), and ``batch.targets`` with this rank's shifted labels, the
    global count of labelled tokens, ``loss_mask``, ``padding_mask`` and document ids (see
    :mod:`cpshard.targets` for exactly which keys are kept). Documents come from
    :func:`cpshard.documents.read_documents` (``_packed_seq_ids``, ``seq_idx``, ``cu_seqlens``,
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
    ) -> None:
        what = "cpshard.ContextParallelSharder"
        self._group = resolve_group(group_or_mesh, what)
        rank, world = self._group.rank, self._group.world
        where = f"{what}: rank {rank}"
        if layout is None:
            if shard_batch is None:
                raise ValueError(
                    f"{where}: layout=None needs a shard_batch function (the direct form)"
                )
            self.layout, self.num_chunks = None, num_chunks
        else:
            self.layout = canonical_layout_name(layout, where)
            self.num_chunks = resolve_num_chunks(self.layout, world, num_chunks, where)
        if isinstance(padding_token_id, bool) or not isinstance(padding_token_id, int):
            raise TypeError(
                f"{where}: padding_token_id must be an int, got {type(padding_token_id).__name__}"
            )
        if loss_mask is not None and not isinstance(loss_mask, torch.Tensor):
            raise TypeError(
                f"{where}: loss_mask must be a tensor or None, got {type(loss_mask).__name__}"
            )
        extras = dict(extra_seq_buffers or {})
        if extra_seq_buffers is not None and not isinstance(extra_seq_buffers, Mapping):
            raise TypeError(f"{where}: extra_seq_buffers must map batch keys to their seq dim")
        for key, d in extras.items():
            if not isinstance(key, str) or isinstance(d, bool) or not isinstance(d, int):
                raise TypeError(
                    f"{where}: extra_seq_buffers must map str keys to int seq dims, got {key!r}: "
                    f"{d!r}"
                )
            if key in _KNOWN_KEYS:
                raise ValueError(
                    f"{where}: extra_seq_buffers names {key!r}, which the sharder shards itself"
                )
        if not isinstance(shift_labels, bool):
            raise TypeError(
                f"{where}: shift_labels must be a bool, got {type(shift_labels).__name__}"
            )
        if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ValueError(f"{where}: pad_multiple must be an int >= 1, got {pad_multiple!r}")
        pad_values = dict(extra_pad_values or {})
        if extra_pad_values is not None and not isinstance(extra_pad_values, Mapping):
            raise TypeError(
                f"{where}: extra_pad_values must map extra_seq_buffers keys to pad values"
            )
        unknown = sorted(set(pad_values) - set(extras), key=str)
        if unknown:
            raise ValueError(
                f"{where}: extra_pad_values names {unknown}, which extra_seq_buffers does not"
            )
        for name, fn in (
            ("shard_batch", shard_batch),
            ("local_token_global_indices", local_token_global_indices),
        ):
            if fn is not None and not callable(fn):
                raise TypeError(f"{where}: {name} must be callable, got {type(fn).__name__}")
        if shard_layout is not None:
            if not isinstance(shard_layout, ShardLayout):
                raise TypeError(
                    f"{where}: shard_layout must be a ShardLayout, got "
                    f"{type(shard_layout).__name__}"
                )
            if shard_layout.world_size != world:
                raise ValueError(
                    f"{where}: shard_layout is for world size {shard_layout.world_size}, the "
                    f"group has {world}"
                )
        self._cp_mesh = group_or_mesh
        self._tp_mesh = tp_mesh
        self._loss_mask = loss_mask
        self._padding_token_id = padding_token_id
        self.extra_seq_buffers = extras
        self.extra_pad_values = pad_values
        self.pad_multiple = pad_multiple
        self.shift_labels = shift_labels
        self._user_indices = local_token_global_indices
        self._direct = shard_batch is not None
        self.shard_batch = shard_batch if shard_batch is not None else self._builtin_shard_batch
        if local_token_global_indices is not None:
            self.local_token_global_indices = local_token_global_indices
        elif self.layout in CLOSED_FORM_LAYOUTS:
            self.local_token_global_indices = self._closed_form_indices
        else:
            self.local_token_global_indices = None
        self.shard_layout = shard_layout
        self._cache: dict[tuple, Any] = {}
        self._cache_owner: ShardLayout | None = None

    # ------------------------------------------------------------------ properties / helpers

    @property
    def rank(self) -> int:
        return self._group.rank

    @property
    def world_size(self) -> int:
        return self._group.world

    def _where(self, what: str) -> str:
        return f"cpshard.ContextParallelSharder.{what}: rank {self.rank}"

    # ------------------------------------------------------------------ shard

    def shard(
        self, batch: dict[str, Any]
    ) -> tuple[Callable[[], contextlib.AbstractContextManager], dict[str, Any]]:
        """Shard ``batch`` (pad, shard every sequence-aligned tensor) and keep its layout in
        :attr:`shard_layout` for the token verbs. Returns ``(ctx_factory, sharded_batch)``; the
        input batch is not modified. The built-in ``shard_batch`` registers the sharded
        ``position_ids`` as this step's tokens: CP attention given them
        (:mod:`cpshard.attention.tokens`) raises under another context or outside any."""
        result = self.shard_batch(
            self._cp_mesh,
            self._tp_mesh,
            batch,
            loss_mask=self._loss_mask,
            padding_token_id=self._padding_token_id,
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
        self._cache.clear()
        return ctx, out
