"""``maybe_distribute_visual``: run a VLM's vision tower on this rank's frames only.

Qwen-VL-style towers attend within each frame and their position embeddings are spatial only,
so frames are independent units: ``visual(all frames) == concat_r visual(frames of rank r)``
(up to rounding). With an active scope (:mod:`cpshard.vision.scope`) the frames of a pack are
planned over the CP group with the optimal contiguous planner, each rank runs the tower on its
frames, and ONE ragged all-gather (``pooler_output`` and every ``deepstack_features`` level
fused along the hidden dim) rebuilds the full embeddings in entry order on every rank. Its
backward (reduce-scatter-v) hands each rank the summed gradient of the tokens it computed.

Every check whose outcome could differ across ranks goes through group consensus before the
next collective, so a bad input, a tower failure or a token-count mismatch on one rank makes
EVERY rank raise instead of leaving the others blocked.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections.abc import MutableMapping
from typing import Any

import torch

from cpshard.consensus import agree
from cpshard.fingerprints import digest, dtype_code
from cpshard.transport import gather_ragged
from cpshard.vision.attributes import MODULE_WRAPPERS, attribute
from cpshard.vision.plan import (
    VisionFramePlan,
    grid_problem,
    grid_workload,
    plan_vision_frames,
    resolve_cost_alpha,
)
from cpshard.vision.scope import CpVisionGroupScope, current_cp_vision_scope

__all__ = ["maybe_distribute_visual", "spatial_merge_size"]

logger = logging.getLogger(__name__)

_WHAT = "cpshard.maybe_distribute_visual"


def spatial_merge_size(visual: object) -> int | None:
    """The tower's spatial merge factor (merged tokens per frame = ``h*w / m**2``): its
    ``spatial_merge_size`` attribute, else ``visual.config.spatial_merge_size``, else the same
    on a wrapped module (``module``, ``_orig_mod``, FSDP / checkpoint wrappers). None if absent."""
    nodes = [visual]
    nodes += [w for name in MODULE_WRAPPERS if (w := attribute(visual, name)) is not None]
    for node in nodes:
        for holder in (node, attribute(node, "config")):
            value = attribute(holder, "spatial_merge_size")
            if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:
                return int(value)
    return None


def _grid_for_visual(grid_thw: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
    """``grid_thw`` on ``pixel_values``' device (towers index device-resident position tables
    with it); the tensor itself when it already is."""
    if grid_thw.device == pixel_values.device:
        return grid_thw
    return grid_thw.to(pixel_values.device, non_blocking=True)


def host_grid(grid_thw: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """``(rows, host tensor)``: ``grid_thw`` as a list of ``[t, h, w]`` ints and the CPU int64
    tensor it was read from — one explicit (blocking) device-to-host copy when the grid is not
    on the CPU, none when it is."""
    host = grid_thw if grid_thw.device.type == "cpu" else grid_thw.to("cpu")
    if host.dtype != torch.int64:
        host = host.to(torch.int64)
    return host.tolist(), host


def _replicated(visual: Any, pixel_values: Any, grid_thw: Any, kwargs: dict) -> Any:
    """The plain call: exact pre-sharding behaviour."""
    if isinstance(grid_thw, torch.Tensor) and isinstance(pixel_values, torch.Tensor):
        grid_thw = _grid_for_visual(grid_thw, pixel_values)
    return visual(pixel_values, grid_thw=grid_thw, return_dict=True, **kwargs)


def _needs_grad(visual: Any, pixel_values: Any) -> bool:
    if not torch.is_grad_enabled():
        return False
    if isinstance(pixel_values, torch.Tensor) and pixel_values.requires_grad:
        return True
    params = getattr(visual, "parameters", None)
    return callable(params) and any(p.requires_grad for p in params())


def _check_group_scope_for_trainable(visual: Any, pixel_values: Any, scope: CpVisionGroupScope) -> None:
    """A trainable tower over a group not declared CP-only: raise. The tower is replicated (not
    tensor-parallel) across TP ranks, so the gather's reduce-scatter(SUM) backward over a CP x TP
    group would add its gradient once per TP rank. Deterministic across ranks (parameters'
    ``requires_grad``, grad mode and the declaration are the same everywhere), so it raises on
    every rank before any collective."""
    if scope.spans_only_cp or not _needs_grad(visual, pixel_values):
        return
    raise ValueError(
        f"{_WHAT}: rank {scope.group.rank}: the vision tower is trainable (parameters or pixel_values "
        "require grad) but the published sharding group was declared spans_only_cp=False (e.g. the "
        "flattened CP x TP rank set). The tower is replicated across TP ranks, so gathering frames "
        "over that group would add its gradient once per TP rank in the gather's backward. Publish "
        "the CP-only group (set_cp_vision_group(cp_group, ...)), or freeze the tower / run it "
        "under torch.no_grad()."
    )


@dataclasses.dataclass
class _Inputs:
    """This rank's view of the call, checked locally; the fields go through consensus."""

    problem: str | None = None
    has_media: bool = False
    grid: list[list[int]] = dataclasses.field(default_factory=list)
    merge: int = 0
    alpha: int = 0

    def fields(self, pixel_values: Any, scope: CpVisionGroupScope) -> dict[str, list[int]]:
        cfg = scope.config
        ok = self.problem is None and self.has_media
        flat = [v for row in self.grid for v in row] if ok else []
        pv = pixel_values if ok else None
        return {
            "media": [int(self.has_media), len(self.grid) if ok else 0],
            "grid_thw": digest(flat),
            "pixel_values dtype, dims, row size": [
                dtype_code(pv.dtype) if pv is not None else -1,
                pv.dim() if pv is not None else 0,
                pv[:1].numel() if pv is not None else 0,
            ],
            "spatial_merge_size": [self.merge],
            "config": [
                cfg.min_tokens, cfg.min_frames, cfg.min_local_patch_rows, self.alpha,
                int(scope.spans_only_cp),
            ],
        }


