"""torch's ``MemTracker`` with the categories a CP step's memory is reported in, and cpshard's
custom ops traced through.

torch's tracker sees the outputs of every op dispatched under it. cpshard's attention and
exchange ops are opaque custom ops whose fake kernels return only their outputs, so their
internal buffers (the K/V buffer an exchange builds, the kernels' workspace, the gradients sent
back) would be missed: :class:`StepTracker` runs each one's own Python body instead, under
itself, so every allocation of the op is seen (the collectives inside run on the fake process
group, whose fake kernels allocate what the real ones return).

Categories: torch's (parameters, buffers, gradients, optimizer state, activations = made in the
forward, temporaries = made in the backward, other = external tensors) plus ``KV`` (made by a
K/V exchange op: the buffers a rank receives and sends, forward and backward) and ``LOSS`` (made
inside the loss module, forward and backward). Only tensors on the traced device count (the
``meta`` tensors cpshard makes to read a layout hold no memory).

Per segment of the step (:meth:`StepTracker.segment_of`) it keeps the peak snapshot, so that a
composition of the step (:mod:`cpshard.simulation.step_memory`) can place each segment's peak.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._library.custom_ops import OPDEFS
from torch.distributed._tools.mem_tracker import _RefType, _TOTAL_KEY, MemTracker
from torch.utils._pytree import tree_map_only

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
# Ops that read a tensor's metadata (dispatched for a fake tensor's ``.device`` and sizes).
_METADATA_OPS = frozenset(
    op.default for op in (torch.ops.prim.device, torch.ops.aten.sym_size, torch.ops.aten.sym_stride)
    if hasattr(op, "default")
)


class Category(_RefType):
    """torch's memory reference types (same values, so torch's own code finds them) and
    cpshard's two."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    KV = "K/V exchange"
    LOSS = "Loss"


class StepTracker(MemTracker):
    """A :class:`MemTracker` of one training step on ``device`` that traces cpshard's custom ops
    through, reports :class:`Category`, and keeps per-segment peaks. ``segment_of(tracker)``
    names the segment the step is in at each op; ``loss_module``: the module whose forward and
    backward allocations count as ``LOSS``."""

    def __init__(
        self,
        device: torch.device,
        segment_of: Callable[[StepTracker], str],
        loss_module: torch.nn.Module | None = None,
    ) -> None:
        super().__init__()
        self._ref_class = Category
        self.device = device
        self.segment_of = segment_of
        self.loss_module = loss_module
        self.segment_peaks: dict[str, Snapshot] = {}
        self._forced: Category | None = None

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
        if t.device == self.device:
            super()._track(reftype, t)

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

    def _trace_through(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Run cpshard op ``name``'s Python body under this tracker (its inner ops seen)."""
        outer = self._forced
        if name in EXCHANGE_OPS:
            self._forced = Category.KV
        try:
            with self:
                out = OPDEFS[name]._init_fn(*args, **kwargs)
            tree_map_only(torch.Tensor, lambda t: self._track(self._category(), t), out)
            return out
        finally:
            self._forced = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _METADATA_OPS:  # a tensor's device or size: nothing allocated
            return func(*args, **(kwargs or {}))
        name = func._schema.name
        if name.startswith("cpshard::") and name in OPDEFS:
            return self._trace_through(name, args, kwargs or {})
        res = func(*args, **(kwargs or {}))
        category = self._category()
        tree_map_only(torch.Tensor, lambda t: self._track(category, t), res)
        self._update_peak_stats(None)
        return res
