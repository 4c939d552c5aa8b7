"""The NeMo Automodel mirror (``cpshard.nemo``) against NeMo Automodel's documented API, item
by item, in one process (the multi-rank items are in ``tests/nemo/test_ranks.py``).

NeMo's documented names, signatures (parameter names, kinds, defaults), return values and
exception types are written down below as the contract; the ``cpshard.nemo`` names are checked
against it. A cpshard signature may extend a documented signature with further parameters that
have defaults (e.g. ``seq_dim``), never change or reorder the documented ones. The parameter
lists of ``cp_vision_frame_shard`` are those of NeMo's published API reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import itertools
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib
import torch

import cpshard
from cpshard.nemo.components.distributed import cp_vision_frame_shard as vfs
from cpshard.nemo.components.distributed.blockdiag_cp import batch as bd
from cpshard.nemo.components.distributed.blockdiag_cp import runtime as bd_runtime
from cpshard.nemo.components.distributed.context_parallel import sharder as sh
from cpshard.nemo.components.models.step5 import cp as step5

P = inspect.Parameter
POS, KW = P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY
REQ = P.empty

# --------------------------------------------------------------------------- the contract
# (module, qualified name) -> [(parameter, kind, default)], as NeMo documents them.

SIGNATURES: dict[tuple[str, str], list[tuple[str, inspect._ParameterKind, object]]] = {
    # step5_cp_transport.txt
    ("step5", "gather_sequence"): [("x", POS, REQ), ("group", POS, REQ)],
    ("step5", "gather_metadata"): [("x", POS, REQ), ("group", POS, REQ)],
    ("step5", "gather_halo"): [("x", POS, REQ), ("group", POS, REQ), ("halo_size", POS, REQ),
                               ("left_padding", POS, 0)],
    ("step5", "_GatherSequence.forward"): [("ctx", POS, REQ), ("x", POS, REQ), ("group", POS, REQ)],
    ("step5", "_GatherSequence.backward"): [("ctx", POS, REQ), ("grad_output", POS, REQ)],
    ("step5", "_GatherHalo.forward"): [("ctx", POS, REQ), ("x", POS, REQ), ("group", POS, REQ),
                                       ("halo_size", POS, REQ), ("left_padding", POS, REQ)],
    ("step5", "_GatherHalo.backward"): [("ctx", POS, REQ), ("grad_output", POS, REQ)],
    # blockdiag_cp_batch.txt
    ("bd", "_cp_blockdiag_doc_ids"): [("batch", POS, REQ), ("seq_len", POS, REQ), ("device", POS, REQ),
                                      ("batch_size", POS, REQ)],
    ("bd", "make_cp_blockdiag_batch_and_ctx"): [("cp_mesh", POS, REQ), ("tp_mesh", POS, REQ),
                                                ("batch", POS, REQ), ("loss_mask", POS, None),
                                                ("padding_token_id", POS, 0)],
    # context_parallel_sharder.txt
    ("sh", "ContextParallelSharder"): [
        ("model", POS, None), ("device_mesh", POS, None), ("batch", POS, None), ("shard_batch", POS, None),
        ("local_token_global_indices", POS, None), ("shard_layout", POS, None), ("padding_token_id", POS, 0),
        ("num_chunks", POS, 1), ("loss_mask", POS, None), ("invoke_pre_embed", POS, True),
        ("extra_seq_buffers", POS, None),
    ],
    ("sh", "ContextParallelSharder._indices"): [("self", POS, REQ), ("padded_seq_len", POS, REQ),
                                                ("device", POS, REQ)],
    ("sh", "ContextParallelSharder.shard"): [("self", POS, REQ), ("batch", POS, REQ)],
    ("sh", "ContextParallelSharder.shard_token_tensor"): [("self", POS, REQ), ("tensor", POS, REQ),
                                                          ("seq_dim", POS, 1), ("fill", POS, None)],
    ("sh", "ContextParallelSharder.gather_token_tensor"): [("self", POS, REQ), ("tensor", POS, REQ),
                                                           ("seq_dim", POS, 1), ("trim", POS, False),
                                                           ("fill", POS, None)],
    # cp_vision_frame_shard.txt
    ("vfs", "CpVisionFrameShardingConfig.__post_init__"): [("self", POS, REQ)],
    ("vfs", "_AllGatherSeqDiff.forward"): [("ctx", POS, REQ), ("x", POS, REQ), ("group", POS, REQ),
                                           ("seq_dim", POS, REQ)],
    ("vfs", "_AllGatherSeqDiff.backward"): [("ctx", POS, REQ), ("grad_out", POS, REQ)],
    ("vfs", "_GroupHolder.get"): [("self", POS, REQ)],
    ("vfs", "_GroupHolder.set"): [("self", POS, REQ), ("value", POS, REQ)],
    ("vfs", "_GroupHolder.reset"): [("self", POS, REQ), ("token", POS, REQ)],
    ("vfs", "_GroupScope"): [("group", POS, REQ), ("config", POS, REQ), ("spans_only_cp", POS, True)],
    ("vfs", "_all_gather_var_tokens"): [("local", POS, REQ), ("group", POS, REQ), ("world", POS, REQ),
                                        ("token_counts", POS, REQ)],
    ("vfs", "_check_group_scope_for_trainable"): [("visual", POS, REQ), ("scope", POS, REQ)],
    ("vfs", "_contiguous_balanced_bounds"): [("patches", POS, REQ), ("world", POS, REQ),
                                             ("cost_alpha_source", KW, None), ("config", KW, None)],
    ("vfs", "_grid_for_visual"): [("grid_thw", POS, REQ), ("pixel_values", POS, REQ)],
    ("vfs", "_grid_list_for_planning"): [("grid_thw", POS, REQ)],
    ("vfs", "_infer_vision_hidden_size"): [("source", POS, REQ)],
    ("vfs", "_raise_if_any_rank_failed"): [("local_ok", POS, REQ), ("group", POS, REQ), ("device", POS, REQ),
                                           ("local_detail", POS, REQ)],
    ("vfs", "_vision_cost_alpha"): [("source", POS, None), ("config", POS, None)],
    ("vfs", "cp_vision_frame_sharding_active"): [],
    ("vfs", "maybe_distribute_visual"): [("visual", POS, REQ), ("pixel_values", POS, REQ),
                                         ("grid_thw", POS, REQ)],
    ("vfs", "reset_cp_vision_group"): [("token", POS, REQ)],
    ("vfs", "set_cp_vision_group"): [("group", POS, REQ), ("config", KW, REQ), ("spans_only_cp", KW, True)],
}
MODULES = {"step5": step5, "bd": bd, "sh": sh, "vfs": vfs}
MODULE_PATHS = [
    "cpshard.nemo.components.distributed.cp_vision_frame_shard",
    "cpshard.nemo.components.distributed.blockdiag_cp.batch",
    "cpshard.nemo.components.distributed.context_parallel",
    "cpshard.nemo.components.distributed.context_parallel.sharder",
    "cpshard.nemo.components.models.step5.cp",
]
FUNCTION_CLASSES = [(step5, "_GatherSequence"), (step5, "_GatherHalo"), (vfs, "_AllGatherSeqDiff")]


def _resolve(module: str, qualname: str):
    obj = MODULES[module]
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("path", MODULE_PATHS)
def test_module_paths_mirror_nemo(path):
    """Replacing the import prefix ``nemo_automodel`` with ``cpshard.nemo`` imports the module."""
    assert importlib.import_module(path).__name__ == path


@pytest.mark.parametrize("key", list(SIGNATURES), ids=lambda k: f"{k[0]}.{k[1]}")
def test_documented_signature(key):
    """The documented parameters come first, with the documented names, kinds and defaults; any
    further parameter is optional (a superset that NeMo's documented calls never see)."""
    obj = _resolve(*key)
    params = list(inspect.signature(obj).parameters.values())
    documented = SIGNATURES[key]
    got = [(p.name, p.kind, p.default) for p in params[: len(documented)]]
    assert got == documented
    for extra in params[len(documented):]:
        assert extra.kind == P.VAR_KEYWORD or extra.default is not P.empty, extra


@pytest.mark.parametrize("module, name", FUNCTION_CLASSES, ids=lambda v: getattr(v, "__name__", v))
def test_function_classes_are_autograd_functions(module, name):
    assert issubclass(getattr(module, name), torch.autograd.Function)


def test_package_exports_the_sharder():
    from cpshard.nemo.components.distributed import context_parallel

    assert context_parallel.ContextParallelSharder is sh.ContextParallelSharder


# --------------------------------------------------------------------------- py.typed


def test_py_typed_ships_with_the_package():
    """PEP 561 marker in the package and in its package data (so wheels carry it)."""
    assert resources.files("cpshard").joinpath("py.typed").is_file()
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["cpshard"]


# --------------------------------------------------------------------------- vision: config

CONFIG_FIELDS = ["enabled", "mesh_dims", "min_tokens", "min_frames", "min_local_patch_rows", "cost_alpha"]


def test_config_fields_defaults_and_order():
    """Frozen dataclass; NeMo's field order (positional construction means the same)."""
    cfg = vfs.CpVisionFrameShardingConfig()
    assert [f.name for f in dataclasses.fields(cfg)] == CONFIG_FIELDS
    assert [getattr(cfg, f) for f in CONFIG_FIELDS] == [False, ("cp",), 2048, 32, 96, "auto"]
    assert vfs.CpVisionFrameShardingConfig(True, ("cp",), 1, 2, 3, None).min_local_patch_rows == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.enabled = True
    # the mirror's config is cpshard's, so both APIs accept it
    assert isinstance(cfg, cpshard.CpVisionFrameShardingConfig)
    assert [f.name for f in dataclasses.fields(cpshard.CpVisionFrameShardingConfig)] == CONFIG_FIELDS


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"cost_alpha": True}, ValueError),
        ({"cost_alpha": "AUTO"}, ValueError),
        ({"cost_alpha": 1.5}, ValueError),
        ({"cost_alpha": -1}, ValueError),
        ({"min_local_patch_rows": True}, ValueError),
        ({"min_local_patch_rows": 1.5}, ValueError),
        ({"min_local_patch_rows": "96"}, ValueError),
        ({"min_tokens": -1}, ValueError),
        ({"min_frames": "32"}, ValueError),
        ({"enabled": 1}, TypeError),
        ({"mesh_dims": ["cp"]}, TypeError),
        ({"mesh_dims": ("tp",)}, ValueError),
        ({"mesh_dims": ("cp", "tp")}, ValueError),
    ],
)
def test_config_validation_exception_types(kwargs, exc):
    with pytest.raises(exc, match=next(iter(kwargs))):
        vfs.CpVisionFrameShardingConfig(**kwargs)


