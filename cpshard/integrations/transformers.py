"""Hugging Face ``transformers`` (>= 5) models on cpshard, without glue in the model code.

* :func:`register` adds the attention implementation ``"cpshard"``: select it with
  ``model.set_attn_implementation("cpshard")``. While a CP attention state is active (inside the
  context of ``ContextParallelSharder.shard`` or of :func:`cpshard.make_cp_blockdiag_batch_and_ctx`)
  every attention layer runs :func:`cpshard.cp_attention` over the sharded sequence; otherwise it is exactly transformers' ``"sdpa"``
  (its masks included), so the same model also runs outside CP.
* :func:`wrap_vision_tower` makes a VLM's vision tower (``model.visual``, ``model.model.visual``)
  run through :func:`cpshard.maybe_distribute_visual`: inside a vision group scope each rank
  runs the tower on its own frames and every rank receives the full embeddings.

transformers stays optional for cpshard users (``pip install cpshard[transformers]``): it is
imported when :func:`register` runs, never when cpshard is imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cpshard.attention.api import cp_attention
from cpshard.attention.plain import plain_attention
from cpshard.attention.state import active_state, current
from cpshard.attention.tokens import check_outside, check_recompute_found, state_for_tokens
from cpshard.batch.token_types import step_token_types
from cpshard.integrations import (
    gated_deltanet,
    hooks,
    llama4,
    mamba,
    mamba2,
    minimax,
    refused_layers,
    short_conv,
    token_types,
)
from cpshard.integrations.masks import DescribedMask, step_mask
from cpshard.integrations.token_types import register_vlm
from cpshard.vision import maybe_distribute_visual

__all__ = [
    "ATTN_IMPLEMENTATION",
    "cpshard_attention",
    "register",
    "register_vlm",
    "wrap_vision_tower",
]

ATTN_IMPLEMENTATION = "cpshard"
_WHAT = "cpshard.integrations.transformers"
# Keyword arguments of transformers' attention call that change the attention itself and that
# the CP attention does not implement: refused rather than dropped.
_UNSUPPORTED = ("position_bias",)
# The ones it implements, which transformers' "sdpa" does not: outside CP cpshard's plain
# attention serves a call that passes one.
_EAGER_ONLY = ("softcap", "s_aux")
# The hooked families, in the order register() installs them.
FAMILIES = (
    gated_deltanet.FAMILY,  # Qwen3.5 / Qwen3-Next linear attention
    mamba.FAMILY,  # the Mamba (v1) layers of Mamba, Falcon-Mamba and Jamba
    mamba2.FAMILY,  # the Mamba2 layers of Mamba2 and its hybrids
    short_conv.FAMILY,  # LFM2's short convolutions
    minimax.FAMILY,  # MiniMax's lightning attention
    llama4.FAMILY,  # Llama 4's attention temperature on document positions
)


# ------------------------------------------------------------------ the active CP step


def _cp_active() -> bool:
    """A CP attention state is active on this rank (a sharded step is running)."""
    return active_state() is not None


def _cp_rank() -> int:
    state = active_state()
    return state.group.rank if state is not None else 0


@contextmanager
def _cp_attention_suspended() -> Iterator[None]:
    """No CP attention inside: for a module whose tokens are not the sharded sequence (a
    vision tower run on this rank's frames)."""
    with current.scope(None):
        yield


# ------------------------------------------------------------------ the attention function


def cpshard_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract (``[B, H, S, D]`` in, ``([B, S, H, D], None)``
    out): the active CP attention, else transformers' ``"sdpa"`` function unchanged (for a call
    with ``softcap`` or sinks, which "sdpa" does not implement, cpshard's plain attention on the
    same masks).

    Under CP, ``is_causal`` (else the module's ``is_causal``), ``scaling``, GQA (from the head
    counts), the sliding window (the call's ``sliding_window``, else the module's), logit
    soft-capping (``softcap``) and attention sinks (``s_aux``) go to the CP attention, which
    refuses what it cannot do exactly: a mask, dropout, ``position_bias``. A mask the mask
    builder translated (:class:`~cpshard.integrations.masks.DescribedMask`: chunked attention,
    image blocks, ...) goes to it as ``mask=``, its step's
    :class:`~cpshard.masks.MaskDescription`.

    The model's ``position_ids`` (transformers passes them in ``kwargs``) tell whose tokens
    these are: a sharded batch's raise under another step's or layout's context, and outside any
    context (:mod:`cpshard.attention.tokens`)."""
    position_ids = kwargs.get("position_ids")
    if not _cp_active() and state_for_tokens(position_ids, None) is None:  # recompute: its step
        check_outside(position_ids, _WHAT)
        check_recompute_found(_WHAT, "attention layer")
        forward = _outside_cp(module, kwargs)
        return forward(
            module, query, key, value, attention_mask,
            dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs,
        )  # fmt: skip
    extra = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if extra:
        raise ValueError(
            f"{_WHAT}: rank {_cp_rank()}: {', '.join(extra)} is not supported by the CP attention"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    mask = None
    if isinstance(attention_mask, DescribedMask):  # the step's translated mask: integrations.masks
        mask, attention_mask = attention_mask.for_layer(causal, window), None
        if mask is not None:  # it states the causality and window: the layer's must not narrow it
            causal, window = None, None
    query = llama4.scaled_queries(module, query, position_ids, f"{_WHAT}: rank {_cp_rank()}")
    out = cp_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        window=window,
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
        position_ids=position_ids,
        mask=mask,
    )
    return out.transpose(1, 2).contiguous(), None


def _outside_cp(module: torch.nn.Module, kwargs: dict[str, Any]) -> Callable[..., Any]:
    """The attention function for a call outside CP: transformers' "sdpa", or, for the
    arguments "sdpa" does not implement (soft-capping, sinks), the same call on cpshard's plain
    attention (which reads the "sdpa" masks this implementation's mask builder makes)."""
    if any(kwargs.get(name) is not None for name in _EAGER_ONLY):
        return _plain_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _plain_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract on :func:`~cpshard.attention.plain.plain_attention`,
    with "sdpa"'s reading of the mask (None: causal when the module is)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    out = plain_attention(
        query, key, value, attention_mask, dropout if module.training else 0.0, causal, scaling,
        query.shape[1] != key.shape[1], None, kwargs.get("softcap"), kwargs.get("s_aux"),
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _cpshard_mask(*args: Any, **kwargs: Any) -> torch.Tensor | DescribedMask | None:
    """The mask builder for ``"cpshard"``: under CP no dense mask (the step's documents define
    the attention; a mask built from one shard would be wrong) but the model's mask function
    translated for the step (:func:`cpshard.integrations.masks.step_mask`: None when its pieces
    are CP attention's plain ones, else a :class:`~cpshard.integrations.masks.DescribedMask` for
    the layers' attention, or an error on every rank); transformers' SDPA mask otherwise."""
    state = active_state()
    if state is not None:
        # sdpa_mask(batch_size, cache_position, kv_length, kv_offset, mask_function, ...)
        fn = kwargs.get("mask_function", args[4] if len(args) > 4 else None)
        return step_mask(
            fn, kwargs.get("config"), state.documents, step_token_types(state.derived),
            f"{_WHAT}: rank {state.group.rank}",
        )  # fmt: skip
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register the attention implementation ``"cpshard"`` (and its mask builder) with
    transformers, so that ``model.set_attn_implementation("cpshard")`` selects it, and install
    cpshard's hooks family by family (:mod:`cpshard.integrations.hooks`): the Gated DeltaNet
    layers of its hybrid models (:mod:`cpshard.integrations.gated_deltanet`), its Mamba layers
    (:mod:`cpshard.integrations.mamba`, :mod:`cpshard.integrations.mamba2`), its short
    convolutions (:mod:`cpshard.integrations.short_conv`), MiniMax's lightning attention
    (:mod:`cpshard.integrations.minimax`) and Llama 4's attention temperature
    (:mod:`cpshard.integrations.llama4`). A family whose modeling module does not match this
    transformers is left alone and its models are refused under CP, saying why; every other
    family works. Layers cpshard cannot shard (sparse-attention indexers, attention written in
    the model's own code) are refused under CP with the reason
    (:mod:`cpshard.integrations.refused_layers`); every VLM whose attention implementation
    becomes ``"cpshard"`` is registered (:func:`register_vlm`). Idempotent."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            f"{_WHAT} needs transformers >= 5: pip install 'cpshard[transformers]'"
        ) from exc
    AttentionInterface.register(ATTN_IMPLEMENTATION, cpshard_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _cpshard_mask)
    for family in FAMILIES:
        hooks.install(family)
    refused_layers.refuse()
    token_types.install(ATTN_IMPLEMENTATION)  # VLMs selected for CP: their masks' token types


# ------------------------------------------------------------------ the vision tower


class _Tower:
    """The tower as :func:`maybe_distribute_visual` sees it: its attributes (merge size,
    config, parameters) and its ORIGINAL forward as the call."""

    def __init__(self, tower: torch.nn.Module, forward: Callable[..., Any]) -> None:
        self._tower, self._forward = tower, forward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tower, name)


