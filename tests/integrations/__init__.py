"""The transformers integration (cpshard.integrations.transformers) on real tiny models."""
