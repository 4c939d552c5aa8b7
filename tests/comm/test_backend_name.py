"""Backend-string resolution (``cpshard.comm.backend_name``) and the choices that rest on it:
the transport (``cpshard.comm.select``) and torch's transport's routes (gloo's point-to-point
ones or torch's collectives), for every form of backend string torch produces."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from cpshard.comm import TorchTransport, resolve_group, select
from cpshard.comm.backend_name import device_backend, parse_backend_string
from cpshard.comm.group import Group
from tests.helpers import assert_no_mismatches


class Bound:
    """A registered per-device backend as ``ProcessGroup._get_backend`` returns it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def name(self) -> str:
        return self._name


class StandInGroup:
    """Stands in for a ``ProcessGroup``: the backends registered per device type, and a record
    of the device types asked for."""

    def __init__(self, **by_type: str) -> None:
        self.by_type, self.asked = by_type, []

    def _get_backend(self, device: torch.device) -> Bound:
        self.asked.append(device.type)
        if device.type not in self.by_type:
            raise RuntimeError(f"No backend type associated with device type {device.type}")
        return Bound(self.by_type[device.type])


@pytest.mark.parametrize(
    "text, cuda, cpu",
    [
        ("nccl", "nccl", "nccl"),
        ("NCCL", "nccl", "nccl"),
        ("gloo", "gloo", "gloo"),
        ("cpu:gloo,cuda:nccl", "nccl", "gloo"),
        ("cuda:nccl,cpu:gloo", "nccl", "gloo"),
        ("cpu:gloo, cuda:nccl", "nccl", "gloo"),
        ("cuda:nccl", "nccl", None),
        ("cpu:gloo", None, "gloo"),
        ("undefined", None, None),
        ("", None, None),
    ],
)
def test_backend_strings(text: str, cuda: str | None, cpu: str | None) -> None:
    assert parse_backend_string(text, "cuda") == cuda
    assert parse_backend_string(text, "cpu") == cpu


def test_a_malformed_backend_string_is_named() -> None:
    with pytest.raises(ValueError, match="malformed backend string 'cpu:gloo,cuda'"):
        parse_backend_string("cpu:gloo,cuda", "cuda")


def test_undefined_resolves_through_the_groups_device_backend() -> None:
    pg = StandInGroup(cuda="nccl", cpu="gloo")
    assert device_backend("undefined", pg, "cuda") == "nccl"
    assert device_backend("undefined", pg, "cpu") == "gloo"
    assert pg.asked == ["cuda", "cpu"]
    # a string that names the backend is not second-guessed: the group is not asked
    assert device_backend("cpu:gloo,cuda:nccl", pg, "cuda") == "nccl" and len(pg.asked) == 2
    # no backend for that device type, or only the string to go by
    assert device_backend("undefined", StandInGroup(cpu="gloo"), "cuda") == ""
    assert device_backend("cpu:gloo", StandInGroup(cpu="gloo"), "cuda") == ""
    assert device_backend("undefined", None, "cuda") == ""


class CudaLike:
    """What select reads of a tensor: where it lives."""

    def __init__(self, is_cuda: bool) -> None:
        self.is_cuda = is_cuda


