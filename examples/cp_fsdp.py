"""Context parallelism under FSDP2 on a (dp, cp) device mesh: a tiny Llama trained for a few
steps on packed batches, on CPU, beside the same training in one process.

    torchrun --nproc-per-node 4 examples/cp_fsdp.py --dp 2 --cp 2 [--fsdp flat|hsdp|dp]
        [--layout balanced] [--steps 5] [--checkpointing hf|wrapper] [--compile]
    python examples/cp_fsdp.py --dp 2 --cp 2 ...      (spawns the dp x cp gloo ranks itself)

Every rank builds the same tiny random Llama (float64). Each data-parallel replica gets its own
packed batch from transformers' ``DataCollatorWithFlattening`` (restarting ``position_ids``),
which :class:`cpshard.ContextParallelSharder` shards over the replica's CP ranks. The loss is
:func:`cpshard.cp_cross_entropy` over the CP group; the model is wrapped with FSDP2
(``fully_shard``) in one of three ways:

* ``flat`` — over the flattened (dp, cp) mesh (the torchtitan / NeMo recipe): FSDP2's averaging
  over every rank is the whole gradient reduction;
* ``hsdp`` — replicate over dp, shard over cp (the 2-D mesh): the same;
* ``dp`` — over the dp ranks alone: the one extra line is
  ``cpshard.reduce_cp_gradients(model, cp_group)`` after ``backward()``.

AdamW with gradient clipping steps the model; ``backward()`` runs after the step's
``with ctx():`` has exited (activation-checkpoint recomputes there find their step). It prints
each step's CP loss (the mean over the ranks) beside the single-process loss (each replica's
documents run one by one, the replicas' losses averaged) and, at the end, the largest
parameter difference.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cpshard
from cpshard.integrations import transformers as cp_transformers

FSDP_MODES = ("flat", "hsdp", "dp")
CHECKPOINTING = ("none", "hf", "wrapper")
LR, CLIP = 1e-2, 1.0


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A tiny random Llama (float64, 2 layers) with the ``"cpshard"`` attention."""
    import transformers

    cp_transformers.register()
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.float64)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def documents(step: int, replica: int, vocab: int = 64) -> list[list[int]]:
    """The token ids of each document of a replica's packed batch at ``step`` (2-5 documents of
    1-14 tokens; the same on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + replica)
    count = int(torch.randint(2, 6, (), generator=g))
    lengths = torch.randint(1, 15, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def packed(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    """The documents packed into one row by transformers' ``DataCollatorWithFlattening``."""
    import transformers

    collate = transformers.DataCollatorWithFlattening(return_tensors="pt")
    return dict(collate([{"input_ids": d} for d in docs]))


def reference_loss(model: torch.nn.Module, docs: list[list[int]]) -> torch.Tensor:
    """One replica's token-mean loss in one process: each document run alone, every token
    predicting the next one of its document."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for d in docs:
        ids = torch.tensor([d])
        logits = model(input_ids=ids).logits[0, :-1]
        total = total + F.cross_entropy(logits, ids[0, 1:], reduction="sum")
        count += len(d) - 1
    return total / max(count, 1)


def _checkpoint(model: torch.nn.Module, how: str) -> None:
    """Activation checkpointing of every decoder layer: transformers' own, or torch's
    ``checkpoint_wrapper``."""
    if how == "hf":
        enable = (
            getattr(model, "activation_checkpointing_enable", None)
            or model.gradient_checkpointing_enable
        )
        enable()
    elif how == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        layer = type(model.model.layers[0])
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer))


def _shard(model: torch.nn.Module, mesh: Any, fsdp: str) -> None:
    """FSDP2 over each decoder layer and the root, on the mesh ``fsdp`` names."""
    from torch.distributed.fsdp import fully_shard

    target = {"flat": mesh["dp", "cp"]._flatten("dp_cp"), "hsdp": mesh, "dp": mesh["dp"]}[fsdp]
    for layer in model.model.layers:
        fully_shard(layer, mesh=target)
    fully_shard(model, mesh=target)


def _plain_name(name: str) -> str:
    return name.replace("_checkpoint_wrapped_module.", "")


def train(
    rank: int,
    world: int,
    dp: int,
    cp: int,
    fsdp: str = "flat",
    steps: int = 3,
    layout: str = "balanced",
    checkpointing: str = "none",
    compile: bool = False,
) -> dict[str, Any]:
    """Train on this rank (``dp * cp == world``) and in one process alongside; returns the
    per-step CP losses (mean over ranks), reference losses and the largest parameter
    difference at the end (every rank returns the same)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dp * cp != world:
        raise ValueError(f"rank {rank}: dp * cp = {dp} * {cp} must be the world size {world}")
    mesh = init_device_mesh("cpu", (dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group, replica = mesh["cp"].get_group(), mesh.get_local_rank("dp")

    model = tiny_llama()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    _checkpoint(model, checkpointing)
    _shard(model, mesh, fsdp)
    forward = torch.compile(model) if compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    sharder = cpshard.ContextParallelSharder(cp_group, layout)

    cp_losses, ref_losses = [], []
    for step in range(steps):
        ctx, local = sharder.shard(packed(documents(step, replica)))
        with ctx():
            out = forward(
                input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
            )
            loss = cpshard.cp_cross_entropy(out.logits, local.targets.labels, cp_group)
        loss.backward()  # outside the context: checkpoint recomputes find their step
        if fsdp == "dp":  # FSDP2 averaged over dp only: average over the CP ranks too
            cpshard.reduce_cp_gradients(model, cp_group)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        cp_losses.append(float(mean) / world)

        ref = sum(reference_loss(reference, documents(step, d)) for d in range(dp)) / dp
        ref.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref.detach()))

    want = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        worst = max(worst, float((full.detach() - want[_plain_name(name)].detach()).abs().max()))
    return {"cp": cp_losses, "reference": ref_losses, "max_param_diff": worst}


def _print(result: dict[str, Any], title: str) -> None:
    print(title)
    for step, (cp, ref) in enumerate(zip(result["cp"], result["reference"], strict=True)):
        print(f"step {step}: CP loss {cp:.15f}  single-process loss {ref:.15f}")
    print(
        f"max |parameter difference| after {len(result['cp'])} steps: "
        f"{result['max_param_diff']:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--fsdp", choices=FSDP_MODES, default="flat")
    parser.add_argument("--layout", choices=cpshard.LAYOUTS, default="balanced")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpointing", choices=CHECKPOINTING, default="none")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = parser.parse_args()
    run = functools.partial(
        train,
        dp=args.dp,
        cp=args.cp,
        fsdp=args.fsdp,
        steps=args.steps,
        layout=args.layout,
        checkpointing=args.checkpointing,
        compile=args.compile,
    )
    title = f"FSDP2 {args.fsdp}, dp={args.dp} x cp={args.cp}, {args.layout}"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        result = run(dist.get_rank(), dist.get_world_size())
        if dist.get_rank() == 0:
            _print(result, title)
        dist.destroy_process_group()
    else:
        from cpshard.testing import run_ranks

        _print(run_ranks(_spawned, args.dp * args.cp, run, timeout=600)[0], title)


def _spawned(rank: int, world: int, run: Any) -> dict[str, Any]:
    return run(rank, world)


if __name__ == "__main__":
    main()