class CpVisionTower:
    """Mixin put in front of a vision tower's class by :func:`wrap_vision_tower`: the tower's
    call goes through :func:`maybe_distribute_visual`, with no CP attention inside (the tower
    attends within this rank's frames, not over the sharded sequence)."""

    # its tokens are this rank's frames, not the sharded sequence: its convolutions (patch
    # embeddings) are no token mixers of the CP step
    cpshard_not_sequence = True

    def forward(
        self, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        original = super().forward  # type: ignore[misc]
        with _cp_attention_suspended():
            return maybe_distribute_visual(_Tower(self, original), pixel_values, grid_thw, **kwargs)


_TOWER_NAMES = ("visual", "vision_tower", "vision_model")


def _find_tower(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """``(owner, attribute)`` of the vision tower on ``model`` or on its ``model`` submodule."""
    for owner in (model, getattr(model, "model", None)):
        for name in _TOWER_NAMES:
            if isinstance(owner, torch.nn.Module) and isinstance(
                getattr(owner, name, None), torch.nn.Module
            ):
                return owner, name
    raise ValueError(
        f"{_WHAT}.wrap_vision_tower: no vision tower on {type(model).__name__}: looked for "
        f"{', '.join(_TOWER_NAMES)} on the model and on model.model"
    )


def wrap_vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    """Route the VLM's vision tower (``visual``, ``vision_tower`` or ``vision_model``, on the
    model or on ``model.model``) through :func:`maybe_distribute_visual`; returns the tower.

    The tower object stays in place and its class gains :class:`CpVisionTower` in front (a
    subclass made once per tower class), so its parameter names (state_dict keys), ``dtype``,
    ``spatial_merge_size`` and ``isinstance`` checks are unchanged and the model code calls it
    as before (``return_dict=True`` and its keyword arguments pass through). It also
    registers the VLM's mask inputs (:func:`register_vlm`). Idempotent."""
    owner, name = _find_tower(model)
    register_vlm(model)  # its mask's token types, if it reads any
    tower = getattr(owner, name)
    cls = type(tower)
    if not issubclass(cls, CpVisionTower):
        tower.__class__ = _wrapped_class(cls)
    return tower


@functools.cache
def _wrapped_class(cls: type) -> type:
    """``cls`` with :class:`CpVisionTower` in front (one per tower class)."""
    return type(f"CpShard{cls.__name__}", (CpVisionTower, cls), {})
