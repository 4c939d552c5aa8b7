"""The largest sequence a CP training step fits on a device, PREDICTED per model, world size,
layout and activation checkpointing (``cpshard plan --memory --max-seq-len``'s search, one
predictor per model and checkpointing setting): the table of docs/memory.md.

    python -m cpshard.bench.memory_table [--models llama3-8b qwen3-32b] [--worlds 8 32 128]
        [--layouts head_tail contiguous] [--device h100] [--docs one] [--fsdp off on]
        [--checkpointing off on] [--jobs N]

Each cell: the largest S, a multiple of 1024 x W (1k tokens per rank), up to 64M, whose worst
of ranks 0 and W-1 is predicted to fit (bf16 parameters, AdamW, the full-logits loss; replicated
on every CP rank, or sharded by FSDP2 over the W CP ranks).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

from cpshard.simulation.memory_report import device
from cpshard.simulation.memory_search import largest_fitting
from cpshard.simulation.model_config import model_config
from cpshard.simulation.step_memory import Predictor
from cpshard.simulation.training_step import DTYPES, StepSpec

LIMIT = 64 * 1024**2
PER_RANK = 1024  # the search's granularity, in tokens per rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["llama3-8b", "qwen3-32b"])
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--layouts", nargs="+", default=["head_tail", "contiguous"])
    p.add_argument("--strategy", default="auto")
    p.add_argument("--device", default="h100")
    p.add_argument("--docs", default="one")
    p.add_argument("--fsdp", nargs="+", choices=("off", "on"), default=["off", "on"])
    p.add_argument("--checkpointing", nargs="+", choices=("off", "on"), default=["off", "on"])
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="ranks traced at once")
    args = p.parse_args()
    dev = device(args.device)
    print(f"| model | FSDP2 | checkpointing | W | " + " | ".join(args.layouts) + " |")
    print("|---|---|---|---|" + "---|" * len(args.layouts))
    for name in args.models:
        for fsdp, ckpt in itertools.product(args.fsdp, args.checkpointing):
            started = time.perf_counter()
            spec = StepSpec(model_config(name), DTYPES["bf16"], ckpt == "on", fsdp=fsdp == "on")
            predictor = Predictor(spec)
            for world in args.worlds:
                cells = []
                for layout in args.layouts:
                    found = largest_fitting(
                        predictor, world, sorted({0, world - 1}), layout, args.strategy,
                        args.docs, dev.bytes, PER_RANK * world, LIMIT, jobs=args.jobs,
                    )  # fmt: skip
                    cells.append("none" if found.seq_len is None else f"{found.seq_len // 1024}k")
                    took = time.perf_counter() - started
                    print(f"  {name} fsdp={fsdp} ckpt={ckpt} W={world} {layout}: "
                          f"{cells[-1]} "
                          f"({len(found.tried)} predictions, {took:.0f} s)",
                          file=sys.stderr, flush=True)  # fmt: skip
                print(f"| {name} | {fsdp} | {ckpt} | {world} | " + " | ".join(cells) + " |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
