"""Per-token document ids ``[B, S]`` (int64, 0 = padding) from whatever a batch carries."""

from __future__ import annotations

from typing import Any

import torch

from cpshard.documents import read_documents


def document_ids(batch: dict[str, Any], seq_len: int, device: torch.device | str | None, batch_size: int) -> torch.Tensor:
    """Per-position document ids ``[B, S]`` (int64, 0 == padding) on ``device``.

    Read by :func:`cpshard.documents.read_documents`, as both sharding entry points do: the
    collator's ``_packed_seq_ids`` (returned as given, 0 at every pad), else the documents of
    ``seq_idx``, ``cu_seq_lens_q/k`` / ``cu_seqlens``, a 4-D block-causal ``attention_mask``, a
    2-D ``attention_mask`` of document indices or ``position_ids`` restarting at 0, numbered
    ``1, 2, ...`` per row; else one document per row. Padding comes from ``padding_mask`` and the
    masks. Contradictory sources raise ``ValueError``. A document is a maximal run of one
    non-zero id.
    """
    ids, _ = read_documents(batch, batch_size, seq_len)
    return ids.to(device)
