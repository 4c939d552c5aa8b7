"""The one-process simulation of a rank plans exactly what that rank of a real job plans, and
the pieces around it (document specs, rank choice, head shapes)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from cpshard.layouts import LAYOUTS
from cpshard.simulation import (
    HeadShape,
    document_ids,
    document_lengths,
    plan_step,
    rank_plan,
    shape_from_model,
    simulated_rank,
)
from cpshard.simulation.ranks import default_ranks, parse_ranks
from tests.helpers import cp_mesh

SHAPE = HeadShape(heads=8, kv_heads=2, head_dim=4, layers=3, window=None, dtype_bytes=4)
SEQ = 96


def _ids() -> torch.Tensor:
    """Long-tailed documents and trailing padding."""
    return document_ids(document_lengths("20,9,40,1,3,11", SEQ), SEQ)


def _fingerprint(group, layout: str, strategy: str, ids: torch.Tensor, shape: HeadShape) -> dict:
    """Everything the simulation reports of this rank, with the state's spans and counts."""
    state, lay, _ = plan_step(group, layout, strategy, ids)
    plan = dataclasses.asdict(rank_plan(state, lay, ids, shape, 0.0))
    ex = state.windowed(shape.window).exchange
    counts = {
        name: list(getattr(ex, name)) for name in ("recv_counts", "send_counts", "halos")
        if hasattr(ex, name)
    }  # fmt: skip
    return {
        **plan, **counts, "key_len": ex.key_len, "received_rows": ex.received_rows,
        "spans": [tuple(s) for s in state.spans],
    }  # fmt: skip


def _real(rank: int, world: int, sub: int, mesh, ids, shape) -> dict | None:
    """Every layout's fingerprint on the first ``sub`` ranks of the pool (one subgroup: one pool
    serves every world size), or on a 2-D ``mesh``; None on the other ranks."""
    group = cp_mesh(*mesh) if mesh else dist.new_group(list(range(sub)))
    if rank >= sub:
        return None
    layouts = ("head_tail", "contiguous") if mesh else LAYOUTS
    return {layout: _fingerprint(group, layout, "auto", ids, shape) for layout in layouts}


def _simulated(world: int, layout: str, ids, shape, mesh) -> list[dict]:
    out = []
    for rank in range(world):
        with simulated_rank(rank, world, mesh) as group:
            out.append(_fingerprint(group, layout, "auto", ids, shape))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_simulated_ranks_equal_real_ranks(pool4, world: int) -> None:
    ids, shape = _ids(), dataclasses.replace(SHAPE, window=7)
    real = pool4.run(_real, world, None, ids, shape, timeout=60)[:world]
    for layout in LAYOUTS:
        assert _simulated(world, layout, ids, shape, None) == [r[layout] for r in real], layout


def test_simulated_mesh_equals_real_mesh(pool4) -> None:
    ids = _ids()
    real = pool4.run(_real, 4, (2, 2), ids, SHAPE, timeout=60)
    for layout in ("head_tail", "contiguous"):
        simulated = _simulated(4, layout, ids, SHAPE, (2, 2))
        assert simulated == [r[layout] for r in real], layout
        assert "hierarchical" in simulated[0]["busiest_bytes"]


def test_simulated_rank_restores_no_group() -> None:
    with simulated_rank(1, 3) as group:
        assert dist.get_rank(group) == 1 and dist.get_world_size(group) == 3
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="rank: 3"):
        with simulated_rank(3, 3):
            pass


@pytest.mark.parametrize("spec", ["one", "equal:7", "uniform:13", "pareto:50"])
def test_document_specs_fill_the_sequence(spec: str) -> None:
    lengths = document_lengths(spec, 1000, seed=3)
    assert sum(lengths) == 1000 and min(lengths) >= 1
    assert lengths == document_lengths(spec, 1000, seed=3)  # deterministic
    ids = document_ids(lengths, 1000)
    assert ids.shape == (1, 1000) and int(ids.max()) == len(lengths) and int(ids.min()) == 1


def test_pareto_has_a_long_tail() -> None:
    lengths = document_lengths("pareto:1024", 1 << 20)
    assert len(lengths) == 1024 and max(lengths) > 20 * (1 << 20) // 1024


def test_explicit_lengths_pad_the_rest() -> None:
    ids = document_ids(document_lengths("3,2", 8), 8)
    assert ids.tolist() == [[1, 1, 1, 2, 2, 0, 0, 0]]


@pytest.mark.parametrize(
    "spec, message",
    [("zipf:3", "unknown distribution"), ("pareto:0", "count"), ("5,x", "neither"),
     ("0,3", ">= 1"), ("6,6", "more than --seq-len")],
)  # fmt: skip
def test_bad_document_specs_name_the_option(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"--docs: .*{message}"):
        document_lengths(spec, 10)


def test_rank_choice() -> None:
    assert default_ranks(64) == list(range(64))
    picked = default_ranks(256)
    assert {0, 1, 128, 255} <= set(picked) and len(picked) == 8 and picked == default_ranks(256)
    assert parse_ranks("all", 100) == list(range(100))
    assert parse_ranks("5,1,5", 8) == [1, 5]
    with pytest.raises(ValueError, match="--ranks"):
        parse_ranks("8", 8)


def test_shape_from_a_config_file(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
        "num_hidden_layers": 32, "sliding_window": 4096, "use_sliding_window": False,
    }))  # fmt: skip
    assert shape_from_model(str(path)) == HeadShape(32, 8, 128, 32, None, 2)
    assert shape_from_model(str(tmp_path), 4, layers=2).layers == 2
    with pytest.raises(ValueError, match="--model"):
        shape_from_model("NoSuchConfigAnywhere")
    with pytest.raises(ValueError, match="--kv-heads"):
        HeadShape(heads=6, kv_heads=4, head_dim=8)
