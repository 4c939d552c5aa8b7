"""transformers' short-convolution layers (LFM2, LFM2-MoE, LFM3: a gated causal depthwise
convolution over the sequence, with no recurrence) under CP, with no change to the model.

The layer projects its input into two gates and a value, convolves the gated value causally and
gates the result, all in its own forward except for the functions of its modeling module it calls
for the token mixing. :func:`install` puts dispatchers in their place
(:mod:`cpshard.integrations.dispatch`); outside a CP attention context each is the original
function, inside one:

* ``causal_conv1d_fn``: cpshard's per-document convolution
  (:func:`cpshard.mixers.cp_causal_conv1d`), the window carried from the preceding ranks;
* ``apply_mask_to_padding_states``: the hidden states unmasked (the step's documents say which
  tokens are padding);
* ``causal_conv1d_update`` (token-by-token decoding): refused, CP shards training steps.
"""

from __future__ import annotations

from cpshard.integrations.dispatch import (
    causal_conv,
    decoding_refused,
    install_dispatchers,
    unmasked,
)

_WHAT = "cpshard.integrations.transformers (short convolution)"
# modeling module -> the short-convolution layer class in it
MODULES = {
    "transformers.models.lfm2.modeling_lfm2": "Lfm2ShortConv",
    "transformers.models.lfm2_moe.modeling_lfm2_moe": "Lfm2MoeShortConv",
    "transformers.models.lfm3.modeling_lfm3": "Lfm3ShortConv",
}


def install() -> None:
    """Put the dispatchers into every short-convolution modeling module transformers has and
    mark its layer class (idempotent; modules this transformers lacks are skipped)."""
    install_dispatchers(
        MODULES,
        {
            "apply_mask_to_padding_states": unmasked(_WHAT),
            "causal_conv1d_fn": causal_conv(_WHAT),
            "causal_conv1d_update": decoding_refused(_WHAT, "short convolution"),
        },
        _WHAT,
    )
