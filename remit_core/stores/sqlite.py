"""SQLite engine: the embedded default, one file, WAL mode, `BEGIN IMMEDIATE`.

`sqlite:///relative.db`, `sqlite:////absolute/path.db`. Query options:
`synchronous=FULL|NORMAL` (default NORMAL: in WAL mode every commit survives
a killed process; FULL also survives power loss, except for claims, whose
holders all die with the host), `busy_timeout` in ms.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sqlite3
import threading
import time
import weakref
from collections.abc import Sequence
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

from remit_core import failpoints
from remit_core.errors import HeadMoved, StoreUnavailable
from remit_core.records import (
    BlobRecord,
    CheckpointRecord,
    Claim,
    FenceRef,
    WriteMode,
    WriteRecord,
)
from remit_core.stores._sql import (
    _CLAIM_ROW,
    _JOIN_WRITES,
    _SELECT_HEAD,
    _TAKE_CLAIM,
    _WRITE_COLS,
    _WRITE_CONFLICTS,
    _WRITE_OF_W,
    SqlStore,
    Txn,
    _ckpt_and_writes,
    _ckpt_params,
    _claim_of,
    _flat,
    _release_params,
    effect_claim_columns,
    int_option,
)
from remit_core.stores.base import display_url, stale_fence, url_options


def sqlite_path(url: str) -> str:
    """The file path a `sqlite://` URL names.

    A URL with a host (`sqlite://tmp/x.db`, one slash short) or a `#` would name
    another file than the one meant (the host, or all after the `#`, is no part of
    the path): each is a `ValueError` naming it, before any file is opened."""
    parts = urlsplit(url)
    if parts.netloc:
        raise ValueError(
            f"sqlite URL {display_url(url)!r} names a host "
            f"{parts.netloc.rpartition('@')[2]!r}, which a SQLite "
            "store has none of: write sqlite:///relative/path.db or "
            "sqlite:////absolute/path.db"
        )
    if "#" in url:
        raise ValueError(
            f"sqlite URL {display_url(url)!r} holds a '#', which would end its path there: "
            "name a file without one"
        )
    path = parts.path
    if path.startswith("/"):
        path = path[1:]
    if not path:
        raise ValueError(f"sqlite URL names no file: {url!r}")
    return path


#: SQLite's primary result codes SQLITE_BUSY and SQLITE_LOCKED.
_BUSY_CODES = (5, 6)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return int(code) & 0xFF in _BUSY_CODES
    return "locked" in str(exc) or "busy" in str(exc)


def connect_wal(path: str, *, busy_ms: int, synchronous: str = "NORMAL") -> sqlite3.Connection:
    """A connection to `path` in WAL mode, in autocommit mode, usable from any thread.

    Turning a new file to WAL needs the file to itself, and SQLite does not wait
    for that (the busy timeout does not apply): processes that open a new file
    together would see "database is locked" at once. That step is retried here,
    within the busy timeout.
    """
    conn = sqlite3.connect(
        path, isolation_level=None, check_same_thread=False, timeout=busy_ms / 1000
    )
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(busy_ms)}")
        deadline = time.monotonic() + busy_ms / 1000
        while True:
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                break
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.002 + random.random() * 0.008)
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    except BaseException:
        conn.close()
        raise
    return conn


#: A claim's row, the head of the branch it names and the head's writes;
#: parameters: run, ns, run, ns, branch (the head), run, scope (the claim).
_CLAIM_ROW_AND_HEAD = (
    f"SELECT cl.holder, cl.fence, cl.expires_at, head.*, {_WRITE_OF_W} FROM remit_claims cl "
    f"LEFT JOIN ({_SELECT_HEAD}) AS head ON true{_JOIN_WRITES.format(c='head')} "
    "WHERE cl.run_id = ? AND cl.scope = ? ORDER BY w.task_id, w.idx"
)
#: Branch heads a store keeps in memory (see `SQLiteStore.get_head`).
_HEADS_KEPT = 1024
_FENCED = "remit: stale fence"
_MOVED = "remit: head moved"
#: Columns of the commit view: a checkpoint's, then the compare-and-set and fence.
_COMMIT_WIDTH = 16
_COMMIT = f"INSERT INTO remit_commit VALUES ({', '.join('?' * _COMMIT_WIDTH)})"

#: The one-statement commit: a view to insert into, and the trigger that does
#: the work (fence check, head compare-and-set, checkpoint append). Migration 4
#: (fences carry their holder) replaces the views of migrations 2 and 3.
_COMMIT_SCHEMA = [
    "DROP TRIGGER IF EXISTS remit_commit_blobs_insert",
    "DROP VIEW IF EXISTS remit_commit_blobs",
    "DROP TRIGGER IF EXISTS remit_commit_insert",
    "DROP VIEW IF EXISTS remit_commit",
    """CREATE VIEW remit_commit AS SELECT
        run_id, checkpoint_id, branch, parent_id, state, ns, seq, metadata, schema_version,
        workflow_version, created_at, NULL AS expected_head, NULL AS fence_run,
        NULL AS fence_scope, NULL AS fence, NULL AS fence_holder
        FROM remit_checkpoints WHERE 0""",
    f"""CREATE TRIGGER remit_commit_insert INSTEAD OF INSERT ON remit_commit
    BEGIN
        SELECT RAISE(ABORT, '{_FENCED}') WHERE NEW.fence IS NOT NULL AND NOT EXISTS (
            SELECT 1 FROM remit_claims WHERE run_id = NEW.fence_run
            AND scope = NEW.fence_scope AND fence = NEW.fence
            AND holder = NEW.fence_holder);
        SELECT RAISE(ABORT, '{_MOVED}') WHERE CASE WHEN NEW.expected_head IS NULL
            THEN EXISTS (SELECT 1 FROM remit_branches WHERE run_id = NEW.run_id
                AND ns = NEW.ns AND branch = NEW.branch AND head_id IS NOT NULL)
            ELSE NOT EXISTS (SELECT 1 FROM remit_branches WHERE run_id = NEW.run_id
                AND ns = NEW.ns AND branch = NEW.branch AND head_id = NEW.expected_head)
            END;
        INSERT INTO remit_branches
            (run_id, branch, head_id, ns, head_seq, base_id, fork_token, created_at)
            VALUES (NEW.run_id, NEW.branch, NEW.checkpoint_id, NEW.ns, NEW.seq, NULL, NULL,
            NEW.created_at)
            ON CONFLICT (run_id, ns, branch) DO UPDATE SET head_id = excluded.head_id,
            head_seq = excluded.head_seq;
        INSERT INTO remit_checkpoints (run_id, checkpoint_id, branch, parent_id, state, ns,
            seq, metadata, schema_version, workflow_version, created_at)
            VALUES (NEW.run_id, NEW.checkpoint_id, NEW.branch, NEW.parent_id, NEW.state,
            NEW.ns, NEW.seq, NEW.metadata, NEW.schema_version, NEW.workflow_version,
            NEW.created_at);
    END""",
]

#: Blobs a one-statement commit carries (more go in with it in an explicit transaction).
_BLOB_SLOTS = 4
_SLOTS = range(1, _BLOB_SLOTS + 1)
_COMMIT_WITH_BLOBS = (
    "INSERT INTO remit_commit_blobs VALUES ("
    + ", ".join(["?"] * (_COMMIT_WIDTH + 2 * _BLOB_SLOTS))
    + ")"
)

#: The one-statement commit of a checkpoint and up to `_BLOB_SLOTS` blobs of it:
#: its trigger makes the commit above, then adds the blobs, in the one statement.
_COMMIT_WITH_BLOBS_SCHEMA = [
    "CREATE VIEW remit_commit_blobs AS SELECT *, "
    + ", ".join(f"NULL AS key{i}, NULL AS value{i}" for i in _SLOTS)
    + " FROM remit_commit WHERE 0",
    """CREATE TRIGGER remit_commit_blobs_insert
    INSTEAD OF INSERT ON remit_commit_blobs
    BEGIN
        INSERT INTO remit_commit VALUES (NEW.run_id, NEW.checkpoint_id, NEW.branch,
            NEW.parent_id, NEW.state, NEW.ns, NEW.seq, NEW.metadata, NEW.schema_version,
            NEW.workflow_version, NEW.created_at, NEW.expected_head, NEW.fence_run,
            NEW.fence_scope, NEW.fence, NEW.fence_holder);"""
    + "".join(
        f"""
        INSERT INTO remit_blobs (run_id, ns, key, value)
            SELECT NEW.run_id, NEW.ns, NEW.key{i}, NEW.value{i} WHERE NEW.key{i} IS NOT NULL
            ON CONFLICT (run_id, ns, key) DO NOTHING;"""
        for i in _SLOTS
    )
    + """
    END""",
]


#: The one-statement commit that also gives up the writer's claim (its last write):
#: its trigger makes the commit with blobs above, then releases the claim if the
#: claim is still (run, scope, fence, holder), as `SqlStore.release_claim` does.
_COMMIT_RELEASE_SCHEMA = [
    "DROP TRIGGER IF EXISTS remit_commit_release_insert",
    "DROP VIEW IF EXISTS remit_commit_release",
    "CREATE VIEW remit_commit_release AS SELECT *, NULL AS release_run, "
    "NULL AS release_scope, NULL AS release_fence, NULL AS release_holder "
    "FROM remit_commit_blobs WHERE 0",
    """CREATE TRIGGER remit_commit_release_insert
    INSTEAD OF INSERT ON remit_commit_release
    BEGIN
        INSERT INTO remit_commit_blobs VALUES (NEW.run_id, NEW.checkpoint_id, NEW.branch,
            NEW.parent_id, NEW.state, NEW.ns, NEW.seq, NEW.metadata, NEW.schema_version,
            NEW.workflow_version, NEW.created_at, NEW.expected_head, NEW.fence_run,
            NEW.fence_scope, NEW.fence, NEW.fence_holder, """
    + ", ".join(f"NEW.key{i}, NEW.value{i}" for i in _SLOTS)
    + """);
        UPDATE remit_claims SET holder = '', expires_at = 0 WHERE run_id = NEW.release_run
            AND scope = NEW.release_scope AND fence = NEW.release_fence
            AND holder = NEW.release_holder;
    END""",
]
_COMMIT_RELEASE = (
    "INSERT INTO remit_commit_release VALUES ("
    + ", ".join(["?"] * (_COMMIT_WIDTH + 2 * _BLOB_SLOTS + 4))
    + ")"
)


#: Rows per multi-row statement: a larger batch goes in as several, in one transaction.
_MAX_ROWS = 64
_BLOB_NAMES = ("run_id", "ns", "key", "value")
_WRITE_NAMES = _WRITE_COLS.split(", ")


def _values(n: int, width: int) -> str:
    return "VALUES " + ", ".join(["(" + ", ".join("?" * width) + ")"] * n)


@functools.lru_cache(maxsize=128)
def _blobs_sql(n: int) -> str:
    return (
        f"INSERT INTO remit_blobs ({', '.join(_BLOB_NAMES)}) {_values(n, 4)} "
        "ON CONFLICT (run_id, ns, key) DO NOTHING"
    )


@functools.lru_cache(maxsize=256)
def _writes_sql(n: int, mode: str, fenced: bool) -> str:
    """Writes in one statement; `fenced`: only while the claim has the fence whose
    run, scope, number and holder follow the rows' values."""
    where = (
        " WHERE EXISTS (SELECT 1 FROM remit_claims WHERE run_id = ? AND scope = ? "
        "AND fence = ? AND holder = ?)"
        if fenced
        else " WHERE true"  # (an upsert from a SELECT needs a WHERE)
    )
    return (
        f"INSERT INTO remit_writes ({_WRITE_COLS}) SELECT * FROM ({_values(n, 8)}){where} "
        f"ON CONFLICT (run_id, ns, checkpoint_id, task_id, idx) {_WRITE_CONFLICTS[mode]}"
    )


