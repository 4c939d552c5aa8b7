"""The steady state on CUDA + NCCL under ``torch.cuda.set_sync_debug_mode("error")``: any
device->host sync in a per-call path raises.

Per rank (world size 1 on one GPU; with ``--world W`` > 1, W spawned ranks on W GPUs, since NCCL
refuses two ranks on one GPU), after the per-step set-up and the communicator's creation (both
allowed to sync):

* every verb of the native NCCL transport (``cpshard.comm.nccl``) called directly, uneven sizes
  and a ring of send/recv at W > 1;
* ``gather_sequence``, ``gather_ragged`` and ``gather_halo``, forward and backward (at W = 1 they
  return their input, so this checks only that their W = 1 path does not sync);
* one ``cp_blockdiag_sdpa`` layer inside ``make_cp_blockdiag_batch_and_ctx``'s context, forward
  and backward, with each exchange strategy (``needed_rows``; ``heads``, whose all-to-alls run
  on the native transport), the two compared.

Results are checked against plain-PyTorch references after leaving the sync-debug mode. Prints one
``ok <what>`` line per check and exits non-zero on the first failure; prints ``skipped: <why>``
and exits 0 without a GPU, cpshard's CUDA build or its NCCL communicator.

    python scripts/gpu/steady_state.py [--world W] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# the checkout this script belongs to, unless PYTHONPATH / an install provides cpshard first
sys.path.append(str(Path(__file__).resolve().parents[2]))
import cpshard  # noqa: E402
from cpshard.comm import resolve_group  # noqa: E402


def skip_reason(world: int) -> str | None:
    """Why this machine cannot run the check at ``world`` ranks, or None."""
    if not torch.cuda.is_available():
        return "no GPU"
    info = cpshard.build_info()
    if not info.cuda_kernels or not info.nccl:
        return "cpshard was built without CUDA kernels or the NCCL communicator"
    if torch.cuda.device_count() < world:
        return f"{world} ranks need {world} GPUs, {torch.cuda.device_count()} visible"
    return None


@contextmanager
def no_sync() -> Iterator[None]:
    """Raise on any device->host sync inside (and on the stream's pending errors after)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def check(name: str, rank: int, fn: Callable[[], None]) -> None:
    fn()
    if rank == 0:
        print(f"ok {name}", flush=True)


CHECKS = (
    "transport verbs",
    "gather_sequence / gather_ragged / gather_halo",
    "cp_blockdiag_sdpa layer, needed_rows and heads",
)


def run_rank(rank: int, world: int, store_path: str) -> None:
    """This rank's checks; rank 0 writes the communicator's facts to ``<store_path>.json``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    device = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
    try:
        pg = dist.group.WORLD
        group = resolve_group(pg, "gpu_steady_state")
        from cpshard.comm import nccl, nccl_runtime

        comm = nccl.communicator(group, device)  # created collectively (may sync: once)
        if rank == 0:
            print(f"communicator: bootstrap={comm.bootstrap}, NCCL {nccl.version()}", flush=True)
        steps = (
            lambda: verbs(comm, rank, world, device),
            lambda: transport(pg, rank, world, device),
            lambda: blockdiag_layer(pg, rank, world, device),
        )
        for name, step in zip(CHECKS, steps, strict=True):
            check(name, rank, step)
        assert comm.error() == "", comm.error()
        if rank == 0:
            loaded = nccl_runtime.loaded_versions()
            facts = {
                "bootstrap": comm.bootstrap,
                "nccl_cpshard": ".".join(map(str, nccl.version())),
                "nccl_loaded": {
                    path: ".".join(map(str, nccl_runtime.version_triple(code)))
                    for path, code in loaded.items()
                },
            }
            Path(f"{store_path}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()


def verbs(comm: object, rank: int, world: int, device: torch.device) -> None:
    sizes = [3 + 2 * r for r in range(world)]  # uneven at W > 1
    offs = [sum(sizes[:r]) for r in range(world + 1)]
    n = 5
    local = torch.arange(n, device=device, dtype=torch.float32) + 100 * rank
    mine = torch.arange(sizes[rank], device=device, dtype=torch.float32) + 100 * rank
    full = torch.arange(offs[-1], device=device, dtype=torch.float32) * (rank + 1)
    rs_full = torch.arange(world * n, device=device, dtype=torch.float32) * (rank + 1)
    outs = {
        "all_gather": torch.empty(world * n, device=device),
        "all_gather_v": torch.empty(offs[-1], device=device),
        "reduce_scatter": torch.empty(n, device=device),
        "reduce_scatter_v": torch.empty(sizes[rank], device=device),
        "recv": torch.empty(n, device=device),
    }
    ring = [((rank + 1) % world, local)], [((rank - 1) % world, outs["recv"])]
    with no_sync():
        comm.all_gather(outs["all_gather"], local)
        comm.all_gather_v(outs["all_gather_v"], mine, sizes)
        comm.reduce_scatter(outs["reduce_scatter"], rs_full)
        comm.reduce_scatter_v(outs["reduce_scatter_v"], full, sizes)
        if world > 1:
            comm.send_recv(*ring)
        side = torch.cuda.Stream(device)  # a side stream: the allocator bookkeeping path
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            comm.all_gather_v(outs["all_gather_v"], mine, sizes)
        torch.cuda.current_stream(device).wait_stream(side)
    base = torch.arange(n, dtype=torch.float32)
    assert torch.equal(outs["all_gather"].cpu(), torch.cat([base + 100 * r for r in range(world)]))
    want_v = torch.cat(
        [torch.arange(sizes[r], dtype=torch.float32) + 100 * r for r in range(world)]
    )
    assert torch.equal(outs["all_gather_v"].cpu(), want_v)
    scale = world * (world + 1) / 2  # sum over ranks of (rank + 1)
    full_cpu = torch.arange(offs[-1], dtype=torch.float32)
    want_rs = torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * scale
    assert torch.allclose(outs["reduce_scatter"].cpu(), want_rs)
    assert torch.allclose(
        outs["reduce_scatter_v"].cpu(), full_cpu[offs[rank] : offs[rank + 1]] * scale
    )
    if world > 1:
        assert torch.equal(outs["recv"].cpu(), base + 100 * ((rank - 1) % world))


def transport(pg: dist.ProcessGroup, rank: int, world: int, device: torch.device) -> None:
    length = 4
    x = torch.randn(2, length, 8, device=device, requires_grad=True)
    counts = [length] * world
    with no_sync():
        seq = cpshard.gather_sequence(x, pg, seq_dim=1)
        rag = cpshard.gather_ragged(x, pg, counts, dim=1)
        halo = cpshard.gather_halo(x, pg, 2, seq_dim=1)
        (seq.sum() + rag.sum() + halo.sum()).backward()
    assert seq.shape == (2, world * length, 8) and rag.shape == seq.shape
    assert halo.shape[1] == length + min(2, rank * length)
    # every rank's rows appear once in seq and rag (sum over ranks), plus its halo readers
    assert x.grad is not None and torch.isfinite(x.grad).all()


def blockdiag_layer(pg: dist.ProcessGroup, rank: int, world: int, device: torch.device) -> None:
    """One layer per exchange strategy: ``needed_rows`` (key/value rows) and ``heads`` (the
    sequence <-> head all-to-alls around an inner attention); both must give the same output and
    gradients (the same attention, moved differently)."""
    bsz, seq, heads, dim = 2, 8 * world, 2 * world, 16
    doc = torch.tensor([[1] * (3 * world) + [2] * (5 * world), [3] * (seq - 2) + [0, 0]])
    # float32: the per-segment path; bfloat16: the one-launch varlen path where available.
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator(device=device).manual_seed(rank)
        shape = (bsz, heads, seq // world, dim)
        qkv = [torch.randn(shape, device=device, dtype=dtype, generator=gen) for _ in range(3)]
        results = {}
        for strategy in ("needed_rows", "heads"):
            batch = {
                "input_ids": torch.ones(bsz, seq, dtype=torch.int64, device=device),
                "_packed_seq_ids": doc,
            }
            # The per-step set-up may sync; the layer, every call of every step, must not.
            train_ctx, batch = cpshard.make_cp_blockdiag_batch_and_ctx(
                pg, None, batch, strategy=strategy
            )
            assert batch["input_ids"].shape[1] == seq // world
            q, k, v = (t.clone().requires_grad_() for t in qkv)
            with train_ctx():
                cpshard.cp_blockdiag_sdpa(q, k, v, is_causal=True)  # warm-up (kernel choice)
                with no_sync():
                    out = cpshard.cp_blockdiag_sdpa(q, k, v, is_causal=True)
                    out.sum().backward()
            assert out.shape == q.shape and torch.isfinite(out).all(), (strategy, dtype)
            grads = [t.grad for t in (q, k, v)]
            assert all(g is not None and torch.isfinite(g).all() for g in grads), (strategy, dtype)
            results[strategy] = [out.detach(), *grads]
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for a, b in zip(results["needed_rows"], results["heads"]):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--world", type=int, default=1, help="ranks, one GPU each (default 1)")
    p.add_argument("--json", type=Path, help="also write what ran (or why not) here")
    args = p.parse_args(argv)
    reason = skip_reason(args.world)
    if reason is not None:
        print(f"skipped: {reason}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": reason, "world": args.world}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        if args.world == 1:
            run_rank(0, 1, store)
        else:
            mp.start_processes(
                run_rank, args=(args.world, store), nprocs=args.world, start_method="spawn"
            )
        facts = json.loads(Path(f"{store}.json").read_text())
    print(f"all steady-state checks passed at world size {args.world}")
    if args.json:
        record = {
            "ok": True,
            "world": args.world,
            "checked": list(CHECKS),
            "sync_check": 'torch.cuda.set_sync_debug_mode("error")',
            **facts,
        }
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