def _inspect(visual: Any, pixel_values: Any, grid_thw: Any, scope: CpVisionGroupScope) -> _Inputs:
    """Validate the call locally and read the host metadata (one explicit device-to-host copy of
    ``grid_thw`` when it is not on the CPU, one ``tolist``)."""
    out = _Inputs(has_media=pixel_values is not None and grid_thw is not None)
    if not out.has_media:
        return out
    if not isinstance(pixel_values, torch.Tensor):
        out.problem = f"pixel_values must be a torch.Tensor or None, got {type(pixel_values).__name__}"
        return out
    if not isinstance(grid_thw, torch.Tensor):
        out.problem = f"grid_thw must be a torch.Tensor or None, got {type(grid_thw).__name__}"
        return out
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        out.problem = f"grid_thw must have shape [entries, 3] (rows of t, h, w), got {tuple(grid_thw.shape)}"
        return out
    if grid_thw.dtype == torch.bool or grid_thw.dtype.is_floating_point or grid_thw.dtype.is_complex:
        out.problem = f"grid_thw must be an integer tensor, got {grid_thw.dtype}"
        return out
    if pixel_values.dim() < 1:
        out.problem = "pixel_values must have a leading patch-row dim, got a 0-d tensor"
        return out
    merge = spatial_merge_size(visual)
    if merge is None:
        out.problem = (
            f"cannot find the spatial merge factor of the vision tower ({type(visual).__name__}): "
            "expected visual.spatial_merge_size or visual.config.spatial_merge_size (an int >= 1)"
        )
        return out
    out.merge = merge
    out.grid, _ = host_grid(grid_thw)
    if (problem := grid_problem(out.grid, merge)) is not None:
        out.problem = problem
        return out
    rows = sum(t * h * w for t, h, w in out.grid)
    if pixel_values.shape[0] != rows:
        out.problem = (
            f"pixel_values has {pixel_values.shape[0]} patch rows but grid_thw describes {rows} "
            f"(sum of t*h*w over {len(out.grid)} entries)"
        )
        return out
    try:
        out.alpha = resolve_cost_alpha(scope.config.cost_alpha, visual)
    except (TypeError, ValueError) as exc:  # cannot happen with a validated config; kept uniform
        out.problem = str(exc)
    return out


