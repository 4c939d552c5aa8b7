"""The functions transformers' hybrid layers mix tokens with, swapped for dispatchers on the
active CP step.

transformers' hybrid layers call module-level functions of their modeling module for what
mixes tokens along the sequence (the short causal convolution, the recurrence).
:mod:`cpshard.integrations.hooks` puts a dispatcher in each one's place — outside a CP attention
context the original function, inside one cpshard's per-document version over the step's shards
(:mod:`cpshard.mixers`) — and marks the layer's class ``cpshard_sequence_mixer`` so that the
guard refusing token mixers CP does not shard lets it run. The dispatchers the families share
are here: the convolution's (:func:`causal_conv`), the padding mask's (:func:`unmasked`), a
fused kernel's (:func:`unfused`) and the refusal of token-by-token decoding
(:func:`decoding_refused`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from cpshard.attention.state import AttentionState, active_state
from cpshard.attention.tokens import check_recompute_found
from cpshard.integrations.hooks import Hook, Make
from cpshard.mixers import cp_causal_conv1d, recurrence_runs


def mixing_state(what: str) -> AttentionState | None:
    """The CP step a hybrid layer's token mixing runs under: the active context's, else None
    (the original function runs). A recompute during a backward called after the step's
    context exited cannot find its step here (these functions see no batch tensor to look it up
    by): it raises (:func:`~cpshard.attention.tokens.check_recompute_found`) rather than mix
    this rank's shard alone."""
    state = active_state()
    if state is None:
        check_recompute_found(what, "hybrid layer (linear attention / state-space scan)")
    return state


def causal_conv(what: str) -> Make:
    """The dispatcher of transformers' ``causal_conv1d_fn`` (``[B, C, L]`` in and out, weight
    ``[C, K]``): under CP :func:`cpshard.mixers.cp_causal_conv1d`, after the step's runs are
    planned (which refuses a layout that cuts documents into many pieces, on every rank, before
    any transfer)."""

    def make(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(original)
        def causal_conv1d_fn(
            hidden_states: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None = None,
            activation: str | None = None,
            **kwargs: Any,
        ) -> torch.Tensor:
            state = mixing_state(what)
            if state is None:
                return original(hidden_states, weight, bias, activation=activation, **kwargs)
            recurrence_runs(state, what)
            if hidden_states.shape[-1] != state.local_len:  # a cache's states prepended
                raise cache_refused(state, what, "convolution")
            x = hidden_states.transpose(1, 2).to(weight.dtype)  # [B, L, C]
            y = cp_causal_conv1d(x, weight, bias, state, activation)
            return y.transpose(1, 2).to(hidden_states.dtype)

        return causal_conv1d_fn

    return make


def cache_refused(state: AttentionState, what: str, layer: str) -> ValueError:
    """The refusal of a cached (generation) call of ``layer`` under CP."""
    return ValueError(
        f"{what}: rank {state.group.rank}: a {layer} layer ran with a cache inside a CP context; "
        "CP shards training steps: call the model with use_cache=False"
    )


def unmasked(what: str) -> Make:
    """The dispatcher of ``apply_mask_to_padding_states``: under CP the hidden states unmasked.
    The step's documents say which tokens are padding and padding belongs to no document, so
    zeroing it changes no other token; the layer's 2-D mask is the caller's trimmed to the local
    length, which for a full-sequence mask would zero other tokens (as the attention layers'
    masks, it is not read under CP)."""

    def make(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @functools.wraps(original)
        def apply_mask_to_padding_states(
            hidden_states: torch.Tensor, attention_mask: torch.Tensor | None
        ) -> torch.Tensor:
            if mixing_state(what) is not None:
                return hidden_states
            return original(hidden_states, attention_mask)

        return apply_mask_to_padding_states

    return make


def decoding_refused(what: str, layer: str) -> Make:
    """The dispatcher of a token-by-token decoding function (``causal_conv1d_update``, a
    selective state update): refused under CP, which shards training steps."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def refused_under_cp(*args: Any, **kwargs: Any) -> Any:
            state = mixing_state(what)
            if state is not None:
                raise cache_refused(state, what, layer)
            return original(*args, **kwargs)

        return refused_under_cp

    return make


def unfused(what: str) -> Make:
    """The dispatcher of a fused kernel entry (a whole layer in one kernel, when one is
    installed, which would mix the shard alone): None under CP, so the layer takes its path
    through the dispatched functions."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def fused_or_none(*args: Any, **kwargs: Any) -> Any:
            return None if mixing_state(what) is not None else original(*args, **kwargs)

        return fused_or_none

    return make


# The leading parameters the shared dispatchers pass on to transformers' functions.
CONV_PARAMS = ("hidden_states", "weight", "bias", "activation")
MASK_PARAMS = ("hidden_states", "attention_mask")


def conv_hook(what: str) -> Hook:
    return Hook(causal_conv(what), CONV_PARAMS)


def decoding_hook(what: str, layer: str) -> Hook:
    return Hook(decoding_refused(what, layer))


def padded_conv_hooks(what: str, layer: str) -> dict[str, Hook]:
    """The hooks of a layer that masks its padding and convolves causally, which every such
    family (Mamba, Mamba2, the short convolutions) has under the same names: the padding mask
    unread, the convolution per document, its token-by-token decoding refused."""
    return {
        "apply_mask_to_padding_states": Hook(unmasked(what), MASK_PARAMS),
        "causal_conv1d_fn": conv_hook(what),
        "causal_conv1d_update": decoding_hook(what, layer),
    }
