"""The refusal of models that mix tokens without cpshard (:mod:`cpshard.guard.models`): a
mixer by its parameters raises before running; a module mixing tokens by its own code, whatever
its class is called, is found by the audit and named (the innermost one); calls that reached
cpshard pass; each model is audited once; declared-safe modules are skipped; nothing is checked
outside a CP attention context; compiled models (``torch.compile(model)``, ``model.compile()``)
are checked and audited as eager ones, and a compiled step runs a model checked eagerly first.
And the probe itself (:mod:`cpshard.guard.probe`)."""

from __future__ import annotations

import pytest
import torch

from cpshard.attention import activated, step_state
from cpshard.comm.group import Group
from cpshard.guard import models as guard
from cpshard.guard.probe import mixes_tokens
from cpshard.guard.reach import note_cpshard_mixing
from cpshard.layouts import make_layout


def _context():
    """Rank 1 of an offline world-2 group, 6 local tokens (planned without communication)."""
    doc = torch.tensor([[1] * 6 + [2] * 6])
    return activated(step_state(Group(None, 1, 2), make_layout("contiguous", 2, 12), doc))


class Harmless(torch.nn.Module):
    """Mixes tokens (a running sum over the sequence) under a name that says nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(1)


class Routed(torch.nn.Module):
    """Stands for a layer that mixes tokens through cpshard (it reports the call as cpshard's
    functions do)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        note_cpshard_mixing()
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


def test_what_is_a_mixer_by_its_parameters() -> None:
    assert guard.mixer_problem(torch.nn.Conv1d(4, 4, 3)) is not None
    assert guard.mixer_problem(torch.nn.Conv1d(4, 4, 1)) is None  # a per-token projection
    assert guard.mixer_problem(torch.nn.Conv3d(3, 4, 2)) is None  # image patches
    assert guard.mixer_problem(torch.nn.LSTM(4, 4)) is not None
    assert guard.mixer_problem(torch.nn.Linear(4, 4)) is None


def test_a_model_with_a_sequence_convolution_raises_before_running() -> None:
    model = _Model(torch.nn.Conv1d(6, 6, 3, padding=1))
    x = torch.randn(1, 6, 4)
    with _context(), pytest.raises(ValueError, match=r"rank 1: _Model .* module 'block.1' is a conv"):
        model(x)
    assert model.ran == 0
    model(x)  # outside CP: runs
    assert model.ran == 1


def test_a_module_mixing_tokens_by_its_own_code_is_named() -> None:
    model = _Model(Harmless())
    x = torch.randn(1, 6, 4)
    with _context(), pytest.raises(ValueError, match=r"rank 1: _Model .* module 'block.1' is Harmless"):
        model(x)
    model(x)  # outside CP: runs


def test_calls_that_reached_cpshard_pass_and_their_siblings_are_probed() -> None:
    routed = _Model(Routed())
    with _context():
        routed(torch.randn(1, 6, 4))
    both = torch.nn.Sequential(Routed(), Harmless())
    with _context(), pytest.raises(ValueError, match=r"module '1' is Harmless"):
        both(torch.randn(1, 6, 4))


def test_models_are_audited_once(monkeypatch) -> None:
    audits = []
    real = guard.audit
    monkeypatch.setattr(guard, "audit", lambda m, a, k: audits.append(m) or real(m, a, k))
    model = _Model(None)
    with _context():
        for _ in range(3):
            model(torch.randn(1, 6, 4))
    assert audits == [model]
    assert model.ran == 3 + 1 + 3  # three calls, the audit's re-run, its probe's three runs


def test_declared_safe_modules_are_skipped() -> None:
    tower = torch.nn.Sequential(torch.nn.Conv1d(6, 6, 3, padding=1), Harmless())
    tower.cpshard_not_sequence = True
    model = _Model(None)
    model.tower = tower
    with _context():
        guard.check_model(model)  # no error: the marked subtree is not the sharded sequence
        guard.audit(model, (torch.randn(1, 6, 4),), {})
        model.tower(torch.randn(1, 6, 4))


def test_nothing_is_checked_outside_a_context() -> None:
    model = _Model(Harmless())
    model(torch.randn(1, 6, 4))
    assert model.ran == 1


class _Attention(torch.nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=self.causal)[:, 0]


@pytest.mark.parametrize(
    "module, mixes",
    [
        (_Attention(causal=True), True),
        (_Attention(causal=False), True),
        (Harmless(), True),
        (torch.nn.Conv1d(6, 6, 1), True),  # [B, C, L] read as [B, L, ...]: mixes dim 1
        (torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4)), False),
        (torch.nn.LayerNorm(4), False),
        (torch.nn.Dropout(0.5), False),  # the same random state in every run
    ],
)
def test_the_probe_tells_token_mixing_from_per_token_work(module: torch.nn.Module, mixes: bool) -> None:
    assert mixes_tokens(module, (torch.randn(2, 6, 4),), {}, (2, 6)) is mixes


