"""Layouts: the per-rank causal-attention balance of every layout, and the time of
:meth:`cpshard.ContextParallelSharder.gather_token_tensor` next to the usual un-shard.

(a) Balance (pure; rank 0 computes while the other ranks wait): packed rows of random documents
(exponential lengths of a given mean, up to ``W - 1`` padding tokens at the tail). For every
layout, each rank's causal-attention cost (the sum over its tokens of the keys each attends to
inside its document) and the row's max/mean over ranks, at the bench's world size; reported:
the mean and the worst max/mean over the rows, how many rows ``balanced`` keeps within 1.05, and
the planning time per row of the data-dependent layouts.

(b) Un-shard (every rank of the bench group): ``gather_token_tensor(shard, trim=True)`` against
the baseline that does not know the layout in closed form -- all-gather every rank's index
tensor, all-gather the shards, argsort the gathered indices, index, slice -- for per-token
values ``[B, S]`` and hidden states ``[1, S, H]``, ``head_tail`` and ``balanced``. Both are
checked equal to the full tensor once, then timed together (:func:`time_steps`).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpshard import LAYOUTS, ContextParallelSharder, ShardLayout, layouts, make_layout
from cpshard.bench.memory import peak_extra_bytes
from cpshard.bench.report import mib
from cpshard.bench.runtime import Runtime
from cpshard.bench.timing import time_steps
from cpshard.comm.torch_compat import all_gather_single
from cpshard.layouts import DATA_DEPENDENT_LAYOUTS
from cpshard.layouts.owners import owner_ranks

BALANCED_GOAL = 1.05  # max/mean the balanced layout must reach where the packing allows it


@dataclass(frozen=True)
class BalanceSizes:
    seq_len: int  # tokens per packed row
    rows: int  # random rows per document-length mean
    means: tuple[float, ...]  # document-length means


@dataclass(frozen=True)
class GatherCase:
    layout: str
    rows: int  # B
    seq_len: int  # S (the caller's length; padded as the layout needs)
    hidden: int  # 0: per-token values [B, S]; else hidden states [B, S, H]
    mean_doc_len: float  # documents of the packed rows the data-dependent layouts plan from

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, self.seq_len) + ((self.hidden,) if self.hidden else ())


BALANCE = BalanceSizes(8192, 24, (64.0, 512.0, 2048.0, 8192.0))
QUICK_BALANCE = BalanceSizes(250, 3, (16.0, 128.0))

# per-token values (log-probs, losses): one long row, and 8 rows (per-row indices for balanced);
# hidden states [1, S, H]
CASES = tuple(
    GatherCase(layout, rows, seq_len, hidden, 2048.0)
    for rows, seq_len, hidden in ((1, 131072, 0), (8, 32768, 0), (1, 16384, 256))
    for layout in ("head_tail", "balanced")
)
# lengths that are not multiples of 2W, so that the smoke test exercises the trim
QUICK_CASES = tuple(
    GatherCase(layout, rows, seq_len, hidden, 24.0)
    for rows, seq_len, hidden in ((2, 301, 0), (1, 203, 8))
    for layout in ("head_tail", "balanced")
)


def _sizes(rt: Runtime) -> tuple[BalanceSizes, tuple[GatherCase, ...]]:
    return (QUICK_BALANCE, QUICK_CASES) if rt.cfg.quick else (BALANCE, CASES)


def steps(rt: Runtime) -> int:
    """One step per document-length mean of the balance figures, one per un-shard case."""
    sizes, cases = _sizes(rt)
    return len(sizes.means) + len(cases)


# ------------------------------------------------------------------------------- balance


def random_row(rng: random.Random, seq_len: int, mean: float, pad_max: int = 0) -> list[int]:
    """Document ids of one packed row: exponential document lengths (>= 1) of mean ``mean``,
    then up to ``pad_max`` padding tokens (id 0)."""
    pad = rng.randrange(pad_max + 1) if pad_max else 0
    ids, doc = [], 1
    while len(ids) < seq_len - pad:
        ids += [doc] * max(1, int(rng.expovariate(1.0 / mean)))
        doc += 1
    return ids[: seq_len - pad] + [0] * pad


def max_over_mean(doc_ids: torch.Tensor, lay: ShardLayout) -> float:
    """The per-rank causal cost's max/mean of one row ``doc_ids`` ``[1, S]`` under ``lay``."""
    padded = torch.cat([doc_ids, doc_ids.new_zeros(1, lay.padded_seq_len - doc_ids.shape[1])], 1)
    costs = layouts.rank_costs(padded, owner_ranks(lay), lay.world_size).double()
    return float(costs.max() / costs.mean()) if costs.sum() > 0 else 1.0


