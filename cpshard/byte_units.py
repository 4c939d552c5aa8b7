"""Byte counts as people read them, for the command-line reports."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB or MiB: ``512 B``, ``4.0 KiB``, ``64.0 MiB``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip


def parse_bytes(text: str, what: str) -> int:
    """A size people write (``96GiB``, ``80 GB``, ``1.5TB``, ``123456``) in bytes; ``what``
    (the argument) words the error."""
    t = text.strip().upper().replace(" ", "")
    number = t.rstrip("KMGTIB")
    unit = t[len(number) :] or "B"
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"{what}: {text!r} is not a size such as 96GiB, 80GB or a byte count"
        ) from None
    if not value >= 1:
        raise ValueError(f"{what}: {text!r} must be at least one byte")
    return int(value)
