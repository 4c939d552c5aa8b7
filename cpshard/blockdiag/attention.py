"""Causal attention within each document across the CP group, for any step state.

A step state (:class:`cpshard.blockdiag.state.AttentionState`) says how this rank's K/V become
its key buffer and which keys each run of its queries attends, as spans: queries
``[q, q + n)`` of a batch row over the buffer's keys ``[k, split)`` (all visible: the document's
part before the run) and ``[split, split + n)`` (causal: the run's own keys), i.e. the
document's whole prefix, causal aligned bottom-right. Pad rows attend to nothing and output
zeros. The block-diagonal state (``make_cp_blockdiag_batch_and_ctx``, contiguous shards)
builds its buffer with the multi-hop halo: exactly the K/V rows before its first token that the
document containing that token reaches back to (the max over batch rows); a sharder layout's
state (:mod:`cpshard.attention`) with one all-to-all-v of the rows its runs reach.

``torch.library`` custom ops do the work, each with a fake kernel and a backward op, so that
``torch.compile`` traces a call as one opaque node (and its backward as another) and never sees
the step's spans:

* ``cpshard::blockdiag_attention(q, kv, key, d_k, scale)`` -> ``(out, lse)``: the state's
  exchange builds the key buffer from this rank's K and V (concatenated on the last dim) —
  here ``cpshard::blockdiag_halo(kv, key)``: the halo in front (the transport's
  ``halo_exchange``) — and the spans attend it. It saves only this rank's own K/V: backward
  (``cpshard::blockdiag_attention_backward``, from the saved output and log-sum-exp) runs the
  exchange again and sends the buffer's gradients back to their owners
  (``cpshard::blockdiag_halo_return``, the transport's ``halo_return``; an all-padding rank
  joins too). A model's layers thus keep their own K/V for backward, not the exchanged buffer
  (up to W times larger for long documents or ``stripe``), for one more exchange per layer.

``key`` is the step state's CPU scalar key (:func:`cpshard.blockdiag.state.state_for`): the
spans, the exchange plan and the varlen packing were computed once per step and moved to the
device once, so a call reads no device data on the host and copies nothing host->device.

Kernels:

* CUDA fp16/bf16 on sm80+ (equal q/k and v head dims, a multiple of 8 up to 256): ONE launch
  per layer of torch's own varlen flash kernels (``aten._flash_attention_forward`` /
  ``_flash_attention_backward``, whose causal mask is aligned bottom-right), GQA in the kernel;
  no flash-attn package needed (flash-attn's ``flash_attn_varlen_func`` is an autograd function,
  which a custom op's explicit backward cannot call; torch ships the same FA2 kernels). Each
  span packs its document's prefix, so a step whose packing would exceed
  ``PACKED_KEYS_PER_ROW`` key rows per buffer row (many short runs per document, as
  ``stripe`` gives) has none and runs the loop below.
* Otherwise a loop over spans: a span whose document starts before the run splits into a
  non-causal prefix part and a causal square part, merged by their log-sum-exp
  (flash-attention's decomposition), so no ``[L, S]`` mask is ever built; runs of a few tokens
  (``stripe`` gives single-token runs) go in blocks of one document, one masked call each
  (:mod:`cpshard.blockdiag.blocks`). On CPU each part is
  torch's CPU flash kernel; on CUDA fp32/fp64 (no flash kernel takes them), and where the flash
  kernels do not fit (head dims, pre-sm80 GPUs), each part is an explicit matmul-softmax
  (memory O(n * m) per part): use fp16/bf16 on GPUs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

import torch
import torch.nn.functional as F

from cpshard.blockdiag.blocks import Block, Blocks
from cpshard.blockdiag.state import AttentionState, Packing, Span, active_state, state_for
from cpshard.comm.collectives import halo_exchange, halo_return
from cpshard.consensus import check_call, device_code, digest, dtype_code
from cpshard.transport import HALO, call_key

_WHAT = "cpshard.cp_blockdiag_sdpa"
Tensors = tuple[torch.Tensor, torch.Tensor]
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------ kernels


How = TypeVar("How", contravariant=True)
T = torch.Tensor


class Kernel(Protocol[How]):
    """An attention kernel with an explicit backward (a custom op's backward cannot use
    autograd). ``how`` says which keys each query sees: a :class:`Packing` for a varlen kernel,
    ``causal`` for a part kernel. The backward takes the forward's output and log-sum-exp."""

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
    """torch's own varlen flash-attention kernels (CUDA fp16/bf16), dropout off."""

    def forward(self, q: T, k: T, v: T, p: Packing, scale: float | None) -> Tensors:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, p.causal, False, scale=scale
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
        )
        return dq, dk, dv


