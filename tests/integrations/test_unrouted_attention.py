"""Models whose attention does not go through cpshard are refused under a CP context, on every
rank, naming the module: a plain PyTorch decoder that calls ``F.scaled_dot_product_attention``
itself, whatever its class is called (found by what it does), and transformers' families with
their own attention code (BLOOM and MPT with ALiBi, Falcon with RoPE and with ALiBi), listed by
name with the reason (Falcon's ALiBi path reads a dense mask before any attention runs). A model routed through cpshard at
the same W is never refused: the same decoder with its attention calling ``cp_attention``, and
a ``register()``ed transformers model, are exact against each document alone (the
model-family tests run the others exact). Refusals over random token ids at W = 1..4, the
block-diagonal batch and every sharder layout (four at W = 2, one at the others); the routed
models at W = 2, the block-diagonal batch and a sharder layout."""

from __future__ import annotations

import copy
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.helpers import EXAMPLES, cp_aware_decoder, plain_sdpa_decoder
from tests.integrations.harness import check_relative_errors, relative_step_errors

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402

from cpshard.integrations import transformers as cp_transformers  # noqa: E402


def _model(name: str) -> torch.nn.Module:
    import transformers as T

    if name == "sdpa_decoder":
        torch.manual_seed(0)
        return plain_sdpa_decoder().to(torch.float64)
    if name == "bloom":
        config = T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    elif name == "mpt":
        config = T.MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=1, max_seq_len=64)
    elif name in ("falcon_rope", "falcon_alibi"):
        config = T.FalconConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
            alibi=name == "falcon_alibi", new_decoder_architecture=False, multi_query=True,
        )  # fmt: skip
    else:
        raise AssertionError(name)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.float64)
    cp_transformers.register()
    model.set_attn_implementation("cpshard")
    return model


MODELS = {  # model -> the module its refusal names
    "bloom": "transformer.h.0.self_attention",
    "mpt": "transformer.blocks.0.attn",
    "falcon_rope": "transformer.h.0.self_attention",
    "falcon_alibi": "transformer.h.0.self_attention",
    "sdpa_decoder": "blocks.0.attn",
}


ROWS = [[7, 5, -2, 6]]  # documents of 7, 5 and 6 tokens, interior padding


def _refused(rank: int, world: int, name: str, layout: str) -> tuple[str, bool]:
    """This rank's error (or 'no error') for ``name``'s first forward under ``layout``, and
    whether the model then runs outside CP (finite logits)."""
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    model = _model(name)
    batch = cp_decoder.packed_batch(ROWS, 48, seed=2)
    if layout == "blockdiag":
        ctx, local = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
    else:
        ctx, local = ContextParallelSharder(dist.group.WORLD, layout).shard(batch)
    kwargs = {} if name == "sdpa_decoder" else {"use_cache": False}
    try:
        with ctx():
            model(input_ids=local["input_ids"], position_ids=local["position_ids"], **kwargs)
        message = "no error"
    except ValueError as exc:
        message = str(exc)
    ids = batch["input_ids"]
    outside = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])
    logits = outside if isinstance(outside, torch.Tensor) else outside.logits
    return message, bool(torch.isfinite(logits).all())


# world -> the layouts a refusal is tried in: the block-diagonal batch and every sharder layout
# over W = 1..4 (several at W = 2).
REFUSAL_GRID = {
    1: ["blockdiag"],
    2: ["blockdiag", "head_tail", "stripe", "balanced"],
    3: ["per_document_head_tail"],
    4: ["contiguous"],
}


def _refusals(rank: int, world: int) -> dict[str, tuple[str, bool]]:
    return {
        f"{name} {layout}": _refused(rank, world, name, layout)
        for name in MODELS
        for layout in REFUSAL_GRID[world]
    }


@pytest.mark.parametrize("world", sorted(REFUSAL_GRID))
def test_attention_outside_cpshard_is_refused_on_every_rank(pools, world: int) -> None:
    """Every rank raises; a rank whose shard shows the mixing names itself and the module (its
    attention; under ``stripe`` Falcon's model, whose mask from the shard's positions is what
    mixes them), the others the rank that failed."""
    results = pools(world).run(_refusals, timeout=300)
    for case in results[0]:
        name, layout = case.split()
        module = MODELS[name]
        named = []
        for rank, outcomes in enumerate(results):
            message, finite = outcomes[case]
            assert finite, f"{case}: outside CP the model no longer runs"
            if message.startswith(f"cpshard CP attention: rank {rank}: "):
                assert f"module {module!r}" in message, (rank, case, message)
                if name == "sdpa_decoder":  # found by what it does
                    assert "without cpshard" in message and "train wrong" in message, message
                else:  # transformers' own-attention families: refused by name, saying why
                    assert "its attention is the model's own code" in message, (case, message)
                named.append(rank)
            else:
                assert "failed its checks" in message, (rank, case, message)
        assert named, f"{case}: no rank named the module: {[r[case] for r in results]}"


class _Logits(torch.nn.Module):
    """A model's ``(input_ids, position_ids) -> logits`` as ``.logits`` (positions from 0 when
    none are given: a document run alone)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        out = self.model(input_ids=input_ids, position_ids=position_ids)
        return SimpleNamespace(logits=out if isinstance(out, torch.Tensor) else out.logits)


def _routed_model(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(model, reference)``: a user's decoder whose attention calls ``cp_attention`` (outside
    CP: plain SDPA), or transformers' Llama with the ``"cpshard"`` attention (reference:
    ``"sdpa"``)."""
    if name == "own_decoder":
        torch.manual_seed(0)
        model = cp_aware_decoder().to(torch.float64)
        return model, copy.deepcopy(model)
    model = cp_decoder.tiny_decoder("llama")
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    return model, reference


def _routed(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    """Each model routed through cpshard, one CP step per layout against each document alone."""
    out = {}
    for name in ("own_decoder", "llama"):
        for layout in ("blockdiag", "head_tail"):
            model, reference = _routed_model(name)
            batch = cp_decoder.packed_batch(ROWS, 48, seed=2)
            logits = _Logits(model)

            def forward(local: dict[str, torch.Tensor]) -> torch.Tensor:
                return logits(local["input_ids"], local["position_ids"]).logits

            cp = cp_decoder.cp_loss(dist.group.WORLD, batch, forward, layout)
            ref = cp_decoder.reference_loss(_Logits(reference), cp_decoder.text_documents(batch))
            cp_decoder.reference_backward(ref, reference, world)
            errors = relative_step_errors(model, reference, cp, ref, dist.group.WORLD)
            out[f"{name} {layout}"] = errors
    return out


def test_attention_routed_through_cpshard_is_never_refused(pool2) -> None:
    """The same user's decoder with its attention calling ``cp_attention``, and a ``register()``ed
    transformers model, run their step (a refusal would raise here) and are exact."""
    check_relative_errors(pool2.run(_routed, timeout=300), 2)