@pytest.mark.parametrize(
    "text, by_type, native",
    [
        ("nccl", {}, True),
        ("cpu:gloo,cuda:nccl", {}, True),
        ("undefined", {"cuda": "nccl", "cpu": "gloo"}, True),
        ("undefined", {"cpu": "gloo"}, False),
        ("gloo", {}, False),
        ("cpu:gloo,cuda:gloo", {}, False),
    ],
)
def test_the_native_nccl_path_is_chosen_for_every_nccl_form(
    monkeypatch: pytest.MonkeyPatch, text: str, by_type: dict[str, str], native: bool
) -> None:
    class NcclBuild:
        nccl = True

    monkeypatch.setattr(select, "build_info", lambda: NcclBuild)
    monkeypatch.setattr(Group, "backend", property(lambda self: text))
    group = Group(StandInGroup(**by_type), 0, 2)  # type: ignore[arg-type]
    assert select.uses_native_nccl(group, CudaLike(True)) is native  # type: ignore[arg-type]
    assert select.uses_native_nccl(group, CudaLike(False)) is False  # type: ignore[arg-type]

    class CpuBuild:
        nccl = False

    monkeypatch.setattr(select, "build_info", lambda: CpuBuild)
    assert select.uses_native_nccl(group, CudaLike(True)) is False  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "text, by_type, gloo_cpu, gloo_cuda",
    [
        ("gloo", {}, True, True),
        ("cpu:gloo,cuda:nccl", {}, True, False),
        ("cpu:gloo", {}, True, False),
        ("undefined", {"cpu": "gloo", "cuda": "nccl"}, True, False),
        ("undefined", {"cuda": "nccl"}, False, False),
        ("nccl", {}, False, False),
    ],
)
def test_torch_transport_routes_by_the_tensors_device_backend(
    monkeypatch: pytest.MonkeyPatch,
    text: str,
    by_type: dict[str, str],
    gloo_cpu: bool,
    gloo_cuda: bool,
) -> None:
    """torch's transport takes gloo's point-to-point routes for a device exactly when the group's
    backend for that device type is gloo (a device map or ``"undefined"`` included)."""
    monkeypatch.setattr(Group, "backend", property(lambda self: text))
    transport = TorchTransport(Group(StandInGroup(**by_type), 0, 2))  # type: ignore[arg-type]
    assert transport.uses_gloo(torch.device("cpu")) is gloo_cpu
    assert transport.uses_gloo(torch.device("cuda", 0)) is gloo_cuda


# The gloo backend string forms of a real gloo group (the world's, read through each form) and a
# collective-route group ("nccl" forced on gloo, which runs torch's collectives too).
ROUTE_TEXTS = ["gloo", "cpu:gloo", "cpu:gloo,cuda:nccl", "undefined", "nccl"]
GATHERS = ("all_gather_into_tensor", "all_gather_single")
SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")
# The collective route calls them by the newest names this torch has (cpshard.comm.torch_compat).
NEWEST = {
    new if hasattr(dist, new) else old: 1
    for old, new in (GATHERS, SCATTERS)
}


def _routes_on_gloo(rank: int, world: int) -> list[str]:
    """One rank's equal all-gather and reduce-scatter through torch's transport for every form
    of ``ROUTE_TEXTS`` and on a group made with ``backend="cpu:gloo"``; the mismatches in
    results and in the route taken."""
    from tests.helpers import counting_collectives

    n = 3
    local = torch.arange(n, dtype=torch.float64) + 10 * rank
    want_gather = torch.cat([torch.arange(n, dtype=torch.float64) + 10 * r for r in range(world)])
    full = torch.arange(world * n, dtype=torch.float64) * (rank + 1)
    want_scatter = torch.arange(world * n, dtype=torch.float64)[rank * n : (rank + 1) * n] * sum(
        range(1, world + 1)
    )
    problems: list[str] = []

    def run(label: str, group: Group, p2p: bool) -> None:
        transport = TorchTransport(group)
        out, part = torch.empty(world * n, dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        with counting_collectives() as seen:
            transport.all_gather(out, local)
            transport.reduce_scatter(part, full)
        if not torch.equal(out, want_gather) or not torch.equal(part, want_scatter):
            problems.append(f"{label}: gathered {out.tolist()}, scattered {part.tolist()}")
        collectives = {name: seen[name] for name in GATHERS + SCATTERS if seen[name]}
        routed = (
            seen["batch_isend_irecv"] == 1 and seen["all_to_all_single"] == 1 and not collectives
            if p2p
            else collectives == NEWEST
        )
        if not routed:
            problems.append(f"{label}: {'p2p' if p2p else 'collective'} route expected, {seen}")

    world_group = resolve_group(dist.group.WORLD, "test")
    saved = Group.backend
    try:
        for text in ROUTE_TEXTS:
            Group.backend = property(lambda self, text=text: text)  # type: ignore[method-assign]
            run(text, world_group, text != "nccl")
    finally:
        Group.backend = saved  # type: ignore[method-assign]
    mapped = dist.new_group(list(range(world)), backend="cpu:gloo")
    try:
        group = resolve_group(mapped, "test")
        assert group.backend == "cpu:gloo", group.backend
        run("new_group(backend='cpu:gloo')", group, True)
    finally:
        dist.destroy_process_group(mapped)
    return problems


def test_torch_transport_routes_on_a_real_gloo_group(pools) -> None:
    assert_no_mismatches(pools(2).run(_routes_on_gloo))
