"""What several test modules share: independent references, case tables and instruments.

Imported by the test files as ``tests.helpers`` (``tests`` and its folders are packages, so the
repository root, or the scratch copy CI runs from, is on ``sys.path``); no test file imports
another. Worker-side functions here pickle by reference, like those of the test modules.

* paths: :data:`REPO`, :data:`EXAMPLES`;
* results of a rank pool: :func:`assert_no_mismatches`;
* attention: :func:`packed_doc_ids` (named packing patterns), :func:`dense_attention` (the dense
  per-document attention reference), :class:`StandInVarlen` and :func:`kernel_path` (routing
  cp_blockdiag_sdpa's kernels on CPU), :func:`masked_attention` (attention over any mask with
  soft-capping and sinks, head by head), :func:`compare_compiled`, :func:`recording_host_reads` and
  :func:`record_host_reads` (the hot path's host reads of tensor data), :func:`cp_mesh` (a 2-D CP
  mesh) and :func:`recording_routes` (the head-parallel plans a step's attention calls take);
* transport: :data:`GATHER_ERROR_CASES` and :func:`call_gather_case` (one rank's bad input to a
  gather, and the words its error must contain), :func:`counting_collectives` (the
  torch.distributed calls made inside a block);
* parity: :func:`cp_aware_decoder` / :func:`plain_sdpa_decoder` /
  :func:`shard_positions_decoder` (a user's own decoder, the last with positions made from the
  shard's length) and the broken losses :func:`labels_shifted_per_shard`, :func:`per_rank_mean_loss`,
  :func:`loss_without_cp_factor`, loaded by ``cpshard parity`` as ``tests.helpers:NAME``;
* documents: :func:`document_spans` (every document's row and bounds),
  :func:`per_document_positions` (positions restarting at each document);
* sequence mixers, each document alone: :func:`causal_conv_reference`,
  :func:`delta_rule_reference`, :func:`ssd_reference`, :func:`selective_scan_reference`,
  :func:`lightning_reference` (the model-family tests' step and checks are
  ``tests/integrations/harness.py``'s); :func:`swapped` (a module attribute replaced for a
  block).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from cpshard import check_mode, gather_halo, gather_metadata, gather_ragged, gather_sequence
from cpshard.attention import active_state
from cpshard.attention.engine import part_kernel as _PART_KERNEL
from cpshard.attention.engine import math_varlen as _MATH_VARLEN
from cpshard.attention.engine import varlen_kernel as _VARLEN_KERNEL

F64 = torch.float64

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def assert_no_mismatches(results: list[list[str]], first: int = 40) -> None:
    """A rank pool's results, one list of mismatches per rank, are all empty."""
    problems = [f"rank {r}: {p}" for r, res in enumerate(results) for p in res]
    assert not problems, f"{len(problems)} mismatches, first ones:\n" + "\n".join(problems[:first])


# --------------------------------------------------------------------------- attention

D = 8  # head dim of the attention cases