def test_the_probe_changes_token_ids_and_needs_two_tokens() -> None:
    embed = torch.nn.Embedding(8, 4)
    ids = torch.tensor([[0, 3, 7, 1, 2, 5]])
    assert mixes_tokens(embed, (ids,), {}, (1, 6)) is False
    assert mixes_tokens(torch.nn.Sequential(embed, Harmless()), (ids,), {}, (1, 6)) is True
    assert mixes_tokens(Harmless(), (torch.randn(1, 1, 4),), {}, (1, 1)) is False


class _Router(torch.nn.Module):
    """An MoE router: ``[B * L, experts]`` logits of the flattened tokens."""

    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(4, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x.flatten(0, 1))


def test_the_probe_reads_only_tensors_of_the_steps_rows_and_tokens() -> None:
    """A router's logits with as many experts as tokens are not read as a sequence."""
    assert mixes_tokens(_Router(experts=6), (torch.randn(1, 6, 4),), {}, (1, 6)) is False


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


# The audit (a module mixing by its own code, found when the first forward returns) of compiled
# models, and a model checked eagerly then called inside a compiled function.
AUDITED = ["torch.compile fullgraph", "module.compile fullgraph"]


def _compiled_audit(rank: int, world: int) -> dict[str, tuple[str, list[float]]]:
    """Per way of compiling, per decoder (attention by plain SDPA, or through ``cp_attention``):
    this rank's error or 'no error', and the logits' largest difference from the eager decoder's
    in the same context (for a decoder that ran); and a compiled step (``torch.compile(step)``)
    calling the cp-aware decoder after its first, eager call inside the context."""
    import copy

    import torch._dynamo
    import torch.distributed as dist

    from cpshard import ContextParallelSharder
    from tests.helpers import cp_aware_decoder, plain_sdpa_decoder

    doc = torch.tensor([[1] * 7 + [2] * 5 + [0] * 2 + [3] * 6])
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    out: dict[str, tuple[str, list[float]]] = {}

    def run(name: str, call, eager: torch.nn.Module) -> None:
        ctx, local = ContextParallelSharder(dist.group.WORLD, "head_tail").shard(dict(batch))
        args = (local["input_ids"], local["position_ids"])
        try:
            with ctx():
                got, want = call(*args), eager(*args)
            out[name] = "no error", [float((got - want).abs().max())]
        except ValueError as exc:
            out[name] = str(exc), []

    cases = [(how, plain_sdpa_decoder) for how in AUDITED] + [(AUDITED[0], cp_aware_decoder)]
    for how, make in cases:  # (model.compile() of a model that passes: the test above)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make()
        eager = copy.deepcopy(model)
        if how.startswith("torch.compile"):
            call = torch.compile(model, backend="eager", fullgraph=True)
        else:
            model.compile(backend="eager", fullgraph=True)
            call = model
        run(f"{how} {make.__name__}", call, eager)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = cp_aware_decoder()
    eager = copy.deepcopy(model)
    ctx, local = ContextParallelSharder(dist.group.WORLD, "head_tail").shard(dict(batch))
    with ctx():
        model(local["input_ids"], local["position_ids"])  # the first call: eager, checked
    step = torch.compile(lambda i, p: model(i, p), backend="eager", fullgraph=True)
    run("compiled step", step, eager)
    return out


def test_compiled_models_are_audited_on_every_rank(pool2) -> None:
    """``torch.compile(model)`` and ``model.compile()`` with fullgraph: a decoder whose attention
    calls SDPA itself is refused on every rank, naming its attention module, with the same
    ValueError as eagerly; the same decoder calling ``cp_attention`` compiled with
    ``torch.compile`` runs and gives the eager decoder's logits; so does a compiled step calling
    it after its eager first call."""
    for rank, cases in enumerate(pool2.run(_compiled_audit, timeout=300)):
        for how in AUDITED:
            message, _ = cases[f"{how} plain_sdpa_decoder"]
            wrapped = how.startswith("torch.compile")  # the wrapper's name for the module
            named = "_orig_mod.blocks.0.attn" if wrapped else "blocks.0.attn"
            said = f"module {named!r} is _Attention, which mixes tokens"
            assert message.startswith(f"cpshard CP attention: rank {rank}: "), (rank, how, message)
            assert said in message, (rank, how, message)
            assert "train wrong" in message, (rank, how, message)
        for name in (f"{AUDITED[0]} cp_aware_decoder", "compiled step"):
            message, diffs = cases[name]
            assert message == "no error" and diffs[0] <= 1e-6, (rank, name, message, diffs)
