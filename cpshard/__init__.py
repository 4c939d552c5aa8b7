"""cpshard: context-parallel sharding building blocks for long-context LLM and VLM training."""

from cpshard._build import BuildInfo, build_info
from cpshard.blockdiag import cp_blockdiag_sdpa, document_ids, make_cp_blockdiag_batch_and_ctx
from cpshard.consensus import raise_on_any_rank
from cpshard.ops import (
    DocumentSegments,
    deinterleave_sequence,
    document_segments,
    index_gather,
    index_scatter_add,
    interleave_sequence,
    pack_ragged,
    unpack_ragged,
)
from cpshard.transport import gather_halo, gather_metadata, gather_ragged, gather_sequence

__version__ = "0.1.0"

__all__ = [
    "BuildInfo",
    "DocumentSegments",
    "__version__",
    "build_info",
    "cp_blockdiag_sdpa",
    "deinterleave_sequence",
    "document_ids",
    "document_segments",
    "gather_halo",
    "gather_metadata",
    "gather_ragged",
    "gather_sequence",
    "index_gather",
    "index_scatter_add",
    "interleave_sequence",
    "make_cp_blockdiag_batch_and_ctx",
    "pack_ragged",
    "raise_on_any_rank",
    "unpack_ragged",
]
