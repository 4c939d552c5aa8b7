"""The attention kernels CP attention runs, each with an explicit backward (a custom op's
backward cannot use autograd).

* :class:`TorchFlashVarlen`: torch's own varlen flash kernels (``aten._flash_attention_forward``
  / ``_flash_attention_backward``; CUDA fp16/bf16 on sm80+, equal q/k and v head dims that are a
  multiple of 8 up to 256; causal aligned bottom-right, GQA in the kernel): ONE launch per layer
  for every span of the step. No flash-attn package is needed (flash-attn's
  ``flash_attn_varlen_func`` is an autograd function, which a custom op's explicit backward
  cannot call; torch ships the same FA2 kernels; it calls the package's ops directly where
  soft-capping needs it: :mod:`cpshard.attention.flash_attn2`).
  A windowed step's packing passes its window as the kernels' left window.
  FlashAttention-3 on Hopper GPUs: :mod:`cpshard.attention.fa3`; which kernel serves which
  queries: :mod:`cpshard.attention.choice`.
* :class:`MathVarlen`: the varlen kernels' contract in explicit matmul-softmax (fp16/bf16
  computed in fp32), over the packing's chunks: many short spans in one launch group, a long
  span in row pieces of bounded memory. It serves the varlen path where no flash kernel does
  (soft-capped logits, CUDA fp32/fp64, pre-sm80 GPUs, other head dims), so a step launches per
  chunk, not per span.
* Part kernels for the per-span loop: :class:`CpuFlash` (torch's CPU flash kernel) and
  :class:`MathPart` (explicit matmul-softmax in query chunks) for devices and dtypes no flash
  kernel serves (CUDA fp32/fp64, pre-sm80 GPUs, head dims flash does not take) and for
  soft-capped logits where no flash kernel takes them: use fp16/bf16 on GPUs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Protocol, TypeVar

import torch

from cpshard.attention.outside_modes import outside_dispatch_modes
from cpshard.attention.packing import Packing

Tensors = tuple[torch.Tensor, torch.Tensor]
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


How = TypeVar("How", contravariant=True)
T = torch.Tensor


class Kernel(Protocol[How]):
    """An attention kernel with an explicit backward (a custom op's backward cannot use
    autograd). ``how`` says which keys each query sees: a :class:`Packing` for a varlen kernel,
    ``causal`` for a part kernel. The backward takes the forward's output and log-sum-exp.
    ``name`` says which kernel it is (:func:`cpshard.attention_kernel`)."""

    name: str

    def forward(self, q: T, k: T, v: T, how: How, scale: float | None) -> Tensors: ...

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: How, scale: float | None
    ) -> Grads: ...


# A packed varlen kernel (the contract of torch's varlen flash kernels): ``[tokens, heads, D]``
# sequences delimited by int32 ``cu_q`` / ``cu_k``, causal aligned bottom-right, GQA by head
# groups; ``lse`` is ``[heads, q tokens]`` float32.
VarlenKernel = Kernel[Packing]
# Which keys of a part each query sees: all (False), causal with n == m (True), or an additive
# ``[1, 1, n, m]`` mask in the queries' dtype (0 visible, -inf hidden).
Visible = bool | torch.Tensor
Part = tuple[slice, Visible]  # a key range of the row's key buffer and which keys each query sees
# Queries ``[1, H, n, D]`` over one key part ``[1, H, m, D]``; ``lse`` is ``[1, H, n]``.
PartKernel = Kernel[Visible]


class TorchFlashVarlen:
    """torch's own varlen flash-attention kernels (CUDA fp16/bf16), dropout off; a windowed
    packing's window is the kernels' left window (keys ``window - 1`` before a query and the
    query itself)."""

    name = "torch_flash_varlen"

    @staticmethod
    def _window(p: Packing) -> dict[str, int | None]:
        """The kernels' window arguments. A packing whose spans all have ONE query gets a left
        window covering every key (``max_k``: the same attention): with no window, FlashAttention-2
        answers single-query GQA calls by folding the head groups into the query dim
        (``seqlenq_ngroups_swapped``), which reorders the forward's log-sum-exp against the
        ``[heads, tokens]`` order its backward and the loop's merge read."""
        if p.window is not None:
            left = p.window - 1
        elif p.max_q == 1:
            left = max(p.max_k, 1)
        else:
            return {"window_size_left": None, "window_size_right": None}
        return {"window_size_left": left, "window_size_right": 0}

    def forward(self, q: T, k: T, v: T, p: Packing, scale: float | None) -> Tensors:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, p.causal, False, scale=scale,
            **self._window(p),
        )
        return out, lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, p: Packing, scale: float | None
    ) -> Grads:
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # unused without dropout
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad,
            q,
            k,
            v,
            out,
            lse,
            p.cu_q,
            p.cu_k,
            p.max_q,
            p.max_k,
            0.0,
            p.causal,
            rng,
            unused,
            scale=scale,
            **self._window(p),
        )
        return dq, dk, dv