def balance_figures(world: int, sizes: BalanceSizes, mean: float, seed: int = 0) -> list[dict]:
    """Per layout, over ``sizes.rows`` random rows with documents of mean length ``mean``: the
    mean and worst max/mean, the rows within :data:`BALANCED_GOAL`, the planning time per row."""
    rng = random.Random(f"{seed}:{mean}")
    packs = [
        torch.tensor([random_row(rng, sizes.seq_len, mean, pad_max=world - 1)])
        for _ in range(sizes.rows)
    ]
    out = []
    for name in LAYOUTS:
        ratios, plan_s = [], []
        for ids in packs:
            t0 = time.perf_counter()
            lay = make_layout(name, world, sizes.seq_len, doc_ids=ids)
            plan_s.append(time.perf_counter() - t0)
            ratios.append(max_over_mean(ids, lay))
        out.append(
            {
                "world": world,
                "seq_len": sizes.seq_len,
                "rows": sizes.rows,
                "mean_doc_len": mean,
                "layout": name,
                "mean_max_over_mean": statistics.mean(ratios),
                "worst_max_over_mean": max(ratios),
                "rows_within_goal": sum(r <= BALANCED_GOAL for r in ratios),
                "plan_ms_per_row": (
                    1e3 * statistics.median(plan_s) if name in DATA_DEPENDENT_LAYOUTS else None
                ),
            }
        )
    return out


# ------------------------------------------------------------------------------- un-shard


def baseline_unshard(
    local: torch.Tensor, mine: torch.Tensor, seq_len: int, pg: dist.ProcessGroup
) -> torch.Tensor:
    """The un-shard without a closed form (user code, so ``torch.distributed`` directly):
    all-gather every rank's index tensor ``mine`` (``[L]`` or per row ``[B, L]``) and the shards
    ``local`` ``[B, L, ...]``, argsort the indices, index, slice to ``seq_len``."""
    world = dist.get_world_size(pg)
    rows, length = local.shape[:2]
    every = mine.new_empty(world * mine.numel())
    all_gather_single(every, mine.contiguous().view(-1), group=pg)
    data = local.new_empty(world * local.numel())
    all_gather_single(data, local.contiguous().view(-1), group=pg)
    data = data.view(world, *local.shape).movedim(0, 1)
    data = data.reshape(rows, world * length, *local.shape[2:])
    order = torch.argsort(every.view(world, -1, length).permute(1, 0, 2).flatten(1), dim=1)
    if order.shape[0] == 1:  # every row alike
        out = data.index_select(1, order[0])
    else:  # per-row indices
        idx = order.view(*order.shape, *([1] * (data.dim() - 2))).expand(data.shape)
        out = torch.gather(data, 1, idx)
    return out[:, :seq_len]


@dataclass
class GatherSetup:
    """One case on one rank: the sharder after its shard, the full tensor, this rank's shard
    and global positions."""

    sharder: ContextParallelSharder
    full: torch.Tensor
    local: torch.Tensor
    mine: torch.Tensor


def setup_case(rt: Runtime, case: GatherCase) -> GatherSetup:
    """Shard a batch of packed rows with ``case.layout`` and this rank's shard of a full tensor
    built identically on every rank."""
    rng = random.Random(1)
    docs = torch.tensor(
        [random_row(rng, case.seq_len, case.mean_doc_len) for _ in range(case.rows)]
    )
    sharder = ContextParallelSharder(rt.pg, case.layout)
    ids = torch.ones(case.rows, case.seq_len, dtype=torch.int64)
    sharder.shard({"input_ids": ids.to(rt.device), "_packed_seq_ids": docs.to(rt.device)})
    gen = torch.Generator().manual_seed(2)
    full = torch.randn(case.shape, generator=gen).to(device=rt.device, dtype=rt.dtype)
    local = sharder.shard_token_tensor(full, fill=0.0).contiguous()
    mine = sharder.shard_layout.indices(rt.rank, rt.device).contiguous()
    return GatherSetup(sharder, full, local, mine)


