"""The attention shape a simulated step is costed for: head counts, head size, layers, window
and element size, given explicitly or read from a transformers config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class HeadShape:
    """One attention layer's head layout (``head_dim`` for both K and V), how many layers
    (None: figures are per layer), a sliding window (None: full causal) and bytes per element."""

    heads: int
    kv_heads: int
    head_dim: int
    layers: int | None = None
    window: int | None = None
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for name in ("heads", "kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--kv-heads: {self.kv_heads} does not divide --heads {self.heads}"
            )
        if self.layers is not None and self.layers < 1:
            raise ValueError("--layers: must be >= 1")
        if self.window is not None and self.window < 1:
            raise ValueError("--window: must be >= 1")


def _config(model: str) -> Any:
    """The text config of ``model``: a config.json path (or a folder holding one) or a
    transformers config or model class name (its default config)."""
    path = Path(model)
    if path.exists():
        path = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--model: cannot read a config from {model!r}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--model: {path} does not hold a JSON object")
        config: Any = data.get("text_config") or data
        return type("Config", (), config) if isinstance(config, dict) else config
    import transformers

    cls = getattr(transformers, model, None)
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        cls = cls.config_class
    if not isinstance(cls, type) or not issubclass(cls, transformers.PretrainedConfig):
        raise ValueError(
            f"--model: {model!r} is neither a config.json path nor a transformers config or "
            "model class"
        )
    config = cls()
    return getattr(config, "text_config", None) or config


def shape_from_model(model: str, dtype_bytes: int = 2, **overrides: int | None) -> HeadShape:
    """The :class:`HeadShape` of ``model``'s config (``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim`` or ``hidden_size / heads``, ``num_hidden_layers``,
    ``sliding_window`` unless ``use_sliding_window`` is false); ``overrides`` not None win."""
    return shape_of_config(_config(model), dtype_bytes, repr(model), **overrides)


def shape_of_config(
    config: Any, dtype_bytes: int = 2, name: str = "the config", **overrides: int | None
) -> HeadShape:
    """:func:`shape_from_model` of a config object (``name`` words its errors)."""
    try:
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    except (AttributeError, TypeError, ValueError):
        raise ValueError(
            f"--model: {name} lacks num_attention_heads and head_dim or hidden_size"
        ) from None
    layers = getattr(config, "num_hidden_layers", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not isinstance(window, int):
        window = None
    found = {
        "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "layers": int(layers) if isinstance(layers, int) else None, "window": window,
    }  # fmt: skip
    found.update({k: v for k, v in overrides.items() if v is not None})
    return HeadShape(dtype_bytes=dtype_bytes, **found)
