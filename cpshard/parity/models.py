"""The model a parity check runs: a transformers architecture built tiny with a random config
of the same attention features, a config file, or the user's ``module:function`` factory.

Every rank and the reference build the model from the same :class:`ModelSpec` with the same
seed, so their parameters are equal before the step. The forward contract (what
:func:`logits_of` reads): ``model(input_ids=..., position_ids=...)`` returns logits
``[B, S, V]`` or an object with ``.logits``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cpshard.simulation.model_config import read_config_json

# Sizes a tiny config takes; the attention features (window, layer types, head layout ratios,
# rope) stay as the architecture's defaults.
_TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
_TINY_WINDOW = 8
# The state-space layers' sizes (Mamba, Mamba2 and the hybrids that use them), under each name a
# config gives them: a small state, and heads that tile the layer's inner width (expand x
# hidden_size = 64, as head_dim 8 x 8 heads for Mamba2, 4 x 16 for the hybrids).
_TINY_SSM = {
    "state_size": 4,
    "mamba_d_state": 4,
    "ssm_state_size": 4,
    "n_groups": 2,
    "mamba_n_groups": 2,
    "mamba_ngroups": 2,
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "n_mamba_heads": 4,
    "mamba_headdim": 16,
    "mamba_d_ssm": 64,
    "time_step_rank": 8,
    "mamba_dt_rank": 8,
    "attention_hidden_size": 64,  # Zamba2's shared block: attention over [hidden, embeddings]
    "attention_head_dim": 16,
}
_MAMBA2_HEADS = 8  # Mamba2's own config: num_heads x head_dim (8) = 64
_TINY_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 32,
    "deepstack_visual_indexes": [0],
}


@dataclass(frozen=True)
class ModelSpec:
    """Which model: ``kind`` is ``"architecture"`` (a transformers class name such as
    ``LlamaForCausalLM``), ``"config"`` (a ``config.json`` path or a folder holding one) or
    ``"factory"`` (``module:function`` returning an ``nn.Module``); ``value`` names it."""

    kind: str
    value: str
    seed: int = 0

    @staticmethod
    def parse(text: str, seed: int = 0) -> ModelSpec:
        """``text`` as a spec: ``module:function`` is a factory, an existing path a config file,
        anything else an architecture name."""
        if not isinstance(text, str) or not text:
            raise ValueError(
                f"model: expected an architecture, a config path or module:function, got {text!r}"
            )
        if Path(text).exists():
            return ModelSpec("config", text, seed)
        if ":" in text:
            return ModelSpec("factory", text, seed)
        return ModelSpec("architecture", text, seed)

    @property
    def uses_transformers(self) -> bool:
        return self.kind in ("architecture", "config")


def load_object(text: str, what: str) -> Any:
    """The attribute ``function`` of module ``module`` for ``text`` = ``module:function``."""
    module_name, sep, attr = text.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what}: expected module:function, got {text!r}")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what}: cannot load {text!r}: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"{what}: {text!r} is not callable")
    return obj


def _settable(config: Any, name: str) -> bool:
    """Whether ``config.name`` can be set (not a property derived from other fields, under its
    own name or the one the config's ``attribute_map`` gives it)."""
    name = getattr(config, "attribute_map", {}).get(name, name)
    attr = getattr(type(config), name, None)
    return not isinstance(attr, property) or attr.fset is not None


def _shrink(config: Any) -> Any:
    """``config`` with tiny sizes (text and, for a VLM, vision), attention features kept."""
    text = getattr(config, "text_config", None) or config
    for key, value in (*_TINY.items(), *_TINY_SSM.items()):
        if hasattr(text, key) and _settable(text, key):
            setattr(text, key, value)
    if isinstance(getattr(text, "sliding_window", None), int):  # a window documents exceed
        text.sliding_window = min(text.sliding_window, _TINY_WINDOW)
    if hasattr(text, "num_heads") and hasattr(text, "n_groups") and hasattr(text, "head_dim"):
        text.num_heads = _MAMBA2_HEADS
    if getattr(text, "layer_types", None) is not None and _settable(text, "layer_types"):
        text.layer_types = list(text.layer_types)[: text.num_hidden_layers]
        while len(text.layer_types) < text.num_hidden_layers:
            text.layer_types.append(text.layer_types[-1] if text.layer_types else "full_attention")
    if getattr(text, "rope_scaling", None) and "mrope_section" in (text.rope_scaling or {}):
        text.rope_scaling = dict(text.rope_scaling, mrope_section=[2, 1, 1])
    if getattr(text, "rope_parameters", None) and "mrope_section" in (text.rope_parameters or {}):
        text.rope_parameters = dict(text.rope_parameters, mrope_section=[2, 1, 1])
    vision = getattr(config, "vision_config", None)
    if vision is not None:
        for key, value in _TINY_VISION.items():
            if hasattr(vision, key):
                setattr(vision, key, value)
    if text is not config and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False
    return config


def _architecture(name: str) -> Any:
    """The transformers model class ``name``, or ``ValueError``."""
    import transformers

    cls = getattr(transformers, name, None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise ValueError(f"model: {name!r} is not a transformers model class")
    return cls


def check_model_spec(spec: ModelSpec) -> None:
    """``ValueError`` when ``spec`` names no model: an architecture transformers lacks, a
    factory that does not load, a config file with no ``model_type``. (What the model then
    does is the check's to find.)"""
    if spec.kind == "architecture":
        _architecture(spec.value)
    elif spec.kind == "factory":
        load_object(spec.value, "model")
    else:
        read_config_json(spec.value, "model")


def _transformers_model(spec: ModelSpec) -> torch.nn.Module:
    import transformers

    from cpshard.integrations import transformers as cp_transformers

    cp_transformers.register()
    if spec.kind == "architecture":
        cls = _architecture(spec.value)
        config = _shrink(cls.config_class())
    else:
        data = read_config_json(spec.value, "model")
        kind = type(transformers.AutoConfig.for_model(data["model_type"]))
        config = kind.from_dict(data)
        archs = data.get("architectures") or []
        cls = getattr(transformers, archs[0]) if archs else transformers.AutoModelForCausalLM
    # MoE layers' grouped kernels take no float64: their per-expert loop, the same arithmetic
    config._experts_implementation = "eager"
    torch.manual_seed(spec.seed)
    if cls is transformers.AutoModelForCausalLM:
        model = cls.from_config(config)
    else:
        model = cls(config)
    model = model.to(torch.float64)
    model.set_attn_implementation(cp_transformers.ATTN_IMPLEMENTATION)
    return model


def build_model(spec: ModelSpec) -> torch.nn.Module:
    """The spec's model in float64, its parameters seeded by ``spec.seed``; a transformers
    model with the ``"cpshard"`` attention (plain SDPA outside a CP step)."""
    if spec.uses_transformers:
        return _transformers_model(spec).train()
    factory: Callable[[], Any] = load_object(spec.value, "model")
    torch.manual_seed(spec.seed)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model: {spec.value} returned a {type(model).__name__}, not an nn.Module")
    return model.to(torch.float64).train()


def forward(model: torch.nn.Module, spec: ModelSpec, input_ids: torch.Tensor,
            position_ids: torch.Tensor) -> torch.Tensor:
    """The model's logits for a training forward (a transformers model without its cache)."""
    extra = {"use_cache": False} if spec.uses_transformers else {}
    return logits_of(model(input_ids=input_ids, position_ids=position_ids, **extra))


def vocab_size(model: torch.nn.Module) -> int:
    """The model's vocabulary: its config's, else the first embedding's rows."""
    config = getattr(model, "config", None)
    for c in (getattr(config, "text_config", None), config):
        if c is not None and isinstance(getattr(c, "vocab_size", None), int):
            return c.vocab_size
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            return m.num_embeddings
    raise ValueError("model: no vocabulary size (no config.vocab_size and no nn.Embedding)")


def kv_row_bytes(model: torch.nn.Module) -> int | None:
    """Bytes of one token's K and V over every attention layer (float64), when the config says
    the head layout; None otherwise."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    try:
        heads = text.num_key_value_heads or text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return 2 * heads * head_dim * 8 * text.num_hidden_layers
    except (AttributeError, TypeError):
        return None


def logits_of(output: Any, what: str = "model") -> torch.Tensor:
    """The logits a forward returned (a tensor, or an object with ``.logits``)."""
    logits = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"{what}: the forward returned {type(output).__name__}, neither logits nor an "
            "object with .logits"
        )
    return logits
