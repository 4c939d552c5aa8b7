"""Backend-string resolution (``cpshard.comm.backend_name``) and the transport choice that
rests on it (``cpshard.comm.select``), for every form of backend string torch produces."""

from __future__ import annotations

import pytest
import torch

from cpshard.comm import select
from cpshard.comm.backend_name import device_backend, parse_backend_string
from cpshard.comm.group import Group


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
