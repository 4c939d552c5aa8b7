"""Models whose layers mix tokens outside attention in a way cpshard does not shard (Mamba) are
refused under a CP context, on every rank and before any result, with the module named; outside
CP they run as before: a refusal, never a silently wrong step. W = 2 (the block-diagonal batch,
balanced) and W = 3 (contiguous, head_tail, stripe, per_document_head_tail). (Gated DeltaNet
hybrids and Mamba2 models run under CP: tests/integrations/test_hybrid_models.py,
test_mamba2_models.py.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from cpshard.integrations import transformers as cp_transformers  # noqa: E402


def _hybrid(name: str) -> torch.nn.Module:
    import transformers as T

    ssm = dict(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4)
    if name == "mamba":
        config = T.MambaConfig(**ssm)
    else:
        raise AssertionError(name)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.float64)
    cp_transformers.register()
    return model


HYBRIDS = {  # model -> the module its refusal names
    "mamba": "backbone.layers.0.mixer.conv1d",
}


def _refused(rank: int, world: int, name: str, layout: str) -> tuple[str, bool]:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    model = _hybrid(name)
    doc = torch.tensor([[1] * 7 + [2] * 5 + [0] * 2 + [3] * 6])
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    if layout == "blockdiag":
        ctx, local = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    else:
        ctx, local = ContextParallelSharder(dist.group.WORLD, layout).shard(batch)
    calls = []
    hook = model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    try:
        with ctx():
            model(input_ids=local["input_ids"], position_ids=local["position_ids"])
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    hook.remove()
    outside = model(input_ids=doc).logits  # outside CP the model runs unchanged
    return message, not calls and bool(torch.isfinite(outside).all())


def _refusals(
    rank: int, world: int, name: str, layouts: tuple[str, ...]
) -> dict[str, tuple[str, bool]]:
    return {layout: _refused(rank, world, name, layout) for layout in layouts}


# The layouts each world runs: the block-diagonal batch and every sharder layout, across the two.
WORLDS = {
    2: ("blockdiag", "balanced"),
    3: ("contiguous", "head_tail", "stripe", "per_document_head_tail"),
}


@pytest.mark.parametrize("world", list(WORLDS))
@pytest.mark.parametrize("name", list(HYBRIDS))
def test_hybrid_models_are_refused_on_every_rank(pools, name: str, world: int) -> None:
    results = pools(world).run(_refusals, name, WORLDS[world], timeout=120)
    for rank, outcomes in enumerate(results):
        assert list(outcomes) == list(WORLDS[world]), outcomes
        for layout, (message, clean) in outcomes.items():
            assert f"rank {rank}" in message and repr(HYBRIDS[name]) in message, (layout, message)
            assert "train wrong" in message, message
            assert clean, f"{name} W={world} {layout}: computed under CP before the refusal"
