"""Smoke tests of cpshard.testing: the multi-process harness the other tests rely on."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from cpshard.testing import RankError, RankPool, RankTimeoutError, run_ranks

# Worker-side functions: module level, so that they pickle by reference.


def _rank_input(rank: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * (rank + 1) + rank


def _collectives(rank: int, world: int, n: int) -> dict:
    x = _rank_input(rank, n)
    summed = x.clone()
    dist.all_reduce(summed)
    gathered = torch.empty(world * n, dtype=x.dtype)
    dist.all_gather_into_tensor(gathered, x)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(dist.group.WORLD),
        "sum": summed,
        "gathered": gathered,
    }


def _worker_info(rank: int, world: int) -> dict:
    return {
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "backend": dist.get_backend(),
    }


def _echo_tensors(rank: int, world: int, base: torch.Tensor, *, scale: int) -> dict:
    t = base * scale + rank
    return {
        "scaled": t,
        "view": t.t(),  # non-contiguous
        "mask": t > rank,
        "half": t.to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "nested": [t.sum(), (t[0],)],
    }


def _raise_on_rank(rank: int, world: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"bad input on rank {rank}")
    return rank


def _raise_everywhere(rank: int, world: int) -> None:
    raise KeyError(f"missing key of rank {rank}")


def _raise_while_others_reduce(rank: int, world: int) -> None:
    if rank == world - 1:
        raise RuntimeError("failed before the collective")
    dist.all_reduce(torch.ones(1))


class _Unpicklable(Exception):
    def __init__(self, what: str, lock: threading.Lock) -> None:
        super().__init__(what)
        self.lock = lock


def _unpicklable_outcomes(rank: int, world: int) -> object:
    if rank == 0:
        raise _Unpicklable("holds a lock", threading.Lock())
    return threading.Lock()


def _lonely_all_reduce(rank: int, world: int) -> int:
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # no other rank joins: blocks until killed
    return rank


def _identity(rank: int, world: int, value: object) -> object:
    return value


def _check_collectives(pool: RankPool, n: int = 5) -> None:
    world = pool.world
    results = pool.run(_collectives, n, timeout=30)
    inputs = [_rank_input(r, n) for r in range(world)]
    expected_sum = torch.stack(inputs).sum(0)
    expected_gather = torch.cat(inputs)
    assert len(results) == world
    for rank, result in enumerate(results):
        assert (result["rank"], result["world"]) == (rank, world)
        assert torch.equal(result["sum"], expected_sum)
        assert torch.equal(result["gathered"], expected_gather)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_match_reference(pools, world):
    _check_collectives(pools(world))


@pytest.mark.parametrize("world", [1, 4])
def test_workers_are_reused_and_configured(pools, world):
    pool = pools(world)
    first = pool.run(_worker_info)
    second = pool.run(_worker_info)
    pids = [info["pid"] for info in first]
    assert pids == [info["pid"] for info in second] == pool.pids
    assert len(set(pids)) == world and os.getpid() not in pids
    for info in first:
        assert (info["threads"], info["omp"], info["backend"]) == (1, "1", "gloo")


def test_tensors_round_trip(pool2):
    base = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    results = pool2.run(_echo_tensors, base, scale=3)
    for rank, got in enumerate(results):
        expected = base * 3 + rank
        assert torch.equal(got["scaled"], expected)
        assert torch.equal(got["view"], expected.t())
        assert torch.equal(got["mask"], expected > rank)
        assert got["half"].dtype == torch.bfloat16 and torch.equal(got["half"], expected.to(torch.bfloat16))
        assert got["empty"].shape == (0, 3)
        assert torch.equal(got["nested"][0], expected.sum()) and torch.equal(got["nested"][1][0], expected[0])


def test_one_rank_raising_names_it_and_pool_recovers_cheaply(pool3):
    pids = pool3.pids
    with pytest.raises(RankError) as info:
        pool3.run(_raise_on_rank, 1)
    err = info.value
    assert err.rank == 1 and err.error_type == "ValueError"
    assert "rank 1" in str(err) and "bad input on rank 1" in str(err)
    assert "_raise_on_rank" in err.remote_traceback and "ValueError" in err.remote_traceback
    assert err.remote_traceback.strip() in str(err)
    assert pool3.broken
    _check_collectives(pool3)
    assert not pool3.broken and pool3.pids == pids  # re-initialised the group, no respawn


def test_run_collect_reports_every_rank(pool4):
    outcomes = pool4.run_collect(_raise_everywhere)
    assert [o.rank for o in outcomes] == [0, 1, 2, 3]
    for rank, outcome in enumerate(outcomes):
        assert not outcome.ok and not outcome.timed_out
        assert outcome.error_type == "KeyError"
        assert f"missing key of rank {rank}" in outcome.error_message
        assert "_raise_everywhere" in outcome.traceback
    outcomes = pool4.run_collect(_raise_on_rank, 2)
    assert [o.ok for o in outcomes] == [True, True, False, True]
    assert [o.value for o in outcomes if o.ok] == [0, 1, 3]
    assert outcomes[2].error_type == "ValueError"
    _check_collectives(pool4)


def test_unpicklable_exception_and_value(pool2):
    outcomes = pool2.run_collect(_unpicklable_outcomes)
    assert not outcomes[0].ok and outcomes[0].error_type.endswith("_Unpicklable")
    assert outcomes[0].error_message == "holds a lock"
    assert not outcomes[1].ok and "cannot be pickled" in outcomes[1].error_message
    _check_collectives(pool2)


def test_unpicklable_argument_fails_in_parent_only(pool2):
    with pytest.raises(Exception, match="pickle"):
        pool2.run(_identity, lambda: 0)
    assert not pool2.broken


def test_raise_while_others_block_reports_the_raising_rank(pool2, monkeypatch):
    monkeypatch.setattr(pool2, "grace", 1.0)
    pool2.start()  # restart (if a previous test broke it) outside the timed part
    pids = pool2.pids
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool2.run(_raise_while_others_reduce, timeout=30)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1 and "failed before the collective" in str(info.value)
    assert "[0]" in info.value.note  # rank 0 hung in the all_reduce and was killed
    _check_collectives(pool2)
    assert pool2.pids[1] == pids[1] and pool2.pids[0] != pids[0]


def test_hung_rank_times_out_and_pool_recovers(pool2):
    pool2.start()
    pids = pool2.pids
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        pool2.run(_lonely_all_reduce, timeout=2.0)
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 6
    err = info.value
    assert isinstance(err, TimeoutError) and isinstance(err, RankError)
    assert err.ranks == [0] and err.rank == 0 and "ranks [0]" in str(err)
    assert "_lonely_all_reduce" in err.remote_traceback  # the hung rank's stack
    assert pool2.broken
    _check_collectives(pool2)
    assert pool2.pids[1] == pids[1] and pool2.pids[0] != pids[0]


def test_run_ranks_one_shot():
    results = run_ranks(_collectives, 1, 3, timeout=60)
    assert len(results) == 1 and torch.equal(results[0]["gathered"], _rank_input(0, 3))
