"""cpshard's transformers hooks installed family by family (:mod:`cpshard.integrations.hooks`): a
modeling module that does not match (a hooked function missing, or taking other parameters) is
left alone and its models are refused under CP on every rank, saying which family, which
transformers and what to do, while every other family works (Llama steps exactly in the same
process); a missing fused-kernel entry is no mismatch; functions the ``kernels`` package wraps
are read through; sparse-attention indexers are refused with their reason."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.integrations.harness import check_relative_errors, step_errors, tiny_model

pytest.importorskip("transformers")

from cpshard.integrations import hooks  # noqa: E402
from cpshard.integrations import transformers as cp_transformers  # noqa: E402

MAMBA = "transformers.models.mamba.modeling_mamba"


def _mamba_config():
    import transformers as T

    return T.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=4, residual_in_fp32=False, use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip


def _llama_config():
    import transformers as T

    return T.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
    )  # fmt: skip


def _stand_in(name: str, without: str) -> types.ModuleType:
    """A copy of the modeling module ``name`` (its classes and functions the same objects)
    without ``without``, as a transformers release that dropped it would be."""
    import importlib

    real = importlib.import_module(name)
    copy = types.ModuleType(name)
    for attr, value in vars(real).items():
        value = getattr(value, "cpshard_original", value)  # transformers' own, not a dispatcher
        if attr != without:
            setattr(copy, attr, value)
    return copy


def _mamba_refused_llama_exact(rank: int, world: int) -> tuple[str, dict, str]:
    """With a stand-in Mamba modeling module lacking its scan: the error stepping a Mamba model
    under CP, Llama's step errors, and the module's status."""
    import importlib

    real = importlib.import_module(MAMBA)
    sys.modules[MAMBA] = _stand_in(MAMBA, "mamba_selective_scan")
    try:
        cp_transformers.register()
        status = next(s for s in hooks.hook_report() if s.module == MAMBA)
        try:
            step_errors(tiny_model(_mamba_config(), attention=False), "contiguous",
                        reference_attention=None)
            said = "no error"
        except ValueError as exc:
            said = str(exc)
        llama = {"llama": step_errors(tiny_model(_llama_config()), "balanced")}
    finally:
        sys.modules[MAMBA] = real
        cp_transformers.register()  # the real module: its hooks back
    return said, llama, f"{status.state}: {status.reason}"


@pytest.mark.parametrize("world", [1, 2])
def test_a_family_that_does_not_match_is_refused_and_llama_steps_exactly(pools, world) -> None:
    import transformers

    results = pools(world).run(_mamba_refused_llama_exact, timeout=300)
    for rank, (said, _, status) in enumerate(results):
        assert status == "inactive: it has no mamba_selective_scan", status
        for words in (
            f"rank {rank}", "'lm.backbone.layers.0.mixer' (MambaMixer) cannot run under CP",
            "cpshard's Mamba hooks are not installed",
            f"transformers {transformers.__version__}'s {MAMBA} does not match them",
            "(it has no mamba_selective_scan)", "`cpshard env`", "without CP",
        ):  # fmt: skip
            assert words in said, (rank, words, said)
    check_relative_errors([llama for _, llama, _ in results], world)


def _scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
          return_last_state=False):  # fmt: skip
    return hidden_states


def _reordered_scan(hidden_states, A, dt, B, C, D=None):
    return hidden_states


def _family(scan) -> hooks.Family:
    from cpshard.integrations import mamba

    module = types.ModuleType("cpshard_test_modeling")
    module.Mixer = type("Mixer", (torch.nn.Module,), {})
    module.mamba_selective_scan = scan
    sys.modules[module.__name__] = module
    functions = {"mamba_selective_scan": mamba.FAMILY.functions["mamba_selective_scan"]}
    return hooks.Family("test", {module.__name__: "Mixer"}, functions=functions,
                        fused={"mamba_inner_fn": lambda original: original})  # fmt: skip


def test_a_function_taking_other_parameters_is_a_mismatch_and_a_missing_fused_entry_is_not() -> None:
    from cpshard.guard import refusals

    try:
        (status,) = hooks.install(_family(_reordered_scan))
        assert status.state == hooks.INACTIVE
        assert "its mamba_selective_scan does not match: it takes (hidden_states, A, dt" in status.reason
        module = sys.modules["cpshard_test_modeling"]
        assert refusals.reason(module.Mixer) is not None
        assert not hasattr(module.mamba_selective_scan, "cpshard_original")  # left alone

        (status,) = hooks.install(_family(_scan))  # no mamba_inner_fn: nothing fused to turn off
        module = sys.modules["cpshard_test_modeling"]
        assert status.state == hooks.ACTIVE and status.reason == ""
        assert module.mamba_selective_scan.cpshard_original is _scan
        assert module.Mixer.cpshard_sequence_mixer and refusals.reason(module.Mixer) is None
    finally:
        del sys.modules["cpshard_test_modeling"]


def test_a_layer_that_is_no_mixer_is_not_refused_when_its_hook_does_not_match() -> None:
    """Llama 4's attention: an inactive temperature hook must not refuse every Llama 4 model
    (untuned ones attend exactly through cpshard; the tuned ones are refused by the attention
    function)."""
    from cpshard.guard import refusals
    from cpshard.integrations import llama4

    module = types.ModuleType("cpshard_test_attention")
    module.Attention = type("Attention", (torch.nn.Module,), {})
    module.Attention.forward = lambda self, *args: None  # takes no hidden_states
    sys.modules[module.__name__] = module
    try:
        family = hooks.Family("test attention", {module.__name__: "Attention"},
                              methods=llama4.FAMILY.methods, mixer=False)  # fmt: skip
        (status,) = hooks.install(family)
        assert status.state == hooks.INACTIVE and "Attention.forward does not match" in status.reason
        assert refusals.reason(module.Attention) is None
        assert not hasattr(module.Attention.forward, "cpshard_original")
    finally:
        del sys.modules[module.__name__]


def test_functions_wrapped_by_the_kernels_package_are_read_through() -> None:
    """The ``kernels`` package turns a hub-replaceable function into a module whose ``forward``
    closes over it (transformers >= 5.25): its parameters are the function's."""

    def make_func_module(func):
        class Func(torch.nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)

        return Func()

    wrapped = make_func_module(_scan)
    assert hooks.signature_mismatch(wrapped, ("hidden_states", "dt", "A")) is None
    assert "cpshard's dispatcher passes (A, dt)" in hooks.signature_mismatch(wrapped, ("A", "dt"))


