"""The transformers config a memory prediction builds its model from: a named shape (a small
table of published model sizes, built from a dict: nothing is downloaded), a model-type name
with sizes given as flags, or a ``config.json`` path (or a folder holding one)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Published shapes (the released configs' sizes), by the name ``--model`` accepts.
NAMED: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    "llama3-70b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
        "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 500000.0,
        "max_position_embeddings": 131072, "tie_word_embeddings": False,
    },
    "qwen3-8b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
        "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
    "qwen3-32b": {
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120,
        "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
    },
}  # fmt: skip

# Size flags of ``cpshard plan`` -> the config field each overrides.
SIZE_FIELDS = {
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "layers": "num_hidden_layers",
    "heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
}


def read_config_json(spec: str, what: str) -> dict[str, Any]:
    """The fields of the transformers config at ``spec`` (a config.json or its folder);
    ``ValueError`` naming ``what`` when it cannot be read or has no ``model_type``."""
    path = Path(spec)
    path = path / "config.json" if path.is_dir() else path
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{what}: cannot read a config from {spec!r}: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"{what}: {path} has no model_type")
    return data


def model_config(spec: str, **sizes: int | None) -> Any:
    """The transformers ``PretrainedConfig`` of ``spec`` (a :data:`NAMED` shape, a model type
    such as ``llama`` or ``qwen3``, or a config.json path), its fields overridden by ``sizes``
    (:data:`SIZE_FIELDS` keys; None: keep). A model type alone takes transformers' defaults
    for the sizes not given."""
    import transformers

    if spec in NAMED:
        fields = dict(NAMED[spec])
    elif Path(spec).exists():
        fields = read_config_json(spec, "--model")
    else:
        fields = {"model_type": spec}
    model_type = fields.pop("model_type")
    try:
        config_class = transformers.AutoConfig.for_model(model_type).__class__
    except ValueError:
        names = ", ".join(NAMED)
        raise ValueError(
            f"--model: {spec!r} is none of {names}, a transformers model type (llama, qwen3, "
            "...) or a config.json path"
        ) from None
    for key, value in sizes.items():
        if key not in SIZE_FIELDS:
            raise ValueError(f"model_config: unknown size {key!r}")
        if value is not None:
            fields[SIZE_FIELDS[key]] = value
    fields.pop("transformers_version", None)
    config = config_class(**fields)
    if getattr(config, "text_config", None) is not None:
        raise ValueError(f"--model: {spec!r} is a multimodal config; give its text model's")
    return config
