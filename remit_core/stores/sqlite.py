"""SQLite engine: the embedded default, one file, WAL mode, `BEGIN IMMEDIATE`.

`sqlite:///relative.db`, `sqlite:////absolute/path.db`. Query options:
`synchronous=FULL|NORMAL` (default NORMAL: in WAL mode every commit survives
a killed process; FULL also survives power loss), `busy_timeout` in ms.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator
from types import TracebackType
from urllib.parse import parse_qs, urlsplit

from remit_core.errors import StoreUnavailable
from remit_core.stores._sql import SqlStore, Txn


def sqlite_path(url: str) -> str:
    """The file path a `sqlite://` URL names."""
    parts = urlsplit(url)
    path = parts.path
    if path.startswith("/"):
        path = path[1:]
    if not path:
        raise ValueError(f"sqlite URL names no file: {url!r}")
    return path


class _OneStatement:
    """The store's connection under its lock, for one statement in autocommit mode.

    A plain class rather than a generator context: reads and claims are short
    enough that the generator's cost shows.
    """

    __slots__ = ("_store",)

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store

    def __enter__(self) -> Txn:
        self._store._lock.acquire()
        try:
            return self._store._connection()
        except BaseException:
            self._store._lock.release()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._store._lock.release()
        if isinstance(exc, sqlite3.OperationalError):
            raise StoreUnavailable(f"SQLite store {self._store.path!r}: {exc}") from exc


class SQLiteStore(SqlStore):
    """One connection per process, serialised by a lock; re-opened after fork."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.path = sqlite_path(url)
        opts = parse_qs(urlsplit(url).query)
        self._synchronous = opts.get("synchronous", ["NORMAL"])[0].upper()
        if self._synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"unknown synchronous mode {self._synchronous!r} in {url!r}")
        self._busy_ms = int(opts.get("busy_timeout", ["30000"])[0])
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._one_statement = _OneStatement(self)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            try:
                conn = sqlite3.connect(
                    self.path, isolation_level=None, check_same_thread=False, timeout=30
                )
                conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"cannot open SQLite store {self.path!r}: {exc}") from exc
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    @contextlib.contextmanager
    def _txn(self) -> Iterator[Txn]:
        with self._lock:
            conn = self._connection()
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"SQLite store {self.path!r}: {exc}") from exc
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            try:
                conn.execute("COMMIT")
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"SQLite commit failed on {self.path!r}: {exc}") from exc

    def _read(self) -> contextlib.AbstractContextManager[Txn]:
        # One statement in autocommit mode reads one consistent snapshot.
        return self._one_statement

    def _atomic(self) -> contextlib.AbstractContextManager[Txn]:
        # A write statement in autocommit mode takes the write lock when it starts
        # (waiting up to the busy timeout), so it needs no BEGIN IMMEDIATE.
        return self._one_statement

    def setup(self) -> None:
        with self._txn() as txn:
            self._migrate(txn)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None
