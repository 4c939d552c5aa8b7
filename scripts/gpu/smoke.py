"""The GPU check's first stage, torch alone (no cpshard, nothing built yet): one all-reduce on
a one-rank process group (NCCL on the GPU, gloo in the dry run) and the machine's facts
(:mod:`machine`: the device, NCCL, which attention kernels torch runs), in ``OUT/smoke.json``.

It tells the machine's problems from cpshard's. NCCL at one rank copies and connects nothing: a
smoke test, not a check of any multi-rank logic.

    python scripts/gpu/smoke.py --out DIR [--device cuda|cpu]
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
import torch.distributed as dist

import machine  # this folder's: the script's own, first on sys.path
import stage_args


def all_reduce(device: str) -> dict:
    """One all-reduce on a one-rank group: NCCL on a GPU, gloo on CPU."""
    backend = "nccl" if device == "cuda" else "gloo"
    kwargs = {"device_id": torch.device("cuda", 0)} if device == "cuda" else {}
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
        try:
            x = torch.arange(8, dtype=torch.float32, device=device)
            dist.all_reduce(x)
            ok = bool(torch.equal(x.cpu(), torch.arange(8, dtype=torch.float32)))
        finally:
            dist.destroy_process_group()
    return {"ok": ok, "backend": backend}


def main(argv: list[str] | None = None) -> int:
    args = stage_args.parse(stage_args.parser(__doc__), argv)
    if args is None:
        return 1
    start = time.monotonic()
    record = {"all_reduce": all_reduce(args.device), "machine": machine.facts(args.device)}
    record["ok"] = record["all_reduce"]["ok"]
    record["seconds"] = round(time.monotonic() - start, 2)
    (args.out / "smoke.json").write_text(json.dumps(record, indent=1, sort_keys=True))
    print(json.dumps(record, default=str))
    device = record["machine"]["device"]["name"]
    verdict = "ok" if record["ok"] else "FAILED"
    backend = record["all_reduce"]["backend"]
    print(f"{verdict}: {backend} all-reduce at world size 1 on {device}; facts in smoke.json")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
