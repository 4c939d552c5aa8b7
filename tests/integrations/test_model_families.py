"""The attention variants of today's model families under CP, through transformers: tiny random
configs, float64, one packed row of documents (some longer than every sliding window, interior
padding), every ContextParallelSharder layout and the block-diagonal batch, W = 1..4; and under the
head-parallel strategies (``heads`` at W = 2..4, ``hierarchical`` on 2-D meshes at W = 4), with
head counts that split unevenly over the ranks or leave a rank none.

The reference runs each document alone through a copy of the model whose attention is this
file's own float64 statement of the module's attention (causal, its sliding window, logit
soft-capping, sinks, its scaling), so neither cpshard nor transformers' float32-softmax eager
path is in it. Bounds: loss relative error < 1e-9, every gradient within 1e-8 of the largest.
Outside CP, the soft-capped and sinked families (Gemma 2, gpt-oss) against the same reference.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.distributed as dist

from tests.helpers import EXAMPLES, cp_mesh, recording_routes
from tests.integrations.harness import ModelLogits, check_relative_errors, step_errors

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import cp_decoder  # noqa: E402

from cpshard.integrations import transformers as cp_transformers  # noqa: E402

REFERENCE = "cpshard-test-reference"
ROWS = [[9, -2, 6, 3, -1, 7, -1]]  # documents of 9, 6, 3, 7 tokens; windows are 3 and 4
LOSS_TOL, GRAD_TOL = 1e-9, 1e-8


def _reference_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                         is_causal=None, **kwargs):  # fmt: skip
    """One document's attention, float64, from the module's own settings (no mask: the row is
    one document with no padding)."""
    n = query.shape[2]
    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    logits = (query @ k.transpose(-1, -2)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if kwargs.get("softcap") is not None:
        logits = kwargs["softcap"] * torch.tanh(logits / kwargs["softcap"])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = j <= i
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    if window is not None:
        visible &= i - j < window
    logits = logits.masked_fill(~visible, float("-inf"))
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, column], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    return (probs @ v).transpose(1, 2).contiguous(), None


def _config(family: str, heads: tuple[int, int] = (4, 2)):
    """``family``'s tiny config with ``heads`` = (query heads, key/value heads) of 8 dims (the
    hidden size too: 8 per query head)."""
    import transformers as T

    common = dict(
        vocab_size=64, hidden_size=8 * heads[0], intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=heads[0], num_key_value_heads=heads[1], head_dim=8,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    mixed = ["sliding_attention", "full_attention"]
    if family == "llama":  # the baseline: causal over the whole document, no variant
        return T.LlamaConfig(**common)
    if family == "mistral":
        return T.MistralConfig(**common, sliding_window=4)
    if family == "qwen2":  # layer 0 full, layer 1 sliding
        common.pop("head_dim")
        return T.Qwen2Config(**common, use_sliding_window=True, sliding_window=3, max_window_layers=1)
    if family == "gemma2":
        return T.Gemma2Config(
            **common, sliding_window=4, attn_logit_softcapping=0.1, final_logit_softcapping=None,
            query_pre_attn_scalar=8,
        )
    if family == "gemma3":
        return T.Gemma3TextConfig(**common, sliding_window=3, layer_types=mixed, query_pre_attn_scalar=8)
    if family == "cohere2":
        return T.Cohere2Config(**common, sliding_window=4, layer_types=mixed)
    if family == "gpt_oss":
        return T.GptOssConfig(
            **common, sliding_window=4, layer_types=mixed, num_local_experts=4,
            num_experts_per_tok=2, experts_implementation="eager",
        )
    if family == "deepseek_v3":  # query/key head dim 12, value head dim 16, MHA
        for name in ("head_dim", "num_key_value_heads"):
            common.pop(name)
        return T.DeepseekV3Config(
            **common, num_key_value_heads=heads[0], kv_lora_rank=16, q_lora_rank=None,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=16, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
            first_k_dense_replace=1, n_group=1, topk_group=1, experts_implementation="eager",
        )
    raise AssertionError(family)


FAMILIES = [
    "llama", "mistral", "qwen2", "gemma2", "gemma3", "cohere2", "gpt_oss", "deepseek_v3"
]


def _gemma_norm(self, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _cohere_norm(self, x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return self.weight * centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


# Norms that compute in float32 whatever the input: their float64 statement, so that rounding
# to float32 does not blur a float64 comparison (the same in the CP model and the reference).
_FLOAT32_NORMS = {"Gemma2RMSNorm": _gemma_norm, "Gemma3RMSNorm": _gemma_norm, "Cohere2LayerNorm": _cohere_norm}


def _model(family: str, heads: tuple[int, int] = (4, 2)) -> torch.nn.Module:
    import transformers

    cp_transformers.register()
    transformers.AttentionInterface.register(REFERENCE, _reference_attention)
    torch.manual_seed(0)
    config = _config(family, heads)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float64)
    with torch.no_grad():  # gpt-oss initialises its sinks to zero: make them matter
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.linspace(-1.0, 1.5, p.numel(), dtype=p.dtype))
    for module in model.modules():
        norm = _FLOAT32_NORMS.get(type(module).__name__)
        if norm is not None:
            module.forward = norm.__get__(module)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def _step(
    family: str, layout: str, group, strategy: str = "auto", mesh=None,
    heads: tuple[int, int] = (4, 2),
) -> tuple[float, float, float]:  # fmt: skip
    """One CP step sharded as ``layout`` (over ``mesh`` when given, a 2-D mesh whose flattening
    is ``group``) with CP attention's ``strategy``, and the per-document reference: (CP loss
    averaged over ranks, reference loss, worst gradient difference relative to the largest
    gradient)."""
    return step_errors(
        _model(family, heads), layout, group, seed=len(family), reference_attention=REFERENCE,
        logits=ModelLogits, strategy=strategy, mesh=mesh,
    )  # fmt: skip


def _layouts(world: int) -> list[str]:
    """Every layout and the block-diagonal batch (one rank: they are all one shard)."""
    from cpshard import LAYOUTS

    return ["blockdiag"] if world == 1 else [*LAYOUTS, "blockdiag"]


def _cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {
        f"{family} {layout}": _step(family, layout, dist.group.WORLD)
        for family in FAMILIES
        for layout in _layouts(world)
    }


def _vlm_step(layout: str, group) -> tuple[float, float, float]:
    """Qwen3-VL through the sharder: the merged inputs carry ``visual_pos_masks`` and one
    deepstack tensor per level, which the caller does not name; cpshard shards them as
    sequence-aligned entries."""
    import cp_vlm

    model = cp_vlm.tiny_vlm(0)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    cp_transformers.wrap_vision_tower(model)
    batch = cp_vlm.vlm_batch(model, cp_vlm.ROWS, 0)
    merged = cp_vlm.merged_inputs(model, batch)  # every rank runs the tower on every frame
    cp = cp_decoder.cp_loss(group, merged, lambda local: cp_vlm.decoder_logits(model, local), layout)
    ref = cp_decoder.reference_loss(reference, cp_vlm.vlm_documents(batch))
    cp_decoder.reference_backward(ref, reference, dist.get_world_size(group))
    return cp_decoder.compare(model, reference, cp, ref, group)


def _vlm_cases(rank: int, world: int) -> dict[str, tuple[float, float, float]]:
    return {layout: _vlm_step(layout, dist.group.WORLD) for layout in _layouts(world)}


# Every sharder layout and the block-diagonal batch at W = 2, 3 and 4 (W = 1 is one shard
# whatever the layout: the block-diagonal batch at W = 1 is in test_transformers.py). Run after
# the families, on their warm rank pools, the three worlds add about 5 s.
VLM_WORLDS = (2, 3, 4)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_families_match_each_document_alone(pools, world: int) -> None:
    check_relative_errors(pools(world).run(_cases, timeout=900), world, LOSS_TOL, GRAD_TOL)


@pytest.mark.parametrize("world", VLM_WORLDS)
def test_qwen3_vl_through_the_sharder_without_naming_its_buffers(pools, world: int) -> None:
    # absolute gradient bound: the vision rotary embedding computes in float32 (see
    # test_transformers.py)
    results = pools(world).run(_vlm_cases, timeout=600)
    assert all(sorted(cases) == sorted(_layouts(world)) for cases in results), results
    check_relative_errors(results, world, LOSS_TOL, 1e-9)


# name -> (family, (query heads, key/value heads)) under the head-parallel strategies; the
# uneven ones split over W = 4 ranks as: 4/1 one KV head replicated on every rank (its gradients
# summed back), 6/2 query heads 1, 2, 1, 2 (gpt-oss: its sinks sliced alike), 3/3 none on rank 2.
HEAD_MODELS = {
    "llama": ("llama", (4, 2)),
    "llama 4/1": ("llama", (4, 1)),
    "llama 3/3": ("llama", (3, 3)),
    "mistral": ("mistral", (4, 2)),
    "qwen2": ("qwen2", (4, 2)),
    "gemma2": ("gemma2", (4, 2)),
    "gemma3": ("gemma3", (4, 2)),
    "cohere2": ("cohere2", (4, 2)),
    "gpt_oss": ("gpt_oss", (4, 2)),
    "gpt_oss 6/2": ("gpt_oss", (6, 2)),
    "deepseek_v3": ("deepseek_v3", (4, 2)),
}
STRATEGY_LAYOUTS = ["head_tail", "stripe", "blockdiag"]
W2_ONLY = ("gpt_oss", "gemma3", "cohere2")  # (gpt-oss's sinks run split 1, 2, 1, 2 at W = 4)
NODE_MODELS = ["llama 4/1", "llama 3/3", "gemma2", "gpt_oss 6/2", "deepseek_v3"]
# world -> (strategy, 2-D mesh shape or None, the plan kind its calls take, models); a one-node
# mesh's hierarchical plan is its all-to-all alone (nothing exchanged between nodes).
STRATEGY_CASES = {
    2: [("heads", None, "heads", ["llama", "mistral", "gemma2", "gemma3", "cohere2", "gpt_oss",
                                  "deepseek_v3"])],  # fmt: skip
    3: [("heads", None, "heads", ["llama", "gpt_oss"])],
    4: [
        ("heads", None, "heads", [m for m in HEAD_MODELS if m not in W2_ONLY]),
        ("hierarchical", (2, 2), "hierarchical", NODE_MODELS),
        ("hierarchical", (1, 4), "hierarchical", ["llama"]),
    ],
}


def _strategy_cases(
    rank: int, world: int
) -> dict[str, tuple[tuple[float, float, float], str, list[str]]]:
    """Each case's errors, the plan kind it should take and the kinds its calls took."""
    out = {}
    for strategy, shape, kind, names in STRATEGY_CASES[world]:
        mesh = None if shape is None else cp_mesh(*shape)
        for name in names:
            family, heads = HEAD_MODELS[name]
            for layout in STRATEGY_LAYOUTS:
                with recording_routes() as kinds:
                    errors = _step(family, layout, dist.group.WORLD, strategy, mesh, heads)
                out[f"{name} {layout} {strategy} mesh {shape}"] = errors, kind, sorted(set(kinds))
    return out


