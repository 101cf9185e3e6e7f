"""The probe's outside world: a journal of step entries and an effect sink.

Both live in one SQLite file per scenario, shared by every process of the
scenario (forked workers open their own connection). The journal records who
entered which step and which crash point was reached; the sink behaves like a
payment API: it counts every application, answers "did key K happen?", and
ignores a repeated idempotency key when the caller supplies one. The harness
judges cells only from what these two tables and the store say.
"""

from __future__ import annotations

import contextvars
import os
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remit_core.effects import NOT_APPLIED
from remit_core.stores.sqlite import connect_wal

_SCHEMA = """
CREATE TABLE IF NOT EXISTS journal (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,
    name TEXT NOT NULL,
    run TEXT,
    pid INTEGER NOT NULL,
    tid INTEGER NOT NULL,
    resumer TEXT,
    t REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS effects (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    key TEXT,
    run TEXT,
    pid INTEGER NOT NULL,
    resumer TEXT,
    t REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS effects_by_key ON effects (key) WHERE key IS NOT NULL;
CREATE TABLE IF NOT EXISTS repeats (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    key TEXT NOT NULL,
    run TEXT,
    pid INTEGER NOT NULL,
    resumer TEXT,
    t REAL NOT NULL
);
"""

#: The label of the resumer now running in this thread/task (set by the harness).
current_resumer: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "remit_probe_resumer", default=None
)
#: The run the current operation is about (set by the harness around each operation).
current_run: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "remit_probe_run", default=None
)


@dataclass(frozen=True)
class Entry:
    """One journal row: a step entered (`kind="enter"`) or a crash point reached."""

    seq: int
    kind: str
    name: str
    run: str | None
    pid: int
    tid: int
    resumer: str | None
    t: float


class WorldDB:
    """The scenario's SQLite file; one connection per process, serialised across threads."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            conn = connect_wal(str(self.path), busy_ms=60_000)
            conn.executescript(_SCHEMA)
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._connection().execute(sql, params).fetchall()

    def insert(self, sql: str, params: tuple[Any, ...]) -> bool:
        """Run one INSERT (OR IGNORE); true if a row was written."""
        with self._lock:
            return self._connection().execute(sql, params).rowcount == 1

    def backup_to(self, dest: Path) -> None:
        """A consistent copy of the file (WAL included) at `dest`."""
        with self._lock:
            target = sqlite3.connect(dest)
            try:
                self._connection().backup(target)
            finally:
                target.close()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


class Journal:
    """Who entered which step, from which process, thread and resumer."""

    def __init__(self, db: WorldDB) -> None:
        self._db = db

    def record(self, kind: str, name: str) -> None:
        self._db.insert(
            "INSERT INTO journal (kind, name, run, pid, tid, resumer, t) VALUES (?,?,?,?,?,?,?)",
            (
                kind,
                name,
                current_run.get(),
                os.getpid(),
                threading.get_native_id(),
                current_resumer.get(),
                time.time(),
            ),
        )

    def entries(self, run: str | None = None) -> list[Entry]:
        rows = self._db.execute(
            "SELECT seq, kind, name, run, pid, tid, resumer, t FROM journal "
            + ("WHERE run = ? " if run is not None else "")
            + "ORDER BY seq",
            (run,) if run is not None else (),
        )
        return [Entry(*row) for row in rows]

    def entered(self, run: str | None = None, *, after: int = 0) -> Counter[str]:
        """How many times each step was entered (journal rows after seq `after`)."""
        return Counter(e.name for e in self.entries(run) if e.kind == "enter" and e.seq > after)

    def last_seq(self) -> int:
        rows = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM journal")
        return int(rows[0][0])


class EffectSink:
    """An outside system the probe's effects act on, with a payment API's key rule."""

    def __init__(self, db: WorldDB) -> None:
        self._db = db

    def apply(self, name: str, idempotency_key: str | None = None) -> str:
        """Apply effect `name`; a repeated `idempotency_key` is ignored (not counted).

        Returns a receipt, the same for a repeated key, as a payment API would.
        An ignored repeat is noted apart (`repeats`): the caller applied the
        effect again, and only the key rule of this sink kept it single.
        """
        row = (
            name,
            idempotency_key,
            current_run.get(),
            os.getpid(),
            current_resumer.get(),
            time.time(),
        )
        columns = "(name, key, run, pid, resumer, t) VALUES (?,?,?,?,?,?)"
        if not self._db.insert(f"INSERT OR IGNORE INTO effects {columns}", row):
            self._db.insert(f"INSERT INTO repeats {columns}", row)
        return f"{name}:{idempotency_key or 'no-key'}"

    def happened(self, idempotency_key: str) -> bool:
        """Did an application with `idempotency_key` happen?"""
        rows = self._db.execute("SELECT 1 FROM effects WHERE key = ? LIMIT 1", (idempotency_key,))
        return bool(rows)

    def reconcile(self, idempotency_key: str) -> Any:
        """A `reconcile=` hook for effects: the receipt if K happened, else NOT_APPLIED."""
        rows = self._db.execute(
            "SELECT name FROM effects WHERE key = ? LIMIT 1", (idempotency_key,)
        )
        return f"{rows[0][0]}:{idempotency_key}" if rows else NOT_APPLIED

    def counts(self, run: str | None = None) -> Counter[str]:
        """Applications counted per effect name (optionally for one run)."""
        rows = self._db.execute(
            "SELECT name, COUNT(*) FROM effects "
            + ("WHERE run = ? " if run is not None else "")
            + "GROUP BY name",
            (run,) if run is not None else (),
        )
        return Counter({name: int(n) for name, n in rows})

    def repeats(self) -> Counter[str]:
        """Applications attempted again under a key already applied (ignored, not
        counted), per effect name."""
        rows = self._db.execute("SELECT name, COUNT(*) FROM repeats GROUP BY name")
        return Counter({name: int(n) for name, n in rows})

    def last_seq(self) -> int:
        """The seq of the newest counted application (0 if none)."""
        rows = self._db.execute("SELECT COALESCE(MAX(seq), 0) FROM effects")
        return int(rows[0][0])

    def applied_by(self, pid: int, *, after: int = 0) -> Counter[str]:
        """Counted applications process `pid` made after seq `after`, per effect name."""
        rows = self._db.execute(
            "SELECT name, COUNT(*) FROM effects WHERE pid = ? AND seq > ? GROUP BY name",
            (pid, after),
        )
        return Counter({name: int(n) for name, n in rows})

    def applications(self) -> Iterator[tuple[str, str | None, str | None]]:
        """(name, key, run) of every counted application, in order."""
        yield from (
            (name, key, run)
            for name, key, run in self._db.execute(
                "SELECT name, key, run FROM effects ORDER BY seq"
            )
        )
