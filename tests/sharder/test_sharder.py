"""ContextParallelSharder (``cpshard.sharder``) on gloo at world sizes 1-4.

Every rank builds the same FULL tensors from fixed seeds, and every result is compared with an
independent reference written here in plain PyTorch:

* the positions of each rank come from a token-by-token definition of the closed-form layouts
  (``_ref_owner``), or, for data-dependent layouts, from the indices the layout carries once
  they are checked to partition the padded rows (``tests/layouts/test_layouts.py`` checks those
  against their own definitions);
* shard: the caller's tensor padded by hand (``fill`` / the batch conventions) then indexed with
  the rank's positions; un-shard: the caller's tensor itself (``trim=True``) or its padded form;
* gradients (float64): for ``loss = sum_q <gather(shard(x)), w_q>`` the gradient of rank r's
  ``x`` is ``sum_q w_q`` at the positions rank r holds, 0 elsewhere.

Each rank of a pool runs a whole grid of cases per ``pool.run`` and returns the mismatches it
found; the parent asserts there are none. Error cases check that EVERY rank raises a clear error
(no hang) when only one rank's input is bad.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import pytest
import torch
import torch.distributed as dist

from cpshard import check_mode, comm
from cpshard.layouts import ShardLayout, make_layout
from cpshard.sharder import ContextParallelSharder
from tests.helpers import assert_no_mismatches, per_document_positions

WORLDS = [1, 2, 3, 4]
F64, F32, BF16, I64 = torch.float64, torch.float32, torch.bfloat16, torch.int64
ATOL = 1e-10
B, S, H = 2, 13, 3

# --------------------------------------------------------------------------- references


def _rand(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    if not dtype.is_floating_point:
        return torch.randint(1, 1000, tuple(shape), generator=gen, dtype=dtype)
    return torch.randn(tuple(shape), generator=gen, dtype=F64).to(dtype)


def _ref_owner(name: str, world: int, padded: int, chunks: int | None) -> torch.Tensor:
    """[P]: owner of each position, token by token (contiguous / stripe / serpentine chunks)."""
    if name == "contiguous":
        return torch.tensor([p // (padded // world) for p in range(padded)], dtype=I64)
    if name == "stripe":
        return torch.tensor([p % world for p in range(padded)], dtype=I64)
    chunks = chunks or 2 * world
    deal = []
    while len(deal) < chunks:
        deal += list(range(world)) if len(deal) // world % 2 == 0 else list(reversed(range(world)))
    return torch.tensor([deal[p // (padded // chunks)] for p in range(padded)], dtype=I64)


def _owner_of(sharder: ContextParallelSharder, spec: tuple) -> torch.Tensor:
    """[P] or [B, P] owners of the sharder's current layout, checked to be a partition."""
    lay = sharder.shard_layout
    name, chunks = spec
    if lay.local_token_global_indices is None:
        return _ref_owner(name, lay.world_size, lay.padded_seq_len, chunks)
    idx = lay.local_token_global_indices  # [W, B, L]
    owner = torch.full((idx.shape[1], lay.padded_seq_len), -1, dtype=I64)
    for r in range(lay.world_size):
        for b in range(idx.shape[1]):
            assert bool((owner[b, idx[r, b]] == -1).all()), "a position is held twice"
            owner[b, idx[r, b]] = r
    assert bool((owner >= 0).all()), "a position is held by no rank"
    return owner[0] if owner.shape[0] == 1 else owner


