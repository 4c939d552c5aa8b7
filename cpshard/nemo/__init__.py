"""NeMo Automodel mirror: the module paths and names of NVIDIA NeMo Automodel's CP components,
as thin adapters over cpshard's own implementation.

Switching is an import-prefix change: ``nemo_automodel.components...`` becomes
``cpshard.nemo.components...`` (README, "NeMo Automodel mirror", lists the deliberate
differences).
"""