def _chunks(records: Sequence[Any]) -> list[Sequence[Any]]:
    return [records[i : i + _MAX_ROWS] for i in range(0, len(records), _MAX_ROWS)]


def _insert_rows(txn: Txn, blobs: Sequence[BlobRecord], writes: Sequence[WriteRecord]) -> None:
    """Blobs, then writes ("overwrite"), a multi-row statement per `_MAX_ROWS`."""
    for part in _chunks(blobs):
        txn.execute(_blobs_sql(len(part)), _flat(part, _BLOB_NAMES))
    for part in _chunks(writes):
        txn.execute(_writes_sql(len(part), "overwrite", False), _flat(part, _WRITE_NAMES))


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


class _LeaseStatement(_OneStatement):
    """`_OneStatement` at `synchronous = NORMAL`, for claims on a store set to FULL.

    A commit at NORMAL survives a killed process but not the loss of power; a
    claim lost so had only holders on this host, which died with it.
    """

    __slots__ = ()

    def __enter__(self) -> Txn:
        conn = super().__enter__()
        try:
            conn.execute("PRAGMA synchronous = NORMAL")
        except BaseException as exc:
            self.__exit__(type(exc), exc, exc.__traceback__)
            raise
        return conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        store = self._store
        conn = store._conn
        if conn is not None:
            try:
                conn.execute(f"PRAGMA synchronous = {store._synchronous}")
            except sqlite3.Error:
                # Never leave the connection at NORMAL: the next use opens a new one.
                store._conn = None
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
        super().__exit__(exc_type, exc, tb)


