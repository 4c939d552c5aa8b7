"""The per-step CP attention state, its token-restored holder, and its registry.

The state is module-level because attention layers deep inside a model read it without a way to
pass arguments; entering the step's context (``train_ctx()`` of
``make_cp_blockdiag_batch_and_ctx``, or the one ``ContextParallelSharder.shard`` returns)
installs it and leaving restores whatever was there (nesting works; a context of another layout
inside an active one raises).

Everything the attention needs from the step's documents is computed ONCE, on the host, when the
state is built: the spans each query run attends, the K/V exchange's plan (the block-diagonal
state's halos here; a layout's all-to-all-v tables in :mod:`cpshard.attention.state`), and the
varlen packing (row indices and ``cu_seqlens``). Device copies are made once per device (pinned
host memory, non-blocking copies) and cached in the state, so no attention call reads device
data on the host or copies host data to a device.

The attention custom ops find the state by its ``key``, a CPU int64 scalar tensor: a traced graph
takes the key as a tensor input, so ``torch.compile`` does not specialise on a step's spans (they
are data, not a guard). The registry holds states weakly: a state lives as long as its context
factory (and so until the step's backward has run).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from cpshard.comm import Group

if TYPE_CHECKING:
    from cpshard.blockdiag.blocks import Blocks


@dataclass(frozen=True)
class Segment:
    """One document piece of this rank: queries [begin, begin + length) of ``row`` attend keys
    [doc_start, query] (global positions)."""

    row: int
    begin: int
    length: int
    doc_start: int


@dataclass(frozen=True)
class Span:
    """A segment in the kernel's coordinates: local queries ``[q, q + n)`` of batch row ``row``
    attend the keys ``[k, split)`` of the row's key buffer all visible and, in a causal state,
    ``[split, split + n)`` causally (query ``q + i`` sees ``split .. split + i``): the keys of
    one document in order (a bidirectional state's spans end at ``split``)."""

    row: int
    q: int
    n: int
    k: int
    split: int


@dataclass(frozen=True)
class Packing:
    """The varlen kernel's view of a step's spans: span i's queries are the rows
    ``q_rows[cu_q[i]:cu_q[i+1]]`` of the flattened ``[B * L]`` queries, its keys the rows
    ``k_rows[cu_k[i]:cu_k[i+1]]`` of the flattened ``[B * N]`` key buffer."""

    q_rows: torch.Tensor  # int64 [tokens in spans]
    k_rows: torch.Tensor  # int64 [keys over all spans]
    cu_q: torch.Tensor  # int32 [spans + 1]
    cu_k: torch.Tensor  # int32 [spans + 1]
    max_q: int
    max_k: int
    shared_keys: bool  # a key row serves several spans (its gradients must be added up)
    causal: bool  # causal aligned bottom-right, else every key of a span visible

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
            self.shared_keys,
            self.causal,
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


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in page-locked memory when CUDA is available (so device copies can be async)."""
    return t.pin_memory() if torch.cuda.is_available() else t


# The most packed key rows per key buffer row: beyond it the varlen packing is not built (the
# loop's blocks serve the step). Each span packs its document's whole prefix, so layouts with
# many short runs per document (``stripe``: one per token) would pack O(L * document) rows.
PACKED_KEYS_PER_ROW = 4


def pack(
    spans: Sequence[Span], local_len: int, key_len: int, causal: bool, batch_size: int
) -> Packing | None:
    """The varlen packing of ``spans`` over ``[B * local_len]`` queries and ``[B * key_len]``
    keys (host tensors, pinned when CUDA is available); None when it would pack more than
    ``PACKED_KEYS_PER_ROW`` key rows per buffer row."""
    k_lens = [s.split + (s.n if causal else 0) - s.k for s in spans]
    if sum(k_lens) > PACKED_KEYS_PER_ROW * batch_size * key_len:
        return None
    q_rows, cu_q = _runs([s.row * local_len + s.q for s in spans], [s.n for s in spans])
    k_first = [s.row * key_len + s.k for s in spans]
    k_rows, cu_k = _runs(k_first, k_lens)
    return Packing(
        *map(pinned, (q_rows, k_rows, cu_q, cu_k)),
        max((s.n for s in spans), default=0),
        max(k_lens, default=0),
        _overlap(k_first, k_lens),
        causal,
    )


def _overlap(first: list[int], lengths: list[int]) -> bool:
    """Whether two of the ranges ``[first[i], first[i] + lengths[i])`` share a row."""
    reached = None
    for start, n in sorted((f, n) for f, n in zip(first, lengths, strict=True) if n):
        if reached is not None and start < reached:
            return True
        reached = max(start + n, reached or 0)
    return False


_Movable = TypeVar("_Movable")  # host metadata with a to(device)


def cached_on(cache: dict, device: torch.device, host: _Movable) -> _Movable:
    """``host`` (step metadata with a ``to(device)``) on ``device``: copied once per device
    into ``cache``; the host copy itself on the CPU."""
    if device.type == "cpu":
        return host
    found = cache.get(device)
    if found is None:
        found = cache[device] = host.to(device)
    return found


_keys = itertools.count()
_registry: weakref.WeakValueDictionary[int, AttentionState] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class AttentionState:
    """What CP attention needs for one step on this rank, computed once per step on the host:
    the spans each query run attends (in the coordinates of the K/V buffer the state's exchange
    builds), their varlen packing, the loop's blocks of short runs, and a registry key.
    Subclasses say how the key buffer is built (:meth:`extend`) and how wide it is
    (:attr:`key_len`, when the step fixes it)."""

    group: Group
    local_len: int  # tokens per rank (and batch row)
    batch_size: int
    reach: int  # the most keys any query of the step attends, over all ranks (0: none)
    key: torch.Tensor = field(init=False, repr=False, compare=False)  # CPU int64 scalar
    spans: tuple[Span, ...] = field(init=False, repr=False, compare=False)
    packing: Packing | None = field(init=False, repr=False, compare=False)  # host (pinned) copy
    blocks: Blocks = field(init=False, repr=False, compare=False)  # the loop's view, host copy
    _on_device: dict[torch.device, Packing] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _blocks_on: dict[torch.device, Blocks] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    layout = "contiguous"  # the layout whose shards the state serves
    causal = True  # the spans' queries see their document's prefix, else all of it

    def __post_init__(self) -> None:
        spans = self._spans()
        key = next(_keys)
        object.__setattr__(self, "spans", spans)
        from cpshard.blockdiag.blocks import plan_blocks  # that module imports this one

        packing = pack(spans, self.local_len, self.key_len, self.causal, self.batch_size)
        object.__setattr__(self, "packing", packing)
        object.__setattr__(self, "blocks", plan_blocks(spans, self.causal))
        object.__setattr__(self, "key", torch.tensor(key, dtype=torch.int64))
        _registry[key] = self

    def _spans(self) -> tuple[Span, ...]:
        raise NotImplementedError

    @property
    def key_len(self) -> int:
        """Rows per batch row of the key buffer :meth:`extend` returns."""
        raise NotImplementedError

    @property
    def exchange_plan(self) -> tuple[int, ...]:
        """Integers every rank derives alike from the step (for the checked-mode consensus)."""
        raise NotImplementedError

    def extend(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's K/V ``[B, H, L, D]`` -> the key buffer ``[B, H, key_len, D]`` the spans
        index (the step's exchange, a custom op)."""
        raise NotImplementedError

    def restore(self, grad: torch.Tensor, length: int) -> torch.Tensor:
        """Adjoint of :meth:`extend`: the key buffer's gradient ``[B, H, key_len, D]`` -> this
        rank's ``[B, H, length, D]``, each row's gradients added by its owner."""
        raise NotImplementedError

    def packing_on(self, device: torch.device) -> Packing | None:
        """The packing on ``device``, copied there once per device and cached (None: the step
        has none, see :func:`pack`)."""
        return None if self.packing is None else cached_on(self._on_device, device, self.packing)

    def place_on(self, device: torch.device) -> None:
        """Copy the attention's metadata to ``device`` (once per step, at the step's setup)."""
        self.packing_on(device)
        self.blocks_on(device)

    def blocks_on(self, device: torch.device) -> Blocks:
        """:attr:`blocks` on ``device``, copied there once per device and cached."""
        return cached_on(self._blocks_on, device, self.blocks)

    def bidirectional(self) -> AttentionState | None:
        """The step's state for bidirectional attention within documents, if it has one."""
        return None


@dataclass(frozen=True)
class BlockDiagState(AttentionState):
    """The contiguous layout's state (``make_cp_blockdiag_batch_and_ctx``): the key buffer is
    this rank's K/V with the multi-hop halo in front."""

    start: int = 0  # global position of this rank's first token
    halos: tuple[int, ...] = ()  # tokens each rank must receive before its first token
    segments: tuple[Segment, ...] = ()  # this rank's segments, row-major

    def _spans(self) -> tuple[Span, ...]:
        origin = self.start - self.halo  # global position of the first buffer row
        return tuple(
            Span(s.row, s.begin - self.start, s.length, s.doc_start - origin, s.begin - origin)
            for s in self.segments
        )

    @property
    def halo(self) -> int:
        """Tokens this rank receives before its first token."""
        return min(self.halos[self.group.rank], self.start)

    @property
    def key_len(self) -> int:
        return self.halo + self.local_len

    @property
    def exchange_plan(self) -> tuple[int, ...]:
        return self.halos

    def extend(self, kv: torch.Tensor) -> torch.Tensor:
        from cpshard.blockdiag.attention import blockdiag_halo  # the ops module imports this one

        return blockdiag_halo(kv, self.key) if self.group.world > 1 else kv

    def restore(self, grad: torch.Tensor, length: int) -> torch.Tensor:
        from cpshard.blockdiag.attention import blockdiag_halo_return

        return blockdiag_halo_return(grad, self.key, length) if self.group.world > 1 else grad


def state_for(key: torch.Tensor) -> AttentionState:
    """The step state registered under ``key`` (a host read of a CPU scalar: no device sync)."""
    state = _registry.get(int(key))
    if state is None:
        raise RuntimeError(
            "cpshard CP attention: the step's attention state is gone; keep the context returned "
            "by make_cp_blockdiag_batch_and_ctx / ContextParallelSharder.shard alive until the "
            "step's backward has run"
        )
    return state


class _Holder:
    def __init__(self) -> None:
        self.value: AttentionState | None = None

    def set(self, value: AttentionState | None) -> AttentionState | None:
        previous, self.value = self.value, value
        return previous

    def reset(self, token: AttentionState | None) -> None:
        self.value = token


current = _Holder()


def active_state() -> AttentionState | None:
    """The state installed by the innermost active attention context, if any."""
    return current.value


@contextmanager
def activated(state: AttentionState) -> Iterator[None]:
    """Install ``state`` for the block, then restore the previous one. Entering it inside an
    active state of another layout raises: the model's shards would follow one of the two."""
    outer = current.value
    if outer is not None and outer.layout != state.layout:
        raise ValueError(
            f"cpshard CP attention: rank {state.group.rank}: a {state.layout!r} attention context "
            f"entered inside an active {outer.layout!r} one; shards of one layout cannot be "
            "attended with the other's state"
        )
    token = current.set(state)
    try:
        yield
    finally:
        current.reset(token)
