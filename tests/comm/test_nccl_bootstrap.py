"""The NCCL transport's bootstrap logic on CPU: ``cpshard.comm.nccl`` creating, caching and
closing communicators at W = 2 and 3 on gloo, with a stand-in for the native class (whose
constructor needs a GPU) and for torch's communicator address. What runs is the module's own
code: the ranks' agreement on splitting, the unique id made by rank 0 and broadcast over the
host-side channel, the device of the tensors, the per-group cache and ``close``."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cpshard.comm import nccl, resolve_group
from cpshard.testing import RankPool


class FakeCommunicator:
    """Stands in for ``torch.classes.cpshard.NcclCommunicator``: records how it was made."""

    def __init__(
        self,
        parent: int,
        parent_config: int,
        uid: torch.Tensor,
        rank: int,
        world: int,
        device: int,
        timeout_s: float,
    ) -> None:
        self.parent, self.parent_config = parent, parent_config
        self.uid, self.rank, self.world = uid.clone(), rank, world
        self.index, self.timeout_s, self.closed = device, timeout_s, False

    @staticmethod
    def unique_id() -> torch.Tensor:
        return torch.randint(0, 256, (nccl.UNIQUE_ID_BYTES,), dtype=torch.uint8)

    @staticmethod
    def version() -> int:
        return 23007

    @staticmethod
    def parent_matches(parent: int, rank: int, world: int, device: int) -> bool:
        return parent != 0

    def device(self) -> int:
        return self.index

    def error(self) -> str:
        return ""

    def close(self, grace_s: float) -> None:
        self.closed, self.grace_s = True, grace_s


@contextmanager
def stand_ins(can_split: bool) -> Iterator[None]:
    """The native class and torch's communicator address replaced for this rank."""
    saved = nccl._native, nccl._torch_comm
    nccl._native = lambda: FakeCommunicator
    nccl._torch_comm = lambda backend, device, group: 0xC0FFEE if can_split else 0
    try:
        yield
    finally:
        nccl._native, nccl._torch_comm = saved


def _made(
    rank: int, world: int, mode: str, splitters: list[int]
) -> tuple[str, int, list[int], float]:
    """Create the communicator of a fresh group on "cuda:<rank>" and report how it was made."""
    pg = dist.new_group(list(range(world)))
    group = resolve_group(pg, "test")
    with stand_ins(rank in splitters):
        comm = nccl.communicator(group, torch.device("cuda", rank), bootstrap=mode)
        assert nccl.communicator(group, torch.device("cuda", rank)) is comm  # cached per group
        with pytest.raises(ValueError, match="one device per rank and group"):
            nccl.communicator(group, torch.device("cuda", rank + 1))
        with pytest.raises(ValueError, match="indexed CUDA device, got cuda"):
            nccl.communicator(group, torch.device("cuda"))  # never the current device
        native = comm.comm
        assert (native.rank, native.world, native.index) == (rank, world, rank)
        assert comm.device == torch.device("cuda", rank)
        nccl.close(pg)
        assert native.closed and native.grace_s < 0  # the group's timeout, not the exit grace
        assert nccl.communicator(group, torch.device("cuda", rank)) is not comm  # a fresh one
        nccl.close(pg)
    return comm.bootstrap, native.parent, native.uid.tolist(), native.timeout_s


@pytest.mark.parametrize("world", [2, 3])
def test_split_when_every_rank_can(pools, world: int) -> None:
    pool: RankPool = pools(world)
    for bootstrap, parent, uid, timeout in pool.run(_made, "split", list(range(world))):
        assert bootstrap == "split" and parent == 0xC0FFEE and uid == [] and timeout > 0


@pytest.mark.parametrize("world", [2, 3])
def test_unique_id_from_rank_0_when_a_rank_cannot_split(pools, world: int) -> None:
    pool: RankPool = pools(world)
    made = pool.run(_made, "split", list(range(world - 1)))  # the last rank cannot split
    assert {m[0] for m in made} == {"unique_id"} and {m[1] for m in made} == {0}
    ids = [m[2] for m in made]
    assert len(ids[0]) == nccl.UNIQUE_ID_BYTES and all(i == ids[0] for i in ids)


def test_unique_id_when_asked(pools) -> None:
    made = pools(2).run(_made, "unique_id", [0, 1])
    assert [m[0] for m in made] == ["unique_id"] * 2 and made[0][2] == made[1][2]


