"""Entering a step's CP attention: its state installed for a block, and the guard that refuses
models whose token mixers CP attention does not shard (:mod:`cpshard.guard`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cpshard.attention.state import AttentionState, active_state, current
from cpshard.guard.models import guard_models


@contextmanager
def activated(state: AttentionState) -> Iterator[None]:
    """Install ``state`` for the block, then restore the previous one. Entering it inside an
    active state of another layout raises: the model's shards would follow one of the two."""
    outer = current.get()
    if outer is not None and outer.layout != state.layout:
        raise ValueError(
            f"cpshard CP attention: rank {state.group.rank}: a {state.layout!r} attention context "
            f"entered inside an active {outer.layout!r} one; shards of one layout cannot be "
            "attended with the other's state"
        )
    guard_models(active_state)
    with current.scope(state):
        yield
