"""Documents, padding and per-document positions of a batch, from every format models produce.

Both per-step entry points (:meth:`cpshard.ContextParallelSharder.shard` and
:func:`cpshard.make_cp_blockdiag_batch_and_ctx`) read a batch's documents here, so they always
agree. A document is a maximal run of non-pad tokens inside one row that no source splits.

**Padding** (True = pad) is the union of: ``padding_mask``; zeros of a 2-D ``attention_mask``
(any dtype);
positions of a 4-D ``attention_mask`` that do not attend to themselves; ``_packed_seq_ids == 0``;
the tail of a ``cu_seqlens`` stream after its last offset.

**Document boundaries** come from these sources (all that the batch carries are read):

1. ``_packed_seq_ids`` ``[B, S]`` (the collator's per-token document index);
2. ``seq_idx`` ``[B, S]`` (transformers' ``DataCollatorWithFlattening(return_seq_idx=True)``);
3. ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``cu_seqlens``: offsets ``[0, ..., n]`` of the documents
   in the flattened ``B * S`` token stream (``DataCollatorWithFlattening(
   return_flash_attn_kwargs=True)``);
4. a 4-D block-causal ``attention_mask`` ``[B, 1, S, S]`` (a token that does not attend to its
   predecessor starts a document);
5. a 2-D ``attention_mask`` holding per-document indices (some value > 1; a 0/1 mask is padding
   only);
6. ``position_ids`` ``[B, S]`` (or ``[S]``) restarting at 0 (``DataCollatorWithFlattening``'s
   default output). mRoPE ``[3, B, S]`` positions are not read: vision tokens repeat positions.

Sources 1-5 must give exactly the same boundaries; ``position_ids`` may continue across a
document boundary (packing without position reset) but may not restart inside a document.
Anything else is contradictory and raises :class:`DocumentError`, which the entry points turn into
an error on every rank. A row start and the first token after padding always start a document.
The ids returned are ``_packed_seq_ids`` as given (0 at every pad) when the batch carries them,
else the documents numbered ``1, 2, ...`` in each row.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cpshard.batch.runs import run_starts

__all__ = [
    "CU_SEQLENS_KEYS",
    "DOCUMENT_KEYS",
    "DocumentError",
    "document_ids",
    "document_positions",
    "document_positions_at",
    "read_documents",
]

CU_SEQLENS_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens")
# Entries that describe the full sequence's documents or attention: consumed by sharding (a
# shard of them would be wrong for the local tokens), never passed on to the model.
DOCUMENT_KEYS = (
    "attention_mask",
    "_packed_seq_ids",
    "seq_idx",
    *CU_SEQLENS_KEYS,
    "max_length_q",
    "max_length_k",
)


class DocumentError(ValueError):
    """The batch's document or padding metadata is malformed or contradictory."""


