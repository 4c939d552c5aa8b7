"""The sharded batch contract: what the model gets, and the side record the loss reads.

A sharded batch (:class:`ShardedBatch`, returned by :meth:`cpshard.ContextParallelSharder.shard`
and :func:`cpshard.make_cp_blockdiag_batch_and_ctx`) is a ``dict`` of exactly what a model's
forward takes, so ``model(**batch)`` is correct on every rank:

* kept (this rank's shard): ``input_ids``, ``inputs_embeds``, ``position_ids`` (created per
  document when the batch has none), the sharder's ``extra_seq_buffers``;
* kept as given: every entry that is not sequence-aligned (``pixel_values``, ``image_grid_thw``,
  ...);
* removed: ``labels``, ``loss_mask`` and ``padding_mask`` (moved to :attr:`ShardedBatch.targets`)
  and the full sequence's document metadata (:data:`cpshard.batch.documents.DOCUMENT_KEYS`:
  ``attention_mask``, ``_packed_seq_ids``, ``seq_idx``, ``cu_seq_lens_q/k``, ``cu_seqlens``,
  ``max_length_q/k``), which the CP attention replaces.

Its :attr:`~ShardedBatch.targets` (:class:`BatchTargets`) holds this rank's ``labels`` shifted
ONCE over the whole sequence before sharding (a model's own loss would shift again inside each
shard and lose the token at every shard boundary), the global count of labelled tokens, and the
shard's ``loss_mask``, ``padding_mask`` and document ids. The attribute is not a key: copying
the dict (``dict(batch)``, ``{**batch}``) drops it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cpshard.batch.documents import DOCUMENT_KEYS
from cpshard.batch.padding import IGNORE_INDEX

__all__ = ["BatchTargets", "CONSUMED_KEYS", "ShardedBatch", "shift_targets"]

# Batch entries that never reach the model's forward.
CONSUMED_KEYS = ("labels", "loss_mask", "padding_mask", *DOCUMENT_KEYS)


@dataclass(frozen=True)
class BatchTargets:
    """This rank's side of a sharded batch, for the loss (not for the model's forward).

    Attributes:
        labels: ``[B, L]`` this rank's labels; with ``shift_labels`` (the default) the target of
            each local token, i.e. the full sequence's ``labels[:, i + 1]`` (-100 at the last
            position and at padding): pass them to :func:`cpshard.cp_cross_entropy` with the
            logits as they are. None when the batch had no labels.
        num_labelled: 0-d int64, the labelled tokens (labels != -100) of the whole batch on all
            ranks (e.g. ``num_items_in_batch``); None without labels.
        loss_mask: ``[B, L]`` this rank's loss mask (shifted with the labels), or None.
        padding_mask: ``[B, L]`` bool, True at this rank's pad positions.
        document_ids: ``[B, L]`` int64, this rank's document ids (0 = pad).
    """

    labels: torch.Tensor | None
    num_labelled: torch.Tensor | None
    loss_mask: torch.Tensor | None
    padding_mask: torch.Tensor
    document_ids: torch.Tensor


class ShardedBatch(dict):
    """A sharded batch: the model's inputs as keys (``model(**batch)``), the loss's side record
    as :attr:`targets` (see the module doc)."""

    def __init__(self, inputs: dict[str, Any], targets: BatchTargets) -> None:
        super().__init__(inputs)
        self.targets = targets

    def with_targets(self, document_ids_key: str | None = None) -> dict[str, Any]:
        """A plain dict of the inputs plus the side record as keys (``labels``, ``loss_mask``,
        ``padding_mask``, and the document ids under ``document_ids_key`` when given; absent
        entries are left out): the one-dict shape of NeMo's batches."""
        side = self.targets
        extra = {
            "labels": side.labels,
            "loss_mask": side.loss_mask,
            "padding_mask": side.padding_mask,
        }
        if document_ids_key is not None:
            extra[document_ids_key] = side.document_ids
        return {**self, **{key: value for key, value in extra.items() if value is not None}}


def shift_targets(
    labels: torch.Tensor | None, loss_mask: torch.Tensor | None, documents: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``labels`` and ``loss_mask`` ``[B, S]`` shifted once along the sequence, as a causal LM's
    loss does: position i gets position i + 1's value, except where position i + 1 belongs to
    another document or is padding (``documents`` ``[B, S]``, 0 = padding): a document's last
    token has no target (-100 / 0), since its next token lies where its attention cannot see."""
    ends = documents[:, 1:] != documents[:, :-1]
    ends |= documents[:, :-1] == 0

    def shift(t: torch.Tensor | None, fill: int) -> torch.Tensor | None:
        if t is None:
            return None
        out = F.pad(t[:, 1:], (0, 1), value=fill)
        out[:, :-1].masked_fill_(ends.to(t.device), fill)
        return out

    return shift(labels, IGNORE_INDEX), shift(loss_mask, 0)
