"""The gated delta rule (Gated DeltaNet: Qwen3.5, Qwen3-Next) over a step's runs, with every
document's state carried across ranks.

Per head, with state ``S`` (``d_k x d_v``), decay ``a_t = exp(g_t)`` and rate ``b_t``:
``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` and ``o_t = S_t^T q_t`` (``q`` scaled
by ``d_k^-1/2``; ``q`` and ``k`` optionally L2-normalised first). Each run (one document's
positions on this rank) is cut into chunks of ``chunk_size`` tokens that never cross a document
start; within a chunk the rule is solved in closed form (the WY / UT representation: one
unit-lower-triangular solve), across chunks a scan carries ``S``. Chunks of all runs are
computed together; the scan steps through chunk ``j`` of every run at once. Padding inside a
run's last chunk has ``k = v = b = g = 0``: it leaves the state untouched.

The end state is affine in the start state: ``S_end = T S_0 + E``. A run's transition ``T``
(``d_k x d_k`` per head) is the rule run from ``S_0 = I`` with ``v = 0``; with ``E`` from a zero
start it is what :func:`cpshard.mixers.carry.carry_states` composes across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.comm import Group
from cpshard.mixers.carry import carry_states
from cpshard.mixers.runs import RecurrenceRuns, Run

CHUNK = 64
L2_EPS = 1e-6  # the L2 normalisation's epsilon (flash-linear-attention's and transformers')


@dataclass(frozen=True)
class ChunkTable:
    """Where the chunks of a set of runs come from (host work, once per step and run set).

    ``tokens``: ``[N, C]`` flat token index (``row * L + position``) of each chunk slot, the pad
    index ``B * L`` after a run's end; ``steps[j]``: ``(chunks, runs)``, chunk ``j`` of every run
    that has one, and those runs' indices; ``valid``: the flattened slots that hold tokens and
    ``targets`` their token indices (for the scatter back)."""

    tokens: torch.Tensor
    steps: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    valid: torch.Tensor
    targets: torch.Tensor
    runs: int

    def to(self, device: torch.device) -> ChunkTable:
        if self.tokens.device == device:
            return self
        return ChunkTable(
            self.tokens.to(device),
            tuple((c.to(device), r.to(device)) for c, r in self.steps),
            self.valid.to(device),
            self.targets.to(device),
            self.runs,
        )


def chunk_table(runs: tuple[Run, ...], local_len: int, batch_size: int, chunk: int) -> ChunkTable:
    pad = batch_size * local_len
    slots, per_run = [], []
    for run in runs:
        count = -(-run.n // chunk)
        per_run.append(count)
        base = run.row * local_len + run.q
        for c in range(count):
            start = c * chunk
            width = min(chunk, run.n - start)
            slots.append(list(range(base + start, base + start + width)) + [pad] * (chunk - width))
    tokens = torch.tensor(slots, dtype=torch.int64).reshape(-1, chunk)
    first = [0]
    for count in per_run[:-1]:
        first.append(first[-1] + count)
    steps = []
    for j in range(max(per_run, default=0)):
        live = [i for i, count in enumerate(per_run) if count > j]
        steps.append(
            (
                torch.tensor([first[i] + j for i in live], dtype=torch.int64),
                torch.tensor(live, dtype=torch.int64),
            )
        )
    flat = tokens.flatten()
    valid = torch.nonzero(flat != pad).flatten()
    return ChunkTable(tokens, tuple(steps), valid, flat[valid], len(runs))


def l2_normalise(x: torch.Tensor) -> torch.Tensor:
    """``x`` over its L2 norm along the last dim, with :data:`L2_EPS` inside the root."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def _chunks(x: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """``[B, L, ...]`` -> ``[N, C, ...]`` by the table (zeros in padding slots)."""
    flat = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
    return flat[table.tokens]


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
    qc, kc, vc = (_chunks(t, table).transpose(1, 2) for t in (q, k, v))  # [N, H, C, d]
    gc, bc = (_chunks(t, table).transpose(1, 2) for t in (g, beta))  # [N, H, C]
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
    outs, order = [], []
    for chunks, runs in table.steps:
        s = state.index_select(0, runs)
        fresh = u.index_select(0, chunks) - w.index_select(0, chunks) @ s
        if want_output:
            outs.append(q_read.index_select(0, chunks) @ s + attn.index_select(0, chunks) @ fresh)
            order.append(chunks)
        s = s * chunk_decay.index_select(0, chunks) + (
            k_write.index_select(0, chunks).transpose(-1, -2) @ fresh
        )
        state = state.index_copy(0, runs, s)
    if not want_output:
        return None, state
    if not outs:  # no runs on this rank (padding only)
        return q.new_zeros(b * length, heads, dv) + v.sum() * 0, state
    done = torch.cat(outs)  # [N, H, C, dv] in step order
    slots = torch.empty_like(torch.cat(order))
    slots[torch.cat(order)] = torch.arange(len(slots), device=slots.device)
    per_slot = done.index_select(0, slots).transpose(1, 2).reshape(-1, heads, dv)
    out = q.new_zeros(b * length, heads, dv).index_copy(
        0, table.targets, per_slot.index_select(0, table.valid)
    )
    return out, state


def _table(runs: RecurrenceRuns, which: str, device: torch.device) -> ChunkTable:
    """The chunk table of this rank's runs (``"all"``), its exported runs (``"exported"``) or
    the exported runs that continue their document (``"middle"``), cached for the step."""
    key = (which, device)
    table = runs._tables.get(key)
    if table is None:
        host = runs._tables.get((which, None))
        if host is None:
            host = runs._tables[(which, None)] = chunk_table(
                _select(runs, which), runs.local_len, runs.batch_size, CHUNK
            )
        table = runs._tables[key] = host.to(device)
    return table


def _select(runs: RecurrenceRuns, which: str) -> tuple[Run, ...]:
    mine = runs.mine
    if which == "all":
        return mine
    exported = [mine[i] for i in runs.exported[runs.rank]]
    return tuple(exported if which == "exported" else [r for r in exported if r.incoming])


def cp_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    runs: RecurrenceRuns,
    group: Group,
    use_qkl2_normalise: bool = True,
) -> torch.Tensor:
    """The gated delta rule over this rank's shard of a CP step: every document from a zero
    state, documents that continue from other ranks from the state those ranks leave.

    ``query``, ``key`` ``[B, L, H_k, d_k]``, ``value`` ``[B, L, H_v, d_v]`` (``H_v`` a multiple
    of ``H_k``), ``g`` (log decay) and ``beta`` ``[B, L, H_v]``. Returns ``[B, L, H_v, d_v]`` in
    ``value``'s dtype (computed in float32 at least). Collective over ``group`` when a document
    spans ranks (every rank calls it alike)."""
    out_dtype = value.dtype
    work = torch.promote_types(value.dtype, torch.float32)
    b, length, hk, _ = key.shape
    hv = value.shape[2]
    q, k, v, gg, bb = (t.to(work) for t in (query, key, value, g, beta))
    if hv != hk:
        q, k = (t.repeat_interleave(hv // hk, dim=2) for t in (q, k))
    if use_qkl2_normalise:
        q, k = l2_normalise(q), l2_normalise(k)
    q = q * q.shape[-1] ** -0.5
    device = q.device
    initial, tie = None, None
    if runs.carries:
        exported = _table(runs, "exported", device)
        middle = _table(runs, "middle", device)
        _, ends = chunked_delta_rule(q, k, v, gg, bb, exported, None, want_output=False)
        dk = k.shape[-1]
        eye = torch.eye(dk, dtype=work, device=device).expand(middle.runs, hv, dk, dk)
        _, transitions = chunked_delta_rule(
            q, k, torch.zeros_like(k), gg, bb, middle, eye.contiguous(), want_output=False
        )
        starts, tie = carry_states(runs, group, ends, transitions, lambda t, s: t @ s, v)
        if starts:
            zero = ends.new_zeros(ends.shape[1:])
            initial = torch.stack([starts.get(i, zero) for i in range(len(runs.mine))])
    out, _ = chunked_delta_rule(q, k, v, gg, bb, _table(runs, "all", device), initial)
    if tie is not None:
        out = out + tie
    return out.view(b, length, hv, -1).to(out_dtype)
