"""Numeric checks of ``cpshard.cp_attention`` on a GPU at world size 1, forward and backward.

* fp16 / bf16 on both paths (the one-launch varlen kernel and the per-part loop) against an
  fp32 reference: the error of cpshard's result must stay within a small multiple of the
  reference's own low-precision error (the same per-document attention run in fp16 / bf16 by
  ``F.scaled_dot_product_attention``), so the bound tracks what the dtype allows;
* GQA with single-token query runs (every document one token: FlashAttention's
  ``seqlenq_ngroups_swapped`` reshape of its log-sum-exp) on both paths against a float64
  reference, the same way;
* the variants, fp16 / bf16 against fp32 with the same bound (the sinks' gradient checked too):
  a sliding window and sinks (alone and together, GQA) on both paths; logit soft-capping alone
  and with a window and sinks on both paths (no flash kernel takes a soft-cap: the varlen path
  runs the explicit varlen kernel in chunks, and the check asserts which path ran). The
  reference is SDPA where it has the option (a window: a band mask), else the explicit
  statement in the dtype under test (soft-cap, sinks; the sinks themselves fp32).

Prints one ``ok`` / ``FAIL`` line per check with the errors and bounds; exits non-zero on a
failure, 0 with ``skipped: <why>`` when there is no GPU. ``--device cpu`` runs the same checks
on the CPU loop path in fp32 (no varlen kernel there), to exercise the script itself.

    python scripts/gpu/numerics.py [--device cuda|cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[2]))
import cpshard  # noqa: E402
from cpshard.attention import engine  # noqa: E402

FACTOR = 3.0  # cpshard may err by this multiple of the reference's own low-precision error


@dataclass(frozen=True)
class Variant:
    """cp_attention's options under check: a sliding ``window``, a logit ``softcap`` and
    whether the call has ``sinks`` (one learned logit per query head)."""

    window: int | None = None
    softcap: float | None = None
    sinks: bool = False

    def __str__(self) -> str:
        named = [f"window {self.window}"] if self.window is not None else []
        named += [f"softcap {self.softcap:g}"] if self.softcap is not None else []
        return " ".join(named + ["sinks"] * self.sinks)


PLAIN = Variant()


@contextmanager
def path(name: str, seen: list[str]) -> Iterator[None]:
    """Route cp_attention to the varlen kernel (``varlen``: as chosen by cpshard) or the loop
    (``loop``: no varlen kernel); record which implementation each call used."""
    saved_kernel, saved_impl = engine.varlen_kernel, engine.implementation
    saved_math, saved_capped = engine.math_varlen, engine.capped_varlen_kernel
    if name == "loop":
        engine.varlen_kernel = lambda q, d_k, d_v: None
        engine.capped_varlen_kernel = lambda q, d, softcap: None
        engine.math_varlen = lambda part: None

    def recording(*args, **kwargs):
        impl = saved_impl(*args, **kwargs)
        seen.append(type(impl).__name__.lower())
        return impl

    engine.implementation = recording
    try:
        yield
    finally:
        engine.varlen_kernel, engine.implementation = saved_kernel, saved_impl
        engine.math_varlen, engine.capped_varlen_kernel = saved_math, saved_capped


def explicit(q, k, v, visible: torch.Tensor, softcap: float | None, sinks) -> torch.Tensor:
    """Matmul-softmax in q's dtype: soft-capped logits, a sink column dropped after the softmax."""
    logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.to(logits.dtype).view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, column], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return (probs[..., : k.shape[2]] if sinks is not None else probs) @ v


def reference(q, k, v, lengths: list[int], variant: Variant = PLAIN, sinks=None) -> torch.Tensor:
    """Per-document causal attention in q's dtype: F.scaled_dot_product_attention (a window as
    a band mask), or :func:`explicit` with a soft-cap or sinks (SDPA has neither)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    outs, at = [], 0
    for n in lengths:
        sl = slice(at, at + n)
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        visible = (j <= i) & (j > i - (variant.window or n))
        qs, ks, vs = q[:, :, sl], k[:, :, sl], v[:, :, sl]
        if variant.softcap is not None or sinks is not None:
            outs.append(explicit(qs, ks, vs, visible, variant.softcap, sinks))
        elif variant.window is not None:
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible))
        else:  # SDPA's own causal mask: its flash kernel on a GPU
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
        at += n
    return torch.cat(outs, dim=2)


def with_grads(
    fn: Callable, leaves: list[torch.Tensor], weight: torch.Tensor
) -> list[torch.Tensor]:
    """fn(*leaves) and the gradients of (fn * weight).sum() w.r.t. the leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
    return [out.detach().double(), *(g.double() for g in grads)]


def cp_with_grads(
    leaves: list[torch.Tensor], lengths: list[int], weight: torch.Tensor, variant: Variant
) -> list[torch.Tensor]:
    """cp_attention at world size 1 inside a sharder context over the documents ``lengths``,
    and its gradients w.r.t. ``leaves`` (q, k, v and, with sinks, the sinks; the backward runs
    while the step's context is alive)."""
    doc = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]
    sharder = cpshard.ContextParallelSharder(None, "contiguous")
    ctx, local = sharder.shard({"input_ids": doc.clone(), "_packed_seq_ids": doc})
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    q, k, v = leaves[:3]
    with ctx():
        out = cpshard.cp_attention(
            q,
            k,
            v,
            is_causal=True,
            enable_gqa=q.shape[1] != k.shape[1],
            window=variant.window,
            softcap=variant.softcap,
            sinks=leaves[3] if variant.sinks else None,
            position_ids=local["position_ids"].to(q.device),
        )
        grads = torch.autograd.grad((out.float() * weight).sum(), leaves)
    return [out.detach().double(), *(g.double() for g in grads)]


