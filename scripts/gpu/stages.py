"""The stages of ``scripts/gpu/check.sh`` that run cpshard's CP layer, each writing its JSON as it
ends (``OUT/<stage>.json``); they run after the build stage made the extension.

* ``correctness``: W = 2 and 4 ranks on the one GPU (NCCL refuses two ranks on one device) with
  CUDA tensors, the transport through gloo staged through host memory
  (:mod:`cpshard.comm.host_staged`), so the CUDA kernels, the attention's varlen path and the
  multi-rank plans run for real: the ``needed_rows`` and ``heads`` strategies (and
  ``hierarchical`` on a 2 x 2 mesh at W = 4), a sliding window, sinks and a soft-cap, and a
  mixer (the causal convolution's window exchange), each forward and backward in bf16 against
  the same step in float64 on the CPU, within ``FACTOR`` times the error of a plain-PyTorch
  bf16 reference against that float64 one (the flash-attention tests' rule); then the
  steady-state step under ``torch.cuda.set_sync_debug_mode("error")``;
* ``compile``: ``torch.compile`` of the layer against eager at W = 2 (one cold compile per rank);
* ``graph``: (world size 1: a captured graph cannot hold the host-staged transfers) CUDA-graph
  capture of a warmed layer replayed on new inputs;
* ``bench``: one CP layer step at W = 2 on the shared GPU, the varlen attention against
  per-document SDPA, and each attention kernel cpshard can run here (torch's FA2 flash op,
  FlashAttention-3, the flash-attn package's soft-capped FA2, the explicit one), plain and
  soft-capped, against per-document SDPA with which kernel ran (:mod:`varlen_kernels`; the
  kernels against copy bandwidth and the per-call verb cost against
  torch's ``all_gather_into_tensor`` are ``cpshard.bench.kernels`` and
  ``cpshard.bench.nccl_world1``, which check.sh runs as stages of their own).

``--device cpu`` (check.sh ``--dry-run``) runs the same logic on CPU tensors (float32 as the low
precision, ``torch.compile`` with the ``aot_eager`` backend, the graph stage's calls without a
graph) so CI proves the stages' logic; what CPU cannot check (the sync check, the capture) is
recorded as not checked, and timings are labelled dry-run.

    python scripts/gpu/stages.py {correctness,compile,graph,bench} --out DIR [--device cuda|cpu]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

# the checkout this script belongs to, unless PYTHONPATH / an install provides cpshard first
# (at import: spawned ranks import this file too), and this folder's scripts
sys.path.append(str(Path(__file__).resolve().parents[2]))
sys.path.append(str(Path(__file__).resolve().parent))
import numerics  # noqa: E402
import stage_args  # noqa: E402
import steady_state  # noqa: E402
import timing  # noqa: E402
import varlen_kernels  # noqa: E402

import cpshard  # noqa: E402
from cpshard.attention import active_state  # noqa: E402
from cpshard.mixers import cp_causal_conv1d  # noqa: E402

FACTOR = 3.0  # cpshard may err by this multiple of the plain low-precision reference's error
HEAD_DIM = 32
DOCS = [37, 100, 1, 150, 12, 84]  # document lengths of the one batch row (sum 384)


def _write(out: Path, name: str, record: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True))


# ---------------------------------------------------------------- correctness


def _reference(q, k, v, variant: dict, sinks) -> torch.Tensor:
    """Per-document causal attention of :data:`DOCS` in q's dtype (numerics.py's statement)."""
    return numerics.reference(
        q, k, v, DOCS,
        numerics.Variant(variant.get("window"), variant.get("softcap"), sinks is not None), sinks,
    )  # fmt: skip


def _with_grads(fn: Callable, leaves: list[torch.Tensor], weight: torch.Tensor) -> list:
    """fn(*leaves) and its gradients (numerics.py's), in float64 on the CPU."""
    return [t.cpu() for t in numerics.with_grads(fn, leaves, weight.to(leaves[0].device))]


@contextmanager
def no_sync(device: str) -> Iterator[None]:
    """Any device->host sync inside raises (CUDA: steady_state.py's check); a plain call on CPU."""
    with steady_state.no_sync() if device == "cuda" else nullcontext():
        yield


def _backend(device: str) -> str:
    """torch.compile's backend: inductor on the GPU, aot_eager (no C++ compiler) on CPU."""
    return "inductor" if device == "cuda" else "aot_eager"


def _case_inputs(heads: int, kv_heads: int, sinks: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(heads * 7 + kv_heads + 3 * sinks)
    s = sum(DOCS)
    full = [
        torch.randn(1, h, s, HEAD_DIM, generator=g, dtype=torch.float64)
        for h in (heads, kv_heads, kv_heads)
    ]
    if sinks:
        full.append(torch.randn(heads, generator=g, dtype=torch.float64) + 1.0)
    return full, torch.randn(1, heads, s, HEAD_DIM, generator=g)


def _cp_step(
    group: object,
    rank: int,
    world: int,
    leaves: list[torch.Tensor],
    weight: torch.Tensor,
    variant: dict,
    strategy: str,
    device: str,
    compiled: bool = False,
    checked: bool = False,
    warm: bool = True,
) -> list[torch.Tensor]:
    """This rank's slice of the CP layer's output and gradients (q, k, v, sinks) for the
    full-sequence ``leaves``: contiguous shards, one batch row of :data:`DOCS`; the step's set-up,
    a warm-up call (``warm``), then the forward and backward (``checked``: under the sync
    check)."""
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(DOCS)])[None]
    sharder = cpshard.ContextParallelSharder(group, "contiguous", strategy=strategy)
    ctx, local = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    length = doc.shape[1] // world
    mine = slice(rank * length, (rank + 1) * length)
    sinks = variant.get("sinks", False)
    parts = [t[:, :, mine] for t in leaves[:3]] + ([leaves[3]] if sinks else [])
    local_leaves = [t.detach().to(device).requires_grad_() for t in parts]
    position_ids = local["position_ids"].to(device)

    def layer(q, k, v, *rest):
        return cpshard.cp_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1],
            window=variant.get("window"), softcap=variant.get("softcap"),
            sinks=rest[0] if rest else None, position_ids=position_ids,
        )  # fmt: skip

    fn = torch.compile(layer, backend=_backend(device)) if compiled else layer
    w = weight[:, :, mine].to(device)
    with ctx():
        if warm:  # the step's first call may make its metadata (and sync)
            fn(*local_leaves)
        with no_sync(device) if checked else nullcontext():
            out = fn(*local_leaves)
            grads = torch.autograd.grad((out.float() * w).sum(), local_leaves)
    got = [out.detach().double().cpu(), *(g.double().cpu() for g in grads)]
    if sinks:  # every rank holds the sinks: their gradient is the sum over ranks
        dist.all_reduce(got[-1], group=group if isinstance(group, dist.ProcessGroup) else None)
    return got


