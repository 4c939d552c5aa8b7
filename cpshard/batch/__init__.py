"""The batch of a CP step: its documents (from every format models produce), the padding
conventions every sharder shares, the runs of one document, and the sharded batch's contract
(what the model gets, and the side record the loss reads).

* :mod:`~cpshard.batch.documents`: document ids and padding of a batch, per-document positions;
* :mod:`~cpshard.batch.padding`: how sequence-aligned entries are padded;
* :mod:`~cpshard.batch.runs`: the runs of one document;
* :mod:`~cpshard.batch.targets`: :class:`ShardedBatch` and its :class:`BatchTargets`;
* :mod:`~cpshard.batch.token_types`: the rows' token types a step keeps for the model's mask.
"""

from cpshard.batch.documents import DocumentError, document_ids, document_positions, read_documents
from cpshard.batch.padding import IGNORE_INDEX, pad_sequence, pad_value, sequence_dim
from cpshard.batch.targets import CONSUMED_KEYS, BatchTargets, ShardedBatch, shift_targets

__all__ = [
    "BatchTargets",
    "CONSUMED_KEYS",
    "DocumentError",
    "IGNORE_INDEX",
    "ShardedBatch",
    "document_ids",
    "document_positions",
    "pad_sequence",
    "pad_value",
    "read_documents",
    "sequence_dim",
    "shift_targets",
]