def packed_doc_ids(name: str, b: int, s: int) -> torch.Tensor:
    """Document ids [b, s] for a named packing pattern."""
    doc = torch.zeros(b, s, dtype=torch.long)
    for row in range(b):
        if name == "short_docs":
            doc[row] = torch.arange(s) // 3 + 1
        elif name == "one_doc":
            doc[row] = 1
        elif name == "interior_pad":
            doc[row, : s // 3] = 1
            doc[row, s // 3 + 2 : s - 1] = 2
        elif name == "leading_pad":
            doc[row, 5:] = 7
        elif name == "pad_rank":  # a whole middle stretch of padding (a full rank at W <= 4)
            doc[row, : s // 5] = 1
            doc[row, s - s // 5 :] = 2
        elif name == "reused_ids":
            doc[row] = torch.tensor([1, 1, 2, 2, 2, 1, 1, 0, 1, 1, 3, 3] * s)[:s]
        elif name == "random":
            g = torch.Generator().manual_seed(17 * row + s)
            i = 0
            while i < s:
                n = int(torch.randint(1, max(2, s // 2), (1,), generator=g))
                doc[row, i : i + n] = int(torch.randint(0, 3, (1,), generator=g))
                i += n
        else:
            raise AssertionError(name)
    return doc


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor, causal: bool = True
) -> torch.Tensor:
    """Dense block-diagonal causal (or bidirectional) attention on the full sequence (pads
    output zeros)."""
    s = q.shape[2]
    new_run = torch.ones_like(doc, dtype=torch.bool)
    new_run[:, 1:] = doc[:, 1:] != doc[:, :-1]
    run = torch.cumsum(new_run.long(), dim=1)
    pos = torch.arange(s)
    mask = (
        (run[:, :, None] == run[:, None, :])
        & (doc[:, :, None] != 0)
        & ((pos[:, None] >= pos[None, :]) | (not causal))
    )
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return probs @ v


def random_qkvw(
    b: int, s: int, heads: int, kv_heads: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """Float64 q, k, v ``[b, heads (kv_heads), s, D]`` and an upstream weight shaped like q."""
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, h, s, D, dtype=torch.float64, generator=g)
        for h in (heads, kv_heads, kv_heads, heads)
    )


def visible_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Attention of the whole rows under ``visible`` ``[B, 1 or H, S, S]`` (a query that sees
    nothing: zeros), GQA by head groups."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return probs.nan_to_num(0.0) @ v


def shard_heads(sharder, t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` ``[B, H, S, D]`` (padded with zeros)."""
    return sharder.shard_token_tensor(t.transpose(1, 2), seq_dim=1, fill=0.0).transpose(1, 2)


def each_case(layouts: list[str], cases: list, names: list[str], full) -> Iterator[tuple]:
    """``(layout, case, name, doc, (q, k, v), w)`` for every layout, case and mask name, in
    that order: ``full(case)`` gives ``(doc, q, k, v, w)``; q, k, v are fresh leaves."""
    for layout in layouts:
        for case in cases:
            doc, *qkv, w = full(case)
            for name in names:
                leaves = tuple(t.detach().clone().requires_grad_() for t in qkv)
                yield layout, case, name, doc, leaves, w


def cp_case_result(
    sharder, out: torch.Tensor, w: torch.Tensor, leaves: tuple[torch.Tensor, ...], problems: list
) -> tuple:
    """A rank's result of one case (what :func:`check_cp_results` takes): back-propagates its
    share ``out * w`` (``w`` the full upstream weight), then the gathered output, the full
    ``leaves``' (q, k, v) gradients and ``problems``."""
    (out * shard_heads(sharder, w)).sum().backward()
    gathered = sharder.gather_token_tensor(out.detach().transpose(1, 2), 1, trim=True)
    return (gathered.transpose(1, 2), *(t.grad for t in leaves), problems)


def check_cp_results(
    got: list[list[tuple]], expected: list[tuple], grad_names: tuple[str, ...] = ("q", "k", "v")
) -> None:
    """``got[r][i]``: rank r's ``(gathered output, *grads of the full leaves, problems)`` of
    case i (:func:`cp_case_result`); ``expected[i]``: its ``(label, output, grads)`` on the
    whole rows, the leaves named ``grad_names``. Every rank's output and no problems; the
    ranks' gradients summed."""
    for at, (label, want, grads) in enumerate(expected):
        for r, results in enumerate(got):
            torch.testing.assert_close(
                results[at][0], want, rtol=0, atol=1e-12, msg=f"{label} output, rank {r}"
            )
            assert not results[at][-1], (label, results[at][-1])
        for j, grad_name in enumerate(grad_names):
            total = sum(results[at][1 + j] for results in got)
            torch.testing.assert_close(
                total, grads[j], rtol=0, atol=1e-10, msg=f"{label} grad {grad_name}"
            )


def assert_refused_on_every_rank(outcomes: list, message: str) -> None:
    """Every rank's outcome (``RankPool.run_collect``) a ``ValueError`` with ``message``,
    naming the rank."""
    assert all(not o.ok and o.error_type == "ValueError" for o in outcomes), outcomes
    assert all(message in o.error_message for o in outcomes), outcomes
    assert all(f"rank {o.rank}" in o.error_message for o in outcomes), outcomes


def variant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    doc: torch.Tensor,
    causal: bool = True,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Dense per-document attention on the full sequence with the variants: a sliding
    ``window`` (keys a query sees, itself included), soft-capped logits, a sink logit per query
    head (a softmax column with no value), v's head dim free; pads output zeros."""
    s = q.shape[2]
    new_run = torch.ones_like(doc, dtype=torch.bool)
    new_run[:, 1:] = doc[:, 1:] != doc[:, :-1]
    run = torch.cumsum(new_run.long(), dim=1)
    pos = torch.arange(s)
    mask = (run[:, :, None] == run[:, None, :]) & (doc[:, :, None] != 0)
    if causal:
        mask &= pos[:, None] >= pos[None, :]
    if window is not None:
        mask &= pos[:, None] - pos[None, :] < window
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    logits = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    if sinks is not None:
        column = sinks.view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return (probs @ v) * (doc != 0)[:, None, :, None]


def assert_variant_results(
    got: list[list[tuple]],
    layouts: list[str],
    world: int,
    cases: list[tuple],
    make_case: Callable[[tuple], tuple[torch.Tensor, ...]],
    label: str = "",
    on_rank: Callable[[str, str, tuple, tuple], None] | None = None,
) -> None:
    """Each rank's CP attention results ``got`` (per layout, then per case of ``cases``: the
    gathered output and that rank's gradients of q, k, v and the sinks) against
    :func:`variant_attention` on the whole batch ``make_case(case)`` gives (doc ids, q, k, v,
    the output's weight, sinks; a case ends with its window, soft-cap and whether it has sinks):
    every rank's output, and the gradients summed over ranks. ``on_rank(where, layout, case,
    result)`` checks anything more of each rank's result."""
    at = 0
    for layout in layouts:
        for case in cases:
            *_, window, softcap, with_sinks = case
            doc, q, k, v, w, sinks = make_case(case)
            leaves = [t.requires_grad_() for t in (q, k, v, sinks)]
            want = variant_attention(
                *leaves[:3], doc, True, window, softcap, leaves[3] if with_sinks else None
            )
            grads = torch.autograd.grad((want * w).sum(), leaves, allow_unused=True)
            where = " ".join(part for part in (layout, label, f"W={world}", case[0]) if part)
            for r in range(world):
                torch.testing.assert_close(
                    got[r][at][0], want, rtol=0, atol=1e-12, msg=f"{where} output on rank {r}"
                )
                if on_rank is not None:
                    on_rank(f"{where} rank {r}", layout, case, got[r][at])
            for j, name in enumerate(["q", "k", "v", "sinks"][: 3 + with_sinks]):
                total = sum(got[r][at][1 + j] for r in range(world))
                torch.testing.assert_close(
                    total, grads[j], rtol=0, atol=1e-10, msg=f"{where} grad {name}"
                )
            at += 1


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over an arbitrary ``visible`` mask (``[B, Lq, Lk]`` bool, or ``[B, 1, Lq, Lk]``),
    one head at a time, as the weighted sum it is: logits ``scale * q.k`` (soft-capped:
    ``softcap * tanh(logit / softcap)``), weights ``exp(logit - m)`` on the visible keys, and the
    head's sink adding ``exp(sink - m)`` to the denominator only. ``m`` (the largest logit, the
    sink included) is a constant shift: detached. GQA by head groups; v's head dim free."""
    visible = visible.reshape(visible.shape[0], *visible.shape[-2:])
    rep = q.shape[1] // k.shape[1]
    rows = []
    for b in range(q.shape[0]):
        heads = []
        for h in range(q.shape[1]):
            logits = scale * (q[b, h] @ k[b, h // rep].T)
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            logits = torch.where(visible[b], logits, float("-inf"))
            shift = logits.max(-1, keepdim=True).values
            if sinks is not None:
                shift = torch.maximum(shift, sinks[h])
            shift = shift.detach()
            weights = torch.exp(logits - shift)
            denominator = weights.sum(-1, keepdim=True)
            if sinks is not None:
                denominator = denominator + torch.exp(sinks[h] - shift)
            heads.append((weights @ v[b, h // rep]) / denominator)
        rows.append(torch.stack(heads))
    return torch.stack(rows)


class StandInVarlen:
    """torch's varlen flash contract (``aten._flash_attention_forward`` / ``_backward``) in plain
    PyTorch: packed ``[tokens, heads, D]`` sequences delimited by int32 cumulative lengths, GQA
    by head groups, the causal mask aligned bottom-right (a query sees every key of a longer
    prefix; with the packing's window, only its last ``window`` keys) or none, ``lse``
    ``[heads, tokens]``; the backward is the vector-Jacobian product of the
    same statement (``torch.func``: autograd is off inside a custom op). It
    records every packing it is handed."""

    name = "stand_in_varlen"

    def __init__(self) -> None:
        self.packings: list = []
        self.calls = {"forward": 0, "backward": 0}

    def _attend(self, q, k, v, p, scale):
        cu_q, cu_k = p.cu_q, p.cu_k
        assert (
            cu_q.dtype == cu_k.dtype == torch.int32
            and isinstance(p.max_q, int)
            and isinstance(p.max_k, int)
        )
        assert p.max_q == int((cu_q[1:] - cu_q[:-1]).max()) and p.max_k == int(
            (cu_k[1:] - cu_k[:-1]).max()
        )
        assert q.shape[0] == int(cu_q[-1]) and k.shape[0] == v.shape[0] == int(cu_k[-1])
        self.packings.append(p)
        outs, lses = [], []
        for i in range(len(cu_q) - 1):
            qs = q[cu_q[i] : cu_q[i + 1]].transpose(0, 1)
            rep = q.shape[1] // k.shape[1]
            ks = k[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
            vs = v[cu_k[i] : cu_k[i + 1]].transpose(0, 1).repeat_interleave(rep, 0)
            n, m = qs.shape[1], ks.shape[1]
            diagonal = torch.arange(n)[:, None] + (m - n)
            visible = torch.arange(m)[None, :] <= diagonal
            if p.window is not None:
                visible &= torch.arange(m)[None, :] > diagonal - p.window
            visible |= not p.causal
            scores = (
                qs @ ks.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
            ).masked_fill(~visible, float("-inf"))
            outs.append((torch.softmax(scores, dim=-1) @ vs).transpose(0, 1))
            wide = torch.float64 if q.dtype == torch.float64 else torch.float32  # the kernel's lse
            lses.append(torch.logsumexp(scores.to(wide), dim=-1))
        return torch.cat(outs), torch.cat(lses, dim=1)

    def forward(self, q, k, v, p, scale):
        self.calls["forward"] += 1
        return self._attend(q, k, v, p, scale)

    def backward(self, grad, q, k, v, out, lse, p, scale):
        """The kernels' backward reads the output it is given only in ``D = rowsum(grad * out)``
        (``dS = P * (dP - D)``): the vector-Jacobian product with the log-sum-exp cotangent
        ``D(forward's output) - D(out)`` (``d lse / dS = P``) is that statement."""
        self.calls["backward"] += 1
        (again, again_lse), vjp = torch.func.vjp(lambda *t: self._attend(*t, p, scale), q, k, v)
        torch.testing.assert_close(again_lse, lse, rtol=0, atol=0)
        shift = ((grad * again).sum(-1) - (grad * out).sum(-1)).t().to(lse.dtype)
        return vjp((grad, shift))


PATHS = ["per_segment", "varlen", "math"]


@contextmanager
def kernel_path(name: str) -> Iterator[StandInVarlen | None]:
    """Route cp_blockdiag_sdpa's kernels on CPU: the CPU flash loop (``per_segment``), the
    one-launch varlen path of CUDA fp16/bf16 with :class:`StandInVarlen` as its kernel
    (``varlen``), or the loop with the explicit part kernel of CUDA fp32/fp64 (``math``)."""
    from cpshard.attention import engine as attention
    from cpshard.attention.kernels import MathPart

    kernel = StandInVarlen() if name == "varlen" else None
    try:
        if kernel is not None:
            attention.varlen_kernel = lambda q, d_k, d_v: kernel
        if name == "math":
            attention.part_kernel = lambda q, softcap=None: MathPart(softcap)
            attention.math_varlen = lambda part: None  # the loop (the chunked kernel: its own test)
        yield kernel
    finally:
        attention.varlen_kernel, attention.part_kernel = _VARLEN_KERNEL, _PART_KERNEL
        attention.math_varlen = _MATH_VARLEN


def compare_compiled(
    compiled, eager, ctx, qkv: tuple[torch.Tensor, ...], weight: torch.Tensor, name: str
) -> None:
    """Inside ``ctx()``, ``compiled(q, k, v)`` equals ``eager(q, k, v)``, forward and gradients."""
    got = []
    for fn in (compiled, eager):
        leaves = [t.clone().requires_grad_() for t in qkv]
        with ctx():
            out = fn(*leaves)
        got.append((out.detach(), *torch.autograd.grad((out * weight).sum(), leaves)))
    for a, e in zip(*got, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-13, msg=f"{name} compiled vs eager")


HOST_READS = ["item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"]


@contextmanager
def recording_host_reads(
    reads: list[str], allowed: torch.Tensor | tuple[torch.Tensor, ...]
) -> Iterator[None]:
    """Record every host read of tensor data (``.item()``, ``.tolist()``, ``.cpu()``, ``int()``,
    ``bool()``, ...) and every tensor built from host data (``torch.tensor``) made by library
    code (the nearest caller outside torch is cpshard); reads of ``allowed`` (the step's CPU
    key, or keys) and reads by test code (the kernel stand-in above) are not recorded."""
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}
    built = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def spy(name: str, real, check_self: bool):
        def call(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                frame = frame.f_back
            by_library = (
                frame is not None and f"{os.sep}cpshard{os.sep}" in frame.f_code.co_filename
            )
            if by_library and not (check_self and any(args[0] is a for a in allowed)):
                reads.append(f"{name} from {frame.f_code.co_filename}:{frame.f_lineno}")
            return real(*args, **kwargs)

        return call

    try:
        for name, real in saved.items():
            setattr(torch.Tensor, name, spy(name, real, True))
        for name, real in built.items():
            setattr(torch, name, spy(name, real, False))
        yield
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)
        for name, real in built.items():
            setattr(torch, name, real)


def record_host_reads(ctx, attend, qkv: tuple[torch.Tensor, ...], path: str) -> list[str]:
    """The host reads of two layers of ``attend(q, k, v, enable_gqa=True)`` inside ``ctx()`` and
    their backward, through the kernel ``path``; asserts that a varlen kernel is handed the
    packing the step's state built."""
    reads: list[str] = []
    with ctx():
        state = active_state()
    with kernel_path(path) as kernel, recording_host_reads(reads, state.key):
        for _ in range(2):  # two layers
            with ctx():
                out = attend(*qkv, enable_gqa=True)
            out.sum().backward()
    if kernel is not None:
        built = state.packing.packings
        assert kernel.packings and all(any(p is b for b in built) for p in kernel.packings)
    return reads


# --------------------------------------------------------------------------- transport

def _gather_counts(world: int) -> list[int]:
    return [2 + r for r in range(world)]


def call_gather_case(rank: int, world: int, case: str, bad: int, mode: str = "call") -> str:
    """Run gather ``case`` with valid arguments on every rank but ``bad``, in check ``mode``."""
    with check_mode(mode):
        return _gather_case(rank, world, case, bad)


def _gather_case(rank: int, world: int, case: str, bad: int) -> str:
    me = rank == bad
    g = dist.group.WORLD
    counts = _gather_counts(world)
    n = counts[rank]
    x = torch.randn(2, n, 4, dtype=F64)  # ragged along dim 1
    s = torch.randn(2, 3, 4, dtype=F64)  # equal shards along dim 1

    if case.startswith("ragged"):
        dim = 1
        if me:
            if case == "ragged_wrong_count":
                x = torch.randn(2, n + 1, 4, dtype=F64)
            elif case == "ragged_wrong_hidden":
                x = torch.randn(2, n, 5, dtype=F64)
            elif case == "ragged_wrong_dtype":
                x = x.float()
            elif case == "ragged_wrong_ndim":
                x = x.unsqueeze(-1)
            elif case == "ragged_counts_too_long":
                counts = counts + [1]
            elif case == "ragged_counts_too_short":
                counts = counts[:-1]
            elif case == "ragged_counts_differ":
                counts = list(counts)
                counts[(bad + 1) % world] += 1  # its own entry still matches x
            elif case == "ragged_counts_negative":
                counts = list(counts)
                counts[(bad + 1) % world] = -1
            elif case == "ragged_counts_tensor":
                counts = torch.tensor(counts)
            elif case == "ragged_dim_out_of_range":
                dim = 5
            elif case == "ragged_dim_differs":
                # tokens along dim 2 here, along dim 1 elsewhere
                x, dim = x.transpose(1, 2).contiguous(), 2
            elif case == "ragged_not_tensor":
                x = x.tolist()
            else:
                raise AssertionError(case)
        gather_ragged(x, g, counts, dim)
    elif case.startswith("seq") or case.startswith("meta"):
        fn = gather_metadata if case.startswith("meta") else gather_sequence
        seq_dim = 1
        if case.startswith("meta"):
            s = torch.arange(6).view(2, 3) + 3 * rank
        if me:
            if case == "seq_uneven":
                s = torch.randn(2, 4, 4, dtype=F64)
            elif case == "seq_wrong_hidden":
                s = torch.randn(2, 3, 6, dtype=F64)
            elif case == "seq_wrong_dtype":
                s = s.to(torch.bfloat16)
            elif case == "seq_wrong_ndim":
                s = s[..., 0]
            elif case == "seq_dim_out_of_range":
                seq_dim = 3
            elif case == "seq_not_tensor":
                s = None
            elif case == "meta_requires_grad":
                s = s.double().requires_grad_()
            elif case == "meta_wrong_dtype":
                s = s.int()
            else:
                raise AssertionError(case)
        fn(s, g, seq_dim=seq_dim)
    elif case.startswith("halo"):
        halo, left, seq_dim = 4, 1, 1
        if me:
            if case == "halo_negative":
                halo = -1
            elif case == "halo_list_wrong_length":
                halo = [4] * (world + 1)
            elif case == "halo_list_differs":
                halo = [4] * world
                halo[(bad + 1) % world] = 2
            elif case == "halo_not_int":
                halo = 2.5
            elif case == "halo_negative_padding":
                left = -1
            elif case == "halo_wrong_hidden":
                s = torch.randn(2, 3, 5, dtype=F64)
            elif case == "halo_uneven":
                s = torch.randn(2, 2, 4, dtype=F64)
            elif case == "halo_wrong_dtype":
                s = s.float()
            elif case == "halo_dim_out_of_range":
                seq_dim = -4
            elif case == "halo_not_tensor":
                s = s.numpy()
            else:
                raise AssertionError(case)
        gather_halo(s, g, halo, left_padding=left, seq_dim=seq_dim)
    else:
        raise AssertionError(case)
    return "returned normally"


# case -> words the failing rank's message must contain (lower-cased). Field mismatches are
# detected by comparison, so there every rank gets the same message, naming the odd rank.
GATHER_ERROR_CASES = {
    "ragged_wrong_count": ["counts[{bad}]", "x.shape[1]"],
    "ragged_wrong_hidden": ["x.shape", "differs on rank {bad}"],
    "ragged_wrong_dtype": ["dtype", "differs on rank {bad}"],
    "ragged_wrong_ndim": ["x.shape", "differs on rank {bad}"],
    "ragged_counts_too_long": ["counts has {world_plus}", "{world} ranks"],
    "ragged_counts_too_short": ["counts has {world_minus}", "{world} ranks"],
    "ragged_counts_differ": ["counts differs on rank {bad}"],
    "ragged_counts_negative": ["negative"],
    "ragged_counts_tensor": ["counts must be a list"],
    "ragged_dim_out_of_range": ["dim=5", "out of range"],
    "ragged_dim_differs": ["token dim differs on rank {bad}"],
    "ragged_not_tensor": ["x must be a torch.tensor", "list"],
    "seq_uneven": ["x.shape", "differs on rank {bad}"],
    "seq_wrong_hidden": ["x.shape", "differs on rank {bad}"],
    "seq_wrong_dtype": ["dtype", "differs on rank {bad}"],
    "seq_wrong_ndim": ["x.shape", "differs on rank {bad}"],
    "seq_dim_out_of_range": ["seq_dim=3", "out of range"],
    "seq_not_tensor": ["x must be a torch.tensor", "nonetype"],
    "meta_requires_grad": ["requires grad"],
    "meta_wrong_dtype": ["dtype", "differs on rank {bad}"],
    "halo_negative": ["halo_size=-1"],
    "halo_list_wrong_length": ["halo_size has {world_plus}"],
    "halo_list_differs": ["halo_size differs on rank {bad}"],
    "halo_not_int": ["halo_size", "2.5"],
    "halo_negative_padding": ["left_padding", "-1"],
    "halo_wrong_hidden": ["x.shape", "differs on rank {bad}"],
    "halo_uneven": ["x.shape", "differs on rank {bad}"],
    "halo_wrong_dtype": ["dtype", "differs on rank {bad}"],
    "halo_dim_out_of_range": ["seq_dim=-4", "out of range"],
    "halo_not_tensor": ["x must be a torch.tensor", "ndarray"],
}


# Every collective and point-to-point entry of torch.distributed a transport could use
# (isend/irecv stay unwrapped: P2POp checks their identity; they are counted through
# batch_isend_irecv, the only way the transport posts them).
DIST_ENTRIES = (
    "batch_isend_irecv", "all_to_all_single", "all_gather_into_tensor", "all_gather",
    "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single", "all_reduce",
    "broadcast", "broadcast_object_list", "all_gather_object", "send", "recv", "barrier",
    "reduce_scatter", "gather", "scatter", "all_to_all",
)


@contextmanager
def counting_collectives() -> Iterator[Counter]:
    """Count calls of every torch.distributed entry in ``DIST_ENTRIES`` inside the block."""
    seen: Counter = Counter()
    originals = {name: getattr(dist, name) for name in DIST_ENTRIES if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)



# --------------------------------------------------------------------------- parity set-ups
# Models and losses `cpshard parity` loads by "tests.helpers:NAME": a decoder of one's own
# (its attention CP-aware or plain SDPA) and the broken losses users write.


class _Attention(torch.nn.Module):
    def __init__(self, width: int, heads: int, cp_aware: bool) -> None:
        super().__init__()
        self.heads, self.cp_aware = heads, cp_aware
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.out = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        from cpshard import cp_attention

        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        if self.cp_aware:
            y = cp_attention(q, k, v, is_causal=True, position_ids=position_ids)
        else:
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, w))


class _Block(torch.nn.Module):
    def __init__(self, width: int, cp_aware: bool) -> None:
        super().__init__()
        self.attn = _Attention(width, 2, cp_aware)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, position_ids)
        return x + self.mlp(x)


class _ShardPositions(torch.nn.Module):
    """Broken: position embeddings of 0..L-1 over the tokens it is given (this rank's shard
    under CP), not of the model's position ids."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(256, width) * 0.1)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.table[: position_ids.shape[1]].expand(position_ids.shape[0], -1, -1)


class OwnDecoder(torch.nn.Module):
    """A user's decoder: ``forward(input_ids, position_ids) -> logits``."""

    def __init__(
        self, cp_aware: bool, vocab: int = 48, width: int = 16, shard_positions: bool = False
    ) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = _ShardPositions(width) if shard_positions else torch.nn.Embedding(256, width)
        self.blocks = torch.nn.ModuleList(_Block(width, cp_aware) for _ in range(2))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x, position_ids)
        return self.head(x)


def cp_aware_decoder() -> torch.nn.Module:
    return OwnDecoder(cp_aware=True)


def plain_sdpa_decoder() -> torch.nn.Module:
    return OwnDecoder(cp_aware=False)


def shard_positions_decoder() -> torch.nn.Module:
    return OwnDecoder(cp_aware=True, shard_positions=True)


def labels_shifted_per_shard(logits, batch, group):
    """Broken: targets made from this rank's own input_ids (shifted inside the shard)."""
    from cpshard import cp_cross_entropy

    ids = batch["input_ids"]
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels = labels.masked_fill(ids == 0, -100)
    return cp_cross_entropy(logits, labels, group), labels


def per_rank_mean_loss(logits, batch, group):
    """Broken: the token mean of this rank's tokens alone."""
    labels = batch.targets.labels
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    return loss, labels


def loss_without_cp_factor(logits, batch, group):
    """Broken under FSDP2's averaging: the ranks' losses add up to the loss (no CP factor)."""
    from cpshard import cp_cross_entropy

    return cp_cross_entropy(logits, batch.targets.labels, group) / dist.get_world_size(group)


def _documents(row: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each document of a 1-D id row (the examples' definition)."""
    sys.path.insert(0, str(EXAMPLES))
    from cp_decoder import runs

    return runs(row)


def document_spans(doc: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every document of ``doc`` ``[B, S]`` (0 = pad), row by row."""
    return [(b, s, e) for b in range(doc.shape[0]) for s, e in _documents(doc[b])]


def per_document_positions(ids: torch.Tensor) -> torch.Tensor:
    """0, 1, ... in every document (a maximal run of one non-zero id), pads continuing."""
    out = torch.zeros_like(ids)
    for b in range(ids.shape[0]):
        for i in range(1, ids.shape[1]):
            starts = ids[b, i] != 0 and ids[b, i] != ids[b, i - 1]
            out[b, i] = 0 if starts else out[b, i - 1] + 1
    return out


def causal_conv_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, doc: torch.Tensor
) -> torch.Tensor:
    """Each document of ``x`` ``[B, S, C]`` alone through a zero-padded causal depthwise
    ``conv1d`` (``weight`` ``[C, K]``) then SiLU; padding rows are zeros."""
    out = torch.zeros_like(x)
    k = weight.shape[1]
    for b in range(x.shape[0]):
        for s, e in _documents(doc[b]):
            part = x[b, s:e].T[None]  # [1, C, n]
            y = torch.nn.functional.conv1d(
                part, weight[:, None], bias, padding=k - 1, groups=x.shape[2]
            )
            out[b, s:e] = torch.nn.functional.silu(y[0, :, : e - s].T)
    return out


def delta_rule_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    doc: torch.Tensor,
) -> torch.Tensor:
    """The gated delta rule token by token, each document from a zero state: ``q``, ``k``
    ``[B, S, H, d_k]`` (L2-normalised with eps 1e-6, ``q`` scaled by ``d_k^-1/2``), ``v``
    ``[B, S, H, d_v]``, ``g`` (log decay), ``beta`` ``[B, S, H]``; padding rows are zeros."""
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    out = torch.zeros_like(v)
    rows = []
    for b in range(q.shape[0]):
        row = [torch.zeros_like(v[b, 0])] * q.shape[1]
        for s, e in _documents(doc[b]):
            state = v.new_zeros(q.shape[2], q.shape[3], v.shape[3])
            for t in range(s, e):
                state = state * g[b, t].exp()[:, None, None]
                kt = k[b, t]
                err = v[b, t] - torch.einsum("hkv,hk->hv", state, kt)
                state = state + torch.einsum("hk,hv->hkv", kt, err * beta[b, t][:, None])
                row[t] = torch.einsum("hkv,hk->hv", state, q[b, t])
        rows.append(torch.stack(row))
    return torch.stack(rows) + out


def ssd_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    doc: torch.Tensor,
) -> torch.Tensor:
    """Mamba2's state-space recurrence token by token, each document from a zero state: ``x``
    ``[B, S, H, P]``, ``dt`` ``[B, S, H]`` (the step as used), ``A`` ``[H]``, ``B``, ``C``
    ``[B, S, G, N]`` (head ``h`` reads group ``h * G // H``), ``D`` ``[H]`` or None;
    ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T``, ``y_t = S_t C_t + D x_t``; padding rows are
    zeros."""
    heads, groups = x.shape[2], B.shape[2]
    group_of = torch.arange(heads) * groups // heads
    rows = []
    for b in range(x.shape[0]):
        row = [torch.zeros_like(x[b, 0])] * x.shape[1]
        for s, e in _documents(doc[b]):
            state = x.new_zeros(heads, x.shape[3], B.shape[3])
            for t in range(s, e):
                bt, ct = B[b, t, group_of], C[b, t, group_of]  # [H, N]
                state = state * torch.exp(dt[b, t] * A)[:, None, None] + torch.einsum(
                    "h,hp,hn->hpn", dt[b, t], x[b, t], bt
                )
                y = torch.einsum("hpn,hn->hp", state, ct)
                row[t] = y + D[:, None] * x[b, t] if D is not None else y
        rows.append(torch.stack(row))
    return torch.stack(rows)


def selective_scan_reference(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    doc: torch.Tensor,
) -> torch.Tensor:
    """Mamba's selective scan token by token, each document from a zero state: ``x``, ``dt``
    ``[B, S, D]`` (the step as used), ``A`` ``[D, N]``, ``B``, ``C`` ``[B, S, N]``, ``D`` ``[D]``
    or None; ``S_t = exp(dt_t A) * S_{t-1} + (dt_t x_t) B_t^T`` elementwise per channel,
    ``y_t = S_t C_t + D x_t``; padding rows are zeros."""
    rows = []
    for b in range(x.shape[0]):
        row = [torch.zeros_like(x[b, 0])] * x.shape[1]
        for s, e in _documents(doc[b]):
            state = x.new_zeros(A.shape)
            for t in range(s, e):
                state = torch.exp(dt[b, t][:, None] * A) * state + torch.outer(dt[b, t] * x[b, t], B[b, t])
                y = state @ C[b, t]
                row[t] = y + D * x[b, t] if D is not None else y
        rows.append(torch.stack(row))
    return torch.stack(rows)


def lightning_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, doc: torch.Tensor
) -> torch.Tensor:
    """Lightning attention over the full sequence in its quadratic form, no recurrence: ``q``,
    ``k`` ``[B, S, H, D]``, ``v`` ``[B, S, H, Dv]``, ``slope`` ``[H]``;
    ``o_t = sum_s exp(-slope (t - s)) (q_t . k_s) v_s`` over the tokens ``s <= t`` of ``t``'s
    document (one mask over the packed row: same run of one id, causal); padding rows are
    zeros."""
    s = q.shape[1]
    new_run = torch.ones_like(doc, dtype=torch.bool)
    new_run[:, 1:] = doc[:, 1:] != doc[:, :-1]
    run = torch.cumsum(new_run.long(), dim=1)
    pos = torch.arange(s)
    distance = (pos[:, None] - pos[None, :]).to(q.dtype)  # [t, s]
    allowed = (run[:, :, None] == run[:, None, :]) & (distance >= 0) & (doc != 0)[:, :, None]
    decay = torch.exp(-slope[:, None, None] * distance.clamp(min=0))  # [H, t, s]
    weights = torch.einsum("bthd,bshd->bhts", q, k) * decay * allowed[:, None]
    return torch.einsum("bhts,bshe->bthe", weights, v)


def step_context(layout: str, doc: torch.Tensor, group=None) -> tuple:
    """``(context factory, sharder)`` of one CP step over the document ids ``doc``: ``layout``
    a sharder layout, or ``"blockdiag"`` for the block-diagonal batch (with a ``contiguous``
    sharder for the test's own token verbs, which shard alike)."""
    from cpshard import ContextParallelSharder, make_cp_blockdiag_batch_and_ctx

    group = dist.group.WORLD if group is None else group
    batch = {"input_ids": doc.clone(), "_packed_seq_ids": doc}
    if layout == "blockdiag":
        ctx, _ = make_cp_blockdiag_batch_and_ctx(group, None, batch)
        sharder = ContextParallelSharder(group, "contiguous")
        sharder.shard(dict(batch))
        return ctx, sharder
    sharder = ContextParallelSharder(group, layout)
    ctx, _ = sharder.shard(batch)
    return ctx, sharder


_meshes: dict[tuple[int, int], tuple[object, object]] = {}


def cp_mesh(inter: int, intra: int):
    """This worker's 2-D CP DeviceMesh ``(inter, intra)`` over the default group, made once per
    default group (every rank asks for the same shapes in the same order: they make its groups;
    a rank pool that re-creates its default group drops the old mesh's groups with it)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.group.WORLD
    found = _meshes.get((inter, intra))
    if found is None or found[0] is not world:
        mesh = init_device_mesh("cpu", (inter, intra), mesh_dim_names=("inter", "intra"))
        found = _meshes[inter, intra] = (world, mesh)
    return found[1]


@contextmanager
def recording_routes() -> Iterator[list[str]]:
    """The kind (``"heads"`` or ``"hierarchical"``) of every CP attention call inside the block
    that goes through a head-parallel plan, in call order (backward recomputes included)."""
    from cpshard.attention import api

    kinds: list[str] = []
    attend = api.head_parallel_attention

    def recorded(plan, *args, **kwargs):
        kinds.append(plan.kind)
        return attend(plan, *args, **kwargs)

    with swapped("cpshard.attention.api", "head_parallel_attention", recorded):
        yield kinds


@contextmanager
def swapped(module: str, name: str, value: object) -> Iterator[None]:
    """``module.name`` (a module path) set to ``value`` for the block."""
    import importlib

    mod = importlib.import_module(module)
    saved = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, saved)
