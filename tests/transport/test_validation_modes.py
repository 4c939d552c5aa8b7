"""The validation model of the per-call transport (docs/validation.md): a hot path that issues
nothing but its transfers, fit for GPUs.

* Default mode: a steady-state ``gather_sequence`` / ``gather_ragged`` / ``gather_halo`` call
  issues exactly its data transfer (one batched point-to-point on gloo) and its backward exactly
  the dual transfer; checked mode (``cpshard.check_mode("call")``) adds exactly one round.
* Default mode, bad input on one rank: never a silent wrong answer. The bad rank raises its local
  problem at once and its peers fail in the transfer; a cross-rank mismatch that no local check
  sees changes the call's fingerprint, which is the messages' tag, so the ranks never exchange
  data and fail by the group's timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard import check_mode, gather_halo, gather_ragged, gather_sequence
from cpshard.testing import RankPool
from tests.helpers import GATHER_ERROR_CASES, call_gather_case, counting_collectives

F64 = torch.float64


def _calls(rank: int, world: int) -> dict[str, dict[str, dict[str, int]]]:
    """Collective counts of each function's forward and backward, in both modes."""
    g = dist.group.WORLD
    counts = [2 + r for r in range(world)]
    functions = {
        "gather_sequence": lambda x: gather_sequence(x, g, seq_dim=1),
        "gather_ragged": lambda x: gather_ragged(x, g, counts, dim=1),
        "gather_halo": lambda x: gather_halo(x, g, 3, seq_dim=1),
    }
    out: dict[str, dict[str, dict[str, int]]] = {}
    for mode in ("step", "call"):
        for name, fn in functions.items():
            n = counts[rank] if name == "gather_ragged" else 4
            x = torch.randn(2, n, 3, dtype=F64, requires_grad=True)
            with check_mode(mode):
                fn(x).sum().backward()  # warm-up: the steady state is what is counted
                with counting_collectives() as fwd:
                    y = fn(x)
                with counting_collectives() as bwd:
                    y.sum().backward()
            out[f"{name} {mode}"] = {"forward": dict(fwd), "backward": dict(bwd)}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_steady_state_call_issues_only_its_transfer(pools, world):
    for rank_counts in pools(world).run(_calls, timeout=120):
        for name in ("gather_sequence", "gather_ragged", "gather_halo"):
            default = rank_counts[f"{name} step"]
            checked = rank_counts[f"{name} call"]
            assert default["forward"] == {"batch_isend_irecv": 1}, (name, default)
            backward = "batch_isend_irecv" if name == "gather_halo" else "all_to_all_single"
            assert default["backward"] == {backward: 1}, (name, default)
            # checked mode: one consensus round (an all-to-all on the host channel) more
            assert checked["forward"] == {"batch_isend_irecv": 1, "all_to_all_single": 1}, (name, checked)
            assert checked["backward"] == default["backward"], (name, checked)


PG_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def short_pool2():
    with RankPool(2, pg_timeout=PG_TIMEOUT, grace=PG_TIMEOUT + 10) as pool:
        yield pool


# Cases whose bad rank sees its own problem locally (the rest are cross-rank mismatches).
_LOCAL = {
    "ragged_wrong_count", "ragged_counts_too_long", "ragged_counts_too_short",
    "ragged_counts_negative", "ragged_counts_tensor", "ragged_dim_out_of_range",
    "ragged_not_tensor", "seq_dim_out_of_range", "seq_not_tensor", "meta_requires_grad",
    "halo_negative", "halo_list_wrong_length", "halo_not_int", "halo_negative_padding",
    "halo_dim_out_of_range", "halo_not_tensor",
}


@pytest.mark.parametrize("case", list(GATHER_ERROR_CASES))
def test_default_mode_bad_input_never_silent(short_pool2, case):
    short_pool2.start()
    bad = 1
    outcomes = short_pool2.run_collect(call_gather_case, case, bad, "step", timeout=PG_TIMEOUT + 20)
    for o in outcomes:
        assert not o.ok, f"rank {o.rank} returned {o.value!r}: a silent answer to bad input"
        assert not o.timed_out, f"rank {o.rank} hung past the group's timeout:\n{o.traceback}"
    own = outcomes[bad]
    if case in _LOCAL:
        assert own.error_type in ("ValueError", "TypeError"), (own.error_type, own.error_message)
        assert f"rank {bad}" in own.error_message, own.error_message
    for o in outcomes:
        # a local check's error, or the transfer's failure: the group's timeout (or a peer's
        # read error once the other side gave up)
        assert o.error_type in ("ValueError", "TypeError", "RuntimeError", "DistBackendError"), (
            o.rank, o.error_type, o.error_message
        )


def _store_channel(rank: int, world: int) -> dict[str, object]:
    """A non-gloo (NCCL) group's consensus runs over its store, not a GPU collective: exercised
    on CPU by presenting a gloo group as an NCCL one, after subgroups of every shape exist."""
    from cpshard.comm import Group, all_gather_bytes, resolve_group
    from cpshard.consensus import agree

    dist.new_group(list(range(1, world)))
    for r in range(world):
        dist.new_group([r])
    g = resolve_group(dist.group.WORLD, "test")
    original = Group.backend
    Group.backend = property(lambda self: "nccl")  # type: ignore[method-assign]
    verdicts = []
    try:
        with counting_collectives() as seen:
            for round_ in range(4):  # several rounds: keys are reused safely
                try:
                    agree(g, "store.check", "bad here" if rank == round_ % world else None)
                    verdicts.append("passed")
                except ValueError as exc:
                    verdicts.append(str(exc))
        payloads = all_gather_bytes(bytes([rank]) * (rank + 1), g)
    finally:
        Group.backend = original  # type: ignore[method-assign]
    return {"verdicts": verdicts, "collectives": dict(seen), "payloads": payloads}


@pytest.mark.parametrize("world", [2, 3])
def test_consensus_of_a_non_gloo_group_runs_over_its_store(pools, world):
    for rank, out in enumerate(pools(world).run(_store_channel, timeout=60)):
        assert out["collectives"] == {}, out["collectives"]
        assert out["payloads"] == [bytes([r]) * (r + 1) for r in range(world)]
        for round_, verdict in enumerate(out["verdicts"]):
            bad = round_ % world
            expected = f"rank {bad}: bad here" if rank == bad else f"rank {bad} failed"
            assert expected in verdict, (round_, verdict)
