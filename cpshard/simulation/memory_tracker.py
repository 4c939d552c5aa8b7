"""torch's ``MemTracker`` (and, for an FSDP2-sharded step, its ``FSDPMemTracker``) with the
categories a CP step's memory is reported in, and cpshard's custom ops traced through.

torch's tracker sees the outputs of every op dispatched under it. cpshard's attention and
exchange ops are opaque custom ops whose fake kernels return only their outputs, so their
internal buffers (the K/V buffer an exchange builds, the kernels' workspace, the gradients sent
back) would be missed: the trackers here run each one's own Python body instead, under
themselves, so every allocation of the op is seen (the collectives inside run on the fake process
group, whose fake kernels allocate what the real ones return).

Categories: torch's (parameters, buffers, gradients, optimizer state, activations = made in the
forward, temporaries = made in the backward, other = external tensors; with FSDP2 its sharded
and unsharded parameters and gradients, all-gather and reduce-scatter buffers) plus ``KV`` (made
by a K/V exchange op: the buffers a rank receives and sends, forward and backward) and ``LOSS``
(made inside the loss module, forward and backward). Only tensors on the traced device count
(the ``meta`` tensors cpshard makes to read a layout hold no memory).

Per segment of the step (``segment_of``) the tracker keeps the peak snapshot, so that a
composition of the step (:mod:`cpshard.simulation.step_memory`) can place each segment's peak.

Replay: a model's decoder layers call cpshard's attention with identical arguments (shapes,
strides, dtypes, the step state's key), so a later call of a top-level cpshard op whose
arguments match an earlier one's is not traced through again: its fake kernel makes the outputs
and the earlier call's internal peak (relative to its entry) is applied. A call is only replayed
when the earlier one provably left nothing but its outputs behind and its fake kernel's outputs
match the traced ones storage for storage (checked as it is recorded); the result is the same to
the byte as tracing it (a test compares both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._library.custom_ops import OPDEFS
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _RefType, _TOTAL_KEY, MemTracker
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

# cpshard's custom ops whose outputs are K/V exchanged between ranks (and the gradients sent
# back), or sequence rows moved for head-parallel attention.
EXCHANGE_OPS = frozenset(
    f"cpshard::{name}"
    for name in (
        "kv_halo", "kv_halo_return", "kv_needed_rows", "kv_needed_rows_return", "all_gather_v",
        "reduce_scatter_v", "all_to_all_v", "halo_exchange", "halo_return", "seq_to_heads",
        "heads_to_seq",
    )
)  # fmt: skip

Snapshot = dict[str, int]
# A real (host) tensor argument of up to this many elements is part of a call's signature by
# value; a call with a larger one is never replayed.
_HOST_VALUES = 64
# Ops that read a tensor's metadata (dispatched for a fake tensor's ``.device`` and sizes).
_METADATA_OPS = frozenset(
    op.default for op in (torch.ops.prim.device, torch.ops.aten.sym_size, torch.ops.aten.sym_stride)
    if hasattr(op, "default")
)


class Category(_RefType):
    """torch's memory reference types (same values, so torch's own code finds them: plain
    ``MemTracker``'s and ``FSDPMemTracker``'s) and cpshard's two."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    SHARDED_PARAM = "Sharded Param"
    UNSHARDED_PARAM = "Unsharded Param"
    SHARDED_GRAD = "Sharded Grad"
    UNSHARDED_GRAD = "Unsharded Grad"
    ALL_GATHER = "All Gather"
    REDUCE_SCATTER = "Reduce Scatter"
    FSDP_OPT = "OptState"
    INP = "Inputs"
    KV = "K/V exchange"
    LOSS = "Loss"


@dataclass(frozen=True)
class _Replay:
    """What a traced call left to replay: its peak over its entry by category, and each output
    storage's category (in the outputs' flattened order)."""

    peak_delta: Snapshot
    out_categories: tuple[str, ...]


def _storages(tensors: list[Any]) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in tensors if isinstance(t, torch.Tensor)]


def _signature(args: tuple, kwargs: dict) -> tuple | None:
    """What a call's behaviour can depend on: every tensor's metadata and which arguments share
    storage, every other argument's value (None: an argument that is not plain data)."""
    leaves, spec = tree_flatten((args, kwargs))
    owners: dict[int, int] = {}
    out: list[Any] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if not _is_fake(leaf):  # a host tensor (the state's key): its values
                if leaf.numel() > _HOST_VALUES:
                    return None
                with _disable_current_modes():
                    values = tuple(leaf.flatten().tolist())
                out.append(("host", leaf.dtype, tuple(leaf.shape), values))
                continue
            st = leaf.untyped_storage()
            owner = owners.setdefault(id(st), len(owners))
            out.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, str(leaf.device),
                        leaf.storage_offset(), st.nbytes(), owner, leaf.requires_grad))  # fmt: skip
        elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype)):
            out.append((type(leaf).__name__, leaf))
        else:
            return None
    return tuple(out)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


