"""The NeMo Automodel mirror (``cpshard.nemo``) on gloo at W = 1-4: the items of NeMo's
documented behaviour that involve a collective, each against an independent reference written
here.

Every rank builds the same FULL tensors from fixed seeds; its shard is a slice of them, and its
upstream gradient ``U_r`` is seeded by its rank, so the expected gradient of any rank is
computable locally (the sum over ranks of the upstream rows that reach its tokens). Each
``pool.run`` runs a grid of cases and returns the mismatches found; the parent asserts there are
none. One-rank-bad-input cases check that EVERY rank raises (none hangs).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cpshard
from cpshard.nemo.components.distributed import cp_vision_frame_shard as vfs
from cpshard.nemo.components.distributed.blockdiag_cp import batch as bd
from cpshard.nemo.components.distributed.blockdiag_cp import runtime as bd_runtime
from cpshard.nemo.components.distributed.context_parallel import sharder as sh
from cpshard.nemo.components.models.step5 import cp as step5
from tests.helpers import assert_no_mismatches

WORLDS = [1, 2, 3, 4]
F64 = torch.float64
ATOL = 1e-10


def _rand(shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=F64)


def _close(bad: list[str], tag: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        bad.append(f"{tag}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    elif not torch.allclose(got, want, atol=ATOL, rtol=0):
        bad.append(f"{tag}: max error {(got - want).abs().max().item():.3g}")


def _raises_everywhere(bad: list[str], tag: str, exc: type, call, match: str = "") -> None:
    """``call()`` must raise ``exc`` (its message containing ``match``) on this rank (every rank
    runs it)."""
    try:
        call()
    except exc as e:
        if match not in str(e):
            bad.append(f"{tag}: message without {match!r}: {e}")
        return
    except Exception as e:  # noqa: BLE001
        bad.append(f"{tag}: raised {type(e).__name__}: {e}")
        return
    bad.append(f"{tag}: did not raise {exc.__name__}")


# --------------------------------------------------------------------------- step5 transport


def _halo_reference(full: torch.Tensor, world: int, length: int, halo: int, lp: int, rank: int) -> torch.Tensor:
    h = min(rank * length, halo)
    zeros = full.new_zeros(full.shape[0], lp, *full.shape[2:])
    return torch.cat([zeros, full[:, rank * length - h: rank * length], full[:, rank * length:(rank + 1) * length]], 1)


def _halo_grad_reference(world: int, length: int, halo: int, lp: int, rank: int, shape, seed: int) -> torch.Tensor:
    """Rank ``rank``'s gradient: every rank q's upstream rows scattered to the global positions
    they were read from (halo rows included), summed, then rank's slice."""
    total = torch.zeros(shape[0], world * length, *shape[2:], dtype=F64)
    for q in range(world):
        h = min(q * length, halo)
        up = _rand((shape[0], lp + h + length, *shape[2:]), seed + q)
        total[:, q * length - h:(q + 1) * length] += up[:, lp:]
    return total[:, rank * length:(rank + 1) * length]


