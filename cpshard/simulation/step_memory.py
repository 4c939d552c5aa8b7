"""Each simulated rank's peak memory of a CP training step, predicted in this process.

Method: the real step (:mod:`cpshard.simulation.training_step`) on torch's fake process group
as rank r of W, the batch sharded by cpshard's sharder for rank r, the model built under
``FakeTensorMode`` (no real weights), tracked by torch's ``MemTracker``
(:class:`~cpshard.simulation.memory_tracker.StepTracker`, which also traces cpshard's custom
ops through) or, with FSDP2, torch's ``FSDPMemTracker`` (:class:`~cpshard.simulation.
memory_tracker.FSDPStepTracker`: the model really ``fully_shard``-ed over the fake group, its
all-gathers and reduce-scatters the fake kernels' buffers). The step is that of a later step of
a job: the optimizer's state exists, the gradients do not yet, the attention's host views are
placed at the setup, and the model has passed the guard's audit.

Scale: the decoder's layers are identical, so a rank traces a model of a few layers
(:func:`traced_layers`: embeddings, two decoder layers, final norm, head and loss; three with
FSDP2, whose backward prefetches the next layer's parameters, so that the repeated layer is one
with a layer on either side) and the step of ``N`` layers is composed from it: the second layer's
forward is repeated ``N - T + 1`` times, each repetition adding what one layer keeps for its
backward (the difference of the first two layers' post-forward snapshots), and likewise its
backward (each frees its activations and adds its gradients: the difference of the last two
layers' post-backward snapshots); every later segment is shifted by those ``N - T`` extra
layers, and every point by their parameters and optimizer state. A segment's peak, shifted, is
the composed step's peak over that segment (a repetition's offset is the same for every point of
it, so the maximum over repetitions is its first or last). The optimizer step is traced on the
traced model with every gradient present and composed likewise: each further layer adds its
parameters, gradients and state (torch's CPU step updates one parameter at a time, so its
temporaries are the largest parameter's), plus what the rank still holds after its backward.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModState
from torch.distributed._tools.mem_tracker import _ModState, _TOTAL_KEY

from cpshard.attention import state as states
from cpshard.guard.models import assume_verified
from cpshard.planning.head_parallel import head_parallel_kinds
from cpshard.sharder import ContextParallelSharder
from cpshard.simulation.fake_rank import simulated_rank
from cpshard.simulation.memory_tracker import Category, FSDPStepTracker, Snapshot, StepTracker
from cpshard.simulation.step_loss import LOSSES, LossModule
from cpshard.simulation.training_step import (
    CausalStep,
    StepSpec,
    build_model,
    decoder_layers,
    forward_backward,
    fully_shard_step,
    make_optimizer,
    packed_batch,
    world_mesh,
)

TRACED_LAYERS = 2
FSDP_TRACED_LAYERS = 3
DEVICE = torch.device("cpu")

# Report categories -> torch's / cpshard's reference types they sum.
CATEGORIES: dict[str, tuple[Category, ...]] = {
    "parameters": (Category.PARAM, Category.BUFFER, Category.SHARDED_PARAM),
    "gradients": (Category.GRAD, Category.SHARDED_GRAD),
    "optimizer": (Category.OPT, Category.FSDP_OPT),
    "fsdp_gathered": (Category.UNSHARDED_PARAM, Category.ALL_GATHER),
    "fsdp_reduced": (Category.UNSHARDED_GRAD, Category.REDUCE_SCATTER),
    "activations": (Category.ACT, Category.INP),
    "kv_exchange": (Category.KV,),
    "loss": (Category.LOSS,),
    "temporaries": (Category.TEMP, Category.OTH),
}
# What a layer's backward leaves per layer besides its activations' release: its gradients.
_GRADIENTS = (Category.GRAD.value, Category.SHARDED_GRAD.value)
# What a rank holds at its optimizer step besides what the optimizer's trace holds (parameters,
# buffers, gradients, state): the rest of the backward's end.
_HELD = frozenset(
    c.value for c in (
        Category.PARAM, Category.BUFFER, Category.GRAD, Category.OPT, Category.SHARDED_PARAM,
        Category.SHARDED_GRAD, Category.FSDP_OPT,
    )
) | {_TOTAL_KEY}  # fmt: skip


def traced_layers(spec: StepSpec) -> int:
    """Decoder layers a rank traces: :data:`TRACED_LAYERS`, or :data:`FSDP_TRACED_LAYERS` with
    FSDP2 (a repeated layer with a prefetching neighbour on either side)."""
    return FSDP_TRACED_LAYERS if spec.fsdp else TRACED_LAYERS


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
    """What one rank's traced step of a few layers gives the composition."""

    peaks: dict[str, Snapshot]  # per segment
    post_forward: tuple[Snapshot, ...]  # after each traced layer's forward
    post_backward: tuple[Snapshot, ...]  # after each traced layer's backward
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