class _StepTracking:
    """What both trackers add to torch's: the categories, the traced-through ops, the
    per-segment peaks and the replay of repeated calls (see the module)."""

    _curr_mem_snap: dict
    _peak_mem: dict
    _peak_mem_snap: dict
    _WINFO: Any
    _in_opt: bool
    _in_ac: bool
    _mod_tracker: Any

    def _setup(
        self,
        device: torch.device,
        segment_of: Callable[[Any], str],
        loss_module: torch.nn.Module | None,
        replay: bool,
    ) -> None:
        self._ref_class = Category
        self.device = device
        self.segment_of = segment_of
        self.loss_module = loss_module
        self.segment_peaks: dict[str, Snapshot] = {}
        self._forced: Category | None = None
        self._replay_enabled = replay
        self._replays: dict[tuple, _Replay | None] = {}
        self._recording: list[dict[str, Any]] = []

    @property
    def modules(self) -> Any:
        """torch's module tracker (``parents``, ``is_bw``, ``get_known_fqn``)."""
        return self._mod_tracker

    def current(self) -> Snapshot:
        """The bytes held now by category (plus ``Total``) on the traced device."""
        return dict(self._curr_mem_snap.get(self.device, {_TOTAL_KEY: 0}))

    def _in_loss(self) -> bool:
        if self.loss_module is None:
            return False
        name = self._mod_tracker.get_known_fqn(self.loss_module)
        return name is not None and name in self._mod_tracker.parents

    def _category(self) -> Category:
        if self._forced is not None:
            return self._forced
        if self._in_opt:
            return Category.OPT
        if self._in_loss():
            return Category.LOSS
        if self._mod_tracker.is_bw and not self._in_ac:
            return Category.TEMP
        return Category.ACT

    def _track(self, reftype: _RefType, t: torch.Tensor) -> None:
        # what an op made: this step's category, whatever torch's dispatch named
        if t.device == self.device:
            super()._track(self._category(), t)  # type: ignore[misc]

    def _update_peak_stats(self, peak_state: Any) -> None:
        # torch's walks every tracked module's stats at every op; only the step's and the
        # segments' peaks are read here.
        snap = self._curr_mem_snap.get(self.device)
        if snap is None:
            return
        total = snap[_TOTAL_KEY]
        if self._peak_mem.get(self.device, 0) < total:
            self._peak_mem[self.device] = total
            self._peak_mem_snap[self.device] = dict(snap)
        segment = self.segment_of(self)
        seen = self.segment_peaks.get(segment)
        if seen is None or seen[_TOTAL_KEY] < total:
            self.segment_peaks[segment] = dict(snap)
        for rec in self._recording:
            if rec["peak"] is None or rec["peak"][_TOTAL_KEY] < total:
                rec["peak"] = dict(snap)

    def _trace_through(self, func: Any, name: str, args: tuple, kwargs: dict) -> Any:
        """Run cpshard op ``name``'s Python body under this tracker (its inner ops seen), or
        replay an identical earlier call's."""
        top = not self._recording and self._forced is None and self._replay_enabled
        key = (name, self._category(), _signature(args, kwargs)) if top else None
        if key is not None and key[2] is not None and self._replays.get(key) is not None:
            return self._replay(self._replays[key], func, args, kwargs)  # type: ignore[arg-type]
        outer = self._forced
        if name in EXCHANGE_OPS:
            self._forced = Category.KV
        entry = self.current()
        known = {id(st) for st in self._WINFO.keys()} if key is not None else set()
        rec: dict[str, Any] = {"peak": None}
        self._recording.append(rec)
        try:
            with self:  # type: ignore[attr-defined]
                out = OPDEFS[name]._init_fn(*args, **kwargs)
            tree_map_only(torch.Tensor, lambda t: self._track(self._category(), t), out)
        finally:
            self._recording.pop()
            self._forced = outer
        if key is not None and key[2] is not None and key not in self._replays:
            self._replays[key] = self._recorded(func, args, kwargs, out, entry, known, rec)
        return out

    def _recorded(
        self, func: Any, args: tuple, kwargs: dict, out: Any, entry: Snapshot,
        known: set, rec: dict[str, Any],
    ) -> _Replay | None:  # fmt: skip
        """The replay of a call just traced, or None where replaying it would not be exact:
        it left more than its outputs, or its fake kernel's outputs differ from them."""
        outs, spec = tree_flatten(out)
        fakes, fake_spec = tree_flatten(func(*args, **kwargs))
        if spec != fake_spec or len(outs) != len(fakes):
            return None
        stores = _storages(outs)
        if len({id(s) for s in stores}) != len(stores) or any(id(s) in known for s in stores):
            return None  # outputs sharing storage, or one made before the call
        for a, b in zip(outs, fakes, strict=True):
            if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
                return None
            if isinstance(a, torch.Tensor) and (
                (a.shape, a.stride(), a.dtype, a.device, a.storage_offset())
                != (b.shape, b.stride(), b.dtype, b.device, b.storage_offset())
                or a.untyped_storage().nbytes() != b.untyped_storage().nbytes()
            ):
                return None
        now = self.current()
        categories = []
        left: Snapshot = {}
        for st in stores:
            winfo = self._WINFO.get(st, (None, None))[0]
            if winfo is None:
                categories.append("")
                continue
            categories.append(winfo.reftype.value)
            left[winfo.reftype.value] = left.get(winfo.reftype.value, 0) + winfo.mem_consumed
        left[_TOTAL_KEY] = sum(left.values())
        net = {str(getattr(k, "value", k)): now.get(k, 0) - entry.get(k, 0) for k in {*now, *entry}}
        if {k: v for k, v in net.items() if v} != {k: v for k, v in left.items() if v}:
            return None  # the call left something besides its outputs (a cache, a buffer)
        peak = rec["peak"] if rec["peak"] is not None else now
        delta = {k: peak.get(k, 0) - entry.get(k, 0) for k in set(peak) | set(entry)}
        return _Replay({str(getattr(k, "value", k)): v for k, v in delta.items()}, tuple(categories))

    def _replay(self, replay: _Replay, func: Any, args: tuple, kwargs: dict) -> Any:
        """An identical earlier call's effect: its peak over the entry, then its outputs (made
        by the op's fake kernel) tracked in their recorded categories."""
        snap = self._curr_mem_snap.setdefault(self.device, dict.fromkeys(Category, 0))
        snap.setdefault(_TOTAL_KEY, 0)
        for k, v in replay.peak_delta.items():
            snap[k] = snap.get(k, 0) + v
        self._update_peak_stats(None)
        for k, v in replay.peak_delta.items():
            snap[k] -= v
        out = func(*args, **kwargs)
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        for t, category in zip(tensors, replay.out_categories, strict=True):
            if category:
                MemTracker._track(self, Category(category), t)  # type: ignore[arg-type]
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _METADATA_OPS:  # a tensor's device or size: nothing allocated
            return func(*args, **(kwargs or {}))
        name = func._schema.name
        if name.startswith("cpshard::") and name in OPDEFS:
            return self._trace_through(func, name, args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)  # type: ignore[misc]


