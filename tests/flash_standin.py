"""Plain-PyTorch stand-ins for the flash packages' torch ops, registered on CPU under test-only
namespaces with the packages' own argument lists, so cpshard's FA3 and flash-attn kernel classes
(:mod:`cpshard.attention.fa3`, :mod:`cpshard.attention.flash_attn2`) run on CPU unchanged:

* ``cpshard_standin_fa3::fwd`` / ``bwd``: FlashAttention-3's ``flash_attn_3::fwd`` / ``bwd``
  (the schema of the FA3 sources, keyword names and defaults included);
* ``cpshard_standin_fa2::_flash_attn_varlen_forward`` / ``_flash_attn_varlen_backward``: the
  flash-attn 2.7-2.8 package's varlen ops (the Python signature its ``custom_op`` is made from).

What they compute is the kernels' contract, in float64 math: varlen sequences (``cu_seqlens``)
or a dense batch, GQA by head groups, causal aligned bottom-right, left / right windows (FA's
``-1``: none; causal sets the right window to 0), logits ``softcap * tanh(score * scale /
softcap)``, a query seeing no key: zero output and ``-inf`` log-sum-exp. The backward reads the
output it is given only in ``D = rowsum(dout * out)`` and rebuilds ``P = exp(logits - lse)``
from the log-sum-exp it is given, as the kernels do. The log-sum-exp is float32 for fp16 /
bf16 / fp32 queries (the kernels') and float64 for float64 queries (what the tests compare).
Arguments beyond the contract cpshard uses (KV caches, paging, rotary, fp8 scales) raise.
"""

from __future__ import annotations

import torch

FA3 = "cpshard_standin_fa3"
FA2 = "cpshard_standin_fa2"

