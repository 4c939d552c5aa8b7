"""The native communicator's life (``csrc/comm/life.h``: the wait for a split child, the calls,
the watchdog, close) on CPU, through ``cpshard._C._ScriptedCommunicator``: the same C++ the NCCL
communicator runs, over a scripted NCCL. Scripted communicators are numbered: 1 is the parent,
2 the split child.

The tests wait on the communicator's state and events, never on a fixed sleep (but for the
exits, whose order against a scripted thread is set by its delays); a wall-time upper
bound only tells "returned at the timeout or grace" from "hung" or "waited for something longer",
so it sits far above the timeout it bounds (a loaded machine, a sanitized build)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cpshard import _C
from cpshard.comm import nccl

Scripted = _C._ScriptedCommunicator
ROOT = Path(__file__).resolve().parents[2]


def _eventually(check, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.02)


def _aborted(comm: Scripted) -> str:
    """Waits until the watchdog has published why it aborted ``comm``, and returns the reason."""
    _eventually(lambda: comm.error() != "")
    return str(comm.error())


# ---------------------------------------------------------------- the split's wait


def test_a_child_published_after_the_split_returned_is_waited_for() -> None:
    start = time.monotonic()
    comm = Scripted(timeout_s=120.0, publish_ms=300)  # NCCL's thread publishes it 300 ms later
    waited = time.monotonic() - start
    assert 0.3 <= waited < 60.0, waited  # at the publication, not at the timeout
    assert comm.child() == 2 and comm.error() == "" and comm.events() == []
    comm.enqueue(finish_ms=0)
    comm.close(grace_s=5.0)
    assert comm.events() == ["destroy 2"]  # quiescent: destroyed, not aborted


def test_the_wait_polls_the_child_never_the_parent() -> None:
    """The parent is torch's: polling it completes and frees its pending group job outside
    torch's lock, racing torch's watchdog. The parent stays in progress until the child is
    published, so a wait that polled it would have done so many times."""
    comm = Scripted(timeout_s=120.0, publish_ms=200)
    assert comm.parent_polls() == 0
    comm.close(grace_s=5.0)


def test_a_failed_blocking_split_aborts_the_child_it_published() -> None:
    """NCCL publishes the child even when the split returns an error (its initialisation
    failed after it was made): aborted, not leaked."""
    before = _C._scripted_aborts()
    with pytest.raises(RuntimeError, match="the blocking split failed"):
        Scripted(timeout_s=10.0, publish_ms=0, child="failed", blocking=True)
    assert _C._scripted_aborts() == before + 1
    comm = Scripted(timeout_s=10.0, publish_ms=0, blocking=True)  # one that succeeded is used
    assert comm.child() == 2
    comm.close(grace_s=5.0)
    assert comm.events() == ["destroy 2"]


@pytest.mark.parametrize("value", ["0", "00", "0x0"])
def test_nccl_comm_blocking_0_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """NCCL_COMM_BLOCKING=0 overrides the blocking mode the communicator is made with, after
    which every verb would raise "in progress"."""
    monkeypatch.setenv("NCCL_COMM_BLOCKING", value)
    with pytest.raises(RuntimeError, match=f"NCCL_COMM_BLOCKING={value} in the environment"):
        Scripted(timeout_s=10.0, publish_ms=0)


@pytest.mark.parametrize("value", ["1", "", "no"])
def test_other_nccl_comm_blocking_values_are_accepted(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """1 keeps the mode blocking; NCCL ignores a value it cannot parse as an integer."""
    monkeypatch.setenv("NCCL_COMM_BLOCKING", value)
    Scripted(timeout_s=10.0, publish_ms=0).close(grace_s=5.0)


def test_a_split_that_fails_on_ncclS_thread_raises_and_aborts_the_child() -> None:
    with pytest.raises(RuntimeError, match="the split failed: the split failed on NCCL's thread"):
        Scripted(timeout_s=10.0, publish_ms=100, child="failed")


def test_a_child_never_published_raises_after_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="was never published"):
        Scripted(timeout_s=0.3, publish_ms=-1)
    assert 0.3 <= time.monotonic() - start < 30.0  # the timeout, not for ever


def test_a_child_published_after_the_timeout_is_aborted_when_it_comes() -> None:
    """The wait gives up first; NCCL's thread writes the cell later (so the cell must still be
    alive then) and the late child is aborted when it appears, not leaked."""
    before = _C._scripted_aborts()
    start = time.monotonic()
    # "never published": the wait gave up before the publication (a child it saw would have been
    # aborted right there, raising "never became ready")
    with pytest.raises(RuntimeError, match="was never published"):
        Scripted(timeout_s=0.2, publish_ms=2000)
    _eventually(lambda: _C._scripted_aborts() == before + 1, within=30.0)
    assert time.monotonic() - start >= 2.0  # aborted when it came


# ---------------------------------------------------------------- the watchdog


def test_a_call_unfinished_after_the_timeout_aborts_the_communicator() -> None:
    comm = Scripted(timeout_s=0.3, publish_ms=0)
    comm.enqueue(finish_ms=-1)  # a peer that died: the call never finishes
    assert "has not finished within the process group's timeout of 300 ms" in _aborted(comm)
    assert comm.events() == ["abort 2"]  # the error is published once the abort has happened
    with pytest.raises(RuntimeError, match="rank 0 of 1.*the communicator was aborted"):
        comm.enqueue(finish_ms=0)
    comm.close(grace_s=1.0)
    assert comm.events() == ["abort 2"]  # aborted once


def test_an_asynchronous_error_aborts_the_communicator() -> None:
    comm = Scripted(timeout_s=60.0, publish_ms=0)
    comm.enqueue(finish_ms=0)
    comm.fail("remote process exited")
    assert _aborted(comm) == "asynchronous NCCL error: remote process exited"
    assert comm.events() == ["abort 2"]
    comm.close(grace_s=1.0)


def test_the_error_is_published_only_once_the_abort_has_happened() -> None:
    """A slow abort (NCCL's can take seconds): whoever sees the reason, through error() or a call
    that raises it, sees the abort done; a call made while the abort is under way waits for it."""
    comm = Scripted(timeout_s=0.2, publish_ms=0, abort_ms=500)
    comm.enqueue(finish_ms=-1)
    deadline = time.monotonic() + 30.0
    while True:
        assert time.monotonic() < deadline, "the communicator was never aborted"
        seen = comm.error()
        if seen:
            assert comm.events() == ["abort 2"], seen
            break
        try:
            comm.enqueue(finish_ms=0)
        except RuntimeError as raised:
            assert "the communicator was aborted" in str(raised)
            assert comm.events() == ["abort 2"], str(raised)
            break
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="has not finished within"):
        comm.enqueue(finish_ms=0)
    comm.close(grace_s=1.0)
    assert comm.events() == ["abort 2"]


def test_a_stuck_call_released_by_a_slow_abort_returns_with_the_reason_published() -> None:
    comm = Scripted(timeout_s=0.2, publish_ms=0, abort_ms=300)
    assert comm.enqueue_stuck(at_most_ms=60_000)
    assert "inside NCCL for longer" in comm.error() and comm.events() == ["abort 2"]
    comm.close(grace_s=1.0)


def test_a_host_call_stuck_inside_nccl_is_released_by_the_watchdogs_abort() -> None:
    comm = Scripted(timeout_s=0.3, publish_ms=0)
    start = time.monotonic()
    released = comm.enqueue_stuck(at_most_ms=60_000)  # a first connect to a peer that never comes
    assert released and 0.3 <= time.monotonic() - start < 30.0  # the abort, not at_most_ms
    # the released call returns once the reason is published
    assert "inside NCCL for longer than the process group's timeout" in comm.error()
    assert comm.events() == ["abort 2"]
    comm.close(grace_s=1.0)


def test_a_call_in_time_is_not_aborted() -> None:
    comm = Scripted(timeout_s=0.5, publish_ms=0)
    for _ in range(5):
        comm.enqueue(finish_ms=50)
    time.sleep(0.8)  # longer than the timeout, but every call finished well within it
    assert comm.error() == "" and comm.events() == []
    comm.close(grace_s=1.0)
    assert comm.events() == ["destroy 2"]


# ---------------------------------------------------------------- the end


def test_close_with_queued_work_waits_the_grace_then_aborts() -> None:
    comm = Scripted(timeout_s=600.0, publish_ms=0)
    comm.enqueue(finish_ms=-1)
    start = time.monotonic()
    comm.close(grace_s=0.2)
    assert 0.2 <= time.monotonic() - start < 60.0  # the grace, not the 10-minute timeout
    assert comm.events() == ["abort 2"]
    comm.close(grace_s=0.2)  # idempotent
    with pytest.raises(RuntimeError, match="the communicator is closed"):
        comm.enqueue(finish_ms=0)


def test_close_waits_for_work_that_finishes_within_the_grace() -> None:
    comm = Scripted(timeout_s=600.0, publish_ms=0)
    comm.enqueue(finish_ms=300)
    start = time.monotonic()
    comm.close(grace_s=120.0)
    assert 0.25 <= time.monotonic() - start < 60.0  # when the work finished, not the grace
    assert comm.events() == ["destroy 2"]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh interpreter on this checkout; it must exit cleanly."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize(
    ("call", "said"),
    [
        ("enqueue(finish_ms=-1)", "aborting the communicator"),
        # a graph holds the communicator: NCCL's destroy and abort would wait for it (two
        # minutes in the script), so the exit leaves it
        ("enqueue_captured()", "leaving the communicator to the process"),
    ],
)
def test_interpreter_exit_with_queued_work_returns_within_seconds(
    tmp_path: Path, call: str, said: str
) -> None:
    """cpshard.comm.nccl's exit path: a communicator of a live process group with a call that
    never finishes (a dead peer), or one captured into a CUDA graph that is still alive, and the
    default ten-minute timeout ends within seconds."""
    done = _run(
        f"""
        import time

        import torch.distributed as dist
        from cpshard import _C
        from cpshard.comm import nccl
        dist.init_process_group("gloo", init_method="file://{tmp_path / "store"}", rank=0,
                                world_size=1)
        native = _C._ScriptedCommunicator(timeout_s=600.0, publish_ms=0)
        nccl.register(dist.group.WORLD, nccl.NcclTransport(native, "split"))
        native.{call}
        print("exiting at", time.time(), flush=True)
        """
    )
    ended = time.time()
    assert "exiting at" in done.stdout and said in done.stderr, done.stderr
    exit_took = ended - float(done.stdout.split("exiting at")[1])
    assert exit_took < nccl.EXIT_GRACE_S + 60.0, exit_took  # the grace, not ten minutes


# ---------------------------------------------------------------- calls captured into CUDA graphs


def test_close_with_a_captured_call_leaves_the_communicator(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A captured call records no event, so the communicator looks quiescent, but NCCL's
    destroy would wait until the graph is destroyed (two minutes in the script): close leaves
    the communicator to the process instead, saying so."""
    comm = Scripted(timeout_s=600.0, publish_ms=0)
    comm.enqueue(finish_ms=0)
    comm.enqueue_captured()
    assert comm.captured() == 1
    start = time.monotonic()
    comm.close(grace_s=5.0)
    assert time.monotonic() - start < 60.0  # not the destroy's wait for the graph
    assert comm.events() == []  # neither destroyed nor aborted
    assert "1 calls were captured into CUDA graphs" in capfd.readouterr().err
    comm.destroy_graphs()


def test_an_abort_held_up_by_a_captured_call_publishes_the_reason_at_once() -> None:
    """NCCL's abort stops the kernels, then waits for the graphs holding the communicator: it
    runs on a thread of its own, and calls raise the reason rather than wait for the graph."""
    comm = Scripted(timeout_s=0.3, publish_ms=0)
    comm.enqueue_captured()
    comm.enqueue(finish_ms=-1)  # a dead peer
    reason = _aborted(comm)  # well before the graph is destroyed (two minutes in the script)
    assert "has not finished within" in reason and "1 calls captured into CUDA graphs" in reason
    _eventually(lambda: comm.events() == ["abort 2"])  # the abort took effect
    with pytest.raises(RuntimeError, match="the communicator was aborted"):
        comm.enqueue(finish_ms=0)
    comm.close(grace_s=1.0)
    comm.destroy_graphs()  # the abort returns
    assert comm.events() == ["abort 2"]


# ---------------------------------------------------------------- the process's teardown


def test_no_late_child_is_aborted_once_teardown_began() -> None:
    """A thread left to abort a late split child makes no NCCL call once the interpreter's exit
    has begun (NCCL, CUDA and torch may be half torn down then)."""
    done = _run(
        """
        import atexit
        import time

        def after_teardown() -> None:  # registered first, so it runs after cpshard's handler
            time.sleep(2.0)  # the child is published meanwhile, 1 s after the split
            print("aborts", _C._scripted_aborts(), flush=True)

        atexit.register(after_teardown)
        from cpshard import _C
        try:
            _C._ScriptedCommunicator(timeout_s=0.2, publish_ms=1000)
        except RuntimeError as e:
            assert "was never published" in str(e), e
        """
    )
    assert "aborts 0" in done.stdout, done.stdout + done.stderr


def test_teardown_waits_for_an_abort_already_under_way() -> None:
    """An abort a thread began before the exit is waited for (bounded), not cut short."""
    done = _run(
        """
        import atexit
        import time

        def after_teardown() -> None:  # registered first, so it runs after cpshard's handler
            print("aborts", _C._scripted_aborts(), flush=True)

        atexit.register(after_teardown)
        from cpshard import _C
        try:  # the child comes 0.3 s after the split; its abort takes effect 1 s later
            _C._ScriptedCommunicator(timeout_s=0.1, publish_ms=300, abort_ms=1000)
        except RuntimeError as e:
            assert "was never published" in str(e), e
        time.sleep(0.6)  # the exit begins while the abort is under way
        """
    )
    assert "aborts 1" in done.stdout, done.stdout + done.stderr


def test_bad_arguments_are_named() -> None:
    with pytest.raises(RuntimeError, match='child must be "ready" or "failed", got "maybe"'):
        Scripted(timeout_s=1.0, publish_ms=0, child="maybe")
    with pytest.raises(RuntimeError, match="timeout_s must be positive and finite, got -1"):
        Scripted(timeout_s=-1.0, publish_ms=0)
    with pytest.raises(RuntimeError, match="poll_ms must be positive"):
        Scripted(timeout_s=1.0, publish_ms=0, poll_ms=0)
    with pytest.raises(RuntimeError, match="abort_ms must not be negative, got -1"):
        Scripted(timeout_s=1.0, publish_ms=0, abort_ms=-1)
