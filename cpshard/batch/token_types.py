"""A step's token types for the whole padded row: what a model's attention mask reads besides
the documents.

Some models build their attention mask from per-token types: Gemma 3 VLMs make the image tokens
(``token_type_ids == 1``) of one run a bidirectional block, Gemma 4 its vision tokens
(``mm_token_type_ids``), PaliGemma its prefix (``token_type_ids == 0``). Under CP each rank's
model sees its shard's types only, and a block is a property of the row (where a run starts and
ends), so the sharder keeps the row's types for the step: :func:`read_token_types` reads them
from the batch (``[B, S]`` integers; ``block_sequence_ids``, transformers' block ids, -1 outside
a block, taken as they are), :func:`pad_token_types` pads them to the layout's length, and the
step's attention state holds them (:func:`keep_for_step`, :func:`step_token_types`) for the mask
hook (:mod:`cpshard.integrations.transformers`). Host int64 tensors, read once per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cpshard.batch.padding import pad_sequence
from cpshard.fingerprints import digest
from cpshard.validation import Problem

# The batch entries a mask may read, in the order the consensus field lists them.
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids", "block_sequence_ids")
# Where the step's attention state keeps them (its ``derived`` dict).
_STEP_KEY = "token types"

TokenTypes = dict[str, torch.Tensor]


def read_token_types(batch: Mapping[str, Any], rows: int, seq_len: int) -> TokenTypes:
    """The batch's token types ``[B, S]`` (a ``[1, S]`` one repeated over the rows), host int64,
    by key; raises :class:`~cpshard.validation.Problem` naming a malformed one."""
    out: TokenTypes = {}
    for key in TOKEN_TYPE_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise Problem(f"batch[{key!r}] must be a tensor, got {type(value).__name__}", TypeError)
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise Problem(f"batch[{key!r}] must hold integers, got {value.dtype}", TypeError)
        if value.dim() != 2 or value.shape[1] != seq_len or value.shape[0] not in (rows, 1):
            raise Problem(
                f"batch[{key!r}] must be [B, S] = [{rows}, {seq_len}], got shape "
                f"{tuple(value.shape)}"
            )
        out[key] = value.detach().to("cpu", torch.int64).expand(rows, seq_len).contiguous()
    return out


def pad_token_types(types: TokenTypes, padded_len: int) -> TokenTypes:
    """``types`` right-padded to ``padded_len`` positions (0: text; block ids -1: no block)."""
    return {key: pad_sequence(key, value, 1, padded_len) for key, value in types.items()}


def token_types_field(types: TokenTypes) -> list[int]:
    """The consensus field of the step's token types: which keys it holds and a digest of
    their values (ranks whose types differ would mask the step differently)."""
    keys = sum(1 << i for i, key in enumerate(TOKEN_TYPE_KEYS) if key in types)
    held = [types[k].reshape(-1) for k in TOKEN_TYPE_KEYS if k in types]
    return [keys, *digest(torch.cat(held) if held else None)]


def keep_for_step(derived: dict[object, object], types: TokenTypes) -> None:
    """Keep the step's padded token types in its attention state's ``derived`` dict."""
    derived[_STEP_KEY] = dict(types)


def step_token_types(derived: Mapping[object, object]) -> TokenTypes:
    """The step's padded token types kept by :func:`keep_for_step` (empty: the batch had none)."""
    return dict(derived.get(_STEP_KEY, {}))  # type: ignore[call-overload]