@functools.cache
def device_capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, queried on the host once per device."""
    return torch.cuda.get_device_capability(device)


def op_takes(op: object, names: set[str]) -> bool:
    """Whether a package's torch op (an ``OpOverloadPacket``) exists and its schema has
    arguments of every name in ``names``: the keywords cpshard calls it with, so that a build
    with another argument list is never chosen."""
    try:
        schema = op.default._schema  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return False
    return names <= {a.name for a in schema.arguments}


def torch_flash_runs_on(device: torch.device) -> bool:
    """torch's flash kernels run on this GPU: built in, and an sm80+ device."""
    return torch.backends.cuda.is_flash_attention_available() and (
        device_capability(device) >= (8, 0)
    )


@functools.cache
def _cpu_flash_groups() -> bool:
    """Whether this torch's CPU flash kernels take fewer K/V heads than query heads, and K/V
    views of any strides, forward and backward: probed once on tiny inputs against the same
    call with the heads repeated (a torch that refuses or differs gets repeated heads). Probed
    outside any dispatch mode: a first call traced under ``FakeTensorMode`` (a memory
    prediction) asks about the kernels, not about fake tensors, which hold no values."""
    return outside_dispatch_modes(_probe_cpu_flash_groups)


def _probe_cpu_flash_groups() -> bool:
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    gen = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(1, 4, 5, 8, generator=gen) for _ in range(2))
    kv = torch.randn(1, 5, 2, 16, generator=gen).transpose(1, 2)  # [1, 2, 5, 16], strided
    k, v = kv[..., :8], kv[..., 8:]
    wide = [t.repeat_interleave(2, dim=1).contiguous() for t in (k, v)]
    try:
        out, lse = flash(q, k, v, 0.0, True)
        dq, dk, dv = flash_backward(grad, q, k, v, out, lse, 0.0, True)
    except RuntimeError:
        return False
    out_w, lse_w = flash(q, *wide, 0.0, True)
    dq_w, dk_w, dv_w = flash_backward(grad, q, *wide, out_w, lse_w, 0.0, True)
    if dk.shape != k.shape or dv.shape != v.shape:
        return False
    fold = lambda g: g.view(1, 2, 2, 5, 8).sum(2)  # noqa: E731
    pairs = ((out, out_w), (dq, dq_w), (dk, fold(dk_w)), (dv, fold(dv_w)))
    return all(torch.allclose(a, b, atol=1e-5) for a, b in pairs)


class CpuFlash:
    """torch's CPU flash kernels. Given the MERGED output and log-sum-exp of several parts, the
    backward of each part is its exact share of the joint softmax's gradient. ``grouped``: GQA
    in the kernel, and K/V of any strides (the last 1), so the loop copies none (where this
    torch's kernels do, see :func:`_cpu_flash_groups`)."""

    name = "cpu_flash"

    @property
    def grouped(self) -> bool:
        return _cpu_flash_groups()

    def forward(self, q: T, k: T, v: T, how: Visible, scale: float | None) -> Tensors:
        causal, mask = _causal_and_mask(how)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        return out, lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: Visible, scale: float | None
    ) -> Grads:
        causal, mask = _causal_and_mask(how)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
        )


def _causal_and_mask(how: Visible) -> tuple[bool, torch.Tensor | None]:
    return (False, how) if isinstance(how, torch.Tensor) else (how, None)


