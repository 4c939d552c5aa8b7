"""Frame-level context-parallel vision-tower sharding (mirror of
``nemo_automodel.components.distributed.cp_vision_frame_shard``).

Thin adapters over :mod:`cpshard.vision`: the planner is cpshard's optimal contiguous partition
(never worse than NeMo's prefix-quantile cut), the gathers are cpshard's transport, and the
scope is cpshard's own holder, so a group published here is seen by
:func:`cpshard.maybe_distribute_visual` and the other way round. NeMo's conventions are kept
where its users rely on them: ``config`` is required by :func:`set_cp_vision_group`, tokens are
the previous scope (``reset_cp_vision_group(None)`` clears), ``mesh_dims`` is ``("cp",)``, the
no-media and small-workload fall-backs issue no collective, and a rank that runs only a dummy
frame keeps it at ``spatial_merge_size**2`` rows.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Literal

import torch
import torch.distributed as dist

from cpshard import vision as _vision
from cpshard.comm import Group
from cpshard.consensus import raise_on_any_rank
from cpshard.nemo._autograd import reentrant_backward, reentrant_forward
from cpshard.transport import gather_ragged, gather_sequence
from cpshard.vision import distribute as _distribute
from cpshard.vision import scope as _scope

__all__ = [
    "CpVisionFrameShardingConfig",
    "cp_vision_frame_sharding_active",
    "maybe_distribute_visual",
    "reset_cp_vision_group",
    "set_cp_vision_group",
]

_WHAT = "cp_vision_frame_shard"


@dataclasses.dataclass(frozen=True)
class CpVisionFrameShardingConfig(_vision.CpVisionFrameShardingConfig):
    """Declarative policy for sharding VLM vision work across CP ranks.

    :class:`cpshard.CpVisionFrameShardingConfig` (same fields, defaults and order: ``enabled``,
    ``mesh_dims``, ``min_tokens``, ``min_frames``, ``min_local_patch_rows``, ``cost_alpha``)
    with NeMo's rule for ``mesh_dims``: a tuple (``TypeError`` otherwise) equal to ``("cp",)``
    (``ValueError`` otherwise). Bad values of the other fields raise ``ValueError``, a
    non-bool ``enabled`` ``TypeError``.
    """

    mesh_dims: tuple[Literal["cp"]] = ("cp",)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh_dims, tuple):
            raise TypeError(
                f"CpVisionFrameShardingConfig.mesh_dims must be a tuple of mesh-dimension names, "
                f"got {type(self.mesh_dims).__name__} ({self.mesh_dims!r})"
            )
        super().__post_init__()
        if self.mesh_dims != ("cp",):
            raise ValueError(
                f'CpVisionFrameShardingConfig.mesh_dims supports only ("cp",), got {self.mesh_dims!r}'
            )


@dataclasses.dataclass(frozen=True)
class _GroupScope:
    """The published sharding group plus the caller's declaration of its scope.

    ``spans_only_cp=False`` marks a group that also spans replicated non-CP axes (e.g. the
    flattened CP x TP set); that is only safe for a frozen vision tower.
    """

    group: dist.ProcessGroup
    config: _vision.CpVisionFrameShardingConfig
    spans_only_cp: bool = True

    def _resolved(self) -> _vision.CpVisionGroupScope | None:
        """cpshard's scope for this one (group resolved and checked); built once, on first use."""
        top = self.__dict__.get("_top")
        if top is None:
            try:
                top = _scope.make_scope(self.group, self.config, self.spans_only_cp)
            except (TypeError, ValueError) as exc:
                rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
                raise type(exc)(
                    f"{_WHAT}: rank {rank}: the group published by set_cp_vision_group cannot be "
                    f"used: {exc}"
                ) from exc
            if top is not None:  # (group None: no scope, nothing to remember)
                object.__setattr__(self, "_top", top)
                _BY_RESOLVED[id(top)] = self
        return top

    def resolve(self) -> _vision.CpVisionGroupScope | None:
        """The deferred-scope hook of cpshard's holder (:func:`cpshard.vision.scope.swap_scope`):
        the group is resolved and checked when the published scope is first used."""
        return self._resolved()