@functools.cache
def _flash_runs_on(device: torch.device) -> bool:
    """torch's flash kernels run on this GPU: built in, and an sm80+ device (a host query)."""
    return torch.backends.cuda.is_flash_attention_available() and (
        torch.cuda.get_device_capability(device) >= (8, 0)
    )


def varlen_kernel(q: torch.Tensor, d_k: int, d_v: int) -> VarlenKernel | None:
    """The one-launch kernel for CUDA fp16/bf16 queries with equal head dims that the flash
    kernels take (a multiple of 8, at most 256) on a GPU they run on, else None (the loop)."""
    fits = d_k == d_v and d_k % 8 == 0 and d_k <= 256
    half = q.dtype in (torch.float16, torch.bfloat16)
    if q.is_cuda and half and fits and _flash_runs_on(q.device):
        return TorchFlashVarlen()
    return None


class CpuFlash:
    """torch's CPU flash kernels. Given the MERGED output and log-sum-exp of several parts, the
    backward of each part is its exact share of the joint softmax's gradient."""

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


class MathPart:
    """Explicit matmul-softmax (fp16/bf16 computed in fp32), for devices and dtypes no flash
    kernel serves (CUDA fp32/fp64, pre-sm80 GPUs, head dims flash does not take)."""

    @staticmethod
    def _probs(
        q: torch.Tensor,
        k: torch.Tensor,
        lse: torch.Tensor | None,
        how: Visible,
        scale: float | None,
    ) -> Tensors:
        s = scale if scale is not None else q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-1, -2)) * s
        if isinstance(how, torch.Tensor):
            scores = scores + how.to(scores.dtype)
        elif how:
            n = q.shape[2]
            scores = scores.masked_fill(
                torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
            )
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q: T, k: T, v: T, how: Visible, scale: float | None) -> Tensors:
        wide = _lse_dtype(q.dtype)  # fp16/bf16 computed in fp32
        probs, lse = self._probs(q.to(wide), k.to(wide), None, how, scale)
        return (probs @ v.to(wide)).to(q.dtype), lse

    def backward(
        self, grad: T, q: T, k: T, v: T, out: T, lse: T, how: Visible, scale: float | None
    ) -> Grads:
        s = scale if scale is not None else q.shape[-1] ** -0.5
        dtype, wide = q.dtype, _lse_dtype(q.dtype)
        grad, q, k, v, out = (t.to(wide) for t in (grad, q, k, v, out))
        probs, _ = self._probs(q, k, lse, how, scale)
        dv = probs.transpose(-1, -2) @ grad
        dscores = probs * (grad @ v.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True)) * s
        return tuple(t.to(dtype) for t in (dscores @ k, dscores.transpose(-1, -2) @ q, dv))


def part_kernel(q: torch.Tensor) -> PartKernel:
    """The per-segment part kernel for q's device."""
    return CpuFlash() if q.device.type == "cpu" else MathPart()


# ------------------------------------------------------------------ the per-segment loop


def _parts(item: Span | Block, causal: bool, blocks: Blocks, dtype: torch.dtype) -> list[Part]:
    """Key ranges (of the row's key buffer) of a span or block, and which keys its queries see."""
    if isinstance(item, Block):
        return [(slice(item.k, item.k + item.width), blocks.mask(item, dtype))]
    if not causal:
        return [(slice(item.k, item.split), False)]
    square = (slice(item.split, item.split + item.n), True)
    return [(slice(item.k, item.split), False), square] if item.split > item.k else [square]


