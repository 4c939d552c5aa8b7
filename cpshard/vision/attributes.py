"""Reading attributes of user objects (towers, configs, outputs) without depending on their
classes: a mapping's key or an attribute, and the wrappers a tower may sit inside."""

from __future__ import annotations

from collections.abc import Mapping

# Attributes under which wrappers keep the module they wrap: DDP / DataParallel (``module``),
# ``torch.compile`` (``_orig_mod``), FSDP1 and activation checkpointing.
MODULE_WRAPPERS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def attribute(node: object, name: str) -> object:
    """``node[name]`` for a mapping, else ``getattr(node, name, None)``; None where reading it
    raises (a property that fails is an absent value, not an error)."""
    if isinstance(node, Mapping):
        return node.get(name)
    try:
        return getattr(node, name, None)
    except Exception:
        return None
