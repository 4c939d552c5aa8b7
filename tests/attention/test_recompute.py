"""Activation checkpointing under CP with ``backward()`` called after the step's context has
exited: the recompute of each checkpointed layer finds its step through the sharded batch's
``position_ids`` (:func:`cpshard.attention.tokens.state_for_tokens`).

* transformers' own checkpointing and torch's ``checkpoint_wrapper``, under FSDP2 over the
  flattened (2, 2) mesh, three steps: equal to the single-process training;
* a recompute whose step's context object was dropped before ``backward()``: a ``RuntimeError``
  on every rank that says it is the recompute and what to do.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from tests.helpers import EXAMPLES
from tests.test_fsdp_composition import check_training

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import cp_fsdp  # noqa: E402

import cpshard  # noqa: E402


def _checkpointed(rank: int, world: int) -> dict[str, dict]:
    return {
        how: cp_fsdp.train(rank, world, 2, 2, "flat", 3, "head_tail", checkpointing=how)
        for how in ("hf", "wrapper")
    }


def test_checkpointed_layers_recompute_under_their_step(pool4):
    check_training(pool4.run(_checkpointed, timeout=300))


def _dropped_context(rank: int, world: int) -> str:
    """A checkpointed attention whose context is dropped before backward: the error text."""
    ids = torch.arange(8).remainder(5).view(1, 8)
    batch = {"input_ids": ids, "_packed_seq_ids": torch.tensor([[1] * 5 + [2] * 3])}
    ctx, local = cpshard.ContextParallelSharder(dist.group.WORLD, "head_tail").shard(batch)
    q = torch.randn(1, 2, local["input_ids"].shape[1], 4, dtype=torch.float64, requires_grad=True)

    def layer(x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return cpshard.cp_attention(x, x, x, position_ids=position_ids)

    with ctx():
        out = checkpoint(layer, q, position_ids=local["position_ids"], use_reentrant=False)
    del ctx
    try:
        out.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_recompute_without_its_step_says_so(pool2):
    for rank, message in enumerate(pool2.run(_dropped_context, timeout=60)):
        assert f"rank {rank}: an activation-checkpoint recompute in backward" in message, message
        assert "keep the context returned by" in message, message
