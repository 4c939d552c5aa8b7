"""Mirror of ``nemo_automodel.components.models``."""