@pytest.mark.parametrize("world", sorted(STRATEGY_CASES))
def test_families_under_head_parallel_strategies(pools, world: int) -> None:
    results = pools(world).run(_strategy_cases, timeout=600)
    for rank, cases in enumerate(results):
        for name, (_, kind, kinds) in cases.items():
            assert kinds == [kind], f"rank {rank} W={world} {name}: attention took {kinds}"
    errors = [{n: c[0] for n, c in cases.items()} for cases in results]
    check_relative_errors(errors, world, LOSS_TOL, GRAD_TOL)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_outside_cp_softcap_and_sinks_match_the_reference(family: str) -> None:
    """Outside a CP step the "cpshard" attention of a soft-capped (Gemma 2) or sinked (gpt-oss)
    model, sliding-window layers included, is plain attention on transformers' masks: one
    document longer than the windows gives the reference attention's loss and gradients."""
    model = _model(family)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation(REFERENCE)
    ids = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(len(family)))
    losses = []
    for m in (model, reference):
        logits = m(input_ids=ids).logits
        losses.append(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]))
        losses[-1].backward()
    got, want = (float(x.detach()) for x in losses)
    assert abs(got - want) <= LOSS_TOL * abs(want), (got, want)
    grads = dict(reference.named_parameters())
    largest = max(float(p.grad.abs().max()) for p in grads.values() if p.grad is not None)
    for name, p in model.named_parameters():
        h = grads[name].grad
        if p.grad is None or h is None:
            assert p.grad is None and h is None, name
            continue
        assert float((p.grad - h).abs().max()) <= GRAD_TOL * largest, name
