"""The per-step CP attention state, its registry, and the scoped value that holds the active one.

The state is module-level because attention layers deep inside a model read it without a way to
pass arguments; entering the step's context (``train_ctx()`` of
``make_cp_blockdiag_batch_and_ctx``, or the one ``ContextParallelSharder.shard`` returns)
installs it (:func:`cpshard.attention.activation.activated`) and leaving restores whatever was
there (nesting works; a context of another layout inside an active one raises).

Everything the attention needs from the step's documents is computed ONCE, on the host, when the
state is built (:mod:`cpshard.attention.step`): the spans each query run attends, the K/V
exchange and its plan (:mod:`cpshard.attention.exchange`), the varlen packing and the loop's
blocks. Device copies are made once per device (pinned host memory, non-blocking copies) and
cached in the state, so no attention call reads device data on the host or copies host data to
a device.

The attention custom ops find the state by its ``key``, a CPU int64 scalar tensor: a traced graph
takes the key as a tensor input, so ``torch.compile`` does not specialise on a step's spans (they
are data, not a guard). The registry holds states weakly: a state lives as long as its context
factory (and so until the step's backward has run).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cpshard.attention.blocks import Blocks, plan_blocks
from cpshard.attention.exchange import KVExchange
from cpshard.attention.outside_modes import outside_dispatch_modes
from cpshard.attention.packing import Packed, pack_spans
from cpshard.attention.placement import cached_on
from cpshard.masks import MaskDescription
from cpshard.planning import LayoutRuns
from cpshard.planning.spans import Span, span_rules, spans_of
from cpshard.comm import Group
from cpshard.layouts import ShardLayout
from cpshard.scoped import ScopedValue

STRATEGIES = ("needed_rows", "heads", "hierarchical", "auto")

_keys = itertools.count()
# The sliding windows layers have asked for (any step): a step plans their states at its setup,
# so that from a model's second step on no layer plans in its forward.
seen_windows: set[int] = set()
# Whether a layer has attended bidirectionally (any step): a step then plans its bidirectional
# state at its setup, else on first use (most models attend only causally).
seen_bidirectional = False
# What earlier steps' calls read: a state's host views (``"packing"``: the varlen kernel's,
# ``"blocks"``: the loop's) and the head-parallel plans (their kind): a step's setup makes and
# places those, anything else on its first use.
seen_views: set[str] = set()
_registry: weakref.WeakValueDictionary[int, AttentionState] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class HeadParallel:
    """A step's head-parallel plan (DeepSpeed-Ulysses, and its hierarchical form): one
    all-to-all over ``group`` turns "all heads, my tokens" into "my heads, the tokens of every
    rank of ``group``" before attention, and back after it; ``inner`` (a causal state, its twin
    inside) attends those tokens across the ranks that hold the same heads (one rank: a plain
    per-document attention; the ranks at the same place of every node: the needed-rows
    exchange between nodes). ``order``: where each token of the gathered shards goes so that
    they ascend in global order (host ``[T]`` or ``[B, T]``; None: they already do)."""

    kind: str  # the strategy it serves: "heads" or "hierarchical"
    group: Group
    inner: AttentionState
    order: torch.Tensor | None
    _order_on: dict[torch.device, torch.Tensor | None] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def order_on(self, device: torch.device) -> torch.Tensor | None:
        """:attr:`order` on ``device``, copied there once per device and cached."""
        return None if self.order is None else cached_on(self._order_on, device, self.order)

    def place_on(self, device: torch.device) -> None:
        """Place the plan's order and inner state once an earlier step's call used the plan
        (:data:`seen_views`), else leave them to its first use."""
        if self.kind in seen_views:
            self.order_on(device)
            self.inner.place_on(device)

    def used(self) -> HeadParallel:
        """This plan, marked as read by a call (later steps place it at their setup)."""
        seen_views.add(self.kind)
        return self


@dataclass(frozen=True)
class AttentionState:
    """What CP attention needs for one step on this rank, computed once per step on the host:
    the spans each query run attends (in the coordinates of the key buffer ``exchange``
    builds), their varlen packing, the loop's blocks of short runs, and a registry key.

    ``causal``: spans see their document's prefix, else the whole document. ``twin``: the
    step's bidirectional state (of a causal one; a bidirectional state has none), or
    ``plan_twin``: how a causal state plans it once, when first asked for. ``window``:
    each query sees only that many keys of its prefix, itself included (a windowed state
    exchanges only the rows its windows reach). ``plan_window``: how the step's causal state
    plans the state of a window (once per window and step, on first use: see
    :meth:`windowed`). ``mask``: the mask description a masked state executes (not causal, no
    twin), its spans' per-span ``rules`` (:func:`~cpshard.planning.spans.query_keys`; None:
    from ``causal`` and ``window``); ``plan_mask``: how the step's causal state plans the
    state of a description (once per description object and step: :meth:`masked`)."""

    group: Group
    layout: str  # the layout whose shards the state serves
    local_len: int  # tokens per rank (and batch row)
    batch_size: int
    reach: int  # the most keys any query of the step attends, over all ranks (0: none)
    causal: bool
    span_table: torch.Tensor  # [N, 6] int64: the spans' fields (cpshard.planning.spans)
    exchange: KVExchange
    twin: AttentionState | None = None
    plan_twin: Callable[[], AttentionState] | None = field(
        default=None, repr=False, compare=False
    )
    window: int | None = None
    plan_window: Callable[[int], AttentionState] | None = field(
        default=None, repr=False, compare=False
    )
    mask: MaskDescription | None = field(default=None, repr=False, compare=False)
    rules: torch.Tensor | None = field(default=None, repr=False, compare=False)
    plan_mask: Callable[[MaskDescription], AttentionState] | None = field(
        default=None, repr=False, compare=False
    )
    # The step's padded document ids [B, P] (host), layout and every rank's runs of them: what
    # the sequence mixers other than attention (convolutions, recurrences: cpshard.mixers) plan
    # their steps from.
    documents: torch.Tensor | None = field(default=None, repr=False, compare=False)
    shard_layout: ShardLayout | None = field(default=None, repr=False, compare=False)
    runs: LayoutRuns | None = field(default=None, repr=False, compare=False)
    # How the step's calls exchange (``STRATEGIES``) and its head-parallel plans: ``heads``
    # and ``hierarchical`` use theirs, ``auto`` the cheapest of them and this state's own
    # exchange (:mod:`cpshard.attention.strategy`).
    strategy: str = "needed_rows"
    head_parallel: tuple[HeadParallel, ...] = field(default=(), repr=False, compare=False)
    key: torch.Tensor = field(init=False, repr=False, compare=False)  # CPU int64 scalar
    # Host (pinned) copies of the varlen packing and the loop's blocks (see :meth:`place_on`).
    _host: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)
    _packing_on: dict[torch.device, Packed] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _rest_on: dict[torch.device, Blocks] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _blocks_on: dict[torch.device, Blocks] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _windows: dict[int, AttentionState] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # id(description) -> the description (held: its id is not reused) and its state
    _masks: dict[int, tuple[MaskDescription, AttentionState]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    # Per-step plans other consumers derive from this state (planned once, on first use).
    derived: dict[object, object] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.causal == (self.twin is None and self.plan_twin is None):
            raise ValueError("a causal attention state needs its bidirectional twin, only it")
        key = next(_keys)
        if self.window is not None and not self.causal:
            raise ValueError("a sliding window needs a causal attention state")
        if (self.mask is None) != (self.rules is None) or (self.mask is not None and self.causal):
            raise ValueError("a masked attention state has its mask and rules, and no twin")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        object.__setattr__(self, "key", torch.tensor(key, dtype=torch.int64))
        _registry[key] = self

    def extend(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's K/V ``[B, H, L, D]`` -> the key buffer the spans index."""
        return self.exchange.extend(kv, self.key)

    def restore(self, grad: torch.Tensor, length: int) -> torch.Tensor:
        """Adjoint of :meth:`extend`."""
        return self.exchange.restore(grad, self.key, length)

    def _made(self, name: str, make: Callable[[], object]) -> Any:
        """The host view ``name``, made by ``make`` on first use and kept for the step."""
        if name not in self._host:
            self._host[name] = make()
        return self._host[name]

    @property
    def spans(self) -> tuple[Span, ...]:
        """The spans each query run attends (host objects, made from :attr:`span_table` on
        first use)."""
        return self._made("spans", lambda: spans_of(self.span_table))

    @property
    def span_rules(self) -> torch.Tensor:
        """``[N, 3]`` per-span rules ``(end, back, ahead)``: which keys each query sees
        (:func:`~cpshard.planning.spans.query_keys`), a masked state's own, else its kind's."""
        if self.rules is not None:
            return self.rules
        return self._made("rules", lambda: span_rules(self.span_table, self.causal, self.window))

    @property
    def looks_ahead(self) -> bool:
        """Whether a query of the state's mask description sees a later key (made once from the
        description: alike on every rank; a state without one: not causal)."""
        if self.mask is None:
            return not self.causal
        mask = self.mask
        return self._made("looks ahead", lambda: bool((mask.ahead > 0).any()))

    @property
    def packing(self) -> Packed | None:
        """The spans' varlen packings (host; None: the step has none, see
        :func:`~cpshard.attention.packing.pack_spans`), made on first use."""
        seen_views.add("packing")
        return self._made(
            "packing",
            lambda: pack_spans(
                self.span_table,
                self.span_rules,
                self.local_len,
                self.exchange.key_len,
                self.batch_size,
            ),
        )

    @property
    def rest(self) -> Blocks | None:
        """The loop's view of the spans no packing states (a mask description's per-query key
        ranges), next to the packings; None: every span is packed, or there is no packing."""
        packed = self.packing
        if packed is None or not packed.rest:
            return None
        at = list(packed.rest)
        return self._made("rest", lambda: plan_blocks(self.span_table[at], self.span_rules[at]))

    @property
    def blocks(self) -> Blocks:
        """The loop's view of the spans (host, :func:`~cpshard.attention.blocks.plan_blocks`),
        made on first use."""
        seen_views.add("blocks")
        return self._made("blocks", lambda: plan_blocks(self.span_table, self.span_rules))

    def packing_on(self, device: torch.device) -> Packed | None:
        """The packing on ``device``, copied there once per device and cached (None: the step
        has none)."""
        packing = self.packing
        return None if packing is None else cached_on(self._packing_on, device, packing)

    def rest_on(self, device: torch.device) -> Blocks | None:
        """:attr:`rest` on ``device``, copied there once per device and cached."""
        rest = self.rest
        return None if rest is None else cached_on(self._rest_on, device, rest)

    def blocks_on(self, device: torch.device) -> Blocks:
        """:attr:`blocks` on ``device``, copied there once per device and cached."""
        return cached_on(self._blocks_on, device, self.blocks)

    def place_on(self, device: torch.device) -> None:
        """Make the attention's metadata and copy it to ``device`` (once per step, at the step's
        setup): the views earlier steps' calls read; a view no call has read yet is made on its
        first use (a CPU step never packs, a step whose strategy attends elsewhere never groups
        blocks)."""
        if "packing" in seen_views:
            self.packing_on(device)
            self.rest_on(device)
        if "blocks" in seen_views:
            self.blocks_on(device)
        self.exchange.place_on(device)
        for plan in self.head_parallel:
            plan.place_on(device)

    def bidirectional(self) -> AttentionState:
        """The step's state for bidirectional attention within documents."""
        global seen_bidirectional
        if self.mask is not None:
            raise ValueError("cpshard CP attention: a masked state has no bidirectional twin")
        if not self.causal:
            return self
        seen_bidirectional = True
        return self.twin if self.twin is not None else self.plan_twin()

    def windowed(self, window: int | None) -> AttentionState:
        """The step's causal state for a sliding ``window`` (keys a query sees, itself
        included): this state when no query of the step attends more keys (``reach``), else
        the window's own state, planned at the step's setup when a layer asked for the window
        in an earlier step, else on its first use, and kept (host work from the step's document
        ids: every rank plans it alike, nothing is read from a device)."""
        if window is None or window == self.window:
            return self
        seen_windows.add(window)
        if window >= self.reach:
            return self
        if self.plan_window is None:
            raise ValueError("cpshard CP attention: a sliding window needs a causal state")
        state = self._windows.get(window)
        if state is None:
            state = self._windows[window] = self.plan_window(window)
        return state

    def masked(self, mask: MaskDescription) -> AttentionState:
        """The step's state executing the mask description ``mask`` (of the step's batch: its
        rows and documents, over the padded length or the unpadded one), planned on its first
        use from the step's runs and kept for the step: a layer type that passes the same
        description object reuses it, and a new object equal to one the step planned (a model's
        mask translated again by a recomputed forward) is matched once, by content. Raises
        ``ValueError`` (starting ``mask:``) for a description of another batch or one CP
        attention cannot execute."""
        if self.plan_mask is None:
            raise ValueError("cpshard CP attention: a mask description needs the step's state")
        known = self._masks.get(id(mask))
        if known is not None:
            return known[1]
        state = next((s for d, s in self._masks.values() if d.same_as(mask)), None)
        if state is None:
            state = self.plan_mask(mask)
        self._masks[id(mask)] = (mask, state)
        return state

    def variant(self, causal: bool, mask: MaskDescription | None = None) -> AttentionState:
        """The step's state a call attends under: ``mask``'s (:meth:`masked`), else this causal
        state or its bidirectional twin."""
        if mask is not None:
            return self.masked(mask)
        return self if causal else self.bidirectional()


def state_for(key: torch.Tensor) -> AttentionState:
    """The step state registered under ``key`` (a host read of a CPU scalar: no device sync,
    outside any dispatch mode)."""
    state = _registry.get(outside_dispatch_modes(lambda: int(key)))
    if state is None:
        raise RuntimeError(
            "cpshard CP attention: the step's attention state is gone; keep the context returned "
            "by make_cp_blockdiag_batch_and_ctx / ContextParallelSharder.shard alive until the "
            "step's backward has run"
        )
    return state


def any_step_alive() -> bool:
    """True while some step's attention state is alive (its context object not yet dropped)."""
    return len(_registry) > 0


# The state of the innermost active attention context.
current: ScopedValue[AttentionState | None] = ScopedValue(None, "cpshard CP attention context")


def active_state() -> AttentionState | None:
    """The state installed by the innermost active attention context, if any."""
    return current.get()
