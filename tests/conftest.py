"""Session-wide rank pools: spawning workers costs seconds, so tests share them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
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


BenchRun = Callable[..., tuple[subprocess.CompletedProcess, dict]]


@pytest.fixture
def run_bench(tmp_path: Path) -> BenchRun:
    """``run(*args, timeout=300)``: ``python -m cpshard.bench ARGS --json F`` in a subprocess
    (one thread per rank); asserts it succeeded, returns the process and the parsed JSON."""

    def run(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict]:
        out = tmp_path / "bench.json"
        proc = subprocess.run(
            [sys.executable, "-m", "cpshard.bench", *args, "--json", str(out)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        assert proc.returncode == 0, proc.stderr
        return proc, json.loads(out.read_text())

    return run
