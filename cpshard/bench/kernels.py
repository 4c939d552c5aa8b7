"""Throughput of cpshard's kernels next to a plain ``dst.copy_(src)`` of the same bytes.

Every case moves ``--size-mib`` of data (fp32 and bf16); for each the table gives the median
time over ``--repeats`` runs (after warm-up), the bandwidth (bytes read + bytes written / time)
and its ratio to the bandwidth of ``dst.copy_(src)`` over the case's input bytes, measured in the
same run with the same thread count. ``document_segments`` reports tokens/s instead.

The ops allocate their output on every call (there is no out= variant), so two baselines are
measured: ``copy_`` into a preallocated tensor (the project's yardstick) and ``clone()`` (copy into
a fresh allocation, i.e. the same allocate + first-touch cost the ops pay).

``--device cuda`` runs the same cases and baselines on the GPU (cpshard's CUDA build): every
timed call is followed by ``torch.cuda.synchronize()``, so a time is the call's wall time from an
idle device to its end, launches included; the page-fault column is nan there.

    python -m cpshard.bench.kernels                    # 64 MiB, 15 repeats, all threads
    python -m cpshard.bench.kernels --threads 1 --json out.json
    python -m cpshard.bench.kernels --device cuda --json cuda.json

"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import cpshard
from cpshard.bench.cases import ragged_counts
from cpshard.bench.timing import time_calls

H = 2048  # hidden size of every token row
WORLD = 4  # ranks of the uneven per-rank counts (max/mean = 1.6: a load-imbalanced all-to-all)


@dataclass
class Row:
    case: str
    dtype: str
    shape: str
    median_ms: float
    min_ms: float
    bytes_moved: int  # read + written
    gbps: float  # bytes_moved / median
    copy_gbps: float  # dst.copy_(src) of the case's input bytes
    ratio: float  # gbps / copy_gbps (nan for document_segments)
    clone_ratio: float  # gbps / clone_gbps
    faults_per_call: float  # minor page faults per call (first touch of fresh output pages)
    tokens_per_s: float = float("nan")


def elems_for(size_bytes: int, dtype: torch.dtype) -> int:
    return size_bytes // torch.empty(0, dtype=dtype).element_size()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rows: list[Row] = []
        self.size = args.size_mib << 20
        self.device = torch.device(args.device)
        self.on_cuda = self.device.type == "cuda"
        self._baselines: dict[tuple[torch.dtype, int], tuple[float, float]] = {}

    def time(self, fn) -> tuple[list[float], float]:
        """Times of fn (synchronized on CUDA) and its page faults per call (nan on CUDA)."""
        if self.on_cuda:
            calls = time_calls(fn, self.args.repeats, self.args.warmup, torch.cuda.synchronize)
            return calls.wall_s, float("nan")
        calls = time_calls(fn, self.args.repeats, self.args.warmup)
        return calls.wall_s, calls.minor_faults

    def randn(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """Normal samples drawn on the CPU (the same values for every device), cast, moved."""
        return torch.randn(*shape).to(self.device, dtype)

    def baselines(self, dtype: torch.dtype, nbytes: int) -> tuple[float, float]:
        """(copy_ GB/s, clone GB/s) for nbytes of dtype, measured once per run."""
        key = (dtype, nbytes)
        if key not in self._baselines:
            n = elems_for(nbytes, dtype)
            src = self.randn(n, dtype=dtype)
            dst = torch.empty_like(src)
            moved = 2 * n * src.element_size()
            copy_times = self.time(lambda: dst.copy_(src))
            clone_times = self.time(lambda: src.clone())
            copy_t, clone_t = statistics.median(copy_times[0]), statistics.median(clone_times[0])
            self._baselines[key] = (moved / copy_t / 1e9, moved / clone_t / 1e9)
            self.add_row("copy_ (baseline)", dtype, [n], copy_times, moved, nbytes)
            self.add_row("clone (baseline)", dtype, [n], clone_times, moved, nbytes)
        return self._baselines[key]

    def add_row(self, case, dtype, shape, timed, moved, in_bytes, tokens=None):
        times, faults = timed
        med = statistics.median(times)
        gbps = moved / med / 1e9
        copy_gbps, clone_gbps = self._baselines.get((dtype, in_bytes), (float("nan"), float("nan")))
        row = Row(
            case=case,
            dtype=str(dtype).removeprefix("torch."),
            shape="x".join(map(str, shape)),
            median_ms=med * 1e3,
            min_ms=min(times) * 1e3,
            bytes_moved=moved,
            gbps=gbps,
            copy_gbps=copy_gbps,
            ratio=float("nan") if tokens is not None else gbps / copy_gbps,
            clone_ratio=float("nan") if tokens is not None else gbps / clone_gbps,
            faults_per_call=faults,
            tokens_per_s=float("nan") if tokens is None else tokens / med,
        )
        self.rows.append(row)
        print(format_row(row), flush=True)

    def case(self, name, dtype, x, fn, out_elems):
        """Time fn() (which reads x and writes out_elems elements) against the baselines."""
        in_bytes = x.numel() * x.element_size()
        self.baselines(dtype, in_bytes)
        moved = in_bytes + out_elems * x.element_size()
        self.add_row(name, dtype, list(x.shape), self.time(fn), moved, in_bytes)

    def run(self) -> None:
        for dtype in self.args.dtypes:
            self.ragged(dtype)
            self.interleave(dtype)
            self.index(dtype)
        self.segments()

    def ragged(self, dtype: torch.dtype) -> None:
        """pack / unpack, exact and padded, with the tokens on dim 0 (``x [T, H]``) and on dim 1
        (``x [B=4, N, H]``), split over :data:`WORLD` ranks by uneven counts."""
        rows = elems_for(self.size, dtype) // H
        for dim, batch in ((0, ()), (1, (4,))):
            mean = rows // (batch[0] if batch else 1) // WORLD
            counts = ragged_counts(mean, WORLD)
            pad = max(counts)
            x = self.randn(*batch, WORLD * mean, H, dtype=dtype)
            shape = list(x.shape)
            exact = cpshard.pack_ragged(x, counts, dim)
            padded = cpshard.pack_ragged(x, counts, dim, pad_to=pad)
            for kind, pad_to, packed in (("exact ", None, exact), ("padded", pad, padded)):

                def pack(x=x, counts=counts, dim=dim, pad_to=pad_to):
                    return cpshard.pack_ragged(x, counts, dim, pad_to=pad_to)

                def unpack(packed=packed, counts=counts, shape=shape, dim=dim, pad_to=pad_to):
                    return cpshard.unpack_ragged(packed, counts, shape, dim, pad_to=pad_to)

                self.case(f"pack_ragged {kind} dim{dim}", dtype, x, pack, packed.numel())
                # unpack reads only the real rows of a padded buffer: its input bytes are x's
                self.case(
                    f"unpack_ragged {kind} dim{dim}",
                    dtype,
                    exact if pad_to is None else x,
                    unpack,
                    x.numel(),
                )

    def interleave(self, dtype: torch.dtype) -> None:
        b = 2
        length = elems_for(self.size, dtype) // (WORLD * b * H)
        x = self.randn(WORLD, b, length, H, dtype=dtype)  # [W, B, L, H] -> [B, W*L, H]
        self.case(
            "interleave_sequence", dtype, x, lambda: cpshard.interleave_sequence(x, 1), x.numel()
        )
        y = cpshard.interleave_sequence(x, 1)
        self.case(
            "deinterleave_sequence",
            dtype,
            y,
            lambda: cpshard.deinterleave_sequence(y, WORLD, 1),
            y.numel(),
        )

    def index(self, dtype: torch.dtype) -> None:
        rows = elems_for(self.size, dtype) // H
        src = self.randn(rows, H, dtype=dtype)
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(0)).to(self.device)
        self.case(
            "index_gather (perm)",
            dtype,
            src,
            lambda: cpshard.index_gather(src, perm, 0),
            src.numel(),
        )
        self.case(
            "index_scatter_add (perm)",
            dtype,
            src,
            lambda: cpshard.index_scatter_add(src, perm, 0, rows),
            src.numel(),
        )

    def segments(self) -> None:
        b, s = 8, 131072
        g = torch.Generator().manual_seed(0)
        # documents of random lengths (mean ~2k tokens), a padding tail in some rows
        lengths = torch.randint(1, 4096, (b, s // 64), generator=g)
        ids = torch.zeros(b, s, dtype=torch.int64)
        for r in range(b):
            doc = torch.repeat_interleave(torch.arange(1, lengths.shape[1] + 1), lengths[r])[:s]
            ids[r, : doc.numel()] = doc
            ids[r, s - r * 1000 :] = 0
        ids = ids.to(self.device)
        for name, (start, end) in (
            ("document_segments full", (0, s)),
            ("document_segments 1/4", (s // 4, s // 2)),
        ):
            times = self.time(
                lambda start=start, end=end: cpshard.document_segments(ids, start, end)
            )
            self.add_row(
                name,
                torch.int64,
                [b, s],
                times,
                b * (end - start) * 8,
                b * s * 8,
                tokens=b * (end - start),
            )


HEADER = (
    f"{'case':<27} {'dtype':<9} {'shape':<16} {'median ms':>9} {'min ms':>8} {'GB/s':>7} "
    f"{'faults':>7} {'copy GB/s':>9} {'/copy_':>7} {'/clone':>7}"
)


def format_row(r: Row) -> str:
    if r.tokens_per_s == r.tokens_per_s:  # document_segments
        tail = f"{r.tokens_per_s / 1e9:>7.2f} Gtok/s"
    else:
        tail = f"{r.copy_gbps:>9.2f} {r.ratio:>7.2f} {r.clone_ratio:>7.2f}"
        if r.case.endswith("(baseline)"):
            tail = f"{'':>9} {'':>7} {'':>7}"
    return (
        f"{r.case:<27} {r.dtype:<9} {r.shape:<16} {r.median_ms:>9.2f} {r.min_ms:>8.2f} "
        f"{r.gbps:>7.2f} {r.faults_per_call:>7.0f} {tail}"
    )


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=64, help="data per case (default 64)")
    p.add_argument("--repeats", type=int, default=15, help="timed runs per case (default 15)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs before (default 3)")
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help=f"intra-op threads (default {torch.get_num_threads()})",
    )
    p.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated (default float32,bfloat16)"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the tensors live and the kernels run (default cpu)",
    )
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    args.dtypes = [getattr(torch, d.strip()) for d in args.dtypes.split(",") if d.strip()]
    info = cpshard.build_info()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error(f"--device cuda: no CUDA device is visible to torch {torch.__version__}")
    if args.device == "cuda" and not info.cuda_kernels:
        p.error(f"--device cuda: {cpshard._C.__file__} was built without the CUDA kernels")
    torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        where = f"{device}, synchronized after every call"
        faults = "faults = nan (host page faults say nothing about GPU memory)"
    else:
        where = f"threads {torch.get_num_threads()}"
        faults = "faults = minor page faults per call"
    print(
        f"cpshard {cpshard.__version__} ({cpshard._C.__file__}), torch {torch.__version__}, "
        f"{where}, {args.size_mib} MiB/case, median of {args.repeats}"
    )
    if info.sanitized:
        print("warning: this is the sanitizer build; numbers are meaningless", file=sys.stderr)
    print(
        "GB/s = (bytes read + bytes written) / median; /copy_ and /clone = GB/s over the "
        f"baseline's; {faults}"
    )
    print(HEADER)
    print("-" * len(HEADER))
    bench = Bench(args)
    bench.run()
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "device": device,
                    "threads": torch.get_num_threads(),
                    "size_mib": args.size_mib,
                    "repeats": args.repeats,
                    "torch": torch.__version__,
                    "rows": [asdict(r) for r in bench.rows],
                },
                indent=1,
            )
        )
    missed = [
        r
        for r in bench.rows
        if r.case.split()[0]
        in ("pack_ragged", "unpack_ragged", "interleave_sequence", "deinterleave_sequence")
        and r.ratio < 0.8
    ]
    if missed:
        print("\nbelow the 0.8 x copy_ goal:")
        for r in missed:
            print(f"  {r.case} {r.dtype}: {r.ratio:.2f} ({(0.8 - r.ratio) / 0.8:.0%} short)")
    copy_gbps, clone_gbps = next(iter(bench._baselines.values()), (1.0, 1.0))
    if not bench.on_cuda and clone_gbps < 0.7 * copy_gbps:
        print(
            f"\nnote: clone() runs at {clone_gbps / copy_gbps:.2f} x copy_: writing a freshly "
            "allocated "
            "output costs a page fault per page on first touch, and every op allocates its output. "
            "Compare THP_MEM_ALLOC_ENABLE=1 (2 MiB pages) or "
            "MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=4294967296 (heap reuse)."
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
