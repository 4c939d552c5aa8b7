"""``cpshard plan --memory``'s report: every simulated rank's predicted peak by category, the
worst rank, and whether it fits a device (a named GPU or a size)."""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.byte_units import parse_bytes
from cpshard.simulation.step_memory import CATEGORIES, RankMemory

# Named devices -> their memory as sold (decimal GB).
DEVICES = {"h100": 80 * 10**9, "h200": 141 * 10**9, "a100": 80 * 10**9, "b200": 192 * 10**9}

METHOD = (
    "the real step (forward, loss, backward, optimizer step) under FakeTensorMode on torch's fake "
    "process group, tracked by torch's MemTracker (FSDPMemTracker with FSDP2's fully_shard on "
    "the fake group) with cpshard's ops traced through; {traced} decoder layers traced per rank "
    "and composed to {layers} (identical layers: each further layer repeats the second's saved "
    "activations, gradients, parameters and optimizer state); the optimizer step traced and "
    "composed alike; CPU kernels' allocations"
)


@dataclass(frozen=True)
class Device:
    """A memory budget: its name as given and its bytes."""

    name: str
    bytes: int


def device(text: str) -> Device:
    """``--device``: a name of :data:`DEVICES` or a size (``96GiB``, ``80GB``)."""
    key = text.strip().lower()
    if key in DEVICES:
        return Device(key, DEVICES[key])
    return Device(text.strip(), parse_bytes(text, f"--device (or one of {', '.join(DEVICES)})"))


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def worst(ranks: list[RankMemory]) -> RankMemory:
    return max(ranks, key=lambda m: (m.peak_bytes, -m.rank))


def render(
    header: list[str],
    ranks: list[RankMemory],
    dev: Device,
    layers: int,
    traced: int,
    seconds: float,
) -> str:
    """The report's text: ``header`` lines, a row per rank (GiB), the worst rank and the fit."""
    names = list(CATEGORIES)
    out = [*header, "# method: " + METHOD.format(traced=traced, layers=layers)]
    out.append(
        f"#{'rank':>5} {'peak GiB':>9} " + " ".join(f"{n:>12}" for n in names) + "  peak at"
    )
    for m in ranks:
        out.append(
            f" {m.rank:>5} {gib(m.peak_bytes):>9} "
            + " ".join(f"{gib(m.by_category[n]):>12}" for n in names)
            + f"  {m.at}"
        )
    w = worst(ranks)
    room = dev.bytes - w.peak_bytes
    verdict = "fits" if room >= 0 else "does NOT fit"
    out += [
        f"# worst: rank {w.rank}, {gib(w.peak_bytes)} GiB at {w.at}: {verdict} {dev.name} "
        f"({gib(dev.bytes)} GiB), {'spare' if room >= 0 else 'over by'} {gib(abs(room))} GiB",
        f"# predicted in {seconds:.1f} s ({len(ranks)} rank(s); per-rank trace median "
        f"{sorted(m.trace_s for m in ranks)[len(ranks) // 2]:.1f} s)",
    ]
    return "\n".join(out)


def payload(
    ranks: list[RankMemory], dev: Device, layers: int, traced: int, seconds: float
) -> dict:
    """The report as JSON: ``ranks`` (rank, peak_bytes, by_category, at, trace_s), the worst
    rank, the device and whether the worst fits it, the method and the time taken."""
    w = worst(ranks)
    return {
        "ranks": [
            {"rank": m.rank, "peak_bytes": m.peak_bytes, "by_category": m.by_category,
             "at": m.at, "trace_s": m.trace_s}
            for m in ranks
        ],
        "worst": {"rank": w.rank, "peak_bytes": w.peak_bytes, "at": w.at},
        "device": {"name": dev.name, "bytes": dev.bytes, "fits": w.peak_bytes <= dev.bytes},
        "method": METHOD.format(traced=traced, layers=layers),
        "seconds": seconds,
    }  # fmt: skip
