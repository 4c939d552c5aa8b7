"""A transformers model's attention mask under CP: translated into the step's
:class:`~cpshard.masks.MaskDescription`, or refused.

Under CP the ``"cpshard"`` mask builder builds no dense mask: the step's documents define what
each query sees. :func:`step_mask` hands the model's mask function to
:func:`~cpshard.integrations.mask_translation.describe_transformers_mask` with the step's padded
documents (global order) and the row's block ids (from the step's token types,
:mod:`cpshard.batch.token_types`, by the VLM's rule, :mod:`cpshard.integrations.token_types`):

* a description that is causal or bidirectional attention within documents, or a sliding
  window of it (each layer passes its own window to the attention), keeps the plain path: no
  mask (None);
* any other description (chunked attention, image blocks, a prefix, a bidirectional window) is
  returned as a :class:`DescribedMask`, which reaches the layer's attention call as its
  ``attention_mask`` (each layer type its own) — while CP attention does not execute
  descriptions (:func:`attention_executes_masks`), every rank raises here instead, naming the
  mask's kind;
* a mask function that does not translate (a user's own, a block cut by other tokens) raises,
  naming its first piece CP attention does not implement (:func:`mask_problem`);
* a VLM whose mask reads token types (:func:`~cpshard.integrations.token_types.register_vlm`)
  raises when the step's batch has none, or when the model's mask function ignores the blocks
  they hold (its language model run without them), naming the batch key.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cpshard.attention.api import cp_attention
from cpshard.integrations.mask_translation import (
    describe_transformers_mask,
    mask_kind,
    reads_block_ids,
)
from cpshard.integrations.token_types import marked_rule
from cpshard.masks import INF, MaskDescription

# Qualified-name prefixes of transformers' mask-function pieces CP attention implements.
_IMPLEMENTED = (
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay.",  # the window: each layer passes it to the attention
    "sliding_window_bidirectional_overlay.",
    "packed_sequence_mask_function.",  # the step's documents
    "padding_mask_function.",  # padding: the step's documents (pad rows attend nothing)
)
# Pieces that combine or re-index other pieces: implemented when every piece they hold is.
_COMPOSITIONS = ("and_masks.", "remap_positions_for_packed_sequence.")


@dataclass(frozen=True)
class DescribedMask:
    """The ``attention_mask`` the ``"cpshard"`` mask builder returns under CP for a mask CP
    attention executes as a description: the step's ``description`` and its ``kind`` in words."""

    description: MaskDescription
    kind: str


def attention_executes_masks(attention: Callable[..., Any] = cp_attention) -> bool:
    """Whether CP attention takes a :class:`~cpshard.masks.MaskDescription` (its ``mask=``)."""
    return "mask" in inspect.signature(attention).parameters


def _pieces(fn: Callable[..., Any]) -> list[Callable[..., Any]]:
    """The mask functions a composed mask function closes over."""
    out: list[Callable[..., Any]] = []
    for cell in fn.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, tuple):
            out.extend(v for v in value if callable(v) and not isinstance(v, type))
        elif callable(value) and not isinstance(value, type):
            out.append(value)
    return out


def mask_problem(mask_function: Callable[..., Any] | None) -> str | None:
    """The qualified name of the first piece of ``mask_function`` CP attention does not
    implement, or None when it implements them all (None: transformers' default, causal)."""
    if mask_function is None:
        return None
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    if name.startswith(_IMPLEMENTED):
        return None
    if name.startswith(_COMPOSITIONS):
        pieces = _pieces(mask_function)
        if not pieces:
            return name
        for piece in pieces:
            problem = mask_problem(piece)
            if problem is not None:
                return problem
        return None
    return name


def plain(description: MaskDescription) -> bool:
    """The description is causal or bidirectional attention within documents, or a causal
    sliding window of it: what CP attention does from a layer's ``is_causal`` and window."""
    if description.segments == 0:
        return True
    d = description
    if not bool(((d.lo == d.doc_start) & (d.hi == d.doc_end)).all()):
        return False
    back, ahead = torch.unique(d.back), torch.unique(d.ahead)
    if back.numel() != 1 or ahead.numel() != 1:
        return False
    return int(ahead) == 0 or (int(ahead) == INF and int(back) == INF)


def step_mask(
    mask_function: Callable[..., Any] | None,
    config: object,
    documents: torch.Tensor,
    token_types: Mapping[str, torch.Tensor],
    where: str,
) -> DescribedMask | None:
    """The attention mask of ``mask_function`` (a model's, with its text ``config``) for the
    step of padded ``documents`` ``[B, P]`` and token types (module doc): None for the plain
    path, a :class:`DescribedMask`, or ``ValueError`` (``where`` names the module and rank)."""
    block_ids = _block_ids(mask_function, config, documents, token_types, where)
    description = describe_transformers_mask(mask_function, documents, block_ids)
    if description is None:
        problem = mask_problem(mask_function) or getattr(mask_function, "__qualname__", "?")
        raise ValueError(
            f"{where}: the model builds its attention mask with {problem!r}, a pattern CP "
            "attention does not implement (it implements causal and bidirectional attention "
            "within documents, sliding windows, chunked attention and bidirectional blocks read "
            "from the step's token types; not custom masks, blocks cut by other tokens, or "
            "blocks whose ids are a shard's: a VLM's token types reach the mask through "
            "cpshard.integrations.transformers.register_vlm and the batch); under CP the step "
            "would attend something else than the model. Train this model outside CP"
        )
    if plain(description):
        return None
    kind = mask_kind(mask_function)
    if not attention_executes_masks():
        raise ValueError(
            f"{where}: the model's attention mask is {kind}; cpshard translates it (a "
            "MaskDescription) but CP attention does not execute mask descriptions yet, so the "
            "step cannot attend it exactly. Train this model outside CP"
        )
    return DescribedMask(description, kind)


def _block_ids(
    mask_function: Callable[..., Any] | None,
    config: object,
    documents: torch.Tensor,
    token_types: Mapping[str, torch.Tensor],
    where: str,
) -> torch.Tensor | None:
    """The row's block ids for the mask: by the registered VLM's rule from the step's token
    types (raising when they are missing or the mask ignores their blocks), else the batch's
    own ``block_sequence_ids``, else None."""
    rule = marked_rule(config)
    if rule is None:
        return token_types.get("block_sequence_ids")
    if rule.block_ids is None:
        raise ValueError(
            f"{where}: the {rule.family} model builds its attention mask from {rule.key} in a "
            "way cpshard does not know (only Gemma 3, Gemma 4 and PaliGemma's are read); under "
            "CP the step would attend something else than the model. Train it outside CP"
        )
    if rule.key not in token_types:
        raise ValueError(
            f"{where}: the {rule.family} model's attention mask reads {rule.key} (bidirectional "
            f"image blocks or a prefix), and this step's batch has no {rule.key}: put the rows' "
            f"{rule.key} [B, S] in the batch the sharder shards (and the shard's into the "
            "model's forward); without them its image tokens would attend causally"
        )
    block_ids = rule.block_ids(token_types[rule.key])
    if bool(((block_ids >= 0) & (documents != 0)).any()) and not reads_block_ids(mask_function):
        raise ValueError(
            f"{where}: the step's {rule.key} hold blocks of the {rule.family} model's mask, but "
            f"its mask function reads none: its language model ran without {rule.key} (call "
            f"the VLM's model, e.g. model.model(inputs_embeds=..., {rule.key}=...), not its "
            "language_model alone); its image tokens would attend causally"
        )
    return block_ids
