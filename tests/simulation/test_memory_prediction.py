"""``cpshard plan --memory``: the predicted peak of a CP training step (replicated, and sharded by
FSDP2 over the CP ranks and data-parallel replicas) against the measured peak of the same real
step on gloo (CPU allocator), the layer composition against a trace of every layer, the replay
of repeated attention calls against tracing them, the command's report and its argument
errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from cpshard.bench.memory_prediction import Case, cp_group, measure_rank, spec_of
from cpshard.cli import main
from cpshard.guard.models import assume_verified
from cpshard.sharder import ContextParallelSharder
from cpshard.simulation.documents import document_ids, document_lengths
from cpshard.simulation.fake_rank import simulated_rank
from cpshard.simulation.memory_tracker import FSDPStepTracker, StepTracker
from cpshard.simulation.model_config import model_config
from cpshard.simulation.step_loss import LOSSES, LossModule
from cpshard.simulation.step_memory import DEVICE, Predictor, later_step_views
from cpshard.simulation.training_step import (
    CausalStep,
    StepSpec,
    build_model,
    forward_backward,
    fully_shard_step,
    make_optimizer,
    packed_batch,
    world_mesh,
)
from cpshard.testing import run_ranks

TOLERANCE = 0.10
# (world, cases): the peak lands in the loss, in a checkpointed backward and in the optimizer step;
# the chunked loss that never holds the logits too; FSDP2 over the CP ranks, and over 2 CP ranks
# times 2 data-parallel replicas.
MEASURED = {
    2: (Case(4096, "head_tail"), Case(4096, "contiguous", checkpointing=True),
        Case(512, "stripe", docs="one"), Case(4096, "head_tail", loss="linear_cross_entropy"),
        Case(4096, "head_tail", fsdp=True), Case(512, "stripe", docs="one", fsdp=True)),
    4: (Case(4096, "head_tail", strategy="heads"), Case(4096, "per_document_head_tail"),
        Case(512, "contiguous", checkpointing=True, docs="one"),
        Case(4096, "contiguous", checkpointing=True, fsdp=True),
        Case(4096, "head_tail", fsdp=True, dp_shard=2)),
}  # fmt: skip


def _measure(rank: int, world: int, cases: tuple[Case, ...]) -> list[int]:
    return [measure_rank(cp_group(case), case) for case in cases]


def _predict(world: int, case: Case) -> list[tuple[int, str]]:
    """Every CP rank's prediction (of the first data-parallel replica)."""
    cp = world // case.dp_shard
    ids = document_ids(document_lengths(case.docs, case.seq_len), case.seq_len)
    found = Predictor(spec_of(case)).ranks(cp, list(range(cp)), case.layout, case.strategy, ids)
    return [(m.peak_bytes, m.at) for m in found]


@pytest.mark.parametrize("world", sorted(MEASURED))
def test_prediction_within_ten_percent_of_the_measured_step(world: int) -> None:
    cases = MEASURED[world]
    measured = run_ranks(_measure, world, cases, timeout=900)
    seen = set()
    for i, case in enumerate(cases):
        predictions = _predict(world, case)
        for rank in range(world):  # a replica's CP rank r holds what the first replica's does
            predicted, at = predictions[rank % len(predictions)]
            got = measured[rank][i]
            seen.add(at)
            assert abs(predicted / got - 1) <= TOLERANCE, (
                f"W={world} {case} rank {rank}: predicted {predicted} B (at {at}), "
                f"measured {got} B"
            )
    assert len(seen) >= 2, f"every case peaked at {seen}: the cases test one segment only"


