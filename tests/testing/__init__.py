"""The multi-rank harness (cpshard.testing): RankPool and run_ranks."""