def widened(scale: float | None, q: T, *others: T) -> tuple[float, torch.dtype, list[T]]:
    """The softmax scale, q's dtype (the results') and q and ``others`` in the explicit kernels'
    compute dtype (fp16/bf16 computed in fp32)."""
    s = scale if scale is not None else q.shape[-1] ** -0.5
    wide = lse_dtype(q.dtype)
    return s, q.dtype, [t.to(wide) for t in (q, *others)]


def logit_grads(probs: T, g: T, out: T, v: T, raw: T, softcap: float | None) -> T:
    """The gradient of the raw scores from the softmax's ``probs``, the output's gradient ``g``,
    the output and the values (``P * (dP - rowsum(g * out))``), through the soft-cap."""
    dlogits = probs * (g @ v.transpose(-1, -2) - (g * out).sum(-1, keepdim=True))
    if softcap is not None:  # d(c tanh(x / c)) / dx = 1 - tanh(x / c)^2
        dlogits = dlogits * (1 - torch.tanh(raw / softcap) ** 2)
    return dlogits


class MathPart:
    """Explicit matmul-softmax (fp16/bf16 computed in fp32), for devices and dtypes no flash
    kernel serves (CUDA fp32/fp64, pre-sm80 GPUs, head dims flash does not take) and for logit
    soft-capping (``softcap * tanh(score / softcap)``) where no flash kernel taking it does
    (FA3, the flash-attn package's FA2: :mod:`cpshard.attention.choice`).
    Queries go in chunks of at most ``SCORES`` score elements: memory O(SCORES) per part, not
    O(n * m)."""

    name = "math_part"
    SCORES = 1 << 22
    grouped = False  # K/V heads repeated for the queries' and made contiguous by the caller

    def __init__(self, softcap: float | None = None) -> None:
        self.softcap = softcap

    def _chunks(self, n: int, m: int) -> Iterator[slice]:
        step = max(1, self.SCORES // max(m, 1))
        return (slice(i, min(i + step, n)) for i in range(0, n, step))

    def _scores(self, q: T, k: T, how: Visible, rows: slice, s: float) -> Tensors:
        """The chunk ``rows``' raw scores ``q k^T * s`` and the logits the softmax takes (capped,
        masked)."""
        raw = (q[:, :, rows] @ k.transpose(-1, -2)) * s
        logits = raw if self.softcap is None else self.softcap * torch.tanh(raw / self.softcap)
        if isinstance(how, torch.Tensor):
            logits = logits + how[:, :, rows].to(logits.dtype)
        elif how:
            i = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
            j = torch.arange(k.shape[2], device=q.device)[None, :]
            logits = logits.masked_fill(j > i, float("-inf"))
        return raw, logits

    def forward(self, q: T, k: T, v: T, how: Visible, scale: float | None) -> Tensors:
        s, dtype, (q, k, v) = widened(scale, q, k, v)
        out = q.new_empty(*q.shape[:3], v.shape[-1])
        lse = q.new_empty(q.shape[:3])
        for rows in self._chunks(q.shape[2], k.shape[2]):
            _, logits = self._scores(q, k, how, rows, s)
            lse[:, :, rows] = torch.logsumexp(logits, dim=-1)
            out[:, :, rows] = torch.exp(logits - lse[:, :, rows, None]) @ v
        return out.to(dtype), lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: Visible, scale: float | None
    ) -> Grads:
        s, dtype, (q, k, v, grad, out) = widened(scale, q, k, v, grad, out)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows in self._chunks(q.shape[2], k.shape[2]):
            raw, logits = self._scores(q, k, how, rows, s)
            probs = torch.exp(logits - lse[:, :, rows, None])
            g = grad[:, :, rows]
            dv += probs.transpose(-1, -2) @ g
            dlogits = logit_grads(probs, g, out[:, :, rows], v, raw, self.softcap)
            dq[:, :, rows] = (dlogits @ k) * s
            dk += (dlogits.transpose(-1, -2) @ q[:, :, rows]) * s
        return dq.to(dtype), dk.to(dtype), dv.to(dtype)


