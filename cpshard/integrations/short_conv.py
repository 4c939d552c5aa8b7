"""transformers' short-convolution layers (LFM2, LFM2-MoE, LFM3: a gated causal depthwise
convolution over the sequence, with no recurrence) under CP, with no change to the model.

The layer projects its input into two gates and a value, convolves the gated value causally and
gates the result, all in its own forward except for the functions of its modeling module it calls
for the token mixing. :data:`FAMILY` puts dispatchers in their place
(:mod:`cpshard.integrations.dispatch`); outside a CP attention context each is the original
function, inside one:

* ``causal_conv1d_fn``: cpshard's per-document convolution
  (:func:`cpshard.mixers.cp_causal_conv1d`), the window carried from the preceding ranks;
* ``apply_mask_to_padding_states``: the hidden states unmasked (the step's documents say which
  tokens are padding);
* ``causal_conv1d_update`` (token-by-token decoding): refused, CP shards training steps.
"""

from __future__ import annotations

from cpshard.integrations.dispatch import padded_conv_hooks
from cpshard.integrations.hooks import Family

_WHAT = "cpshard.integrations.transformers (short convolution)"
# modeling module -> the short-convolution layer class in it
MODULES = {
    "transformers.models.lfm2.modeling_lfm2": "Lfm2ShortConv",
    "transformers.models.lfm2_moe.modeling_lfm2_moe": "Lfm2MoeShortConv",
    "transformers.models.lfm3.modeling_lfm3": "Lfm3ShortConv",
}


FAMILY = Family(
    "short convolution",
    MODULES,
    functions=padded_conv_hooks(_WHAT, "short convolution"),
)