def _integers(value: object, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise DocumentError(f"{name} must be a tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise DocumentError(f"{name} must hold integers, got {value.dtype}")
    return value.detach().to("cpu", torch.int64)


def _rows(value: torch.Tensor, name: str, rows: int, seq_len: int) -> torch.Tensor:
    """``value`` as ``[B, S]`` (a ``[S]`` or ``[1, S]`` value is shared by every row)."""
    if value.dim() == 1:
        value = value[None]
    if value.dim() != 2 or value.shape[1] != seq_len or value.shape[0] not in (rows, 1):
        raise DocumentError(
            f"{name} must have shape [B, S] = [{rows}, {seq_len}], got shape {tuple(value.shape)}"
        )
    return value.expand(rows, seq_len)


def _attends(mask: torch.Tensor) -> torch.Tensor:
    """A mask as 'attends' booleans (bool / int: nonzero; float: additive, 0 attends)."""
    return mask == 0 if mask.dtype.is_floating_point else mask.bool()


def _cu_seqlens_starts(
    value: object, name: str, rows: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, pad)`` ``[B, S]`` of a 1-D offsets tensor over the flattened ``B * S`` stream."""
    cu = _integers(value, name)
    if cu.dim() == 2 and cu.shape[0] == 1:
        cu = cu[0]
    total = rows * seq_len
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise DocumentError(f"{name} must be 1-D offsets starting at 0, got {cu.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
        raise DocumentError(
            f"{name} must be non-decreasing offsets of at most B * S = {total} tokens, got "
            f"{cu.tolist()}"
        )
    starts = torch.zeros(total, dtype=torch.bool)
    begins = cu[:-1][cu[:-1] < cu[1:]]  # empty documents start nothing
    starts[begins] = True
    pad = torch.arange(total) >= int(cu[-1])
    return starts.view(rows, seq_len), pad.view(rows, seq_len)


def read_documents(
    batch: Mapping[str, Any], rows: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, pad)`` of a batch: document ids ``[B, S]`` int64 (0 = pad) and the padding ``[B, S]``
    bool, both on the host. Raises :class:`DocumentError` on malformed or contradictory sources
    (see the module doc for the sources and their priority)."""
    pad = torch.zeros(rows, seq_len, dtype=torch.bool)
    explicit: list[tuple[str, torch.Tensor | None, torch.Tensor | None]] = []  # name, ids, starts

    given = batch.get("padding_mask")
    if given is not None:
        if not isinstance(given, torch.Tensor):
            raise DocumentError(f"padding_mask must be a tensor, got {type(given).__name__}")
        pad |= _rows(given.detach().cpu().bool(), "padding_mask", rows, seq_len)
    packed = batch.get("_packed_seq_ids")
    if packed is not None:
        packed = _rows(_integers(packed, "_packed_seq_ids"), "_packed_seq_ids", rows, seq_len)
        pad |= packed == 0
        explicit.append(("_packed_seq_ids", packed, None))
    seq_idx = batch.get("seq_idx")
    if seq_idx is not None:
        explicit.append(
            ("seq_idx", _rows(_integers(seq_idx, "seq_idx"), "seq_idx", rows, seq_len), None)
        )
    for key in CU_SEQLENS_KEYS:
        if batch.get(key) is not None:
            starts, tail = _cu_seqlens_starts(batch[key], key, rows, seq_len)
            pad |= tail
            explicit.append((key, None, starts))
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise DocumentError(f"attention_mask must be a tensor, got {type(mask).__name__}")
        mask = mask.detach()
        if mask.dim() == 4:
            if (
                mask.shape[1] != 1
                or mask.shape[0] not in (rows, 1)
                or mask.shape[2:] != (seq_len, seq_len)
            ):
                raise DocumentError(
                    f"a 4-D attention_mask must be [B, 1, S, S] = [{rows}, 1, {seq_len}, "
                    f"{seq_len}], got {tuple(mask.shape)}"
                )
            # only the two diagonals leave the mask's device, never the [S, S] mask
            valid = _attends(mask[:, 0].diagonal(dim1=-2, dim2=-1)).cpu().expand(rows, seq_len)
            to_prev = _attends(mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)).cpu()
            pad |= ~valid
            starts = valid.clone()
            starts[:, 1:] &= ~(to_prev.expand(rows, seq_len - 1) & valid[:, :-1])
            explicit.append(("the 4-D attention_mask", None, starts))
        elif mask.dim() == 2:
            mask = _rows(mask.cpu(), "attention_mask", rows, seq_len)
            pad |= mask == 0  # a 2-D mask is validity (or document indices) in any dtype
            if (
                not mask.dtype.is_floating_point
                and mask.dtype != torch.bool
                and bool((mask > 1).any())
            ):
                explicit.append(
                    ("the 2-D attention_mask's document indices", mask.to(torch.int64), None)
                )
        else:
            raise DocumentError(
                f"attention_mask must be [B, S] or [B, 1, S, S], got {tuple(mask.shape)}"
            )

    valid = ~pad
    pos = batch.get("position_ids")
    checks_positions = isinstance(pos, torch.Tensor) and pos.dim() in (1, 2)
    if packed is not None and len(explicit) == 1 and not checks_positions:
        return packed * valid, pad  # the ids themselves: no other source to agree with
    implicit = run_starts(torch.zeros(rows, seq_len, dtype=torch.int64), valid)
    starts, first = None, ""
    for name, ids, own in explicit:
        mine = run_starts(ids, valid) if ids is not None else (own & valid) | implicit
        if starts is None:
            first, starts = name, mine
        elif not torch.equal(mine, starts):
            raise DocumentError(
                f"{name} and {first} describe different documents{_where(mine, starts)}"
            )

    if checks_positions:
        pos = _rows(_integers(pos, "position_ids"), "position_ids", rows, seq_len)
        restarts = (pos == 0) & valid
        if starts is None:
            starts = restarts | implicit
        elif bool((restarts & ~starts).any()):
            raise DocumentError(
                f"position_ids restart at 0 inside a document of {first}"
                f"{_where(restarts & ~starts)}"
            )
    if starts is None:
        starts = implicit
    if packed is not None:
        return packed * valid, pad
    return torch.cumsum(starts.to(torch.int64), dim=1) * valid, pad


def _where(a: torch.Tensor, b: torch.Tensor | None = None) -> str:
    """`` (first at row r, position i)`` of a difference (or of a True entry)."""
    diff = a if b is None else a != b
    row, col = (int(v) for v in torch.nonzero(diff)[0])
    return f" (first at row {row}, position {col})"


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Per-document ``position_ids`` ``[B, S]`` for document ids ``[B, S]`` (0 = pad): 0, 1, ...
    in every document; a pad continues counting from the token before it (from 0 at a row
    start), as appended padding does (:mod:`cpshard.batch.padding`)."""
    rows, seq_len = ids.shape
    starts = run_starts(ids, ids != 0)
    index = torch.arange(seq_len, device=ids.device).expand(rows, seq_len)
    last_start = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - last_start


def document_positions_at(ids: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """:func:`document_positions` of ``ids`` ``[B, S]`` at the positions ``at`` (``[L]`` for
    every row, or ``[B, L]``; positions past ``S`` continue the last token's count, as padding
    the sequence does): ``[B, L]``, from the documents' starts alone (one rank's positions,
    never the whole sequence's)."""
    rows, seq_len = ids.shape
    at = at.to("cpu", torch.int64).expand(rows, -1)
    if seq_len == 0:
        return at.clone()
    starts = torch.nonzero(run_starts(ids, ids != 0).reshape(-1)).flatten()  # flat, ascending
    origin = torch.arange(rows).view(rows, 1) * seq_len
    key = origin + at.clamp(max=seq_len - 1)
    j = torch.searchsorted(starts, key, right=True) - 1
    found = starts[j.clamp(min=0)]
    last = torch.where((j >= 0) & (found >= origin), found - origin, 0)
    return at - last


def document_ids(
    batch: Mapping[str, Any], seq_len: int, device: torch.device | str | None, batch_size: int
) -> torch.Tensor:
    """Per-position document ids ``[B, S]`` (int64, 0 == padding) on ``device``.

    Read by :func:`read_documents`, as both sharding entry points do: the collator's
    ``_packed_seq_ids`` (returned as given, 0 at every pad), else the documents of ``seq_idx``,
    ``cu_seq_lens_q/k`` / ``cu_seqlens``, a 4-D block-causal ``attention_mask``, a 2-D
    ``attention_mask`` of document indices or ``position_ids`` restarting at 0, numbered
    ``1, 2, ...`` per row; else one document per row. Padding comes from ``padding_mask`` and the
    masks. Contradictory sources raise ``ValueError``. A document is a maximal run of one
    non-zero id.
    """
    ids, _ = read_documents(batch, batch_size, seq_len)
    return ids.to(device)