def _compare(got: list, truth: list, ref_lp: list, mine: slice) -> tuple[bool, list[dict]]:
    names = ("out", "dq", "dk", "dv", "dsinks")
    ok, rows = True, []
    for name, a, t, r in zip(names[: len(got)], got, truth, ref_lp, strict=True):
        if name != "dsinks":
            t, r = t[:, :, mine], r[:, :, mine]
        err = (a - t).abs().max().item()
        ref_err = (r - t).abs().max().item()
        bound = FACTOR * ref_err + 1e-6 * t.abs().max().item()
        good = err <= bound and bool(torch.isfinite(a).all())
        ok &= good
        rows.append({"what": name, "err": err, "ref_err": ref_err, "bound": bound, "ok": good})
    return ok, rows


def _conv_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-document causal depthwise convolution (then SiLU) of ``x`` ``[1, S, C]``."""
    outs, at = [], 0
    for n in DOCS:
        seg = F.pad(x[:, at : at + n].transpose(1, 2), (w.shape[1] - 1, 0))
        y = F.conv1d(seg, w.unsqueeze(1).to(seg.dtype), b.to(seg.dtype), groups=w.shape[0])
        outs.append(F.silu(y).transpose(1, 2))
        at += n
    return torch.cat(outs, dim=1)


def _conv_case(pg: object, rank: int, world: int, dev: str, low: torch.dtype) -> tuple[bool, list]:
    """The CP causal convolution (a mixer: the window exchange across ranks) against each
    document alone, output and gradients, by the same bound as the attention."""
    g = torch.Generator().manual_seed(17)
    s, channels = sum(DOCS), 24
    full = [
        torch.randn(1, s, channels, generator=g, dtype=torch.float64),
        torch.randn(channels, 4, generator=g, dtype=torch.float64),
        torch.randn(channels, generator=g, dtype=torch.float64),
    ]
    weight = torch.randn(1, s, channels, generator=g)
    truth = _with_grads(_conv_reference, full, weight)
    ref_lp = _with_grads(_conv_reference, [t.to(dev, low) for t in full], weight)
    length = s // world
    mine = slice(rank * length, (rank + 1) * length)
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(DOCS)])[None]
    ctx, _ = cpshard.ContextParallelSharder(pg, "contiguous").shard(
        {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    x = full[0][:, mine].to(dev, low).requires_grad_()
    w, b = (t.to(dev, low).requires_grad_() for t in full[1:])
    with ctx():
        y = cp_causal_conv1d(x, w, b, active_state(), "silu")
        grads = torch.autograd.grad((y.float() * weight[:, mine].to(dev)).sum(), [x, w, b])
    got = [y.detach().double().cpu(), *(t.double().cpu() for t in grads)]
    for shared in got[2:]:  # the filters are every rank's: their gradient sums over ranks
        dist.all_reduce(shared, group=pg)
    ok, rows = True, []
    for name, a, t, r in zip(("out", "dx", "dw", "db"), got, truth, ref_lp, strict=True):
        if name in ("out", "dx"):
            t, r = t[:, mine], r[:, mine]
        err, ref_err = (a - t).abs().max().item(), (r - t).abs().max().item()
        bound = FACTOR * ref_err + 1e-6 * t.abs().max().item()
        ok &= err <= bound
        rows.append(
            {"what": name, "err": err, "ref_err": ref_err, "bound": bound, "ok": err <= bound}
        )
    return ok, rows


CASES = [
    ("needed_rows", {}, 8, 2),
    ("heads", {}, 8, 8),
    ("needed_rows", {"window": 24}, 8, 2),
    ("needed_rows", {"sinks": True}, 8, 2),
    ("needed_rows", {"softcap": 3.0}, 8, 2),
    ("needed_rows", {"window": 24, "softcap": 3.0, "sinks": True}, 8, 2),
]


def _correctness_rank(rank: int, world: int, device: str) -> dict:
    """This rank's cases, each against the float64 truth within the low-precision bound, and
    the plain case's steady-state step under the sync check."""
    low = torch.bfloat16 if device == "cuda" else torch.float32
    record: dict = {"dtype": str(low).split(".")[-1], "cases": []}
    ok = True
    pg = dist.group.WORLD
    length = sum(DOCS) // world
    mine = slice(rank * length, (rank + 1) * length)
    cases = list(CASES)
    if world == 4:
        cases.append(("hierarchical", {}, 8, 8))
    for strategy, variant, heads, kv_heads in cases:
        full, weight = _case_inputs(heads, kv_heads, variant.get("sinks", False))

        def ref(*t: torch.Tensor, variant: dict = variant) -> torch.Tensor:
            return _reference(*t[:3], variant, t[3] if len(t) > 3 else None)

        truth = _with_grads(ref, full, weight)
        lp = [t.to(device, low) for t in full[:3]] + [t.to(device, torch.float32) for t in full[3:]]
        ref_lp = _with_grads(ref, lp, weight)
        group: object = pg
        if strategy == "hierarchical":
            group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("inter", "intra"))
        got = _cp_step(group, rank, world, lp, weight, variant, strategy, device)
        good, rows = _compare(got, truth, ref_lp, mine)
        ok &= good
        record["cases"].append(
            {
                "strategy": strategy,
                "variant": variant,
                "heads": [heads, kv_heads],
                "ok": good,
                "errors": rows,
            }
        )
    good, rows = _conv_case(pg, rank, world, device, low)
    ok &= good
    record["cases"].append(
        {"strategy": "mixer", "variant": {"causal_conv1d": 4}, "ok": good, "errors": rows}
    )
    record["sync_free"] = _sync_free(rank, world, device, low)
    record["ok"] = ok and record["sync_free"].get("ok", True)
    return record


