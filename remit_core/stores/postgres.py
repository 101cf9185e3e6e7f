"""PostgreSQL engine (psycopg 3 and a connection pool), for many processes or hosts.

`postgresql://user@host:port/db`. Query options `min_size`/`max_size` size
the pool, `idle_txn_timeout_ms` (default 10000) bounds how long a paused
client may hold a transaction open; other options go to libpq. Each primitive is one transaction (a
single statement runs in autocommit mode, one round trip); the fence check
holds the claim row `FOR SHARE` until commit.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import select
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from remit_core import failpoints
from remit_core.errors import HeadMoved, StoreUnavailable, VersionMismatch
from remit_core.records import (
    BlobRecord,
    CheckpointRecord,
    Claim,
    FenceRef,
    WriteMode,
    WriteRecord,
)
from remit_core.stores._sql import (
    _BRANCH_COLS,
    _CKPT_COLS,
    _CLAIM_RETURNING,
    _CLAIM_ROW,
    _JOIN_WRITES,
    _SELECT_HEAD,
    _TAKE_CLAIM_OF,
    _WRITE_COLS,
    _WRITE_CONFLICTS,
    _WRITE_OF_W,
    SqlStore,
    Txn,
    _ckpt_and_writes,
    _ckpt_params,
    _claim_of,
    _flat,
    effect_claim_columns,
    int_option,
)
from remit_core.stores.base import display_url, newer_schema, stale_fence, url_options

try:
    import psycopg
except ImportError as exc:  # pragma: no cover - depends on the extra
    raise ImportError('the PostgreSQL store needs: pip install "remit[postgres]"') from exc

#: How many times a copy runs whose snapshot a concurrent insert into its target
#: outdated (each on a new snapshot).
_COPY_ATTEMPTS = 5
#: How long a connection serves before it is closed and replaced.
_CONNECTION_LIFETIME = 3600.0
_IDLE = psycopg.pq.TransactionStatus.IDLE


#: Up to this many rows go in as a `VALUES` list (cheaper to bind than arrays);
#: more go in as one array per column, through `unnest`.
_MAX_VALUES_ROWS = 64
_BLOB_COLUMNS = (("run_id", "text"), ("ns", "text"), ("key", "text"), ("value", "bytea"))
_WRITE_COLUMNS = tuple(
    zip(
        _WRITE_COLS.split(", "),
        ("text", "text", "text", "int", "text", "bytea", "text", "text"),
        strict=True,
    )
)


def _rows_source(n: int, columns: tuple[tuple[str, str], ...]) -> str:
    """The FROM source of `n` rows of `columns` (a `VALUES` list, or `unnest` of arrays)."""
    if n > _MAX_VALUES_ROWS:
        return "unnest(" + ", ".join(f"?::{t}[]" for _, t in columns) + ")"
    typed = "(" + ", ".join(f"?::{t}" for _, t in columns) + ")"
    plain = "(" + ", ".join("?" for _ in columns) + ")"
    return "(VALUES " + ", ".join([typed] + [plain] * (n - 1)) + ")"


def _rows_params(records: Sequence[Any], columns: tuple[tuple[str, str], ...]) -> list[Any]:
    """The parameters of `_rows_source(len(records), columns)`."""
    if len(records) > _MAX_VALUES_ROWS:
        return [[getattr(rec, name) for rec in records] for name, _ in columns]
    return _flat(records, [name for name, _ in columns])


def _first_per_slot(writes: Iterable[WriteRecord]) -> list[WriteRecord]:
    first: dict[tuple[str, str, str, str, int], WriteRecord] = {}
    for w in writes:
        first.setdefault((w.run_id, w.ns, w.checkpoint_id, w.task_id, w.idx), w)
    return list(first.values())


@functools.lru_cache(maxsize=1024)
def _pg_placeholders(sql: str) -> str:
    """`sql` with psycopg's placeholders for `_sql`'s `?` (the statements are few)."""
    return sql.replace("?", "%s")


def _outdated_plan(exc: psycopg.Error) -> bool:
    """Whether `exc` is the server refusing a prepared statement whose result columns
    changed type since it was prepared (another session altered a table: a newer
    Remit's migration, most likely)."""
    return isinstance(exc, psycopg.errors.FeatureNotSupported) and "cached plan" in str(exc)


class _Outdated(Exception):
    """A prepared statement failed as `_outdated_plan` inside a transaction (which
    the failure aborted); the store decides what to raise."""


class _PgTxn:
    """Adapts a psycopg cursor to the `?`-placeholder statements of `_sql`.

    `stale` is set once a prepared statement of the connection was outdated by a
    change of the tables: the connection is then closed after use, so that none
    of its other prepared statements fails later.
    """

    def __init__(self, cur: psycopg.Cursor[Any], store: PostgresStore) -> None:
        self._cur = cur
        self._store = store
        self.stale = False

    def execute(self, sql: str, params: Sequence[Any] = ()) -> psycopg.Cursor[Any]:
        try:
            return self._cur.execute(_pg_placeholders(sql), params, prepare=True)
        except psycopg.errors.FeatureNotSupported as exc:
            if not _outdated_plan(exc):
                raise
            self.stale = True
            if self._cur.connection.pgconn.transaction_status != _IDLE:
                raise _Outdated() from exc
            # Outside a transaction the statement did not run (its plan was refused
            # first): refuse it if a newer Remit changed the tables, else run it anew.
            done = self._cur.execute(
                "SELECT version FROM remit_migrations", prepare=False
            ).fetchall()
            refusal = self._store._refuse_newer(int(r[0]) for r in done)
            if refusal is not None:
                raise refusal from exc
            return self._cur.execute(_pg_placeholders(sql), params, prepare=False)

    def raw(self, sql: str) -> None:
        """A statement that is not prepared (a `SET`), with no parameters."""
        self._cur.execute(sql, prepare=False)


#: A commit in one statement, so one round trip: the fence check (the claim row
#: held `FOR SHARE`), the branch head's compare-and-set, and, only if it moved,
#: the checkpoint, and the blobs and writes when there are any. A checkpoint id
#: already taken fails the whole statement on the primary key. `{move}` is the
#: head's compare-and-set.
_COMMIT = """
WITH claim AS (
    SELECT fence, holder FROM remit_claims WHERE run_id = ? AND scope = ? FOR SHARE
), moved AS (
    {move}
), checkpoint AS (
    INSERT INTO remit_checkpoints ({ckpt_cols})
    SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ? FROM moved
){blobs}{writes}{release}
SELECT (SELECT count(*) FROM moved), (SELECT fence FROM claim), (SELECT holder FROM claim)
"""
_COMMIT_BLOBS = """, blobs AS (
    INSERT INTO remit_blobs (run_id, ns, key, value)
    SELECT b.* FROM {source} AS b, moved
    ON CONFLICT (run_id, ns, key) DO NOTHING
)"""
_COMMIT_WRITES = """, writes AS (
    INSERT INTO remit_writes ({write_cols})
    SELECT w.* FROM {source} AS w, moved
    ON CONFLICT (run_id, ns, checkpoint_id, task_id, idx) DO UPDATE SET
        channel = excluded.channel, value = excluded.value, task_path = excluded.task_path
)"""
#: Parameters: fence, fence, holder (no fence presented: NULL, NULL, "").
_FENCE_HOLDS = "(?::bigint IS NULL OR EXISTS (SELECT 1 FROM claim WHERE fence = ? AND holder = ?))"
_MOVE_HEAD = (
    "UPDATE remit_branches SET head_id = ?, head_seq = ? WHERE run_id = ? AND ns = ? "
    f"AND branch = ? AND head_id = ? AND {_FENCE_HOLDS} RETURNING 1"
)
_CREATE_BRANCH = (
    f"INSERT INTO remit_branches ({_BRANCH_COLS}) SELECT ?, ?, ?, ?, ?, NULL, NULL, ? "
    f"WHERE {_FENCE_HOLDS} ON CONFLICT (run_id, ns, branch) DO UPDATE SET "
    "head_id = excluded.head_id, head_seq = excluded.head_seq "
    "WHERE remit_branches.head_id IS NULL RETURNING 1"
)
#: Step writes in one statement: the fence check, then every write or none.
_PUT_WRITES = """
WITH claim AS (
    SELECT fence, holder FROM remit_claims WHERE run_id = ? AND scope = ? FOR SHARE
), held AS (
    SELECT 1 WHERE {fence_holds}
), writes AS (
    INSERT INTO remit_writes ({write_cols})
    SELECT w.* FROM {source} AS w, held
    ON CONFLICT (run_id, ns, checkpoint_id, task_id, idx) {conflict}
)
SELECT (SELECT count(*) FROM held), (SELECT fence FROM claim), (SELECT holder FROM claim)
"""


def _rows_key(n: int) -> int:
    """Row counts that share one statement text (every count above the VALUES limit)."""
    return min(n, _MAX_VALUES_ROWS + 1)


@functools.lru_cache(maxsize=256)
def _put_writes_sql(mode: str, n: int) -> str:
    return _PUT_WRITES.format(
        fence_holds=_FENCE_HOLDS,
        write_cols=_WRITE_COLS,
        conflict=_WRITE_CONFLICTS[mode],
        source=_rows_source(n, _WRITE_COLUMNS),
    )


#: Gives a claim up with the commit, if the head moved (run, scope, fence, holder).
_COMMIT_RELEASE = """, released AS (
    UPDATE remit_claims SET holder = '', expires_at = 0 FROM moved
    WHERE run_id = ? AND scope = ? AND fence = ? AND holder = ?
)"""


@functools.lru_cache(maxsize=256)
def _commit_sql(first: bool, n_blobs: int, n_writes: int, release: bool) -> str:
    """The commit statement; one without blobs, writes or a release leaves their parts out."""
    blobs = _COMMIT_BLOBS.format(source=_rows_source(n_blobs, _BLOB_COLUMNS))
    writes = _COMMIT_WRITES.format(
        write_cols=_WRITE_COLS, source=_rows_source(n_writes, _WRITE_COLUMNS)
    )
    return _COMMIT.format(
        move=_CREATE_BRANCH if first else _MOVE_HEAD,
        ckpt_cols=_CKPT_COLS,
        blobs=blobs if n_blobs else "",
        writes=writes if n_writes else "",
        release=_COMMIT_RELEASE if release else "",
    )


#: In a statement, commit it without waiting for the WAL flush.
_NO_FLUSH = "(SELECT set_config('synchronous_commit', 'off', true)) IS NOT NULL"
#: A take does not wait for the WAL flush. Lost in a server crash, it can hand
#: its fence number out again, but to another holder, and fenced writes check
#: the holder too; any durable write of its holder flushes it first.
_ACQUIRE_CLAIM_ASYNC = (
    _TAKE_CLAIM_OF.format(row=f"SELECT ?, ?, ?, 1, ? WHERE {_NO_FLUSH}") + _CLAIM_RETURNING
)

#: Run ids up to this many bytes leave room in every index entry for the ids beside them.
_ROOMY_ID = 2400
#: A step write's key with a run id in it (see `PostgresStore._check_room`).
_TRY_WRITE_KEY = (
    "INSERT INTO remit_writes (run_id, ns, checkpoint_id, task_id, idx, channel, value, "
    "task_path) VALUES (?, '', ?, ?, 0, '', ''::bytea, '')"
)


class _Tried(Exception):
    """Rolls back the transaction of a try (`PostgresStore._check_room`)."""


#: A claim and the head it starts from (with its writes), in one round trip. The
#: head is read in the statement's snapshot, and so is the claim's row (`seen`): a
#: take that waited on a holder's transaction (a commit that released the claim, or
#: a lapsed holder's last commit, the taking holder's own included) sees that row
#: change after the snapshot, and the head it read may be older than the claim (see
#: `_read_head_again`).
_CLAIM_AT_HEAD = f"""
WITH claimed AS (
    {_ACQUIRE_CLAIM_ASYNC}
)
SELECT claimed.holder, claimed.fence, claimed.expires_at, seen.holder, seen.fence,
    head.*, {_WRITE_OF_W}
FROM (SELECT 1) AS one
LEFT JOIN claimed ON true
LEFT JOIN ({_CLAIM_ROW}) AS seen ON true
LEFT JOIN ({_SELECT_HEAD}) AS head ON true{_JOIN_WRITES.format(c="head")}
ORDER BY w.task_id, w.idx
"""
#: The head and its writes, read after a take (see `_read_head_again`).
_HEAD_AND_WRITES = f"""
SELECT head.*, {_WRITE_OF_W} FROM ({_SELECT_HEAD}) AS head{_JOIN_WRITES.format(c="head")}
ORDER BY w.task_id, w.idx
"""


def _read_head_again(claim: Claim, seen_holder: str | None, seen_fence: int | None) -> bool:
    """Whether a take's head, read in its statement's snapshot, may be older than
    the claim: yes unless the snapshot's claim row leaves no holder that could have
    committed since (none, or released) and the take's fence follows from it with
    no other take between. A row that names the taking holder itself counts as
    held: a commit of that holder's (one that gives the claim up, its last after
    its lease lapsed, or one under its live lease) may have been in flight, and
    the take waited for it."""
    if seen_fence is None:
        return claim.fence != 1
    if seen_holder == "":
        return claim.fence != seen_fence + 1
    return True


#: libpq options whose values it checks only when it connects, so that a bad one would
#: surface as `StoreUnavailable`, a failure to retry: checked with the URL instead.
_INT_OPTIONS = (
    "connect_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_count",
    "tcp_user_timeout",
)
_INT = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)
_SSLMODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")


