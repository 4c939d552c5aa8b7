"""The native communicator's bounded wait for a call that may block for ever (a split from a
blocking parent waits inside NCCL for every peer), driven on CPU through
``cpshard._C._run_within`` by a stand-in call that sleeps and then returns a value."""

from __future__ import annotations

import time

import pytest

from cpshard import _C


def test_a_call_that_returns_in_time_gives_its_result() -> None:
    start = time.monotonic()
    assert _C._run_within(block_ms=20, timeout_ms=10_000, value=7) == 7
    assert time.monotonic() - start < 5.0  # returned when the call did, not at the timeout


def test_a_call_that_blocks_past_the_timeout_is_given_up_and_released_when_it_returns() -> None:
    value = 1000 + int(time.monotonic_ns() % 1_000_000)  # this test's own mark
    start = time.monotonic()
    assert _C._run_within(block_ms=8000, timeout_ms=100, value=value) is None
    waited = time.monotonic() - start
    assert 0.09 <= waited < 6.0, waited  # the timeout, not the call
    assert value not in _C._late_results()  # still running
    deadline = time.monotonic() + 60
    while value not in _C._late_results():  # the late result goes to its release, once
        assert time.monotonic() < deadline, "the late result was never released"
        time.sleep(0.05)
    assert _C._late_results().count(value) == 1


def test_a_zero_timeout_still_takes_an_immediate_result_or_gives_up() -> None:
    assert _C._run_within(block_ms=2000, timeout_ms=0, value=3) is None


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(RuntimeError, match="negative time"):
        _C._run_within(block_ms=-1, timeout_ms=10, value=0)
