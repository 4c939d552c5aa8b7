"""Mirror of ``nemo_automodel.components.distributed``."""
