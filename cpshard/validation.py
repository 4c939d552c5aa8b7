"""Argument checks shared by every module: each names the argument and its caller (``what``,
which the caller makes name the rank too where a rank is involved), and raises the exception
type the public API documents (``TypeError`` for a wrong type, ``ValueError`` for a bad value).

:class:`Problem` is a check's finding that is not raised on the spot: a per-step entry point
collects it and makes every rank raise through the consensus round
(:func:`cpshard.consensus.agree`), or raises it locally as ``kind``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


class Problem(Exception):
    """A local check failed; raised on every rank through consensus (or locally as ``kind``)."""

    def __init__(self, message: str, kind: type[Exception] = ValueError) -> None:
        super().__init__(message)
        self.kind = kind


def is_int(value: object) -> bool:
    """Whether ``value`` is a Python int (a bool is not a count, a size nor an index)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: object, name: str, what: str, low: int | None = None) -> int:
    """``value`` as an int of at least ``low``: ``TypeError`` for a non-int (bools included),
    ``ValueError`` below ``low``."""
    if not is_int(value):
        raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__}")
    if low is not None and value < low:
        raise ValueError(f"{what}: {name} must be >= {low}, got {value}")
    return value


def check_bool(value: object, name: str, what: str) -> bool:
    """``value`` as a bool (``TypeError`` otherwise: ``0``/``1`` are not flags)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what}: {name} must be a bool, got {type(value).__name__}")
    return value


def tensor_arg(value: object, name: str) -> torch.Tensor:
    """``value`` as a tensor, else a :class:`Problem` (``TypeError``) naming ``name``."""
    if not isinstance(value, torch.Tensor):
        raise Problem(f"{name} must be a torch.Tensor, got {type(value).__name__}", TypeError)
    return value


def dim_arg(t: torch.Tensor, dim: object, name: str = "seq_dim") -> int:
    """``dim`` of ``t`` made non-negative, else a :class:`Problem` naming ``name``."""
    if not is_int(dim):
        raise Problem(f"{name} must be an int, got {type(dim).__name__}", TypeError)
    if t.dim() == 0 or not -t.dim() <= dim < t.dim():
        raise Problem(f"{name}={dim} is out of range for a tensor of shape {tuple(t.shape)}")
    return dim % t.dim()


def counts_arg(counts: object, world: int | None = None) -> list[int]:
    """Per-rank counts as a list of non-negative ints (one per rank of a ``world``-rank group
    when given), else a :class:`Problem`. A tensor is refused: counts must be known on the
    host."""
    if isinstance(counts, torch.Tensor):
        raise Problem(
            "counts must be a list of ints, not a tensor (it must be known on the host)", TypeError
        )
    if not isinstance(counts, Sequence) or isinstance(counts, str):
        raise Problem(f"counts must be a sequence of ints, got {type(counts).__name__}", TypeError)
    if world is not None and len(counts) != world:
        raise Problem(f"counts has {len(counts)} entries but the group has {world} ranks")
    for r, c in enumerate(counts):
        if not is_int(c):
            raise Problem(f"counts[{r}] must be an int, got {type(c).__name__}", TypeError)
        if c < 0:
            raise Problem(f"counts[{r}] = {c} is negative")
    return list(counts)


def problem_of(check: Callable[..., object], *args: object) -> str | None:
    """The :class:`Problem` ``check(*args)`` finds, as text, or None (for checks whose finding
    goes to a consensus round)."""
    try:
        check(*args)
    except Problem as p:
        return str(p)
    return None


def raised(what: str, check: Callable[..., T], *args: object) -> T:
    """``check(*args)``, its :class:`Problem` raised on the spot as its ``kind``, prefixed by
    ``what`` (the caller and, where it has one, the rank)."""
    try:
        return check(*args)
    except Problem as p:
        raise p.kind(f"{what}: {p}") from None