def test_bootstrap_mode_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nccl.BOOTSTRAP_ENV, "unique_id")
    assert nccl.bootstrap_mode() == "unique_id"
    monkeypatch.setenv(nccl.BOOTSTRAP_ENV, "mpi")
    with pytest.raises(ValueError, match="CPSHARD_NCCL_BOOTSTRAP must be one of split, unique_id"):
        nccl.bootstrap_mode()


class RecordingBackend:
    """Stands in for torch's ``ProcessGroupNCCL`` on one rank: records every lookup and eager
    connect. Like torch's, ``_comm_ptr`` returns 0 while it has no communicator, and every
    ``eager_connect_single_device`` builds a new one (here: a new address)."""

    def __init__(self, has_comm: bool, fails: bool = False) -> None:
        self.calls: list[str] = []
        self.ptr = 0xBEEF if has_comm else 0
        self.fails = fails

    def _comm_ptr(self) -> int:
        self.calls.append("lookup")
        return self.ptr

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.calls.append("connect")
        if self.fails:
            raise RuntimeError("NCCL error: remote process exited")
        self.ptr = (self.ptr or 0xBEEF) + 0x100


def _through_torch(
    rank: int, world: int, has_comm: list[int], fails: list[int], mismatches: list[str]
) -> tuple[list[str], list[str], list[int]]:
    """Create, close and create again the communicator of one fresh group whose torch backend
    is a :class:`RecordingBackend` and whose NCCL libraries disagree on rank r as
    ``mismatches[r]`` says ("": they agree); report what the backend saw, the bootstraps and
    parents."""
    pg = dist.new_group(list(range(world)))
    group = resolve_group(pg, "test")
    backend = RecordingBackend(rank in has_comm, fails=rank in fails)
    saved = nccl._native, nccl._backend_of, nccl._on_device, nccl._runtime_mismatch
    nccl._native = lambda: FakeCommunicator
    nccl._backend_of = lambda g, d: backend
    nccl._on_device = lambda d: nullcontext()
    nccl._runtime_mismatch = lambda: mismatches[rank]
    made, parents = [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(2):
                comm = nccl.communicator(group, torch.device("cuda", rank))
                made.append(comm.bootstrap)
                parents.append(comm.comm.parent)
                nccl.close(pg)
    finally:
        nccl._native, nccl._backend_of, nccl._on_device, nccl._runtime_mismatch = saved
    return backend.calls, made, parents


SAME = ["", ""]  # every NCCL library in the process reports the version ours runs


@pytest.mark.parametrize("world", [2, 3])
def test_torchs_communicator_is_looked_up_and_never_created_when_it_exists(pools, world) -> None:
    out = pools(world).run(_through_torch, list(range(world)), [], [""] * 3)
    for calls, made, parents in out:
        assert calls == ["lookup", "lookup"], calls  # no eager connect at all
        assert made == ["split", "split"] and parents == [0xBEEF, 0xBEEF]


def test_torchs_communicator_is_created_once_when_no_rank_has_one(pools) -> None:
    for calls, made, parents in pools(2).run(_through_torch, [], [], SAME):
        # first creation: lookup (none), one eager connect, lookup; the second finds it
        assert calls == ["lookup", "connect", "lookup", "lookup"], calls
        assert made == ["split", "split"] and parents == [0xBEEF + 0x100] * 2


def test_no_eager_connect_when_only_some_ranks_have_torchs_communicator(pools) -> None:
    for calls, made, _ in pools(3).run(_through_torch, [0], [], SAME + SAME[:1]):
        assert "connect" not in calls and made == ["unique_id", "unique_id"]


def test_a_failed_eager_connect_on_one_rank_leaves_no_rank_waiting(pools) -> None:
    out = pools(2).run(_through_torch, [], [1], SAME, timeout=60)
    assert [o[0][:2] for o in out] == [["lookup", "connect"]] * 2
    # the failing rank voted against the split: every rank made a unique-id communicator
    assert all(o[1] == ["unique_id", "unique_id"] for o in out), out


def test_another_nccl_on_one_rank_means_no_split_and_no_eager_connect(pools) -> None:
    mismatches = ["", "another NCCL 2.29.1 is loaded"]
    for calls, made, _ in pools(2).run(_through_torch, [], [], mismatches):
        assert "connect" not in calls and made == ["unique_id", "unique_id"]


class TorchConfig:
    """Stands in for torch's ``ProcessGroupNCCL.Options().config``: the ``ncclConfig_t`` torch
    made its communicator with, whose address ``unsafe_get_ptr`` gives."""

    def __init__(self, address: int) -> None:
        self.address = address

    def unsafe_get_ptr(self) -> int:
        return self.address


class ConfiguredBackend(RecordingBackend):
    """torch's backend with its communicator and, when ``address`` is not 0, the config it was
    made with (torch's options; an older torch has no ``unsafe_get_ptr`` there)."""

    def __init__(self, address: int) -> None:
        super().__init__(has_comm=True)
        self.options = SimpleNamespace(config=TorchConfig(address) if address else object())


def _configs_passed(rank: int, world: int, address: int, mode: str) -> tuple[str, int, int]:
    """The bootstrap, parent and parent config address one creation passed the native class."""
    pg = dist.new_group(list(range(world)))
    group = resolve_group(pg, "test")
    backend = ConfiguredBackend(address)
    saved = nccl._native, nccl._backend_of, nccl._on_device, nccl._runtime_mismatch
    nccl._native = lambda: FakeCommunicator
    nccl._backend_of = lambda g, d: backend
    nccl._on_device = lambda d: nullcontext()
    nccl._runtime_mismatch = lambda: ""
    try:
        comm = nccl.communicator(group, torch.device("cuda", rank), bootstrap=mode)
        nccl.close(pg)
    finally:
        nccl._native, nccl._backend_of, nccl._on_device, nccl._runtime_mismatch = saved
    return comm.bootstrap, comm.comm.parent, comm.comm.parent_config


def test_the_split_passes_the_config_torch_made_its_communicator_with(pools) -> None:
    for made in pools(2).run(_configs_passed, 0xFACADE, "split"):
        assert made == ("split", 0xBEEF, 0xFACADE)  # the child takes torch's settings
    for made in pools(2).run(_configs_passed, 0, "split"):
        assert made == ("split", 0xBEEF, 0)  # none exposed: NCCL's defaults, made blocking
    for made in pools(2).run(_configs_passed, 0xFACADE, "unique_id"):
        assert made == ("unique_id", 0, 0)  # a communicator of its own: no parent, no config


class WrappedBackend:
    """An older torch's backend, or one wrapped under TORCH_DISTRIBUTED_DEBUG=DETAIL: it can
    eager-connect but has no ``_comm_ptr``."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.calls.append("connect")


def _without_lookup(rank: int, world: int) -> tuple[list[str], str]:
    pg = dist.new_group(list(range(world)))
    group = resolve_group(pg, "test")
    backend = WrappedBackend()
    saved = nccl._native, nccl._backend_of, nccl._on_device, nccl._runtime_mismatch
    nccl._native = lambda: FakeCommunicator
    nccl._backend_of = lambda g, d: backend
    nccl._on_device = lambda d: nullcontext()
    nccl._runtime_mismatch = lambda: ""
    try:
        comm = nccl.communicator(group, torch.device("cuda", rank))
        nccl.close(pg)
    finally:
        nccl._native, nccl._backend_of, nccl._on_device, nccl._runtime_mismatch = saved
    return backend.calls, comm.bootstrap


def test_a_backend_without_comm_ptr_falls_back_to_the_unique_id(pools) -> None:
    for calls, bootstrap in pools(2).run(_without_lookup):
        assert calls == [] and bootstrap == "unique_id"


class FailingOnRank1(FakeCommunicator):
    """A native constructor that fails on rank 1 only (a bad device, NCCL refusing)."""

    def __init__(self, parent, parent_config, uid, rank, world, device, timeout_s) -> None:
        if rank == 1:
            raise RuntimeError("NcclCommunicator: ncclCommInitRankConfig failed: internal error")
        super().__init__(parent, parent_config, uid, rank, world, device, timeout_s)


def _creation_fails_on_rank_1(rank: int, world: int) -> str:
    pg = dist.new_group(list(range(world)))
    group = resolve_group(pg, "test")
    saved = nccl._native, nccl._torch_comm
    nccl._native = lambda: FailingOnRank1
    nccl._torch_comm = lambda backend, device, group: 0
    try:
        with pytest.raises(RuntimeError) as info:
            nccl.communicator(group, torch.device("cuda", rank))
        assert nccl._cache.get(pg) is None  # nothing half-made is kept
    finally:
        nccl._native, nccl._torch_comm = saved
    return str(info.value)


def test_a_creation_failing_on_one_rank_fails_on_every_rank(pools) -> None:
    messages = pools(3).run(_creation_fails_on_rank_1, timeout=60)
    for rank, message in enumerate(messages):
        assert f"rank {rank}: creating the communicator (unique_id) failed on ranks [1]" in message
    assert "internal error" in messages[1] and "internal error" not in messages[0]
