"""Bad input on ONE rank of the transport gathers (``cpshard.transport``; the validation
model of docs/validation.md).

In checked mode (``cpshard.check_mode("call")``) every rank raises a clear
``ValueError``/``TypeError`` promptly (the failing rank describing its own problem, the others
naming the failing rank), none hangs in a collective. In the default mode the failing rank
raises its local problem at once and the others fail in the transfer (an error, or the group's
timeout) - never a silent wrong answer. Also ``raise_on_any_rank`` semantics, and a rank that
leaves in the middle of a step makes the others raise within the group's timeout, after which
the pool recovers.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from cpshard import (
    gather_halo,
    gather_metadata,
    gather_ragged,
    gather_sequence,
    raise_on_any_rank,
)
from cpshard.testing import RankPool
from tests.helpers import GATHER_ERROR_CASES, call_gather_case

F64 = torch.float64
PROMPT_S = 10.0  # every rank must have raised within this many seconds

FUNCTION = {
    "ragged": "gather_ragged",
    "seq": "gather_sequence",
    "meta": "gather_metadata",
    "halo": "gather_halo",
}

# (world, failing rank): rank 0 failing at W=3 checks that a field mismatch is blamed on the odd
# rank by majority, not on rank 0 by default.
PLACEMENTS = [(2, 1), (3, 0), (4, 2)]


def _assert_every_rank_raised(
    outcomes, elapsed: float, bad: int, expect: list[str], what: str
) -> None:
    assert elapsed < PROMPT_S, f"took {elapsed:.1f} s"
    for o in outcomes:
        assert not o.ok, f"rank {o.rank} did not raise"
        assert not o.timed_out, f"rank {o.rank} hung:\n{o.traceback}"
        assert o.error_type in ("ValueError", "TypeError"), (o.rank, o.error_type, o.error_message)
        assert what in o.error_message, (o.rank, o.error_message)
    own = outcomes[bad].error_message.lower()
    for word in expect:
        assert word.lower() in own, (
            f"rank {bad}'s message lacks {word!r}: {outcomes[bad].error_message}"
        )
    for o in outcomes:
        if o.rank != bad:
            assert f"rank {bad}" in o.error_message, (
                f"rank {o.rank} does not name rank {bad}: {o.error_message}"
            )


@pytest.mark.parametrize("world,bad", PLACEMENTS)
@pytest.mark.parametrize("case", list(GATHER_ERROR_CASES))
def test_bad_input_on_one_rank(pools, case, world, bad):
    pool = pools(world)
    pool.start()  # re-form the group after the previous case's failure, outside the timed part
    start = time.monotonic()
    outcomes = pool.run_collect(call_gather_case, case, bad, timeout=PROMPT_S + 5)
    elapsed = time.monotonic() - start
    fmt = dict(bad=bad, world=world, world_plus=world + 1, world_minus=world - 1)
    expect = [w.format(**fmt) for w in GATHER_ERROR_CASES[case]]
    _assert_every_rank_raised(outcomes, elapsed, bad, expect, FUNCTION[case.split("_")[0]])


LOCAL_CASES = [c for c in GATHER_ERROR_CASES if "differ" not in c and c not in (
    "ragged_wrong_hidden", "ragged_wrong_dtype", "ragged_wrong_ndim", "seq_uneven",
    "seq_wrong_hidden", "seq_wrong_dtype", "seq_wrong_ndim", "meta_wrong_dtype",
    "halo_wrong_hidden", "halo_uneven", "halo_wrong_dtype")]


def _local_errors_single_rank(rank: int, world: int) -> dict[str, tuple[str, str]]:
    """At world size 1 (and with group None) a local problem still raises, with the rank."""
    out = {}
    for case in LOCAL_CASES:
        try:
            call_gather_case(rank, world, case, rank)
        except (ValueError, TypeError) as exc:
            out[case] = (type(exc).__name__, str(exc))
        else:
            out[case] = ("", "no error")
    for name, call in {
        "ragged None, counts too long": lambda: gather_ragged(torch.zeros(2, 3), None, [2, 1]),
        "ragged None, wrong count": lambda: gather_ragged(torch.zeros(2, 3), None, [3]),
        "halo None, negative": lambda: gather_halo(torch.zeros(2, 3), None, -2),
        "sequence None, seq_dim": lambda: gather_sequence(torch.zeros(2, 3), None, seq_dim=2),
        "metadata None, requires grad": lambda: gather_metadata(
            torch.zeros(2, 3, requires_grad=True), None
        ),
        "group of a wrong type": lambda: gather_sequence(torch.zeros(2, 3), "world"),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            out[name] = ("", "no error")
    return out


def test_bad_input_at_world_size_1(pool1):
    (result,) = pool1.run(_local_errors_single_rank, timeout=30)
    for case, (kind, message) in result.items():
        assert kind in ("ValueError", "TypeError"), (case, message)
        if case in GATHER_ERROR_CASES:
            fmt = dict(bad=0, world=1, world_plus=2, world_minus=0)
            for word in GATHER_ERROR_CASES[case]:
                assert word.format(**fmt).lower() in message.lower(), (case, message)
        if case != "group of a wrong type":
            assert "rank 0" in message, (case, message)
        else:
            assert "group" in message, message


# --------------------------------------------------------------------------- raise_on_any_rank


def _roar(rank: int, world: int, failed: list[int], group_kind: str) -> str:
    if group_kind == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        group = init_device_mesh("cpu", (world,))
    elif group_kind == "none":
        group = None
    else:
        group = dist.group.WORLD
    raise_on_any_rank(rank in failed, f"local detail {rank * 11}", group, "my.check")
    return "passed"


@pytest.mark.parametrize(
    "world,failed,group_kind",
    [
        (2, [], "pg"),
        (2, [1], "pg"),
        (3, [0], "pg"),
        (4, [1, 3], "pg"),
        (4, [0, 1, 2, 3], "pg"),
        (4, [2], "mesh"),
        (3, [], "mesh"),
        (1, [0], "pg"),
        (1, [], "pg"),
        (2, [1], "none"),  # without a group each rank decides alone
    ],
)
def test_raise_on_any_rank(pools, world, failed, group_kind):
    pool = pools(world)
    pool.start()
    start = time.monotonic()
    outcomes = pool.run_collect(_roar, failed, group_kind, timeout=PROMPT_S + 5)
    assert time.monotonic() - start < PROMPT_S
    local = group_kind == "none"
    for o in outcomes:
        assert not o.timed_out, o.traceback
        should_raise = o.rank in failed if local else bool(failed)
        if not should_raise:
            assert o.ok and o.value == "passed", (o.rank, o.error_message)
            continue
        assert not o.ok and o.error_type == "ValueError", (o.rank, o.error_type, o.error_message)
        assert "my.check" in o.error_message
        if o.rank in failed:
            own_rank = 0 if local else o.rank  # without a group every rank is rank 0 of its own
            assert f"local detail {o.rank * 11}" in o.error_message
            assert f"rank {own_rank}:" in o.error_message
        else:
            named = ("rank " if len(failed) == 1 else "ranks ") + ", ".join(map(str, failed))
            assert named in o.error_message, o.error_message
            assert "local detail" not in o.error_message


# --------------------------------------------------------------------------- a rank leaves mid-step

PG_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def short_pool():
    """Two ranks whose collectives time out after PG_TIMEOUT s; the parent waits longer (grace),
    so that it sees what the abandoned rank raises instead of killing it."""
    with RankPool(2, pg_timeout=PG_TIMEOUT, grace=PG_TIMEOUT + 15) as pool:
        yield pool


def _abandon(rank: int, world: int, how: str) -> str:
    g = dist.group.WORLD
    counts = [3, 5]
    x = torch.randn(2, counts[rank], 4, dtype=F64, requires_grad=True)
    if how == "return before forward":
        if rank == 1:
            return "left"
        gather_ragged(x, g, counts, dim=1)
    elif how == "exit before forward":
        if rank == 1:
            os._exit(0)
        gather_ragged(x, g, counts, dim=1)
    elif how == "exit before ragged backward":
        y = gather_ragged(x, g, counts, dim=1)
        if rank == 1:
            os._exit(0)
        y.sum().backward()
    elif how == "return before halo backward":
        s = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
        y = gather_halo(s, g, 2, seq_dim=1)
        if rank == 1:
            return "left"
        y.sum().backward()  # rank 0 waits for the halo gradient from rank 1
    elif how == "return before sequence backward":
        s = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
        y = gather_sequence(s, g, seq_dim=1)
        if rank == 1:
            return "left"
        y.sum().backward()
    else:
        raise AssertionError(how)
    return "finished"


def _healthy(rank: int, world: int) -> torch.Tensor:
    x = torch.full((1, rank + 1), float(rank), dtype=F64)
    return gather_ragged(x, dist.group.WORLD, [1, 2], dim=1)


@pytest.mark.parametrize(
    "how",
    [
        "return before forward",
        "exit before forward",
        "exit before ragged backward",
        "return before halo backward",
        "return before sequence backward",
    ],
)
def test_rank_leaving_mid_step_does_not_hang_the_others(short_pool, how):
    short_pool.start()
    start = time.monotonic()
    outcomes = short_pool.run_collect(_abandon, how, timeout=PG_TIMEOUT + 25)
    elapsed = time.monotonic() - start
    survivor, leaver = outcomes
    assert not survivor.ok and not survivor.timed_out, (survivor.error_message, survivor.traceback)
    assert survivor.error_type != "WorkerDied"
    assert elapsed < PG_TIMEOUT + 10, f"rank 0 raised only after {elapsed:.1f} s"
    if how.startswith("return"):
        assert leaver.ok and leaver.value == "left"
    else:
        assert not leaver.ok and leaver.error_type == "WorkerDied"
    # The pool recovers (a fresh process group, a respawned worker where one died).
    expected = torch.tensor([[0.0, 1.0, 1.0]], dtype=F64)
    for y in short_pool.run(_healthy, timeout=60):
        assert torch.equal(y, expected)