def _local_call(visual: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor, plan: VisionFramePlan,
                rank: int, kwargs: dict) -> Any:
    """The tower on this rank's frames: its rows of ``pixel_values`` (a view) and its grid rows
    (consecutive frames of one entry merged), plus the zero pad frame when it has one."""
    p0, p1 = plan.row_bounds[rank]
    local = pixel_values[p0:p1]
    pad = plan.pad_rows(rank)
    if pad:
        local = torch.cat([local, pixel_values.new_zeros((pad, *pixel_values.shape[1:]))])
    grid = torch.tensor(plan.local_grid(rank), dtype=grid_thw.dtype, device=pixel_values.device)
    return visual(local, grid_thw=grid, return_dict=True, **kwargs)


def _levels(out: Any) -> tuple[Any, Any]:
    """``(pooler_output, deepstack_features)`` of an output object or mapping (None if absent)."""
    return attribute(out, "pooler_output"), attribute(out, "deepstack_features")


def _output_problem(out: Any, expected: int) -> str | None:
    pooler, deep = _levels(out)
    if not isinstance(pooler, torch.Tensor) or pooler.dim() < 1:
        return f"the vision tower's output ({type(out).__name__}) has no pooler_output tensor"
    if pooler.shape[0] != expected:
        return (
            f"the vision tower produced {pooler.shape[0]} visual tokens (pooler_output) for this rank's "
            f"frames, but the plan expects {expected}: is its spatial_merge_size right?"
        )
    if deep is not None:
        if not isinstance(deep, (list, tuple)):
            return f"deepstack_features must be a list of tensors, got {type(deep).__name__}"
        for k, d in enumerate(deep):
            if not isinstance(d, torch.Tensor) or d.dim() < 1:
                return f"deepstack_features[{k}] is not a tensor"
            if d.shape[0] != expected:
                return (
                    f"deepstack_features[{k}] has {d.shape[0]} visual tokens, "
                    f"but the plan expects {expected}"
                )
            if d.device != pooler.device:
                return f"deepstack_features[{k}] is on {d.device} but pooler_output on {pooler.device}"
    return None


def _level_fields(out: Any) -> dict[str, list[int]]:
    pooler, deep = _levels(out)
    levels = [pooler, *(deep or [])]
    layout = []
    for t in levels:
        layout += [dtype_code(t.dtype), t.dim(), *t.shape[1:]]
    return {
        "deepstack levels": [-1 if deep is None else len(deep)],
        "level dtypes and shapes": digest(layout),
        "requires grad": [int(any(t.requires_grad for t in levels))],
    }


def _fused_gather(levels: list[torch.Tensor], keep: int, scope: CpVisionGroupScope,
                  counts: list[int]) -> list[torch.Tensor]:
    """Gather the first ``keep`` rows of every level with ONE ragged all-gather per dtype (one in
    all in practice): the levels share the token dim, so they travel side by side as one
    ``[keep, sum(widths)]`` block and are split back afterwards (differentiably)."""
    total = sum(counts)
    result: list[torch.Tensor | None] = [None] * len(levels)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(levels):
        by_dtype.setdefault(t.dtype, []).append(k)
    for ks in by_dtype.values():
        parts = [levels[k][:keep].reshape(keep, levels[k][:1].numel()) for k in ks]
        widths = [p.shape[1] for p in parts]
        fused = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        full = gather_ragged(fused, scope.group.pg, counts, dim=0)
        pieces = [full] if len(parts) == 1 else full.split(widths, dim=1)
        for k, piece in zip(ks, pieces):
            result[k] = piece.reshape(total, *levels[k].shape[1:]).contiguous()
    return result  # type: ignore[return-value]


