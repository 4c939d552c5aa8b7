"""The native NCCL communicator as a :class:`cpshard.comm.Transport` (CUDA builds only).

One ``torch.classes.cpshard.NcclCommunicator`` per process group, created collectively on the
first transfer, on the device of the tensors moved (never the current device), and ended by
:func:`close` or when the process group is garbage collected (the calls in flight may finish for
up to the group's timeout, not past an error), or at interpreter exit (they get
:data:`EXIT_GRACE_S`), never left to garbage collection at exit. A quiescent communicator is
destroyed, any other aborted; one with calls captured into CUDA graphs is left to the process,
with a warning (NCCL's destroy and abort would wait for those graphs, maybe for ever).

**Bootstrap: split from torch's communicator** (``CPSHARD_NCCL_BOOTSTRAP=split``, the default).
Every rank asks torch for its own ``ncclComm_t`` of the group on that device
(``ProcessGroupNCCL._comm_ptr()``, looked up first; only when no rank has one does every rank ask
torch to create it, once, with ``eager_connect_single_device``), the ranks agree over the
host-side channel that all of them have it, and each calls ``ncclCommSplit`` on it with a copy
of the config torch made it with (its options' ``config``: CTAs, network, traffic class...),
made blocking: a verb enqueues on the caller's thread with no thread of NCCL's per call, and a
watchdog bounds hangs as torch's does (``csrc/comm/life.h``). The split itself follows the
parent's blocking mode inside NCCL: from a blocking parent it runs on a thread of its own and is
given up, raising, after the timeout; from a non-blocking parent it returns while NCCL's thread
still makes the child, which is waited for until NCCL publishes it. Splitting needs torch's and
cpshard's NCCL to be one library: every NCCL library loaded in the process must report, at run
time, the version cpshard's communicator runs (:mod:`cpshard.comm.nccl_runtime`). Why a split
child rather than driving torch's communicator directly:

* ownership: torch's communicator belongs to ``ProcessGroupNCCL``: its watchdog may abort and
  free it at any time (we would hold a dangling pointer), it may be non-blocking, and torch
  documents work launched into it from outside as unmonitored. The child is ours: our watchdog
  polls it with the group's timeout and aborts it, and closing it never touches torch's state;
* resources: NCCL shares the parent's buffers, channels and proxy thread with the child when the
  *parent* allows it (its ``config.splitShare``: ``ProcessGroupNCCL.Options().config.split_share
  = 1``, or ``NCCL_COMM_SPLIT_SHARE_RESOURCES=1`` before torch creates its communicator); then
  the child costs almost nothing. Otherwise NCCL gives the child buffers of its own, allocated
  lazily for the peers and algorithms it actually uses (the halo exchange's neighbours, the
  gathers' rings) — still no second bootstrap or unique id;
* ordering: our kernels go on the caller's current stream. torch makes its internal NCCL stream
  wait for the current stream when it issues a collective, so a torch collective issued after
  one of ours runs after it; with shared resources NCCL also serialises the two communicators'
  kernels in issue order. A torch collective issued with ``async_op=True`` and not waited on
  before one of ours may overlap it, exactly as two torch process groups may: every rank must
  issue both in the same order (the collective contract);
* abort: with shared resources the child also shares the parent's abort flag, so the child is
  aborted only when something already failed (an asynchronous error, the timeout, or calls
  still unfinished when the timeout ends the teardown's wait); a quiescent child is destroyed.

**Fallback: a unique id** (``CPSHARD_NCCL_BOOTSTRAP=unique_id``, or automatically when any rank
cannot split: a torch without ``_comm_ptr``, a wrapped backend under
``TORCH_DISTRIBUTED_DEBUG=DETAIL``, another NCCL library loaded next to ours). Rank 0 makes the id
(:func:`unique_id`, the function the CUDA compile-only CI job calls) and broadcasts it over the
host-side channel (:func:`cpshard.comm.host.all_gather_bytes`, the group's store), never over a
CUDA collective.
"""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from cpshard.comm import nccl_runtime
from cpshard.comm.group import Group, GroupLike, resolve_group
from cpshard.comm.host import all_gather_bytes, all_gather_small