def _segmenter(layers: torch.nn.ModuleList, traced: int) -> Callable[[Any], str]:
    """The step's segment at the tracker's current op: ``embedding``, ``layer i forward``,
    ``head and loss`` (the loss's backward included), ``layer i backward``, ``embedding
    backward`` (what :func:`compose` places)."""
    seen = {"forward": False, "backward": False}

    def segment(tracker: Any) -> str:
        mods = tracker.modules
        for i in range(traced):
            name = mods.get_known_fqn(layers[i])
            if name is not None and name in mods.parents:
                phase = "backward" if mods.is_bw else "forward"
                seen[phase] = True
                return f"layer {i} {phase}"
        if not seen["forward"]:
            return "embedding"
        return "head and loss" if not seen["backward"] else "embedding backward"

    return segment


def _bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage (a DTensor's: its local shard's)."""
    local = getattr(t, "_local_tensor", t)
    return local.untyped_storage().nbytes()


def _optimizer_bytes(opt: torch.optim.Optimizer | None, params: list[torch.Tensor]) -> int:
    if opt is None:
        return 0
    return sum(
        _bytes(v)
        for p in params
        for v in opt.state.get(p, {}).values()
        if isinstance(v, torch.Tensor)
    )


def trace_rank(
    mode: FakeTensorMode,
    step: CausalStep,
    opt: torch.optim.Optimizer | None,
    local: Any,
    ctx: Callable[[], Any],
    fsdp: bool = False,
    replay: bool = True,
) -> LayerTrace:
    """Trace one forward and backward of ``step`` (fake, a few decoder layers; ``fsdp``: sharded
    by :func:`~cpshard.simulation.training_step.fully_shard_step`) on this rank's sharded batch
    ``local`` inside its CP context ``ctx`` (``replay``: the later layers' identical attention
    calls replayed, not traced again)."""
    layers = decoder_layers(step.base)
    segment = _segmenter(layers, len(layers))
    if fsdp:
        tracker: Any = FSDPStepTracker(DEVICE, segment, step, opt, step.loss, replay)
        forward_state, backward_state = _FSDPModState.AFT_POST_FW, _FSDPModState.AFT_POST_BW
    else:
        tracker = StepTracker(DEVICE, segment, step.loss, replay)
        tracker.track_external(step, *(() if opt is None else (opt,)))
        forward_state, backward_state = _ModState.POST_FW, _ModState.POST_BW
    with mode, tracker:
        forward_backward(step, local, ctx, mode.from_tensor)
        end = _plain(tracker.current())
    stats = [tracker.memory_tracking[layer].snapshots for layer in layers]

    def at(i: int, state: Any) -> Snapshot:
        return _plain(stats[i][state][0][DEVICE])

    params = list(layers[1].parameters())
    param_key, opt_key = (
        (Category.SHARDED_PARAM, Category.FSDP_OPT) if fsdp else (Category.PARAM, Category.OPT)
    )
    static = {
        param_key.value: sum(_bytes(p) for p in params),
        opt_key.value: _optimizer_bytes(opt, params),
    }
    static[_TOTAL_KEY] = sum(static.values())
    for p in step.parameters():
        p.grad = None
    return LayerTrace(
        peaks={k: _plain(v) for k, v in tracker.segment_peaks.items()},
        post_forward=tuple(at(i, forward_state) for i in range(len(layers))),
        post_backward=tuple(at(i, backward_state) for i in range(len(layers))),
        end=end,
        layer_static=static,
    )


def compose(
    trace: LayerTrace, layers: int, optimizer_peak: Snapshot | None
) -> tuple[Snapshot, str]:
    """The peak snapshot of the ``layers``-layer step and the segment it is in (see the module);
    ``optimizer_peak``: the traced model's optimizer step (None: no optimizer)."""
    traced = len(trace.post_forward)
    n = layers - traced
    if n < 0:
        raise ValueError(f"--layers: the composition needs >= {traced} layers, got {layers}")
    fwd = _add(trace.post_forward[1], trace.post_forward[0], times=(1, -1))
    bwd = _add(trace.post_backward[traced - 2], trace.post_backward[traced - 1], times=(1, -1))
    up = lambda d: n if _total(d) > 0 else 0  # noqa: E731 -- the repetition at the maximum
    shift = {
        "embedding": ((fwd, 0), (bwd, 0)),
        "head and loss": ((fwd, n), (bwd, 0)),
        "embedding backward": ((fwd, n), (bwd, n)),
    }
    for i in range(traced):
        shift[f"layer {i} forward"] = ((fwd, 0 if i == 0 else up(fwd) if i == 1 else n), (bwd, 0))
        shift[f"layer {i} backward"] = ((fwd, n), (bwd, n if i == 0 else up(bwd) if i == 1 else 0))
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
        held = {k: v for k, v in trace.end.items() if k not in _HELD}
        grads = {k: bwd.get(k, 0) for k in _GRADIENTS}
        snap = _add(optimizer_peak, held, trace.layer_static, grads, times=(1, 1, n, n))
        snap[_TOTAL_KEY] = sum(v for k, v in snap.items() if k != _TOTAL_KEY)
        if _total(snap) > _total(best[0]):
            best = (snap, "optimizer step")
    return best