def _check_values(query: dict[str, str], url: str) -> None:
    """A `ValueError` naming the option and `url` if a value libpq would refuse at
    connect is given (an integer option that is not one, an unknown `sslmode`)."""
    for name in _INT_OPTIONS:
        value = query.get(name)
        if value is not None and not _INT.fullmatch(value):
            raise ValueError(
                f"PostgreSQL URL option {name}={value!r} in {display_url(url)!r}: not an integer"
            )
    ports = query.get("port")
    if ports is not None and not all(p == "" or _INT.fullmatch(p) for p in ports.split(",")):
        raise ValueError(
            f"PostgreSQL URL option port={ports!r} in {display_url(url)!r}: not a port "
            "number (or a comma-separated list of them)"
        )
    sslmode = query.get("sslmode")
    if sslmode is not None and sslmode not in _SSLMODES:
        raise ValueError(
            f"PostgreSQL URL option sslmode={sslmode!r} in {display_url(url)!r}: one of "
            + ", ".join(_SSLMODES)
        )


def _too_large(exc: psycopg.errors.ProgramLimitExceeded) -> ValueError:
    """The refusal of a row PostgreSQL cannot hold: an id (run, checkpoint, blob
    key, fork token, ...) past what an index entry takes (2704 bytes for all the
    ids of one key together). The transaction rolled back: nothing was stored."""
    return ValueError(
        "an id is too long for the PostgreSQL store (the ids of one record must fit "
        f"in an index entry of 2704 bytes); nothing was stored: {exc.diag.message_primary}"
    )


