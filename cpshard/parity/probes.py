"""Forward hooks that record what each module of a model saw and made, for locating the first
module whose output differs from the reference's.

A record keeps, per module call in completion order (a child completes before its parent), the
token-aligned tensors among its inputs and its output: ``[B, L, ...]`` tensors whose first two
dims are the batch and the call's token count. :func:`origin` then finds the module where a
difference starts: its inputs equal the reference's but its output does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.guard.models import auditing


@dataclass
class Call:
    """One module call: its name, token-aligned inputs and output (detached copies)."""

    name: str
    inputs: list[torch.Tensor]
    output: torch.Tensor | None


@dataclass
class Record:
    """Every module call of one forward, in completion order."""

    calls: list[Call] = field(default_factory=list)

    def by_name(self) -> dict[str, Call]:
        """The calls of modules called exactly once (others cannot be paired)."""
        seen: dict[str, list[Call]] = {}
        for c in self.calls:
            seen.setdefault(c.name, []).append(c)
        return {name: cs[0] for name, cs in seen.items() if len(cs) == 1}


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):
                return v
    return None


def _aligned(t: Any, batch: int, tokens: int) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and t.dim() >= 2
        and t.shape[0] == batch
        and t.shape[1] == tokens
    )


@contextmanager
def recording(model: torch.nn.Module, batch: int, tokens: int) -> Iterator[Record]:
    """Record every submodule call of ``model`` whose tensors are ``[batch, tokens, ...]`` (not
    the calls of cpshard's check of a model's first CP forward, :mod:`cpshard.guard.models`,
    which re-runs it)."""
    record = Record()

    def hook(name: str) -> Callable[..., None]:
        def after(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if auditing():  # cpshard re-running the model to check it: not the model's call
                return
            out = _first_tensor(output)
            ins = [t for t in (*args, *kwargs.values()) if _aligned(t, batch, tokens)]
            record.calls.append(
                Call(
                    name,
                    [t.detach().clone() for t in ins],
                    out.detach().clone() if _aligned(out, batch, tokens) else None,
                )
            )

        return after

    handles = [
        m.register_forward_hook(hook(name), with_kwargs=True)
        for name, m in model.named_modules()
        if name
    ]
    try:
        yield record
    finally:
        for h in handles:
            h.remove()


def origin(
    calls: list[Call],
    differs: Callable[[str, int, torch.Tensor], bool],
) -> str | None:
    """The first module (in completion order) whose token-aligned inputs all match but whose
    output differs: ``differs(name, slot, tensor)`` compares one tensor (slot -1: the output,
    else the input's index) with the reference's. None when no module's output differs."""
    first_diff = None
    for c in calls:
        if c.output is None or not differs(c.name, -1, c.output):
            continue
        if first_diff is None:
            first_diff = c.name
        if not any(differs(c.name, i, t) for i, t in enumerate(c.inputs)):
            return c.name
    return first_diff