class _Loop:
    """The per-span loop: each long span's parts and each block of short spans
    (:mod:`cpshard.blockdiag.blocks`) through the part kernel, parts merged by LSE."""

    def __init__(self, state: AttentionState, q: torch.Tensor) -> None:
        self.state, self.kern, self.heads = state, part_kernel(q), q.shape[1]
        self.blocks, self.dtype = state.blocks_on(q.device), q.dtype

    def _items(self) -> Iterator[tuple[tuple[slice, ...], list[Part]]]:
        """Each span or block: its query rows' index into ``[B, H, L, ...]`` and its parts."""
        for it in self.blocks.items:
            rows = (slice(it.row, it.row + 1), slice(None), slice(it.q, it.q + it.n))
            yield rows, _parts(it, self.state.causal, self.blocks, self.dtype)

    def _keys(self, t: T, at: tuple[slice, slice, slice]) -> T:
        """A part's keys or values, KV heads repeated for the queries' heads: per part, so
        the repeat never holds the whole key buffer."""
        return _repeat(t[at], self.heads).contiguous()

    def forward(self, q: T, k: T, v: T, scale: float | None) -> Tensors:
        out = q.new_zeros(*q.shape[:3], v.shape[-1])
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=_lse_dtype(q.dtype))
        for rows, parts in self._items():
            qs = q[rows].contiguous()
            results = []
            for keys, how in parts:
                at = (rows[0], slice(None), keys)
                results.append(
                    self.kern.forward(qs, self._keys(k, at), self._keys(v, at), how, scale)
                )
            if len(results) == 1:
                out[rows], lse[rows] = results[0]
                continue
            total = torch.logsumexp(torch.stack([r[1] for r in results]), dim=0)
            out[rows] = sum(
                o * torch.exp(part_lse - total).unsqueeze(-1).to(o.dtype) for o, part_lse in results
            )
            lse[rows] = total
        return out, lse

    def backward(self, grad: T, q: T, k: T, v: T, out: T, lse: T, scale: float | None) -> Grads:
        kv_heads = k.shape[1]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows, parts in self._items():
            g, qs, os_, ls = (t[rows].contiguous() for t in (grad, q, out, lse))
            for keys, how in parts:
                at = (rows[0], slice(None), keys)
                dqs, dks, dvs = self.kern.backward(
                    g, qs, self._keys(k, at), self._keys(v, at), os_, ls, how, scale
                )
                dq[rows] += dqs
                dk[at] += _fold(dks, kv_heads)
                dv[at] += _fold(dvs, kv_heads)
        return dq, dk, dv


# ------------------------------------------------------------------ the varlen path


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, N, D]`` -> ``[B * N, H, D]``."""
    return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3])


def _unflat(flat: torch.Tensor, b: int) -> torch.Tensor:
    """``[B * N, H, D]`` -> ``[B, H, N, D]``."""
    return flat.view(b, -1, *flat.shape[1:]).transpose(1, 2)


def _scatter(rows: torch.Tensor, packed: torch.Tensor, n: int, add: bool = False) -> torch.Tensor:
    """``[n, ...]`` zeros with ``packed`` at ``rows``: copied (distinct rows: deterministic, no
    atomics), or added where rows repeat (``add``)."""
    out = packed.new_zeros(n, *packed.shape[1:])
    return out.index_add(0, rows, packed) if add else out.index_copy(0, rows, packed)


class _Varlen:
    """Every segment in one launch of a varlen kernel: segment queries and their keys packed as
    ``[tokens, heads, D]`` by the step's packing (GQA left to the kernel), results put back."""

    def __init__(self, kern: VarlenKernel, packing: Packing) -> None:
        self.kern, self.p = kern, packing

    def _packed(self, q: T, k: T, v: T) -> tuple[T, T, T]:
        p = self.p
        return (
            _flat(q).index_select(0, p.q_rows),
            _flat(k).index_select(0, p.k_rows),
            _flat(v).index_select(0, p.k_rows),
        )

    def forward(self, q: T, k: T, v: T, scale: float | None) -> Tensors:
        b, heads, length, _ = q.shape
        out, lse = self.kern.forward(*self._packed(q, k, v), self.p, scale)
        full_lse = lse.new_full((b * length, heads), float("-inf")).index_copy(
            0, self.p.q_rows, lse.t()
        )
        lse = full_lse.view(b, length, heads).transpose(1, 2)
        return _unflat(_scatter(self.p.q_rows, out, b * length), b), lse

    def backward(self, grad: T, q: T, k: T, v: T, out: T, lse: T, scale: float | None) -> Grads:
        b, heads, length, _ = q.shape
        p = self.p
        pick = lambda t: _flat(t).index_select(0, p.q_rows)  # noqa: E731
        packed_lse = (
            lse.transpose(1, 2).reshape(-1, heads).index_select(0, p.q_rows).t().contiguous()
        )
        dq, dk, dv = self.kern.backward(
            pick(grad), *self._packed(q, k, v), pick(out), packed_lse, p, scale
        )
        ext = b * k.shape[2]  # copies where each key row serves one span (the contiguous split)
        dq = _scatter(p.q_rows, dq, b * length)
        return (
            _unflat(dq, b),
            _unflat(_scatter(p.k_rows, dk, ext, p.shared_keys), b),
            _unflat(_scatter(p.k_rows, dv, ext, p.shared_keys), b),
        )


def _implementation(state: AttentionState, q: torch.Tensor, d_k: int, d_v: int) -> _Loop | _Varlen:
    """One varlen launch where a kernel serves q (and the rank has spans, and the step a
    packing), else the loop."""
    kern = varlen_kernel(q, d_k, d_v)
    packing = state.packing_on(q.device) if kern is not None and state.spans else None
    return _Loop(state, q) if packing is None else _Varlen(kern, packing)


