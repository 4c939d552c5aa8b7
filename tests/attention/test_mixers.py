"""The refusal of token mixers CP attention does not shard (:mod:`cpshard.attention.mixers`):
what counts as one, that a model with one raises naming it (once per model, nothing computed),
that a model without one is walked once and then passes, and that nothing is checked outside a
CP attention context."""

from __future__ import annotations

import pytest
import torch

from cpshard.attention import activated, mixers, step_state
from cpshard.layouts import make_layout


class _Solo:  # the one rank of a world-2 group whose state is planned (no communication)
    world, rank, name = 2, 1, "solo"


def _context():
    doc = torch.tensor([[1] * 6 + [2] * 6])
    return activated(step_state(_Solo(), make_layout("contiguous", 2, 12), doc))


class GatedDeltaNetLike(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(1)


class _Model(torch.nn.Module):
    def __init__(self, mixer: torch.nn.Module | None) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), mixer or torch.nn.Identity())
        self.ran = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ran += 1
        return self.block(self.proj(x))


def test_what_is_a_token_mixer() -> None:
    assert mixers.mixer_problem(torch.nn.Conv1d(4, 4, 3)) is not None
    assert mixers.mixer_problem(torch.nn.Conv1d(4, 4, 1)) is None  # a per-token projection
    assert mixers.mixer_problem(torch.nn.Conv3d(3, 4, 2)) is None  # image patches
    assert mixers.mixer_problem(torch.nn.LSTM(4, 4)) is not None
    assert mixers.mixer_problem(GatedDeltaNetLike()) is not None
    assert mixers.mixer_problem(torch.nn.Linear(4, 4)) is None


@pytest.mark.parametrize("mixer", [torch.nn.Conv1d(6, 6, 3, padding=1), GatedDeltaNetLike()])
def test_a_model_with_a_mixer_raises_before_running(mixer: torch.nn.Module) -> None:
    model = _Model(mixer)
    x = torch.randn(1, 6, 4)
    with _context(), pytest.raises(ValueError, match=r"rank 1: _Model .* module 'block.1'"):
        model(x)
    assert model.ran == 0
    model(x)  # outside CP: runs
    assert model.ran == 1


def test_models_without_mixers_are_walked_once(monkeypatch) -> None:
    walks = []
    real = mixers._walk
    monkeypatch.setattr(mixers, "_walk", lambda m: walks.append(m) or real(m))
    model = _Model(None)
    with _context():
        for _ in range(3):
            model(torch.randn(1, 6, 4))
    assert walks == [model]


def test_marked_modules_are_skipped() -> None:
    tower = torch.nn.Sequential(torch.nn.Conv1d(4, 4, 3))
    tower.cpshard_not_sequence = True
    model = _Model(tower)
    with _context():
        mixers.check_model(model)  # no error: the marked subtree is not the sharded sequence


# --------------------------------------------------------------------------- compiled models


class _ConvLM(torch.nn.Module):
    """Embedding, a convolution over the sequence (kernel 3: a token mixer; kernel 1: a
    per-token projection), a head."""

    def __init__(self, kernel: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.conv = torch.nn.Conv1d(8, 8, kernel, padding=kernel - 1)
        self.head = torch.nn.Linear(8, 16)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.embed(input_ids).transpose(1, 2))[..., : input_ids.shape[1]]
        return self.head(x.transpose(1, 2))


COMPILED = [
    "torch.compile", "torch.compile fullgraph", "module.compile", "module.compile fullgraph"
]


def _compiled_in_cp(rank: int, world: int) -> dict[str, tuple[str, int, int, bool]]:
    """Each way of compiling, a model with a token mixer (kernel 3) and one without (kernel 1),
    called inside a CP context: (this rank's error or 'no error', graphs compiled inside the
    context, graphs compiled after a call outside it, that call's output finite)."""
    import torch._dynamo
    import torch.distributed as dist
    from torch._dynamo.testing import CompileCounterWithBackend

    from cpshard import ContextParallelSharder

    doc = torch.tensor([[1] * 7 + [2] * 5 + [0] * 2 + [3] * 6])
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    out = {}
    for how in COMPILED:
        for kernel in (3, 1):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("eager")
            torch.manual_seed(0)
            model = _ConvLM(kernel)
            full = how.endswith("fullgraph")
            if how.startswith("torch.compile"):
                run = torch.compile(model, backend=counter, fullgraph=full)
            else:
                model.compile(backend=counter, fullgraph=full)
                run = model
            ctx, local = ContextParallelSharder(dist.group.WORLD, "balanced").shard(dict(batch))
            try:
                with ctx():
                    run(local["input_ids"])
                message = "no error"
            except ValueError as exc:
                message = str(exc)
            inside = counter.frame_count
            finite = bool(torch.isfinite(run(doc)).all())  # outside CP: runs, compiled
            out[f"{how} kernel {kernel}"] = (message, inside, counter.frame_count, finite)
    return out


def test_compiled_models_are_checked_on_every_rank(pool2) -> None:
    """``torch.compile(model)`` and ``model.compile()``, with and without fullgraph: a model with
    a token mixer is refused on every rank before anything is compiled or run, with the same
    ValueError as eagerly; a model without one compiles into one graph inside the context."""
    for rank, cases in enumerate(pool2.run(_compiled_in_cp, timeout=300)):
        for how in COMPILED:
            message, inside, after, finite = cases[f"{how} kernel 3"]
            named = "'_orig_mod.conv'" if how.startswith("torch.compile") else "'conv'"
            assert f"rank {rank}: " in message, (rank, how, message)
            said = f"module {named} is a convolution over the sequence"
            assert said in message, (rank, how, message)
            assert "train wrong" in message, (rank, how, message)
            assert inside == 0, f"rank {rank} {how}: compiled {inside} graphs before refusing"
            assert after >= 1 and finite, (rank, how, after, finite)
            message, inside, after, finite = cases[f"{how} kernel 1"]
            assert message == "no error", (rank, how, message)
            assert inside == 1 and finite, (rank, how, inside, finite)