def _sync_free(rank: int, world: int, device: str, low: torch.dtype) -> dict:
    """The plain case's warmed step (forward and backward) under the sync check. On CPU the same
    step runs as a plain call: there is no device->host sync to catch, so nothing is checked."""
    full, weight = _case_inputs(8, 2, False)
    lp = [t.to(device, low) for t in full[:3]]
    try:
        _cp_step(dist.group.WORLD, rank, world, lp, weight, {}, "needed_rows", device, checked=True)
    except Exception:  # noqa: BLE001  (a sync raised, or the step failed: recorded)
        return {"checked": device == "cuda", "ok": False, "error": traceback.format_exc()}
    if device != "cuda":
        return {"checked": False, "why": "no GPU: the step ran without torch's sync check"}
    return {"checked": True, "ok": True, "mode": 'torch.cuda.set_sync_debug_mode("error")'}


def _compile_rank(rank: int, world: int, device: str) -> dict:
    """``torch.compile`` of the layer against eager, forward and backward, on the plain case."""
    low = torch.bfloat16 if device == "cuda" else torch.float32
    full, weight = _case_inputs(8, 2, False)
    lp = [t.to(device, low) for t in full[:3]]
    pg = dist.group.WORLD
    eager = _cp_step(pg, rank, world, lp, weight, {}, "needed_rows", device)
    start = time.monotonic()
    compiled = _cp_step(pg, rank, world, lp, weight, {}, "needed_rows", device, compiled=True)
    seconds = time.monotonic() - start
    tol = 2e-2 if low == torch.bfloat16 else 1e-5
    diffs = [(a - b).abs().max().item() for a, b in zip(eager, compiled, strict=True)]
    same = all(
        torch.allclose(a, b, atol=tol, rtol=tol) for a, b in zip(eager, compiled, strict=True)
    )
    return {
        "ok": same,
        "backend": _backend(device),
        "max_abs_diff": dict(zip(("out", "dq", "dk", "dv"), diffs, strict=True)),
        "tolerance": tol,
        "compile_and_two_steps_s": round(seconds, 2),
    }


