"""Run a function on every rank of a pool of gloo worker processes.

Multi-rank tests pay ~4 s per spawned group (mostly ``import torch``), so
:class:`RankPool` spawns its workers once and runs many cases on them.
A failing rank fails the caller with its rank and traceback; a hung rank is
killed after a timeout; after any failure the pool rebuilds what it needs
(process group, dead workers) before the next run.

Workers are started with the spawn method (never fork), each joins a gloo
process group through a file store, runs with one intra-op thread, ignores
SIGINT (the parent handles Ctrl-C) and exits when the parent goes away.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import multiprocessing.connection
import multiprocessing.process
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing

__all__ = ["Outcome", "RankError", "RankPool", "RankTimeoutError", "run_ranks"]

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_STOP_WAIT_S = 5.0  # how long shutdown waits for workers to exit before killing them
_STACK_WAIT_S = 1.0  # how long to wait for a hung worker to dump its stack


@dataclasses.dataclass
class Outcome:
    """What one rank did in a run: returned ``value`` (``ok``) or failed.

    A failure carries the exception's type name, message and formatted
    traceback as strings, so that any exception crosses the process boundary.
    ``timed_out`` marks a rank that did not answer in time; it was killed, and
    ``traceback`` then holds the Python stacks it had when it was killed.
    """

    rank: int
    ok: bool
    value: Any = None
    error_type: str = ""
    error_message: str = ""
    traceback: str = ""
    timed_out: bool = False


class RankError(RuntimeError):
    """A rank failed; ``remote_traceback`` is the traceback from that rank."""

    def __init__(
        self,
        rank: int,
        error_type: str,
        error_message: str,
        remote_traceback: str = "",
        note: str = "",
    ) -> None:
        self.rank = rank
        self.error_type = error_type
        self.error_message = error_message
        self.remote_traceback = remote_traceback
        self.note = note
        text = f"rank {rank} failed with {error_type}: {error_message}"
        if note:
            text += f"\n{note}"
        if remote_traceback:
            text += f"\n\n--- traceback of rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (
            type(self),
            (self.rank, self.error_type, self.error_message, self.remote_traceback, self.note),
        )


class RankTimeoutError(RankError, TimeoutError):
    """Ranks ``ranks`` did not answer within ``timeout`` seconds and were killed.

    ``rank`` is the lowest of them; ``remote_traceback`` holds its stacks.
    """

    def __init__(self, ranks: list[int], timeout: float, remote_traceback: str = "") -> None:
        self.ranks = list(ranks)
        self.timeout = timeout
        super().__init__(
            min(ranks),
            "TimeoutError",
            f"no answer within {timeout:g} s; ranks {self.ranks} hung and were killed",
            remote_traceback,
        )

    def __reduce__(self):
        return (type(self), (self.ranks, self.timeout, self.remote_traceback))


def _type_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _failure(rank: int, exc: BaseException, context: str = "") -> Outcome:
    """An Outcome describing ``exc`` with strings only (always picklable)."""
    try:
        message = str(exc)
    except Exception:
        message = f"<str() of {_type_name(exc)} failed>"
    return Outcome(
        rank,
        ok=False,
        error_type=_type_name(exc),
        error_message=f"{context}{message}",
        traceback="".join(traceback.format_exception(exc)),
    )


def _exit_when_orphaned(parent_pid: int) -> None:
    """Kill this worker once its parent is gone (even mid-collective)."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _handle(rank: int, world: int, kind: str, body: tuple) -> Outcome:
    """Execute one request from the parent and describe the result."""
    try:
        if kind == "ping":
            return Outcome(rank, ok=True)
        if kind == "init":
            init_method, pg_timeout = body
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group(
                "gloo",
                init_method=init_method,
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=pg_timeout),
            )
            return Outcome(rank, ok=True)
        sys_path, payload = body
        sys.path[:] = sys_path  # so that `fn` is importable as it is in the parent
        fn, args, kwargs = pickle.loads(payload)
        return Outcome(rank, ok=True, value=fn(rank, world, *args, **kwargs))
    except BaseException as exc:  # a worker must answer, whatever `fn` raised
        return _failure(rank, exc)


