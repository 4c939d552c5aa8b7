"""The validated settings of one ``cpshard bench`` run (picklable: it travels to every rank)."""

from __future__ import annotations

from dataclasses import dataclass

from cpshard.validation import is_int

GATHER_OPS = ("ragged", "ragged_even", "sequence", "halo")
SECTION_OPS = (
    "planner", "vision", "layouts", "blockdiag", "attention", "mixers", "loss", "planning",
    "memory", "heads_memory",
)  # fmt: skip
OPS = (*GATHER_OPS, "strategies", *SECTION_OPS)
# ``--full`` and ``--ops all``: every op but those that run only when named (long grids, and
# ``heads_memory``'s cases: fresh ranks per case, minutes on a CPU)
NAMED_ONLY_OPS = ("planning", "memory", "heads_memory")
FULL_OPS = tuple(op for op in OPS if op not in NAMED_ONLY_OPS)
# the default: a representative subset (the transport, CP attention under each exchange
# strategy, the vision planner) that finishes in a few minutes on a 2-core CPU machine
DEFAULT_OPS = ("ragged", "sequence", "halo", "attention", "planner")
DTYPES = ("float32", "bfloat16", "float16", "float64")
BACKENDS = ("auto", "gloo", "nccl")

DEFAULT_SIZES = (
    256,
    1024,
)  # tokens per rank (the mean for ragged counts); 2 and 8 MiB at H=2048 fp32
DEFAULT_HIDDEN = 2048
DEFAULT_WORLD_CPU = 4


@dataclass(frozen=True)
class BenchConfig:
    """What to run. ``world=None``: the launcher's world size, else a default (see launch)."""

    world: int | None = None
    ops: tuple[str, ...] = DEFAULT_OPS
    sizes: tuple[int, ...] = DEFAULT_SIZES
    hidden: int = DEFAULT_HIDDEN
    dtype: str = "float32"
    repeats: int = 5
    warmup: int = 1
    iters: int = 0  # iterations per repeat; 0 = enough for about ``target_s`` per repeat
    target_s: float = 0.1
    json_path: str | None = None
    plot_path: str | None = None
    backend: str = "auto"
    timeout_s: float = 600.0
    memory: bool = True  # measure peak extra memory (two profiled steps per op)
    quick: bool = False  # smoke-test problem sizes for the sections
    full: bool = False  # every grid of each section (else the attention section runs one case)

    def __post_init__(self) -> None:
        def bad(field: str, value: object, need: str) -> ValueError:
            return ValueError(f"BenchConfig.{field}={value!r}: {need}")

        if self.world is not None and (
            not is_int(self.world) or self.world < 2
        ):
            raise bad("world", self.world, "must be an int >= 2")
        if (
            not self.ops
            or any(op not in OPS for op in self.ops)
            or len(set(self.ops)) != len(self.ops)
        ):
            raise bad("ops", self.ops, f"must be distinct names from {', '.join(OPS)}")
        if not self.sizes or any(
            not is_int(s) or s < 1 for s in self.sizes
        ):
            raise bad("sizes", self.sizes, "must be ints >= 1 (tokens per rank)")
        for field, low in (("hidden", 1), ("repeats", 1), ("warmup", 0), ("iters", 0)):
            value = getattr(self, field)
            if not is_int(value) or value < low:
                raise bad(field, value, f"must be an int >= {low}")
        if self.dtype not in DTYPES:
            raise bad("dtype", self.dtype, f"must be one of {', '.join(DTYPES)}")
        if self.backend not in BACKENDS:
            raise bad("backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        if not self.target_s > 0:
            raise bad("target_s", self.target_s, "must be > 0")
        if not self.timeout_s > 0:
            raise bad("timeout_s", self.timeout_s, "must be > 0")