def test_config_valid_values():
    for alpha in ("auto", None, 0, 7):
        assert vfs.CpVisionFrameShardingConfig(cost_alpha=alpha).cost_alpha == alpha


# --------------------------------------------------------------------------- vision: scope


def test_group_holder_plain_get_set_reset():
    """``set`` returns the previous value (the token), ``reset(token)`` installs it back, in any
    order; a fresh holder is independent of the module's."""
    holder = vfs._GroupHolder()
    a = vfs._GroupScope(object(), vfs.CpVisionFrameShardingConfig(), True)
    b = vfs._GroupScope(object(), vfs.CpVisionFrameShardingConfig(), False)
    assert holder.get() is None
    t1 = holder.set(a)
    assert t1 is None and holder.get() is a
    t2 = holder.set(b)
    assert t2 is a and holder.get() is b
    holder.reset(t1)
    assert holder.get() is None
    holder.reset(t2)
    assert holder.get() is a
    assert vfs._CP_VISION_GROUP.get() is None


def test_group_scope_is_frozen_record():
    cfg = vfs.CpVisionFrameShardingConfig(enabled=True)
    scope = vfs._GroupScope("g", cfg, False)
    assert (scope.group, scope.config, scope.spans_only_cp) == ("g", cfg, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        scope.spans_only_cp = True


def test_set_and_reset_without_a_group():
    """``config`` is required (TypeError without it); ``set_cp_vision_group(None, config=...)``
    disables sharding and returns the previous scope; ``reset_cp_vision_group(None)`` clears."""
    cfg = vfs.CpVisionFrameShardingConfig(enabled=True)
    with pytest.raises(TypeError):
        vfs.set_cp_vision_group(None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        vfs.set_cp_vision_group(None, config={"enabled": True})  # type: ignore[arg-type]
    token = vfs.set_cp_vision_group(None, config=cfg)
    assert token is None and not vfs.cp_vision_frame_sharding_active()
    vfs.reset_cp_vision_group(None)
    assert vfs._CP_VISION_GROUP.get() is None and cpshard.current_cp_vision_scope() is None


# --------------------------------------------------------------------------- vision: planning


def _brute_force_bottleneck(costs: list[int], world: int) -> int:
    """The smallest largest-group cost over every contiguous partition (independent reference)."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), world - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


def test_contiguous_balanced_bounds_contract():
    """Cut points of length world+1, rank r owns [cuts[r], cuts[r+1]), >= 1 entry each,
    contiguous, deterministic; cost p*(p+alpha); None when entries < world."""
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        world = int(torch.randint(1, 5, (1,), generator=gen))
        patches = torch.randint(1, 40, (n,), generator=gen)
        alpha = [0, 5, 17][trial % 3]
        cfg = vfs.CpVisionFrameShardingConfig(cost_alpha=alpha)
        cuts = vfs._contiguous_balanced_bounds(patches, world, config=cfg)
        if n < world:
            assert cuts is None
            continue
        assert len(cuts) == world + 1 and cuts[0] == 0 and cuts[-1] == n
        assert all(b > a for a, b in itertools.pairwise(cuts))
        costs = [p * (p + alpha) for p in patches.tolist()]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(cuts))
        assert worst == _brute_force_bottleneck(costs, world)  # never worse than any cut
        assert vfs._contiguous_balanced_bounds(patches, world, config=cfg) == cuts
    # NeMo's documented exact-boundary example: 4 equal frames over 2 ranks split [2, 2]
    assert vfs._contiguous_balanced_bounds(torch.tensor([4, 4, 4, 4]), 2) == [0, 2, 4]
    with pytest.raises(ValueError):
        vfs._contiguous_balanced_bounds(torch.tensor([4, 0, 4]), 2)


def test_cost_alpha_source_and_config():
    """A configured int wins; "auto"/None = 3 x discovered width; unknown width -> 0."""
    qwen = SimpleNamespace(config=SimpleNamespace(hidden_size=1280, spatial_merge_size=2))
    assert vfs._vision_cost_alpha(qwen) == 3 * 1280
    assert vfs._vision_cost_alpha(qwen, vfs.CpVisionFrameShardingConfig(cost_alpha=None)) == 3 * 1280
    assert vfs._vision_cost_alpha(qwen, vfs.CpVisionFrameShardingConfig(cost_alpha=0)) == 0
    assert vfs._vision_cost_alpha(qwen, vfs.CpVisionFrameShardingConfig(cost_alpha=11)) == 11
    assert vfs._vision_cost_alpha(SimpleNamespace()) == 0
    assert vfs._vision_cost_alpha() == 0
    # the cost model reaches the partition: with alpha the big frame no longer dominates
    frames = torch.tensor([64] + [16] * 8)
    pure = vfs._contiguous_balanced_bounds(frames, 2, config=vfs.CpVisionFrameShardingConfig(cost_alpha=0))
    linear = vfs._contiguous_balanced_bounds(frames, 2, config=vfs.CpVisionFrameShardingConfig(cost_alpha=10**6))
    assert pure == [0, 1, 9] and linear == [0, 3, 9]
    assert vfs._contiguous_balanced_bounds(frames, 2, cost_alpha_source=SimpleNamespace(embed_dim=10**6)) == linear


@pytest.mark.parametrize(
    "source, width",
    [
        (SimpleNamespace(visual=SimpleNamespace(config=SimpleNamespace(hidden_size=1152))), 1152),  # Qwen
        (SimpleNamespace(config=SimpleNamespace(vit_hidden_size=1280, hidden_size=4096)), 1280),  # Nemotron Omni
        (SimpleNamespace(radio_model=SimpleNamespace(embed_dim=768)), 768),  # RADIO-style
        (SimpleNamespace(hidden_size=4096, vision_config=SimpleNamespace(hidden_size=1024)), 1024),
        ({"embed_dim": "1024"}, 1024),  # numeric-string widths (YAML / JSON configs)
        ({"vision_config": {"hidden_size": 512.0}}, 512),
        (SimpleNamespace(vit_hidden_size=torch.tensor(256)), 256),
        (SimpleNamespace(embed_dim=1024.5, hidden_size=64), 64),  # not a width: the root one counts
        (SimpleNamespace(hidden_size=640), 640),  # the tower itself
        (SimpleNamespace(), None),
        ({"embed_dim": "wide"}, None),
        (None, None),
    ],
)
def test_infer_vision_hidden_size(source, width):
    assert vfs._infer_vision_hidden_size(source) == width


def test_grid_helpers():
    grid = torch.tensor([[1, 4, 6], [3, 2, 2]], dtype=torch.int32)
    pixels = torch.zeros(36, 3)
    assert vfs._grid_for_visual(grid, pixels) is grid  # already there: the input, no copy
    rows, host = vfs._grid_list_for_planning(grid)
    assert rows == [[1, 4, 6], [3, 2, 2]]
    assert host.device.type == "cpu" and host.dtype == torch.int64 and host.tolist() == rows


def test_check_group_scope_for_trainable_without_collective():
    """Deterministic local check: a trainable tower over a group declared spans_only_cp=False
    raises ValueError; a frozen tower or a CP-only group passes."""
    tower = torch.nn.Linear(2, 2)
    cfg = vfs.CpVisionFrameShardingConfig(enabled=True)
    vfs._check_group_scope_for_trainable(tower, vfs._GroupScope(None, cfg, True))
    with pytest.raises(ValueError, match="spans_only_cp=False"):
        vfs._check_group_scope_for_trainable(tower, vfs._GroupScope(None, cfg, False))
    tower.requires_grad_(False)
    vfs._check_group_scope_for_trainable(tower, vfs._GroupScope(None, cfg, False))


def test_maybe_distribute_visual_plain_call_without_scope():
    """No scope: exactly ``visual(pixel_values, grid_thw=grid_thw, return_dict=True)``."""
    calls = []

    def visual(pv, grid_thw=None, return_dict=None, **kw):
        calls.append((pv, grid_thw, return_dict, kw))
        return SimpleNamespace(pooler_output=pv)

    pv, grid = torch.randn(8, 3), torch.tensor([[1, 2, 4]])
    out = vfs.maybe_distribute_visual(visual, pv, grid)
    assert out.pooler_output is pv and calls[-1][:3] == (pv, grid, True)
    vfs.maybe_distribute_visual(visual, None, None)
    assert calls[-1][:3] == (None, None, True)


# --------------------------------------------------------------------------- block-diagonal


def test_doc_ids_resolution_order():
    """``_packed_seq_ids`` first, else the 4-D block-causal mask's diagonal, else a 2-D mask,
    else one document; [B, S] int64, 0 == padding, on the requested device."""
    b, s = 2, 6
    packed = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 0, 0]])
    ids = bd._cp_blockdiag_doc_ids({"_packed_seq_ids": packed, "attention_mask": torch.ones(b, s)}, s, "cpu", b)
    assert ids.dtype == torch.int64 and torch.equal(ids, packed)
    block = torch.zeros(b, 1, s, s, dtype=torch.bool)
    for row, runs in enumerate([[(0, 2), (2, 5)], [(0, 4)]]):
        for lo, hi in runs:
            block[row, 0, lo:hi, lo:hi] = torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril()
    ids = bd._cp_blockdiag_doc_ids({"attention_mask": block}, s, "cpu", b)
    assert ids.tolist() == [[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]]
    mask2d = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert torch.equal(bd._cp_blockdiag_doc_ids({"attention_mask": mask2d}, s, "cpu", b), mask2d)
    ones = bd._cp_blockdiag_doc_ids({}, s, torch.device("cpu"), b)
    assert torch.equal(ones, torch.ones(b, s, dtype=torch.int64))


def test_blockdiag_batch_single_rank():
    """cp size 1: nothing is padded; attention_mask dropped, padding_mask added (True = pad,
    bool, the batch's device), loss_mask stored back; the batch is updated in place."""
    b, s, h = 2, 5, 3
    embeds = torch.randn(b, s, h, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    loss_mask = torch.ones(b, s)
    batch = {"inputs_embeds": embeds, "attention_mask": mask, "position_ids": torch.arange(s).expand(b, s)}
    ctx, out = bd.make_cp_blockdiag_batch_and_ctx(None, None, batch, loss_mask=loss_mask)
    assert out is batch and "attention_mask" not in out
    assert out["padding_mask"].dtype == torch.bool and out["padding_mask"].device == embeds.device
    assert out["padding_mask"].tolist() == (mask == 0).tolist()
    assert torch.equal(out["loss_mask"], loss_mask) and torch.equal(out["inputs_embeds"], embeds)
    assert callable(ctx) and hasattr(ctx(), "__enter__")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_blockdiag_batch_device_follows_the_batch():
    """The device bug: ``padding_mask`` and the document ids live on the batch's device."""
    dev = torch.device("cuda")
    b, s = 1, 6
    batch = {"inputs_embeds": torch.randn(b, s, 4, device=dev),
             "_packed_seq_ids": torch.tensor([[1, 1, 2, 2, 0, 0]], device=dev)}
    _, out = bd.make_cp_blockdiag_batch_and_ctx(None, None, batch)
    assert out["padding_mask"].device.type == "cuda" and out["_packed_seq_ids"].device.type == "cuda"
    assert out["padding_mask"].cpu().tolist() == [[False] * 4 + [True] * 2]
    assert bd._cp_blockdiag_doc_ids(batch, s, dev, b).device.type == "cuda"


def test_cp_blockdiag_sdpa_accepts_nemo_calls_without_state():
    """No active state: plain SDPA (with the mask); extra keyword arguments are accepted."""
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.allclose(bd_runtime.cp_blockdiag_sdpa(q, k, v, mask, position_ids=None), ref)


# --------------------------------------------------------------------------- step5 at one rank


def test_step5_without_cp_aliases():
    """``group=None``: gather_sequence / gather_metadata return x itself; gather_halo has
    ``left_padding + 0 + L`` positions with the zero padding first."""
    x = torch.randn(2, 5, 3)
    assert step5.gather_sequence(x, None) is x
    assert step5.gather_metadata(x, None) is x
    out = step5.gather_halo(x, None, 4, left_padding=2)
    assert out.shape == (2, 7, 3) and not out[:, :2].any() and torch.equal(out[:, 2:], x)
    y = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    (step5._GatherSequence.apply(y, None) * 3).sum().backward()
    assert torch.equal(y.grad, torch.full_like(y, 3))
    y.grad = None
    halo = step5._GatherHalo.apply(y, None, 3, 1)
    assert halo.shape == (2, 6, 3)
    halo.sum().backward()
    assert torch.equal(y.grad, torch.ones_like(y))


# --------------------------------------------------------------------------- sharder: one rank


def test_shard_layout_record():
    """NeMo's ShardLayout: frozen, every field optional (None)."""
    lay = sh.ShardLayout()
    assert [f.name for f in dataclasses.fields(lay)] == [
        "local_token_global_indices", "original_seq_len", "padded_seq_len", "input_row_shape",
        "input_token_stream_positions",
    ]
    assert all(getattr(lay, f.name) is None for f in dataclasses.fields(lay))
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.padded_seq_len = 4


def _noop_shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0):
    return (lambda: torch.no_grad()), batch, None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": torch.nn.Linear(1, 1), "shard_batch": _noop_shard_batch},
        {"batch": {}, "shard_batch": _noop_shard_batch},
        {"num_chunks": 2, "shard_batch": _noop_shard_batch},
        {"invoke_pre_embed": False, "shard_batch": _noop_shard_batch},
        {"extra_seq_buffers": {"x": 1}, "shard_batch": _noop_shard_batch},
        {"local_token_global_indices": lambda m, p, d: torch.arange(p), "batch": {}},
        {"shard_layout": sh.ShardLayout(padded_seq_len=4), "batch": {}},
        {},  # the resolution form needs a batch
    ],
)
def test_constructor_forms_are_exclusive(kwargs):
    with pytest.raises(TypeError):
        sh.ContextParallelSharder(**kwargs)


def test_identity_sharder_at_cp_size_one():
    """Resolution with no CP: the batch is returned unchanged and the verbs are identities."""
    batch = {"input_ids": torch.arange(7)[None], "labels": torch.arange(7)[None]}
    sharder = sh.ContextParallelSharder(device_mesh=None, batch=batch)
    ctx, out = sharder.shard(batch)
    assert out is batch and torch.equal(out["input_ids"], torch.arange(7)[None])
    assert sharder.shard_layout == sh.ShardLayout(original_seq_len=7, padded_seq_len=7)
    t = torch.randn(1, 7, 2)
    assert torch.equal(sharder.shard_token_tensor(t), t)
    assert torch.equal(sharder.gather_token_tensor(t, trim=True), t)
    assert torch.equal(sharder._indices(7, "cpu"), torch.arange(7))
    with ctx():
        pass


def test_data_dependent_direct_form_before_first_shard():
    """Direct form without index callable or layout: the token verbs raise NotImplementedError
    before the first shard; ``trim=True`` without a layout too."""
    sharder = sh.ContextParallelSharder(shard_batch=_noop_shard_batch)
    assert sharder.local_token_global_indices is None and sharder.shard_layout is None
    t = torch.randn(1, 4)
    for call in (lambda: sharder.shard_token_tensor(t), lambda: sharder.gather_token_tensor(t),
                 lambda: sharder.gather_token_tensor(t, trim=True), lambda: sharder._indices(4, "cpu")):
        with pytest.raises(NotImplementedError, match="data-dependent|no shard layout"):
            call()
    closed = sh.ContextParallelSharder(shard_batch=_noop_shard_batch,
                                       local_token_global_indices=lambda m, p, d=None: torch.arange(p))
    with pytest.raises(NotImplementedError, match="no shard layout to trim"):
        closed.gather_token_tensor(t, trim=True)
    assert torch.equal(closed.gather_token_tensor(t), t)


def test_direct_form_reports_and_uses_nemo_layouts():
    """A custom shard_batch returning a NeMo ShardLayout: ``shard`` stores that very object;
    the verbs follow it (original length padded with ``fill``, trimmed back; other lengths
    raise ValueError)."""

    def shard_batch(cp_mesh, tp_mesh, batch, *, loss_mask=None, padding_token_id=0):
        ids = torch.nn.functional.pad(batch["input_ids"], (0, 3), value=padding_token_id)
        return (lambda: torch.no_grad()), {"input_ids": ids}, layout

    layout = sh.ShardLayout(local_token_global_indices=torch.arange(8), original_seq_len=5, padded_seq_len=8)
    sharder = sh.ContextParallelSharder(shard_batch=shard_batch, padding_token_id=9)
    ctx, out = sharder.shard({"input_ids": torch.arange(5)[None]})
    assert sharder.shard_layout is layout and out["input_ids"].tolist() == [[0, 1, 2, 3, 4, 9, 9, 9]]
    assert sharder.shard_token_tensor(torch.arange(5)[None], fill=-1).tolist() == [[0, 1, 2, 3, 4, -1, -1, -1]]
    assert torch.equal(sharder.gather_token_tensor(torch.arange(8)[None], trim=True), torch.arange(5)[None])
    with pytest.raises(ValueError):
        sharder.shard_token_tensor(torch.arange(6)[None], fill=0)
    with pytest.raises(TypeError):
        sharder.shard_layout = {"padded_seq_len": 8}
    # reported indices are flattened and cast to int64, and checked against the length asked for
    sharder.shard_layout = sh.ShardLayout(local_token_global_indices=torch.tensor([[1, 0]], dtype=torch.int32))
    assert torch.equal(sharder._indices(2, None), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="does not match"):
        sharder._indices(6, None)


# --------------------------------------------------------------------------- NeMo's conventions


class _RecordingTower(torch.nn.Module):
    """A trainable tower: per-row linear then a mean over each ``merge**2`` rows; records its
    calls (the pixel rows and grid it was given)."""

    spatial_merge_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 3, dtype=torch.float64)
        self.calls: list[tuple[object, object]] = []

    def forward(self, pixel_values, grid_thw=None, return_dict=True):
        self.calls.append((pixel_values, grid_thw))
        if pixel_values is None:
            return SimpleNamespace(pooler_output=torch.zeros(1, 3), deepstack_features=None)
        merged = self.proj(pixel_values).reshape(-1, 4, 3).mean(dim=1)
        return SimpleNamespace(pooler_output=merged, deepstack_features=None)


