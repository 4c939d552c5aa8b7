"""Per-call cost of cpshard's native NCCL communicator next to torch.distributed's NCCL, at
world size 1.

One process, one GPU, a one-rank NCCL process group (file store). With one rank nothing crosses
a wire: every verb is at most a device-local copy, so small sizes show the fixed cost of a call
(argument checks, the enqueue on the stream, torch's work objects) and large ones the copy. Each
verb runs on the same group through ``cpshard.comm.transport_for`` (the native communicator,
``cpshard.comm.nccl``) and through torch.distributed's own collective for the same job
(``all_gather_into_tensor``, ``reduce_scatter_tensor``: present in every torch from 2.11 on).
``send_recv`` is left out: at world size 1 there is no peer. For each verb and size:

* ``sync us``: median wall time of one call from an idle GPU until ``torch.cuda.synchronize()``
  returns after it;
* ``pipelined us``: ``--repeats`` calls back to back, then one synchronize, per call (the cost
  when calls queue up on the stream, as in a training step).

Then the native ``all_gather_v`` and ``reduce_scatter_v`` of bfloat16 parts starting 16-byte
aligned and 2 bytes past that (where the parts after an odd-sized one start), side by side.

Each verb's result is checked once (at world size 1 every verb copies its input) before timing.
Without a GPU, torch's NCCL or cpshard's NCCL build it prints ``skipped: <why>`` and exits 0.

    python -m cpshard.bench.nccl_world1 --json nccl_world1.json

"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import cpshard
from cpshard.bench.timing import time_calls
from cpshard.byte_units import human_bytes
from cpshard.comm import Group, Transport, resolve_group, transport_for

# Every verb at world size 1, as (native transport, out, x) -> None and (process group, out, x)
# -> None for torch.distributed's collective doing the same job; each leaves a copy of x in out.
Native = Callable[[Transport, torch.Tensor, torch.Tensor], None]
Torch = Callable[[dist.ProcessGroup, torch.Tensor, torch.Tensor], None]


def _torch_gather(pg: dist.ProcessGroup, out: torch.Tensor, x: torch.Tensor) -> None:
    dist.all_gather_into_tensor(out, x, group=pg)


def _torch_reduce_scatter(pg: dist.ProcessGroup, out: torch.Tensor, x: torch.Tensor) -> None:
    dist.reduce_scatter_tensor(out, x, group=pg)


VERBS: dict[str, tuple[Native, Torch]] = {
    "all_gather": (lambda t, out, x: t.all_gather(out, x), _torch_gather),
    "all_gather_v": (lambda t, out, x: t.all_gather_v(out, x, [x.numel()]), _torch_gather),
    "reduce_scatter": (lambda t, out, x: t.reduce_scatter(out, x), _torch_reduce_scatter),
    "reduce_scatter_v": (
        lambda t, out, x: t.reduce_scatter_v(out, x, [x.numel()]),
        _torch_reduce_scatter,
    ),
}


@dataclass
class Row:
    verb: str
    transport: str  # "native" (cpshard.comm.nccl) or "torch" (torch.distributed's collective)
    dtype: str
    bytes: int  # of the input (and of the output) at world size 1
    sync_us: float  # median of single synchronized calls
    min_us: float
    pipelined_us: float  # per call, --repeats calls then one synchronize


def skip_reason() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not torch.cuda.is_available():
        return "no GPU"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    if not cpshard.build_info().nccl:
        return "cpshard was built without the NCCL communicator"
    return None


@contextmanager
def world1_group() -> Iterator[Group]:
    """A one-rank NCCL process group on GPU 0 (no ``set_device``: the communicator takes the
    tensors' device), its native communicator closed and the group destroyed on exit."""
    from cpshard.comm import nccl

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(
            "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
        try:
            yield resolve_group(dist.group.WORLD, "nccl_world1")
        finally:
            nccl.close(dist.group.WORLD)
            dist.destroy_process_group()


def pipelined(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` calls enqueued back to back, then one synchronize."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls


def timed_row(
    fn: Callable[[], object], args: argparse.Namespace, verb: str, transport: str, x: torch.Tensor
) -> Row:
    """``fn`` (one call of ``verb`` on input ``x``) timed single and pipelined."""
    times = time_calls(fn, args.repeats, args.warmup, torch.cuda.synchronize).wall_s
    return Row(
        verb=verb,
        transport=transport,
        dtype=str(x.dtype).removeprefix("torch."),
        bytes=x.numel() * x.element_size(),
        sync_us=statistics.median(times) * 1e6,
        min_us=min(times) * 1e6,
        pipelined_us=pipelined(fn, args.repeats) * 1e6,
    )


HEADER = (
    f"{'verb':<17} {'size':>9} {'native sync us':>14} {'torch sync us':>13} {'torch/native':>12} "
    f"{'native pipelined us':>19} {'torch pipelined us':>18}"
)


def run(group: Group, args: argparse.Namespace) -> list[Row]:
    """Time every verb at every size through both transports, printing a line per pair."""
    native = transport_for(group, torch.empty(0, device="cuda"))
    if type(native).__name__ != "NcclTransport":
        raise RuntimeError(
            f"transport_for picked {type(native).__name__}, not the native NCCL communicator"
        )
    rows: list[Row] = []
    for kib in args.sizes_kib:
        n = (kib << 10) // torch.empty(0, dtype=args.dtype).element_size()
        x = torch.randn(n, device="cuda").to(args.dtype)
        out = torch.empty_like(x)
        for verb, (native_call, torch_call) in VERBS.items():
            pair: dict[str, Row] = {}
            calls = {"native": partial(native_call, native), "torch": partial(torch_call, group.pg)}
            for name, call in calls.items():
                fn = partial(call, out, x)
                out.zero_()
                fn()
                torch.cuda.synchronize()
                if not torch.equal(out, x):
                    raise RuntimeError(f"{verb} through {name} did not copy its input at world 1")
                pair[name] = timed_row(fn, args, verb, name, x)
            nat, tor = pair["native"], pair["torch"]
            print(
                f"{verb:<17} {human_bytes(nat.bytes):>9} {nat.sync_us:>14.1f} {tor.sync_us:>13.1f} "
                f"{tor.sync_us / nat.sync_us:>12.2f} {nat.pipelined_us:>19.1f} "
                f"{tor.pipelined_us:>18.1f}",
                flush=True,
            )
            rows += pair.values()
    return rows


ALIGNMENT_HEADER = (
    f"{'bf16 verb':<17} {'size':>9} {'aligned sync us':>15} {'2-byte sync us':>14} "
    f"{'2-byte/aligned':>14} {'aligned pipelined us':>20} {'2-byte pipelined us':>19}"
)


def alignment(group: Group, args: argparse.Namespace) -> list[Row]:
    """The native ``all_gather_v`` and ``reduce_scatter_v`` of bfloat16 parts starting 16-byte
    aligned and starting 2 bytes past that, as the parts after an odd-sized one do: whether NCCL
    takes a slower path for them. Printed as one line per verb and size."""
    native = transport_for(group, torch.empty(0, device="cuda"))
    verbs = {name: VERBS[name][0] for name in ("all_gather_v", "reduce_scatter_v")}
    rows: list[Row] = []
    for kib in args.sizes_kib:
        n = (kib << 10) // 2
        src = torch.randn(n + 1, device="cuda").to(torch.bfloat16)
        dst = torch.empty_like(src)
        for verb, call in verbs.items():
            pair: dict[str, Row] = {}
            for name, start in (("aligned", 0), ("2-byte", 1)):
                x, out = src[start : start + n], dst[start : start + n]
                fn = partial(call, native, out, x)
                out.zero_()
                fn()
                torch.cuda.synchronize()
                if not torch.equal(out, x):
                    raise RuntimeError(f"{verb} at a {name} offset did not copy its input")
                pair[name] = timed_row(fn, args, verb, f"native {name}", x)
            a, b = pair["aligned"], pair["2-byte"]
            print(
                f"{verb:<17} {human_bytes(a.bytes):>9} {a.sync_us:>15.1f} {b.sync_us:>14.1f} "
                f"{b.sync_us / a.sync_us:>14.2f} {a.pipelined_us:>20.1f} {b.pipelined_us:>19.1f}",
                flush=True,
            )
            rows += pair.values()
    return rows


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes-kib",
        default="4,1024,65536",
        type=lambda s: [int(v) for v in s.split(",") if v.strip()],
        help="comma-separated input sizes in KiB (default 4,1024,65536)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16", "float64")
    )
    p.add_argument("--repeats", type=int, default=50, help="timed calls per case (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls before (default 5)")
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    reason = skip_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        if args.json:
            args.json.write_text(json.dumps({"skipped": reason}))
        return 0
    nccl, device = ".".join(map(str, torch.cuda.nccl.version())), torch.cuda.get_device_name(0)
    print(
        f"cpshard {cpshard.__version__}, torch {torch.__version__}, NCCL {nccl}, {device}, "
        f"world size 1, median of {args.repeats}"
    )
    print(HEADER)
    print("-" * len(HEADER))
    with world1_group() as group:
        rows = run(group, args)
        print()
        print(ALIGNMENT_HEADER)
        print("-" * len(ALIGNMENT_HEADER))
        rows += alignment(group, args)
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "torch": torch.__version__,
                    "nccl": nccl,
                    "dtype": str(args.dtype).removeprefix("torch."),
                    "repeats": args.repeats,
                    "rows": [asdict(r) for r in rows],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
