"""Block-diagonal (per-document) causal attention across CP ranks."""

from cpshard.blockdiag.attention import cp_blockdiag_sdpa
from cpshard.blockdiag.batch import make_cp_blockdiag_batch_and_ctx
from cpshard.blockdiag.ids import document_ids
from cpshard.blockdiag.state import BlockDiagState, Segment, active_state

__all__ = [
    "BlockDiagState",
    "Segment",
    "active_state",
    "cp_blockdiag_sdpa",
    "document_ids",
    "make_cp_blockdiag_batch_and_ctx",
]