def _media(entries: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(entries, dtype=torch.long)
    rows = int(grid.prod(dim=-1).sum())
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64), grid


@pytest.fixture
def _unusable_group():
    """A published group cpshard cannot resolve (``object()``), reset afterwards."""
    tokens = []

    def publish(config, spans_only_cp: bool = True):
        tokens.append(vfs.set_cp_vision_group(object(), config=config, spans_only_cp=spans_only_cp))

    yield publish
    for token in reversed(tokens):
        vfs.reset_cp_vision_group(token)
    assert cpshard.current_cp_vision_scope() is None


def test_vision_group_is_checked_when_used_not_when_set(_unusable_group):
    """``set_cp_vision_group`` accepts any group; the fall-backs that need none (no media,
    disabled, a small workload) and the trainable-tower check run before the group is used;
    only a call that would shard raises ``TypeError`` naming the published group and the rank.
    cpshard's own ``set_cp_vision_group`` still checks its group when it is set."""
    pixels, grid = _media([(1, 2, 2), (1, 4, 4), (2, 2, 4)])
    cfg = vfs.CpVisionFrameShardingConfig(enabled=True, min_tokens=0, min_frames=32)
    _unusable_group(cfg)
    assert isinstance(vfs._CP_VISION_GROUP.get(), vfs._GroupScope)
    tower = _RecordingTower()
    want = tower(pixels, grid_thw=grid).pooler_output
    tower.calls.clear()
    # no media: the plain call with both arguments unchanged
    for pv, g in ((None, None), (pixels, None), (None, grid)):
        out = vfs.maybe_distribute_visual(tower, pv, g)
        assert tower.calls[-1][0] is pv and tower.calls[-1][1] is g
        assert out.pooler_output.shape == ((1, 3) if pv is None else (9, 3))
    # a trainable tower over a group not declared CP-only: ValueError before the group is used
    _unusable_group(cfg, spans_only_cp=False)
    with pytest.raises(ValueError, match="spans_only_cp"):
        vfs.maybe_distribute_visual(tower, pixels, grid)
    # the same call would shard: now the group is used, and refused
    _unusable_group(cfg)
    with pytest.raises(TypeError, match=r"rank 0: the group published by set_cp_vision_group") as info:
        vfs.maybe_distribute_visual(tower, pixels, grid)
    assert "got object" in str(info.value)
    with pytest.raises(TypeError, match="set_cp_vision_group"):
        cpshard.cp_vision_frame_sharding_active()
    # disabled, then below both minimums: the plain call, equal to the tower's own output
    for policy in (vfs.CpVisionFrameShardingConfig(enabled=False, min_tokens=0),
                   vfs.CpVisionFrameShardingConfig(enabled=True, min_tokens=999, min_frames=999)):
        _unusable_group(policy)
        tower.calls.clear()
        out = vfs.maybe_distribute_visual(tower, pixels, grid)
        assert len(tower.calls) == 1 and tower.calls[0][0] is pixels
        assert torch.equal(out.pooler_output, want)
    with pytest.raises(TypeError, match="got object"):
        cpshard.set_cp_vision_group(object())
    with pytest.raises(TypeError, match="spans_only_cp"):
        vfs.set_cp_vision_group(object(), config=cfg, spans_only_cp=1)  # type: ignore[arg-type]


