"""Which module calls of an audited forward reached cpshard's token mixing.

While :func:`recording` is active (the one forward of a model that
:mod:`cpshard.guard.models` audits), every module call becomes a :class:`Call` in a tree,
and each cpshard function that mixes tokens across the CP group (:func:`cpshard.cp_attention`,
the mixers of :mod:`cpshard.mixers`) reports itself with :func:`note_cpshard_mixing`: the call
running then, and every call around it, *reached* cpshard. A call that did not may still mix the
tokens of its shard by its own code; it is probed as it returns.

Outside a recording :func:`note_cpshard_mixing` reads one attribute and returns: no cost on the
hot path, and no effect inside a compiled graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.scoped import ScopedValue


@dataclass(eq=False)
class Call:
    """One module call of the audited forward: its module, the calls made inside it, whether
    cpshard mixed tokens inside it, whether it is skipped (declared safe, or inside such a
    call), and — for a call that did not reach cpshard — whether it mixes tokens by itself."""

    module: torch.nn.Module
    parent: Call | None
    skipped: bool = False
    children: list[Call] = field(default_factory=list)
    reached: bool = False
    mixes: bool = False


Probe = Callable[[Call, tuple[Any, ...], dict[str, Any]], bool]  # (call, args, kwargs) -> mixes


class Recording:
    """The call tree of one audited forward, built by the module hooks. Each call that did not
    reach cpshard is probed (``probe``) as it returns, while the forward that made it is still
    running: parameters a wrapper materialises only during its forward (FSDP's) are there, and
    every rank probes the same calls in the same order (probes may run collectives of their
    own, such as FSDP's all-gathers)."""

    def __init__(self, skip: Callable[[torch.nn.Module], bool], probe: Probe) -> None:
        self.root: Call | None = None
        self.open: Call | None = None  # the innermost call still running
        self._skip, self._probe = skip, probe

    def enter(self, module: torch.nn.Module) -> None:
        parent = self.open
        skipped = (parent is not None and parent.skipped) or self._skip(module)
        call = Call(module, parent, skipped)
        if parent is None:
            self.root = call if self.root is None else self.root
        else:
            parent.children.append(call)
        self.open = call

    def leave(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        call = self.open
        if call is None or call.module is not module:
            return  # a call entered before the recording began
        self.open = call.parent
        if call.reached:
            if call.parent is not None:
                call.parent.reached = True
        elif not call.skipped:
            call.mixes = self._probe(call, args, kwargs)

    def note(self) -> None:
        if self.open is not None:
            self.open.reached = True


# The recording of the forward being audited (one of the documented scopes), else None.
_recording: ScopedValue[Recording | None] = ScopedValue(None, "cpshard.guard.reach")


def note_cpshard_mixing() -> None:
    """Report that cpshard mixes tokens across the CP group here (called by every such
    function): the running module call, and those around it, reached cpshard."""
    if torch.compiler.is_compiling():  # a compiled graph is never audited: nothing to trace
        return
    recording = _recording.get()
    if recording is not None:
        recording.note()


def current_recording() -> Recording | None:
    """The recording of the forward being audited, if any."""
    return _recording.get()


@contextmanager
def recording(skip: Callable[[torch.nn.Module], bool], probe: Probe) -> Iterator[Recording]:
    """Record the module calls of the block: their tree, which reached cpshard, and, probed as
    they return, whether those that did not mix tokens (modules ``skip`` names are not probed,
    nor anything inside them)."""
    with _recording.scope(Recording(skip, probe)) as value:
        assert value is not None
        yield value


@contextmanager
def not_recording() -> Iterator[None]:
    """No recording inside (a probe's re-runs of a call already recorded)."""
    with _recording.scope(None):
        yield
