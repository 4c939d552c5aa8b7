"""The per-step block-diagonal CP attention state, its token-restored holder, and its registry.

The state is module-level because attention layers deep inside a model read it without a way to
pass arguments; entering ``train_ctx()`` installs it and leaving restores whatever was there
(nesting works).

Everything the attention needs from the step's documents is computed ONCE, on the host, when the
state is built (``make_cp_blockdiag_batch_and_ctx``): the segments, the halos, and the varlen
packing (row indices and ``cu_seqlens``). Device copies of the packing are made once per device
(pinned host memory, non-blocking copies) and cached in the state, so no attention call reads
device data on the host or copies host data to a device.

The attention custom ops find the state by its ``key``, a CPU int64 scalar tensor: a traced graph
takes the key as a tensor input, so ``torch.compile`` does not specialise on a step's segment list
(it is data, not a guard). The registry holds states weakly: a state lives as long as its
``train_ctx`` (and so until the step's backward has run).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import torch

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
class Packing:
    """The varlen kernel's view of a step's segments: segment i's queries are the rows
    ``q_rows[cu_q[i]:cu_q[i+1]]`` of the flattened ``[B * L]`` queries, its keys the rows
    ``k_rows[cu_k[i]:cu_k[i+1]]`` of the flattened ``[B * (halo + L)]`` halo-extended keys."""

    q_rows: torch.Tensor  # int64 [tokens in segments]
    k_rows: torch.Tensor  # int64 [keys over all segments]
    cu_q: torch.Tensor  # int32 [segments + 1]
    cu_k: torch.Tensor  # int32 [segments + 1]
    max_q: int
    max_k: int

    def to(self, device: torch.device) -> Packing:
        """The same packing on ``device`` (non-blocking copies; the host tensors are pinned when
        CUDA is available)."""
        move = lambda t: t.to(device, non_blocking=True)  # noqa: E731
        return Packing(
            move(self.q_rows),
            move(self.k_rows),
            move(self.cu_q),
            move(self.cu_k),
            self.max_q,
            self.max_k,
        )


def _runs(first: list[int], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat row indices of the runs ``[first[i], first[i] + lengths[i])`` back to back, and the
    int32 cumulative lengths."""
    lens = torch.tensor(lengths, dtype=torch.int64)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu[1:])
    rows = torch.repeat_interleave(
        torch.tensor(first, dtype=torch.int64) - cu[:-1], lens
    ) + torch.arange(int(cu[-1]))
    return rows, cu.to(torch.int32)


def _pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory when CUDA is available (so device copies can be async)."""
    return t.pin_memory() if torch.cuda.is_available() else t


_keys = itertools.count()
_registry: weakref.WeakValueDictionary[int, BlockDiagState] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class BlockDiagState:
    """What ``cp_blockdiag_sdpa`` needs for one step on this rank, computed once per step."""

    group: Group
    start: int  # global position of this rank's first token
    local_len: int  # tokens per rank (the padded sequence / W)
    batch_size: int
    halos: tuple[int, ...]  # tokens each rank must receive before its first token
    segments: tuple[Segment, ...]  # this rank's segments, row-major
    key: torch.Tensor = field(init=False, repr=False, compare=False)  # CPU int64 scalar
    packing: Packing = field(init=False, repr=False, compare=False)  # host (pinned) copy
    _on_device: dict[torch.device, Packing] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        ext = self.halo + self.local_len  # rows of a batch row's halo-extended keys
        origin = self.start - self.halo
        segs = self.segments
        q_rows, cu_q = _runs(
            [s.row * self.local_len + s.begin - self.start for s in segs], [s.length for s in segs]
        )
        k_lens = [s.begin + s.length - s.doc_start for s in segs]
        k_rows, cu_k = _runs([s.row * ext + s.doc_start - origin for s in segs], k_lens)
        packing = Packing(
            *map(_pinned, (q_rows, k_rows, cu_q, cu_k)),
            max((s.length for s in segs), default=0),
            max(k_lens, default=0),
        )
        key = next(_keys)
        object.__setattr__(self, "packing", packing)
        object.__setattr__(self, "key", torch.tensor(key, dtype=torch.int64))
        _registry[key] = self

    @property
    def halo(self) -> int:
        """Tokens this rank receives before its first token."""
        return min(self.halos[self.group.rank], self.start)

    def packing_on(self, device: torch.device) -> Packing:
        """The packing on ``device``, copied there once per device and cached."""
        if device.type == "cpu":
            return self.packing
        found = self._on_device.get(device)
        if found is None:
            found = self._on_device[device] = self.packing.to(device)
        return found


def state_for(key: torch.Tensor) -> BlockDiagState:
    """The step state registered under ``key`` (a host read of a CPU scalar: no device sync)."""
    state = _registry.get(int(key))
    if state is None:
        raise RuntimeError(
            "cpshard.cp_blockdiag_sdpa: the step's block-diagonal state is gone; keep the "
            "train_ctx returned by make_cp_blockdiag_batch_and_ctx alive until the step's "
            "backward has run"
        )
    return state


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