BOOTSTRAPS = ("split", "unique_id")
BOOTSTRAP_ENV = "CPSHARD_NCCL_BOOTSTRAP"
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId), fixed by NCCL's ABI
EXIT_GRACE_S = 3.0  # how long queued calls may still finish at interpreter exit

_cache: weakref.WeakKeyDictionary[dist.ProcessGroup, NcclTransport] = weakref.WeakKeyDictionary()
# (process group name, device index) pairs whose communicator this process asked torch to
# create: never twice (torch would build, and leak, another one).
_connected: set[tuple[str, int]] = set()


def _native():
    """The TorchBind class (``torch.classes``, never ``torch.ops``)."""
    return torch.classes.cpshard.NcclCommunicator


def unique_id() -> torch.Tensor:
    """A fresh ncclUniqueId as a uint8 CPU tensor of :data:`UNIQUE_ID_BYTES` (needs no GPU)."""
    return _native().unique_id()


def version() -> tuple[int, int, int]:
    """(major, minor, patch) of the NCCL the communicator runs against."""
    return nccl_runtime.version_triple(int(_native().version()))


def bootstrap_mode() -> str:
    """The requested bootstrap, from ``CPSHARD_NCCL_BOOTSTRAP`` (default ``split``)."""
    mode = os.environ.get(BOOTSTRAP_ENV, "split").strip().lower()
    if mode not in BOOTSTRAPS:
        raise ValueError(f"{BOOTSTRAP_ENV} must be one of {', '.join(BOOTSTRAPS)}, got {mode!r}")
    return mode


class NcclTransport:
    """The transport verbs on a native ``cpshard::NcclCommunicator``.

    ``key`` (a fingerprint of the call's arguments that the gloo backend swaps with the data) is
    accepted and not checked here: reading it would need a host round trip per call."""

    def __init__(self, comm: torch.ScriptObject, bootstrap: str) -> None:
        self.comm = comm
        self.bootstrap = bootstrap  # how it was made: "split" or "unique_id"
        self.device = torch.device("cuda", int(comm.device()))

    def all_gather(self, out: torch.Tensor, local: torch.Tensor, key: int | None = None) -> None:
        self.comm.all_gather(out, local.contiguous().view(-1))

    def all_gather_v(
        self, out: torch.Tensor, local: torch.Tensor, sizes: Sequence[int], key: int | None = None
    ) -> None:
        self.comm.all_gather_v(out, local.contiguous().view(-1), list(sizes))

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        self.comm.reduce_scatter(out, full.contiguous().view(-1))

    def reduce_scatter_v(self, out: torch.Tensor, full: torch.Tensor, sizes: Sequence[int]) -> None:
        self.comm.reduce_scatter_v(out, full.contiguous().view(-1), list(sizes))

    def send_recv(
        self,
        sends: Sequence[tuple[int, torch.Tensor]],
        recvs: Sequence[tuple[int, torch.Tensor]],
        key: int | None = None,
    ) -> None:
        self.comm.send_recv(
            [t.contiguous().view(-1) for _, t in sends],
            [r for r, _ in sends],
            [t for _, t in recvs],
            [r for r, _ in recvs],
        )

    def error(self) -> str:
        """Why the communicator was aborted, set only once the abort has happened; ``""`` while
        it is usable or the abort is still under way."""
        return str(self.comm.error())

    def close(self, grace_s: float | None = None) -> None:
        """End the communicator (idempotent); later calls raise. Calls in flight get ``grace_s``
        seconds to finish (None: the group's timeout), then it is aborted; with calls captured
        into CUDA graphs it is left to the process instead."""
        self.comm.close(-1.0 if grace_s is None else float(grace_s))


def _timeout_s(backend: object) -> float:
    """The process group's timeout in seconds (torch's NCCL default when it has none)."""
    timeout = getattr(getattr(backend, "options", None), "_timeout", None)
    if not isinstance(timeout, timedelta):
        timeout = getattr(dist.distributed_c10d, "default_pg_nccl_timeout", None) or timedelta(
            minutes=10
        )
    return timeout.total_seconds()


