"""The declarative vision frame-sharding policy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cpshard.validation import is_int

__all__ = ["CpVisionFrameShardingConfig"]

_WHAT = "CpVisionFrameShardingConfig"


def _non_negative_int(value: object, name: str) -> None:
    # ValueError for every bad value (a bool, a float, a string, a negative int): the field's
    # value is wrong, as NeMo Automodel's config reports it.
    if not is_int(value) or value < 0:
        raise ValueError(f"{_WHAT}.{name} must be a non-negative integer, got {type(value).__name__} ({value!r})")


@dataclass(frozen=True)
class CpVisionFrameShardingConfig:
    """Declarative policy for sharding a VLM's vision tower across the ranks of a CP group.

    Args:
        enabled: shard vision frames when a multi-rank group is published
            (:func:`set_cp_vision_group`). Off by default, so recipes keep the replicated tower.
        mesh_dims: when the published group is a multi-dimensional ``DeviceMesh``, the named
            dims frames are sharded over (flattened when more than one). A ``ProcessGroup`` or a
            1-D mesh is used as it is.
        min_tokens: the sharded path is taken when the pack has at least this many merged visual
            tokens (``sum(t*h*w) / spatial_merge_size**2``) ...
        min_frames: ... or at least this many frame units (``sum(t)``). Below both, the tower runs
            replicated: a small workload does not pay for the collectives. Long videos have small
            frames, so the token count alone underestimates their ViT work.
        min_local_patch_rows: the floor on the patch rows of each rank's local tower call. A rank
            whose planned frames have fewer rows runs one extra zero frame (its own entry, so it
            cannot touch the real frames' outputs) that brings it to the floor; its tokens are
            dropped before the gather. Keeps every local call above tiny-input kernel paths
            (alignment minimums, degenerate launch shapes). ``0`` disables the floor.
        cost_alpha: linear term of the per-frame cost ``p * (p + cost_alpha)`` used by the
            planner (``p`` = a frame's patch rows). An int is an exact override (``0`` = pure
            quadratic); ``"auto"`` (or its alias ``None``) uses ``3 * vision width`` discovered
            from the tower, or ``0`` when no width is found.

    The fields are in NeMo Automodel's order, so positional construction means the same in both.
    Raises ``TypeError`` for a non-bool ``enabled`` or a ``mesh_dims`` that is not a sequence of
    names, ``ValueError`` naming the field for every other bad value. ``mesh_dims`` may be given
    as a list (YAML); it is stored as a tuple.
    """

    enabled: bool = False
    mesh_dims: tuple[str, ...] = ("cp",)
    min_tokens: int = 2048
    min_frames: int = 32
    min_local_patch_rows: int = 96
    cost_alpha: int | Literal["auto"] | None = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            got = f"{type(self.enabled).__name__} ({self.enabled!r})"
            raise TypeError(f"{_WHAT}.enabled must be a bool, got {got}")
        _non_negative_int(self.min_tokens, "min_tokens")
        _non_negative_int(self.min_frames, "min_frames")
        _non_negative_int(self.min_local_patch_rows, "min_local_patch_rows")
        alpha = self.cost_alpha
        if alpha is not None and alpha != "auto":
            if not is_int(alpha) or alpha < 0:
                raise ValueError(f'{_WHAT}.cost_alpha must be "auto", None or an int >= 0, got {alpha!r}')
        dims = self.mesh_dims
        if isinstance(dims, str) or not isinstance(dims, (tuple, list)):
            raise TypeError(
                f"{_WHAT}.mesh_dims must be a tuple of mesh-dimension names, "
                f"got {type(dims).__name__} ({dims!r})"
            )
        if not dims:
            raise ValueError(f"{_WHAT}.mesh_dims must name at least one mesh dimension")
        for d in dims:
            if not isinstance(d, str) or not d:
                raise TypeError(f"{_WHAT}.mesh_dims entries must be non-empty strings, got {d!r}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"{_WHAT}.mesh_dims has repeated names: {tuple(dims)}")
        object.__setattr__(self, "mesh_dims", tuple(dims))
