"""Vision frame sharding across a context-parallel group.

* :class:`CpVisionFrameShardingConfig` — the declarative policy.
* :func:`set_cp_vision_group` / :func:`reset_cp_vision_group` / :func:`cp_vision_group` /
  :func:`cp_vision_frame_sharding_active` — the group scope of the current model forward.
* :func:`plan_contiguous` and the cost model (:func:`frame_costs`, :func:`resolve_cost_alpha`,
  :func:`vision_hidden_size`) — pure planning functions.
* :func:`maybe_distribute_visual` — the drop-in for ``visual(pixel_values, grid_thw=...)``.
"""

from cpshard.vision.config import CpVisionFrameShardingConfig
from cpshard.vision.distribute import maybe_distribute_visual, spatial_merge_size
from cpshard.vision.plan import (
    VisionFramePlan,
    frame_costs,
    plan_contiguous,
    plan_vision_frames,
    rank_costs,
    resolve_cost_alpha,
    vision_hidden_size,
)
from cpshard.vision.scope import (
    CpVisionGroupScope,
    CpVisionGroupToken,
    cp_vision_frame_sharding_active,
    cp_vision_group,
    current_cp_vision_scope,
    reset_cp_vision_group,
    set_cp_vision_group,
)

__all__ = [
    "CpVisionFrameShardingConfig",
    "CpVisionGroupScope",
    "CpVisionGroupToken",
    "VisionFramePlan",
    "cp_vision_frame_sharding_active",
    "cp_vision_group",
    "current_cp_vision_scope",
    "frame_costs",
    "maybe_distribute_visual",
    "plan_contiguous",
    "plan_vision_frames",
    "rank_costs",
    "reset_cp_vision_group",
    "resolve_cost_alpha",
    "set_cp_vision_group",
    "spatial_merge_size",
    "vision_hidden_size",
]
