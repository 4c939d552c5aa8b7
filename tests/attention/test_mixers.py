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