def _graph(device: str) -> dict:
    """A warmed CP layer at world size 1 captured into a CUDA graph (forward) and replayed on new
    inputs copied into its static ones, against eager calls on those inputs. On CPU the same
    calls run without a graph (the logic the capture runs; nothing captured)."""
    low = torch.bfloat16 if device == "cuda" else torch.float32
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(DOCS)])[None]
    sharder = cpshard.ContextParallelSharder(None, "contiguous")
    ctx, local = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    position_ids = local["position_ids"].to(device)
    g = torch.Generator().manual_seed(5)
    shape = (1, 8, sum(DOCS), HEAD_DIM)
    static = [torch.randn(shape, generator=g).to(device, low) for _ in range(3)]

    def layer() -> torch.Tensor:
        return cpshard.cp_attention(*static, is_causal=True, position_ids=position_ids)

    with ctx():
        layer()  # warm-up: metadata placed, kernels chosen
        if device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                layer()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = layer()
            replay = graph.replay
        else:
            captured = layer()
            replay = lambda: captured.copy_(layer())  # noqa: E731
        errors = []
        for seed in (6, 7):
            g.manual_seed(seed)
            for t in static:
                t.copy_(torch.randn(shape, generator=g).to(device, low))
            replay()
            eager = layer()
            errors.append((captured.double() - eager.double()).abs().max().item())
    record = {"ok": max(errors) == 0.0, "replay_max_abs_diff": errors, "captured": device == "cuda"}
    if device != "cuda":
        record["why"] = "no GPU: the replay ran as plain calls, no graph was captured"
    return record


def _run_rank(
    rank: int, world: int, device: str, store_path: str, out_dir: str, stage: str, options: dict
) -> None:
    """One spawned rank of ``stage``: a gloo group, the stage's body, its record written to
    ``OUT/<stage>_w<W>_rank<r>.json`` (a failure recorded with its traceback)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    record: dict = {"world": world, "device": device}
    try:
        record.update(RANK_STAGES[stage](rank, world, device, **options))
    except Exception:  # noqa: BLE001  (recorded: the stage fails with the traceback)
        record.update(ok=False, error=traceback.format_exc())
    finally:
        Path(out_dir, f"{stage}_w{world}_rank{rank}.json").write_text(
            json.dumps(record, indent=1, default=str)
        )
        dist.destroy_process_group()


def _spawn(stage: str, device: str, out: Path, world: int, **options: object) -> list[dict]:
    """Run ``stage``'s body on ``world`` spawned ranks sharing the device; their records."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _run_rank, args=(world, device, os.path.join(tmp, "store"), str(out), stage, options),
            nprocs=world, start_method="spawn",
        )  # fmt: skip
    return [
        json.loads((out / f"{stage}_w{world}_rank{r}.json").read_text()) for r in range(world)
    ]


