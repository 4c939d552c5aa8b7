"""The host channel over a store (``cpshard.comm.host.StoreChannel``): every rank's payload in
rank order, round after round, at a cost in store requests per rank that does not grow with the
group; and a ``"cpu:gloo,cuda:nccl"`` group's consensus runs over its gloo backend."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from cpshard.comm.host import StoreChannel


class CountingStore:
    """A shared ``HashStore`` seen through one rank's connection, counting its requests."""

    def __init__(self, store: dist.Store) -> None:
        self._store, self.calls = store, Counter()

    def __getattr__(self, name: str):
        target = getattr(self._store, name)

        def call(*args, **kwargs):
            self.calls[name] += 1
            return target(*args, **kwargs)

        return call


def _run(world: int, rounds: int) -> tuple[list[list[list[bytes]]], list[Counter], dist.Store]:
    shared = dist.HashStore()
    stores = [CountingStore(shared) for _ in range(world)]
    results: list[list[list[bytes]]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            channel = StoreChannel(stores[rank], rank, world)  # type: ignore[arg-type]
            for n in range(rounds):
                # payloads of different lengths, empty ones included
                results[rank].append(channel.all_gather(bytes([rank, n]) * ((rank + n) % 3)))
        except BaseException as e:  # noqa: B036 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results, [s.calls for s in stores], shared


@pytest.mark.parametrize("world", [1, 2, 5, 16])
def test_every_rank_gets_every_payload_in_rank_order(world: int) -> None:
    rounds = 6
    results, _, shared = _run(world, rounds)
    for rank in range(world):
        for n in range(rounds):
            assert results[rank][n] == [bytes([r, n]) * ((r + n) % 3) for r in range(world)]
    # rounds older than the last two are deleted: the store does not grow with the steps
    assert shared.num_keys() == 2 * 3


def test_requests_per_rank_do_not_grow_with_the_world() -> None:
    rounds = 5
    per_world = {}
    for world in (2, 8, 32):
        _, calls, _ = _run(world, rounds)
        per_world[world] = max(sum(c.values()) for c in calls)
        others = [sum(c.values()) for c in calls[1:]]
        # append + add + wait + get per round; + set for the rank that completes a round
        assert all(4 * rounds <= o <= 5 * rounds for o in others), others
    # rank 0 also deletes the keys of round n - 2 (three per round from round 2 on)
    assert all(
        4 * rounds + 3 * (rounds - 2) <= v <= 5 * rounds + 3 * (rounds - 2)
        for v in per_world.values()
    ), per_world


def test_a_rank_out_of_range_is_named() -> None:
    with pytest.raises(ValueError, match="rank 3 out of range for world 3"):
        StoreChannel(dist.HashStore(), 3, 3)  # type: ignore[arg-type]


def test_a_foreign_frame_is_reported() -> None:
    store = dist.HashStore()
    store.append("cpshard/host/0/data", b"\x07\x00\x00\x00\x01\x00\x00\x00x")  # "rank 7"
    store.add("cpshard/host/0/count", 1)
    channel = StoreChannel(store, 0, 2)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="bad frame"):
        channel.all_gather(b"mine")


def _mixed_group_round(rank: int, world: int) -> tuple[list[list[int]], int]:
    """A group whose backend string maps CPU to gloo gathers over gloo, not the store."""
    from cpshard.comm import Group, all_gather_small, host, resolve_group

    g = resolve_group(dist.group.WORLD, "test")
    original = Group.backend
    Group.backend = property(lambda self: "cpu:gloo,cuda:nccl")  # type: ignore[method-assign]
    used = []
    real = host.all_gather_bytes
    host.all_gather_bytes = lambda *a: used.append(1) or real(*a)
    try:
        rows = all_gather_small(torch.tensor([rank, 10 * rank]), g).tolist()
    finally:
        Group.backend, host.all_gather_bytes = original, real  # type: ignore[method-assign]
    return rows, len(used)


def test_a_cpu_gloo_cuda_nccl_group_agrees_over_gloo(pools) -> None:
    for rows, store_rounds in pools(2).run(_mixed_group_round):
        assert rows == [[0, 0], [1, 10]] and store_rounds == 0