def _positions(owner: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's positions, ascending: [L] or [B, L]."""
    if owner.dim() == 1:
        return torch.nonzero(owner == rank).flatten()
    return torch.stack([torch.nonzero(row == rank).flatten() for row in owner])


def _pad(x: torch.Tensor, d: int, padded: int, fill) -> torch.Tensor:
    shape = list(x.shape)
    shape[d] = padded - x.shape[d]
    return torch.cat([x, torch.full(shape, fill, dtype=x.dtype)], dim=d)


def _take(full: torch.Tensor, d: int, pos: torch.Tensor) -> torch.Tensor:
    """full's positions ``pos`` along d ([L] for every row, or [B, L] with the batch at d - 1)."""
    if pos.dim() == 1:
        return full.index_select(d, pos)
    if full.shape[d - 1] == 1:
        full = full.expand(*full.shape[: d - 1], pos.shape[0], *full.shape[d:])
    return torch.stack(
        [full.select(d - 1, b).index_select(d - 1, pos[b]) for b in range(pos.shape[0])], dim=d - 1
    )


def _mask(owner: torch.Tensor, rank: int, shape: Sequence[int], d: int) -> torch.Tensor:
    """owner == rank broadcast to a tensor of ``shape`` whose seq dim is d (batch at d - 1)."""
    m = owner == rank
    view = [1] * len(shape)
    view[d] = m.shape[-1]
    if m.dim() == 2:
        view[d - 1] = m.shape[0]
    return m.reshape(view).expand(*shape[:d], m.shape[-1], *shape[d + 1 :])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        return bool(torch.allclose(a.to(F64), b.to(F64), rtol=0, atol=ATOL))
    return bool(torch.equal(a, b))


def _group(world: int, kind: str = "pg"):
    if kind == "none":
        return None
    if kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", (world,))
    return dist.group.WORLD


# --------------------------------------------------------------------------- case grids (pure)

# (layout, num_chunks spec) -- "4W" = 4 * world
LAYOUT_SPECS = [
    ("contiguous", None),
    ("head_tail", None),
    ("head_tail", "4W"),
    ("stripe", None),
    ("per_document_head_tail", None),
    ("balanced", None),
]
DATA_DEPENDENT = ("per_document_head_tail", "balanced")

# (shape with None at the seq dim, seq_dim as passed); batch dim (B) right before the seq dim
SHAPES = [
    ((B, None), 1),
    ((B, None, H), 1),
    ((H, B, None), 2),
    ((B, None, 2, 2), -3),
    ((1, B, None), -1),
]
# nothing before the seq dim (hidden states [1, S, H], a bare [S, H]): the un-shard of head_tail
# reorders the gathered buffer in place there; closed-form layouts only (the data-dependent ones
# plan every row of the batch, so their tensors need the batch dim)
TOKEN_OUTERMOST_SHAPES = [((1, None, H), 1), ((None, H), 0)]
DTYPES = [F64, BF16, I64, torch.bool]


def _chunks(spec, world):
    return None if spec is None else 4 * world


def _doc_ids(seed: int = 7) -> torch.Tensor:
    """[B, S] packed documents (0 = padding)."""
    return torch.tensor(
        [[1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4, 0, 0]],
        dtype=I64,
    )


def _sharder(world: int, layout: str, spec, group_kind: str = "pg", **kw) -> ContextParallelSharder:
    g = _group(world, group_kind)
    sh = ContextParallelSharder(g, layout, num_chunks=_chunks(spec, world), **kw)
    sh.shard({"input_ids": _rand((B, S), I64, 1), "_packed_seq_ids": _doc_ids()})
    return sh


# --------------------------------------------------------------------------- worker: round trips


def _run_round_trips(
    rank: int, world: int, group_kind: str = "pg", specs: list | None = None
) -> list[str]:
    bad: list[str] = []
    for k, (layout, spec) in enumerate(specs or LAYOUT_SPECS):
        sh = _sharder(world, layout, spec, group_kind)
        lay = sh.shard_layout
        padded = lay.padded_seq_len
        owner = _owner_of(sh, (layout, _chunks(spec, world)))
        mine = _positions(owner, rank)
        if (lay.name, lay.world_size, lay.original_seq_len) != (layout, world, S):
            bad.append(f"{layout}: layout fields {lay}")
        shapes = SHAPES + (TOKEN_OUTERMOST_SHAPES if layout not in DATA_DEPENDENT else [])
        for j, (shape, sd) in enumerate(shapes):
            full_shape = [S if s is None else s for s in shape]
            d = sd % len(full_shape)
            # float64 (values and gradients) for every (layout, shape), plus one other dtype in turn
            for dtype in (F64, DTYPES[1 + (j + k) % (len(DTYPES) - 1)]):
                tag = f"{layout}/{spec} shape={full_shape} seq_dim={sd} {dtype}"
                fill = {F64: -3.5, BF16: 2.0, I64: -100, torch.bool: True}[dtype]
                x = _rand(full_shape, dtype, 100 * k + 10 * j)
                ref_padded = _pad(x, d, padded, fill)
                ref_local = _take(ref_padded, d, mine)
                local = sh.shard_token_tensor(x, seq_dim=sd, fill=fill)
                if not _close(local, ref_local):
                    bad.append(f"{tag}: shard of original length")
                if not _close(sh.shard_token_tensor(ref_padded, seq_dim=sd), ref_local):
                    bad.append(f"{tag}: shard of padded length")
                if not _close(sh.gather_token_tensor(local, seq_dim=sd, trim=True), x):
                    bad.append(f"{tag}: gather(trim=True) != input")
                if dtype != F64:
                    continue
                if not _close(sh.gather_token_tensor(local, seq_dim=sd), ref_padded):
                    bad.append(f"{tag}: gather() != padded input")
                # gradients through both verbs: loss = sum_q <gather(shard(x)), w_q>
                leaf = x.clone().requires_grad_()
                y = sh.gather_token_tensor(
                    sh.shard_token_tensor(leaf, seq_dim=sd, fill=0.0), seq_dim=sd, trim=True
                )
                (y * _rand(full_shape, F64, 5000 + rank)).sum().backward()
                w_sum = sum(_rand(full_shape, F64, 5000 + q) for q in range(world))
                held = _mask(owner, rank, ref_padded.shape, d).narrow(d, 0, S)
                if not _close(leaf.grad, torch.where(held, w_sum, torch.zeros_like(w_sum))):
                    bad.append(f"{tag}: grad through shard+gather")
                # gradient through gather alone, untrimmed: every rank's weights at my positions
                loc = ref_local.clone().requires_grad_()
                y = sh.gather_token_tensor(loc, seq_dim=sd)
                (y * _rand(ref_padded.shape, F64, 7000 + rank)).sum().backward()
                w_sum = sum(_rand(ref_padded.shape, F64, 7000 + q) for q in range(world))
                if not _close(loc.grad, _take(w_sum, d, mine)):
                    bad.append(f"{tag}: grad through gather")
    return bad


def _run_no_layout_yet(rank: int, world: int) -> list[str]:
    """Closed-form layouts work before any shard on padded-length tensors."""
    bad = []
    for layout, spec in LAYOUT_SPECS[:4]:
        chunks = _chunks(spec, world)
        sh = ContextParallelSharder(dist.group.WORLD, layout, num_chunks=chunks)
        padded = 3 * (chunks or (2 * world if layout == "head_tail" else world))
        owner = _ref_owner(layout, world, padded, chunks)
        x = _rand((B, padded, H), F64, 11)
        local = sh.shard_token_tensor(x)
        if not _close(local, x.index_select(1, _positions(owner, rank))):
            bad.append(f"{layout}: shard before any layout")
        if not _close(sh.gather_token_tensor(local), x):
            bad.append(f"{layout}: gather before any layout")
        seed_form = sh.local_token_global_indices(dist.group.WORLD, padded, "cpu")
        if not torch.equal(seed_form, _positions(owner, rank)) or not torch.equal(
            sh._indices(padded, "cpu"), seed_form
        ):
            bad.append(f"{layout}: local_token_global_indices callable / _indices")
    if ContextParallelSharder(dist.group.WORLD, "balanced").local_token_global_indices is not None:
        bad.append("balanced: local_token_global_indices must be None (data-dependent)")
    return bad


# --------------------------------------------------------------------------- worker: batches


def _batch(variant: str) -> tuple[dict, torch.Tensor]:
    ids = _doc_ids()
    attn = torch.ones(B, S, dtype=I64)
    attn[1, -2:] = 0
    batch = {
        "input_ids": _rand((B, S), I64, 21),
        "labels": _rand((B, S), I64, 22),
        "inputs_embeds": _rand((B, S, H), F64, 23).requires_grad_(),
        "attention_mask": attn,
        "_packed_seq_ids": ids,
        "token_type_ids": _rand((B, S), I64, 24),
        "vision_pos": _rand((2, B, S), F32, 25),
        "meta": "kept as is",
    }
    if variant == "positions":
        batch["position_ids"] = torch.arange(S).repeat(B, 1) + torch.tensor([[0], [5]])
    elif variant == "mrope":
        batch["position_ids"] = torch.stack(
            [torch.arange(S).repeat(B, 1) * (i + 1) for i in range(3)]
        )
    return batch, _rand((B, S), F32, 26)


def _run_batches(rank: int, world: int) -> list[str]:
    bad = []
    for layout, spec in LAYOUT_SPECS:
        for variant in ("positions", "mrope", "none"):
            tag = f"{layout}/{spec}/{variant}"
            batch, loss_mask = _batch(variant)
            keys = set(batch)
            sh = ContextParallelSharder(
                dist.group.WORLD,
                layout,
                padding_token_id=-1,
                loss_mask=loss_mask,
                extra_seq_buffers={"token_type_ids": 1, "vision_pos": 2, "absent": 1},
                num_chunks=_chunks(spec, world),
            )
            ctx, out = sh.shard(batch)
            with ctx():
                pass
            if set(batch) != keys or "attention_mask" not in batch:
                bad.append(f"{tag}: the input batch was modified")
            lay = sh.shard_layout
            padded = lay.padded_seq_len
            if lay.original_seq_len != S or padded % world or padded < S:
                bad.append(f"{tag}: layout lengths {lay.original_seq_len}, {padded}")
            if layout in DATA_DEPENDENT:
                docs = batch["_packed_seq_ids"] * batch["attention_mask"]
                again = make_layout(layout, world, S, doc_ids=docs)
                if not torch.equal(
                    again.local_token_global_indices, lay.local_token_global_indices
                ):
                    bad.append(f"{tag}: the plan does not follow the batch's documents")
            owner = _owner_of(sh, (layout, _chunks(spec, world)))
            mine = _positions(owner, rank)
            pos = batch.get("position_ids")
            if pos is None:  # created per document (the documents here have no interior pad)
                pos = per_document_positions(batch["_packed_seq_ids"] * batch["attention_mask"])
            pos_full = torch.cat([pos, pos[..., -1:] + torch.arange(1, padded - S + 1)], dim=-1)
            pad_full = _pad(
                (batch["attention_mask"] == 0) | (batch["_packed_seq_ids"] == 0), 1, padded, True
            )
            docs = batch["_packed_seq_ids"] * batch["attention_mask"]
            # labels and loss_mask are shifted once over the whole sequence before sharding; a
            # token whose next token is in another document (or padding) has no target
            same = (docs[:, 1:] == docs[:, :-1]) & (docs[:, :-1] != 0)
            labels = torch.full_like(batch["labels"], -100)
            labels[:, :-1] = torch.where(same, batch["labels"][:, 1:], -100)
            shifted_mask = torch.zeros_like(loss_mask)
            shifted_mask[:, :-1] = torch.where(same, loss_mask[:, 1:], 0.0)
            expected = {
                "input_ids": _take(_pad(batch["input_ids"], 1, padded, -1), 1, mine),
                "targets.labels": _take(_pad(labels, 1, padded, -100), 1, mine),
                "targets.num_labelled": (labels != -100).sum(),
                "inputs_embeds": _take(
                    _pad(batch["inputs_embeds"].detach(), 1, padded, 0.0), 1, mine
                ),
                "targets.loss_mask": _take(_pad(shifted_mask, 1, padded, 0.0), 1, mine),
                "targets.document_ids": _take(_pad(docs, 1, padded, 0), 1, mine),
                "token_type_ids": _take(_pad(batch["token_type_ids"], 1, padded, 0), 1, mine),
                "vision_pos": _take(_pad(batch["vision_pos"], 2, padded, 0.0), 2, mine),
                "position_ids": _take(pos_full, pos_full.dim() - 1, mine),
                "targets.padding_mask": _take(pad_full, 1, mine),
                "meta": "kept as is",
            }
            got = {**out, **{f"targets.{k}": v for k, v in vars(out.targets).items()}}
            if set(got) != set(expected):
                bad.append(f"{tag}: keys {sorted(got)}")
                continue
            for key, ref in expected.items():
                if key == "meta":
                    ok = got[key] == ref
                else:
                    ok = _close(got[key].detach(), ref)
                if not ok:
                    bad.append(f"{tag}: {key}")
            # inputs_embeds: differentiable shard, gradient to the positions this rank holds
            w = _rand(out["inputs_embeds"].shape, F64, 31)
            (out["inputs_embeds"] * w).sum().backward()
            ref_grad = torch.zeros(B, padded, H, dtype=F64)
            held = _mask(owner, rank, (B, padded, H), 1)
            ref_grad[held] = _pad_back(w, mine, padded)[held]
            if not _close(batch["inputs_embeds"].grad, ref_grad[:, :S]):
                bad.append(f"{tag}: inputs_embeds gradient")
            # and the model-side round trip of the sharded embeddings
            if not _close(
                sh.gather_token_tensor(out["inputs_embeds"].detach(), trim=True),
                batch["inputs_embeds"].detach(),
            ):
                bad.append(f"{tag}: gather of the sharded inputs_embeds")
    return bad


def _pad_back(local: torch.Tensor, mine: torch.Tensor, padded: int) -> torch.Tensor:
    """[B, L, H] at positions ``mine`` -> [B, P, H] (zeros elsewhere)."""
    out = torch.zeros(local.shape[0], padded, *local.shape[2:], dtype=local.dtype)
    for b in range(local.shape[0]):
        out[b, mine if mine.dim() == 1 else mine[b]] = local[b]
    return out


def _run_attention_mask_4d(rank: int, world: int) -> list[str]:
    """A 4-D block-causal mask gives the data-dependent planner its documents and padding."""
    ids = _doc_ids()
    same = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] != 0)
    mask4 = (same & torch.tril(torch.ones(S, S, dtype=torch.bool)))[:, None]
    bad = []
    for layout in DATA_DEPENDENT:
        sh = ContextParallelSharder(dist.group.WORLD, layout)
        _, out = sh.shard({"input_ids": _rand((B, S), I64, 3), "attention_mask": mask4})
        ref = make_layout(layout, world, S, doc_ids=ids)
        if not torch.equal(
            ref.local_token_global_indices, sh.shard_layout.local_token_global_indices
        ):
            bad.append(f"{layout}: documents from a 4-D mask")
        owner = _owner_of(sh, (layout, None))
        exp = _take(
            _pad(ids == 0, 1, sh.shard_layout.padded_seq_len, True), 1, _positions(owner, rank)
        )
        if not torch.equal(out.targets.padding_mask, exp) or "attention_mask" in out:
            bad.append(f"{layout}: padding_mask from a 4-D mask")
    return bad


