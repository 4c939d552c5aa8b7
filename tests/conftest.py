"""Session-wide rank pools: spawning workers costs seconds, so tests share them."""

from __future__ import annotations

from typing import Callable, Iterator

import pytest

from cpshard.testing import RankPool


@pytest.fixture(scope="session")
def pools() -> Iterator[Callable[[int], RankPool]]:
    """``get(world)``: this session's RankPool of ``world`` ranks, started on first use."""
    started: dict[int, RankPool] = {}

    def get(world: int) -> RankPool:
        if world not in started:
            started[world] = RankPool(world)
            started[world].start()
        return started[world]

    yield get
    for pool in started.values():
        pool.shutdown()


@pytest.fixture(scope="session")
def pool1(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(1)


@pytest.fixture(scope="session")
def pool2(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(2)


@pytest.fixture(scope="session")
def pool3(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(3)


@pytest.fixture(scope="session")
def pool4(pools: Callable[[int], RankPool]) -> RankPool:
    return pools(4)