# Token restoring the previous published scope; opaque to callers.
CpVisionGroupToken = _GroupScope | None

# The mirror scope each cpshard scope was resolved from (so the holder hands back the very
# object that was set); an entry lives as long as its mirror scope.
_BY_RESOLVED: weakref.WeakValueDictionary[int, _GroupScope] = weakref.WeakValueDictionary()


def _mirror(stored: Any) -> _GroupScope | None:
    """The mirror scope of what cpshard's holder stores: a mirror scope as is, else the mirror
    scope cpshard's scope ``stored`` was resolved from, or a view of a scope set through
    :func:`cpshard.set_cp_vision_group`."""
    if stored is None or isinstance(stored, _GroupScope):
        return stored
    known = _BY_RESOLVED.get(id(stored))
    if known is not None and known.__dict__.get("_top") is stored:
        return known
    view = _GroupScope(stored.group.pg, stored.config, stored.spans_only_cp)
    object.__setattr__(view, "_top", stored)
    object.__setattr__(view, "_view", True)
    _BY_RESOLVED[id(stored)] = view
    return view


class _GroupHolder:
    """Plain get/set/reset holder for the sharding-group scope active during the VLM forward.
    Set by the VLM CP recipe around the model forward and read synchronously by
    :func:`maybe_distribute_visual` before the vision tower runs.

    ``set`` returns the previous value as the token and ``reset(token)`` installs it back, in any
    order. The module's holder (``_CP_VISION_GROUP``) stores into cpshard's scope holder, so the
    NeMo and cpshard APIs share one scope; other instances hold their own value.
    """

    def __init__(self, shared: bool = False) -> None:
        self._shared = shared
        self._value: _GroupScope | None = None

    def get(self) -> _GroupScope | None:
        return _mirror(_scope.stored_scope()) if self._shared else self._value

    def set(self, value: _GroupScope | None) -> _GroupScope | None:
        if not self._shared:
            token, self._value = self._value, value
            return token
        if value is not None and not isinstance(value, _GroupScope):
            raise TypeError(f"{_WHAT}: the scope must be a _GroupScope or None, got {type(value).__name__}")
        # A view of a scope set through cpshard goes back as that scope (its token stays valid);
        # a scope published here is stored unresolved: its group is checked on first use.
        stored = value.__dict__["_top"] if value is not None and value.__dict__.get("_view") else value
        return _mirror(_scope.swap_scope(stored))

    def reset(self, token: _GroupScope | None) -> None:
        self.set(token)


_CP_VISION_GROUP = _GroupHolder(shared=True)


def set_cp_vision_group(
    group: dist.ProcessGroup | None,
    *,
    config: _vision.CpVisionFrameShardingConfig,
    spans_only_cp: bool = True,
) -> CpVisionGroupToken:
    """Install the sharding process group for the current model forward.

    Args:
        group: process group to shard vision frames across (a 1-D ``DeviceMesh`` works too), or
            ``None`` to disable sharding for the call.
        config: the sharding policy (required).
        spans_only_cp: ``True`` (default): ``group`` spans CP ranks only. ``False``: it also
            spans replicated non-CP axes — valid for a frozen tower only
            (:func:`maybe_distribute_visual` raises for a trainable one).

    Returns:
        A token to pass to :func:`reset_cp_vision_group` (the previous scope).

    ``config`` and ``spans_only_cp`` are checked here (``TypeError``); ``group`` when the scope
    is first used: :func:`maybe_distribute_visual` raises ``TypeError`` / ``ValueError`` for a
    group cpshard cannot resolve only once it would shard (its fall-backs — no media, disabled,
    a small workload — and its trainable-tower check run first).
    """
    if not isinstance(config, _vision.CpVisionFrameShardingConfig):
        raise TypeError(f"{_WHAT}: config must be a CpVisionFrameShardingConfig, got {type(config).__name__}")
    if not isinstance(spans_only_cp, bool):
        raise TypeError(f"{_WHAT}: spans_only_cp must be a bool, got {type(spans_only_cp).__name__}")
    # The group is checked when the scope is first used (maybe_distribute_visual,
    # cp_vision_frame_sharding_active), not here: the fall-backs that need no group never do.
    scope = None if group is None else _GroupScope(group, config, spans_only_cp)
    return _CP_VISION_GROUP.set(scope)


