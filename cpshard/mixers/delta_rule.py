"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) over a step's runs, with every
document's state carried across ranks.

Per head, with state ``S`` (``d_k x d_v``), decay ``a_t = exp(g_t)`` and rate ``b_t``:
``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` and ``o_t = S_t^T q_t`` (``q`` scaled
by ``d_k^-1/2``; ``q`` and ``k`` optionally L2-normalised first). Each run (one document's
positions on this rank) is cut into chunks that never cross a document start
(:mod:`cpshard.mixers.chunks`); within a chunk the rule is solved in closed form (the WY / UT
representation: one unit-lower-triangular solve), across chunks a scan carries ``S``. Padding
inside a run's last chunk has ``k = v = b = g = 0``: it leaves the state untouched.

The end state is affine in the start state: ``S_end = T S_0 + E``. A run's transition ``T``
(``d_k x d_k`` per head) is the rule run from ``S_0 = I`` with ``v = 0``; with ``E`` from a zero
start it is what :func:`cpshard.mixers.carry.carry_states` composes across ranks.
"""

from __future__ import annotations

import torch

from cpshard.comm import Group
from cpshard.guard.reach import note_cpshard_mixing
from cpshard.mixers.carry import carry_states
from cpshard.mixers.chunks import ChunkTable, from_chunks, run_table, to_chunks
from cpshard.mixers.runs import RecurrenceRuns

L2_EPS = 1e-6  # the L2 normalisation's epsilon (flash-linear-attention's and transformers')


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """``x`` over its L2 norm along the last dim, with :data:`L2_EPS` inside the root."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def chunked_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    table: ChunkTable,
    initial: torch.Tensor | None,
    want_output: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The rule over the table's runs. ``q``, ``k`` ``[B, L, H, d_k]`` (already normalised,
    scaled, heads repeated), ``v`` ``[B, L, H, d_v]``, ``g``, ``beta`` ``[B, L, H]``, one
    working dtype; ``initial`` ``[R, H, d_k, d_v]`` or None (zeros). Returns (``o``
    ``[B * L, H, d_v]`` — zeros outside the runs — or None, end states ``[R, H, d_k, d_v]``)."""
    b, length = q.shape[:2]
    heads, dk, dv = v.shape[2], q.shape[-1], v.shape[-1]
    qc, kc, vc = (to_chunks(t, table).transpose(1, 2) for t in (q, k, v))  # [N, H, C, d]
    gc, bc = (to_chunks(t, table).transpose(1, 2) for t in (g, beta))  # [N, H, C]
    chunk = qc.shape[2]
    cum = gc.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb, vb = kc * bc[..., None], vc * bc[..., None]
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    system = ((kb @ kc.transpose(-1, -2)) * decay).masked_fill(~strict, 0.0)
    system = system + torch.eye(chunk, dtype=q.dtype, device=q.device)
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, kb * cum.exp()[..., None], upper=False, unitriangular=True
    )
    attn = (qc @ kc.transpose(-1, -2)) * decay  # causal, diagonal included
    q_read = qc * cum.exp()[..., None]
    k_write = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [N, H, 1, 1]

    state = (
        initial
        if initial is not None
        else q.new_zeros(table.runs, heads, dk, dv)
    )
    outs = []
    for chunks, runs in table.steps:
        s = state.index_select(0, runs)
        fresh = u.index_select(0, chunks) - w.index_select(0, chunks) @ s
        if want_output:
            outs.append(q_read.index_select(0, chunks) @ s + attn.index_select(0, chunks) @ fresh)
        s = s * chunk_decay.index_select(0, chunks) + (
            k_write.index_select(0, chunks).transpose(-1, -2) @ fresh
        )
        state = state.index_copy(0, runs, s)
    if not want_output:
        return None, state
    return from_chunks(outs, table, b * length, v), state


def _check(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    runs: RecurrenceRuns,
) -> None:
    """Raise ``ValueError`` naming the argument and the rank when the shapes do not fit the
    step's shard (the chunk tables index this rank's ``[B, L]`` tokens: another length would be
    read wrongly, not refused; the same arguments on every rank raise alike, before any
    transfer)."""
    where = f"cpshard CP gated delta rule: rank {runs.rank}"
    shard = (runs.batch_size, runs.local_len)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4 or tuple(t.shape[:2]) != shard:
            raise ValueError(
                f"{where}: {name} must be [B, L, heads, head_dim] with [B, L] = {list(shard)} "
                f"(this rank's shard), got {tuple(t.shape)}"
            )
    if query.shape != key.shape:
        raise ValueError(
            f"{where}: query and key must have one shape, got {tuple(query.shape)} and "
            f"{tuple(key.shape)}"
        )
    heads = value.shape[2]
    if heads % key.shape[2]:
        raise ValueError(
            f"{where}: value's {heads} heads must be a multiple of key's {key.shape[2]}"
        )
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (*shard, heads):
            raise ValueError(f"{where}: {name} must be {(*shard, heads)}, got {tuple(t.shape)}")


def cp_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    runs: RecurrenceRuns,
    group: Group,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The gated delta rule over this rank's shard of a CP step: every document from a zero
    state, documents that continue from other ranks from the state those ranks leave.

    ``query``, ``key`` ``[B, L, H_k, d_k]``, ``value`` ``[B, L, H_v, d_v]`` (``H_v`` a multiple
    of ``H_k``), ``g`` (log decay) and ``beta`` ``[B, L, H_v]``. Returns ``[B, L, H_v, d_v]`` in
    ``value``'s dtype (computed in float32 at least). Collective over ``group`` when a document
    spans ranks (every rank calls it alike). Raises ``ValueError`` (naming the argument and the
    rank) for shapes that are not this rank's shard."""
    _check(query, key, value, g, beta, runs)
    note_cpshard_mixing()
    out_dtype = value.dtype
    work = torch.promote_types(value.dtype, torch.float32)
    b, length, hk, _ = key.shape
    hv = value.shape[2]
    q, k, v, gg, bb = (t.to(work) for t in (query, key, value, g, beta))
    if hv != hk:
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    if use_qk_l2norm:
        q, k = l2_normalise(q), l2_normalise(k)
    q = q * q.shape[-1] ** -0.5
    device = q.device
    initial, tie = None, None
    if runs.carries:
        exported = run_table(runs, "exported", device)
        middle = run_table(runs, "middle", device)
        _, ends = chunked_delta_rule(q, k, v, gg, bb, exported, None, want_output=False)
        dk = k.shape[-1]
        eye = torch.eye(dk, dtype=work, device=device).expand(middle.runs, hv, dk, dk)
        _, transitions = chunked_delta_rule(
            q, k, torch.zeros_like(k), gg, bb, middle, eye.contiguous(), want_output=False
        )
        initial, tie = carry_states(runs, group, ends, transitions, lambda t, s: t @ s, v)
    out, _ = chunked_delta_rule(q, k, v, gg, bb, run_table(runs, "all", device), initial)
    if tie is not None:
        out = out + tie
    return out.view(b, length, hv, -1).to(out_dtype)
