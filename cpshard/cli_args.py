"""Argument types the console commands share (``argparse`` ``type=`` callables' work)."""

from __future__ import annotations

import argparse


def mesh_shape(text: str, form: str, example: str) -> tuple[int, int]:
    """``--mesh``'s ``AxB`` as two sizes >= 1; ``form`` and ``example`` word the error."""
    try:
        first, second = (int(s) for s in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--mesh: expected {form} such as {example}, got {text!r}"
        ) from None
    if first < 1 or second < 1:
        raise argparse.ArgumentTypeError("--mesh: sizes must be >= 1")
    return first, second
