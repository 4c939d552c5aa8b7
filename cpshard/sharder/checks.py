"""The sharder's local checks: :class:`_Problem` (raised on every rank through consensus, or
locally) and the argument checks every part of the sharder shares."""

from __future__ import annotations

import torch


class _Problem(Exception):
    """A local check failed; raised on every rank through consensus (or locally)."""

    def __init__(self, message: str, kind: type[Exception] = ValueError) -> None:
        super().__init__(message)
        self.kind = kind


def _dim(t: torch.Tensor, dim: object, name: str = "seq_dim") -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise _Problem(f"{name} must be an int, got {type(dim).__name__}", TypeError)
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise _Problem(f"{name}={dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def _tensor(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise _Problem(f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    return t
