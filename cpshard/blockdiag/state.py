"""The per-step block-diagonal CP attention state, and its token-restored holder.

The state is module-level because attention layers deep inside a model read it without a way to
pass arguments; entering ``train_ctx()`` installs it and leaving restores whatever was there
(nesting works).
"""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.comm import Group


@dataclass(frozen=True)
class Segment:
    """One document piece of this rank: queries [begin, begin + length) of ``row`` attend keys
    [doc_start, query] (global positions)."""

    row: int
    begin: int
    length: int
    doc_start: int


@dataclass(frozen=True)
class BlockDiagState:
    """What ``cp_blockdiag_sdpa`` needs for one step on this rank."""

    group: Group
    start: int  # global position of this rank's first token
    local_len: int  # tokens per rank (the padded sequence / W)
    batch_size: int
    halos: tuple[int, ...]  # tokens each rank must receive before its first token
    segments: tuple[Segment, ...]  # this rank's segments, row-major

    @property
    def halo(self) -> int:
        """Tokens this rank receives before its first token."""
        return min(self.halos[self.group.rank], self.start)


class _Holder:
    def __init__(self) -> None:
        self.value: BlockDiagState | None = None

    def set(self, value: BlockDiagState | None) -> BlockDiagState | None:
        previous, self.value = self.value, value
        return previous

    def reset(self, token: BlockDiagState | None) -> None:
        self.value = token


current = _Holder()


def active_state() -> BlockDiagState | None:
    """The state installed by the innermost active ``train_ctx()``, if any."""
    return current.value