def _full_trace_peak(spec: StepSpec, world: int, rank: int, layout: str, ids: torch.Tensor) -> int:
    """The peak of the step of every layer, traced whole (no composition)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    later_step_views("auto", None)
    with simulated_rank(rank, world, dp=spec.dp_shard) as group:
        mesh = world_mesh() if spec.fsdp else None
        with mode:
            model = build_model(spec, spec.layers)
            loss_module = LossModule(model.get_output_embeddings(), LOSSES[spec.loss], group)
            step = CausalStep(model, loss_module)
            if mesh is not None:
                fully_shard_step(step, mesh)
            opt = make_optimizer(spec, step)
        assume_verified(step)
        ctx, local = ContextParallelSharder(group, layout).shard(
            packed_batch(ids, int(spec.config.vocab_size))
        )
        if spec.fsdp:
            tracker = FSDPStepTracker(DEVICE, lambda _: "step", step, opt, loss_module, False)
        else:
            tracker = StepTracker(DEVICE, lambda _: "step", loss_module, replay=False)
            tracker.track_external(step, opt)
        with mode, tracker:
            forward_backward(step, local, ctx, mode.from_tensor)
            opt.step()
    return tracker._peak_mem[DEVICE]


_SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=192, layers=5, heads=4,
              kv_heads=2, head_dim=16)  # fmt: skip


@pytest.mark.parametrize(
    "seq, checkpointing, docs, fsdp, dp",
    [(2048, False, "pareto:8", False, 1), (2048, True, "one", False, 1),
     (128, False, "one", False, 1), (2048, False, "pareto:8", True, 1),
     (2048, True, "one", True, 2), (128, False, "one", True, 1)],
)  # fmt: skip
def test_composition_equals_a_trace_of_every_layer(
    seq: int, checkpointing: bool, docs: str, fsdp: bool, dp: int
) -> None:
    spec = StepSpec(model_config("llama", **_SMALL), torch.float32, checkpointing, "adamw",
                    fsdp=fsdp, dp_shard=dp)  # fmt: skip
    ids = document_ids(document_lengths(docs, seq), seq)
    composed = Predictor(spec).ranks(2, [1], "head_tail", "auto", ids)[0]
    assert composed.peak_bytes == _full_trace_peak(spec, 2, 1, "head_tail", ids)


@pytest.mark.parametrize("fsdp", [False, True])
def test_replayed_attention_calls_give_the_traced_result(fsdp: bool) -> None:
    """The later layers' attention calls replayed give every figure of tracing them again, to
    the byte; so do ranks traced in forked processes."""
    spec = StepSpec(model_config("llama", **_SMALL), torch.float32, False, "adamw", fsdp=fsdp)
    ids = document_ids(document_lengths("pareto:8", 2048), 2048)
    fresh = Predictor(spec, replay=False).ranks(4, [0, 3], "head_tail", "auto", ids)
    replayed = Predictor(spec).ranks(4, [0, 3], "head_tail", "auto", ids)
    strip = lambda ms: [(m.rank, m.peak_bytes, m.by_category, m.at) for m in ms]  # noqa: E731
    assert strip(replayed) == strip(fresh)
    forked = Predictor(spec).ranks(4, [0, 3, 1], "head_tail", "auto", ids, jobs=2)
    assert strip(forked) == strip(Predictor(spec).ranks(4, [0, 3, 1], "head_tail", "auto", ids))


def test_plan_memory_reports_every_rank(tmp_path, capsys) -> None:
    path = tmp_path / "memory.json"
    argv = ["plan", "--memory", "--model", "llama", "--hidden-size", "64", "--intermediate-size",
            "128", "--vocab-size", "256", "--layers", "3", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--world", "4", "--seq-len", "1k", "--docs", "pareto:8",
            "--device", "1GiB", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "PREDICTED" in out.out and "fits 1GiB" in out.out and "[4/4]" in out.err
    data = json.loads(path.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3]
    for r in data["ranks"]:
        assert set(r["by_category"]) == {
            "parameters", "gradients", "optimizer", "fsdp_gathered", "fsdp_reduced",
            "activations", "kv_exchange", "loss", "temporaries",
        }  # fmt: skip
        assert sum(r["by_category"].values()) == r["peak_bytes"] > 0
    assert data["device"] == {"name": "1GiB", "bytes": 2**30, "fits": True}
    assert data["worst"]["peak_bytes"] == max(r["peak_bytes"] for r in data["ranks"])


def test_plan_memory_fsdp_shards_the_state_over_cp_and_data_parallel_ranks(tmp_path) -> None:
    """--fsdp: parameters and optimizer state per rank fall as the shard group grows (W, then
    W x --dp-shard); the layer being computed is gathered whole."""
    argv = ["plan", "--memory", "--model", "llama", "--hidden-size", "64", "--intermediate-size",
            "128", "--vocab-size", "256", "--layers", "3", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--world", "2", "--seq-len", "1k", "--docs", "pareto:8",
            "--ranks", "0", "--dtype", "fp32"]  # fmt: skip
    held = {}
    for name, extra in (("replicated", []), ("fsdp", ["--fsdp"]),
                        ("fsdp x2", ["--fsdp", "--dp-shard", "2"])):  # fmt: skip
        path = tmp_path / f"{len(held)}.json"
        assert main([*argv, *extra, "--json", str(path)]) == 0
        data = json.loads(path.read_text())
        assert data["setup"]["fsdp"] == ("fsdp" in name)
        cats = data["ranks"][0]["by_category"]
        held[name] = cats["parameters"] + cats["optimizer"]
        assert (cats["fsdp_gathered"] > 0) == ("fsdp" in name)
    # sharded 2 and 4 ways (each parameter padded to a multiple of the group)
    assert held["replicated"] > 1.9 * held["fsdp"] > 3.6 * held["fsdp x2"]


def test_plan_memory_searches_the_largest_fitting_sequence(tmp_path) -> None:
    path = tmp_path / "search.json"
    base = ["plan", "--memory", "--model", "llama", "--hidden-size", "64", "--intermediate-size",
            "128", "--vocab-size", "256", "--layers", "2", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--world", "2", "--docs", "one", "--optimizer", "sgd"]  # fmt: skip
    assert main([*base, "--seq-len", "256", "--max-seq-len", "16k", "--device", "60MiB",
                 "--json", str(path)]) == 0  # fmt: skip
    data = json.loads(path.read_text())
    best, tried = data["max_seq_len"], {int(k): v for k, v in data["tried"].items()}
    assert best is not None and best % 256 == 0 and tried[best] <= 60 * 2**20
    assert best == 16384 or tried[best + 256] > 60 * 2**20


@pytest.mark.parametrize(
    "args, message",
    [
        (["--memory"], "--model"),
        (["--memory", "--model", "nosuchmodeltype"], "--model"),
        (["--memory", "--model", "llama", "--device", "lots"], "--device"),
        (["--memory", "--model", "llama", "--optimizer", "lion"], "--optimizer"),
        (["--memory", "--model", "llama", "--window", "8"], "--window"),
        (["--max-seq-len", "8k", "--heads", "4", "--head-dim", "8"], "--max-seq-len"),
        (["--hidden-size", "64", "--heads", "4", "--head-dim", "8"], "--hidden-size"),
        (["--fsdp", "--heads", "4", "--head-dim", "8"], "--fsdp"),
        (["--jobs", "2", "--heads", "4", "--head-dim", "8"], "--jobs"),
        (["--memory", "--model", "llama", "--jobs", "0"], "--jobs"),
        (["--memory", "--model", "llama", "--dp-shard", "2"], "--dp-shard"),
        (["--memory", "--model", "llama", "--fsdp", "--dp-shard", "0"], "--dp-shard"),
    ],
)  # fmt: skip
def test_plan_memory_bad_arguments_name_the_argument(args, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--world", "4", "--seq-len", "1k", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_model_config_sources(tmp_path) -> None:
    named = model_config("llama3-8b")
    assert (named.hidden_size, named.num_hidden_layers, named.num_key_value_heads) == (4096, 32, 8)
    sized = model_config("qwen3", hidden_size=128, layers=3)
    got = (type(sized).__name__, sized.hidden_size, sized.num_hidden_layers)
    assert got == ("Qwen3Config", 128, 3)
    named.to_json_file(tmp_path / "config.json")
    assert model_config(str(tmp_path)).intermediate_size == 14336
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="--model"):
        model_config(str(tmp_path / "bad.json"))