def _with_levels(out: Any, pooler: torch.Tensor, deep: list[torch.Tensor] | None, deep_type: type) -> Any:
    """``out`` with ``pooler_output`` / ``deepstack_features`` replaced (the object is the local
    call's own fresh output; frozen dataclasses are rebuilt with ``dataclasses.replace``)."""
    changes: dict[str, Any] = {"pooler_output": pooler}
    if deep is not None:
        changes["deepstack_features"] = deep if deep_type is list else deep_type(deep)
    if isinstance(out, MutableMapping) and not dataclasses.is_dataclass(out):
        out.update(changes)
        return out
    try:
        for name, value in changes.items():
            setattr(out, name, value)
    except (dataclasses.FrozenInstanceError, AttributeError):
        if not dataclasses.is_dataclass(out):
            raise
        out = dataclasses.replace(out, **changes)
    return out


def maybe_distribute_visual(visual: Any, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None,
                            **kwargs: Any) -> Any:
    """A drop-in for ``visual(pixel_values, grid_thw=grid_thw, return_dict=True, **kwargs)``
    that, inside an active scope (:func:`set_cp_vision_group`), runs the tower on this rank's
    frames only and returns the FULL embeddings.

    Args:
        visual: the vision tower: frame-independent (attention within each frame, spatial-only
            positions), called as ``visual(pixel_values, grid_thw=..., return_dict=True, **kwargs)``
            and returning an object (HF ``ModelOutput``, dataclass, namespace or dict) with
            ``pooler_output`` ``[tokens, ...]`` and optionally ``deepstack_features`` (a list of
            ``[tokens, ...]``); its merge factor is read from ``visual.spatial_merge_size`` or
            ``visual.config.spatial_merge_size``.
        pixel_values: ``[patch rows, ...]`` for all entries, frame-contiguous in entry order.
        grid_thw: ``[entries, 3]`` integer rows ``(t, h, w)``; ``t*h*w`` rows per entry.
        kwargs: passed unchanged to every tower call (so they must not be per-row tensors).

    Returns:
        The tower's output object: ``pooler_output`` and each ``deepstack_features`` level hold
        all ``sum(t*h*w) / m**2`` tokens in the original entry order, gathered in ONE fused
        ragged all-gather; forward and every gradient match the replicated call's (up to
        rounding) once the ranks' gradients are summed, as CP training does. Other fields
        (``last_hidden_state``) hold this rank's local frames only.

    Behaviour:
        * Replicated call (no collective) when no scope is set, sharding is disabled, or the
          group has one rank. Inside an active scope, every call first agrees on its inputs (one
          small all-gather), then falls back to the replicated call — identically on every rank —
          when there is no media (``pixel_values`` or ``grid_thw`` None, or no frames) or the
          pack is small (fewer than ``config.min_tokens`` merged tokens AND fewer than
          ``config.min_frames`` frames).
        * Frame units are the ``t`` frames of every entry; they are planned with
          :func:`~cpshard.vision.plan.plan_contiguous` over the costs ``p * (p + alpha)``
          (``alpha`` from ``config.cost_alpha`` / the tower's width). Consecutive frames of one
          entry on a rank run as one ``(count, h, w)`` grid row.
        * Fewer frames than ranks: rank ``r < frames`` runs frame ``r``; every other rank runs
          one zero dummy frame, so every rank runs the tower (and its backward) once; dummy
          tokens never enter the gather, so their gradient is zero.
        * A rank whose frames have fewer than ``config.min_local_patch_rows`` rows appends a zero
          frame that brings its call to the floor (its tokens are dropped before the gather).
        * ``grid_thw`` reaches the tower on ``pixel_values``' device; its host copy is taken
          once, explicitly.

    Raises:
        ValueError: on every rank, when the tower is trainable (and grad is enabled) but the
            group was declared ``spans_only_cp=False`` (before any collective); when any rank's
            inputs are invalid or differ from the others' (grid, shapes, config, merge factor);
            when any rank's tower output does not have the planned token count in
            ``pooler_output`` or some ``deepstack_features`` level, or has a different structure.
            A rank whose tower call raises re-raises that exception; the others raise
            ``ValueError`` naming it.
        ValueError: ``return_dict=False`` (the result is always the output object;
            ``return_dict=True``, as transformers' VLMs pass it, is accepted).
    """
    if kwargs.pop("return_dict", True) is False:
        raise ValueError(f"{_WHAT}: return_dict=False is not supported: the result is always the output object")
    return distribute_visual(visual, pixel_values, grid_thw, kwargs)


