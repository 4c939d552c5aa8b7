"""The step keeps the batch's token types for the whole padded row (what a model's mask reads
besides the documents: Gemma 3's image runs, PaliGemma's prefix), in global order, for every
layout and batch path; ranks whose token types differ, and malformed ones, raise on every rank.

The reference is the batch's own tensor padded to the step's length: each rank's step must hold
exactly it (not the rank's shard), beside the step's documents."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard.batch.token_types import TOKEN_TYPE_KEYS, step_token_types
from cpshard.layouts import LAYOUTS

# Batch paths: how the documents are given (the token types ride along in each).
PATHS = ("padded_rows", "position_ids", "cu_seqlens", "blockdiag")


def _batch(path: str, key: str, seed: int) -> dict[str, torch.Tensor]:
    """A batch of ``path`` with ``key`` holding random token types (-1..2 for block ids)."""
    g = torch.Generator().manual_seed(seed)
    if path == "padded_rows":  # two rows, right and interior padding by a validity mask
        valid = torch.tensor([[1] * 9 + [0] * 4, [0, 0] + [1] * 11])
        batch = {"input_ids": torch.randint(1, 50, (2, 13), generator=g), "attention_mask": valid}
    elif path == "position_ids":  # one packed row, documents where positions restart
        pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4, 5, 6, 0, 1]])
        batch = {"input_ids": torch.randint(1, 50, (1, 15), generator=g), "position_ids": pos}
    else:  # one packed row by cu_seqlens, a trailing pad
        batch = {
            "input_ids": torch.randint(1, 50, (1, 14), generator=g),
            "cu_seqlens": torch.tensor([0, 5, 6, 12]),
        }
    low = -1 if key == "block_sequence_ids" else 0
    batch[key] = torch.randint(low, 3, batch["input_ids"].shape, generator=g)
    return batch


def _shard(batch: dict[str, torch.Tensor], path: str, layout: str):
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    if path == "blockdiag":
        return make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    return ContextParallelSharder(dist.group.WORLD, layout).shard(batch)


def _carried(rank: int, world: int, layouts: list[str], paths: list[str]) -> list[str]:
    """Every (layout, path, key): the step's token types against the batch's, padded."""
    from cpshard.attention import active_state

    bad = []
    for i, (layout, path) in enumerate((lay, p) for lay in layouts for p in paths):
        if path == "blockdiag" and layout != layouts[0]:
            continue  # the block-diagonal batch has one layout
        key = TOKEN_TYPE_KEYS[i % len(TOKEN_TYPE_KEYS)]
        base = "cu_seqlens" if path == "blockdiag" else path
        batch = _batch(base, key, seed=i)
        ctx, local = _shard(batch, path, layout)
        with ctx():
            state = active_state()
            types = step_token_types(state.derived)
        padded = state.documents.shape[1]
        fill = -1 if key == "block_sequence_ids" else 0
        want = batch[key].new_full((batch[key].shape[0], padded), fill)
        want[:, : batch[key].shape[1]] = batch[key]
        where = f"rank {rank} W={world} {layout} {path} {key}"
        if set(types) != {key}:
            bad.append(f"{where}: keys {sorted(types)}")
        elif not torch.equal(types[key], want):
            bad.append(f"{where}: {types[key].tolist()} != {want.tolist()}")
        if local[key].shape != local["input_ids"].shape:
            bad.append(f"{where}: the model's shard of {key} is {tuple(local[key].shape)}")
    return bad


@pytest.mark.parametrize(
    "world,layouts",
    [
        (1, ["head_tail"]),
        (2, list(LAYOUTS)),
        (3, ["contiguous", "balanced"]),
        (4, ["stripe", "per_document_head_tail"]),
    ],
)
def test_token_types_are_kept_for_the_whole_row(pools, world: int, layouts: list[str]) -> None:
    results = pools(world).run(_carried, layouts, list(PATHS), timeout=120)
    bad = [m for r in results for m in r]
    assert not bad, bad[:10]


def _disagreeing(rank: int, world: int, path: str) -> str:
    """Rank 1's token types differ in one position: the error this rank raises."""
    batch = _batch("cu_seqlens", "token_type_ids", seed=5)
    if rank == 1:
        batch["token_type_ids"][0, 3] += 1
    try:
        _shard(batch, path, "head_tail")
    except ValueError as exc:
        return str(exc)
    return "no error"


def _malformed(rank: int, world: int, path: str) -> str:
    """Every rank's batch holds float token types: the error this rank raises."""
    batch = _batch("cu_seqlens", "token_type_ids", seed=5)
    batch["token_type_ids"] = batch["token_type_ids"].double()
    try:
        _shard(batch, path, "head_tail")
    except (TypeError, ValueError) as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("path", ["head_tail", "blockdiag"])
def test_token_types_must_agree_and_be_integers_on_every_rank(pools, path: str) -> None:
    for rank, message in enumerate(pools(2).run(_disagreeing, path, timeout=60)):
        assert "token types differs on rank 1" in message, (rank, message)
    for rank, message in enumerate(pools(2).run(_malformed, path, timeout=60)):
        assert f"rank {rank}" in message and "token_type_ids" in message, message
