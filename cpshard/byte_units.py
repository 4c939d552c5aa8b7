"""Byte counts as people read them, for the command-line reports."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB or MiB: ``512 B``, ``4.0 KiB``, ``64.0 MiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
