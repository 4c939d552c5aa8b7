"""Causal attention within each document across the CP group.

Each rank receives, through the multi-hop halo, exactly the K/V rows before its first token that
the document containing that token reaches back to (the max over batch rows), then attends per
document segment: queries ``[begin, begin + n)`` over keys ``[doc_start, begin + n)``. On CUDA
with flash-attn installed (fp16/bf16), all segments go to ONE call of its varlen kernel (causal,
aligned bottom-right: a segment's queries see its whole prefix). Otherwise each segment is one
attention call; on CPU a segment whose document starts on an earlier rank splits into a
non-causal prefix part and a causal square part, merged by their log-sum-exp (flash-attention's
decomposition), so no ``[L, S]`` mask is ever built. Pad rows attend to nothing and output zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from cpshard.blockdiag.state import BlockDiagState, Segment, active_state
from cpshard.consensus import check_call
from cpshard.transport import exchange_halo

_WHAT = "cpshard.cp_blockdiag_sdpa"
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _PrefixCausalAttention(torch.autograd.Function):
    """softmax over [prefix keys (all visible), segment keys (causal)] on CPU, merged by LSE.

    The backward runs the flash backward of each part with the MERGED output and log-sum-exp,
    which gives the exact gradient of the joint softmax.
    """

    @staticmethod
    def forward(ctx, q, k_pre, v_pre, k_seg, v_seg, scale):
        out_a, lse_a = _flash_cpu(q, k_pre, v_pre, 0.0, False, scale=scale)
        out_b, lse_b = _flash_cpu(q, k_seg, v_seg, 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_a, lse_b)
        out = out_a * torch.exp(lse_a - lse).unsqueeze(-1).to(out_a.dtype) + out_b * torch.exp(
            lse_b - lse
        ).unsqueeze(-1).to(out_b.dtype)
        ctx.save_for_backward(q, k_pre, v_pre, k_seg, v_seg, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_pre, v_pre, k_seg, v_seg, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq_a, dk_pre, dv_pre = _flash_cpu_backward(grad, q, k_pre, v_pre, out, lse, 0.0, False, scale=ctx.scale)
        dq_b, dk_seg, dv_seg = _flash_cpu_backward(grad, q, k_seg, v_seg, out, lse, 0.0, True, scale=ctx.scale)
        return dq_a + dq_b, dk_pre, dv_pre, dk_seg, dv_seg, None


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float | None) -> torch.Tensor:
    """Queries q ``[1, H, n, D]`` over keys ``[prefix + n]`` (the first ``prefix`` all visible,
    the last n causal)."""
    n = q.shape[2]
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if q.is_cuda:
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, prefix + n), scale=scale)
    return _PrefixCausalAttention.apply(
        q.contiguous(),
        k[:, :, :prefix].contiguous(),
        v[:, :, :prefix].contiguous(),
        k[:, :, prefix:].contiguous(),
        v[:, :, prefix:].contiguous(),
        scale,
    )


VarlenKernel = Callable[..., torch.Tensor]  # flash_attn.flash_attn_varlen_func's signature


@functools.cache
def _flash_attn_varlen() -> VarlenKernel | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def varlen_kernel(q: torch.Tensor) -> VarlenKernel | None:
    """flash-attn's varlen kernel for CUDA fp16/bf16 queries when flash-attn is installed."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return None
    return _flash_attn_varlen()


def _varlen_attention(
    state: BlockDiagState,
    q: torch.Tensor,
    k_ext: torch.Tensor,
    v_ext: torch.Tensor,
    scale: float | None,
    kernel: VarlenKernel,
) -> torch.Tensor:
    """Every segment in one varlen call: segment queries and their keys packed as
    ``[tokens, heads, D]`` sequences (GQA left to the kernel), outputs put back in place."""
    b, heads, length, d = q.shape
    ext = k_ext.shape[2]
    origin = state.start - state.halo
    segs = state.segments
    q_len = torch.tensor([s.length for s in segs])
    k_len = torch.tensor([s.begin + s.length - s.doc_start for s in segs])
    q_first = torch.tensor([s.row * length + s.begin - state.start for s in segs])
    k_first = torch.tensor([s.row * ext + s.doc_start - origin for s in segs])

    def rows(first: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat row indices of each segment's run, and the int32 cumulative lengths."""
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        idx = torch.repeat_interleave(first - cu[:-1], lens) + torch.arange(int(cu[-1]))
        return idx.to(q.device), cu.to(device=q.device, dtype=torch.int32)

    def packed(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]).index_select(0, idx)

    q_idx, cu_q = rows(q_first, q_len)
    k_idx, cu_k = rows(k_first, k_len)
    out = kernel(
        packed(q, q_idx),
        packed(k_ext, k_idx),
        packed(v_ext, k_idx),
        cu_q,
        cu_k,
        int(q_len.max()),
        int(k_len.max()),
        dropout_p=0.0,
        softmax_scale=scale,
        causal=True,
    )
    full = out.new_zeros(b * length, heads, out.shape[-1]).index_copy(0, q_idx, out)
    return full.view(b, length, heads, -1).transpose(1, 2)


