"""The NeMo Automodel mirror (cpshard.nemo): its documented contract, its collective items."""
