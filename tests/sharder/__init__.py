"""The sharder (cpshard.sharder): ContextParallelSharder, its padding, the block-diagonal batch."""
