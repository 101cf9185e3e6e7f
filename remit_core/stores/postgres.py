"""PostgreSQL engine (psycopg 3 and a connection pool), for many processes or hosts.

`postgresql://user@host:port/db`. Query options `min_size`/`max_size` size
the pool; other options go to libpq. Each primitive is one transaction (a
single statement runs in autocommit mode, one round trip); the fence check
holds the claim row `FOR SHARE` until commit.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from remit_core.errors import StoreUnavailable
from remit_core.stores._sql import SqlStore, Txn

try:
    import psycopg
    from psycopg_pool import ConnectionPool
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError('the PostgreSQL store needs: pip install "remit[postgres]"') from exc

_POOL_OPTS = ("min_size", "max_size")


class _PgTxn:
    """Adapts a psycopg cursor to the `?`-placeholder statements of `_sql`."""

    def __init__(self, cur: psycopg.Cursor[Any]) -> None:
        self._cur = cur

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        return self._cur.execute(sql.replace("?", "%s"), params, prepare=True)


class PostgresStore(SqlStore):
    """A pooled PostgreSQL store; the pool is re-created in a forked child."""

    _lock_suffix = " FOR SHARE"
    _blob_type = "BYTEA"

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        self._min = int(query.pop("min_size", "1"))
        self._max = int(query.pop("max_size", "4"))
        self._conninfo = urlunsplit(
            ("postgresql", parts.netloc, parts.path, urlencode(query), parts.fragment)
        )
        self._pool: ConnectionPool[Any] | None = None
        self._pid = -1
        self._lock = threading.Lock()

    def _get_pool(self) -> ConnectionPool[Any]:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                try:
                    self._pool = ConnectionPool(
                        self._conninfo, min_size=self._min, max_size=self._max, open=True,
                        kwargs={"autocommit": True}, timeout=30,
                    )
                    self._pool.wait(timeout=30)
                except Exception as exc:
                    raise StoreUnavailable(f"cannot reach PostgreSQL store: {exc}") from exc
                self._pid = os.getpid()
            return self._pool

    @contextlib.contextmanager
    def _txn(self) -> Iterator[Txn]:
        try:
            with self._get_pool().connection() as conn, conn.transaction(), conn.cursor() as cur:
                yield _PgTxn(cur)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL store failed: {exc}") from exc

    @contextlib.contextmanager
    def _read(self) -> Iterator[Txn]:
        # Pooled connections are in autocommit mode: one statement, one round trip.
        try:
            with self._get_pool().connection() as conn, conn.cursor() as cur:
                yield _PgTxn(cur)
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL store failed: {exc}") from exc

    _atomic = _read

    def setup(self) -> None:
        with self._txn() as txn:
            # Concurrent setup() calls from many processes serialise here.
            txn.execute("SELECT pg_advisory_xact_lock(7461313)")
            self._migrate(txn)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None and self._pid == os.getpid():
                self._pool.close()
            self._pool = None
