"""``cpshard bench``: microbenchmarks of the sequence transport against hand-written baselines.

Run ``cpshard bench --help`` (or ``python -m cpshard.bench --help``). Without a launcher it spawns
``--world`` local ranks (gloo on CPU by default, NCCL with one GPU per rank when enough GPUs are
visible); under ``torchrun`` it uses the launcher's ranks. Rank 0 prints nccl-tests-style tables:
for every op and size, the median time, algbw, busbw and peak extra memory per rank of cpshard's
op, of a straightforward baseline doing the same job (what a user writes by hand), and of the
wire floor (a bare transfer of exactly the useful bytes), with the ratios.

Modules, one concept each: :mod:`~cpshard.bench.cli` (arguments), :mod:`~cpshard.bench.config`
(the validated settings), :mod:`~cpshard.bench.launch` (spawn / torchrun, process group),
:mod:`~cpshard.bench.timing` and :mod:`~cpshard.bench.memory` (what is measured and how),
:mod:`~cpshard.bench.baselines` (the hand-written baselines), :mod:`~cpshard.bench.floor` (bare
transfers), :mod:`~cpshard.bench.cases` (the benchmarked ops), :mod:`~cpshard.bench.strategies`
(the gloo transfer strategies for the ragged gather), :mod:`~cpshard.bench.report` (tables, JSON,
plot).
"""

from cpshard.bench.cli import main

__all__ = ["main"]
