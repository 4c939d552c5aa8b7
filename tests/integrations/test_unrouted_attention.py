"""Models whose attention does not go through cpshard are refused under a CP context, on every
rank, naming the module, whatever its class is called: transformers' families with their own
attention code (BLOOM and MPT with ALiBi, Falcon with RoPE and with ALiBi) and a plain PyTorch
decoder that calls ``F.scaled_dot_product_attention`` itself. A model routed through cpshard at the same W is never
refused (tests/integrations/test_model_families.py and the hybrid tests run them exact). W = 2,
the block-diagonal batch and a sharder layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from cpshard.integrations import transformers as cp_transformers  # noqa: E402


class _SdpaAttention(torch.nn.Module):
    """Causal self-attention written the plain PyTorch way (one SDPA call)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.attention = _SdpaAttention(width, heads)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                       torch.nn.Linear(2 * width, width))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm(x))
        return x + self.mlp(x)


class SdpaDecoder(torch.nn.Module):
    """A user's decoder with no transformers in it."""

    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _model(name: str) -> torch.nn.Module:
    import transformers as T

    if name == "sdpa_decoder":
        torch.manual_seed(0)
        return SdpaDecoder().to(torch.float64)
    if name == "bloom":
        config = T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4)
    elif name == "mpt":
        config = T.MptConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=64)
    elif name in ("falcon_rope", "falcon_alibi"):
        config = T.FalconConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
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
    "sdpa_decoder": "layers.0.attention",
}


def _refused(rank: int, world: int, name: str, layout: str) -> tuple[str, bool]:
    import torch.distributed as dist

    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    model = _model(name)
    doc = torch.tensor([[1] * 7 + [2] * 5 + [0] * 2 + [3] * 6])
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
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
    outside = model(input_ids=doc)  # outside CP the model runs unchanged
    logits = outside if isinstance(outside, torch.Tensor) else outside.logits
    return message, bool(torch.isfinite(logits).all())


def _refusals(rank: int, world: int, name: str) -> dict[str, tuple[str, bool]]:
    return {layout: _refused(rank, world, name, layout) for layout in LAYOUTS}


LAYOUTS = ("blockdiag", "head_tail")


@pytest.mark.parametrize("name", list(MODELS))
def test_attention_outside_cpshard_is_refused_on_every_rank(pool2, name: str) -> None:
    for rank, outcomes in enumerate(pool2.run(_refusals, name, timeout=300)):
        for layout, (message, finite) in outcomes.items():
            assert f"rank {rank}" in message and repr(MODELS[name]) in message, (layout, message)
            assert "without cpshard" in message and "train wrong" in message, message
            assert finite, f"{name} {layout}: outside CP the model no longer runs"
