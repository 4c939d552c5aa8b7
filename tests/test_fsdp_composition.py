"""CP under FSDP2 on a (dp, cp) = (2, 2) mesh of gloo ranks: three steps of a tiny Llama
(float64, AdamW with clipping, packed batches from ``DataCollatorWithFlattening``) equal the
same training in one process, where each replica's documents run one by one and the replicas'
losses are averaged. The training loop is the example's (``examples/cp_fsdp.py``), so the
recipe docs/training.md gives is the one tested:

* FSDP2 over the flattened (dp, cp) mesh and HSDP: ``cp_cross_entropy`` and nothing else;
* FSDP2 over dp alone: plus ``reduce_cp_gradients(model, cp_group)`` after ``backward()``,
  which reduces the DTensor gradients' local shards;
* ``reduce_cp_gradients`` on gradients FSDP2 already averaged over the CP ranks (the flattened
  mesh, HSDP): refused on every rank, saying what to do.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from tests.helpers import EXAMPLES

pytest.importorskip("transformers")
sys.path.insert(0, str(EXAMPLES))

import cp_fsdp  # noqa: E402

import cpshard  # noqa: E402

PARAM_TOL = 1e-12
LOSS_TOL = 1e-12


def _modes(rank: int, world: int) -> dict[str, dict]:
    return {fsdp: cp_fsdp.train(rank, world, 2, 2, fsdp, steps=3) for fsdp in cp_fsdp.FSDP_MODES}


def check_training(results: list[dict[str, dict]]) -> None:
    """Every rank's runs: the parameters after the last step and every step's loss equal the
    single-process run's."""
    for rank, runs in enumerate(results):
        for name, run in runs.items():
            assert run["max_param_diff"] <= PARAM_TOL, (rank, name, run["max_param_diff"])
            assert len(run["cp"]) >= 3
            for step, (cp, ref) in enumerate(zip(run["cp"], run["reference"], strict=True)):
                assert abs(cp - ref) <= LOSS_TOL, (rank, name, step, cp, ref)


def test_fsdp2_flat_hsdp_and_dp_equal_single_process(pool4):
    check_training(pool4.run(_modes, timeout=300))


def _reduce_after_fsdp(rank: int, world: int) -> dict[str, str]:
    """FSDP2 over the flattened mesh, HSDP (the 2-D mesh: replicated over dp, sharded over cp)
    and FSDP2 over dp alone, each followed by ``reduce_cp_gradients``: the error on this rank
    ('no error' when it reduced)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    meshes = {"flat": mesh["dp", "cp"]._flatten("dp_cp"), "hsdp": mesh, "dp": mesh["dp"]}
    out = {}
    for name, fsdp_mesh in meshes.items():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).double()
        fully_shard(model, mesh=fsdp_mesh)
        model(torch.randn(2, 4, dtype=torch.float64)).sum().backward()
        try:
            cpshard.reduce_cp_gradients(model, mesh["cp"].get_group())
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
        dist.barrier()
    return out


def test_reduce_refuses_gradients_fsdp2_averaged_over_cp(pool4):
    """Flattened mesh and HSDP: FSDP2 averaged over the CP ranks already, so reducing again is
    refused on every rank; over dp alone it is the reduction FSDP2 leaves to do."""
    for rank, outcomes in enumerate(pool4.run(_reduce_after_fsdp, timeout=60)):
        for mode in ("flat", "hsdp"):
            message = outcomes[mode]
            head = f"cpshard.reduce_cp_gradients: rank {rank % 2}: parameters["  # its CP rank
            assert message.startswith(head), (rank, mode, message)
            assert "already averaged it over the CP group" in message, (rank, mode, message)
            assert "do not call reduce_cp_gradients" in message, (rank, mode, message)
        assert outcomes["dp"] == "no error", (rank, outcomes["dp"])
