"""Mirror of ``nemo_automodel.components.distributed.blockdiag_cp``."""