def test_vision_disabled_scope_is_inactive_without_using_its_group(_unusable_group):
    _unusable_group(vfs.CpVisionFrameShardingConfig(enabled=False))
    assert vfs.cp_vision_frame_sharding_active() is False
    assert cpshard.cp_vision_frame_sharding_active() is False


def test_doc_ids_prefer_packed_ids_over_a_disagreeing_mask():
    """``_packed_seq_ids`` wins over a 4-D block-causal mask that says otherwise (NeMo's
    documented preference), in the doc-id helper and in the batch builder; cpshard's own
    :func:`cpshard.document_ids` still refuses the contradiction."""
    b, s = 1, 6
    packed = torch.tensor([[1, 1, 2, 2, 2, 0]])
    block = torch.ones(b, 1, s, s, dtype=torch.bool).tril()  # one document, no padding
    batch = {"_packed_seq_ids": packed, "attention_mask": block}
    assert torch.equal(bd._cp_blockdiag_doc_ids(batch, s, "cpu", b), packed)
    with pytest.raises(ValueError):
        cpshard.document_ids(batch, s, "cpu", b)
    embeds = torch.randn(b, s, 2)
    ctx, out = bd.make_cp_blockdiag_batch_and_ctx(
        None, None, {"inputs_embeds": embeds, "_packed_seq_ids": packed, "attention_mask": block}
    )
    assert "attention_mask" not in out
    assert out["padding_mask"].tolist() == [[False] * 5 + [True]]


