"""Rank 0's output: nccl-tests-style tables on stdout, ``--json``, ``--plot``.

Conventions (also printed with the tables):
* time: median over repeats of the per-iteration time, each repeat's time the max over ranks.
* algbw: bytes one forward moves / time — the gathered output for ragged and sequence gathers
  (nccl-tests all-gather convention), the halo received per rank for halos (send/recv
  convention); a forward + backward step moves them twice (gather, then reduce-scatter).
* busbw: algbw x (W-1)/W for gathers (nccl-tests all-gather), algbw for halos.
* peak: peak extra memory allocated during one step beyond its inputs, max over ranks.
* speedup = baseline time / cpshard time; mem = cpshard peak / baseline peak;
  over_floor = cpshard time / the wire floor (bare transfer of exactly the useful bytes).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
from collections import defaultdict

import torch

import cpshard
from cpshard.bench.config import SECTION_OPS
from cpshard.bench.runtime import Runtime
from cpshard.bench.sections import section

_PAD = "pad to max + all_gather + slice + cat (bwd: reduce_scatter)"
_TITLES = {
    "ragged": f"gather_ragged, uneven counts  vs  {_PAD}",
    "ragged_even": f"gather_ragged, equal counts  vs  {_PAD}",
    "sequence": "gather_sequence [1, L, H] seq_dim=1  vs  list all_gather + cat "
    "(bwd: reduce_scatter)",
    "halo": "gather_halo [1, L, H], halo = L/2  vs  all_gather of every shard's tail + slice "
    "(bwd: reduce_scatter)",
}

CONVENTIONS = (
    "time = median over repeats of the per-iteration time (max over ranks); "
    "algbw = bytes one forward moves / time (gathers: the whole gathered output, nccl-tests "
    "all-gather convention; halo: the halo received per rank), x2 for fwd+bwd; "
    "busbw = algbw*(W-1)/W for gathers, = algbw for halo; "
    "peak = peak extra memory allocated by one step beyond its inputs (max over ranks); "
    "speedup = baseline/cpshard time; mem = cpshard/baseline peak; "
    "over_floor = cpshard time / wire floor (bare p2p / all_to_all of exactly the useful "
    "bytes); CPU time columns: the same ratios of the CPU time used by all ranks (user+system, "
    "all threads; insensitive to other load on a shared machine, unlike wall time)"
)


def machine_info(rt: Runtime) -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "cpu_model": cpu,
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else None,
        "omp_num_threads": torch.get_num_threads(),
        # 1: torch's CPU allocator asks for transparent huge pages (far fewer page faults)
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cpshard": cpshard.__version__,
        "build": dataclasses.asdict(cpshard.build_info()),
        "backend": rt.backend,
        "world": rt.world,
        "device": str(rt.device.type),
        "dtype": rt.cfg.dtype,
        "hidden": rt.cfg.hidden,
        # other load on the machine distorts CPU timings: the 1/5/15-minute load averages at the end
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if rt.is_cuda:
        info["gpu"] = torch.cuda.get_device_name(rt.device)
    return info


def mib(b: float | None) -> str:
    """Bytes as MiB with one decimal, ``-`` for none (a figure not measured)."""
    return "-" if b is None else f"{b / 2**20:.1f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def enrich(row: dict) -> dict:
    """Derived figures (bandwidths and ratios) added to a result row, per mode."""
    for mode, times in (("fwd_bwd", 2), ("fwd", 1)):
        t = row[f"ours_{mode}_s"]
        alg = _gbps(times * row["moved_bytes"], t)
        row[f"ours_{mode}_algbw_GBps"] = alg
        row[f"ours_{mode}_busbw_GBps"] = alg * row["bus_factor"]
        row[f"base_{mode}_algbw_GBps"] = _gbps(times * row["moved_bytes"], row[f"base_{mode}_s"])
        row[f"{mode}_speedup"] = row[f"base_{mode}_s"] / t
        floor = row["floor_fwd_bwd_s" if mode == "fwd_bwd" else "floor_fwd_s"]
        row[f"{mode}_over_floor"] = t / floor if floor > 0 else None
        cpu_floor = row["floor_fwd_bwd_cpu_s" if mode == "fwd_bwd" else "floor_fwd_cpu_s"]
        row[f"{mode}_cpu_over_floor"] = (
            row[f"ours_{mode}_cpu_s"] / cpu_floor if cpu_floor > 0 else None
        )
        row[f"{mode}_cpu_speedup"] = (
            row[f"base_{mode}_cpu_s"] / row[f"ours_{mode}_cpu_s"]
            if row[f"ours_{mode}_cpu_s"] > 0
            else None
        )
        ours_peak, base_peak = (
            row.get(f"ours_{mode}_peak_bytes"),
            row.get(f"base_{mode}_peak_bytes"),
        )
        row[f"{mode}_mem_ratio"] = (
            ours_peak / base_peak if ours_peak is not None and base_peak else None
        )
    return row


def op_tables(rows: list[dict]) -> str:
    by_op: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_op[row["op"]].append(row)
    head = (
        f"{'mode':>8} {'size(B)':>10} {'tokens':>7} {'world':>5} | {'time(us)':>10} {'algbw':>7} "
        f"{'busbw':>7} {'peak(MiB)':>9} | {'base(us)':>10} {'peak(MiB)':>9} | {'speedup':>7} "
        f"{'mem':>5} | {'floor(us)':>10} {'over_floor':>10} | "
        f"{'cpu:speedup':>11} {'over_floor':>10}"
    )
    out = []
    for op, op_rows in by_op.items():
        first = op_rows[0]
        out.append(f"# {op}: {_TITLES.get(op, op)}")
        if op == "ragged":
            w = first["world"]
            props = ", ".join(f"{c * w / sum(first['counts']):.2f}" for c in first["counts"])
            out.append(f"#   counts = mean x ({props}), max/mean = {first['max_over_mean']:.2f}")
        out.append(
            f"#   {'':>37}  ----------- cpshard ------------   ---- baseline ----   -- ratio ---"
            f"   ----- wire floor -----   ---- CPU time ----"
        )
        out.append("#" + head)
        for mode in ("fwd_bwd", "fwd"):
            for r in op_rows:
                peak = r.get(f"ours_{mode}_peak_bytes")
                bpeak = r.get(f"base_{mode}_peak_bytes")
                floor = r["floor_fwd_bwd_s" if mode == "fwd_bwd" else "floor_fwd_s"]
                label = mode.replace("_", "+")
                out.append(
                    f" {label:>8} {r['bytes_per_rank']:>10} {r['tokens']:>7} {r['world']:>5} | "
                    f"{r[f'ours_{mode}_s'] * 1e6:>10.0f} {r[f'ours_{mode}_algbw_GBps']:>7.3f} "
                    f"{r[f'ours_{mode}_busbw_GBps']:>7.3f} {mib(peak):>9} | "
                    f"{r[f'base_{mode}_s'] * 1e6:>10.0f} {mib(bpeak):>9} | "
                    f"{r[f'{mode}_speedup']:>7.2f} {_ratio(peak, bpeak):>5} | "
                    f"{floor * 1e6:>10.0f} {_ratio(r[f'ours_{mode}_s'], floor):>10} | "
                    f"{_fmt(r[f'{mode}_cpu_speedup']):>11} {_fmt(r[f'{mode}_cpu_over_floor']):>10}"
                )
        kinds = sorted({f"fwd {r['floor_fwd_kind']}, bwd {r['floor_bwd_kind']}" for r in op_rows})
        out.append(f"#   floor = fastest bare transfer per direction: {'; '.join(kinds)}")
        out.append("")
    return "\n".join(out)


def strategy_rule(rows: list[dict]) -> list[str]:
    """The measured winner per direction and count pattern, stated as a rule: by median time,
    and by CPU time where that differs (on a shared CPU box the CPU time is the steadier)."""
    groups: dict[tuple[str, str], dict[int, dict[str, tuple[float, float]]]] = defaultdict(
        lambda: defaultdict(dict)
    )
    for r in rows:
        cpu = r.get("cpu_s", float("nan"))
        groups[(r["direction"], r["pattern"])][r["tokens"]][r["strategy"]] = (r["time_s"], cpu)
    lines = []
    for (direction, pattern), per_size in groups.items():
        winners, parts = [], []
        for tokens in sorted(per_size):
            times = {name: t for name, (t, _) in per_size[tokens].items()}
            cpus = {name: c for name, (_, c) in per_size[tokens].items()}
            order = sorted(times, key=times.get)
            part = f"{tokens} tok: {order[0]}"
            if len(order) > 1:
                part += f" (next {order[1]} +{(times[order[1]] / times[order[0]] - 1) * 100:.0f}%)"
            by_cpu = min(cpus, key=cpus.get)
            if by_cpu != order[0]:
                part += f", by CPU {by_cpu}"
            winners.append(order[0])
            parts.append(part)
        detail = "; ".join(parts)
        if len(set(winners)) == 1:
            lines.append(f"{direction} {pattern}: {winners[0]} at every size measured [{detail}]")
        else:
            lines.append(f"{direction} {pattern}: winner depends on size [{detail}]")
    return lines


def _cell(times: dict, cpu: dict, peak: dict, name: str) -> str:
    text = f"{times[name] * 1e3:.1f} / {cpu[name] * 1e3:.1f} / {mib(peak.get(name))}"
    return f"{text:>23}{'*' if name == min(times, key=times.get) else ' '}"


def strategy_table(rows: list[dict]) -> str:
    cells: dict[tuple[str, str, int], dict[str, float]] = defaultdict(dict)
    cpu: dict[tuple[str, str, int], dict[str, float]] = defaultdict(dict)
    for r in rows:
        cells[(r["direction"], r["pattern"], r["tokens"])][r["strategy"]] = r["time_s"]
        cpu[(r["direction"], r["pattern"], r["tokens"])][r["strategy"]] = r.get(
            "cpu_s", float("nan")
        )
    peak: dict[tuple[str, str, int], dict[str, float | None]] = defaultdict(dict)
    for r in rows:
        peak[(r["direction"], r["pattern"], r["tokens"])][r["strategy"]] = r.get("peak_bytes")
    out = [
        "# strategies for the ragged gather (fwd: all-gather-v) and its backward (bwd:",
        "#   reduce-scatter-v SUM), complete implementations (allocation, staging, summation);",
        "#   per cell: median time(ms) / CPU time(ms, all ranks) / peak extra MiB (max over",
        "#   ranks); * = fastest",
    ]
    for direction in ("fwd", "bwd"):
        names = list(dict.fromkeys(r["strategy"] for r in rows if r["direction"] == direction))
        out.append(
            "#" + f"{'dir':>4} {'counts':>8} {'tokens':>7} " + " ".join(f"{n:>24}" for n in names)
        )
        for (d, pattern, tokens), times in cells.items():
            if d != direction:
                continue
            key = (d, pattern, tokens)
            vals = " ".join(_cell(times, cpu[key], peak[key], n) for n in names)
            out.append(f" {direction:>4} {pattern:>8} {tokens:>7} {vals}")
    out.append("# measured rule:")
    out.extend(f"#   {line}" for line in strategy_rule(rows))
    return "\n".join(out)


def _plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        rs = sorted((r for r in rows if r["op"] == op), key=lambda r: r["bytes_per_rank"])
        x = [r["bytes_per_rank"] for r in rs]
        for key, label, style in (
            ("ours_fwd_bwd_s", "cpshard", "o-"),
            ("base_fwd_bwd_s", "baseline", "s--"),
            ("floor_fwd_bwd_s", "wire floor", ":"),
        ):
            ax.plot(x, [r[key] * 1e6 for r in rs], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{op} fwd+bwd, W={rs[0]['world']}")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("time (us)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(rt: Runtime, results: dict) -> None:
    cfg = rt.cfg
    rows = [enrich(r) for r in results["ops"]]
    machine = machine_info(rt)
    print(
        f"# cpshard bench: world={rt.world} backend={rt.backend} device={machine['device']} "
        f"dtype={cfg.dtype} hidden={cfg.hidden} repeats={cfg.repeats} warmup={cfg.warmup} "
        f"iters={'auto' if cfg.iters == 0 else cfg.iters}"
    )
    load = machine["load_average"]
    print(
        f"# machine: {machine['cpu_model']}, {machine['cpu_cores']} cores, torch {machine['torch']}"
        + (f", {machine['gpu']}" if "gpu" in machine else "")
        + (f", load average {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} (1/5/15 min)" if load else "")
        + f", THP_MEM_ALLOC_ENABLE={machine['THP_MEM_ALLOC_ENABLE'] or 'unset'}"
    )
    print(f"# {CONVENTIONS}")
    print()
    if rows:
        print(op_tables(rows))
    if results["strategies"]:
        print(strategy_table(results["strategies"]))
    for name in SECTION_OPS:
        if name in results:
            print()
            print(section(name).render(results[name]))
    sys.stdout.flush()
    if cfg.json_path:
        payload = {
            "cpshard_bench": 1,
            "machine": machine,
            "config": dataclasses.asdict(cfg),
            "conventions": CONVENTIONS,
            "results": rows,
            "strategies": results["strategies"],
            "strategy_rule": strategy_rule(results["strategies"]) if results["strategies"] else [],
            **{name: results[name] for name in SECTION_OPS if name in results},
        }
        with open(cfg.json_path, "w") as f:
            json.dump(payload, f, indent=1)
    if cfg.plot_path and rows:
        _plot(cfg.plot_path, rows)