def _alive(conn: psycopg.Connection[Any]) -> bool:
    """Whether an idle pooled connection may still be used: not closed, and nothing
    (the server's goodbye, its end of the socket) waiting to be read on it. One
    non-blocking poll, no round trip."""
    if conn.closed or conn.broken:
        return False
    fd = conn.pgconn.socket
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLPRI)
        return not poller.poll(0)
    readable, _, _ = select.select([fd], [], [], 0)
    return not readable


class _Pool:
    """At most `size` autocommit connections, each with its cursor, reused last
    in, first out. A statement's checkout and return cost two lock round trips
    here; a general-purpose pool's bookkeeping costs about as much as a fast
    statement. A connection returned broken or inside a transaction is closed,
    never reused; one past its lifetime is closed and replaced on demand, and one
    the server ended while it was idle is replaced when taken."""

    def __init__(self, conninfo: str, size: int, timeout: float = 30.0) -> None:
        self._conninfo = conninfo
        self._size = size
        self._timeout = timeout
        self._idle: list[tuple[psycopg.Connection[Any], psycopg.Cursor[Any], float]] = []
        self._count = 0  # connections open, idle or in use
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def get(self) -> tuple[psycopg.Connection[Any], psycopg.Cursor[Any], float]:
        """A connection, its cursor and when it expires; waits while all are in use."""
        deadline = None
        dead: psycopg.Connection[Any] | None = None
        with self._cond:
            while True:
                if self._closed:
                    raise StoreUnavailable("the PostgreSQL store is closed")
                if self._idle:
                    conn, cur, expires = self._idle.pop()
                    if _alive(conn):
                        return conn, cur, expires
                    # The server ended it while idle (a restart, a terminated
                    # backend): replace it in its slot rather than fail a call.
                    dead = conn
                    break
                if self._count < self._size:
                    self._count += 1
                    break
                deadline = deadline or time.monotonic() + self._timeout
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreUnavailable(
                        f"no PostgreSQL connection came free in {self._timeout:g}s "
                        f"(all {self._size} in use; raise max_size in the URL)"
                    )
                self._cond.wait(left)
        if dead is not None:
            dead.close()
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except BaseException as exc:
            self._forget()
            if isinstance(exc, psycopg.Error):
                raise StoreUnavailable(f"cannot reach PostgreSQL store: {exc}") from exc
            raise
        return conn, conn.cursor(), time.monotonic() + _CONNECTION_LIFETIME

    def put(self, conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any], expires: float) -> None:
        """Take a connection back (or close it: broken, in a transaction, expired, closed pool)."""
        with self._cond:
            keep = (
                not self._closed
                and not conn.closed
                and conn.pgconn.transaction_status == _IDLE
                and time.monotonic() < expires
            )
            if keep:
                self._idle.append((conn, cur, expires))
                self._cond.notify()
                return
        conn.close()
        self._forget()

    def _forget(self) -> None:
        with self._cond:
            self._count -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for conn, _, _ in idle:
            conn.close()