def _problem(state: BlockDiagState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: object, dropout_p: float, enable_gqa: bool) -> str | None:
    """This rank's problem with the arguments, or None."""
    problem = None
    if attn_mask is not None:
        problem = "attn_mask must be None while block-diagonal CP attention is active"
    elif dropout_p != 0.0:
        problem = "dropout_p must be 0 while block-diagonal CP attention is active"
    elif q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        problem = "q, k, v must be [B, heads, L, D]"
    elif q.shape[2] != state.local_len or k.shape[2] != state.local_len or v.shape[2] != state.local_len:
        problem = f"q/k/v hold {q.shape[2]}/{k.shape[2]}/{v.shape[2]} tokens but this rank's shard has {state.local_len}"
    elif q.shape[0] != state.batch_size:
        problem = f"q has batch {q.shape[0]} but the sharded batch has {state.batch_size}"
    elif k.shape[:-1] != v.shape[:-1] or k.dtype != v.dtype or k.device != v.device:
        problem = (
            f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} must match in every "
            "dim but the last, in dtype and in device"
        )
    elif k.shape[0] != q.shape[0] or q.dtype != k.dtype or q.device != k.device:
        problem = f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must match in batch, dtype and device"
    elif q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        problem = f"q has {q.shape[1]} heads and k {k.shape[1]}: pass enable_gqa=True with a divisible head count"
    return problem


def _blockdiag(state: BlockDiagState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    d_k = k.shape[-1]
    kv = exchange_halo(torch.cat([k, v], dim=-1), state.group, list(state.halos), 0, 2, _WHAT)
    k_ext, v_ext = kv[..., :d_k], kv[..., d_k:]
    kernel = varlen_kernel(q) if d_k == v.shape[-1] else None
    if kernel is not None and state.segments:
        return _varlen_attention(state, q, k_ext, v_ext, scale, kernel)
    if q.shape[1] != k.shape[1]:
        k_ext = k_ext.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v_ext = v_ext.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    origin = state.start - state.halo  # global position of k_ext's first row
    rows: list[list[tuple[Segment, torch.Tensor]]] = [[] for _ in range(state.batch_size)]
    for s in state.segments:
        lo = s.begin - state.start
        keys = slice(s.doc_start - origin, s.begin + s.length - origin)
        out = _segment_attention(
            q[s.row : s.row + 1, :, lo : lo + s.length],
            k_ext[s.row : s.row + 1, :, keys],
            v_ext[s.row : s.row + 1, :, keys],
            s.begin - s.doc_start,
            scale,
        )
        rows[s.row].append((s, out))
    out = torch.cat([_assemble(row, q, v.shape[-1], state) for row in rows], dim=0)
    if not state.segments:
        # An all-padding rank still joins the backward halo exchange its peers wait for.
        out = out + kv.narrow(-1, 0, 0).sum()
    return out


def _assemble(pieces: list[tuple[Segment, torch.Tensor]], q: torch.Tensor, d_v: int, state: BlockDiagState) -> torch.Tensor:
    """One batch row ``[1, H, L, d_v]``: segment outputs in place, zeros on pad rows."""
    parts, at = [], state.start
    for s, out in pieces:
        if s.begin > at:
            parts.append(q.new_zeros(1, q.shape[1], s.begin - at, d_v))
        parts.append(out)
        at = s.begin + s.length
    end = state.start + state.local_len
    if at < end:
        parts.append(q.new_zeros(1, q.shape[1], end - at, d_v))
    return torch.cat(parts, dim=2)


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
    """Drop-in for ``F.scaled_dot_product_attention``: plain SDPA when no block-diagonal state is
    active; otherwise causal attention within each document across the CP group (``attn_mask``
    must be None and ``dropout_p`` 0: the documents define the mask)."""
    state = active_state()
    if state is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    problem = _problem(state, query, key, value, attn_mask, dropout_p, enable_gqa)
    if problem is not None:
        check_call(state.group, _WHAT, problem)  # in checked mode: the halo exchange's round, failed here
    return _blockdiag(state, query, key, value, scale)
