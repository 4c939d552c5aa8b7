"""``cpshard bench``: microbenchmarks of the sequence transport against hand-written baselines.

Run ``cpshard bench --help`` (or ``python -m cpshard.bench --help``). Without a launcher it spawns
``--world`` local ranks (gloo on CPU by default, NCCL with one GPU per rank when enough GPUs are
visible); under ``torchrun`` it uses the launcher's ranks. Rank 0 prints nccl-tests-style tables:
for every op and size, the median time, algbw, busbw and peak extra memory per rank of cpshard's
op, of a straightforward baseline doing the same job (what a user writes by hand), and of the
wire floor (a bare transfer of exactly the useful bytes), with the ratios.

The single-process benchmarks have commands of their own: ``cpshard kernels`` (cpshard's
kernels next to a plain ``copy_``) and ``cpshard nccl-world1`` (the native NCCL communicator next
to torch.distributed's at world size 1).

Modules, one concept each: :mod:`~cpshard.bench.cli` (arguments, ``cpshard bench``),
:mod:`~cpshard.bench.config` (the validated settings), :mod:`~cpshard.bench.launch` (spawn /
torchrun, process group), :mod:`~cpshard.bench.runtime` (what a rank's benchmarks share),
:mod:`~cpshard.bench.suite` (the order of a run), :mod:`~cpshard.bench.timing` and
:mod:`~cpshard.bench.memory` (what is measured and how), :mod:`~cpshard.bench.baselines` (the
hand-written baselines, the planner's included), :mod:`~cpshard.bench.floor` (bare transfers),
:mod:`~cpshard.bench.cases` (the benchmarked gather ops), :mod:`~cpshard.bench.strategies` (the
transfer strategies for the ragged gather), :mod:`~cpshard.bench.sections` (the sections beyond
the transport tables: :mod:`~cpshard.bench.planner`, :mod:`~cpshard.bench.vision`,
:mod:`~cpshard.bench.layouts`, :mod:`~cpshard.bench.blockdiag`,
:mod:`~cpshard.bench.attention` with :mod:`~cpshard.bench.attention_strategies`),
:mod:`~cpshard.bench.report` (tables, JSON, plot),
:mod:`~cpshard.bench.kernels` and :mod:`~cpshard.bench.nccl_world1` (the single-process
benchmarks).
"""

from cpshard.bench.cli import main

__all__ = ["main"]