def test_the_report_lists_every_hooked_module_once() -> None:
    cp_transformers.register()
    expected = sorted(m for f in cp_transformers.FAMILIES for m in f.modules)
    report = [s for s in hooks.hook_report() if s.module in expected]
    assert sorted(s.module for s in report) == expected
    assert all(s.state in (hooks.ACTIVE, hooks.INACTIVE, hooks.ABSENT) for s in report)
    # the releases CI runs (the declared range) match every hook they have
    assert [s for s in report if s.state == hooks.INACTIVE] == []


def _indexer_refused(rank: int, world: int) -> str:
    import transformers as T

    config = T.DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16,
        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, index_n_heads=2, index_head_dim=8, index_topk=4,
        tie_word_embeddings=False,
    )  # fmt: skip
    try:
        step_errors(tiny_model(config), "contiguous", reference_attention=None)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_sparse_attention_indexer_is_refused_with_its_reason(pool2) -> None:
    import transformers as T

    if not hasattr(T, "DeepseekV32Config"):
        pytest.skip("this transformers has no DeepSeek-V3.2")
    for rank, said in enumerate(pool2.run(_indexer_refused, timeout=300)):
        for words in (f"rank {rank}", "(DeepseekV32Indexer) cannot run",
                      "sparse-attention indexer", "Train this model without CP"):  # fmt: skip
            assert words in said, (rank, words, said)


def test_a_temperature_tuned_layer_the_hook_did_not_reach_is_refused() -> None:
    """The attention function's own check: a Llama 4 layer scaling its queries by positions it
    counted itself (its hook inactive) raises rather than attend on them."""
    from cpshard.integrations import llama4

    layer = torch.nn.Module()
    layer.attn_temperature_tuning, layer.use_rope = True, False
    query = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="rank 0: Module scales its queries by attention temperature"):
        llama4.scaled_queries(layer, query, torch.arange(3)[None], "rank 0")
    layer.use_rope = True  # a RoPE layer: no temperature, the queries unchanged
    assert llama4.scaled_queries(layer, query, None, "rank 0") is query
