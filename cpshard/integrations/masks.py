"""A transformers model's attention mask under CP: translated into the step's
:class:`~cpshard.masks.MaskDescription`, or refused.

Under CP the ``"cpshard"`` mask builder builds no dense mask: the step's documents define what
each query sees. :func:`step_mask` hands the model's mask function to
:func:`~cpshard.integrations.mask_translation.describe_transformers_mask` with the step's padded
documents (global order) and the row's block ids (from the step's token types,
:mod:`cpshard.batch.token_types`, by the VLM's rule, :mod:`cpshard.integrations.token_types`):

* a mask function of CP attention's plain pieces (causal, bidirectional, sliding windows,
  packed documents, padding) keeps the plain path: no mask (None), each layer attending by its
  own ``is_causal`` and window, as before;
* any other one (chunked attention, image blocks, a prefix, a widening to bidirectional) is
  translated and returned as a :class:`DescribedMask`, which reaches each layer's attention
  call as its ``attention_mask`` (each layer type its own mask). There
  (:mod:`cpshard.integrations.transformers`) a description the layer's ``is_causal`` and window
  attend anyway (:func:`layer_attends`: Gemma 3's bidirectional full layers) takes the plain
  path; any other goes to CP attention as ``mask=``, which executes it;
* a mask function that does not translate (a user's own, a block cut by other tokens) raises,
  naming its first piece CP attention does not implement (:func:`mask_problem`);
* a VLM whose mask reads token types (:func:`~cpshard.integrations.token_types.register_vlm`)
  raises when the step's batch has none, or when the model's mask function ignores the blocks
  they hold (its language model run without them), naming the batch key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from cpshard.integrations.mask_translation import (
    describe_transformers_mask,
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


class DescribedMask(torch.Tensor):
    """The ``attention_mask`` the ``"cpshard"`` mask builder returns under CP for a mask
    function beyond CP attention's plain pieces: the step's ``description``. An empty 4-D
    tensor to transformers, which passes a 4-D mask on as it is (a VLM's language model given
    its VLM's mask); any operation on it gives a plain tensor, which CP attention refuses as a
    mask (``attn_mask``). Each layer that receives it asks :meth:`for_layer` what to execute."""

    description: MaskDescription
    _plain: dict[tuple[bool, int | None], bool]
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, description: MaskDescription) -> DescribedMask:
        mask = torch.Tensor._make_subclass(cls, torch.empty(0, 1, 0, 0, dtype=torch.bool))
        mask.description, mask._plain = description, {}
        return mask

    def __init__(self, description: MaskDescription) -> None:
        super().__init__()

    def for_layer(self, causal: bool, window: int | None) -> MaskDescription | None:
        """None when the layer's own ``is_causal`` and ``window`` attend the description
        (:func:`layer_attends`; the plain path), else the description to execute. Decided once
        per layer kind and step."""
        key = (causal, window)
        if key not in self._plain:
            self._plain[key] = layer_attends(self.description, causal, window)
        return None if self._plain[key] else self.description


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


def layer_attends(description: MaskDescription, causal: bool, window: int | None) -> bool:
    """The description is what CP attention does for a layer from its ``is_causal`` and
    sliding ``window`` alone: bidirectional attention within documents, or causal attention
    within them (each query seeing at most ``window`` keys, itself included). Judged by what
    each query sees, not by the rules' form (a union may state a document's last causal query
    with ``ahead = 0``, chunks of one token are a window of one)."""
    d = description
    if d.segments == 0:
        return True
    if not causal:
        return _sees_alike(d, d.doc_start, INF, d.doc_end, INF)
    return _sees_alike(d, d.doc_start, INF if window is None else window - 1, d.doc_end, 0)


def _sees_alike(
    d: MaskDescription, lo: torch.Tensor, back: int, hi: torch.Tensor, ahead: int
) -> bool:
    """Every query of ``d`` sees what the rule ``(lo, back, hi, ahead)`` (per segment) gives it.
    A query's first key ``max(lo, q - back)`` and end ``min(hi, q + 1 + ahead)`` are linear in
    ``q`` between the bends (``q = lo + back``, ``q = hi - 1 - ahead``), so two rules agree on a
    segment when they agree at its ends and at both rules' bends."""
    first, last = d.start, d.end - 1
    back_t, ahead_t = torch.full_like(d.back, back), torch.full_like(d.ahead, ahead)
    bends = (d.lo + d.back, lo + back_t, d.hi - 1 - d.ahead, hi - 1 - ahead_t)
    inside = (torch.minimum(torch.maximum(b, first), last) for b in bends)
    points = torch.stack([first, last, *inside])
    same_first = torch.maximum(d.lo, points - d.back) == torch.maximum(lo, points - back_t)
    same_end = torch.minimum(d.hi, points + 1 + d.ahead) == torch.minimum(hi, points + 1 + ahead_t)
    return bool((same_first & same_end).all())


def step_mask(
    mask_function: Callable[..., Any] | None,
    config: object,
    documents: torch.Tensor,
    token_types: Mapping[str, torch.Tensor],
    where: str,
) -> DescribedMask | None:
    """The attention mask of ``mask_function`` (a model's, with its text ``config``) for the
    step of padded ``documents`` ``[B, P]`` and token types (module doc): None when its pieces
    are CP attention's plain ones, else a :class:`DescribedMask`; ``ValueError`` (``where``
    names the module and rank) when it does not translate or misses its token types."""
    block_ids = _block_ids(mask_function, config, documents, token_types, where)
    if mask_problem(mask_function) is None:
        return None
    description = describe_transformers_mask(mask_function, documents, block_ids)
    if description is None:
        raise ValueError(
            f"{where}: the model builds its attention mask with "
            f"{mask_problem(mask_function)!r}, a pattern CP attention does not implement (it "
            "implements causal and bidirectional attention within documents, sliding windows, "
            "chunked attention and bidirectional blocks read from the step's token types; not "
            "custom masks, blocks cut by other tokens, or blocks whose ids are a shard's: a "
            "VLM's token types reach the mask through "
            "cpshard.integrations.transformers.register_vlm and the batch); under CP the step "
            "would attend something else than the model. Train this model outside CP"
        )
    return DescribedMask(description)


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
