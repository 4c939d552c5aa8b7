"""Store requests per rank and wall time of the host channel's per-step round at world size W,
on one machine: a TCPStore server, W client connections in W threads (one per rank), each
client wrapped to count the requests it sends.

Usage: python scripts/host_channel_requests.py [--world 64] [--rounds 20] [--payload 512]
Prints one JSON object: requests per rank per round (min / max over ranks) and ms per round.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter
from datetime import timedelta

import torch.distributed as dist

from cpshard.comm.host import StoreChannel


class CountingStore:
    """Forwards every call to ``store`` and counts it by name."""

    def __init__(self, store: dist.Store) -> None:
        self._store, self.calls = store, Counter()

    def __getattr__(self, name: str):
        target = getattr(self._store, name)

        def call(*args, **kwargs):
            self.calls[name] += 1
            return target(*args, **kwargs)

        return call


def measure(world: int, rounds: int, payload: int) -> dict[str, object]:
    """Run ``rounds`` all-gathers of ``payload`` bytes per rank over a fresh TCPStore."""
    timeout = timedelta(seconds=120)
    server = dist.TCPStore("127.0.0.1", 0, world + 1, True, timeout=timeout, wait_for_workers=False)
    stores = [
        CountingStore(dist.TCPStore("127.0.0.1", server.port, world + 1, False, timeout=timeout))
        for _ in range(world)
    ]
    errors: list[BaseException] = []
    barrier = threading.Barrier(world)

    def rank_main(rank: int) -> None:
        try:
            channel = StoreChannel(stores[rank], rank, world)
            barrier.wait()
            for n in range(rounds):
                got = channel.all_gather(bytes([rank % 256, n % 256]) * (payload // 2))
                assert len(got) == world and got[3 % world][0] == 3 % world, "wrong payloads"
        except BaseException as e:  # noqa: B036 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    per_rank = [sum(s.calls.values()) / rounds for s in stores]
    kinds = Counter()
    for s in stores:
        kinds.update(s.calls)
    return {
        "world": world,
        "rounds": rounds,
        "payload_bytes": payload,
        "requests_per_rank_per_round": {"min": min(per_rank), "max": max(per_rank)},
        "requests_per_round_all_ranks": sum(per_rank),
        "by_kind_per_round": {k: v / rounds for k, v in sorted(kinds.items())},
        "ms_per_round": 1000 * elapsed / rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--payload", type=int, default=512, help="bytes per rank (64 int64)")
    args = parser.parse_args()
    print(json.dumps(measure(args.world, args.rounds, args.payload), indent=1))


if __name__ == "__main__":
    main()
