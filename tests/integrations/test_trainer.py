"""The Hugging Face trainers under CP (``cpshard.integrations.trainer``): ``CPSFTTrainer`` (TRL,
``packing=True``) and ``CPTrainer`` (``Trainer`` with ``DataCollatorWithFlattening``) on gloo
ranks train and evaluate as the plain trainers do with the same batches.

The training is the examples' (``examples/tiny_training.py``): a tiny random Llama in float64,
four AdamW steps with gradient accumulation 2 and clipping, then an evaluation. Each CP run at
(dp, cp) is compared with the plain trainer at dp processes (DDP over all ranks in both, and
FSDP2 in one CP run):

* every parameter after the last step and every step's gradient norm: relative 1e-9 for
  ``CPTrainer`` (measured: 1e-13); 1e-6 for ``CPSFTTrainer``, because TRL's chunked log-prob
  kernel computes the LM head and its gradient in float32 whatever the model's dtype, and its
  matmuls round differently for a shard's rows than for the whole row's (measured: gradient
  norms 6e-9, parameters 3e-7 after four AdamW steps; a CP error is orders of magnitude more);
* every step's logged loss and the evaluation loss: relative 1e-6, since the trainers log the
  loss in float32;
* that ``CPTrainer`` computed its loss from the hidden states (``cp_linear_cross_entropy``: the
  LM head's forward never ran in training) while the plain ``Trainer`` computed it from the
  logits, with the model's causal-LM loss restated in float64 (transformers' own casts the
  logits to float32, which would put float32 rounding, not CP, between the two runs);
* the logged token counts exactly (each must be logged by both);
* that CP ran: each training forward of a CP run saw its batch split ``cp`` ways (the plain
  run's batch length over ``cp``, up to the layout's padding), and that FSDP2 applied: its
  run's parameters are DTensors (the DDP runs' are not);
* a checkpoint saved under CP loads as a plain model with the trained parameters;
* ``CPTrainer`` on a model loaded sharded by FSDP2 over all four ranks equals the same reference.

The refusals (a cp_size that does not divide the world, processes that would train alone,
accelerate's CP at the same time, a model with token mixers cpshard does not shard, label
smoothing, a gradient reduction that does not span every rank, evaluation with logits) raise on
every rank, naming the rank and what to change.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.helpers import EXAMPLES

pytest.importorskip("transformers")
pytest.importorskip("trl")
sys.path.insert(0, str(EXAMPLES))

import tiny_training  # noqa: E402

PARAM_TOL = {"trainer": 1e-9, "sft": 1e-6}
LOSS_TOL = 1e-6
# per-step entries each trainer logs that must be there and be equal, not close: what is counted
COUNTS = {"trainer": ("num_input_tokens_seen",), "sft": ("num_input_tokens_seen", "num_tokens")}


def _launched(rank: int, world: int) -> None:
    """The environment torchrun gives a rank (the pool's process group is already up, so
    accelerate takes it), and accelerate's state of an earlier trainer in this worker gone."""
    from accelerate.state import AcceleratorState

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")  # fmt: skip
    AcceleratorState._reset_state(reset_partial_state=True)


FSDP2 = "trainer-fsdp2"  # CPTrainer on a model transformers loads sharded by FSDP2 over the world


def _fsdp2_model(rank: int, world: int, out: str) -> torch.nn.Module:
    """The tiny Llama saved, then loaded with FSDP2 over every rank (transformers'
    ``DistributedConfig``: the way FSDP2 trains on CPU, where ``fsdp=`` arguments become DDP)."""
    import torch.distributed as dist
    import transformers
    from transformers.distributed import DistributedConfig

    folder = os.path.join(out, "fsdp2-initial")
    if rank == 0:
        tiny_training.tiny_llama().save_pretrained(folder)
    dist.barrier()
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, distributed_config=DistributedConfig(fsdp_size=world)
    )


