"""CP attention knows whose tokens it attends: tokens sharded for another layout (or step) raise.

A sharded batch's ``position_ids`` belong to the step (and layout) whose context came with it.
Attention run on them under another context, or outside any context, used to attend wrongly
without an error whenever the local lengths agreed (a ``stripe`` or ``head_tail`` shard under
the block-diagonal context: loss and gradients far off). Now it raises on every rank, through the
transformers ``"cpshard"`` attention (which receives the model's ``position_ids``) and through
``cp_attention(position_ids=...)``; tensors nobody registered are not checked.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.helpers import EXAMPLES

pytest.importorskip("transformers")

sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402

# S = 24, a multiple of 2W for W = 2 and 4: every layout gives each rank the block-diagonal
# split's local length, so only the tokens' origin tells the layouts apart.
ROWS = [[7, 5, -2, 6, -4], [9, -1, 4, 6, 4]]
OTHER_ROWS = [[3, 8, 6, -1, 6], [12, 12]]
NO_ERROR = "no error"


def _outcome(call: Callable[[], object]) -> str:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return NO_ERROR


def _cases(rank: int, world: int) -> dict[str, str]:
    """Each case's outcome on this rank: the error text, or 'no error'."""
    from cpshard import ContextParallelSharder, check_mode, cp_attention
    from cpshard import make_cp_blockdiag_batch_and_ctx as blockdiag_batch
    from cpshard.nemo.components.distributed.blockdiag_cp.batch import (
        make_cp_blockdiag_batch_and_ctx as nemo_blockdiag_batch,
    )

    group = dist.group.WORLD
    model = cp_decoder.tiny_decoder("llama")
    batch = cp_decoder.packed_batch(ROWS, 64)
    other = cp_decoder.packed_batch(OTHER_ROWS, 64, seed=1)
    local_len = 24 // world
    q = torch.randn(2, 4, local_len, 8, dtype=torch.float64)
    kv = torch.randn(2, 2, local_len, 8, dtype=torch.float64)

    def run_model(local: dict) -> Callable[[], object]:
        return lambda: model(input_ids=local["input_ids"], position_ids=local["position_ids"])

    def attend(positions: torch.Tensor | None) -> Callable[[], object]:
        return lambda: cp_attention(q, kv, kv, enable_gqa=True, position_ids=positions)

    def inside(ctx: Callable, call: Callable[[], object], mode: str = "step") -> str:
        def run() -> None:
            with check_mode(mode), ctx():
                call()

        return _outcome(run)

    blockdiag_ctx, blockdiag_local = blockdiag_batch(group, None, dict(batch))
    out = {}
    for layout in ("stripe", "head_tail"):
        sharder_ctx, local = ContextParallelSharder(group, layout).shard(dict(batch))
        assert local["input_ids"].shape == blockdiag_local["input_ids"].shape  # equal lengths
        for mode in ("step", "call"):
            out[f"{layout} under blockdiag, model, {mode}"] = inside(
                blockdiag_ctx, run_model(local), mode
            )
            out[f"{layout} under blockdiag, cp_attention, {mode}"] = inside(
                blockdiag_ctx, attend(local["position_ids"]), mode
            )
        out[f"blockdiag under {layout}, model"] = inside(sharder_ctx, run_model(blockdiag_local))
        out[f"{layout} outside, model"] = _outcome(run_model(local))
        out[f"{layout} outside, cp_attention"] = _outcome(attend(local["position_ids"]))
        out[f"{layout} its own context, model"] = inside(sharder_ctx, run_model(local))
    out["blockdiag outside, model"] = _outcome(run_model(blockdiag_local))
    out["blockdiag its own context, model"] = inside(blockdiag_ctx, run_model(blockdiag_local))

    # Unregistered positions (a copy; none, so the model derives them) are not checked.
    copy = {**blockdiag_local, "position_ids": blockdiag_local["position_ids"].clone()}
    out["copy under blockdiag, model"] = inside(blockdiag_ctx, run_model(copy))
    out["copy outside, model"] = _outcome(run_model(copy))
    out["no positions under blockdiag, cp_attention"] = inside(blockdiag_ctx, attend(None))

    # A stale batch of the previous step, under the next step's context (the previous context
    # still alive, or dropped).
    sharder = ContextParallelSharder(group, "head_tail")
    stale_ctx, stale = sharder.shard(dict(batch))
    next_ctx, _ = sharder.shard(dict(other))
    out["stale head_tail, model"] = inside(next_ctx, run_model(stale))
    _, stale_blockdiag = blockdiag_batch(group, None, dict(batch))
    gc.collect()  # the stale step's state is gone
    next_blockdiag_ctx, _ = blockdiag_batch(group, None, dict(other))
    out["stale blockdiag, context dropped, model"] = inside(
        next_blockdiag_ctx, run_model(stale_blockdiag)
    )
    del stale_ctx

    # Checked mode: one rank's stale tokens make every rank raise.
    out["rank 0 stale, checked"] = inside(
        next_ctx, attend(stale["position_ids"] if rank == 0 else None), "call"
    )

    # NeMo's block-diagonal batch (padded positions zeroed in place: still the step's tokens;
    # S = 23 pads the last rank).
    nemo = cp_decoder.packed_batch([[7, 5, -2, 6, -3], [9, -1, 4, 6, 3]], 64)
    _, nemo_local = nemo_blockdiag_batch(group, None, dict(nemo))
    out["nemo blockdiag outside, model"] = _outcome(run_model(nemo_local))
    return out