def time_case(rt: Runtime, case: GatherCase) -> dict:
    """Un-shard time (and peak extra memory) of cpshard and of the baseline for one case."""
    s = setup_case(rt, case)
    runs = {
        "cpshard": lambda: s.sharder.gather_token_tensor(s.local, trim=True),
        "baseline": lambda: baseline_unshard(s.local, s.mine, case.seq_len, rt.pg),
    }
    for who, fn in runs.items():
        if not torch.equal(fn(), s.full):
            raise AssertionError(f"rank {rt.rank}: layouts {case}: the {who} un-shard differs")
    cfg = rt.cfg
    timings = time_steps(
        rt, runs, warmup=cfg.warmup, repeats=cfg.repeats, iters=cfg.iters, target_s=cfg.target_s
    )
    figures = {
        who: {  # per iteration: median and every repeat (max over ranks), CPU summed over ranks
            "median_s": timings[who].median_s,
            "repeats_s": list(timings[who].repeats_s),
            "cpu_s": timings[who].cpu_s,
            "peak_bytes": peak_extra_bytes(rt, fn) if cfg.memory else None,
        }
        for who, fn in runs.items()
    }
    return {
        "layout": case.layout,
        "shape": list(case.shape),
        "mean_doc_len": case.mean_doc_len,
        "world": rt.world,
        "dtype": cfg.dtype,
        **figures,
        "speedup": figures["baseline"]["median_s"] / figures["cpshard"]["median_s"],
    }


def run(rt: Runtime) -> dict:
    """Balance figures (rank 0; the others wait at a barrier), then every un-shard case."""
    sizes, cases = _sizes(rt)
    figures: list[dict] = []
    for mean in sizes.means:
        rt.progress(f"layouts: balance, documents of ~{mean:.0f} tokens")
        if rt.rank == 0:
            figures += balance_figures(rt.world, sizes, mean)
    dist.barrier(group=rt.pg, **rt.barrier_kwargs)
    gathers = []
    for case in cases:
        rt.progress(f"layouts: gather_token_tensor {case.layout} {list(case.shape)}")
        gathers.append(time_case(rt, case))
    return {"world": rt.world, "balance": figures, "gather": gathers}


# ------------------------------------------------------------------------------- render


def _balance_block(rows: list[dict], world: int) -> list[str]:
    first = rows[0]
    means = sorted({r["mean_doc_len"] for r in rows})
    cell = {(r["layout"], r["mean_doc_len"]): r for r in rows}
    out = [
        f"# layouts: per-rank causal-attention cost, max/mean over the {world} ranks, of "
        f"{first['rows']} random packed rows of {first['seq_len']} tokens",
        "#   (exponential document lengths of the given mean, up to W-1 padding tokens): mean "
        "over rows / worst row; planning ms per row (data-dependent layouts)",
        f"#{'layout':<23}"
        + "".join(f"{'doc ~' + str(int(m)):>17}" for m in means)
        + f"{'plan ms':>9}",
    ]
    for name in LAYOUTS:
        cells = [cell[name, m] for m in means]
        plans = [c["plan_ms_per_row"] for c in cells if c["plan_ms_per_row"] is not None]
        out.append(
            f" {name:<23}"
            + "".join(
                f"{c['mean_max_over_mean']:>9.3f} / {c['worst_max_over_mean']:<5.3f}" for c in cells
            )
            + (f"{max(plans):>9.2f}" if plans else f"{'-':>9}")
        )
    bal = [cell["balanced", m] for m in means]
    within = sum(c["rows_within_goal"] for c in bal)
    total = sum(c["rows"] for c in bal)
    worst = max(bal, key=lambda c: c["worst_max_over_mean"])
    out.append(
        f"# balanced <= {BALANCED_GOAL}: {within}/{total} rows"
        + (
            ""
            if within == total
            else f" (worst {worst['worst_max_over_mean']:.3f} at doc ~{int(worst['mean_doc_len'])})"
        )
    )
    return out


def _gather_block(rows: list[dict]) -> list[str]:
    out = [
        "# layouts: gather_token_tensor(trim=True)  vs  all-gather of every rank's index tensor",
        "#   + all-gather of the shards + argsort + index + slice; median ms (max over ranks) / "
        "peak extra MiB",
        f"#{'layout':<10} {'shape':>17} {'world':>5} {'cpshard ms':>11} {'base ms':>9} "
        f"{'speedup':>8} {'cpshard MiB':>12} {'base MiB':>9}",
    ]
    for r in rows:
        shape = "[" + ", ".join(map(str, r["shape"])) + "]"
        ours, base = r["cpshard"], r["baseline"]
        out.append(
            f" {r['layout']:<10} {shape:>17} {r['world']:>5} {ours['median_s'] * 1e3:>11.2f} "
            f"{base['median_s'] * 1e3:>9.2f} {r['speedup']:>8.2f} "
            f"{mib(ours['peak_bytes']):>12} {mib(base['peak_bytes']):>9}"
        )
    return out


def render(result: dict) -> str:
    """The balance table, the balanced-layout verdict and the un-shard table."""
    return "\n".join(
        _balance_block(result["balance"], result["world"]) + [""] + _gather_block(result["gather"])
    )