class MathVarlen:
    """The varlen contract (packed ``[tokens, heads, D]`` queries and keys, GQA in the kernel,
    log-sum-exp ``[heads, tokens]``) in explicit matmul-softmax over the packing's chunks: each
    chunk's queries against the keys it reads, each query seeing its packed keys
    ``[q_first, q_last]``, logits soft-capped before the mask. Every packed query belongs to
    exactly one chunk. A query that sees no key gets a zero output and a ``-inf``
    log-sum-exp."""

    name = "math_varlen"

    def __init__(self, softcap: float | None = None) -> None:
        self.softcap = softcap

    def _chunk(self, q: T, k: T, p: Packing, c: tuple[int, int, int, int], s: float) -> Tensors:
        """Chunk ``c``'s raw scores ``[H, n, m]`` and the masked, capped logits."""
        q0, q1, k0, k1 = c
        assert p.q_first is not None and p.q_last is not None
        j = torch.arange(k0, k1, device=q.device)[None, :]
        visible = (j >= p.q_first[q0:q1, None]) & (j <= p.q_last[q0:q1, None])
        raw = (q[q0:q1].transpose(0, 1) @ k.transpose(-1, -2)) * s
        logits = raw if self.softcap is None else self.softcap * torch.tanh(raw / self.softcap)
        return raw, logits.masked_fill(~visible, float("-inf"))

    @staticmethod
    def _heads(t: T, c: tuple[int, int, int, int], heads: int) -> T:
        """Chunk ``c``'s keys or values as ``[H, m, D]``, KV heads repeated for the queries'."""
        return repeat_kv(t[c[2] : c[3]].transpose(0, 1), heads)

    def forward(self, q: T, k: T, v: T, p: Packing, scale: float | None) -> Tensors:
        s, dtype, (q, k, v) = widened(scale, q, k, v)
        heads = q.shape[1]
        out = q.new_zeros(q.shape[0], heads, v.shape[-1])
        lse = q.new_full((heads, q.shape[0]), float("-inf"))
        for c in p.chunks:
            _, logits = self._chunk(q, self._heads(k, c, heads), p, c, s)
            total = torch.logsumexp(logits, dim=-1)
            probs = torch.exp(logits - total.nan_to_num(neginf=0.0)[..., None])
            out[c[0] : c[1]] = (probs @ self._heads(v, c, heads)).transpose(0, 1)
            lse[:, c[0] : c[1]] = total
        return out.to(dtype), lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, p: Packing, scale: float | None
    ) -> Grads:
        s, dtype, (q, k, v, grad, out) = widened(scale, q, k, v, grad, out)
        heads, kv_heads = q.shape[1], k.shape[1]
        dq = torch.zeros_like(q)
        dk = k.new_zeros(k.shape[0], heads, k.shape[-1])
        dv = v.new_zeros(v.shape[0], heads, v.shape[-1])
        for c in p.chunks:
            q0, q1, k0, k1 = c
            ks, vs = self._heads(k, c, heads), self._heads(v, c, heads)
            raw, logits = self._chunk(q, ks, p, c, s)
            probs = torch.exp(logits - lse[:, q0:q1, None].nan_to_num(neginf=0.0))
            g = grad[q0:q1].transpose(0, 1)
            dv[k0:k1] += (probs.transpose(-1, -2) @ g).transpose(0, 1)
            dlogits = logit_grads(probs, g, out[q0:q1].transpose(0, 1), vs, raw, self.softcap)
            dq[q0:q1] = ((dlogits @ ks) * s).transpose(0, 1)
            qs = q[q0:q1].transpose(0, 1)
            dk[k0:k1] += ((dlogits.transpose(-1, -2) @ qs) * s).transpose(0, 1)
        fold = lambda t: t.view(t.shape[0], kv_heads, heads // kv_heads, -1).sum(2)  # noqa: E731
        return dq.to(dtype), fold(dk).to(dtype), fold(dv).to(dtype)


def repeat_kv(t: T, heads: int) -> T:
    """``[KV heads, m, D]`` repeated to ``heads`` (GQA)."""
    return t if t.shape[0] == heads else t.repeat_interleave(heads // t.shape[0], dim=0)


def repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, KV heads, n, D]`` repeated to the queries' ``heads`` (GQA)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def fold_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Adjoint of :func:`repeat_heads`: the gradient of repeated heads summed onto each KV head."""
    b, heads, n, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, n, d).sum(2)