def multi_rank(stage: str, device: str, out: Path, worlds: list[int]) -> dict:
    """``stage``'s body at each world size; ok when every rank of every world is."""
    record: dict = {"worlds": {}}
    for world in worlds:
        ranks = _spawn(stage, device, out, world)
        record["worlds"][world] = {"ok": all(r["ok"] for r in ranks), "ranks": ranks}
    record["ok"] = all(w["ok"] for w in record["worlds"].values())
    return record


# ---------------------------------------------------------------- bench


def _layer_step_rank(rank: int, world: int, device: str, repeats: int) -> dict:
    """Median milliseconds of this rank's CP layer step (set-up, forward, backward)."""
    low = torch.bfloat16 if device == "cuda" else torch.float32
    full, weight = _case_inputs(8, 2, False)
    lp = [t.to(device, low) for t in full[:3]]
    step = lambda: _cp_step(  # noqa: E731
        dist.group.WORLD, rank, world, lp, weight, {}, "needed_rows", device, warm=False
    )
    return {"ok": True, "ms": timing.median_ms(step, device, repeats)}


# the bodies of the stages that run on spawned ranks (_run_rank looks them up by name)
RANK_STAGES: dict[str, Callable[..., dict]] = {
    "correctness": _correctness_rank,
    "compile": _compile_rank,
    "bench": _layer_step_rank,
}


def bench(device: str, out: Path, repeats: int) -> dict:
    """One CP layer step (set-up, forward, backward) at W = 2 sharing the device, and the varlen
    attention against a per-document SDPA loop at world size 1."""
    ranks = _spawn("bench", device, out, 2, repeats=repeats)
    low = torch.bfloat16 if device == "cuda" else torch.float32
    docs = [512] * 8 if device == "cuda" else DOCS
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(docs)])[None]
    ctx, local = cpshard.ContextParallelSharder(None, "contiguous").shard(
        {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    )
    position_ids = local["position_ids"].to(device)
    q, k, v = (torch.randn(1, 16, doc.shape[1], 64, device=device, dtype=low) for _ in range(3))

    def per_document() -> None:
        at = 0
        for n in docs:
            sl = slice(at, at + n)
            F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True)
            at += n

    with ctx():
        varlen_ms = timing.median_ms(
            lambda: cpshard.cp_attention(q, k, v, is_causal=True, position_ids=position_ids),
            device,
            repeats,
        )
    sdpa_ms = timing.median_ms(per_document, device, repeats)
    return {
        "ok": all(r["ok"] for r in ranks),
        "dry_run": device != "cuda",
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "layer_step_w2_ms": max(r["ms"] for r in ranks if "ms" in r) if ranks else None,
        "layer_step_errors": [r["error"] for r in ranks if "error" in r],
        "varlen_attention_ms": varlen_ms,
        "per_document_sdpa_ms": sdpa_ms,
        "documents": docs,
        "repeats": repeats,
        "attention_kernels": varlen_kernels.bench(device, repeats, docs),
    }


def main(argv: list[str] | None = None) -> int:
    p = stage_args.parser(__doc__)
    p.add_argument("stage", choices=["correctness", "compile", "graph", "bench"])
    p.add_argument(
        "--worlds", type=int, nargs="+", help="ranks (correctness: 2 4 by default, compile: 2)"
    )
    p.add_argument("--repeats", type=int, default=10)
    args = stage_args.parse(p, argv)
    if args is None:
        return 1
    start = time.monotonic()
    if args.stage == "correctness":
        record = multi_rank("correctness", args.device, args.out, args.worlds or [2, 4])
    elif args.stage == "compile":
        record = multi_rank("compile", args.device, args.out, args.worlds or [2])
    elif args.stage == "graph":
        record = _graph(args.device)
    else:
        record = bench(args.device, args.out, args.repeats)
    record["seconds"] = round(time.monotonic() - start, 2)
    _write(args.out, args.stage, record)
    print(json.dumps({k: v for k, v in record.items() if k not in ("worlds",)}, default=str)[:2000])
    verdict = "ok" if record["ok"] else "FAILED"
    print(f"{args.stage} {verdict} on {args.device} in {record['seconds']} s ({args.stage}.json)")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
