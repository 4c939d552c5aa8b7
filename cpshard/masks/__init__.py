"""Attention masks as the planners plan from them (host descriptions, no device, no collectives).

* :mod:`~cpshard.masks.description`: :class:`MaskDescription`, each document cut into segments
  whose queries reach one key interval each (causal, bidirectional, windows, chunks, blocks,
  and their intersections and unions);
* :mod:`~cpshard.masks.pieces`: runs of queries cut at a description's segments, with the keys
  each piece reaches (:func:`cut_runs`);
* :mod:`~cpshard.masks.mask_mod`: a FlexAttention-style ``mask_mod`` planned block by block
  (:func:`plan_mask_mod`).
"""

from cpshard.masks.description import INF, MaskDescription
from cpshard.masks.mask_mod import (
    EMPTY,
    FULL,
    PARTIAL,
    MaskMod,
    MaskModPlan,
    band_rows,
    evaluate_mask_mod,
    plan_mask_mod,
)
from cpshard.masks.pieces import MaskPieces, cut_runs

__all__ = [
    "EMPTY",
    "FULL",
    "INF",
    "PARTIAL",
    "MaskDescription",
    "MaskMod",
    "MaskModPlan",
    "MaskPieces",
    "band_rows",
    "cut_runs",
    "evaluate_mask_mod",
    "plan_mask_mod",
]
