"""Context-parallel batch sharding (mirror of
``nemo_automodel.components.distributed.context_parallel``)."""

from cpshard.nemo.components.distributed.context_parallel.sharder import (
    ContextParallelSharder,
    ShardLayout,
)

__all__ = ["ContextParallelSharder", "ShardLayout"]