class _DuckMesh:
    """NeMo's duck-typed CP mesh: ``get_group()``, ``size()``, ``get_local_rank()``."""

    def __init__(self, size: int, rank: int = 0, group=None) -> None:
        self._size, self._rank, self._group = size, rank, group

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def get_group(self):
        return self._group


class _DuckDeviceMesh(dict):
    """A duck-typed device mesh: ``mesh_dim_names`` and ``mesh["cp"]``."""

    def __init__(self, cp) -> None:
        super().__init__(cp=cp)
        self.mesh_dim_names = ["cp"]


def test_duck_meshes_single_rank_and_offline():
    """A duck mesh of one rank is no CP; an offline one (no process group while
    torch.distributed is not initialized) gives its rank and size to the layout-only verbs."""
    embeds = torch.randn(1, 5, 2)
    for mesh in (_DuckMesh(1), _DuckMesh(1, group=object())):
        _, out = bd.make_cp_blockdiag_batch_and_ctx(mesh, None, {"inputs_embeds": embeds.clone()})
        _, want = bd.make_cp_blockdiag_batch_and_ctx(None, None, {"inputs_embeds": embeds.clone()})
        assert torch.equal(out["inputs_embeds"], want["inputs_embeds"])
        assert torch.equal(out["padding_mask"], want["padding_mask"])
    assert not torch.distributed.is_initialized()
    layout = sh.ShardLayout(local_token_global_indices=torch.tensor([[5, 4, 1]], dtype=torch.int32))
    sharder = sh.ContextParallelSharder(
        device_mesh=_DuckDeviceMesh(_DuckMesh(2, rank=1)),
        shard_batch=lambda *a, **k: (contextlib.nullcontext, {}, None), shard_layout=layout,
    )
    assert torch.equal(sharder._indices(6, None), torch.tensor([5, 4, 1]))
    with pytest.raises(ValueError, match=r"rank 1: .*3 local x cp_size 2.*padded_seq_len=8.*does not match"):
        sharder._indices(8, None)
    data_dependent = sh.ContextParallelSharder(
        device_mesh=_DuckDeviceMesh(_DuckMesh(2)), shard_batch=lambda *a, **k: (contextlib.nullcontext, {}, None)
    )
    with pytest.raises(NotImplementedError, match="data-dependent"):
        data_dependent.shard_token_tensor(torch.randn(1, 8))
    with pytest.raises(TypeError, match=r"cp_mesh\.get_group\(\) returned None"):
        class _NoRank:
            def size(self):
                return 2

            def get_group(self):
                return None
        bd.make_cp_blockdiag_batch_and_ctx(_NoRank(), None, {"inputs_embeds": embeds.clone()})


