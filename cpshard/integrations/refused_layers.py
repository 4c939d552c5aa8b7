"""transformers layers refused under CP by name, with the reason: what cpshard cannot shard and
what its name-free guard would meet only as a crash from inside the model.

* Sparse-attention indexers (DeepSeek Sparse Attention: DeepSeek-V3.2, GLM-5 and their kin): a
  DSA layer's indexer scores every key for each query with projections of its own and keeps
  the top k, which the attention then reads as its mask. cpshard shards the attention, not
  that selection: under CP the indexer would score this rank's shard alone (and it reads a
  dense mask cpshard does not build).
* Attention written in the model's own code with ALiBi biases (BLOOM, MPT, Falcon): it never
  calls transformers' attention interface, so the ``"cpshard"`` implementation never runs it,
  and Falcon's model adds ALiBi onto a dense mask cpshard does not build.

The classes are listed with :mod:`cpshard.guard.refusals` (keyed by name: nothing is imported),
so a model holding one is refused before it runs, on every rank, naming the module and why.
"""

from __future__ import annotations

from cpshard.guard import refusals

_MODELS = "transformers.models"
INDEXER = (
    "it is a sparse-attention indexer (DeepSeek Sparse Attention), which picks each query's "
    "top-k keys by its own scores over the whole sequence; cpshard shards the attention but "
    "not that selection, which would score this rank's shard alone. Train this model without CP"
)
OWN_ATTENTION = (
    "its attention is the model's own code (ALiBi biases), not transformers' attention "
    "interface, so the \"cpshard\" attention never runs it and it would attend within this "
    "rank's shard alone. Train this model without CP"
)
# modeling module -> its refused classes and why
REFUSED = {
    f"{_MODELS}.deepseek_v32.modeling_deepseek_v32": (("DeepseekV32Indexer",), INDEXER),
    f"{_MODELS}.glm_moe_dsa.modeling_glm_moe_dsa": (("GlmMoeDsaIndexer",), INDEXER),
    f"{_MODELS}.glm5_next.modeling_glm5_next": (("Glm5NextTextIndexer",), INDEXER),
    f"{_MODELS}.deepseek_v4.modeling_deepseek_v4": (("DeepseekV4Indexer",), INDEXER),
    f"{_MODELS}.mistral_large4.modeling_mistral_large4": (("MistralLarge4TextIndexer",), INDEXER),
    f"{_MODELS}.dots3_note.modeling_dots3_note": (("Dots3NoteTextIndexer",), INDEXER),
    f"{_MODELS}.hy_v4.modeling_hy_v4": (("HYV4Indexer",), INDEXER),
    f"{_MODELS}.hy_v4_vl.modeling_hy_v4_vl": (("HYV4VLIndexer",), INDEXER),
    f"{_MODELS}.kolibri1_1.modeling_kolibri1_1": (("Kolibri1_1Indexer",), INDEXER),
    f"{_MODELS}.minimax_m3_vl.modeling_minimax_m3_vl": (("MiniMaxM3VLIndexer",), INDEXER),
    f"{_MODELS}.qwen4_exp.modeling_qwen4_exp": (("Qwen4ExpTextQSAIndexer",), INDEXER),
    f"{_MODELS}.axk2.modeling_axk2": (("AXK2Indexer",), INDEXER),
    f"{_MODELS}.bloom.modeling_bloom": (("BloomAttention",), OWN_ATTENTION),
    f"{_MODELS}.mpt.modeling_mpt": (("MptAttention",), OWN_ATTENTION),
    f"{_MODELS}.falcon.modeling_falcon": (("FalconAttention", "FalconFlashAttention2"), OWN_ATTENTION),
}


def refuse() -> None:
    """List every class of :data:`REFUSED` as refused under CP."""
    for module, (classes, reason) in REFUSED.items():
        for cls in classes:
            refusals.note(f"{module}.{cls}", reason)


def refused_classes() -> dict[str, str]:
    """``{module.class: reason}`` of every listed class."""
    return {f"{m}.{c}": why for m, (classes, why) in REFUSED.items() for c in classes}
