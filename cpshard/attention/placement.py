"""Host metadata of a step on its device: pinned host copies, moved once per device and cached,
so that no attention call copies host data to a device or reads device data on the host."""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch


class Movable(Protocol):
    def to(self, device: torch.device) -> Movable: ...


M = TypeVar("M", bound=Movable)


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory when CUDA is available (so device copies can be async)."""
    return t.pin_memory() if torch.cuda.is_available() else t


def cached_on(cache: dict[torch.device, M], device: torch.device, host: M) -> M:
    """``host`` (step metadata with a ``to(device)``) on ``device``: copied once per device
    into ``cache``; the host copy itself on the CPU."""
    if device.type == "cpu":
        return host
    found = cache.get(device)
    if found is None:
        found = cache[device] = host.to(device)
    return found
