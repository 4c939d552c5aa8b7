"""Sharding a training batch over a CP group: :class:`ContextParallelSharder` (every layout, and
token tensors moved in and out of the same layout) and :func:`make_cp_blockdiag_batch_and_ctx`
(the contiguous layout with NeMo's block-diagonal batch conventions).

Shard = one index gather along the sequence dim with this rank's positions (``fill`` at padded
positions, so padding is never materialised). Un-shard (:meth:`gather_token_tensor`) = one equal
all-gather of the shards in rank order (:func:`cpshard.gather_sequence`; ``gather_ragged`` for
layouts whose ranks hold different counts) followed by ONE reorder with the inverse permutation,
computed locally -- in closed form for ``contiguous`` / ``head_tail`` / ``stripe``, from the
indices carried in the :class:`~cpshard.layouts.ShardLayout` for data-dependent layouts. The
reorder is one fused index gather of tokens into the output, except for ``head_tail``, which
moves whole chunks: its reorder moves chunks (one index gather of whole chunks; a token index
costs a lookup per token, which dominates for per-token values), and when nothing precedes the
token dim (``[1, S, ...]``: hidden states, one row of per-token values) a chunk is one contiguous
run in both orders, so the all-gathered buffer is put in global order in place, cycle by cycle.
That un-shard allocates its output only (the all-gather writes into it): half the memory of
gather + index, and on CPU no first touches of a second output-sized buffer, which cost as much
as the copy itself. No index tensor is ever all-gathered, except in the direct form when the
caller supplies only a ``local_token_global_indices`` callable (it knows this rank's positions
only). Both directions are differentiable: the backward of an index gather is its scatter-add
adjoint, that of the in-place chunk reorder the inverse chunk gather, that of the all-gather a
reduce-scatter.

Padding follows :mod:`cpshard.batch.padding` (the conventions every sharder shares); documents
are read by :mod:`cpshard.batch.documents` and the sharded batch follows
:mod:`cpshard.batch.targets` (the model's inputs as keys, the loss's side record as
``batch.targets``).

This package never calls ``torch.distributed``: ranks come from :func:`cpshard.comm.resolve_group`,
communication from :mod:`cpshard.transport`. ``shard`` (once per step) checks across ranks with
:func:`cpshard.consensus.agree`, so every rank raises; the per-call token verbs check locally,
across ranks only in checked mode (:func:`cpshard.consensus.check_call`).

One concern per module: :mod:`~cpshard.sharder.sharder` (the class, its arguments and
``shard``, composed of the three below), :mod:`~cpshard.sharder.planning` (the built-in per-step
batch planning and the step's attention state), :mod:`~cpshard.sharder.partition` (the partition
followed: layout / index resolution and caches), :mod:`~cpshard.sharder.token_verbs`
(``shard_token_tensor`` / ``gather_token_tensor``) and :mod:`~cpshard.sharder.blockdiag` (the
block-diagonal batch).
"""

from cpshard.sharder.blockdiag import make_cp_blockdiag_batch_and_ctx
from cpshard.sharder.planning import StepPlanner
from cpshard.sharder.sharder import ContextParallelSharder

__all__ = ["ContextParallelSharder", "StepPlanner", "make_cp_blockdiag_batch_and_ctx"]
