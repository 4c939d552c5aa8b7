"""The vision sharding-group scope: which group :func:`maybe_distribute_visual` shards over.

One of cpshard's documented scopes (a :class:`~cpshard.scoped.ScopedValue`), set by the VLM CP
recipe around the model forward and read synchronously when the vision tower runs: activation-
checkpoint recompute re-enters vision submodules after frame selection, not
:func:`maybe_distribute_visual`, so there is no cross-thread read; training steps are
sequential, and token-based restore handles nesting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from cpshard.comm import Group, GroupLike, resolve_group
from cpshard.scoped import ScopedValue, ScopeToken
from cpshard.vision.config import CpVisionFrameShardingConfig

__all__ = [
    "CpVisionGroupScope",
    "CpVisionGroupToken",
    "cp_vision_frame_sharding_active",
    "cp_vision_group",
    "current_cp_vision_scope",
    "reset_cp_vision_group",
    "stored_scope",
    "set_cp_vision_group",
]

_WHAT = "cpshard.set_cp_vision_group"


@dataclass(frozen=True)
class CpVisionGroupScope:
    """The published sharding group plus the caller's declaration of its scope.

    ``group`` is the resolved group (``group.pg`` the process group, ``None`` for one rank);
    ``spans_only_cp=False`` marks a group that also spans replicated non-CP axes (e.g. the
    flattened CP x TP set), which is only valid for a frozen vision tower.
    """

    group: Group
    config: CpVisionFrameShardingConfig
    spans_only_cp: bool

    @property
    def active(self) -> bool:
        """Sharding is on and the group has more than one rank."""
        return self.config.enabled and self.group.world > 1


class CpVisionGroupToken(ScopeToken):
    """Restores the scope that was current before :func:`set_cp_vision_group`; opaque, one use."""

    __slots__ = ()


# The scope of the current model forward (both the top-level API and the NeMo mirror publish
# into it).
_HOLDER: ScopedValue[Any] = ScopedValue(
    None, "cpshard.reset_cp_vision_group", "set_cp_vision_group", CpVisionGroupToken
)


def _resolve(group: GroupLike, config: CpVisionFrameShardingConfig) -> Group:
    """A ProcessGroup, a 1-D mesh as is, or the ``config.mesh_dims`` of a multi-dim mesh."""
    if isinstance(group, DeviceMesh) and group.ndim > 1:
        names = group.mesh_dim_names or ()
        missing = [d for d in config.mesh_dims if d not in names]
        if missing:
            raise ValueError(
                f"{_WHAT}: config.mesh_dims {config.mesh_dims} names {missing}, which the {group.ndim}-D "
                f"mesh does not have (its dims: {tuple(names)})"
            )
        sub = group[config.mesh_dims] if len(config.mesh_dims) > 1 else group[config.mesh_dims[0]]
        group = sub._flatten() if sub.ndim > 1 else sub
    return resolve_group(group, _WHAT)


def set_cp_vision_group(
    group: dist.ProcessGroup | DeviceMesh | None,
    *,
    config: CpVisionFrameShardingConfig | None = None,
    spans_only_cp: bool = True,
) -> CpVisionGroupToken:
    """Install the group that vision frames are sharded over for the current model forward.

    Args:
        group: a ``ProcessGroup``, a 1-D ``DeviceMesh``, a multi-dim ``DeviceMesh`` (sharded
            over ``config.mesh_dims``, flattened when several), or ``None`` to disable sharding
            for the scope.
        config: the sharding policy. ``None`` means ``CpVisionFrameShardingConfig(enabled=True)``
            — publishing a group turns sharding on with the default thresholds.
        spans_only_cp: the caller's declaration of the group's scope. ``True`` (default): the
            group spans context-parallel ranks only (always gradient-correct). ``False``: it also
            spans replicated non-CP axes (e.g. the flattened CP x TP set) — valid only for a
            FROZEN tower; :func:`maybe_distribute_visual` raises for a trainable one, since the
            gather's reduce-scatter backward would add the vision gradient once per TP rank.

    Returns:
        A token for :func:`reset_cp_vision_group` (one use; scopes nest and must be reset in
        reverse order).
    """
    if config is None:
        config = CpVisionFrameShardingConfig(enabled=True)
    return _HOLDER.set(make_scope(group, config, spans_only_cp))


def make_scope(
    group: dist.ProcessGroup | DeviceMesh | None,
    config: CpVisionFrameShardingConfig,
    spans_only_cp: bool,
) -> CpVisionGroupScope | None:
    """The checked scope :func:`set_cp_vision_group` installs (None for ``group=None``)."""
    if not isinstance(config, CpVisionFrameShardingConfig):
        raise TypeError(
            f"{_WHAT}: config must be a CpVisionFrameShardingConfig or None, got {type(config).__name__}"
        )
    if not isinstance(spans_only_cp, bool):
        raise TypeError(f"{_WHAT}: spans_only_cp must be a bool, got {type(spans_only_cp).__name__}")
    return None if group is None else CpVisionGroupScope(_resolve(group, config), config, spans_only_cp)


def swap_scope(scope: Any) -> Any:
    """Install ``scope`` as the current one and return the one it replaces, as it was stored (no
    tokens). ``scope`` is a :class:`CpVisionGroupScope`, None, or a deferred scope: an object
    with ``resolve() -> CpVisionGroupScope`` (the NeMo mirror's, whose group is checked when the
    scope is first used rather than when it is published); :func:`current_cp_vision_scope`
    resolves it."""
    return _HOLDER.swap(scope)


def stored_scope() -> Any:
    """The scope as it was installed (a deferred scope unresolved; see :func:`swap_scope`)."""
    return _HOLDER.get()


def _resolved(value: Any) -> CpVisionGroupScope | None:
    return value if value is None or isinstance(value, CpVisionGroupScope) else value.resolve()


def reset_cp_vision_group(token: CpVisionGroupToken) -> None:
    """Restore the scope that was current before the :func:`set_cp_vision_group` call that
    returned ``token``. Raises ``RuntimeError`` for a token used twice or reset out of order."""
    _HOLDER.reset(token)


@contextmanager
def cp_vision_group(
    group: dist.ProcessGroup | DeviceMesh | None,
    *,
    config: CpVisionFrameShardingConfig | None = None,
    spans_only_cp: bool = True,
) -> Iterator[CpVisionGroupScope | None]:
    """``with cp_vision_group(group, config=...) as scope:`` — :func:`set_cp_vision_group` on
    entry, :func:`reset_cp_vision_group` on exit (also on an exception). Yields the scope."""
    if config is None:
        config = CpVisionFrameShardingConfig(enabled=True)
    with _HOLDER.scope(make_scope(group, config, spans_only_cp)) as scope:
        yield scope


def current_cp_vision_scope() -> CpVisionGroupScope | None:
    """The scope currently set (``None`` outside any scope or inside ``set_cp_vision_group(None)``);
    a deferred scope is resolved here, so its group errors surface on first use."""
    return _resolved(_HOLDER.get())


def cp_vision_frame_sharding_active() -> bool:
    """Whether the current model forward has an active vision shard group (a scope is set, its
    config is enabled, and its group has more than one rank) — the same policy
    :func:`maybe_distribute_visual` applies, for model code that wants to leave its ordinary
    multimodal path untouched otherwise."""
    value = _HOLDER.get()
    if value is None or not value.config.enabled:
        return False
    return _resolved(value).active