def _runtime_mismatch() -> str:
    """Why this process's NCCL libraries forbid a split (``""`` when they all report the version
    cpshard's communicator runs): compared at run time, never with torch's compile-time
    version."""
    return nccl_runtime.mismatch(int(_native().version()), nccl_runtime.loaded_versions())


def _backend_of(group: Group, device: torch.device) -> object:
    """The group's backend object for ``device`` (torch's ``ProcessGroupNCCL``)."""
    assert group.pg is not None
    return group.pg._get_backend(device)


def _on_device(device: torch.device) -> AbstractContextManager[object]:
    """``device`` made current (torch's ``_comm_ptr`` reads the current device)."""
    return torch.cuda.device(device)


def _lookup(backend: object, device: torch.device) -> int:
    """torch's existing ``ncclComm_t`` of the group on ``device``, or 0 when it has none yet
    (``_comm_ptr`` returns 0 then; it never creates one)."""
    with _on_device(device):
        return int(backend._comm_ptr() or 0)  # type: ignore[attr-defined]


def _torch_comm(backend: object, device: torch.device, group: Group) -> int:
    """The address of torch's ``ncclComm_t`` for the group on ``device``, or 0 when this rank
    cannot split from it. Collective over the group's ranks (always entered by all of them).

    torch's communicator is looked up first: ``eager_connect_single_device`` builds a new one
    on every call, without looking at the one it has, and for a group initialised eagerly it
    splits that new one from the *world* communicator (collective over every world rank, which
    ranks outside this group never join). So it is called only when no rank of the group has a
    communicator yet, by every rank together (they agree on that first over the host channel, so
    no rank enters torch's collective creation alone), and at most once per group and device."""
    usable = hasattr(backend, "_comm_ptr")
    if usable and (why := _runtime_mismatch()):
        warnings.warn(f"cpshard NCCL: not splitting from torch's communicator: {why}", stacklevel=3)
        usable = False
    found = 0
    if usable:
        try:
            found = _lookup(backend, device)
        except RuntimeError as e:
            warnings.warn(f"cpshard NCCL: cannot read torch's communicator ({e})", stacklevel=3)
            usable = False
    # 0: cannot split (older torch, a wrapped backend, another NCCL); 1: usable, none yet;
    # 2: usable and torch has one.
    state = 0 if not usable else (2 if found else 1)
    states = all_gather_small(torch.tensor([state]), group).view(-1).tolist()
    if min(states) == 0:
        return 0  # some rank cannot split: the caller falls back to the unique id everywhere
    if max(states) == 2:
        return found  # torch has its communicator (0 here if only other ranks have one)
    # No rank has one: all create it now, together, once.
    assert group.pg is not None
    key = (group.pg.group_name, int(device.index))
    if key in _connected or not hasattr(backend, "eager_connect_single_device"):
        return 0
    _connected.add(key)
    try:
        with _on_device(device):
            backend.eager_connect_single_device(device)  # type: ignore[attr-defined]
        return _lookup(backend, device)
    except RuntimeError as e:  # this rank then votes for the unique id: no rank is left waiting
        warnings.warn(f"cpshard NCCL: cannot split from torch's communicator ({e})", stacklevel=3)
        return 0


def _torch_config(backend: object) -> object | None:
    """The ``NCCLConfig`` torch made the group's communicator with (its options' ``config``,
    which exposes the address of its ``ncclConfig_t``), or None when this torch does not give
    one: the split then passes NCCL's defaults, made blocking (never the parent's mode).
    """
    config = getattr(getattr(backend, "options", None), "config", None)
    return config if callable(getattr(config, "unsafe_get_ptr", None)) else None