# --------------------------------------------------------------------------- worker: direct form


def _thd_shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0):
    """A custom backend: flatten [B, S] into one stream, pad to a multiple of W, contiguous."""
    g = comm.resolve_group(cp_mesh, "test")
    ids = batch["input_ids"]
    rows, cols = ids.shape
    padded = -(-rows * cols // g.world) * g.world
    stream = torch.cat(
        [ids.reshape(1, -1), torch.full((1, padded - rows * cols), padding_token_id)], dim=1
    )
    per = padded // g.world
    lay = ShardLayout("thd_contiguous", g.world, rows * cols, padded, input_row_shape=(rows, cols))
    return contextlib.nullcontext, {"input_ids": stream[:, g.rank * per : (g.rank + 1) * per]}, lay


def _repad(world: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """A repositioned-row layout: every document of each row moved to start at a multiple of 4,
    the last token of each row dropped; a random partition carried as [W, L] indices."""
    ids = _doc_ids()
    pm = torch.full((B, S), -1, dtype=I64)
    for b in range(B):
        at, prev = 0, None
        for i in range(S - 1):
            if ids[b, i] != prev:
                at = -(-at // 4) * 4
                prev = ids[b, i]
            pm[b, i] = at
            at += 1
    padded = -(-(int(pm.max()) + 1) // (4 * world)) * (4 * world)
    perm = torch.randperm(padded, generator=torch.Generator().manual_seed(99))
    idx = torch.stack([torch.sort(c).values for c in perm.view(world, -1)])
    return pm, padded, idx


def _run_direct_form(rank: int, world: int) -> list[str]:
    bad = []
    g = dist.group.WORLD
    # (a) THD: the caller's shard_batch flattens the rows; its layout carries no indices and the
    # sharder's closed-form layout name gives them.
    sh = ContextParallelSharder(g, "contiguous", shard_batch=_thd_shard_batch, padding_token_id=-1)
    batch = {"input_ids": _rand((B, S), I64, 41)}
    _, out = sh.shard(batch)
    lay = sh.shard_layout
    per = lay.padded_seq_len // world
    x = _rand((B, S, H), F64, 42)
    stream = _pad(x.reshape(1, B * S, H), 1, lay.padded_seq_len, 0.0)
    local = sh.shard_token_tensor(x, fill=0.0)
    if not _close(local, stream[:, rank * per : (rank + 1) * per]):
        bad.append("thd: shard of [B, S, H] input rows")
    if not torch.equal(sh.shard_token_tensor(batch["input_ids"], fill=-1), out["input_ids"]):
        bad.append("thd: shard of input_ids differs from the batch's")
    if not _close(sh.gather_token_tensor(local, trim=True), x):
        bad.append("thd: gather(trim=True) != input rows")
    if not _close(sh.gather_token_tensor(local), stream):
        bad.append("thd: gather() != padded stream")
    leaf = x.clone().requires_grad_()
    y = sh.gather_token_tensor(sh.shard_token_tensor(leaf, fill=0.0), trim=True)
    (y * _rand(x.shape, F64, 300 + rank)).sum().backward()
    w_sum = sum(_rand(x.shape, F64, 300 + q) for q in range(world))
    held = torch.zeros(lay.padded_seq_len, dtype=torch.bool)
    held[rank * per : (rank + 1) * per] = True
    ref = torch.where(held[: B * S].reshape(B, S, 1), w_sum, torch.zeros_like(w_sum))
    if not _close(leaf.grad, ref):
        bad.append("thd: gradient")

    # (b) a repositioned-row layout with carried indices and a position map
    pm, padded, idx = _repad(world)
    rep = ShardLayout("repad", world, S, padded, idx, position_map=pm)
    sh = ContextParallelSharder(
        g, None, shard_batch=lambda *a, **k: (contextlib.nullcontext, {}, rep)
    )
    sh.shard({})
    x = _rand((B, S, H), F64, 43)
    full = torch.full((B, padded, H), -5.0, dtype=F64)
    for b in range(B):
        keep = pm[b] >= 0
        full[b, pm[b][keep]] = x[b, keep]
    local = sh.shard_token_tensor(x, fill=-5.0)
    sh.gather_token_tensor(local, trim=True, fill=-7.0)
    # after the step's first calls, the verbs read no tensor data (on a GPU: no sync per call)
    reads: list[int] = []
    real_any = torch.Tensor.any
    torch.Tensor.any = lambda self, *a, **k: reads.append(1) or real_any(self, *a, **k)
    try:
        sh.shard_token_tensor(x, fill=-5.0)
        sh.gather_token_tensor(local, trim=True, fill=-7.0)
    finally:
        torch.Tensor.any = real_any
    if reads:
        bad.append(f"repad: the per-call verbs read tensor data {len(reads)} times")
    if not _close(local, full[:, idx[rank]]):
        bad.append("repad: shard of [B, S_in] rows")
    if not _close(sh.shard_token_tensor(full), local):
        bad.append("repad: shard of padded rows")
    if not _close(sh.gather_token_tensor(local), full):
        bad.append("repad: gather()")
    exp = torch.where((pm >= 0)[..., None], x, torch.full_like(x, -7.0))
    if not _close(sh.gather_token_tensor(local, trim=True, fill=-7.0), exp):
        bad.append("repad: gather(trim=True)")
    try:
        sh.gather_token_tensor(local, trim=True)
        bad.append("repad: trim without fill for dropped positions did not raise")
    except ValueError as exc:
        if "fill" not in str(exc):
            bad.append(f"repad: message {exc}")

    # (c) carried indices with different counts per rank: the all-gather-v path
    owner = torch.tensor([(p * p + 3 * p) % (world + 1) % world for p in range(S)], dtype=I64)
    uneven = ShardLayout("uneven", world, S, S, tuple(_positions(owner, r) for r in range(world)))
    sh = ContextParallelSharder(
        g, None, shard_batch=lambda *a, **k: (contextlib.nullcontext, {}, uneven)
    )
    sh.shard({})
    x = _rand((B, S, H), F64, 45)
    mine = _positions(owner, rank)
    local = sh.shard_token_tensor(x)
    if not _close(local, x[:, mine]) or not _close(sh.gather_token_tensor(local, trim=True), x):
        bad.append("uneven: round trip")
    leaf = local.clone().requires_grad_()
    (sh.gather_token_tensor(leaf) * _rand(x.shape, F64, 600 + rank)).sum().backward()
    if not _close(leaf.grad, sum(_rand(x.shape, F64, 600 + q) for q in range(world))[:, mine]):
        bad.append("uneven: gradient")

    # (d) only a local_token_global_indices callable: reversed stripes; the gather all-gathers
    # the indices (the one case where they are not known locally).
    def reversed_stripes(cp_mesh, padded_len, device):
        gg = comm.resolve_group(cp_mesh, "test")
        return torch.tensor(
            [p for p in range(padded_len) if (padded_len - 1 - p) % gg.world == gg.rank],
            device=device,
        )

    sh = ContextParallelSharder(g, "balanced", local_token_global_indices=reversed_stripes)
    padded = 5 * world
    x = _rand((B, padded), F64, 44)
    mine = reversed_stripes(g, padded, "cpu")
    local = sh.shard_token_tensor(x)
    if not _close(local, x[:, mine]) or not _close(sh.gather_token_tensor(local), x):
        bad.append("callable: round trip")
    leaf = local.clone().requires_grad_()
    (sh.gather_token_tensor(leaf) * _rand(x.shape, F64, 500 + rank)).sum().backward()
    if not _close(leaf.grad, sum(_rand(x.shape, F64, 500 + q) for q in range(world))[:, mine]):
        bad.append("callable: gradient")
    return bad


# ------------------------------------------------------------------- worker: no index gathers


def _run_count_collectives(rank: int, world: int) -> list[str]:
    """The un-shard of closed-form and carried layouts moves the data only: one all-gather of
    the shards, plus the fixed-size consensus exchanges -- never an index tensor."""
    calls: list[tuple] = []
    nested = [0]  # a verb the transport implements through another one counts once
    names = ("all_gather", "all_gather_v")
    original = {name: getattr(comm.TorchTransport, name) for name in names}

    def recorded(name: str):
        def verb(self, out, local, *sizes):
            if not nested[0]:
                calls.append((name, local.dtype, local.numel()))
            nested[0] += 1
            try:
                return original[name](self, out, local, *sizes)
            finally:
                nested[0] -= 1

        return verb

    for name in names:
        setattr(comm.TorchTransport, name, recorded(name))
    bad = []
    try:
        for layout, spec in LAYOUT_SPECS:
            sh = _sharder(world, layout, spec)
            # [B, S, 4] and hidden states [1, S, 4] (head_tail reorders those in place)
            for shape in ((B, S, 4), (1, S, 4)):
                if shape[0] == 1 and layout in DATA_DEPENDENT:
                    continue
                local = sh.shard_token_tensor(_rand(shape, F32, 5), fill=0.0)
                calls.clear()
                sh.gather_token_tensor(local, trim=True)
                if calls != [("all_gather", F32, local.numel())]:
                    bad.append(f"{layout} {shape}: collectives {calls}")
    finally:
        for name in names:
            setattr(comm.TorchTransport, name, original[name])
    return bad


# --------------------------------------------------------------------------- worker: errors


def _expect(bad: list[str], tag: str, fn, exc: type[Exception], *needles: str) -> None:
    try:
        fn()
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        if missing:
            bad.append(f"{tag}: message {str(e)!r} lacks {missing}")
    except Exception as e:  # noqa: BLE001
        bad.append(f"{tag}: raised {type(e).__name__}: {e}")
    else:
        bad.append(f"{tag}: did not raise")


def _run_errors(rank: int, world: int) -> list[str]:
    """Bad input in checked mode: every rank raises (the per-call gathers check across ranks)."""
    with check_mode("call"):
        return _errors(rank, world)


def _errors(rank: int, world: int) -> list[str]:
    g = dist.group.WORLD
    bad: list[str] = []
    last = world - 1
    sh = _sharder(world, "head_tail", None)
    lay = sh.shard_layout
    per = lay.padded_seq_len // world
    ok = torch.zeros(B, per)
    # a wrong local length on the last rank only: every rank raises, naming it
    t = torch.zeros(B, per + 1) if rank == last else ok
    detail = ("holds",) if rank == last else ()
    _expect(
        bad,
        "gather wrong length on one rank",
        lambda: sh.gather_token_tensor(t),
        ValueError,
        f"rank {last}",
        *detail,
    )
    # still in lockstep afterwards
    if not _close(sh.gather_token_tensor(ok), torch.zeros(B, lay.padded_seq_len)):
        bad.append("gather after an error")
    _expect(
        bad,
        "shard wrong length",
        lambda: sh.shard_token_tensor(torch.zeros(B, 2 * S + 1)),
        ValueError,
        f"rank {rank}",
        "accepts",
        f"original_seq_len = {S}",
    )
    if lay.padded_seq_len != S:
        _expect(
            bad,
            "shard without fill",
            lambda: sh.shard_token_tensor(torch.zeros(B, S)),
            ValueError,
            "fill=",
        )
    _expect(
        bad,
        "bad seq_dim",
        lambda: sh.shard_token_tensor(torch.zeros(B, S), seq_dim=3, fill=0),
        ValueError,
        "seq_dim=3",
    )
    _expect(bad, "not a tensor", lambda: sh.shard_token_tensor([1, 2]), TypeError, "torch.Tensor")
    _expect(
        bad, "gather not a tensor", lambda: sh.gather_token_tensor("x"), ValueError, "torch.Tensor"
    )

    fresh = ContextParallelSharder(g, "head_tail")
    _expect(
        bad,
        "trim before shard",
        lambda: fresh.gather_token_tensor(torch.zeros(B, 2), trim=True),
        ValueError,
        "trim",
    )
    for layout in DATA_DEPENDENT:
        dd = ContextParallelSharder(g, layout)
        _expect(
            bad,
            f"{layout} gather before shard",
            lambda dd=dd: dd.gather_token_tensor(torch.zeros(B, 2)),
            ValueError,
            "data-dependent",
            "shard(batch)",
        )
        _expect(
            bad,
            f"{layout} shard_token before shard",
            lambda dd=dd: dd.shard_token_tensor(torch.zeros(B, 4)),
            ValueError,
            "data-dependent",
            "shard(batch)",
        )
        dd.shard({"input_ids": torch.ones(B, S, dtype=I64), "_packed_seq_ids": _doc_ids()})
        _expect(
            bad,
            f"{layout} per-row needs the batch dim",
            lambda dd=dd: dd.shard_token_tensor(torch.zeros(S), seq_dim=0, fill=0),
            ValueError,
            "batch dim",
        )
        other = torch.ones(B, S, dtype=I64)  # one document per row: a different plan
        differs = not torch.equal(
            make_layout(layout, world, S, doc_ids=other).local_token_global_indices,
            dd.shard_layout.local_token_global_indices,
        )
        if world > 1 and differs:  # ranks holding different documents: their plans would not match
            other = other if rank == 0 else _doc_ids()
            _expect(
                bad,
                f"{layout} different batches",
                lambda dd=dd, other=other: dd.shard(
                    {"input_ids": torch.ones(B, S, dtype=I64), "_packed_seq_ids": other}
                ),
                ValueError,
                "partition differs",
            )
    # a bad batch on rank 0 only: every rank raises
    labels = torch.zeros(B, S + 1 if rank == 0 else S, dtype=I64)
    _expect(
        bad,
        "bad labels on rank 0",
        lambda: sh.shard({"input_ids": torch.ones(B, S, dtype=I64), "labels": labels}),
        ValueError,
        "rank 0",
    )
    _expect(bad, "no sequence in the batch", lambda: sh.shard({"meta": 1}), ValueError, "input_ids")
    _expect(bad, "batch not a dict", lambda: sh.shard([1]), ValueError, "dict")
    _expect(
        bad,
        "bad layout name",
        lambda: ContextParallelSharder(g, "ring"),
        ValueError,
        "unknown layout",
        "zigzag",
    )
    if world > 1:
        _expect(
            bad,
            "bad num_chunks",
            lambda: ContextParallelSharder(g, "head_tail", num_chunks=2 * world + 1),
            ValueError,
            "num_chunks",
        )
    _expect(
        bad,
        "num_chunks on stripe",
        lambda: ContextParallelSharder(g, "stripe", num_chunks=world),
        ValueError,
        "num_chunks",
    )
    _expect(bad, "bad group", lambda: ContextParallelSharder("cp", "stripe"), TypeError, "group")
    _expect(
        bad,
        "reserved extra buffer",
        lambda: ContextParallelSharder(g, extra_seq_buffers={"labels": 1}),
        ValueError,
        "labels",
    )
    _expect(
        bad,
        "layout=None needs shard_batch",
        lambda: ContextParallelSharder(g, None),
        ValueError,
        "shard_batch",
    )
    bad_sb = ContextParallelSharder(g, "stripe", shard_batch=lambda *a, **k: ({}, {}))
    _expect(
        bad, "shard_batch result", lambda: bad_sb.shard({}), TypeError, "shard_batch must return"
    )
    return bad


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", WORLDS)
def test_round_trips_and_gradients(pools, world):
    assert_no_mismatches(pools(world).run(_run_round_trips, timeout=240))


@pytest.mark.parametrize("world", WORLDS)
def test_batch_sharding(pools, world):
    pool = pools(world)
    assert_no_mismatches(pool.run(_run_batches, timeout=120))
    assert_no_mismatches(pool.run(_run_attention_mask_4d, timeout=60))


@pytest.mark.parametrize("world", WORLDS)
def test_direct_form_thd_position_map_and_callable(pools, world):
    assert_no_mismatches(pools(world).run(_run_direct_form, timeout=60))


@pytest.mark.parametrize("world", WORLDS)
def test_closed_form_before_any_shard(pools, world):
    assert_no_mismatches(pools(world).run(_run_no_layout_yet, timeout=60))


@pytest.mark.parametrize("world", [2, 4])
def test_gather_moves_no_index_tensors(pools, world):
    assert_no_mismatches(pools(world).run(_run_count_collectives, timeout=60))


@pytest.mark.parametrize("world", WORLDS)
def test_errors_raise_on_every_rank(pools, world):
    assert_no_mismatches(pools(world).run(_run_errors, timeout=60))


@pytest.mark.parametrize("world,kind", [(1, "none"), (2, "mesh")])
def test_group_kinds(pools, world, kind):
    specs = [("head_tail", None), ("balanced", None)]
    assert_no_mismatches(pools(world).run(_run_round_trips, kind, specs, timeout=240))


def _unnamed_entries(rank: int, world: int) -> list[str]:
    """Sequence-aligned batch entries nobody named (a VLM's ``visual_pos_masks`` ``[B, S]``,
    per-token features ``[B, S, 3]``) are sharded like the inputs in every layout and by the
    block-diagonal batch; entries that are not sequence-aligned pass through as given."""
    from cpshard import make_cp_blockdiag_batch_and_ctx

    g = torch.Generator().manual_seed(7)
    b, s = 2, 13
    doc = torch.tensor([[1] * 5 + [2] * 8, [1] * 9 + [0] * 4])
    batch = {
        "input_ids": torch.randint(1, 50, (b, s), generator=g),
        "_packed_seq_ids": doc,
        "visual_pos_masks": torch.rand(b, s, generator=g) > 0.5,
        "features": torch.randn(b, s, 3, generator=g),
        "pixel_values": torch.randn(7, 5, generator=g),
    }
    bad = []
    for layout in ("contiguous", "head_tail", "stripe", "balanced"):
        sh = ContextParallelSharder(dist.group.WORLD, layout)
        _, out = sh.shard(batch)
        for key, fill in (("visual_pos_masks", False), ("features", 0.0)):
            want = sh.shard_token_tensor(batch[key], seq_dim=1, fill=fill)
            if out[key].shape != want.shape or not torch.equal(out[key], want):
                bad.append(f"{layout}: {key} not sharded like the inputs")
        if out["pixel_values"] is not batch["pixel_values"]:
            bad.append(f"{layout}: pixel_values not passed through as given")
        if layout == "contiguous":
            _, blockdiag = make_cp_blockdiag_batch_and_ctx(dist.group.WORLD, None, batch)
            for key in ("input_ids", "position_ids", "visual_pos_masks", "features"):
                if not torch.equal(blockdiag[key], out[key]):
                    bad.append(f"block-diagonal batch: {key} differs from the contiguous sharder's")
    return bad


@pytest.mark.parametrize("world", [1, 3])
def test_unnamed_sequence_entries_are_sharded(pools, world):
    assert pools(world).run(_unnamed_entries, timeout=120) == [[]] * world


def test_direct_form_indices_follow_every_shard():
    """A direct-form ``shard_batch`` may report the same ShardLayout object every step while its
    ``local_token_global_indices`` callable answers per step: every shard drops the positions
    derived from the previous one, so the token verbs follow this step's."""
    layout = ShardLayout("custom", 1, 4, 4)
    order = [torch.arange(4)]

    sh = ContextParallelSharder(
        None,
        None,
        shard_batch=lambda *a, **k: (contextlib.nullcontext, {}, layout),
        local_token_global_indices=lambda mesh, padded, device=None: order[0].to(device),
    )
    t = torch.arange(8.0).view(2, 4)
    for step in (torch.arange(4), torch.tensor([3, 1, 0, 2])):
        order[0] = step
        sh.shard({})
        assert torch.equal(sh.shard_token_tensor(t), t[:, step])
