"""cpshard bench (cpshard.bench): the CLI and its sections."""