def optimizer_peak(
    mode: FakeTensorMode, model: torch.nn.Module, opt: torch.optim.Optimizer | None
) -> Snapshot | None:
    """The peak of ``opt``'s step over the traced ``model`` (fake) with every gradient present:
    its parameters, gradients, state and the step's temporaries; None without an optimizer.
    The gradients are dropped after."""
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


def later_step_views(strategy: str, mesh: tuple[int, int] | None, packing: bool = True) -> None:
    """Mark the attention's host views as read by an earlier step, so the sharder's setup makes
    and places them (outside the traced step) as a job's later steps do. ``packing``: the varlen
    packing too (on CPU only the explicit kernel of soft-capped logits reads it: see
    :func:`reads_packing`; made for a step that never reads it, it costs the setup the most
    time and changes no figure)."""
    states.seen_views.update({"blocks", "needed_rows"})
    states.seen_views.update(head_parallel_kinds(strategy, mesh))
    if packing:
        states.seen_views.add("packing")
    else:
        states.seen_views.discard("packing")


def reads_packing(spec: StepSpec) -> bool:
    """Whether the traced (CPU) step's attention reads the varlen packing: where its logits are
    soft-capped (the explicit kernel, varlen in chunks); the CPU flash kernel's loop does not."""
    text = spec.config.get_text_config()
    return getattr(text, "attn_logit_softcapping", None) is not None