# flash_attn_3's own schemas (hopper/flash_api.cpp), under the test namespace
FA3_FWD = (
    "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new = None, Tensor(v_new!)? v_new = None,"
    " Tensor? q_v = None, Tensor(out!)? out = None, Tensor? cu_seqlens_q = None,"
    " Tensor? cu_seqlens_k = None, Tensor? cu_seqlens_k_new = None, Tensor? seqused_q = None,"
    " Tensor? seqused_k = None, int? max_seqlen_q = None, int? max_seqlen_k = None,"
    " Tensor? page_table = None, Tensor? kv_batch_idx = None, Tensor? leftpad_k = None,"
    " Tensor? rotary_cos = None, Tensor? rotary_sin = None, Tensor? seqlens_rotary = None,"
    " Tensor? q_descale = None, Tensor? k_descale = None, Tensor? v_descale = None,"
    " float? softmax_scale = None, bool is_causal = False, int window_size_left = -1,"
    " int window_size_right = -1, int attention_chunk = 0, float softcap = 0.0,"
    " bool is_rotary_interleaved = False, Tensor? scheduler_metadata = None, int num_splits = 0,"
    " bool? pack_gqa = None, int sm_margin = 0) -> (Tensor(out!), Tensor, Tensor, Tensor)"
)
FA3_BWD = (
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse,"
    " Tensor(dq!)? dq = None, Tensor(dk!)? dk = None, Tensor(dv!)? dv = None,"
    " Tensor? cu_seqlens_q = None, Tensor? cu_seqlens_k = None, Tensor? seqused_q = None,"
    " Tensor? seqused_k = None, int? max_seqlen_q = None, int? max_seqlen_k = None,"
    " float? softmax_scale = None, bool is_causal = False, int window_size_left = -1,"
    " int window_size_right = -1, float softcap = 0.0, bool deterministic = False,"
    " int sm_margin = 0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)

T = torch.Tensor
calls: dict[str, int] = {"fwd": 0, "bwd": 0}  # this process's stand-in calls, by direction


def _lse_dtype(q: T) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _sequences(q: T, k: T, cu_q: T | None, cu_k: T | None) -> list[tuple[tuple, tuple]]:
    """Each sequence's query and key index into q and k: ``(b, rows)`` of a dense batch
    ``[B, S, H, D]`` or ``(rows,)`` of packed ``[tokens, H, D]``."""
    if cu_q is None:
        return [((b, slice(None)), (b, slice(None))) for b in range(q.shape[0])]
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return [((slice(bq[i], bq[i + 1]),), (slice(bk[i], bk[i + 1]),)) for i in range(len(bq) - 1)]


def _visible(n: int, m: int, causal: bool, left: int, right: int) -> T:
    """``[n, m]``: which keys each query sees, windows aligned bottom-right."""
    right = 0 if causal else right
    i = torch.arange(n)[:, None] + (m - n)
    j = torch.arange(m)[None, :]
    seen = torch.ones(n, m, dtype=torch.bool)
    if right >= 0:
        seen &= j <= i + right
    if left >= 0:
        seen &= j >= i - left
    return seen


def _logits(qs: T, ks: T, scale: float, softcap: float, seen: T) -> tuple[T, T]:
    """``[H, n, m]`` raw scores ``q k^T * scale`` and the capped, masked logits."""
    raw = (qs @ ks.transpose(-1, -2)) * scale
    logits = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
    return raw, logits.masked_fill(~seen, float("-inf"))


def _heads(t: T, at: tuple, heads: int) -> T:
    """A sequence's ``[rows, Hkv, D]`` as float64 ``[H, rows, D]`` (KV heads repeated)."""
    t = t[at].transpose(0, 1).double()
    return t.repeat_interleave(heads // t.shape[0], dim=0)


def _lse_at(lse: T, at: tuple) -> tuple:
    """The log-sum-exp index of a sequence: ``[B, H, S]`` dense, ``[H, tokens]`` packed."""
    return (at[0], slice(None), slice(None)) if len(at) == 2 else (slice(None), at[0])


def attend(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap) -> tuple[T, T]:
    """The forward: output like q (v's head dim) and the log-sum-exp."""
    heads = q.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse_shape = (q.shape[0], heads, q.shape[1]) if cu_q is None else (heads, q.shape[0])
    lse = torch.full(lse_shape, float("-inf"), dtype=_lse_dtype(q))
    for at_q, at_k in _sequences(q, k, cu_q, cu_k):
        qs, ks, vs = _heads(q, at_q, heads), _heads(k, at_k, heads), _heads(v, at_k, heads)
        seen = _visible(qs.shape[1], ks.shape[1], causal, left, right)
        _, logits = _logits(qs, ks, scale, softcap, seen)
        total = torch.logsumexp(logits, dim=-1)  # -inf where a query sees no key
        probs = torch.exp(logits - total.nan_to_num(neginf=0.0)[..., None])
        out[at_q] = (probs @ vs).transpose(0, 1).to(out.dtype)
        lse[_lse_at(lse, at_q)] = total.to(lse.dtype)
    return out, lse


def attend_backward(
    dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, left, right, softcap
) -> tuple[T, T, T, T]:
    """dq, dk, dv (KV heads summed) and ``D = rowsum(dout * out)`` from the output and
    log-sum-exp given."""
    heads, kv_heads = q.shape[-2], k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v))
    d_rows = (dout.double() * out.double()).sum(-1)  # [.., tokens, H]
    for at_q, at_k in _sequences(q, k, cu_q, cu_k):
        qs, ks, vs = _heads(q, at_q, heads), _heads(k, at_k, heads), _heads(v, at_k, heads)
        g = dout[at_q].transpose(0, 1).double()
        seen = _visible(qs.shape[1], ks.shape[1], causal, left, right)
        raw, logits = _logits(qs, ks, scale, softcap, seen)
        given = lse[_lse_at(lse, at_q)].double()
        probs = torch.exp(logits - given.nan_to_num(neginf=0.0)[..., None])
        dlogits = probs * (g @ vs.transpose(-1, -2) - d_rows[at_q].t()[..., None])
        if softcap > 0:
            dlogits = dlogits * (1 - torch.tanh(raw / softcap) ** 2)
        fold = lambda t: t.view(kv_heads, heads // kv_heads, *t.shape[1:]).sum(1)  # noqa: E731
        dq[at_q] = ((dlogits @ ks) * scale).transpose(0, 1)
        dk[at_k] += fold((dlogits.transpose(-1, -2) @ qs) * scale).transpose(0, 1)
        dv[at_k] += fold(probs.transpose(-1, -2) @ g).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_rows


def _refuse(**unused) -> None:
    """Arguments beyond the contract cpshard uses must be left at their defaults."""
    bad = [
        name
        for name, value in unused.items()
        if isinstance(value, torch.Tensor) or value not in (None, 0, False)
    ]
    if bad:
        raise NotImplementedError(f"the flash stand-in does not implement {bad}")


def _fa3_fwd(
    q, k, v, k_new=None, v_new=None, q_v=None, out=None, cu_seqlens_q=None, cu_seqlens_k=None,
    cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
    page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
    seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
    is_causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
    is_rotary_interleaved=False, scheduler_metadata=None, num_splits=0, pack_gqa=None,
    sm_margin=0,
):  # fmt: skip
    _refuse(
        k_new=k_new, v_new=v_new, q_v=q_v, out=out, cu_seqlens_k_new=cu_seqlens_k_new,
        seqused_q=seqused_q, seqused_k=seqused_k, page_table=page_table,
        kv_batch_idx=kv_batch_idx, leftpad_k=leftpad_k, rotary_cos=rotary_cos,
        q_descale=q_descale, attention_chunk=attention_chunk,
    )  # fmt: skip
    assert (cu_seqlens_q is None) == (max_seqlen_q is None), "max_seqlen_q with cu_seqlens_q"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dims contiguous"
    calls["fwd"] += 1
    o, lse = attend(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap,
    )  # fmt: skip
    return o, lse, q.new_empty(0), q.new_empty(0, dtype=torch.float32)


def _backward_into(into: tuple[T, T, T], *args: object) -> T:
    """:func:`attend_backward` of ``args``, counted, its q / k / v gradients written into the
    caller's buffers ``into`` (as both packages' ops do); returns ``rowsum(dout * out)`` in
    float32 (their ``softmax_d``)."""
    calls["bwd"] += 1
    grads = attend_backward(*args)
    for buffer, g in zip(into, grads[:3], strict=True):
        buffer.copy_(g)
    return grads[3].float()


def _fa3_bwd(
    dout, q, k, v, out, softmax_lse, dq=None, dk=None, dv=None, cu_seqlens_q=None,
    cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
    softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
    deterministic=False, sm_margin=0,
):  # fmt: skip
    _refuse(seqused_q=seqused_q, seqused_k=seqused_k)
    assert softmax_lse.is_contiguous(), "the log-sum-exp is read contiguous"
    softmax_d = _backward_into(
        (dq, dk, dv), dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
        softmax_scale, is_causal, window_size_left, window_size_right, softcap,
    )  # fmt: skip
    e = q.new_empty(0, dtype=torch.float32)
    return softmax_d, e, e.clone(), e.clone(), e.clone()


_FA3_LIB = torch.library.Library(FA3, "DEF")
_FA3_LIB.define(FA3_FWD)
_FA3_LIB.define(FA3_BWD)
_FA3_LIB.impl("fwd", _fa3_fwd, "CPU")
_FA3_LIB.impl("bwd", _fa3_bwd, "CPU")


# The flash-attn package's varlen ops, with its 2.8 Python signatures (custom_op infers the same
# schema from them as the package's).
@torch.library.custom_op(f"{FA2}::_flash_attn_varlen_forward", mutates_args=(), device_types="cpu")
def _fa2_forward(
    q: T, k: T, v: T, cu_seqlens_q: T, cu_seqlens_k: T, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int = -1,
    window_size_right: int = -1, softcap: float = 0.0, alibi_slopes: T | None = None,
    return_softmax: bool = False, block_table: T | None = None, leftpad_k: T | None = None,
    seqused_k: T | None = None, zero_tensors: bool = False,
) -> tuple[T, T, T, T]:  # fmt: skip
    _refuse(alibi_slopes=alibi_slopes, block_table=block_table, leftpad_k=leftpad_k,
            seqused_k=seqused_k, return_softmax=return_softmax)  # fmt: skip
    assert dropout_p == 0.0, "dropout off"
    calls["fwd"] += 1
    o, lse = attend(
        q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal,
        window_size_left, window_size_right, softcap,
    )  # fmt: skip
    return o, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)


@torch.library.custom_op(
    f"{FA2}::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"), device_types="cpu"
)
def _fa2_backward(
    dout: T, q: T, k: T, v: T, out: T, softmax_lse: T, dq: T | None, dk: T | None,
    dv: T | None, cu_seqlens_q: T, cu_seqlens_k: T, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
    window_size_right: int, softcap: float, alibi_slopes: T | None, deterministic: bool,
    rng_state: T | None = None, zero_tensors: bool = False,
) -> T:  # fmt: skip
    _refuse(alibi_slopes=alibi_slopes)
    return _backward_into(
        (dq, dk, dv), dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k,
        softmax_scale, causal, window_size_left, window_size_right, softcap,
    )  # fmt: skip


fa3_ops = getattr(torch.ops, FA3)
fa2_ops = getattr(torch.ops, FA2)
