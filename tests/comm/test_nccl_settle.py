"""The native communicator's bounded polling wait (for a split child NCCL makes in the
background), driven on CPU through ``cpshard._C._settle_with_states`` by a stand-in state:
1 = in progress, 0 = ready, anything else = an error."""

from __future__ import annotations

import time

import pytest

from cpshard import _C


def test_a_call_that_never_completes_times_out_after_the_timeout() -> None:
    start = time.monotonic()
    outcome, last, polls = _C._settle_with_states([1], 300)  # a peer that never arrives
    waited = time.monotonic() - start
    assert outcome == "timed_out" and last == 1
    assert 0.3 <= waited < 30.0, waited  # the group's timeout, not for ever
    assert polls > 10  # polled all along, not one blocking wait


def test_a_call_that_completes_is_ready_as_soon_as_it_is() -> None:
    outcome, last, polls = _C._settle_with_states([1, 1, 1, 0], 10_000)
    assert (outcome, last, polls) == ("ready", 0, 4)


def test_an_error_while_in_progress_is_reported_not_waited_out() -> None:
    start = time.monotonic()
    outcome, last, polls = _C._settle_with_states([1, 1, 3], 120_000)  # 3: ncclInternalError
    assert (outcome, last, polls) == ("failed", 3, 3)
    assert time.monotonic() - start < 60.0  # at the error, not the timeout


def test_a_zero_timeout_polls_once() -> None:
    assert _C._settle_with_states([1], 0) == ("timed_out", 1, 1)
    assert _C._settle_with_states([0], 0) == ("ready", 0, 1)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(RuntimeError, match="states is empty"):
        _C._settle_with_states([], 10)
    with pytest.raises(RuntimeError, match="timeout_ms = -1 is negative"):
        _C._settle_with_states([0], -1)
    with pytest.raises(RuntimeError, match="negative interval"):
        _C._settle_with_states([0], 10, spin_us=-1)


def test_a_call_that_completes_within_the_spin_never_sleeps() -> None:
    # what is done within the spin must not cost a sleep (here a sleep would be 10 s)
    start = time.monotonic()
    states = [1] * 5 + [0]
    outcome, _, polls = _C._settle_with_states(
        states, 60_000, spin_us=3_000_000, interval_us=10_000_000
    )
    assert (outcome, polls) == ("ready", 6) and time.monotonic() - start < 5.0


def test_after_the_spin_it_sleeps_between_polls() -> None:
    start = time.monotonic()
    outcome, _, polls = _C._settle_with_states([1, 1, 0], 10_000, spin_us=0, interval_us=100_000)
    assert (outcome, polls) == ("ready", 3) and time.monotonic() - start >= 0.2
