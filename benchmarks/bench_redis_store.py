"""The Redis store's primitives against Redis's own single-command round trips.

Store level, below the core (no sealing, no planning), so the numbers show
what the Lua scripts and the record encoding cost:

  commit + head:  `commit_checkpoint` of a ~4 KB state, then `get_head`,
                  against SET of the same bytes, then GET;
  commit:         `commit_checkpoint` alone, against SET alone;
  claim:          `acquire_claim` of a fresh scope, against SET NX PX.

Runs alternate in small blocks so that a busy machine slows both sides alike;
medians per operation and the ratios are printed.

    python benchmarks/bench_redis_store.py [--iterations 2000] [--url redis://...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections.abc import Callable

from redis import Redis

from remit_core.records import CheckpointRecord
from remit_core.stores.redis import RedisStore

BLOCK = 50
STATE = os.urandom(4096)


def timed(op: Callable[[int], object], start: int, n: int) -> list[float]:
    out = []
    for i in range(start, start + n):
        t0 = time.perf_counter()
        op(i)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument(
        "--url", default=os.environ.get("REMIT_BENCH_REDIS", "redis://127.0.0.1:6379/0")
    )
    opts = parser.parse_args()

    store = RedisStore(opts.url)
    store.setup()
    raw = Redis.from_url(opts.url)
    run_id = f"bench-{uuid.uuid4().hex}"
    floor_key = f"remit-bench:{run_id}"

    def commit(i: int) -> None:
        parent = None if i == 0 else f"c{i - 1:08d}"
        record = CheckpointRecord(
            run_id, f"c{i:08d}", "main", parent, STATE, seq=i, metadata={"step": i},
            created_at=time.time(),
        )  # fmt: skip
        store.commit_checkpoint(record, expected_head=parent)

    def commit_head(i: int) -> None:
        commit(i)
        store.get_head(run_id, "", "main")

    def set_only(i: int) -> None:
        raw.set(f"{floor_key}:{i}", STATE)

    def set_get(i: int) -> None:
        raw.set(f"{floor_key}:{i}", STATE)
        raw.get(f"{floor_key}:{i}")

    def claim(i: int) -> None:
        store.acquire_claim(run_id, f"s{i}", "h", now=time.time(), lease=30.0)

    def set_nx(i: int) -> None:
        raw.set(f"{floor_key}:claim:{i}", "h", nx=True, px=30000)

    pairs = {
        "commit + head": (commit_head, set_get),
        "commit": (commit, set_only),
        "claim": (claim, set_nx),
    }
    targets = {"commit + head": 2.0, "commit": 2.0, "claim": 1.5}
    samples: dict[str, tuple[list[float], list[float]]] = {}
    try:
        for name, (remit_op, floor_op) in pairs.items():
            store.delete_run(run_id)  # commits chain on "main" from c00000000 again
            remit, floor = samples[name] = ([], [])
            for start in range(0, opts.iterations, BLOCK):
                remit.extend(timed(remit_op, start, BLOCK))
                floor.extend(timed(floor_op, start, BLOCK))
        print(f"{'operation':<15} {'remit µs':>10} {'floor µs':>10} {'ratio':>7} {'target':>7}")
        for name, (remit, floor) in samples.items():
            r, f = statistics.median(remit) * 1e6, statistics.median(floor) * 1e6
            print(f"{name:<15} {r:>10.1f} {f:>10.1f} {r / f:>7.2f} {targets[name]:>7.1f}")
    finally:
        store.delete_run(run_id)
        for key in raw.scan_iter(match=f"{floor_key}:*", count=1000):
            raw.delete(key)


if __name__ == "__main__":
    main()
