"""Mirror of ``nemo_automodel.components.models.step5``."""