class _Transaction:
    """`BEGIN IMMEDIATE` ... `COMMIT` under the store's lock (a class, like `_OneStatement`).

    Every write transaction but a checkpoint commit forgets the remembered
    heads: it may move or delete any of them.
    """

    __slots__ = ("_store",)

    def __init__(self, store: SQLiteStore) -> None:
        self._store = store

    def __enter__(self) -> Txn:
        store = self._store
        store._lock.acquire()
        try:
            conn = store._connection()
            if not store._keep_heads:
                store._heads.clear()
            conn.execute("BEGIN IMMEDIATE")
        except BaseException as exc:
            store._lock.release()
            if isinstance(exc, sqlite3.Error):
                raise StoreUnavailable(f"SQLite store {store.path!r}: {exc}") from exc
            raise
        return conn

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        store = self._store
        try:
            conn = store._connection()
            failed: BaseException | None = exc
            if failed is None:
                try:
                    conn.execute("COMMIT")
                    return
                except sqlite3.Error as error:
                    failed = error
            # SQLite may have rolled back already (a full disk, an I/O error).
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            if exc is None:
                raise StoreUnavailable(
                    f"SQLite commit failed on {store.path!r}: {failed}"
                ) from failed
            if isinstance(exc, sqlite3.OperationalError):
                raise StoreUnavailable(f"SQLite store {store.path!r}: {exc}") from exc
        finally:
            store._lock.release()


