"""A CP training loop whose step planning runs in the DataLoader's worker processes, on CPU.

    torchrun --nproc-per-node 2 examples/cp_plan_ahead.py [--layout balanced] [--steps 3]

Every rank loads the same packed batches (the CP group shares its data). The collate function,
which runs in a DataLoader worker (a spawned process), calls the sharder's picklable planner
(``sharder.planner()``, the same as ``sharder.plan(batch)``): the step's layout and every
table its CP attention uses, pure host work that would otherwise run in ``shard()`` while the
accelerators wait. The training loop hands the plan to ``sharder.shard(batch, plan=plan)``,
which then does only the step's consensus round and the sharding; a plan made for another
batch, layout, rank, world size or strategy raises on every rank. The model here is a single
CP attention layer and a projection; each step prints the loss summed over the CP group.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

import cpshard


def packed_batches(count: int, seq_len: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``count`` packed rows of random documents (the same on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, seq_len // 2, (seq_len,), generator=gen).tolist()
        doc, i = [], 1
        while len(doc) < seq_len:
            doc += [i] * min(lengths[i], seq_len - len(doc))
            i += 1
        ids = torch.tensor([doc])
        tokens = torch.randint(1, 100, ids.shape, generator=gen)
        out.append({"input_ids": tokens, "labels": tokens.clone(), "_packed_seq_ids": ids})
    return out


class PlanningCollate:
    """The DataLoader's collate function: one packed batch and this rank's plan of its step
    (picklable: a spawned worker gets a copy)."""

    def __init__(self, planner: cpshard.StepPlanner) -> None:
        self.planner = planner

    def __call__(self, items: list[dict[str, torch.Tensor]]) -> tuple[dict[str, Any], Any]:
        batch = items[0]
        return batch, self.planner(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="balanced")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    group = dist.group.WORLD
    sharder = cpshard.ContextParallelSharder(group, args.layout)
    loader = torch.utils.data.DataLoader(
        packed_batches(args.steps, args.seq_len),
        batch_size=1,
        num_workers=1,
        collate_fn=PlanningCollate(sharder.planner()),  # this rank's planner, not the group
        multiprocessing_context="spawn",
    )
    torch.manual_seed(0)  # the same weights on every rank
    embed = torch.nn.Embedding(100, 32)
    head = torch.nn.Linear(32, 100)
    params = [*embed.parameters(), *head.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for step, (batch, plan) in enumerate(loader):
        train_ctx, local = sharder.shard(batch, plan=plan)  # no planning left on this path
        with train_ctx():
            x = embed(local["input_ids"])  # [B, L, 32]
            q = x.view(*x.shape[:2], 4, 8).transpose(1, 2)  # [B, H, L, D]
            attended = cpshard.cp_attention(q, q, q, position_ids=local["position_ids"])
            logits = head(attended.transpose(1, 2).reshape(x.shape))
            loss = cpshard.cp_cross_entropy(logits, local.targets.labels, group)
        loss.backward()
        cpshard.reduce_cp_gradients(torch.nn.ModuleList([embed, head]), group)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if dist.get_rank() == 0:
            print(f"step {step}: loss {total.item() / dist.get_world_size():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
