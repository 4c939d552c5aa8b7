"""Each simulated rank's peak memory of a CP training step, predicted in this process.

Method: the real step (:mod:`cpshard.simulation.training_step`) on torch's fake process group
as rank r of W, the batch sharded by cpshard's sharder for rank r, the model built under
``FakeTensorMode`` (no real weights), tracked by torch's ``MemTracker``
(:class:`~cpshard.simulation.memory_tracker.StepTracker`, which also traces cpshard's custom
ops through). The step is that of a later step of a job: the optimizer's state exists, the
gradients do not yet, the attention's host views are placed at the setup, and the model has
passed the guard's audit.

Scale: the decoder's layers are identical, so a rank traces a model of :data:`TRACED_LAYERS`
layers (embeddings, two decoder layers, final norm, head and loss) and the step of ``N`` layers
is composed from it: the second layer's forward is repeated ``N - 1`` times, each repetition
adding what one layer keeps for its backward (the difference of the two layers' post-forward
snapshots), and likewise its backward (each frees its activations and adds its gradients);
every later segment is shifted by those ``N - 2`` extra layers, and every point by their
parameters and optimizer state. A segment's peak, shifted, is the composed step's peak over
that segment (a repetition's offset is the same for every point of it, so the maximum over
repetitions is its first or last). The optimizer step is traced once on the traced model with
every gradient present (alike on every rank) and composed likewise: each further layer adds its
parameters, gradients and state (torch's CPU step updates one parameter at a time, so its
temporaries are the largest parameter's), plus what the rank still holds after its backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _ModState, _TOTAL_KEY

from cpshard.attention import state as states
from cpshard.guard.models import assume_verified
from cpshard.planning.head_parallel import head_parallel_kinds
from cpshard.sharder import ContextParallelSharder
from cpshard.simulation.fake_rank import simulated_rank
from cpshard.simulation.memory_tracker import Category, Snapshot, StepTracker
from cpshard.simulation.step_loss import LOSSES, LossModule
from cpshard.simulation.training_step import (
    StepSpec,
    build_model,
    decoder_layers,
    forward_backward,
    make_optimizer,
    packed_batch,
)

TRACED_LAYERS = 2
DEVICE = torch.device("cpu")

# Report categories -> torch's / cpshard's reference types they sum.
CATEGORIES: dict[str, tuple[Category, ...]] = {
    "parameters": (Category.PARAM, Category.BUFFER),
    "gradients": (Category.GRAD,),
    "optimizer": (Category.OPT,),
    "activations": (Category.ACT,),
    "kv_exchange": (Category.KV,),
    "loss": (Category.LOSS,),
    "temporaries": (Category.TEMP, Category.OTH),
}


@dataclass(frozen=True)
class RankMemory:
    """Rank ``rank``'s predicted peak: bytes by :data:`CATEGORIES`, the segment where it
    happens, and the seconds its trace took."""

    rank: int
    peak_bytes: int
    by_category: dict[str, int]
    at: str
    trace_s: float


@dataclass(frozen=True)
class LayerTrace:
    """What one rank's traced step of :data:`TRACED_LAYERS` layers gives the composition."""

    peaks: dict[str, Snapshot]  # per segment
    post_forward: tuple[Snapshot, Snapshot]  # after each traced layer's forward
    post_backward: tuple[Snapshot, Snapshot]  # after each traced layer's backward
    end: Snapshot  # after the backward
    layer_static: Snapshot  # one layer's parameters and optimizer state


def _plain(snap: dict[Any, int]) -> Snapshot:
    return {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}


def _add(*snaps: Snapshot, times: tuple[int, ...] | None = None) -> Snapshot:
    out: Snapshot = {}
    for i, snap in enumerate(snaps):
        k = 1 if times is None else times[i]
        for key, value in snap.items():
            out[key] = out.get(key, 0) + k * value
    return out


def _total(snap: Snapshot) -> int:
    return snap.get(_TOTAL_KEY, 0)


def by_category(snap: Snapshot) -> dict[str, int]:
    """``snap`` (torch's reference types) summed into :data:`CATEGORIES`."""
    return {name: sum(snap.get(c.value, 0) for c in kinds) for name, kinds in CATEGORIES.items()}