def _hold_every_store() -> None:
    """Fork or stop only between statements. A thread of this process inside SQLite
    at a fork (a lease renewal, say) would leave SQLite's process-wide mutexes
    locked in the child, whose first open of any SQLite file would then hang; one
    inside a write at a stop would hold the file's write lock while stopped. Every
    statement runs under its store's lock, so holding all of them is enough."""
    while True:
        try:
            stores = sorted(_open_stores, key=id)
            break
        except RuntimeError:  # another thread opened a store meanwhile
            continue
    for store in stores:
        store._lock.acquire()
    _held_stores[:] = stores


def _release_every_store() -> None:
    for store in _held_stores:
        store._lock.release()
    _held_stores.clear()


def _after_fork_in_child() -> None:
    """The parent's connections and locks are not the child's: a connection is
    re-opened on first use, and each store gets a lock of its own."""
    _held_stores.clear()
    for store in list(_open_stores):
        store._lock = threading.RLock()
        store._conn = None
        store._heads.clear()
        store._heads_version = None
        store._keep_heads = False


_open_stores: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()
_held_stores: list[SQLiteStore] = []
os.register_at_fork(
    before=_hold_every_store,
    after_in_parent=_release_every_store,
    after_in_child=_after_fork_in_child,
)
failpoints.hold_at_stop(_hold_every_store, _release_every_store)


