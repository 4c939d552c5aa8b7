"""Layer classes refused under CP in this environment, with the reason.

Integrations list here the layers they know cannot run exactly under CP: a layer whose hooks
do not match the installed library, a layer that selects tokens by its own scoring over the
whole sequence. The guard refuses a model holding one before it runs (on every rank, the same
model on each), naming the module and saying why, where its name-free checks would only say
that the module mixes tokens, or could not see it at all. Classes are keyed by
``module.qualname``, so nothing is imported to list them.
"""

from __future__ import annotations

_reasons: dict[str, str] = {}


def class_key(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def note(key: str, reason: str) -> None:
    """Refuse the layer class ``key`` (``module.qualname``) under CP, for ``reason``."""
    _reasons[key] = reason


def forget(key: str) -> None:
    """No longer refuse ``key`` (its hooks were installed)."""
    _reasons.pop(key, None)


def reason(cls: type) -> str | None:
    """Why the class ``cls`` is refused under CP, or None."""
    return _reasons.get(class_key(cls)) if _reasons else None