# ------------------------------------------------------------------ the custom ops


def _split(kv: torch.Tensor, d_k: int) -> Tensors:
    return kv[..., :d_k], kv[..., d_k:]


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Adjoint of :func:`_repeat`: sum the gradient of repeated heads back onto each KV head."""
    b, heads, n, d = grad.shape
    return grad if heads == kv_heads else grad.view(b, kv_heads, heads // kv_heads, n, d).sum(2)


@torch.library.custom_op("cpshard::blockdiag_halo", mutates_args=())
def blockdiag_halo(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``kv`` ``[B, H, L, D]`` with the step's halo rows in front along dim 2."""
    state = state_for(key)
    halos = list(state.halos)
    return halo_exchange(kv, state.group.name, halos, 0, 2, _halo_key(kv.dtype, kv.shape, halos))


@blockdiag_halo.register_fake
def _blockdiag_halo_fake(kv: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    extended = torch.library.get_ctx().new_dynamic_size()  # halo + L: the step's data
    return kv.new_empty(kv.shape[0], kv.shape[1], extended, kv.shape[3])


@torch.library.custom_op("cpshard::blockdiag_halo_return", mutates_args=())
def blockdiag_halo_return(grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
    """Adjoint of :func:`blockdiag_halo`: ``[B, H, length, D]``, halo rows' gradients added by
    their owners."""
    state = state_for(key)
    halos = list(state.halos)
    shape = (grad.shape[0], grad.shape[1], length, grad.shape[3])
    return halo_return(grad.contiguous(), state.group.name, halos, 0, 2, _halo_key(grad.dtype, shape, halos))


def _halo_key(dtype: torch.dtype, shape: Sequence[int], halos: list[int]) -> int:
    """The transfer's fingerprint (:func:`cpshard.transport.call_key`) from the forward's K/V
    shape: the same in the forward and the backward exchange."""
    return call_key(HALO, dtype, shape, 2, True, False, halos)


@blockdiag_halo_return.register_fake
def _blockdiag_halo_return_fake(grad: torch.Tensor, key: torch.Tensor, length: int) -> torch.Tensor:
    return grad.new_empty(grad.shape[0], grad.shape[1], length, grad.shape[3])


def register_exchange_autograd(
    op: torch.library.CustomOpDef, adjoint: Callable[[T, T, int], T]
) -> None:
    """The autograd of a K/V exchange op ``op(kv, key)`` of the step ``key``: its adjoint op
    ``adjoint(grad, key, length)`` (``length``: the tokens of ``kv``)."""

    def keep(ctx, inputs, output) -> None:
        kv, ctx.key = inputs
        ctx.length = kv.shape[2]

    def backward(ctx, grad: torch.Tensor):
        return adjoint(grad, ctx.key, ctx.length), None

    op.register_autograd(backward, setup_context=keep)


register_exchange_autograd(blockdiag_halo, blockdiag_halo_return)


@torch.library.custom_op("cpshard::blockdiag_attention", mutates_args=())
def blockdiag_attention(
    q: torch.Tensor, kv: torch.Tensor, key: torch.Tensor, d_k: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document causal attention of q ``[B, Hq, L, d_k]`` over the key buffer the step's
    exchange builds from this rank's ``kv`` ``[B, Hkv, L, d_k + d_v]``: the output
    ``[B, Hq, L, d_v]`` (zeros on pad rows) and its log-sum-exp ``[B, Hq, L]`` (-inf on pad
    rows)."""
    state = state_for(key)
    k, v = _split(state.extend(kv), d_k)
    return _implementation(state, q, d_k, v.shape[-1]).forward(q, k, v, scale)


@blockdiag_attention.register_fake
def _blockdiag_attention_fake(
    q: T, kv: T, key: T, d_k: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    out = q.new_empty(*q.shape[:3], kv.shape[3] - d_k)
    return out, q.new_empty(q.shape[:3], dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("cpshard::blockdiag_attention_backward", mutates_args=())
def blockdiag_attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    key: torch.Tensor,
    d_k: int,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of q and of this rank's ``kv``: the exchange again, the spans' backward over
    the buffer, and the buffer's gradients returned to their owners (zeros where no query
    attends: an all-padding rank still joins both exchanges its peers wait for)."""
    state = state_for(key)
    k, v = _split(state.extend(kv), d_k)
    impl = _implementation(state, q, d_k, v.shape[-1])
    dq, dk, dv = impl.backward(grad.contiguous(), q, k, v, out, lse, scale)
    return dq, state.restore(torch.cat([dk, dv], dim=-1), kv.shape[2])


@blockdiag_attention_backward.register_fake
def _blockdiag_attention_backward_fake(
    grad: T, q: T, kv: T, out: T, lse: T, key: T, d_k: int, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(kv)


def _keep_attention(ctx, inputs, output) -> None:
    q, kv, key, ctx.d_k, ctx.scale = inputs
    ctx.save_for_backward(q, kv, key, *output)


def _blockdiag_attention_grad(ctx, grad: torch.Tensor, grad_lse: torch.Tensor | None):
    q, kv, key, out, lse = ctx.saved_tensors
    dq, dkv = blockdiag_attention_backward(grad, q, kv, out, lse, key, ctx.d_k, ctx.scale)
    return dq, dkv, None, None, None


blockdiag_attention.register_autograd(_blockdiag_attention_grad, setup_context=_keep_attention)


# ------------------------------------------------------------------ the public function


def _problem(
    state: AttentionState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: object,
    dropout_p: float,
    enable_gqa: bool,
) -> str | None:
    """This rank's problem with the arguments, or None (shapes and the state's sizes only)."""
    problem = None
    if attn_mask is not None:
        problem = "attn_mask must be None while CP attention is active"
    elif dropout_p != 0.0:
        problem = "dropout_p must be 0 while CP attention is active"
    elif q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        problem = "q, k, v must be [B, heads, L, D]"
    elif (
        q.shape[2] != state.local_len
        or k.shape[2] != state.local_len
        or v.shape[2] != state.local_len
    ):
        problem = (
            f"q/k/v hold {q.shape[2]}/{k.shape[2]}/{v.shape[2]} tokens but this rank's shard of "
            f"the active {state.layout!r} layout has {state.local_len}"
        )
    elif q.shape[0] != state.batch_size:
        problem = f"q has batch {q.shape[0]} but the sharded batch has {state.batch_size}"
    elif k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype or k.device != v.device:
        problem = (
            f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must match in every "
            "dim but the last, in dtype and in device"
        )
    elif k.shape[0] != q.shape[0] or q.dtype != k.dtype or q.device != k.device:
        problem = (
            f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must match in batch, "
            "dtype and device"
        )
    elif q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        problem = (
            f"q has {q.shape[1]} heads and k {k.shape[1]}: pass enable_gqa=True with a divisible "
            "head count"
        )
    return problem


def _fields(
    state: AttentionState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> Callable[[], dict[str, Sequence[int]]]:
    """What every rank's call must agree on (checked mode only: it reads the step's plan)."""
    return lambda: {
        "layout": digest([ord(c) for c in state.layout]),
        "dtype": [dtype_code(q.dtype)],
        "device type": [device_code(q)],
        "q, k, v heads and dims": [q.shape[1], k.shape[1], q.shape[3], k.shape[3], v.shape[3]],
        # ranks that differ here would block in the backward exchange
        "requires_grad": [int(torch.is_grad_enabled() and (k.requires_grad or v.requires_grad))],
        "exchange plan": digest(state.exchange_plan),
    }


def attend(
    state: AttentionState,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    scale: float | None,
    enable_gqa: bool,
    what: str,
    problem: str | None = None,
) -> torch.Tensor:
    """Causal attention within documents under ``state``: the step's K/V exchange, then the
    spans' attention. ``problem``: the caller's own finding about its arguments, reported like
    the shape checks (locally, or on every rank in checked mode)."""
    problem = problem or _problem(state, query, key, value, attn_mask, dropout_p, enable_gqa)
    check_call(state.group, what, problem, _fields(state, query, key, value))
    kv = torch.cat([key, value], dim=-1)
    out, _ = blockdiag_attention(query, kv, state.key, key.shape[-1], scale)
    return out


def cp_blockdiag_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``F.scaled_dot_product_attention``: plain SDPA when no CP attention state is
    active; otherwise causal attention within each document across the CP group, whatever
    ``is_causal`` says (``attn_mask`` must be None and ``dropout_p`` 0: the documents define the
    mask). :func:`cpshard.cp_attention` honours ``is_causal`` and ``window`` instead.

    Checks are local (shapes against the step's sizes) unless checked mode is on, which adds one
    consensus round so that bad input on one rank makes every rank raise."""
    state = active_state()
    if state is None:
        return plain_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return attend(state, query, key, value, attn_mask, dropout_p, scale, enable_gqa, _WHAT)


def plain_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (what the CP attention functions do outside a context)."""
    return F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
