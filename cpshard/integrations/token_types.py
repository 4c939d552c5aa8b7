"""Which transformers VLMs build their language model's attention mask from token types, and
how they turn a row's token types into block ids.

A Gemma 3 VLM makes each run of image tokens (``token_type_ids == 1``) a bidirectional block,
Gemma 4 (with ``use_bidirectional_attention="vision"``) each run of vision tokens
(``mm_token_type_ids`` 1 or 2), PaliGemma its prefix (``token_type_ids == 0``). Their language
model alone builds a causal mask: a recipe that merges the image embeddings before sharding and
runs the language model on the shards (``examples/cp_vlm.py``) would train the image tokens
causally, without an error, unless cpshard knows the model needs its token types. The language
model's config (the object its mask builder receives) cannot tell: it is the text model's
config class, as in a text-only model. So :func:`register_vlm` reads the VLM's config (its
``model_type``, its text config's flags) and records the rule for that config object; the mask
hook (:mod:`cpshard.integrations.masks`) then requires the step's token types and reads the
row's block ids with the model's own function (:func:`marked_rule`). :func:`install` makes
transformers register every model whose attention implementation becomes ``"cpshard"`` (at
``set_attn_implementation``, or when a model is built or loaded with it), so a VLM selected for
CP is registered without a call of its own.

A VLM not in the table whose modeling code reads block ids (``block_sequence_ids``) is recorded
with no rule: cpshard does not know how it makes them, and refuses it under CP.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BlockIds = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TokenTypeRule:
    """How a VLM's mask reads token types: the VLM's ``model_type`` (``family``), the batch
    entry (``key``) and ``block_ids``: the row's transformers block ids (-1 outside a block)
    from its token types ``[B, S]``, as the model makes them (None: cpshard does not know)."""

    family: str
    key: str
    block_ids: BlockIds | None


def _runs_of(module: str) -> BlockIds:
    """The model's own ``get_block_sequence_ids_for_mask`` (Gemma 3, Gemma 4): one block per
    run of image (vision) tokens."""

    def block_ids(types: torch.Tensor) -> torch.Tensor:
        fn = importlib.import_module(module).get_block_sequence_ids_for_mask
        return fn(types, device=types.device).to(torch.int64)

    return block_ids


def _prefix(types: torch.Tensor) -> torch.Tensor:
    """PaliGemma's prefix block: ``torch.where(token_type_ids == 0, 0, -1)``."""
    return torch.where(types == 0, 0, -1).to(torch.int64)


def _gemma4_blocks(text_config: Any) -> bool:
    return getattr(text_config, "use_bidirectional_attention", None) == "vision"


_M = "transformers.models"
# model_type -> (token type key, block ids, whether this config's mask reads them)
_RULES: dict[str, tuple[str, BlockIds, Callable[[Any], bool]]] = {
    "gemma3": ("token_type_ids", _runs_of(f"{_M}.gemma3.modeling_gemma3"), lambda t: True),
    "gemma4": ("mm_token_type_ids", _runs_of(f"{_M}.gemma4.modeling_gemma4"), _gemma4_blocks),
    "gemma4_unified": (
        "mm_token_type_ids",
        _runs_of(f"{_M}.gemma4_unified.modeling_gemma4_unified"),
        _gemma4_blocks,
    ),
    "paligemma": ("token_type_ids", _prefix, lambda t: True),
}

# id(text config) -> (a weak reference to it, its rule): configs are not hashable.
_marked: dict[int, tuple[weakref.ref[Any], TokenTypeRule]] = {}


def token_type_rule(model: torch.nn.Module) -> TokenTypeRule | None:
    """The token-type rule of the VLM ``model``'s attention mask (None: its mask reads no token
    types); a VLM outside the table whose modeling code reads block ids gets a rule without
    ``block_ids``."""
    config = getattr(model, "config", None)
    try:
        text = config.get_text_config()  # type: ignore[union-attr]
    except (AttributeError, ValueError):  # no config, or several text configs: not a VLM's
        return None
    family = str(getattr(config, "model_type", ""))
    if family in _RULES:
        key, block_ids, reads = _RULES[family]
        return TokenTypeRule(family, key, block_ids) if reads(text) else None
    if text is config or not _reads_block_ids(type(model)):  # a text model says it all
        return None
    params = inspect.signature(type(model).forward).parameters
    key = "mm_token_type_ids" if "mm_token_type_ids" in params else "token_type_ids"
    return TokenTypeRule(family, key, None)


@functools.cache
def _reads_block_ids(cls: type) -> bool:
    """The modeling code of ``cls`` builds masks from block ids (read once per class)."""
    try:
        return "block_sequence_ids" in inspect.getsource(inspect.getmodule(cls) or cls)
    except (OSError, TypeError):  # no source: nothing says it reads them
        return False


def register_vlm(model: torch.nn.Module) -> str | None:
    """Record that the VLM ``model``'s language model builds its attention mask from token
    types (:func:`token_type_rule`), so that under CP a step without them, or a language model
    run without them, raises instead of attending causally. Returns the batch key the step
    needs (``"token_type_ids"``, ``"mm_token_type_ids"``), or None. Idempotent."""
    rule = token_type_rule(model)
    if rule is None:
        return None
    text = model.config.get_text_config()  # type: ignore[union-attr]
    key = id(text)
    _marked[key] = (weakref.ref(text, lambda ref: _forget(key, ref)), rule)
    return rule.key


def install(implementation: str) -> None:
    """Register (:func:`register_vlm`) every transformers model whose attention implementation
    is checked and becomes ``implementation``: transformers checks it on the model itself when
    the model is built (or loaded) and at ``set_attn_implementation``. Idempotent."""
    from transformers import PreTrainedModel

    original = PreTrainedModel._check_and_adjust_attn_implementation
    if hasattr(original, "cpshard_original"):
        return

    @functools.wraps(original)
    def check_and_adjust(self: Any, *args: Any, **kwargs: Any) -> Any:
        chosen = original(self, *args, **kwargs)
        if chosen == implementation:
            register_vlm(self)
        return chosen

    check_and_adjust.cpshard_original = original  # type: ignore[attr-defined]
    setattr(PreTrainedModel, "_check_and_adjust_attn_implementation", check_and_adjust)


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    """Drop a dead config's entry (not a newer config's that took its id)."""
    if key in _marked and _marked[key][0] is ref:
        del _marked[key]


def marked_rule(config: object) -> TokenTypeRule | None:
    """The rule :func:`register_vlm` recorded for the (text) config ``config``, or None."""
    found = _marked.get(id(config))
    if found is None or found[0]() is not config:
        return None
    return found[1]
