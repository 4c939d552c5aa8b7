"""The NCCL transport's bootstrap logic on CPU: ``cpshard.comm.nccl`` creating, caching and
closing communicators at W = 2 and 3 on gloo, with a stand-in for the native class (whose
constructor needs a GPU) and for torch's communicator address. What runs is the module's own
code: the ranks' agreement on splitting, the unique id made by rank 0 and broadcast over the
host-side channel, the device of the tensors, the per-group cache and ``close``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from cpshard.comm import nccl, resolve_group
from cpshard.testing import RankPool


class FakeCommunicator:
    """Stands in for ``torch.classes.cpshard.NcclCommunicator``: records how it was made."""

    def __init__(
        self, parent: int, uid: torch.Tensor, rank: int, world: int, device: int, timeout_s: float
    ) -> None:
        self.parent, self.uid, self.rank, self.world = parent, uid.clone(), rank, world
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

    def close(self) -> None:
        self.closed = True


@contextmanager
def stand_ins(can_split: bool) -> Iterator[None]:
    """The native class and torch's communicator address replaced for this rank."""
    saved = nccl._native, nccl._torch_comm
    nccl._native = lambda: FakeCommunicator
    nccl._torch_comm = lambda backend, device: 0xC0FFEE if can_split else 0
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
        assert native.closed
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
