"""What the two Hugging Face trainer examples (``sft_trl.py``, ``trainer_flattening.py``) share:
a tiny random Llama in float64, a word-level tokenizer made in memory (nothing is downloaded),
documents of random token ids, and :func:`train`, which trains a few steps with TRL's
``SFTTrainer`` (``packing=True``) or transformers' ``Trainer`` (``DataCollatorWithFlattening``),
plain or under cpshard CP, and evaluates.

The tests run :func:`train` on gloo ranks against the plain trainers, so what the examples show
is what is tested.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import torch

VOCAB = 64
CLIP = 0.5  # the gradient norm clipped to: below the first steps' norms
KINDS = ("sft", "trainer")
# launcher variables a one-process reference must not inherit
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")  # fmt: skip


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A tiny random Llama (2 layers, float64): the same weights in every process."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).to(torch.float64)


def tiny_tokenizer() -> Any:
    """A word-level tokenizer over ``t0 .. t63`` (pad ``t0``, eos ``t2``), made in memory."""
    import transformers
    from tokenizers import Tokenizer, models

    words = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(words, unk_token="t3"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="t0", eos_token="t2", unk_token="t3"
    )


def documents(count: int, seed: int) -> list[list[int]]:
    """``count`` documents of 3-20 random token ids (4 .. 63), the same in every process."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 21, (count,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def train(
    kind: str,
    cp_size: int | None,
    output_dir: str,
    *,
    steps: int = 4,
    grad_accum: int = 2,
    max_grad_norm: float = CLIP,
    evaluate: bool = True,
    save_to: str | None = None,
    model: torch.nn.Module | None = None,
    **arguments: Any,
) -> dict[str, Any]:
    """Train ``steps`` AdamW steps (gradient accumulation ``grad_accum``, clipping at
    ``max_grad_norm``) and evaluate, in this process's rank of the launched job.

    ``kind``: ``"sft"`` (TRL ``SFTTrainer``, pre-tokenized documents packed padding-free into
    rows of at most 48 tokens, one row per device batch) or ``"trainer"`` (``Trainer`` with
    ``DataCollatorWithFlattening``, three documents per row). ``cp_size``: None for the plain
    class, else the cpshard class with that CP size. ``arguments`` override the training
    arguments. Returns the log history, the eval loss (None without ``evaluate``) and the
    trained parameters (full tensors); ``save_to``: a folder for ``save_model``; ``model``: the
    model to train (default :func:`tiny_llama`), e.g. one loaded sharded by FSDP2.
    """
    import datasets
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    common = dict(
        output_dir=output_dir, use_cpu=True, report_to="none", max_steps=steps,
        gradient_accumulation_steps=grad_accum, max_grad_norm=max_grad_norm, learning_rate=1e-2,
        optim="adamw_torch", logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
        include_num_input_tokens_seen="all", dataloader_drop_last=False,
    )  # fmt: skip
    common.update(arguments)
    train_docs, eval_docs = documents(48, seed=1), documents(10, seed=2)
    model = tiny_llama() if model is None else model
    cp = {} if cp_size is None else {"cp_size": cp_size}
    if kind == "sft":
        from trl import SFTConfig

        if cp_size is None:
            from trl import SFTTrainer as cls
        else:
            from cpshard.integrations.sft import CPSFTTrainer as cls
        args = SFTConfig(
            packing=True, max_length=48, per_device_train_batch_size=1,
            per_device_eval_batch_size=1, dataset_num_proc=None, **common,
        )  # fmt: skip
        trainer = cls(
            model=model, args=args, processing_class=tiny_tokenizer(),
            train_dataset=datasets.Dataset.from_dict({"input_ids": train_docs}),
            eval_dataset=datasets.Dataset.from_dict({"input_ids": eval_docs}), **cp,
        )  # fmt: skip
    else:
        if cp_size is None:
            cls = transformers.Trainer
        else:
            from cpshard.integrations.trainer import CPTrainer as cls
        args = transformers.TrainingArguments(
            per_device_train_batch_size=3, per_device_eval_batch_size=3, **common
        )
        trainer = cls(
            model=model, args=args, data_collator=transformers.DataCollatorWithFlattening(),
            train_dataset=[{"input_ids": d} for d in train_docs],
            eval_dataset=[{"input_ids": d} for d in eval_docs], **cp,
        )  # fmt: skip
    trainer.train()
    eval_loss = trainer.evaluate()["eval_loss"] if evaluate else None
    if save_to is not None:
        trainer.save_model(save_to)
    params = {n: _full(p).detach().clone() for n, p in trainer.model.named_parameters()}
    return {"log": trainer.state.log_history, "eval_loss": eval_loss, "params": params}


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter as one full tensor (FSDP2's DTensor shards gathered)."""
    from torch.distributed.tensor import DTensor

    return p.full_tensor() if isinstance(p, DTensor) else p


def step_losses(log: list[dict[str, Any]]) -> list[float]:
    """The training loss logged at each step."""
    return [entry["loss"] for entry in log if "loss" in entry and "grad_norm" in entry]


def main(kind: str, argv: list[str] | None = None) -> None:
    """The examples' command line: under ``torchrun`` every rank trains under CP (cp = the
    world size) and rank 0 prints each step's loss beside that of the plain trainer, which it
    runs in a process of its own (``--reference``)."""
    parser = argparse.ArgumentParser(description=f"cpshard CP with {kind} on CPU")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--output-dir", default="cp-trainer-out")
    parser.add_argument("--reference", metavar="JSON", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.reference:
        result = train(kind, None, opts.output_dir + "-reference", steps=opts.steps)
        with open(opts.reference, "w") as f:
            json.dump({"losses": step_losses(result["log"]), "eval_loss": result["eval_loss"]}, f)
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result = train(kind, world, opts.output_dir, steps=opts.steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    path = opts.output_dir + "-reference.json"
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    subprocess.run(
        [sys.executable, sys.argv[0], "--steps", str(opts.steps), "--output-dir",
         opts.output_dir, "--reference", path],
        env=env, check=True,
    )  # fmt: skip
    with open(path) as f:
        reference = json.load(f)
    for step, (cp, one) in enumerate(zip(step_losses(result["log"]), reference["losses"], strict=True)):
        print(f"step {step}: loss {cp:.12f} (cp={world})  one process {one:.12f}")
    print(f"eval: loss {result['eval_loss']:.12f} (cp={world})  one process {reference['eval_loss']:.12f}")