def _training_forwards(module: torch.nn.Module, value: Callable[[tuple, dict], int]) -> list[int]:
    """``value(args, kwargs)`` of each training forward of ``module``, filled as it trains (not
    the calls of cpshard's own check of a model's first CP forward)."""
    from cpshard.guard.models import auditing

    seen: list[int] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if module.training and not auditing():
            seen.append(value(args, kwargs))

    module.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def _float64_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """transformers' causal-LM loss (labels shifted unless given shifted, summed over
    ``num_items_in_batch`` or averaged) in the logits' dtype, without its float32 cast."""
    import torch.nn.functional as F

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(
        logits.reshape(-1, vocab_size), shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index, reduction=reduction,
    )  # fmt: skip
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _runs(rank: int, world: int, runs: list[tuple[str, int | None]], out: str) -> dict:
    """Each ``(kind, cp_size)`` of ``runs`` trained on this rank; rank 0's results, with the
    tokens of each of its training forwards, the names of its parameters that are DTensors and
    of those that are not as it starts training (at rest, between steps: FSDP2's root keeps its
    own parameters unsharded after a forward without a backward, as evaluation ends), and
    whether it trained as FSDP2's module."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    results = {}
    for kind, cp in runs:
        _launched(rank, world)
        folder = os.path.join(out, f"{kind}-{cp}")
        if kind == FSDP2:
            model = _fsdp2_model(rank, world, out)
            save, trainer_kind = None, "trainer"
        else:
            model = tiny_training.tiny_llama()
            save, trainer_kind = (folder + "-model" if cp is not None else None), kind
        if trainer_kind == "trainer" and cp is None:
            model.loss_function = _float64_causal_lm_loss
        # the tokens of each forward (its input_ids' last dim), and the LM head's forwards
        tokens = _training_forwards(model, lambda args, kwargs: int(kwargs["input_ids"].shape[-1]))
        head_calls = _training_forwards(model.get_output_embeddings(), lambda args, kwargs: 1)
        named = list(model.named_parameters())
        dtensors = [n for n, p in named if isinstance(p, DTensor)]
        plain = [n for n, p in named if not isinstance(p, DTensor)]
        result = tiny_training.train(trainer_kind, cp, folder, save_to=save, model=model)
        result.update(tokens=tokens, dtensors=dtensors, plain=plain, head_calls=len(head_calls))
        result["fsdp2"] = isinstance(model, FSDPModule)
        results[kind, cp] = result
    return results if rank == 0 else {}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def _steps(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in log if "grad_norm" in e]


def check_same_training(
    cp: dict[str, Any], plain: dict[str, Any], param_tol: float, kind: str, cp_size: int
) -> None:
    """The CP run sharded every training batch over its ``cp_size`` ranks (each forward saw the
    plain run's batch split ``cp_size`` ways, padded at most to a multiple of ``2 * cp_size``),
    and its parameters, gradient norms, losses, counts and evaluation loss equal the plain
    run's."""
    assert len(cp["tokens"]) == len(plain["tokens"]) > 0
    for i, (shard, whole) in enumerate(zip(cp["tokens"], plain["tokens"], strict=True)):
        assert whole <= shard * cp_size < whole + 2 * cp_size, (i, shard, whole, cp_size)
    cp_steps, plain_steps = _steps(cp["log"]), _steps(plain["log"])
    assert len(cp_steps) == len(plain_steps) == 4
    for i, (a, b) in enumerate(zip(cp_steps, plain_steps, strict=True)):
        assert abs(a["grad_norm"] - b["grad_norm"]) <= param_tol * abs(b["grad_norm"]), (i, a, b)
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL * abs(b["loss"]), (i, a, b)
        for key in COUNTS[kind]:
            assert key in a and key in b and a[key] == b[key], (i, key, a, b)
    assert any(s["grad_norm"] > tiny_training.CLIP for s in plain_steps), "no step was clipped"
    assert abs(cp["eval_loss"] - plain["eval_loss"]) <= LOSS_TOL * abs(plain["eval_loss"])
    assert cp["params"].keys() == plain["params"].keys()
    for name, p in plain["params"].items():
        assert _relative(cp["params"][name], p) <= param_tol, name
        assert not torch.equal(p, tiny_training.tiny_llama().state_dict()[name]), name


@pytest.fixture(scope="module")
def trained(pools, tmp_path_factory) -> dict:
    """Every CP run and its plain reference: (dp, cp) = (2, 2) and (1, 4) on 4 ranks, plain at
    dp = 2 on 2 ranks and at dp = 1 in one process, for both trainers."""
    out = str(tmp_path_factory.mktemp("trainer"))
    results = {}
    plans = {
        4: [("sft", 2), ("trainer", 2), ("sft", 4), ("trainer", 4), (FSDP2, 2)],
        2: [("sft", None), ("trainer", None)],
        1: [("sft", None), ("trainer", None)],
    }
    for world, runs in plans.items():
        for (kind, cp), value in pools(world).run(_runs, runs, os.path.join(out, str(world)), timeout=600)[0].items():
            results[kind, world if cp is None else world // cp, cp] = value
    results["out"] = out
    return results


@pytest.mark.parametrize("kind", tiny_training.KINDS)
@pytest.mark.parametrize("dp, cp", [(2, 2), (1, 4)])
def test_cp_trains_and_evaluates_like_the_plain_trainer(trained, kind, dp, cp):
    check_same_training(trained[kind, dp, cp], trained[kind, dp, None], PARAM_TOL[kind], kind, cp)
    run = trained[kind, dp, cp]
    assert run["plain"] and not run["dtensors"] and not run["fsdp2"]  # DDP
    if kind == "trainer":  # the CP loss from the hidden states, the plain one from the logits
        assert run["head_calls"] == 0 < trained[kind, dp, None]["head_calls"]


def test_cp_under_fsdp2_trains_like_the_plain_trainer(trained):
    """FSDP2 over all four ranks (the model loaded sharded: every parameter a DTensor) at
    (dp, cp) = (2, 2) against the plain Trainer at dp = 2 with DDP: FSDP2's averaging over every
    rank is the reduction."""
    run = trained[FSDP2, 2, 2]
    assert run["fsdp2"] and run["dtensors"] and not run["plain"], f"not DTensors: {run['plain']}"
    assert run["head_calls"] == 0  # the loss from the hidden states under FSDP2 too
    check_same_training(
        trained[FSDP2, 2, 2], trained["trainer", 2, None], PARAM_TOL["trainer"], "trainer", 2
    )


@pytest.mark.parametrize("kind", tiny_training.KINDS)
def test_a_checkpoint_saved_under_cp_loads_as_a_plain_model(trained, kind):
    import transformers

    folder = os.path.join(trained["out"], "4", f"{kind}-2-model")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    assert model.config._attn_implementation != "cpshard"
    for name, p in model.named_parameters():
        assert torch.equal(p, trained[kind, 2, 2]["params"][name]), name


# ------------------------------------------------------------------ refusals


def _llama_with_a_token_shift() -> torch.nn.Module:
    """The tiny Llama with a user's layer cpshard does not shard: a convolution over the
    sequence in its first decoder layer."""
    model = tiny_training.tiny_llama()
    model.model.layers[0].token_shift = torch.nn.Conv1d(32, 32, 3, padding=2, groups=32)
    return model.to(torch.float64)


def _refusals(rank: int, world: int, out: str) -> dict[str, str]:
    """Each refused set-up on this rank: its error message ('no error' when none)."""
    import transformers
    from accelerate.parallelism_config import ParallelismConfig
    from torch.nn.parallel import DistributedDataParallel

    from cpshard.integrations.trainer import CPTrainer

    data = [{"input_ids": d} for d in tiny_training.documents(8, seed=1)]

    def make(model=None, cp_size=2, **arguments):
        _launched(rank, world)
        args = transformers.TrainingArguments(
            **{"output_dir": out, "use_cpu": True, "report_to": "none",
               "per_device_train_batch_size": 2, **arguments},
        )  # fmt: skip
        return CPTrainer(
            model=model if model is not None else tiny_training.tiny_llama(), args=args,
            data_collator=transformers.DataCollatorWithFlattening(), train_dataset=data,
            cp_size=cp_size,
        )  # fmt: skip

    def reduction_over_cp_group_only():
        trainer = make()
        ddp = DistributedDataParallel(trainer.model, process_group=trainer._cp_group.pg)
        batch = transformers.DataCollatorWithFlattening()(data[:2])
        trainer.training_step(ddp, dict(batch))

    def evaluation_with_metrics():
        trainer = make()
        trainer.compute_metrics = lambda prediction: {}
        trainer.evaluate(eval_dataset=data)

    cases = {
        "cp_size": lambda: make(cp_size=3),
        "alone": lambda: make(use_cpu=False),
        "accelerate": lambda: make(parallelism_config=ParallelismConfig(cp_size=2)),
        "mixer": lambda: make(model=_llama_with_a_token_shift()),
        "label smoothing": lambda: make(label_smoothing_factor=0.1),
        "reduction": reduction_over_cp_group_only,
        "metrics": evaluation_with_metrics,
    }
    found = {}
    for name, case in cases.items():
        try:
            case()
            found[name] = "no error"
        except ValueError as exc:
            found[name] = str(exc)
    return found


REFUSALS = {
    "cp_size": "cp_size=3 must divide the world size 4",
    "accelerate": "set its cp_size to 1",
    "mixer": "LlamaForCausalLM cannot train under CP: its module 'model.layers.0.token_shift'",
    "label smoothing": "set label_smoothing_factor=0",
    "reduction": "not over all 4 ranks",
    "alone": "each process would train alone. On CPU pass use_cpu=True",
    "metrics": "reports the loss only",
}


def test_refusals_raise_on_every_rank(pool4, tmp_path):
    results = pool4.run(_refusals, str(tmp_path), timeout=300)
    for rank, found in enumerate(results):
        for name, words in REFUSALS.items():
            message = found[name]
            assert message.startswith("cpshard.integrations.trainer: rank "), (rank, name, message)
            assert words in message and f"rank {rank}" in message, (rank, name, message)


def test_sft_example_runs_under_torchrun(tmp_path):
    """``examples/sft_trl.py`` on 2 CPU ranks prints each step's CP loss beside the plain
    SFTTrainer's in one process, and they agree."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(EXAMPLES / "sft_trl.py"), "--steps", "2", "--output-dir", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith(("step ", "eval:"))]
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "eval"], run.stdout
    for line in lines:
        fields = line.split()
        cp, one = float(fields[fields.index("loss") + 1]), float(fields[-1])
        assert abs(cp - one) <= LOSS_TOL * abs(one), line


def test_cpsfttrainer_without_trl_says_what_to_install(monkeypatch):
    """Without TRL, CPSFTTrainer's import says what to install (and that CPTrainer needs none)."""
    monkeypatch.setitem(sys.modules, "trl", None)
    monkeypatch.delitem(sys.modules, "cpshard.integrations.sft", raising=False)
    import cpshard

    with pytest.raises(ImportError, match="CPSFTTrainer needs TRL"):
        cpshard.CPSFTTrainer  # noqa: B018


def test_a_trainer_that_does_not_share_the_token_count_over_cp_is_refused():
    """transformers 5.15's Trainer does not divide a batch's token count by the CP size: under
    it every CP loss and gradient would be 1/cp (measured: the example's loss halved at cp = 2)."""
    from cpshard.integrations import trainer

    with pytest.raises(ValueError, match=r"5\.15\.0's Trainer does not share .* >= 5\.24"):
        trainer._refuse_older_trainer("5.15.0")
    trainer._refuse_older_trainer()  # the installed one (the tested range) passes
