"""Which torch.distributed backend a process group uses for one device type.

torch names a group's backend by a string of several forms: a single backend (``"nccl"``,
``"gloo"``), a device map (``"cpu:gloo,cuda:nccl"``: what ``init_process_group()`` without a
backend and ``init_device_mesh`` make), or ``"undefined"`` (a group whose backends are
registered per device, e.g. by ``split_group``); the group itself then knows the backend bound
to each device type.
"""

from __future__ import annotations

from typing import Protocol

import torch


class _HasBackends(Protocol):
    def _get_backend(self, device: torch.device) -> object: ...


def parse_backend_string(backend: str, device_type: str) -> str | None:
    """The backend ``backend`` (a group's backend string) names for ``device_type``, or None
    when the string does not say (``"undefined"``, a device map without that device type)."""
    text = str(backend).strip().lower()
    if not text or text == "undefined":
        return None
    if ":" not in text:
        return text  # one backend for every device type
    for entry in text.split(","):
        device, sep, name = entry.strip().partition(":")
        if not sep or not device.strip() or not name.strip():
            raise ValueError(f"cpshard: malformed backend string {backend!r} (entry {entry!r})")
        if device.strip() == device_type:
            return name.strip()
    return None


def device_backend(backend: str, pg: _HasBackends | None, device_type: str) -> str:
    """The name of ``pg``'s backend for ``device_type`` (``"nccl"``, ``"gloo"``, ...), from its
    backend string ``backend`` when that says, else from the backend the group has registered
    for that device type; ``""`` when it has none."""
    name = parse_backend_string(backend, device_type)
    if name is not None or pg is None:
        return name or ""
    try:
        bound = pg._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError):  # no backend registered for that device type
        return ""
    get_name = getattr(bound, "name", None)
    return str(get_name()).strip().lower() if callable(get_name) else ""