class SQLiteStore(SqlStore):
    """One connection per process, serialised by a lock; re-opened after fork.

    A checkpoint commit is one statement (see `_COMMIT_SCHEMA`). The store
    remembers the head records it read or committed, valid while
    `PRAGMA data_version` (which moves when any other connection commits)
    stays the same: reading the head just committed costs one pragma.
    """

    #: 2 and 3 made the commit views; 4 makes them anew, with the fence's holder;
    #: 5 adds the commit that releases its claim; 7 is the shared one.
    _engine_migrations: dict[int, list[str]] = {
        2: [],
        3: [],
        4: _COMMIT_SCHEMA + _COMMIT_WITH_BLOBS_SCHEMA,
        5: _COMMIT_RELEASE_SCHEMA,
        7: effect_claim_columns(),
    }

    def __init__(self, url: str) -> None:
        self.url = url
        # Resolved now: the file is opened lazily (and again in a forked child), after
        # the process may have changed its working directory.
        path = sqlite_path(url)
        self.path = path if path == ":memory:" else os.path.abspath(path)
        opts = url_options(url)
        self._synchronous = opts.pop("synchronous", "NORMAL").upper()
        if self._synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"unknown synchronous mode {self._synchronous!r} in {url!r}")
        self._busy_ms = int_option(opts, "busy_timeout", 30000, url)
        if opts:
            raise ValueError(
                f"unknown SQLite URL option {next(iter(opts))!r} in {url!r} (known: "
                "synchronous, busy_timeout)"
            )
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._one_statement = _OneStatement(self)
        self._transaction = _Transaction(self)
        self._lease_statement = (
            _LeaseStatement(self) if self._synchronous in ("FULL", "EXTRA") else self._one_statement
        )
        self._heads: dict[tuple[str, str, str], CheckpointRecord] = {}
        self._heads_version: int | None = None
        self._keep_heads = False  # set while a write that moves only its own head runs
        _open_stores.add(self)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:  # (a forked child starts with none, see `_after_fork_in_child`)
            try:
                conn = connect_wal(self.path, busy_ms=self._busy_ms, synchronous=self._synchronous)
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"cannot open SQLite store {self.path!r}: {exc}") from exc
            self._conn = conn
            self._heads.clear()
            self._heads_version = None
        return self._conn

    def _txn(self) -> contextlib.AbstractContextManager[Txn]:
        return self._transaction

    def _read(self) -> contextlib.AbstractContextManager[Txn]:
        # One statement in autocommit mode reads one consistent snapshot.
        return self._one_statement

    def _atomic(self) -> contextlib.AbstractContextManager[Txn]:
        # A write statement in autocommit mode takes the write lock when it starts
        # (waiting up to the busy timeout), so it needs no BEGIN IMMEDIATE.
        return self._one_statement

    def _lease_write(self) -> contextlib.AbstractContextManager[Txn]:
        # Every client of the file runs on this host: a claim need not outlive it.
        return self._lease_statement

    def acquire_claim(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float
    ) -> Claim:
        # The take, then the row (a row-returning write costs SQLite more than
        # both). The take succeeded if the row then names `holder`: between the two
        # only a takeover of a lapsed lease can land, and its row names another
        # holder (refused, as if it had come first).
        failpoints.hit("claim.in_acquire")
        with self._lease_statement as txn:
            txn.execute(_TAKE_CLAIM, (run_id, scope, holder, now + lease, now, now))
            row = txn.execute(_CLAIM_ROW, (run_id, scope)).fetchone()
        return _claim_of(run_id, scope, row if row is not None and row[0] == holder else None)

    def acquire_claim_at_head(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float, ns: str = ""
    ) -> tuple[Claim, CheckpointRecord | None, list[WriteRecord]]:
        # The take, then the claim's row and the head in one read (as `acquire_claim`).
        failpoints.hit("claim.in_acquire")
        with self._lease_statement as txn:
            txn.execute(_TAKE_CLAIM, (run_id, scope, holder, now + lease, now, now))
            rows = txn.execute(
                _CLAIM_ROW_AND_HEAD, (run_id, ns, run_id, ns, scope, run_id, scope)
            ).fetchall()
        row = rows[0] if rows else None
        claim = _claim_of(run_id, scope, row if row is not None and row[0] == holder else None)
        return (claim, *_ckpt_and_writes(rows, 3))

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
        # One INSERT into the `remit_commit` view: its trigger checks the fence,
        # moves the branch head from `expected_head` and appends the checkpoint,
        # all in the statement's own transaction; a few blobs of the checkpoint's
        # own run (`remit_commit_blobs`) and a release (`remit_commit_release`)
        # ride along. Other blobs and writes join it in an explicit transaction.
        r = record
        key = (r.run_id, r.ns, r.branch)
        params = _ckpt_params(r) + [
            expected_head,
            *(
                (None, None, None, None)
                if fence is None
                else (fence.run_id, fence.scope, fence.fence, fence.holder)
            ),
        ]
        carried = (
            not writes
            and len(blobs) <= _BLOB_SLOTS
            and all(b.run_id == r.run_id and b.ns == r.ns for b in blobs)
        )
        sql = _COMMIT
        if carried and (blobs or release is not None):
            sql = _COMMIT_WITH_BLOBS
            for b in blobs:
                params += (b.key, b.value)
            params += [None, None] * (_BLOB_SLOTS - len(blobs))
            if release is not None:
                sql = _COMMIT_RELEASE
                params += _release_params(release)
        with self._lock:
            self._keep_heads = True
            try:
                if not carried:
                    with self._transaction as txn:
                        self._commit_row(txn, r, expected_head, fence, sql, params)
                        _insert_rows(txn, blobs, writes)
                        if release is not None:
                            txn.execute(self._release_sql, _release_params(release))
                        failpoints.hit("checkpoint.in_commit")
                else:
                    failpoints.hit("checkpoint.in_commit")
                    with self._one_statement as txn:
                        self._commit_row(txn, r, expected_head, fence, sql, params)
            except BaseException:
                self._heads.pop(key, None)
                raise
            finally:
                self._keep_heads = False
            # This connection's own commit leaves data_version as it was.
            self._remember_head(key, record)

    def _commit_row(
        self,
        txn: Txn,
        r: CheckpointRecord,
        expected_head: str | None,
        fence: FenceRef | None,
        sql: str,
        params: Sequence[Any],
    ) -> None:
        try:
            txn.execute(sql, params)
        except sqlite3.IntegrityError as exc:
            reason = str(exc)
            if reason == _FENCED and fence is not None:
                self._check_fence(txn, fence)  # raises, naming the claim's fence now
                raise stale_fence(fence, None) from None
            if reason == _MOVED:
                raise HeadMoved(
                    f"branch {r.branch!r} no longer has head {expected_head!r}",
                    run_id=r.run_id,
                    checkpoint_id=r.checkpoint_id,
                ) from None
            if reason.startswith("UNIQUE constraint failed: remit_checkpoints"):
                raise HeadMoved(
                    "a checkpoint with this id already exists",
                    run_id=r.run_id,
                    checkpoint_id=r.checkpoint_id,
                ) from None
            raise

    def put_writes(
        self, writes: Sequence[WriteRecord], *, mode: WriteMode, fence: FenceRef | None = None
    ) -> None:
        if mode not in _WRITE_CONFLICTS or not 0 < len(writes) <= _MAX_ROWS:
            # expect_absent, or a batch too large for one statement: one transaction.
            super().put_writes(writes, mode=mode, fence=fence)
            return
        # One statement, so one implicit transaction: the fence check and every
        # write, or none.
        params = _flat(writes, _WRITE_NAMES)
        if fence is not None:
            params += (fence.run_id, fence.scope, fence.fence, fence.holder)
        failpoints.hit("writes.in_txn")
        with self._one_statement as txn:
            written = txn.execute(
                _writes_sql(len(writes), mode, fence is not None), params
            ).rowcount
            if written == 0 and fence is not None:
                # None written: every slot was taken ("first"), or the fence is stale.
                # A claim never returns to a (fence, holder) it left, so one that
                # holds now held for the statement.
                self._check_fence(txn, fence)

    def get_head(self, run_id: str, ns: str, branch: str) -> CheckpointRecord | None:
        key = (run_id, ns, branch)
        with self._one_statement as conn:
            try:
                version = conn.execute("PRAGMA data_version").fetchone()[0]
            except sqlite3.Error as exc:
                raise StoreUnavailable(f"SQLite store {self.path!r}: {exc}") from exc
            if version != self._heads_version:
                self._heads.clear()
                self._heads_version = version
            else:
                known = self._heads.get(key)
                if known is not None:
                    return known
            record = super().get_head(run_id, ns, branch)
            # Read at `version` or later: a later commit by another connection
            # moves data_version, and the next call forgets this record.
            if record is not None:
                self._remember_head(key, record)
            return record

    def _remember_head(self, key: tuple[str, str, str], record: CheckpointRecord) -> None:
        """Cache `record` as its branch's head; the oldest entry goes past `_HEADS_KEPT`
        (a process that writes many runs would otherwise keep every run's head)."""
        heads = self._heads
        heads.pop(key, None)  # re-inserted last: the newest
        if len(heads) >= _HEADS_KEPT:
            del heads[next(iter(heads))]
        heads[key] = record

    def setup(self) -> None:
        with self._txn() as txn:
            self._migrate(txn)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:  # (a forked child's was dropped at the fork)
                self._conn.close()
            self._conn = None
            self._heads.clear()
            self._heads_version = None
