"""Context-parallel attention for every shard layout: causal (or bidirectional) attention within
each document of a packed batch, across the CP group, exact forward and backward.

The package, in call order (each module imports only those after it):

* :mod:`~cpshard.attention.api`: the public :func:`cp_attention` and :func:`cp_blockdiag_sdpa`;
* :mod:`~cpshard.attention.mask_mod`: a FlexAttention-style ``mask_mod`` under CP (its
  exchange and its mask on the key buffer, planned once per step and function);
* :mod:`~cpshard.attention.plain`: the same variants on one device (outside a context);
* :mod:`~cpshard.attention.tokens`: which step's context a sharded batch's tokens belong to;
* :mod:`~cpshard.attention.strategy`: which exchange a call uses (the step's own K/V exchange,
  or head parallel: :mod:`~cpshard.attention.head_attention`, all-to-alls before and after the
  inner attention, its heads split by :mod:`~cpshard.attention.head_split`);
* :mod:`~cpshard.attention.ops`: the attention custom ops (forward and backward);
* :mod:`~cpshard.attention.engine`: one varlen launch for a step's spans, or the per-span loop
  (and which kernel the latest call ran: :func:`attention_kernel`);
* :mod:`~cpshard.attention.choice`: which kernel serves a call's queries;
* :mod:`~cpshard.attention.fa3` / :mod:`~cpshard.attention.flash_attn2`: FlashAttention-3 and
  the flash-attn package's soft-capped FA2 kernels, through their packages' torch ops;
* :mod:`~cpshard.attention.kernels`: the kernels (torch's varlen flash, CPU flash, math);
* :mod:`~cpshard.attention.step`: a step's states from its layout and documents (and
  :mod:`~cpshard.attention.head_plan`: its head-parallel plans);
* :mod:`~cpshard.attention.halo` / :mod:`~cpshard.attention.needed_rows`: the two K/V
  exchanges (the multi-hop halo of contiguous shards, the needed-rows all-to-all-v of any
  layout), behind the protocol of :mod:`~cpshard.attention.exchange`;
* :mod:`~cpshard.attention.activation`: entering a step's attention (its state installed, and
  :mod:`cpshard.guard`: models whose token mixers it does not shard refused);
* :mod:`~cpshard.attention.state`: the step's state (and its windows' and mask descriptions'
  states), its registry;
* :mod:`~cpshard.attention.packing`, :mod:`~cpshard.attention.blocks`,
  :mod:`~cpshard.planning.spans`, :mod:`~cpshard.attention.placement`: the state's views of its
  spans (varlen packing, the loop's blocks) and their placement on the device.
"""

from cpshard.attention.activation import activated
from cpshard.attention.api import cp_attention, cp_blockdiag_sdpa
from cpshard.attention.engine import attention_kernel
from cpshard.attention.state import AttentionState, active_state
from cpshard.attention.step import step_state

__all__ = [
    "AttentionState",
    "activated",
    "active_state",
    "attention_kernel",
    "cp_attention",
    "cp_blockdiag_sdpa",
    "step_state",
]
