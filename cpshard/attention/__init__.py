"""Context-parallel attention for every shard layout.

The sharder's context (:meth:`cpshard.ContextParallelSharder.shard`) installs a
:class:`LayoutState`: each rank receives exactly the K/V rows its queries reach (one
all-to-all-v), then attends per run of its tokens with the block-diagonal kernels
(:mod:`cpshard.blockdiag.attention`), which serve ``make_cp_blockdiag_batch_and_ctx``'s
contiguous split the same way through its halo exchange. :func:`cp_attention` is the entry point.
"""

from cpshard.attention.api import cp_attention
from cpshard.attention.exchange import layout_exchange, layout_exchange_return
from cpshard.attention.state import LayoutState, layout_state

__all__ = [
    "LayoutState",
    "cp_attention",
    "layout_exchange",
    "layout_exchange_return",
    "layout_state",
]
