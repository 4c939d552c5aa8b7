"""Host work of the attention (reading the step's key, probing a kernel) run outside any
dispatch mode: a mode that executes cpshard's op bodies (torch's memory tracker under
``FakeTensorMode``, which predicts a step's memory) would otherwise turn host tensors into fake
ones, which hold no values. Eager calls with no mode active, and code being compiled, run it
as it is."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

T = TypeVar("T")


def outside_dispatch_modes(work: Callable[[], T]) -> T:
    """``work()``, with the active dispatch modes set aside while it runs."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is None:
        return work()
    with _disable_current_modes():
        return work()