def check(
    name: str,
    lengths: list[int],
    heads: int,
    kv_heads: int,
    dtype,
    truth_dtype,
    device,
    impl: str,
    variant: Variant = PLAIN,
) -> dict:
    """One case: cpshard's output and gradients against ``truth_dtype``, within ``FACTOR`` x the
    plain ``dtype`` reference's own error; prints its line and returns its record."""
    g = torch.Generator(device="cpu").manual_seed(len(lengths) * 131 + heads)
    s, d = sum(lengths), 64
    full = [
        torch.randn(1, h, s, d, generator=g, dtype=torch.float64)
        for h in (heads, kv_heads, kv_heads)
    ]
    weight = torch.randn(1, heads, s, d, generator=g).to(device)
    if variant.sinks:  # around the logits' scale: each sink takes a real share of the softmax
        full.append(torch.randn(heads, generator=g, dtype=torch.float64) + 1.0)
    names = ("out", "dq", "dk", "dv", "dsinks")[: 1 + len(full)]

    def ref(*t: torch.Tensor) -> torch.Tensor:
        return reference(*t[:3], lengths, variant, t[3] if variant.sinks else None)

    # The sinks stay fp32 (a master weight), so their gradient is not rounded to the dtype at
    # the end: over a few heads that rounding alone would decide both errors.
    lp = [t.to(device, dtype) for t in full[:3]] + [t.to(device, torch.float32) for t in full[3:]]
    truth = with_grads(ref, [t.to(device, truth_dtype) for t in full], weight)
    ref_lp = with_grads(ref, lp, weight)
    seen: list[str] = []
    with path(impl, seen):
        got = cp_with_grads(lp, lengths, weight, variant)
    ok = True
    parts, errors = [], []
    for what, a, b, c in zip(names, got, ref_lp, truth, strict=True):
        err = (a - c).abs().max().item()
        ref_err = (b - c).abs().max().item()
        bound = FACTOR * ref_err + 1e-6 * c.abs().max().item()
        ok &= bool(err <= bound) and bool(torch.isfinite(a).all())
        parts.append(f"{what} err {err:.2e} <= {bound:.2e}")
        errors.append({"what": what, "err": err, "ref_err": ref_err, "bound": bound})
    used = sorted(set(seen))
    want = impl  # a soft-cap on the varlen path: the explicit varlen kernel
    if device.type == "cuda" and used != [want]:
        ok = False
        parts.append(f"ran {used}, expected {want}")
    title = f"{name}{f' {variant}' if variant != PLAIN else ''} {impl} {str(dtype).split('.')[-1]}"
    print(("ok  " if ok else "FAIL"), f"{title}:", "; ".join(parts), flush=True)
    return {"case": title, "ok": ok, "ran": used, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--json", type=Path, help="also write every case's errors here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no GPU")
        if args.json:
            args.json.write_text(json.dumps({"skipped": "no GPU"}))
        return 0
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dtypes, impls = [torch.bfloat16, torch.float16], ["varlen", "loop"]
    else:
        dtypes, impls = [torch.float32], ["loop"]
    cases = []
    for impl in impls:
        for dtype in dtypes:
            truth = torch.float32 if dtype != torch.float32 else torch.float64
            cases.append(
                check(
                    "docs[37,100,1,250,12] H8/2", [37, 100, 1, 250, 12], 8, 2, dtype, truth,
                    device, impl,
                )  # fmt: skip
            )
            cases.append(check("docs[64,64] H4/4", [64, 64], 4, 4, dtype, truth, device, impl))
        # GQA, every query run one token, against float64
        cases.append(
            check(
                "gqa single-token x48 H8/2", [1] * 48, 8, 2, dtypes[0], torch.float64, device,
                impl,
            )  # fmt: skip
        )
        cases.append(
            check(
                "gqa single-token x16 H12/4", [1] * 16, 12, 4, dtypes[-1], torch.float64, device,
                impl,
            )  # fmt: skip
        )
        # The variants. Sinks over 32 query heads: their gradient has one value per head, and
        # the reference's error over a few values is too noisy a yardstick.
        for dtype in dtypes:
            truth = torch.float32 if dtype != torch.float32 else torch.float64
            variants = [Variant(window=16), Variant(sinks=True), Variant(window=16, sinks=True)]
            variants += [Variant(softcap=3.0), Variant(window=16, softcap=3.0, sinks=True)]
            for variant in variants:
                heads, kv_heads = (32, 8) if variant.sinks else (8, 2)
                cases.append(
                    check(
                        f"docs[37,100,1,250,12] H{heads}/{kv_heads}", [37, 100, 1, 250, 12],
                        heads, kv_heads, dtype, truth, device, impl, variant,
                    )  # fmt: skip
                )
    ok = all(c["ok"] for c in cases)
    if args.json:
        record = {"ok": ok, "device": str(device), "factor": FACTOR, "cases": cases}
        args.json.write_text(json.dumps(record, indent=1))
    print("all numeric checks passed" if ok else "numeric checks FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