def _create(group: Group, device: torch.device, mode: str) -> NcclTransport:
    """A communicator for ``group`` on ``device``; collective over the group's ranks."""
    assert group.pg is not None
    backend = _backend_of(group, device)
    timeout = _timeout_s(backend)
    native = _native()
    index = int(device.index)
    parent = _torch_comm(backend, device, group) if mode == "split" else 0
    can_split = parent != 0 and bool(native.parent_matches(parent, group.rank, group.world, index))
    # Splitting is collective over the parent: every rank splits, or none does.
    if mode == "split" and bool(all_gather_small(torch.tensor([int(can_split)]), group).all()):
        empty = torch.empty(0, dtype=torch.uint8)
        config: Any = _torch_config(backend)  # held until the split has read it
        address = int(config.unsafe_get_ptr()) if config is not None else 0
        return _agreed(
            lambda: native(parent, address, empty, group.rank, group.world, index, timeout),
            group,
            "split",
        )
    mine = unique_id().numpy().tobytes() if group.rank == 0 else b""
    uid = torch.frombuffer(bytearray(all_gather_bytes(mine, group)[0]), dtype=torch.uint8)
    return _agreed(
        lambda: native(0, 0, uid, group.rank, group.world, index, timeout), group, "unique_id"
    )


def _agreed(make: Callable[[], torch.ScriptObject], group: Group, bootstrap: str) -> NcclTransport:
    """``make()``'s communicator once every rank made its own: a rank whose creation failed
    tells the others over the host channel, and then every rank raises (naming the failed
    ranks) rather than some of them going on to block in a first transfer nobody joins."""
    comm, error = None, ""
    try:
        comm = make()
    except RuntimeError as e:
        error = str(e)
    made = all_gather_small(torch.tensor([int(comm is not None)]), group).view(-1).tolist()
    failed = [r for r, ok in enumerate(made) if not ok]
    if failed:
        if comm is not None:
            comm.close(0.0)  # nothing was enqueued: destroyed at once
        raise RuntimeError(
            f"cpshard NCCL: rank {group.rank}: creating the communicator ({bootstrap}) failed "
            f"on ranks {failed}" + (f": {error}" if error else "")
        )
    assert comm is not None
    return NcclTransport(comm, bootstrap)


def communicator(group: Group, device: torch.device, bootstrap: str | None = None) -> NcclTransport:
    """The communicator of ``group``'s process group on ``device``, created collectively on first
    use (``bootstrap`` overrides ``CPSHARD_NCCL_BOOTSTRAP`` for that creation)."""
    assert group.pg is not None
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"cpshard NCCL: device must be an indexed CUDA device, got {device}")
    found = _cache.get(group.pg)
    if found is None:
        mode = bootstrap_mode() if bootstrap is None else bootstrap
        if mode not in BOOTSTRAPS:
            raise ValueError(f"bootstrap must be one of {', '.join(BOOTSTRAPS)}, got {mode!r}")
        found = _create(group, device, mode)
        register(group.pg, found)
    elif found.device != device:
        raise ValueError(
            f"cpshard NCCL: the communicator of process group {group.pg.group_name!r} is on "
            f"{found.device}, got a tensor on {device} (one device per rank and group)"
        )
    return found


def register(pg: dist.ProcessGroup, transport: NcclTransport) -> None:
    """Cache ``transport`` as ``pg``'s communicator and end it with the process group (letting
    its calls finish for up to the group's timeout) or at interpreter exit (with a grace of
    :data:`EXIT_GRACE_S`); the finalizer holds no reference to the pg."""
    _cache[pg] = transport
    weakref.finalize(pg, transport.close).atexit = False  # exit is _close_at_exit's


@atexit.register
def _close_at_exit() -> None:
    """End every communicator at interpreter exit: queued calls get :data:`EXIT_GRACE_S`, then
    the communicator is aborted (a rank whose peer died must not wait out the group's timeout,
    ten minutes by default, on its way out)."""
    for transport in list(_cache.values()):
        transport.close(EXIT_GRACE_S)


def close(group: GroupLike) -> None:
    """End ``group``'s communicator now, if it has one (call before destroying the group)."""
    g = resolve_group(group, "cpshard.comm.nccl.close")
    found = _cache.pop(g.pg, None) if g.pg is not None else None
    if found is not None:
        found.close()