def _idled(exc: psycopg.Error) -> StoreUnavailable:
    """The server ended a session whose transaction sat idle past `idle_txn_timeout_ms`
    (the process was paused, or slowed, inside a write): nothing of it was kept."""
    return StoreUnavailable(
        "the PostgreSQL server ended this write's session: its transaction was idle longer "
        "than the store's idle_txn_timeout_ms (the process was paused or slowed inside "
        f"it), so nothing of it was kept ({exc})"
    )


class PostgresStore(SqlStore):
    """A pooled PostgreSQL store; the pool is re-created in a forked child."""

    _lock_suffix = " FOR SHARE"
    _blob_type = "BYTEA"
    #: 6: ids are ordered by their characters, as SQLite and Redis order them, not by
    #: the database's default collation (a language's, on most servers: "a" < "B").
    _engine_migrations: dict[int, list[str]] = {
        6: [
            f'ALTER TABLE {table} ALTER COLUMN {column} TYPE TEXT COLLATE "C"'
            for table, column in (
                ("remit_checkpoints", "checkpoint_id"),
                ("remit_branches", "branch"),
                ("remit_writes", "task_id"),
                ("remit_interrupts", "interrupt_id"),
            )
        ],
        7: effect_claim_columns("IF NOT EXISTS "),
    }
    _acquire_sql = _ACQUIRE_CLAIM_ASYNC
    #: A release does not wait for the WAL flush either. Lost in a server crash,
    #: it leaves the claim held until its lease ends, as if its holder had died (L1).
    _release_sql = SqlStore._release_sql + " AND " + _NO_FLUSH

    def __init__(self, url: str) -> None:
        self.url = url
        parts = urlsplit(url)
        query = url_options(url)
        self._min = int_option(query, "min_size", 1, url)
        self._max = int_option(query, "max_size", max(4, self._min), url, minimum=1)
        if self._min > self._max:
            raise ValueError(
                f"PostgreSQL URL: min_size={self._min} is above max_size={self._max} "
                f"({display_url(url)!r})"
            )
        # A client paused inside a transaction (a SIGSTOPped "zombie") would keep its
        # row locks and block the takeover that L1 promises; the server ends such a
        # transaction after this long. Remit's own transactions are never idle.
        idle_ms = int_option(query, "idle_txn_timeout_ms", 10000, url)
        query["options"] = (
            query.get("options", "") + f" -c idle_in_transaction_session_timeout={idle_ms}"
        ).strip()
        self._conninfo = urlunsplit(
            (
                "postgresql",
                parts.netloc,
                parts.path,
                urlencode(query, quote_via=quote),
                parts.fragment,
            )
        )
        try:
            # libpq parses the URL here, as the first connection would: an option it
            # does not know is refused now, like the other engines' (values are
            # checked by the server or at connect).
            psycopg.pq.Conninfo.parse(self._conninfo.encode())
        except psycopg.Error as exc:
            raise ValueError(
                f"bad PostgreSQL URL {display_url(url)!r}: {str(exc).strip()}"
            ) from None
        _check_values(query, url)
        self._pool: _Pool | None = None
        self._pid = -1
        #: Set once a newer Remit is found to have migrated the store (`_refuse_newer`).
        self._newer: str | None = None
        self._lock = threading.Lock()

    def _get_pool(self) -> _Pool:
        with self._lock:
            if self._pool is None or self._pid != os.getpid():
                # A forked child opens connections of its own (the parent's stay open).
                pool = _Pool(self._conninfo, self._max)
                # Open `min_size` now, so that an unreachable server fails here.
                opened = [pool.get() for _ in range(min(self._min, self._max))]
                for conn in opened:
                    pool.put(*conn)
                self._pool, self._pid = pool, os.getpid()
            return self._pool

    @contextlib.contextmanager
    def _connection(self) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Cursor[Any]]]:
        if self._newer is not None:
            raise VersionMismatch(self._newer)
        pool = self._get_pool()
        conn, cur, expires = pool.get()
        try:
            yield conn, cur
        finally:
            pool.put(conn, cur, expires)

    @contextlib.contextmanager
    def _txn(self) -> Iterator[Txn]:
        try:
            with self._connection() as (conn, cur):
                txn = _PgTxn(cur, self)
                try:
                    with conn.transaction():
                        yield txn
                finally:
                    if txn.stale:
                        conn.close()
        except _Outdated as exc:
            raise self._outdated(exc) from exc.__cause__
        except psycopg.errors.ProgramLimitExceeded as exc:
            raise _too_large(exc) from None
        except psycopg.errors.IdleInTransactionSessionTimeout as exc:
            raise _idled(exc) from exc
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL store failed: {exc}") from exc

    @contextlib.contextmanager
    def _read(self) -> Iterator[Txn]:
        # Pooled connections are in autocommit mode: one statement, one round trip.
        try:
            with self._connection() as (conn, cur):
                txn = _PgTxn(cur, self)
                try:
                    yield txn
                finally:
                    if txn.stale:
                        conn.close()
        except psycopg.errors.ProgramLimitExceeded as exc:
            raise _too_large(exc) from None
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(f"PostgreSQL store failed: {exc}") from exc

    def _refuse_newer(self, applied: Iterable[int]) -> VersionMismatch | None:
        """The refusal of a store a newer Remit migrated while this process used it;
        from then on every call raises it (this Remit does not know the new tables)."""
        refusal = newer_schema(applied, f"the store at {display_url(self.url)}")
        if refusal is not None:
            self._newer = refusal.message + " (migrated while this process used it)"
            return VersionMismatch(self._newer)
        return None

    def _outdated(self, exc: _Outdated) -> VersionMismatch | StoreUnavailable:
        """What a transaction whose prepared statement the tables outdated raises
        (nothing of it was kept): `VersionMismatch` if a newer Remit migrated the
        store, else `StoreUnavailable` (the connection is replaced; call again)."""
        refusal = self._refuse_newer(self.applied_migrations())
        if refusal is not None:
            return refusal
        return StoreUnavailable(
            "a table of the PostgreSQL store changed while this process had statements "
            f"prepared on it; nothing of this write was kept: call again ({exc.__cause__})"
        )

    _atomic = _read

    def _lock_doomed(self, txn: Txn, run_id: str, ns: str, checkpoint_ids: Sequence[str]) -> None:
        if checkpoint_ids:
            txn.execute(
                "SELECT 1 FROM remit_checkpoints WHERE run_id = ? AND ns = ? "
                "AND checkpoint_id = ANY(?) FOR UPDATE",
                (run_id, ns, list(checkpoint_ids)),
            ).fetchall()

    def _lock_branches(self, txn: Txn, run_id: str) -> None:
        txn.execute(
            "SELECT 1 FROM remit_branches WHERE run_id = ? FOR UPDATE", (run_id,)
        ).fetchall()

    @contextlib.contextmanager
    def _snapshot_txn(self) -> Iterator[Txn]:
        # READ COMMITTED reads each statement's own snapshot: a commit landing between
        # two of `copy_run`'s tables would copy a branch head without its checkpoint.
        with self._txn() as txn:
            assert isinstance(txn, _PgTxn)
            txn.raw("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            yield txn

    def copy_run(self, source_run_id: str, target_run_id: str) -> None:
        # The copy's one snapshot may predate a row another client inserted into
        # the target meanwhile (a second copy to it, a write): its insert-if-absent
        # then fails as a serialization failure. Nothing of it was kept; run on a
        # new snapshot, it sees that row and keeps it, as SQLite and Redis do.
        for attempt in range(_COPY_ATTEMPTS):
            try:
                super().copy_run(source_run_id, target_run_id)
                return
            except StoreUnavailable as exc:
                serial = isinstance(exc.__cause__, psycopg.errors.SerializationFailure)
                if not serial or attempt == _COPY_ATTEMPTS - 1:
                    raise

    def commit_checkpoint(
        self,
        record: CheckpointRecord,
        *,
        expected_head: str | None,
        blobs: Sequence[BlobRecord] = (),
        writes: Sequence[WriteRecord] = (),
        fence: FenceRef | None = None,
        release: Claim | None = None,
    ) -> None:
        r = record
        f_run, f_scope, f_fence, f_holder = (
            (r.run_id, "", None, "")
            if fence is None
            else (fence.run_id, fence.scope, fence.fence, fence.holder)
        )
        if expected_head is None:
            move: list[Any] = [r.run_id, r.branch, r.checkpoint_id, r.ns, r.seq, r.created_at]
        else:
            move = [r.checkpoint_id, r.seq, r.run_id, r.ns, r.branch, expected_head]
        params = [
            f_run,
            f_scope,
            *move,
            f_fence,
            f_fence,
            f_holder,
            *_ckpt_params(r),
        ]
        # One statement may touch a row once: the first blob of a key, the last write
        # of a slot.
        first_blobs = list({(b.run_id, b.ns, b.key): b for b in reversed(blobs)}.values())
        last_writes = list(
            {(w.run_id, w.ns, w.checkpoint_id, w.task_id, w.idx): w for w in writes}.values()
        )
        params += _rows_params(first_blobs, _BLOB_COLUMNS)
        params += _rows_params(last_writes, _WRITE_COLUMNS)
        if release is not None:
            params += [release.run_id, release.scope, release.fence, release.holder]
        sql = _commit_sql(
            expected_head is None,
            _rows_key(len(first_blobs)),
            _rows_key(len(last_writes)),
            release is not None,
        )
        failpoints.hit("checkpoint.in_commit")
        try:
            with self._atomic() as txn:
                moved, current, holder = txn.execute(sql, params).fetchone()
        except psycopg.errors.UniqueViolation as exc:
            if exc.diag.constraint_name != "remit_checkpoints_pkey":
                raise
            raise HeadMoved(
                "a checkpoint with this id already exists",
                run_id=r.run_id,
                checkpoint_id=r.checkpoint_id,
            ) from exc
        if fence is not None and (current != fence.fence or holder != fence.holder):
            raise stale_fence(fence, current, holder)
        if moved != 1:
            raise HeadMoved(
                f"branch {r.branch!r} no longer has head {expected_head!r}",
                run_id=r.run_id,
                checkpoint_id=r.checkpoint_id,
            )

    def put_writes(
        self, writes: Sequence[WriteRecord], *, mode: WriteMode, fence: FenceRef | None = None
    ) -> None:
        if mode not in _WRITE_CONFLICTS or not writes:
            # expect_absent: a taken slot refuses the batch (the SQL path).
            super().put_writes(writes, mode=mode, fence=fence)
            return
        keyed = {(w.run_id, w.ns, w.checkpoint_id, w.task_id, w.idx): w for w in writes}
        # One statement may touch a row once: the first of a slot wins, or the last.
        rows = list(keyed.values()) if mode == "overwrite" else _first_per_slot(writes)
        f_run, f_scope, f_fence, f_holder = (
            ("", "", None, "")
            if fence is None
            else (fence.run_id, fence.scope, fence.fence, fence.holder)
        )
        params = [f_run, f_scope, f_fence, f_fence, f_holder]
        params += _rows_params(rows, _WRITE_COLUMNS)
        sql = _put_writes_sql(mode, _rows_key(len(rows)))
        failpoints.hit("writes.in_txn")
        with self._atomic() as txn:
            held, current, holder = txn.execute(sql, params).fetchone()
        if not held and fence is not None:
            raise stale_fence(fence, current, holder)

    def _check_room(self, run_id: str) -> None:
        """Refuse, before its claim is taken, a run id too long for the run's records.

        PostgreSQL keeps the ids of a record's key in one index entry (2704 bytes,
        compressed if they compress): an id that fits the claim's entry could fail
        only at the first checkpoint, after the run's first step ran. A long id (in
        bytes) is tried in a step write's key, the widest a run uses, with ids of 64
        characters beside it; the try is rolled back. Shorter ids cost nothing."""
        if len(run_id) <= _ROOMY_ID // 4 or len(run_id.encode()) <= _ROOMY_ID:
            return
        try:
            with self._txn() as txn:
                txn.execute(_TRY_WRITE_KEY, (run_id, "0" * 64, "0" * 64))
                raise _Tried
        except _Tried:
            pass

    def acquire_claim(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float
    ) -> Claim:
        self._check_room(run_id)
        return super().acquire_claim(run_id, scope, holder, now=now, lease=lease)

    def acquire_claim_at_head(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float, ns: str = ""
    ) -> tuple[Claim, CheckpointRecord | None, list[WriteRecord]]:
        failpoints.hit("claim.in_acquire")
        self._check_room(run_id)
        with self._atomic() as txn:
            rows = txn.execute(
                _CLAIM_AT_HEAD,
                (run_id, scope, holder, now + lease, now, now)
                + (run_id, scope, run_id, ns, run_id, ns, scope),
            ).fetchall()
        claim = _claim_of(run_id, scope, rows[0])
        if not _read_head_again(claim, rows[0][3], rows[0][4]):
            return (claim, *_ckpt_and_writes(rows, 5))
        # Held when the snapshot was read (by another holder, or by this one): a commit
        # of that holder's may have landed after the snapshot. The claim is this
        # holder's now, so a read after it is the head.
        with self._read() as txn:
            rows = txn.execute(_HEAD_AND_WRITES, (run_id, ns, run_id, ns, scope)).fetchall()
        return (claim, *_ckpt_and_writes(rows))

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