def _small(inputs: _Inputs, cfg: Any) -> bool:
    """The pack is below both sharding minimums (the replicated call is cheaper)."""
    _, tokens, frames = grid_workload(inputs.grid, inputs.merge)
    if tokens < cfg.min_tokens and frames < cfg.min_frames:
        logger.debug("%s: replicated (tokens %d < min_tokens %d and frames %d < min_frames %d)",
                     _WHAT, tokens, cfg.min_tokens, frames, cfg.min_frames)
        return True
    return False


def distribute_visual(visual: Any, pixel_values: Any, grid_thw: Any, kwargs: dict, *,
                      local_fallbacks: bool = False, floor_dummy_frames: bool = True, what: str = _WHAT) -> Any:
    """:func:`maybe_distribute_visual` with two policy switches (the NeMo mirror sets both the
    other way). ``local_fallbacks``: decide the no-media and small-workload fall-backs from this
    rank's inputs alone, with no collective (so ranks must agree on them); otherwise they are
    decided after the consensus round. ``floor_dummy_frames``: raise a dummy-only rank's frame to
    ``min_local_patch_rows`` too. ``what`` names the caller in the errors."""
    scope = current_cp_vision_scope()
    if scope is None or not scope.active:
        return _replicated(visual, pixel_values, grid_thw, kwargs)
    group, cfg = scope.group, scope.config
    if local_fallbacks and (pixel_values is None or grid_thw is None):
        return _replicated(visual, pixel_values, grid_thw, kwargs)

    if pixel_values is not None and grid_thw is not None:
        _check_group_scope_for_trainable(visual, pixel_values, scope)
    inputs = _inspect(visual, pixel_values, grid_thw, scope)
    if local_fallbacks and inputs.problem is None and (not inputs.grid or _small(inputs, cfg)):
        return _replicated(visual, pixel_values, grid_thw, kwargs)
    agree(group, what, inputs.problem, inputs.fields(pixel_values, scope))

    if not inputs.has_media or not inputs.grid or _small(inputs, cfg):
        return _replicated(visual, pixel_values, grid_thw, kwargs)

    plan = plan_vision_frames(
        inputs.grid, group.world, spatial_merge_size=inputs.merge, cost_alpha=inputs.alpha,
        min_local_patch_rows=cfg.min_local_patch_rows, floor_dummy_frames=floor_dummy_frames,
    )
    rank = group.rank
    logger.debug("%s: %d frames over %d ranks (%d dummy), tokens per rank %s", what, len(plan.unit_rows),
                 group.world, plan.dummy_ranks, list(plan.token_counts))

    failure: Exception | None = None
    out = None
    try:
        out = _local_call(visual, pixel_values, grid_thw, plan, rank, kwargs)
    except Exception as exc:  # reach consensus first, so that the other ranks raise too
        failure = exc
    if failure is not None:
        try:
            agree(group, what, f"the vision tower raised {type(failure).__name__}: {failure}")
        except ValueError:
            pass  # always taken: this rank failed; the others now raise naming it
        raise failure
    problem = _output_problem(out, plan.local_tokens(rank))
    fields = {"deepstack levels": [0], "level dtypes and shapes": [0, 0], "requires grad": [0]}
    if problem is None:
        fields = _level_fields(out)
    agree(group, what, problem, fields)

    pooler, deep = _levels(out)
    levels = [pooler, *(deep or [])]
    full = _fused_gather(levels, plan.token_counts[rank], scope, list(plan.token_counts))
    return _with_levels(out, full[0], None if deep is None else full[1:], type(deep))