class StepTracker(_StepTracking, MemTracker):
    """A :class:`MemTracker` of one training step on ``device`` that traces cpshard's custom ops
    through, reports :class:`Category`, and keeps per-segment peaks. ``segment_of(tracker)``
    names the segment the step is in at each op; ``loss_module``: the module whose forward and
    backward allocations count as ``LOSS``; ``replay``: replay repeated identical calls of
    cpshard's ops (see the module)."""

    def __init__(
        self,
        device: torch.device,
        segment_of: Callable[[Any], str],
        loss_module: torch.nn.Module | None = None,
        replay: bool = True,
    ) -> None:
        MemTracker.__init__(self)
        self._setup(device, segment_of, loss_module, replay)


class FSDPStepTracker(_StepTracking, FSDPMemTracker):
    """:class:`StepTracker` for a step sharded by FSDP2: torch's ``FSDPMemTracker`` of the root
    ``step`` and optimizer ``opt`` (which names the sharded and unsharded parameters and
    gradients and the all-gather and reduce-scatter buffers), with the same additions."""

    def __init__(
        self,
        device: torch.device,
        segment_of: Callable[[Any], str],
        step: torch.nn.Module,
        opt: torch.optim.Optimizer | None,
        loss_module: torch.nn.Module | None = None,
        replay: bool = True,
    ) -> None:
        FSDPMemTracker.__init__(self, step, opt)
        self._setup(device, segment_of, loss_module, replay)