def _run_step5(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    group = dist.group.WORLD
    b, length, hidden = 2, 5, 3
    full = _rand((b, world * length, hidden), 7)
    mine = full[:, rank * length:(rank + 1) * length]
    # gather_sequence / _GatherSequence: forward = full; grad = sum_q U_q at my positions
    for name, fn in (("gather_sequence", step5.gather_sequence),
                     ("_GatherSequence", step5._GatherSequence.apply)):
        x = mine.clone().requires_grad_(True)
        out = fn(x, group)
        _close(bad, f"W={world} r={rank} {name} forward", out, full)
        out.backward(_rand(out.shape, 100 + rank))
        want = sum(_rand(out.shape, 100 + q) for q in range(world))[:, rank * length:(rank + 1) * length]
        _close(bad, f"W={world} r={rank} {name} grad", x.grad, want)
    meta = step5.gather_metadata(torch.arange(length).repeat(b, 1) + rank * length, group)
    if not torch.equal(meta, torch.arange(world * length).repeat(b, 1)):
        bad.append(f"W={world} r={rank} gather_metadata: {meta.tolist()}")
    # gather_halo / _GatherHalo, windows inside one rank and spanning several
    for halo, lp in ((2, 0), (length, 1), (2 * length + 1, 3), (0, 2)):
        for name, fn in (("gather_halo", step5.gather_halo), ("_GatherHalo", step5._GatherHalo.apply)):
            tag = f"W={world} r={rank} {name}(halo={halo}, left_padding={lp})"
            x = mine.clone().requires_grad_(True)
            out = fn(x, group, halo, lp)
            _close(bad, tag, out, _halo_reference(full, world, length, halo, lp, rank))
            out.backward(_rand(out.shape, 300 + rank))
            _close(bad, f"{tag} grad", x.grad, _halo_grad_reference(world, length, halo, lp, rank, x.shape, 300))
    return bad



# --------------------------------------------------------------------------- vision gathers


def _run_vision_gathers(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    group = dist.group.WORLD
    # _AllGatherSeqDiff along dim 0 and dim 1
    for seq_dim in (0, 1):
        shape = [3, 4]
        shape[seq_dim] = 2
        full = torch.cat([_rand(shape, 20 + q) for q in range(world)], dim=seq_dim)
        x = _rand(shape, 20 + rank).requires_grad_(True)
        out = vfs._AllGatherSeqDiff.apply(x, group, seq_dim)
        _close(bad, f"W={world} r={rank} _AllGatherSeqDiff(seq_dim={seq_dim})", out, full)
        out.backward(_rand(out.shape, 40 + rank))
        total = sum(_rand(out.shape, 40 + q) for q in range(world))
        _close(bad, f"W={world} r={rank} _AllGatherSeqDiff grad", x.grad, total.narrow(seq_dim, 2 * rank, 2))
    # _all_gather_var_tokens: ragged [n_r, H] blocks in rank order, reduce-scatter-v backward
    counts = [(3 * q + 1) % 4 for q in range(world)]  # includes empty blocks
    blocks = [_rand((c, 5), 60 + q) for q, c in enumerate(counts)]
    x = blocks[rank].clone().requires_grad_(True)
    out = vfs._all_gather_var_tokens(x, group, world, counts)
    _close(bad, f"W={world} r={rank} _all_gather_var_tokens", out, torch.cat(blocks))
    out.backward(_rand(out.shape, 80 + rank))
    total = sum(_rand(out.shape, 80 + q) for q in range(world))
    start = sum(counts[:rank])
    _close(bad, f"W={world} r={rank} _all_gather_var_tokens grad", x.grad, total[start:start + counts[rank]])
    # _raise_if_any_rank_failed: nothing when every rank is ok; every rank raises otherwise
    vfs._raise_if_any_rank_failed(True, group, torch.device("cpu"), "unused")
    if world > 1:
        try:
            vfs._raise_if_any_rank_failed(rank != world - 1, group, torch.device("cpu"), "my own detail")
            bad.append(f"W={world} r={rank}: _raise_if_any_rank_failed did not raise")
        except ValueError as e:
            mine = rank == world - 1
            if mine != ("my own detail" in str(e)) or (not mine and str(world - 1) not in str(e)):
                bad.append(f"W={world} r={rank}: unexpected message {e}")
    return bad



# --------------------------------------------------------------------------- maybe_distribute_visual


class RowTower(nn.Module):
    """A frame-independent tower: a row-wise MLP on patch rows, then every ``m*m`` consecutive
    rows merged into one token (and a deepstack level from the hidden rows). Records the rows
    of each call."""

    def __init__(self, m: int = 2, dim: int = 4, hidden: int = 6) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.spatial_merge_size = m
        self.config = SimpleNamespace(hidden_size=hidden)
        self.inp, self.merge = nn.Linear(dim, hidden), nn.Linear(hidden * m * m, 3)
        self.deep = nn.Linear(hidden * m * m, 2)
        self.to(F64)
        self.rows: list[int] = []
        self.drop_token = False

    def forward(self, pixel_values, grid_thw=None, return_dict=True):
        if pixel_values is None:
            self.rows.append(-1)
            return SimpleNamespace(pooler_output=None, deepstack_features=None)
        self.rows.append(pixel_values.shape[0])
        assert grid_thw.device == pixel_values.device and return_dict is True
        h = torch.tanh(self.inp(pixel_values)).reshape(-1, self.merge.in_features)
        pooled = self.merge(h)
        if self.drop_token:
            pooled = pooled[:-1]
        return SimpleNamespace(last_hidden_state=h, pooler_output=pooled, deepstack_features=[self.deep(h)])


def _pack(grid: list[list[int]], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = sum(t * h * w for t, h, w in grid)
    return _rand((rows, 4), seed), torch.tensor(grid, dtype=torch.long)


def _run_visual(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    group = dist.group.WORLD
    on = vfs.CpVisionFrameShardingConfig(enabled=True, min_tokens=0, min_frames=0, min_local_patch_rows=0)
    token = vfs.set_cp_vision_group(group, config=on)
    try:
        tag = f"W={world} r={rank}"
        if vfs.cp_vision_frame_sharding_active() != (world > 1) or cpshard.cp_vision_frame_sharding_active() != (world > 1):
            bad.append(f"{tag}: active flag wrong")
        scope = vfs._CP_VISION_GROUP.get()
        if scope is None or scope.group is not group or scope.config is not on or scope.spans_only_cp is not True:
            bad.append(f"{tag}: the holder does not hand back the published scope: {scope}")
        # equivalence with the replicated call: forward, and summed gradients (what CP training sums)
        for grid in ([[1, 4, 4], [2, 2, 4], [1, 2, 2], [3, 2, 2]], [[2, 4, 2]]):
            tower = RowTower()
            pv, gthw = _pack(grid, 11)
            ref = tower(pv, grid_thw=gthw)
            out = vfs.maybe_distribute_visual(tower, pv, gthw)
            _close(bad, f"{tag} {grid} pooler", out.pooler_output, ref.pooler_output)
            _close(bad, f"{tag} {grid} deepstack", out.deepstack_features[0], ref.deepstack_features[0])
            u, v = _rand(ref.pooler_output.shape, 90 + rank), _rand(ref.deepstack_features[0].shape, 95 + rank)
            grads = torch.autograd.grad((out.pooler_output * u).sum() + (out.deepstack_features[0] * v).sum(),
                                        list(tower.parameters()))
            u_all = sum(_rand(ref.pooler_output.shape, 90 + q) for q in range(world))
            v_all = sum(_rand(ref.deepstack_features[0].shape, 95 + q) for q in range(world))
            want = torch.autograd.grad((ref.pooler_output * u_all).sum() + (ref.deepstack_features[0] * v_all).sum(),
                                       list(tower.parameters()))
            for k, (g, w) in enumerate(zip(grads, want, strict=True)):
                summed = g.detach().clone().contiguous()
                dist.all_reduce(summed)
                _close(bad, f"{tag} {grid} grad[{k}]", summed, w)
        # a rank that runs only a dummy frame keeps it at spatial_merge_size**2 rows (NeMo)
        floor = vfs.CpVisionFrameShardingConfig(enabled=True, min_tokens=0, min_frames=0, min_local_patch_rows=96)
        t2 = vfs.set_cp_vision_group(group, config=floor)
        tower = RowTower()
        pv, gthw = _pack([[1, 4, 4]], 12)  # one frame: ranks 1.. run a dummy frame
        out = vfs.maybe_distribute_visual(tower, pv, gthw)
        _close(bad, f"{tag} one frame", out.pooler_output, tower(pv, grid_thw=gthw).pooler_output)
        # W = 1: the plain call (16 rows); rank 0: its real frame raised to the 96-row floor
        expected_rows = 16 if world == 1 else 96 if rank == 0 else 4
        if tower.rows[0] != expected_rows:
            bad.append(f"{tag}: local call of {tower.rows[0]} rows, expected {expected_rows}")
        vfs.reset_cp_vision_group(t2)
        # the documented fall-backs make no collective: only ONE rank calls (the others do not)
        if rank == 0:
            tower = RowTower()
            plain = vfs.maybe_distribute_visual(tower, None, None)
            if plain.pooler_output is not None or tower.rows != [-1]:
                bad.append(f"{tag}: no-media call was not the plain call")
            small = vfs.CpVisionFrameShardingConfig(enabled=True)  # 2048 tokens / 32 frames minimum
            t3 = vfs.set_cp_vision_group(group, config=small)
            pv, gthw = _pack([[1, 4, 4]], 13)
            vfs.maybe_distribute_visual(tower, pv, gthw)
            if tower.rows[-1] != 16:
                bad.append(f"{tag}: small workload did not run replicated ({tower.rows})")
            vfs.reset_cp_vision_group(t3)
        dist.barrier()
        if world > 1:
            # trainable tower over a group declared not CP-only: ValueError on every rank
            t4 = vfs.set_cp_vision_group(group, config=on, spans_only_cp=False)
            pv, gthw = _pack([[1, 4, 4], [1, 4, 4]], 14)
            _raises_everywhere(bad, f"{tag} spans_only_cp=False", ValueError,
                               lambda: vfs.maybe_distribute_visual(RowTower(), pv, gthw))
            vfs.reset_cp_vision_group(t4)
            # one rank's tower returns one token too few: every rank raises ValueError
            tower = RowTower()
            tower.drop_token = rank == world - 1
            pv, gthw = _pack([[1, 4, 4]] * world, 15)
            _raises_everywhere(bad, f"{tag} token mismatch", ValueError,
                               lambda: vfs.maybe_distribute_visual(tower, pv, gthw), match="cp_vision_frame_shard")
        # the top-level API publishes into the same holder
        with cpshard.cp_vision_group(group, config=on):
            seen = vfs._CP_VISION_GROUP.get()
            if seen is None or seen.group is not group or seen.config is not on:
                bad.append(f"{tag}: cpshard's scope not seen by the mirror holder: {seen}")
            if vfs._CP_VISION_GROUP.get() is not seen:
                bad.append(f"{tag}: the mirror view of one scope is not stable")
    finally:
        vfs.reset_cp_vision_group(token)
    if vfs._CP_VISION_GROUP.get() is not None or cpshard.current_cp_vision_scope() is not None:
        bad.append(f"W={world} r={rank}: the scope was not restored")
    return bad



# --------------------------------------------------------------------------- block-diagonal batch


def _run_blockdiag(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    group = dist.group.WORLD
    b, s, hidden = 2, 7, 3
    padded = -(-s // world) * world
    local = padded // world
    lo, hi = rank * local, (rank + 1) * local
    embeds = _rand((b, s, hidden), 3)
    doc = torch.tensor([[1, 1, 1, 2, 2, 0, 3], [1, 1, 1, 1, 1, 1, 1]])
    labels = torch.arange(b * s).reshape(b, s)
    pad = padded - s

    def ref(t, value, dim=1):
        """``t`` padded along ``dim`` with ``value``, then this rank's contiguous slice."""
        extra = list(t.shape)
        extra[dim] = pad
        return torch.cat([t, torch.full(extra, value, dtype=t.dtype)], dim).narrow(dim, lo, local)

    for mrope in (False, True):
        pos = torch.arange(10, 10 + s).expand(b, s)
        pos = pos.expand(3, b, s) if mrope else pos
        x = embeds.clone().requires_grad_(True)
        loss_mask = torch.ones(b, s)
        batch = {"inputs_embeds": x, "labels": labels, "position_ids": pos, "_packed_seq_ids": doc,
                 "attention_mask": doc != 0}
        ctx, out = bd.make_cp_blockdiag_batch_and_ctx(group, None, batch, loss_mask=loss_mask)
        tag = f"W={world} r={rank} mrope={mrope}"
        _close(bad, f"{tag} inputs_embeds", out["inputs_embeds"], ref(embeds, 0.0))
        checks = {
            "labels": ref(labels, -100),
            "position_ids": ref(pos, 0, dim=pos.dim() - 1),  # NeMo: padded positions are 0
            "loss_mask": ref(loss_mask, 0.0),
            "padding_mask": ref(doc == 0, True),
            "_packed_seq_ids": ref(doc, 0),
        }
        for key, want in checks.items():
            if not torch.equal(out[key], want):
                bad.append(f"{tag} {key}: {out[key].tolist()} != {want.tolist()}")
        if "attention_mask" in out:
            bad.append(f"{tag}: attention_mask kept")
        out["inputs_embeds"].sum().backward()  # differentiable slice
        want = torch.zeros_like(embeds)
        want[:, lo:min(hi, s)] = 1
        _close(bad, f"{tag} inputs_embeds grad", x.grad, want)
        with ctx():
            if cpshard.attention.active_state() is None:
                bad.append(f"{tag}: train_ctx() did not activate the block-diagonal state")
            _check_sdpa(bad, tag, rank, out["padding_mask"], padded, lo, local)
    return bad


def _check_sdpa(bad: list[str], tag: str, rank: int, pad_rows: torch.Tensor, padded: int, lo: int,
                local: int) -> None:
    """The mirror's ``cp_blockdiag_sdpa`` under an active state: cpshard's attention on document
    rows, the row's own value on pad rows (GQA: the value head of its group); ``attn_mask`` and
    extra keywords ignored; the backward runs (a collective) on every rank."""
    heads, kv_heads, d = 4, 2, 3
    full = [_rand((pad_rows.shape[0], h, padded, d), 30 + i) for i, h in enumerate((heads, kv_heads, kv_heads))]
    q, k, v = (t[:, :, lo:lo + local].clone().requires_grad_(True) for t in full)
    got = bd_runtime.cp_blockdiag_sdpa(q, k, v, attn_mask=torch.zeros(1, dtype=torch.bool), enable_gqa=True,
                                       position_ids=None, cu_seqlens=None)
    want = cpshard.cp_blockdiag_sdpa(q.detach(), k.detach(), v.detach(), enable_gqa=True)
    own = v.detach().repeat_interleave(heads // kv_heads, dim=1)
    want = torch.where(pad_rows[:, None, :, None], own, want)
    _close(bad, f"{tag} runtime cp_blockdiag_sdpa", got, want)
    got.sum().backward()
    if v.grad is None:
        bad.append(f"{tag}: no gradient reached v")



# --------------------------------------------------------------------------- the sharder


def _round_robin_positions(world: int, padded: int, rank: int) -> list[int]:
    """torch context_parallel load balancing: 2W chunks, rank r owns chunks r and 2W-1-r."""
    size = padded // (2 * world)
    return [p for p in range(padded) if p // size in (rank, 2 * world - 1 - rank)]


def _run_sharder(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    b, s = 2, 11
    ids = torch.arange(100, 100 + b * s).reshape(b, s)
    tag = f"W={world} r={rank}"

    # resolution form: round-robin (head_tail with 2W chunks) at W > 1, identity at W = 1
    batch = {"input_ids": ids, "labels": ids + 1}
    sharder = sh.ContextParallelSharder(device_mesh=mesh, batch=batch, padding_token_id=7, num_chunks=1)
    ctx, out = sharder.shard(dict(batch))
    lay = sharder.shard_layout
    padded = s if world == 1 else -(-s // (2 * world)) * 2 * world
    mine = torch.tensor(_round_robin_positions(world, padded, rank) if world > 1 else list(range(s)))
    full_ids = torch.cat([ids, torch.full((b, padded - s), 7)], 1)
    if not torch.equal(out["input_ids"], full_ids[:, mine]):
        bad.append(f"{tag} resolution shard: {out['input_ids'].tolist()}")
    if (lay.original_seq_len, lay.padded_seq_len, lay.local_token_global_indices) != (s, padded, None):
        bad.append(f"{tag} resolution layout: {lay}")
    fn = sharder.local_token_global_indices
    if fn is None or not torch.equal(fn(sharder._cp_mesh, padded, "cpu"), mine):
        bad.append(f"{tag}: local_token_global_indices is not the closed-form round-robin map")
    if not torch.equal(sharder._indices(padded, "cpu"), mine):
        bad.append(f"{tag}: _indices")
    x = _rand((b, s, 2), 5).requires_grad_(True)
    local = sharder.shard_token_tensor(x, fill=0.0)
    full = torch.cat([x.detach(), torch.zeros(b, padded - s, 2, dtype=F64)], 1)
    _close(bad, f"{tag} shard_token_tensor", local, full[:, mine])
    back = sharder.gather_token_tensor(local, trim=True)
    _close(bad, f"{tag} gather_token_tensor(trim=True)", back, x.detach())
    back.backward(_rand(back.shape, 50 + rank))
    held = torch.zeros(s, dtype=torch.bool)  # x's gradient reaches the positions this rank holds
    held[mine[mine < s]] = True
    total = sum(_rand(back.shape, 50 + q) for q in range(world))
    _close(bad, f"{tag} round-trip grad", x.grad, torch.where(held[None, :, None], total, 0.0))
    with ctx():
        pass

    # direct form: a custom shard_batch reporting this rank's own 1-D indices (stripes)
    def shard_stripes(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0):
        p = -(-batch["input_ids"].shape[1] // world) * world
        own = torch.arange(rank, p, world)
        ids_full = F.pad(batch["input_ids"], (0, p - batch["input_ids"].shape[1]), value=padding_token_id)
        lay = sh.ShardLayout(local_token_global_indices=own, original_seq_len=batch["input_ids"].shape[1],
                             padded_seq_len=p)
        return (lambda: torch.no_grad()), {"input_ids": ids_full[:, own]}, lay

    direct = sh.ContextParallelSharder(device_mesh=mesh, shard_batch=shard_stripes, padding_token_id=3)
    if direct._cp_mesh is None or direct.local_token_global_indices is not None:
        bad.append(f"{tag} direct form attributes")
    _raises_everywhere(bad, f"{tag} verbs before the first shard", NotImplementedError,
                       lambda: direct.shard_token_tensor(ids))
    _, out = direct.shard({"input_ids": ids})
    p = -(-s // world) * world
    own = torch.arange(rank, p, world)
    if direct.shard_layout.local_token_global_indices is None or not torch.equal(out["input_ids"], F.pad(ids, (0, p - s), value=3)[:, own]):
        bad.append(f"{tag} direct shard")
    y = _rand((b, s), 8).requires_grad_(True)
    part = direct.shard_token_tensor(y, fill=0.0)
    _close(bad, f"{tag} direct shard_token_tensor", part, F.pad(y.detach(), (0, p - s))[:, own])
    whole = direct.gather_token_tensor(part, trim=True)
    _close(bad, f"{tag} direct gather(trim)", whole, y.detach())
    whole.backward(_rand(whole.shape, 70 + rank))
    held = torch.zeros(s, dtype=torch.bool)
    held[own[own < s]] = True
    total = sum(_rand(whole.shape, 70 + q) for q in range(world))
    _close(bad, f"{tag} direct grad", y.grad, torch.where(held[None, :], total, 0.0))

    _check_thd_and_repositioned(bad, tag, rank, world, mesh)

    # resolution through the model-owned block-diagonal hook: contiguous layout
    emb = _rand((b, s, 2), 9)
    hooked = {"inputs_embeds": emb, "_cp_make_batch_fn": bd.make_cp_blockdiag_batch_and_ctx}
    sharder = sh.ContextParallelSharder(device_mesh=mesh, batch=hooked)
    ctx, out = sharder.shard(hooked)
    if world > 1:
        p = -(-s // world) * world
        lo = rank * (p // world)
        want = torch.cat([emb, torch.zeros(b, p - s, 2, dtype=F64)], 1)[:, lo:lo + p // world]
        _close(bad, f"{tag} hook shard", out["inputs_embeds"], want)
        _close(bad, f"{tag} hook gather(trim)", sharder.gather_token_tensor(out["inputs_embeds"], trim=True), emb)
        with ctx():
            if cpshard.attention.active_state() is None:
                bad.append(f"{tag}: the hook's train_ctx did not activate its state")
        # THD batches have no cpshard backend
        _raises_everywhere(bad, f"{tag} THD", NotImplementedError,
                           lambda: sh.ContextParallelSharder(device_mesh=mesh, batch={"qkv_format": "thd"}))
    return bad



def _run_one_rank_bad_shard(rank: int, world: int) -> list[str]:
    """A per-step entry point keeps its consensus: one rank's bad batch makes every rank raise."""
    bad: list[str] = []
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    s = 9 if rank != world - 1 else 8
    batch = {"input_ids": torch.ones(1, s, dtype=torch.long)}
    sharder = sh.ContextParallelSharder(device_mesh=mesh, batch=batch)
    _raises_everywhere(bad, f"W={world} r={rank} shard with one rank's length off", ValueError,
                       lambda: sharder.shard(batch))
    dist.barrier()  # the group still works
    return bad


def _check_thd_and_repositioned(bad: list[str], tag: str, rank: int, world: int, mesh) -> None:
    """Direct-form NeMo layouts in the caller's coordinates: a THD stream (``input_row_shape``:
    ``[B, S]`` rows flattened into one stream, this rank's stripes of it) and a repositioned
    layout (``input_token_stream_positions``: input position -> padded column, -1 dropped)."""
    b, s = 2, 5
    p = -(-(b * s) // world) * world
    own = torch.arange(rank, p, world)
    thd = sh.ShardLayout(local_token_global_indices=own, padded_seq_len=p, input_row_shape=(b, s))
    sharder = sh.ContextParallelSharder(device_mesh=mesh, shard_batch=lambda *a, **k: (None, {}, thd))
    sharder.shard({})
    t = _rand((b, s, 2), 21)
    local = sharder.shard_token_tensor(t, fill=0.0)  # NeMo's stream coordinate: [L, 2]
    _close(bad, f"{tag} THD shard", local, torch.cat([t.reshape(b * s, 2), torch.zeros(p - b * s, 2, dtype=F64)])[own])
    _close(bad, f"{tag} THD gather(trim)", sharder.gather_token_tensor(local, seq_dim=0, trim=True), t)

    positions = torch.tensor([[0, 1, -1, 2, 3], [4, -1, 5, 6, 7]])  # two dropped pad slots
    cols = -(-8 // world) * world
    own = torch.arange(rank * cols // world, (rank + 1) * cols // world)
    moved = sh.ShardLayout(local_token_global_indices=own, padded_seq_len=cols, input_token_stream_positions=positions)
    sharder = sh.ContextParallelSharder(device_mesh=mesh, shard_batch=lambda *a, **k: (None, {}, moved))
    sharder.shard({})
    x = torch.arange(10.0, 20.0, dtype=F64).reshape(b, s)
    _raises_everywhere(bad, f"{tag} repositioned shard without fill", ValueError, lambda: sharder.shard_token_tensor(x))
    padded = torch.full((b, cols), -1.0, dtype=F64)
    for row in range(b):
        keep = positions[row] >= 0
        padded[row, positions[row][keep]] = x[row][keep]
    local = sharder.shard_token_tensor(x, fill=-1.0)
    _close(bad, f"{tag} repositioned shard", local, padded[:, own])
    _raises_everywhere(bad, f"{tag} repositioned trim without fill", ValueError,
                       lambda: sharder.gather_token_tensor(local, trim=True))
    back = sharder.gather_token_tensor(local, trim=True, fill=-5.0)
    _close(bad, f"{tag} repositioned gather(trim)", back, torch.where(positions >= 0, x, -5.0))


class _DuckMesh:
    """NeMo's duck-typed CP mesh over ``group``: ``get_group()``, ``size()``, ``get_local_rank()``."""

    def __init__(self, group, size: int, rank: int) -> None:
        self._group, self._size, self._rank = group, size, rank

    def get_group(self):
        return self._group

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def _run_duck_meshes(rank: int, world: int) -> list[str]:
    """A duck-typed mesh shards exactly like its process group; one whose size() is not its
    group's raises on every rank."""
    bad: list[str] = []
    b, s = 1, 7
    padded = -(-s // world) * world
    local = padded // world
    embeds = _rand((b, s, 2), 11)
    doc = torch.tensor([[1, 1, 2, 2, 2, 3, 0]])
    block = torch.ones(b, 1, s, s, dtype=torch.bool).tril()  # disagrees with doc: ignored
    batch = {"inputs_embeds": embeds.clone(), "_packed_seq_ids": doc, "attention_mask": block}
    _, out = bd.make_cp_blockdiag_batch_and_ctx(_DuckMesh(dist.group.WORLD, world, rank), None, batch)
    full = torch.cat([embeds, torch.zeros(b, padded - s, 2, dtype=F64)], 1)
    _close(bad, f"W={world} r={rank} duck inputs_embeds", out["inputs_embeds"], full[:, rank * local:(rank + 1) * local])
    pad = torch.cat([doc == 0, torch.ones(b, padded - s, dtype=torch.bool)], 1)[:, rank * local:(rank + 1) * local]
    if not torch.equal(out["padding_mask"], pad):
        bad.append(f"W={world} r={rank} duck padding_mask: {out['padding_mask'].tolist()} != {pad.tolist()}")
    idx = torch.arange(rank * 3, rank * 3 + 3)
    sharder = sh.ContextParallelSharder(
        device_mesh=_DuckMesh(dist.group.WORLD, world, rank),
        shard_batch=lambda *a, **k: (None, {}, None), shard_layout=sh.ShardLayout(local_token_global_indices=idx),
    )
    if world > 1 and not torch.equal(sharder._indices(3 * world, None), idx):
        bad.append(f"W={world} r={rank} duck sharder indices")
    if world > 1:
        _raises_everywhere(bad, f"W={world} r={rank} duck size", ValueError,
                           lambda: bd.make_cp_blockdiag_batch_and_ctx(
                               _DuckMesh(dist.group.WORLD, world + 1, rank), None, {"inputs_embeds": embeds.clone()}),
                           match=f"rank {rank}: cp_mesh.get_group() has {world} ranks")
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_sharder_shard_raises_on_every_rank(pools, world):
    assert_no_mismatches(pools(world).run(_run_one_rank_bad_shard, timeout=60))


RANK_CASES = [(_run_step5, 120), (_run_vision_gathers, 60), (_run_visual, 120), (_run_blockdiag, 60),
              (_run_sharder, 120), (_run_duck_meshes, 60)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", RANK_CASES, ids=lambda c: c[0].__name__.removeprefix("_run_"))
def test_on_ranks(pools, case, world):
    """Every area's grid of cases on one spawned group of ``world`` ranks."""
    fn, timeout = case
    assert_no_mismatches(pools(world).run(fn, timeout=timeout))