def reset_cp_vision_group(token: CpVisionGroupToken) -> None:
    """Restore the previous sharding-group scope (pair with :func:`set_cp_vision_group`)."""
    _CP_VISION_GROUP.reset(token)


def cp_vision_frame_sharding_active() -> bool:
    """Return whether the current model forward has an active CP shard group
    (:func:`cpshard.cp_vision_frame_sharding_active`)."""
    return _vision.cp_vision_frame_sharding_active()


class _AllGatherSeqDiff(torch.autograd.Function):
    """Differentiable all-gather of equal-size per-rank shards along ``seq_dim``
    (:func:`cpshard.gather_sequence`): forward concatenates the shards in rank order, backward
    reduce-scatters (SUM) the gradient to the shard owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, seq_dim: int) -> torch.Tensor:
        return reentrant_forward(ctx, gather_sequence, x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return reentrant_backward(ctx, grad_out, 2)


def _all_gather_var_tokens(
    local: torch.Tensor, group: dist.ProcessGroup, world: int, token_counts: list[int]
) -> torch.Tensor:
    """Differentiable all-gather of per-rank ``[n_r, H]`` token blocks into the full
    ``[sum(n_r), H]`` tensor in rank order (:func:`cpshard.gather_ragged`: no padding on the
    wire; backward reduce-scatter-v SUM)."""
    if len(token_counts) != world:
        raise ValueError(f"{_WHAT}: token_counts has {len(token_counts)} entries but world = {world}")
    return gather_ragged(local, group, list(token_counts), dim=0)


def _check_group_scope_for_trainable(visual: torch.nn.Module, scope: _GroupScope) -> None:
    """Raise ``ValueError`` when a trainable vision tower is sharded over a group not declared
    CP-only (the gather's backward would add its gradient once per TP rank). Deterministic
    across ranks, so it raises on every rank before any collective."""
    try:
        top = scope._resolved()
    except (TypeError, ValueError):  # a group cpshard cannot resolve: the check needs no group
        top = None
    if top is None:
        top = _vision.CpVisionGroupScope(Group(None, 0, 1), scope.config, scope.spans_only_cp)
    _distribute._check_group_scope_for_trainable(visual, None, top)


def _contiguous_balanced_bounds(
    patches: torch.Tensor,
    world: int,
    *,
    cost_alpha_source: object | None = None,
    config: _vision.CpVisionFrameShardingConfig | None = None,
) -> list[int] | None:
    """Partition ``len(patches)`` entries into ``world`` contiguous groups (>= 1 entry each)
    minimising the largest group cost ``sum p * (p + alpha)`` (:func:`cpshard.plan_contiguous`,
    optimal). ``alpha``: :func:`_vision_cost_alpha` of ``cost_alpha_source`` and ``config``.
    Returns cut points of length ``world + 1``, or None when there are fewer entries than ranks.
    Raises ``ValueError`` for non-positive patch counts."""
    rows = patches.tolist() if isinstance(patches, torch.Tensor) else list(patches)
    if len(rows) < world:
        return None
    alpha = _vision_cost_alpha(cost_alpha_source, config)
    return _vision.plan_contiguous(_vision.frame_costs(rows, alpha), world)


def _grid_for_visual(grid_thw: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
    """``grid_thw`` on ``pixel_values``' device (the input itself when it already is)."""
    return _distribute._grid_for_visual(grid_thw, pixel_values)


def _grid_list_for_planning(grid_thw: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Return host-side grid metadata for Python partitioning: ``grid_thw.tolist()`` and the CPU
    long tensor it was read from (one explicit copy when the grid is on a device)."""
    return _distribute.host_grid(grid_thw)


def _infer_vision_hidden_size(source: object | None) -> int | None:
    """Best-effort vision-width discovery without depending on model class names
    (:func:`cpshard.vision_hidden_size`); None when no vision width is found."""
    return None if source is None else _vision.vision_hidden_size(source)


def _vision_cost_alpha(
    source: object | None = None, config: _vision.CpVisionFrameShardingConfig | None = None
) -> int:
    """Resolve the linear term in the vision partition cost ``p*(p+alpha)``: the configured
    int, else ``3 * vision width`` of ``source``, else 0 (:func:`cpshard.resolve_cost_alpha`)."""
    return _vision.resolve_cost_alpha("auto" if config is None else config.cost_alpha, source)


def _raise_if_any_rank_failed(
    local_ok: bool, group: dist.ProcessGroup, device: torch.device, local_detail: str
) -> None:
    """Reach group consensus before raising: if any rank's ``local_ok`` is False, every rank
    raises ``ValueError`` (the failed ranks their ``local_detail``, the others naming them).
    ``device`` is accepted for compatibility: cpshard's consensus runs on a host channel."""
    raise_on_any_rank(not local_ok, local_detail, group, _WHAT)


def maybe_distribute_visual(
    visual: torch.nn.Module, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None, **kwargs: Any
) -> Any:
    """Run ``visual(pixel_values, grid_thw=grid_thw, return_dict=True)`` but distribute the
    forward across the CP group when enabled (:func:`cpshard.maybe_distribute_visual`),
    returning an output whose ``pooler_output`` (and every ``deepstack_features`` level) are the
    FULL gathered embeddings in original entry order.

    Falls back to the plain replicated call, with no collective, when sharding is disabled, no
    CP group is active, ``cp_size <= 1``, there are no media inputs, or the visual workload is
    below the minimum sharding size (every rank must see the same media for those checks).

    Raises:
        ValueError: on every rank when the tower is trainable but the published group was
            declared ``spans_only_cp=False``, or when any rank's local visual output does not
            match its planned token count (or any rank's inputs are invalid).
    """
    if "return_dict" in kwargs:
        raise TypeError(f"{_WHAT}: return_dict is always True; do not pass it")
    # NeMo's order: the fall-backs that need no group come before the group is used.
    if pixel_values is None or grid_thw is None:
        return _distribute._replicated(visual, pixel_values, grid_thw, kwargs)
    scope = _CP_VISION_GROUP.get()
    if scope is None or not scope.config.enabled:
        return _distribute._replicated(visual, pixel_values, grid_thw, kwargs)
    try:
        scope._resolved()
    except (TypeError, ValueError):
        # A group cpshard cannot use: its error stands unless this call never needs the group
        # (the trainable-tower check raises first; a small workload falls back, as NeMo's do).
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        local = _vision.CpVisionGroupScope(Group(None, rank, 1), scope.config, scope.spans_only_cp)
        _distribute._check_group_scope_for_trainable(visual, pixel_values, local)
        inputs = _distribute._inspect(visual, pixel_values, grid_thw, local)
        if inputs.problem is None and (not inputs.grid or _distribute._small(inputs, scope.config)):
            return _distribute._replicated(visual, pixel_values, grid_thw, kwargs)
        raise
    return _distribute.distribute_visual(
        visual, pixel_values, grid_thw, kwargs, local_fallbacks=True, floor_dummy_frames=False,
        what=f"{__name__}.maybe_distribute_visual",
    )