def test_offline_duck_mesh_of_two_ranks_shards_the_block_diagonal_batch():
    """NeMo's offline two-rank mesh (a stand-in group while torch.distributed is not
    initialised): each rank's batch is its contiguous half, with the per-step agreement local
    (no collective can run); a collective over that group raises naming the rank."""
    assert not torch.distributed.is_initialized()
    embeds = torch.randn(1, 6, 3)
    batch = {
        "inputs_embeds": embeds,
        "labels": torch.arange(6).view(1, 6),
        "_packed_seq_ids": torch.tensor([[1, 1, 1, 2, 2, 0]]),
    }
    loss_mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    for rank in (0, 1):
        mesh = _DuckMesh(2, rank=rank, group=object())
        _, out = bd.make_cp_blockdiag_batch_and_ctx(mesh, None, dict(batch), loss_mask=loss_mask)
        mine = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(out["inputs_embeds"], embeds[:, mine])
        assert torch.equal(out["loss_mask"], loss_mask[:, mine])
        assert torch.equal(out["padding_mask"], torch.tensor([[False, False, False, False, False, True]])[:, mine])
    with pytest.raises(RuntimeError, match="rank 1 of 2: this CP group has no process group"):
        cpshard.gather_sequence(torch.randn(1, 3), cpshard.comm.Group(None, 1, 2))
