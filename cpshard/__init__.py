"""cpshard: context-parallel sharding building blocks for long-context LLM and VLM training."""

from cpshard._build import BuildInfo, build_info
from cpshard.attention import attention_kernel, cp_attention, cp_blockdiag_sdpa
from cpshard.batch import BatchTargets, ShardedBatch, document_ids
from cpshard.consensus import check_mode, current_check_mode, raise_on_any_rank
from cpshard.layouts import (
    LAYOUT_ALIASES,
    LAYOUTS,
    ShardLayout,
    local_token_global_indices,
    make_layout,
    rank_major_inverse,
)
from cpshard.linear_loss import cp_linear_cross_entropy
from cpshard.loss import cp_cross_entropy, reduce_cp_gradients
from cpshard.masks import MaskDescription
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
from cpshard.parity import ParityReport, run_parity
from cpshard.planning import StepPlan, plan_step
from cpshard.sharder import ContextParallelSharder, StepPlanner, make_cp_blockdiag_batch_and_ctx
from cpshard.transport import gather_halo, gather_metadata, gather_ragged, gather_sequence
from cpshard.vision import (
    CpVisionFrameShardingConfig,
    CpVisionGroupScope,
    CpVisionGroupToken,
    VisionFramePlan,
    cp_vision_frame_sharding_active,
    cp_vision_group,
    current_cp_vision_scope,
    frame_costs,
    maybe_distribute_visual,
    plan_contiguous,
    plan_vision_frames,
    reset_cp_vision_group,
    resolve_cost_alpha,
    set_cp_vision_group,
    vision_hidden_size,
)

__version__ = "0.1.0"

# The Hugging Face trainers, imported on first use: they need transformers (and TRL for
# CPSFTTrainer), which ``import cpshard`` must not load. Not in ``__all__`` for the same reason.
_TRAINERS = {
    "ContextParallelMixin": "cpshard.integrations.trainer",
    "CPTrainer": "cpshard.integrations.trainer",
    "CPSFTTrainer": "cpshard.integrations.sft",
}


def __getattr__(name: str) -> object:
    """``cpshard.CPTrainer``, ``cpshard.CPSFTTrainer`` and ``cpshard.ContextParallelMixin``."""
    if name in _TRAINERS:
        import importlib

        return getattr(importlib.import_module(_TRAINERS[name]), name)
    raise AttributeError(f"module 'cpshard' has no attribute {name!r}")

__all__ = [
    "__version__",
    "attention_kernel",
    "BatchTargets",
    "build_info",
    "BuildInfo",
    "check_mode",
    "ContextParallelSharder",
    "cp_attention",
    "cp_blockdiag_sdpa",
    "cp_cross_entropy",
    "cp_linear_cross_entropy",
    "current_check_mode",
    "cp_vision_frame_sharding_active",
    "cp_vision_group",
    "CpVisionFrameShardingConfig",
    "CpVisionGroupScope",
    "CpVisionGroupToken",
    "current_cp_vision_scope",
    "deinterleave_sequence",
    "document_ids",
    "document_segments",
    "DocumentSegments",
    "frame_costs",
    "gather_halo",
    "gather_metadata",
    "gather_ragged",
    "gather_sequence",
    "index_gather",
    "index_scatter_add",
    "interleave_sequence",
    "LAYOUT_ALIASES",
    "LAYOUTS",
    "local_token_global_indices",
    "make_cp_blockdiag_batch_and_ctx",
    "make_layout",
    "MaskDescription",
    "maybe_distribute_visual",
    "pack_ragged",
    "ParityReport",
    "plan_contiguous",
    "plan_vision_frames",
    "raise_on_any_rank",
    "rank_major_inverse",
    "reduce_cp_gradients",
    "reset_cp_vision_group",
    "resolve_cost_alpha",
    "plan_step",
    "run_parity",
    "set_cp_vision_group",
    "ShardedBatch",
    "ShardLayout",
    "StepPlan",
    "StepPlanner",
    "unpack_ragged",
    "vision_hidden_size",
    "VisionFramePlan",
]