def _segmenter(layers: torch.nn.ModuleList) -> Callable[[StepTracker], str]:
    """The step's segment at the tracker's current op: ``embedding``, ``layer i forward``,
    ``head and loss`` (the loss's backward included), ``layer i backward``, ``embedding
    backward`` (what :func:`compose` places)."""
    seen = {"forward": False, "backward": False}

    def segment(tracker: StepTracker) -> str:
        mods = tracker.modules
        for i in range(TRACED_LAYERS):
            name = mods.get_known_fqn(layers[i])
            if name is not None and name in mods.parents:
                phase = "backward" if mods.is_bw else "forward"
                seen[phase] = True
                return f"layer {i} {phase}"
        if not seen["forward"]:
            return "embedding"
        return "head and loss" if not seen["backward"] else "embedding backward"

    return segment


def _optimizer_bytes(opt: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> int:
    if opt is None:
        return 0
    return sum(
        v.untyped_storage().nbytes()
        for p in params
        for v in opt.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    )


def trace_rank(
    mode: FakeTensorMode,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer | None,
    loss_module: LossModule,
    local: Any,
    ctx: Callable[[], Any],
) -> LayerTrace:
    """Trace one forward and backward of the :data:`TRACED_LAYERS`-layer ``model`` (fake) on
    this rank's sharded batch ``local`` inside its CP context ``ctx``."""
    layers = decoder_layers(model)
    tracker = StepTracker(DEVICE, _segmenter(layers), loss_module)
    tracker.track_external(model, *(() if opt is None else (opt,)))
    with mode, tracker:
        forward_backward(model, loss_module, local, ctx, mode.from_tensor)
        end = _plain(tracker.current())
    stats = [tracker.memory_tracking[layer].snapshots for layer in layers]

    def at(i: int, state: _ModState) -> Snapshot:
        return _plain(stats[i][state][0][DEVICE])

    params = list(layers[1].parameters())
    static = {
        Category.PARAM.value: sum(p.untyped_storage().nbytes() for p in params),
        Category.OPT.value: _optimizer_bytes(opt, params),
    }
    static[_TOTAL_KEY] = sum(static.values())
    for p in model.parameters():
        p.grad = None
    return LayerTrace(
        peaks={k: _plain(v) for k, v in tracker.segment_peaks.items()},
        post_forward=(at(0, _ModState.POST_FW), at(1, _ModState.POST_FW)),
        post_backward=(at(0, _ModState.POST_BW), at(1, _ModState.POST_BW)),
        end=end,
        layer_static=static,
    )


def compose(
    trace: LayerTrace, layers: int, optimizer_peak: Snapshot | None
) -> tuple[Snapshot, str]:
    """The peak snapshot of the ``layers``-layer step and the segment it is in (see the module);
    ``optimizer_peak``: the traced model's optimizer step (None: no optimizer)."""
    n = layers - TRACED_LAYERS
    if n < 0:
        raise ValueError(f"--layers: the composition needs >= {TRACED_LAYERS} layers, got {layers}")
    fwd = _add(trace.post_forward[1], trace.post_forward[0], times=(1, -1))
    bwd = _add(trace.post_backward[0], trace.post_backward[1], times=(1, -1))
    up = lambda d: n if _total(d) > 0 else 0  # noqa: E731 -- the repetition at the maximum
    shift = {
        "embedding": ((fwd, 0), (bwd, 0)),
        "layer 0 forward": ((fwd, 0), (bwd, 0)),
        "layer 1 forward": ((fwd, up(fwd)), (bwd, 0)),
        "head and loss": ((fwd, n), (bwd, 0)),
        "layer 1 backward": ((fwd, n), (bwd, up(bwd))),
        "layer 0 backward": ((fwd, n), (bwd, n)),
        "embedding backward": ((fwd, n), (bwd, n)),
    }
    best: tuple[Snapshot, str] | None = None
    for segment, peak in trace.peaks.items():
        (df, i), (db, j) = shift[segment]
        snap = _add(peak, df, db, trace.layer_static, times=(1, i, j, n))
        if best is None or _total(snap) > _total(best[0]):
            best = (snap, segment)
    assert best is not None
    if optimizer_peak is not None:
        # After its backward a layer holds only its gradients: what the traced step holds
        # besides parameters, gradients and state at its end is what N layers hold.
        held = {k: v for k, v in trace.end.items() if k in _RESIDUE}
        grads = {Category.GRAD.value: bwd.get(Category.GRAD.value, 0)}
        snap = _add(optimizer_peak, held, trace.layer_static, grads, times=(1, 1, n, n))
        snap[_TOTAL_KEY] = sum(v for k, v in snap.items() if k != _TOTAL_KEY)
        if _total(snap) > _total(best[0]):
            best = (snap, "optimizer step")
    return best


# What a rank still holds when its optimizer steps, besides parameters, gradients and state.
_RESIDUE = {
    c.value for c in (Category.ACT, Category.TEMP, Category.KV, Category.LOSS, Category.OTH)
}


def optimizer_peak(
    mode: FakeTensorMode, model: torch.nn.Module, opt: torch.optim.Optimizer | None
) -> Snapshot | None:
    """The peak of ``opt``'s step over the traced ``model`` (fake) with every gradient present:
    its parameters, gradients, state and the step's temporaries (alike on every rank); None
    without an optimizer. The gradients are dropped after."""
    if opt is None:
        return None
    with mode:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    tracker = StepTracker(DEVICE, lambda _: "optimizer step")
    tracker.track_external(model, opt)
    with mode, tracker:
        opt.step()
    for p in model.parameters():
        p.grad = None
    return _plain(tracker.get_tracker_snapshot("peak")[DEVICE])


def later_step_views(strategy: str, mesh: tuple[int, int] | None) -> None:
    """Mark the attention's host views as read by an earlier step, so the sharder's setup makes
    and places them (outside the traced step) as a job's later steps do."""
    states.seen_views.update({"blocks", "packing", "needed_rows"})
    states.seen_views.update(head_parallel_kinds(strategy, mesh))


class Predictor:
    """Predicts ranks' peaks for the steps of one :class:`StepSpec`: the fake
    :data:`TRACED_LAYERS`-layer model, its primed optimizer and the full model's optimizer
    step are made once and serve every rank, batch and layout."""

    def __init__(self, spec: StepSpec) -> None:
        if spec.layers < TRACED_LAYERS:
            raise ValueError(f"--layers: needs >= {TRACED_LAYERS}, got {spec.layers}")
        self.spec = spec
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        with self.mode:
            self.model = build_model(spec, TRACED_LAYERS)
            self.opt = make_optimizer(spec, self.model)
        assume_verified(self.model)
        self.optimizer_peak = optimizer_peak(self.mode, self.model, self.opt)

    def ranks(
        self,
        world: int,
        ranks: list[int],
        layout: str,
        strategy: str,
        doc_ids: torch.Tensor,
        mesh: tuple[int, int] | None = None,
        progress: Callable[[int, RankMemory], None] | None = None,
    ) -> list[RankMemory]:
        """Every rank of ``ranks``' predicted peak for one step of the ``[1, S]`` packed batch
        of documents ``doc_ids`` sharded as ``layout`` (``progress(done, rank's figures)``
        after each)."""
        spec = self.spec
        batch = packed_batch(doc_ids, int(spec.config.vocab_size))
        later_step_views(strategy, mesh)
        out: list[RankMemory] = []
        for rank in ranks:
            start = time.perf_counter()
            with simulated_rank(rank, world, mesh) as group:
                sharder = ContextParallelSharder(group, layout, strategy=strategy)
                ctx, local = sharder.shard(batch)
                head = self.model.get_output_embeddings()
                loss_module = LossModule(head, LOSSES[spec.loss], group)
                assume_verified(loss_module)
                trace = trace_rank(self.mode, self.model, self.opt, loss_module, local, ctx)
            snap, at = compose(trace, spec.layers, self.optimizer_peak)
            seconds = time.perf_counter() - start
            out.append(RankMemory(rank, _total(snap), by_category(snap), at, seconds))
            if progress is not None:
                progress(len(out), out[-1])
        return out
