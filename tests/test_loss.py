"""The CP loss and gradient rule (cpshard.loss) at W = 1-4 on gloo against one process.

A tiny model that mixes tokens across the sequence (a causal running mean over the gathered
sequence), sharded contiguously: with ``cp_cross_entropy`` + ``reduce_cp_gradients(loss="split")``
every rank's loss sum and parameter gradients equal the single-process model's; the
``"replicated"`` rule averages instead; labels with ignored tokens, a rank without any labelled
token and a batch without any are covered.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard import cp_cross_entropy, gather_sequence, reduce_cp_gradients

F64 = torch.float64
V, H, B = 11, 6, 2


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.ModuleDict(
        {"emb": torch.nn.Embedding(V, H), "out": torch.nn.Linear(H, V), "unused": torch.nn.Linear(2, 2)}
    ).double()


def _forward(model, ids: torch.Tensor, group, start: int, length: int) -> torch.Tensor:
    h = model["emb"](ids)
    full = gather_sequence(h, group, seq_dim=1) if group is not None else h
    mixed = full.cumsum(1) / torch.arange(1, full.shape[1] + 1, dtype=F64).view(1, -1, 1)
    return model["out"](mixed[:, start : start + length])


def _labels(kind: str, seq: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    labels = torch.randint(0, V, (B, seq), generator=gen)
    if kind == "ignored":
        labels[:, ::3] = -100
    elif kind == "rank without labels":
        labels[:, : seq // world] = -100  # rank 0's whole shard
    elif kind == "no labels":
        labels[:] = -100
    return labels


def _check(rank: int, world: int) -> list[str]:
    group = dist.group.WORLD
    problems = []
    seq = 4 * world
    length = seq // world
    ids = torch.randint(0, V, (B, seq), generator=torch.Generator().manual_seed(1))
    for kind in ("all", "ignored", "rank without labels", "no labels"):
        labels = _labels(kind, seq, world)
        ref_model = _model()
        logits = _forward(ref_model, ids, None, 0, seq)
        count = (labels != -100).sum()
        ref = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="sum") / max(int(count), 1)
        ref.backward()
        for rule in ("split", "replicated"):
            model = _model()
            if rule == "split":
                start = rank * length
                local = _forward(model, ids[:, start : start + length], group, start, length)
                loss = cp_cross_entropy(local, labels[:, start : start + length], group)
                total = loss.detach().clone()
                dist.all_reduce(total)
            else:  # every rank computes the full loss from the gathered sequence
                local = _forward(model, ids[:, rank * length : (rank + 1) * length], group, 0, seq)
                loss = cp_cross_entropy(local, labels, None)
                total = loss.detach()
            loss.backward()
            reduce_cp_gradients(model, group, loss=rule)
            if not torch.allclose(total, ref.detach(), rtol=0, atol=1e-12):
                problems.append(f"{kind}/{rule}: loss {float(total)} vs {float(ref)}")
            for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
                expected = q.grad if q.grad is not None else torch.zeros_like(q)
                if not torch.allclose(p.grad, expected, rtol=0, atol=1e-10):
                    problems.append(f"{kind}/{rule}: grad of {name} off by {(p.grad - expected).abs().max():.3g}")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_loss_and_gradients_equal_single_process(pools, world):
    for rank, problems in enumerate(pools(world).run(_check, timeout=120)):
        assert problems == [], (rank, problems)


def test_bad_arguments():
    logits = torch.zeros(2, 3, V)
    with pytest.raises(ValueError, match="rank 0: logits"):
        cp_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long), None)
    with pytest.raises(TypeError, match="labels must be integers"):
        cp_cross_entropy(logits, torch.zeros(2, 3), None)
    with pytest.raises(TypeError, match="must be tensors"):
        cp_cross_entropy([1], torch.zeros(2, 3), None)
    with pytest.raises(ValueError, match="loss must be one of"):
        reduce_cp_gradients(torch.nn.Linear(2, 2), None, loss="mean")
    assert float(cp_cross_entropy(logits, torch.full((2, 3), -100), None)) == 0.0
