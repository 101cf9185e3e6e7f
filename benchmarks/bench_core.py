"""Remit's cost over the floor of each engine, side by side in one run.

For SQLite, PostgreSQL and Redis it measures

  commit: `Remit.commit` of a 10-message state, then `Remit.head`, against the
          engine's raw round trip of the same bytes (SQLite: one INSERT in a
          `BEGIN IMMEDIATE` transaction and one SELECT on a plain table, same
          WAL/synchronous settings; PostgreSQL: one INSERT and one SELECT;
          Redis: SET and GET);
  claim:  `Remit.claim` of a run (lease, fence, heartbeat), against one claim
          statement (SQLite and PostgreSQL: one INSERT; Redis: SET NX PX).
          On PostgreSQL, Remit takes a claim without waiting for the WAL flush
          (fences carry the holder, so a take lost in a crash is harmless),
          where the floor's INSERT waits for it: Remit's claim can cost less.

and prints per-operation medians and the ratios (targets: commit within 2x,
claim within 1.5x). Measurements alternate between Remit and the floor in
small blocks so that a busy machine slows both alike.

    python benchmarks/bench_core.py [--iterations 400] [--engines sqlite,postgresql,redis]

PostgreSQL and Redis come from REMIT_BENCH_PG / REMIT_BENCH_REDIS (defaults:
the local test servers). The floor's PostgreSQL table `remit_bench_floor` is
created if absent and only this run's rows are deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from remit_core import Remit, codec, open_store
from remit_core.stores.sqlite import sqlite_path

PG_URL = os.environ.get("REMIT_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REMIT_BENCH_REDIS", "redis://127.0.0.1:6379/0")
TARGETS = {"commit": 2.0, "claim": 1.5}
BLOCK = 25


def ten_message_state() -> bytes:
    """A chat-shaped state of 10 messages, encoded as a shim would hand it over."""
    messages = [
        {
            "role": "user" if i % 2 == 0 else "assistant",
            "content": f"message {i}: " + "lorem ipsum dolor sit amet " * 8,
            "id": str(uuid.UUID(int=i)),
        }
        for i in range(10)
    ]
    return codec.dumps({"messages": messages, "step": 10})


STATE = ten_message_state()


class Floor:
    """The engine's raw single-statement round trips."""

    def write_read(self, key: str) -> None:
        raise NotImplementedError

    def claim(self, key: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Release the connection."""


class SQLiteFloor(Floor):
    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = NORMAL")
        self.conn.execute("CREATE TABLE IF NOT EXISTS floor_data (k TEXT PRIMARY KEY, v BLOB)")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS floor_claims (k TEXT PRIMARY KEY, holder TEXT, "
            "fence INTEGER, expires_at REAL)"
        )

    def write_read(self, key: str) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute("INSERT INTO floor_data (k, v) VALUES (?, ?)", (key, STATE))
        self.conn.execute("COMMIT")
        self.conn.execute("SELECT v FROM floor_data WHERE k = ?", (key,)).fetchone()

    def claim(self, key: str) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.execute(
            "INSERT INTO floor_claims (k, holder, fence, expires_at) VALUES (?, 'h', 1, ?)",
            (key, time.time() + 30),
        )
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()


class PostgresFloor(Floor):
    def __init__(self, url: str) -> None:
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)
        self.tag = uuid.uuid4().hex
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS remit_bench_floor (k TEXT PRIMARY KEY, v BYTEA, "
            "holder TEXT, fence BIGINT, expires_at DOUBLE PRECISION)"
        )

    def write_read(self, key: str) -> None:
        k = f"{self.tag}:d:{key}"
        self.conn.execute(
            "INSERT INTO remit_bench_floor (k, v) VALUES (%s, %s)", (k, STATE), prepare=True
        )
        self.conn.execute(
            "SELECT v FROM remit_bench_floor WHERE k = %s", (k,), prepare=True
        ).fetchone()

    def claim(self, key: str) -> None:
        self.conn.execute(
            "INSERT INTO remit_bench_floor (k, holder, fence, expires_at) VALUES (%s, 'h', 1, %s)",
            (f"{self.tag}:c:{key}", time.time() + 30),
            prepare=True,
        )

    def close(self) -> None:
        self.conn.execute("DELETE FROM remit_bench_floor WHERE k LIKE %s", (f"{self.tag}:%",))
        self.conn.close()


class RedisFloor(Floor):
    def __init__(self, url: str) -> None:
        from redis import Redis

        self.client = Redis.from_url(url)
        self.tag = f"remit-bench:{uuid.uuid4().hex}"
        self.keys: list[str] = []

    def write_read(self, key: str) -> None:
        k = f"{self.tag}:d:{key}"
        self.keys.append(k)
        self.client.set(k, STATE)
        self.client.get(k)

    def claim(self, key: str) -> None:
        k = f"{self.tag}:c:{key}"
        self.keys.append(k)
        self.client.set(k, "h", nx=True, px=30_000)

    def close(self) -> None:
        for i in range(0, len(self.keys), 500):
            self.client.delete(*self.keys[i : i + 500])
        self.client.close()


@dataclass
class Case:
    engine: str
    url: str
    floor: Floor


def remit_commit_and_head(remit: Remit, run_id: str) -> Callable[[int], None]:
    parent: list[str | None] = [None]

    def op(i: int) -> None:
        cid = f"c{i:08d}"
        remit.commit(run_id=run_id, checkpoint_id=cid, parent_id=parent[0], state=STATE)
        head = remit.head(run_id)
        assert head is not None and head.checkpoint_id == cid
        parent[0] = cid

    return op


def remit_claim(remit: Remit, tag: str) -> Callable[[int], None]:
    def op(i: int) -> None:
        remit.claim(f"{tag}-{i}").abandon()

    return op


def measure(
    ours: Callable[[int], None], floor: Callable[[int], None], iterations: int
) -> tuple[float, float]:
    """Median seconds per operation of each, measured in alternating blocks."""
    for i in range(10):  # warm up connections, prepared statements, scripts
        ours(-1 - i)
        floor(-1 - i)
    times: dict[str, list[float]] = {"ours": [], "floor": []}
    done = 0
    while done < iterations:
        for name, fn in (("ours", ours), ("floor", floor)):
            for i in range(done, done + BLOCK):
                start = time.perf_counter()
                fn(i)
                times[name].append(time.perf_counter() - start)
        done += BLOCK
    return statistics.median(times["ours"]), statistics.median(times["floor"])


def cases(engines: list[str], tmp: str) -> list[Case]:
    out = []
    for engine in engines:
        if engine == "sqlite":
            url = f"sqlite:///{tmp}/bench.db"
            open_store(url)
            out.append(Case(engine, url, SQLiteFloor(sqlite_path(url))))
        elif engine == "postgresql":
            out.append(Case(engine, PG_URL, PostgresFloor(PG_URL)))
        elif engine == "redis":
            out.append(Case(engine, REDIS_URL, RedisFloor(REDIS_URL)))
        else:
            raise SystemExit(f"unknown engine {engine!r}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--engines", default="sqlite,postgresql,redis")
    args = parser.parse_args()
    iterations = max(BLOCK, args.iterations // BLOCK * BLOCK)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases(args.engines.split(","), tmp):
            remit = Remit(case.url)
            run_id = f"bench-{uuid.uuid4().hex}"
            try:
                commit = measure(
                    remit_commit_and_head(remit, run_id), case.floor.write_read, iterations
                )
                claim = measure(remit_claim(remit, run_id), case.floor.claim, iterations)
            finally:
                remit.delete_run(run_id)
                for i in range(-10, iterations):
                    remit.delete_run(f"{run_id}-{i}")
                case.floor.close()
            rows.append((case.engine, "commit", *commit))
            rows.append((case.engine, "claim", *claim))
    print(f"{'engine':<11} {'operation':<15} {'remit us':>9} {'floor us':>9} {'ratio':>6}  target")
    missed = 0
    for engine, op, ours, floor in rows:
        ratio = ours / floor
        ok = ratio <= TARGETS[op]
        missed += not ok
        label = "commit+head" if op == "commit" else "claim"
        print(
            f"{engine:<11} {label:<15} {ours * 1e6:>9.0f} {floor * 1e6:>9.0f} {ratio:>6.2f}  "
            f"<= {TARGETS[op]:.1f}x {'ok' if ok else 'MISSED'}"
        )
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
