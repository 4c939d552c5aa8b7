"""The built-in layouts by name: one strategy object each, their aliases, and the resolution of a
caller's layout name to its strategy. This is the one place that knows which names exist; every
other module asks the strategy it gets from here."""

from __future__ import annotations

from cpshard.layouts.balanced import BALANCED
from cpshard.layouts.base import LayoutStrategy
from cpshard.layouts.contiguous import CONTIGUOUS
from cpshard.layouts.head_tail import HEAD_TAIL
from cpshard.layouts.per_document_head_tail import PER_DOCUMENT_HEAD_TAIL
from cpshard.layouts.stripe import STRIPE

__all__ = [
    "CLOSED_FORM_LAYOUTS",
    "DATA_DEPENDENT_LAYOUTS",
    "LAYOUTS",
    "LAYOUT_ALIASES",
    "STRATEGIES",
    "canonical_layout_name",
    "is_closed_form",
    "layout_strategy",
    "lookup",
]

WHAT = "cpshard.layouts"  # the default entry point named in errors

# Registration order is the order names are listed in (LAYOUTS, errors).
STRATEGIES: dict[str, LayoutStrategy] = {
    s.name: s for s in (CONTIGUOUS, HEAD_TAIL, STRIPE, PER_DOCUMENT_HEAD_TAIL, BALANCED)
}
LAYOUTS = tuple(STRATEGIES)
CLOSED_FORM_LAYOUTS = tuple(n for n, s in STRATEGIES.items() if s.closed_form)
DATA_DEPENDENT_LAYOUTS = tuple(n for n, s in STRATEGIES.items() if not s.closed_form)
LAYOUT_ALIASES = {a: n for n, s in STRATEGIES.items() for a in s.aliases}


def lookup(name: object) -> LayoutStrategy | None:
    """The strategy registered under the canonical ``name`` exactly (no alias resolution), or
    None (an alias, a custom layout's name, None): what a recorded layout name refers to."""
    return STRATEGIES.get(name) if isinstance(name, str) else None


def is_closed_form(name: object) -> bool:
    """True when the canonical ``name`` is a built-in closed-form layout."""
    strategy = lookup(name)
    return strategy is not None and strategy.closed_form


def canonical_layout_name(name: object, what: str = WHAT) -> str:
    """The canonical name of a built-in layout (aliases resolved); ValueError for unknown names."""
    if not isinstance(name, str):
        raise TypeError(f"{what}: layout must be a layout name (str), got {type(name).__name__}")
    key = name.strip().lower().replace("-", "_")
    key = LAYOUT_ALIASES.get(key, key)
    if key not in STRATEGIES:
        names = (
            ", ".join(LAYOUTS)
            + " (aliases: "
            + ", ".join(f"{a} = {c}" for a, c in LAYOUT_ALIASES.items())
            + ")"
        )
        raise ValueError(f"{what}: unknown layout {name!r}; choose one of {names}")
    return key


def layout_strategy(name: object, what: str = WHAT) -> LayoutStrategy:
    """The strategy of a built-in layout name or alias (errors as :func:`canonical_layout_name`)."""
    return STRATEGIES[canonical_layout_name(name, what)]