@dataclass
class _Model:
    """A traced model (fake): the causal LM, its primed optimizer and that optimizer's step."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer | None
    optimizer_peak: Snapshot | None


class Predictor:
    """Predicts ranks' peaks for the steps of one :class:`StepSpec`. Replicated, the fake
    traced model, its primed optimizer and its optimizer step are made once and serve every
    rank, batch and layout; with FSDP2 each simulated rank shards its own over its fake group.
    ``replay``: repeated attention calls replayed, not traced again (the same result)."""

    def __init__(self, spec: StepSpec, replay: bool = True) -> None:
        self.traced = traced_layers(spec)
        if spec.layers < self.traced:
            raise ValueError(f"--layers: needs >= {self.traced}, got {spec.layers}")
        self.spec = spec
        self.replay = replay
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.shared = None if spec.fsdp else self._built(None, None)[0]

    def _built(self, group: Any, mesh: Any) -> tuple[_Model, CausalStep | None]:
        """A fresh traced model, and (``group`` given) its step with the loss over ``group``,
        sharded over ``mesh`` (None: replicated)."""
        spec = self.spec
        with self.mode:
            model = build_model(spec, self.traced)
            step = None
            if group is not None:
                step = self._step(model, group)
                if mesh is not None:
                    fully_shard_step(step, mesh)
            opt = make_optimizer(spec, model if step is None else step)
        assume_verified(model)
        return _Model(model, opt, optimizer_peak(self.mode, model, opt)), step

    def _step(self, model: torch.nn.Module, group: Any) -> CausalStep:
        loss = LossModule(model.get_output_embeddings(), LOSSES[self.spec.loss], group)
        step = CausalStep(model, loss)
        assume_verified(step)
        return step

    def ranks(
        self,
        world: int,
        ranks: list[int],
        layout: str,
        strategy: str,
        doc_ids: torch.Tensor,
        mesh: tuple[int, int] | None = None,
        progress: Callable[[int, RankMemory], None] | None = None,
        jobs: int = 1,
    ) -> list[RankMemory]:
        """Every rank of ``ranks``' predicted peak for one step of the ``[1, S]`` packed batch
        of documents ``doc_ids`` sharded as ``layout`` (``progress(done, rank's figures)``
        after each, in the order they finish). ``jobs`` > 1: ranks traced in that many forked
        processes at once (each rank's trace is its own: the same figures as one process)."""
        spec = self.spec
        if jobs < 1:
            raise ValueError(f"--jobs: must be >= 1, got {jobs}")
        batch = packed_batch(doc_ids, int(spec.config.vocab_size))
        packing = reads_packing(spec)
        later_step_views(strategy, mesh, packing)
        job = _Job(world, layout, strategy, batch, mesh, packing)
        jobs = min(jobs, len(ranks))
        if jobs > 1 and "fork" in mp.get_all_start_methods():
            return self._forked(job, ranks, jobs, progress)
        out: list[RankMemory] = []
        for rank in ranks:
            out.append(self.rank(job, rank))
            if progress is not None:
                progress(len(out), out[-1])
        return out

    def rank(self, job: _Job, rank: int) -> RankMemory:
        """``rank``'s predicted peak for ``job``."""
        spec = self.spec
        start = time.perf_counter()
        with simulated_rank(rank, job.world, job.mesh, spec.dp_shard) as group:
            sharder = ContextParallelSharder(group, job.layout, strategy=job.strategy)
            ctx, local = sharder.shard(job.batch)
            if self.shared is not None:
                built, step = self.shared, self._step(self.shared.model, group)
            else:
                built, step = self._built(group, world_mesh())
            assert step is not None
            trace = trace_rank(self.mode, step, built.opt, local, ctx, spec.fsdp, self.replay)
        if not job.packing and "packing" in states.seen_views:
            raise RuntimeError(
                "--model: the traced step read the attention's varlen packing, which "
                "reads_packing said it would not (its setup did not make it): no prediction"
            )
        snap, at = compose(trace, spec.layers, built.optimizer_peak)
        seconds = time.perf_counter() - start
        return RankMemory(rank, _total(snap), by_category(snap), at, seconds)

    def _forked(
        self,
        job: _Job,
        ranks: list[int],
        jobs: int,
        progress: Callable[[int, RankMemory], None] | None,
    ) -> list[RankMemory]:
        """:meth:`rank` of each of ``ranks`` in a pool of ``jobs`` forked processes (each
        inherits this predictor; one thread each, so no OpenMP pool crosses the fork)."""
        global _FORKED
        _FORKED = (self, job)
        found: dict[int, RankMemory] = {}
        try:
            context = mp.get_context("fork")
            with context.Pool(jobs, _start_tracer, (os.getpid(),)) as pool:
                for m in pool.imap_unordered(_rank_in_child, ranks):
                    found[m.rank] = m
                    if progress is not None:
                        progress(len(found), m)
        finally:
            _FORKED = None
        return [found[r] for r in ranks]


@dataclass(frozen=True)
class _Job:
    """One step to predict for each rank: the CP job and its packed batch."""

    world: int
    layout: str
    strategy: str
    batch: dict[str, torch.Tensor]
    mesh: tuple[int, int] | None
    packing: bool


# The predictor and job a forked pool's processes trace ranks of (set only while it runs).
_FORKED: tuple[Predictor, _Job] | None = None


def _start_tracer(parent: int) -> None:
    """A forked tracer's start: one thread, and (on Linux) ended by its parent's death, so a
    ``cpshard plan`` killed by a signal it cannot catch leaves no tracer running."""
    torch.set_num_threads(1)
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request was made
            os._exit(1)


def _rank_in_child(rank: int) -> RankMemory:
    assert _FORKED is not None, "a forked process inherits the predictor"
    predictor, job = _FORKED
    return predictor.rank(job, rank)