def _worker_main(
    rank: int, world: int, conn: multiprocessing.connection.Connection, parent_pid: int, stack_path: str
) -> None:
    """Serve requests from the parent until it says stop or goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    stack_file = open(stack_path, "w")  # kept open: faulthandler writes here on SIGUSR1
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    while True:
        try:
            seq, kind, *body = pickle.loads(conn.recv_bytes())
        except EOFError:
            break
        if kind == "stop":
            break
        outcome = _handle(rank, world, kind, tuple(body))
        try:
            reply = pickle.dumps((seq, outcome), protocol=_PROTOCOL)
        except Exception as exc:
            failed = _failure(rank, exc, f"rank {rank} returned a value that cannot be pickled: ")
            reply = pickle.dumps((seq, failed), protocol=_PROTOCOL)
        conn.send_bytes(reply)
    if dist.is_initialized():
        dist.destroy_process_group()
    # Skip the interpreter teardown: with torch loaded it takes ~1 s per worker.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """``world`` spawned worker processes forming a gloo process group.

    Use as a context manager (or call :meth:`start` and :meth:`shutdown`)::

        with RankPool(2) as pool:
            sums = pool.run(my_module_level_fn, tensor, timeout=30)

    ``fn`` is called as ``fn(rank, world, *args, **kwargs)`` on every rank
    with the default process group initialised; arguments and return values
    travel by pickle (CPU tensors included). Not thread-safe.

    Args:
        world: number of ranks.
        pg_timeout: timeout in seconds of the process group's collectives.
        start_timeout: how long (re)starting the workers may take.
        grace: once a rank has failed, how long to wait for the other ranks'
            outcomes before declaring them hung (they are often blocked in a
            collective with the failed rank).
    """

    def __init__(
        self, world: int, *, pg_timeout: float = 30.0, start_timeout: float = 120.0, grace: float = 3.0
    ) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.world = world
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self.grace = grace
        self._ctx = torch.multiprocessing.get_context("spawn")
        self._procs: list[multiprocessing.process.BaseProcess | None] = [None] * world
        self._conns: list[multiprocessing.connection.Connection | None] = [None] * world
        self._tmpdir: str | None = None
        self._seq = 0
        self._needs_restart = True

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    @property
    def broken(self) -> bool:
        """True when the next run must first (re)start workers or the process group."""
        return self._needs_restart

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the workers, in rank order (None: not running)."""
        return [p.pid if p is not None else None for p in self._procs]

    def start(self) -> None:
        """Spawn the workers and form the process group, unless already done."""
        if self._needs_restart:
            self.restart()

    def restart(self) -> None:
        """Respawn dead workers and give every rank a fresh process group.

        Workers that are alive and idle are kept (cheap); if that fails, all
        workers are respawned once before giving up.
        """
        respawned_all = self._spawn_missing()
        outcomes = self._init_group()
        if not respawned_all and not all(o.ok for o in outcomes):
            self._kill_all()
            self._spawn_missing()
            outcomes = self._init_group()
        failed = [o for o in outcomes if not o.ok]
        if failed:
            self._kill_all()
            first = failed[0]
            raise RankError(
                first.rank, first.error_type, first.error_message, first.traceback, "while starting the rank pool"
            )
        self._needs_restart = False

    def run(self, fn: Callable[..., Any], /, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        """Call ``fn(rank, world, *args, **kwargs)`` on every rank; return the values in rank order.

        Raises :class:`RankError` for the lowest rank that raised (or died),
        or :class:`RankTimeoutError` if ranks did not answer within ``timeout``
        seconds. ``fn`` must be picklable (defined at module level).
        """
        outcomes = self.run_collect(fn, *args, timeout=timeout, **kwargs)
        failed = [o for o in outcomes if not o.ok]
        if not failed:
            return [o.value for o in outcomes]
        raised = [o for o in failed if not o.timed_out]
        hung = [o for o in failed if o.timed_out]
        if not raised:
            raise RankTimeoutError([o.rank for o in hung], timeout, hung[0].traceback)
        first = raised[0]
        notes = []
        if len(raised) > 1:
            notes.append(f"ranks {[o.rank for o in raised[1:]]} failed too")
        if hung:
            notes.append(f"ranks {[o.rank for o in hung]} did not answer afterwards and were killed")
        raise RankError(first.rank, first.error_type, first.error_message, first.traceback, "; ".join(notes))

    def run_collect(
        self, fn: Callable[..., Any], /, *args: Any, timeout: float = 60.0, **kwargs: Any
    ) -> list[Outcome]:
        """Like :meth:`run`, but return every rank's :class:`Outcome` instead of raising.

        Ranks that did not answer within ``timeout`` (or within ``grace``
        seconds after another rank failed) are killed and reported with
        ``timed_out=True``.
        """
        payload = pickle.dumps((fn, args, kwargs), protocol=_PROTOCOL)
        self.start()
        outcomes = self._request(("run", list(sys.path), payload), timeout)
        if not all(o.ok for o in outcomes):
            self._needs_restart = True
        return outcomes

    def shutdown(self) -> None:
        """Stop all workers (killing those that do not exit promptly)."""
        for conn in self._conns:
            if conn is not None:
                try:
                    conn.send_bytes(pickle.dumps((0, "stop"), protocol=_PROTOCOL))
                except OSError:
                    pass  # already dead
        deadline = time.monotonic() + _STOP_WAIT_S
        for proc in self._procs:
            if proc is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        self._kill_all()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- internals ---------------------------------------------------------

    def _spawn_missing(self) -> bool:
        """Start a worker for every rank without a live one; True if all were started."""
        if self._tmpdir is None:
            self._tmpdir = tempfile.mkdtemp(prefix="cpshard-rankpool-")
        missing = [r for r, p in enumerate(self._procs) if p is None or not p.is_alive()]
        for rank in missing:
            self._kill(rank)  # reap a dead worker, close its pipe
            parent_conn, child_conn = self._ctx.Pipe(duplex=True)
            proc = self._ctx.Process(
                target=_worker_main,
                args=(rank, self.world, child_conn, os.getpid(), os.path.join(self._tmpdir, f"stack-{rank}")),
                name=f"cpshard-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()  # so that the worker's death reads as EOF here
            self._procs[rank], self._conns[rank] = proc, parent_conn
        return len(missing) == self.world

    def _init_group(self) -> list[Outcome]:
        """Have every rank (re)join a process group through a fresh file store.

        A ping first waits for new workers to finish importing, so that ranks
        already alive do not spend their store timeout waiting for them.
        """
        outcomes = self._request(("ping",), self.start_timeout)
        if not all(o.ok for o in outcomes):
            return outcomes
        store = os.path.join(self._tmpdir, f"store-{self._seq}")  # unique per request
        return self._request(("init", f"file://{store}", self.pg_timeout), self.pg_timeout + 10.0)

    def _request(self, message: tuple, timeout: float) -> list[Outcome]:
        """Send ``message`` to every rank and collect their outcomes.

        Kills the workers that do not answer in time. Any exception here
        (e.g. KeyboardInterrupt) kills all workers before propagating.
        """
        try:
            self._seq += 1
            seq = self._seq
            data = pickle.dumps((seq, *message), protocol=_PROTOCOL)
            outcomes: dict[int, Outcome] = {}
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(data)
                except OSError:
                    outcomes[rank] = self._died(rank)
            return self._gather(seq, outcomes, timeout)
        except BaseException:
            self._kill_all()
            raise

    def _gather(self, seq: int, outcomes: dict[int, Outcome], timeout: float) -> list[Outcome]:
        start = time.monotonic()
        deadline = start + timeout
        first_failure: int | None = None
        pending = {r for r in range(self.world) if r not in outcomes}
        while pending:
            if first_failure is None and any(not o.ok for o in outcomes.values()):
                first_failure = min(r for r, o in outcomes.items() if not o.ok)
                deadline = min(deadline, time.monotonic() + self.grace)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            waitables = {self._conns[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            for ready in multiprocessing.connection.wait(list(waitables), remaining):
                rank = waitables[ready]
                if rank not in pending:
                    continue
                conn = self._conns[rank]
                if ready is not conn and not conn.poll(0):
                    outcomes[rank] = self._died(rank)
                    pending.discard(rank)
                    continue
                try:
                    reply = conn.recv_bytes()
                except (EOFError, OSError):
                    outcomes[rank] = self._died(rank)
                    pending.discard(rank)
                    continue
                try:
                    reply_seq, outcome = pickle.loads(reply)
                except Exception as exc:
                    reply_seq, outcome = seq, _failure(rank, exc, "cannot unpickle the reply in the parent: ")
                if reply_seq == seq:  # anything else is a stale reply
                    outcomes[rank] = outcome
                    pending.discard(rank)
        for rank in sorted(pending):
            if first_failure is None:
                why = f"rank {rank} did not answer within {timeout:g} s"
            else:
                why = f"rank {rank} did not answer within {self.grace:g} s after rank {first_failure} failed"
            outcomes[rank] = Outcome(
                rank,
                ok=False,
                error_type="TimeoutError",
                error_message=why,
                traceback=self._stack_and_kill(rank),
                timed_out=True,
            )
        return [outcomes[r] for r in range(self.world)]

    def _died(self, rank: int) -> Outcome:
        proc = self._procs[rank]
        proc.join(1.0)
        code = proc.exitcode
        self._kill(rank)
        return Outcome(
            rank,
            ok=False,
            error_type="WorkerDied",
            error_message=f"the worker process of rank {rank} exited (exit code {code})",
        )

    def _stack_and_kill(self, rank: int) -> str:
        """Dump a hung worker's Python stacks (via faulthandler), then kill it."""
        stack_path = os.path.join(self._tmpdir, f"stack-{rank}")
        try:
            os.kill(self._procs[rank].pid, signal.SIGUSR1)
        except OSError:
            pass
        deadline = time.monotonic() + _STACK_WAIT_S
        size = -1
        while time.monotonic() < deadline:
            time.sleep(0.05)
            new_size = os.path.getsize(stack_path) if os.path.exists(stack_path) else 0
            if new_size and new_size == size:
                break
            size = new_size
        self._kill(rank)
        try:
            with open(stack_path) as f:
                stacks = f.read()
        except OSError:
            stacks = ""
        return f"Python stacks of rank {rank} when it was killed:\n{stacks}" if stacks else ""

    def _kill(self, rank: int) -> None:
        proc, conn = self._procs[rank], self._conns[rank]
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join()
            proc.close()
        if conn is not None:
            conn.close()
        self._procs[rank] = self._conns[rank] = None
        self._needs_restart = True

    def _kill_all(self) -> None:
        for rank in range(self.world):
            self._kill(rank)


def run_ranks(fn: Callable[..., Any], world: int, /, *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """One-shot :meth:`RankPool.run`: spawn ``world`` ranks, run ``fn``, shut them down."""
    with RankPool(world) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)
