"""Adapters that plug cpshard into model libraries (each imports its library lazily)."""