FOREIGN = "sharded batch attended under the active 'contiguous' CP attention context"
OUTSIDE = "sharded tokens passed outside their step's CP attention context"
EXPECTED = {
    **{
        f"{layout} under blockdiag, {via}, {mode}": (
            f"cpshard.cp_attention: rank {{rank}}: position_ids: tokens of a '{layout}' {FOREIGN}"
        )
        for layout in ("stripe", "head_tail")
        for via in ("model", "cp_attention")
        for mode in ("step", "call")
    },
    **{
        f"blockdiag under {layout}, model": (
            "tokens of a 'contiguous' sharded batch attended under the active "
            f"'{layout}' CP attention context"
        )
        for layout in ("stripe", "head_tail")
    },
    **{
        f"{layout} outside, {via}": f"{what}: rank {{rank}}: position_ids: {OUTSIDE}"
        for layout in ("stripe", "head_tail")
        for via, what in (
            ("model", "cpshard.integrations.transformers"),
            ("cp_attention", "cpshard.cp_attention"),
        )
    },
    "blockdiag outside, model": f"rank {{rank}}: position_ids: {OUTSIDE} (a 'contiguous' batch)",
    "nemo blockdiag outside, model": f"rank {{rank}}: position_ids: {OUTSIDE}",
    "stale head_tail, model": (
        "tokens of another step's 'head_tail' sharded batch attended under the active "
        "'head_tail' CP attention context; run the model on the batch the context came with"
    ),
    "stale blockdiag, context dropped, model": "tokens of another step's 'contiguous' sharded",
    "stripe its own context, model": None,
    "head_tail its own context, model": None,
    "blockdiag its own context, model": None,
    "copy under blockdiag, model": None,
    "copy outside, model": None,
    "no positions under blockdiag, cp_attention": None,
}


@pytest.mark.parametrize("world", [2, 4])
def test_attention_knows_whose_tokens_it_attends(pools, world: int) -> None:
    """Each case on EVERY rank: the expected error (naming the rank), or no error."""
    for rank, outcomes in enumerate(pools(world).run(_cases, timeout=300)):
        for name, want in EXPECTED.items():
            got = outcomes[name]
            if want is None:
                assert got == NO_ERROR, (rank, name, got)
            else:
                assert want.format(rank=rank) in got, (rank, name, got)
        checked = outcomes["rank 0 stale, checked"]
        expect = "another step's 'head_tail'" if rank == 0 else "rank 0 failed its checks"
        assert expect in checked, (rank, checked)
        assert set(outcomes) == set(EXPECTED) | {"rank 0 stale, checked"}
