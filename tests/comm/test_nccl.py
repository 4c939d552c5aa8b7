"""The native NCCL communicator (``cpshard.comm.nccl``) against torch.distributed. Skipped without
a CUDA device and cpshard's NCCL build, except the NCCL bootstrap helpers, which need only the
NCCL build (the CUDA compile-only CI job runs them). The CUDA kernels of the ops are checked in
``tests/ops/test_cuda_kernels.py``.

NCCL refuses two ranks on one GPU: one rank checks every verb end to end on one GPU; the
multi-rank test runs only when two or more GPUs are visible.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.comm import resolve_group, transport_for

pytestmark = pytest.mark.gpu

needs_nccl_build = pytest.mark.skipif(
    not cpshard.build_info().nccl, reason="cpshard was built without the NCCL communicator"
)
needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not cpshard.build_info().nccl,
    reason="multi-rank NCCL needs two GPUs and cpshard's NCCL build",
)


# ---------------------------------------------------------------- NCCL, no GPU needed


@needs_nccl_build
def test_nccl_bootstrap_helpers_need_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpshard.comm import nccl

    uid = nccl.unique_id()
    assert uid.dtype == torch.uint8 and uid.shape == (nccl.UNIQUE_ID_BYTES,)
    assert not torch.equal(uid, nccl.unique_id())  # fresh every time
    # every NCCL library loaded (torch's and ours) reports, at run time, the version ours runs
    from cpshard.comm import nccl_runtime

    ours = int(nccl._native().version())
    assert nccl_runtime.mismatch(ours, nccl_runtime.loaded_versions()) == ""
    monkeypatch.delenv(nccl.BOOTSTRAP_ENV, raising=False)
    assert nccl.bootstrap_mode() == "split"
    monkeypatch.setenv(nccl.BOOTSTRAP_ENV, "unique_id")
    assert nccl.bootstrap_mode() == "unique_id"
    monkeypatch.setenv(nccl.BOOTSTRAP_ENV, "mpi")
    with pytest.raises(ValueError, match="CPSHARD_NCCL_BOOTSTRAP"):
        nccl.bootstrap_mode()


@needs_nccl_build
def test_nccl_communicator_checks_before_nccl() -> None:
    native = torch.classes.cpshard.NcclCommunicator
    uid = native.unique_id()
    with pytest.raises(RuntimeError, match="rank 3 out of range for world 2"):
        native(0, 0, uid, 3, 2, 0, 60.0)
    with pytest.raises(RuntimeError, match="is not a visible CUDA device"):
        native(0, 0, uid, 0, 1, torch.cuda.device_count(), 60.0)
    assert not native.parent_matches(0, 0, 1, 0)


UNDEFINED = -(2**31)  # NCCL_CONFIG_UNDEF_INT: NCCL resolves the field from the environment


@needs_nccl_build
def test_a_split_child_takes_torchs_config_made_blocking() -> None:
    """What the split passes NCCL, read from the very ``ncclConfig_t`` torch's options hold:
    every setting torch was given, and blocking whatever torch chose (a verb enqueues on the
    caller's thread; the watchdog bounds hangs by the group's timeout)."""
    native = torch.classes.cpshard.NcclCommunicator
    options = dist.ProcessGroupNCCL.Options()
    config = options.config
    config.blocking, config.cga_cluster_size, config.min_ctas, config.max_ctas = 1, 4, 2, 16
    config.split_share, config.net_name = 1, "Socket"
    assert native.split_config(config.unsafe_get_ptr()) == ([1, 4, 2, 16, 1], "Socket")
    defaults = dist.ProcessGroupNCCL.Options().config
    fields = [1, UNDEFINED, UNDEFINED, UNDEFINED, UNDEFINED]
    assert native.split_config(defaults.unsafe_get_ptr()) == (fields, "")
    garbage = torch.zeros(256, dtype=torch.uint8)  # not made by NCCL_CONFIG_INITIALIZER
    with pytest.raises(RuntimeError, match="is not an initialised ncclConfig_t"):
        native.split_config(garbage.data_ptr())


@needs_nccl_build
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the path up to the GPU, on a machine without"
)
def test_bootstrap_reaches_the_native_constructor_without_a_gpu() -> None:
    """On a one-rank gloo group (no NCCL without a GPU) the transport's own bootstrap runs for
    real (torch's communicator looked for, the unique id made and shared over the host channel)
    up to the native constructor, which refuses the missing device before anything reaches
    NCCL."""
    from cpshard.comm import nccl

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            group = resolve_group(dist.group.WORLD, "test")
            for mode in nccl.BOOTSTRAPS:
                with pytest.raises(RuntimeError, match="device 0 is not a visible CUDA device"):
                    nccl.communicator(group, torch.device("cuda", 0), bootstrap=mode)
        finally:
            dist.destroy_process_group()


# ---------------------------------------------------------------- NCCL at world size 1


@pytest.fixture
def nccl_world1():
    if not torch.cuda.is_available() or not cpshard.build_info().nccl:
        pytest.skip("needs a GPU and cpshard's NCCL build")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group(
            "nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0)
        )
        try:
            yield dist.group.WORLD
        finally:
            from cpshard.comm import nccl

            nccl.close(dist.group.WORLD)
            dist.destroy_process_group()


@pytest.mark.parametrize("bootstrap", ["split", "unique_id"])
def test_native_nccl_verbs_at_world_1(nccl_world1, bootstrap: str) -> None:
    from cpshard.comm import nccl

    group = resolve_group(nccl_world1, "test")
    comm = nccl.communicator(group, torch.device("cuda", 0), bootstrap=bootstrap)
    assert comm.bootstrap == bootstrap and comm.device == torch.device("cuda", 0)
    x = torch.randn(37, device="cuda")
    out = torch.empty(37, device="cuda")
    ref = torch.empty(37, device="cuda")
    comm.all_gather(out, x)
    dist.all_gather_into_tensor(ref, x, group=nccl_world1)
    assert torch.equal(out, ref)
    comm.all_gather(out, out)  # in place: local is this rank's slot
    assert torch.equal(out, ref)
    comm.all_gather_v(out, x, [37], key=1234)
    assert torch.equal(out, x)
    comm.reduce_scatter(out, x)
    dist.reduce_scatter_tensor(ref, x, group=nccl_world1)
    assert torch.equal(out, ref)
    comm.reduce_scatter_v(out, x, [37])
    assert torch.equal(out, x)
    z = torch.randn(5, dtype=torch.complex64, device="cuda")
    zout = torch.empty_like(z)
    comm.reduce_scatter(zout, z)
    assert torch.equal(zout, z)
    flags = torch.tensor([True, False, True], device="cuda")
    fout = torch.empty_like(flags)
    comm.reduce_scatter(fout, flags)  # a bool sum is a logical or, as on torch's path
    assert torch.equal(fout, flags)
    comm.send_recv([], [], key=None)
    # A side stream: the call runs there, and the allocator is told (record_stream).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = torch.randn(37, device="cuda")
        comm.all_gather_v(out, y, [37])
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(out, y)
    torch.cuda.synchronize()
    assert comm.error() == ""


@pytest.mark.parametrize("torch_first", [False, True])
def test_eagerly_initialised_subgroup_splits_from_torchs_communicator(
    nccl_world1, torch_first: bool
) -> None:
    """A subgroup of an eagerly initialised world (device_id given): cpshard looks torch's
    communicator up before anything else, splits from it, and asks torch to create one only
    when it has none, then exactly once; never when torch already has one (``torch_first``:
    a collective of torch's on the subgroup made sure it has)."""
    from cpshard.comm import nccl

    sub = dist.new_group([0])
    backend = sub._get_backend(torch.device("cuda", 0))
    if torch_first:
        dist.all_reduce(torch.ones(1, device="cuda"), group=sub)
        torch.cuda.synchronize()
    with torch.cuda.device(0):
        before = int(backend._comm_ptr())
    assert before != 0 or not torch_first, "torch's collective made no communicator"
    events: list[str] = []
    kind = type(backend)
    real_lookup, real_connect = kind._comm_ptr, kind.eager_connect_single_device

    def lookup(self):
        events.append("lookup")
        return real_lookup(self)

    def connect(self, device):
        events.append("connect")
        return real_connect(self, device)

    kind._comm_ptr, kind.eager_connect_single_device = lookup, connect
    try:
        group = resolve_group(sub, "test")
        comm = nccl.communicator(group, torch.device("cuda", 0))
        assert comm.bootstrap == "split", comm.bootstrap
        assert nccl.communicator(group, torch.device("cuda", 0)) is comm  # cached
        x = torch.randn(11, device="cuda")
        out = torch.empty_like(x)
        comm.all_gather(out, x)
        assert torch.equal(out, x)
        assert events[:1] == ["lookup"], events  # looked up first
        if before:
            assert "connect" not in events, events  # torch had one: never another
        else:
            assert events.count("connect") == 1, events  # none: created once, then looked up
            assert events[-1] == "lookup", events
        with torch.cuda.device(0):
            after = int(real_lookup(backend))
        assert after != 0 and (before == 0 or after == before), (before, after)
    finally:
        kind._comm_ptr, kind.eager_connect_single_device = real_lookup, real_connect
        nccl.close(sub)
        dist.destroy_process_group(sub)


def test_native_nccl_rejects_bad_arguments_before_enqueueing(nccl_world1) -> None:
    from cpshard.comm import nccl

    comm = nccl.communicator(resolve_group(nccl_world1, "test"), torch.device("cuda", 0))
    x = torch.randn(8, device="cuda")
    with pytest.raises(RuntimeError, match="sizes has 2 entries for a world of 1"):
        comm.all_gather_v(torch.empty(8, device="cuda"), x, [4, 4])
    with pytest.raises(RuntimeError, match="out has 7 elements"):
        comm.reduce_scatter_v(torch.empty(7, device="cuda"), x, [8])
    with pytest.raises(RuntimeError, match="must be on cuda:0"):
        comm.all_gather(torch.empty(8), x)
    with pytest.raises(RuntimeError, match="NCCL cannot sum dtype Short"):
        comm.reduce_scatter(torch.empty(8, dtype=torch.int16, device="cuda"), x.to(torch.int16))
    with pytest.raises(RuntimeError, match="send_peers holds 0"):
        comm.send_recv([(0, x)], [])
    # A bool reduce-scatter is accepted: a logical or (the max of 0/1 bytes; one rank here).
    flags = torch.tensor([True, False, False, True, False, True, True, False], device="cuda")
    ored = torch.empty_like(flags)
    comm.reduce_scatter(ored, flags)
    assert torch.equal(ored, flags)
    comm.reduce_scatter_v(ored, flags, [8])
    assert torch.equal(ored, flags)
    # The communicator is still healthy: nothing half-enqueued.
    out = torch.empty(8, device="cuda")
    comm.all_gather(out, x)
    torch.cuda.synchronize()
    assert torch.equal(out, x) and comm.error() == ""


def test_native_nccl_close(nccl_world1) -> None:
    from cpshard.comm import nccl

    group = resolve_group(nccl_world1, "test")
    comm = nccl.communicator(group, torch.device("cuda", 0))
    x = torch.randn(4, device="cuda")
    comm.all_gather(torch.empty(4, device="cuda"), x)
    nccl.close(nccl_world1)
    comm.close(0.0)  # idempotent
    with pytest.raises(RuntimeError, match="the communicator is closed"):
        comm.all_gather(torch.empty(4, device="cuda"), x)
    again = nccl.communicator(group, torch.device("cuda", 0))  # a fresh one after close
    assert again is not comm
    out = torch.empty(4, device="cuda")
    again.all_gather(out, x)
    torch.cuda.synchronize()
    assert torch.equal(out, x)


def test_transport_through_nccl_at_world_1(nccl_world1) -> None:
    """World size 1 aliases, as on CPU; the transport picks the native communicator."""
    x = torch.randn(2, 5, 8, device="cuda", requires_grad=True)
    assert cpshard.gather_sequence(x, nccl_world1) is x
    assert cpshard.gather_ragged(x, nccl_world1, [5], dim=1) is x
    assert type(transport_for(resolve_group(nccl_world1, "test"), x)).__name__ == "NcclTransport"


# ---------------------------------------------------------------- NCCL at world size 2


def _two_rank_worker(rank: int, store_path: str, bootstrap: str) -> None:
    from cpshard.comm import nccl

    device = torch.device("cuda", rank)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=device)
    try:
        group = resolve_group(dist.group.WORLD, "test")
        comm = nccl.communicator(group, device, bootstrap=bootstrap)
        sizes = [3, 5]
        mine = torch.full((sizes[rank],), float(rank + 1), device=device)
        out = torch.empty(8, device=device)
        comm.all_gather_v(out, mine, sizes)
        assert out.tolist() == [1.0] * 3 + [2.0] * 5
        full = torch.arange(8.0, device=device) * (rank + 1)
        part = torch.empty(sizes[rank], device=device)
        comm.reduce_scatter_v(part, full, sizes)
        assert (
            part.tolist()
            == (torch.arange(8.0) * 3)[[0, 1, 2] if rank == 0 else [3, 4, 5, 6, 7]].tolist()
        )
        # bool: a logical or over the ranks (rank r sets element i when (i + r) % 3 == 0)
        flags = torch.tensor([(i + rank) % 3 == 0 for i in range(8)], device=device)
        ored = torch.empty(sizes[rank], dtype=torch.bool, device=device)
        comm.reduce_scatter_v(ored, flags, sizes)
        want = [i % 3 == 0 or (i + 1) % 3 == 0 for i in range(8)]
        assert ored.tolist() == (want[:3] if rank == 0 else want[3:])
        recv = torch.empty(4, device=device)
        comm.send_recv(
            [(1 - rank, torch.full((4,), float(rank), device=device))], [(1 - rank, recv)]
        )
        assert recv.tolist() == [float(1 - rank)] * 4
        equal = torch.empty(4, device=device)
        comm.all_gather(equal, torch.full((2,), float(rank), device=device))
        assert equal.tolist() == [0.0, 0.0, 1.0, 1.0]
        assert comm.error() == ""
        nccl.close(dist.group.WORLD)
    finally:
        dist.destroy_process_group()


@needs_two_gpus
@pytest.mark.parametrize("bootstrap", ["split", "unique_id"])
def test_native_nccl_verbs_at_world_2(bootstrap: str) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _two_rank_worker,
            args=(os.path.join(tmp, "store"), bootstrap),
            nprocs=2,
            start_method="spawn",
        )
