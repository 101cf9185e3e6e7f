"""The store suite: every `Store` primitive and the `Remit` facade, on every engine.

Each test runs against SQLite, PostgreSQL and Redis through the shared
`store_url` fixture, with fresh run ids, and covers the refusals the contract
names: CAS failure, a second resume value, stale fences, forks without a token,
invalid writes, corrupt and unknown records.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typing_extensions import TypedDict

from remit_core import (
    MAIN_BRANCH,
    BranchRecord,
    CheckpointInvalid,
    CheckpointRecord,
    CorruptRecord,
    EffectRecord,
    Fenced,
    FenceRef,
    ForkWithoutIntent,
    HeadMoved,
    InterruptRecord,
    Migrations,
    Remit,
    ResumeConflict,
    StateSchema,
    Store,
    StoreUnavailable,
    UnknownRecord,
    VersionMismatch,
    WriteConflict,
    WriteRecord,
    codec,
    failpoints,
    open_store,
    policy,
)
from remit_core.core import _LeaseKeeper
from remit_core.records import BlobRecord
from remit_core.stores.base import SCHEMA_VERSION
from remit_core.stores.postgres import PostgresStore
from remit_core.stores.sqlite import SQLiteStore, sqlite_path

# -- helpers -----------------------------------------------------------------


@pytest.fixture
def store(store_url: str) -> Store:
    return open_store(store_url)


@pytest.fixture
def remit(store: Store) -> Remit:
    return Remit(store)


def engine_of(store: Store) -> str:
    return store.url.split(":", 1)[0]


def ckpt(
    run_id: str,
    cid: str,
    parent: str | None,
    *,
    seq: int = 1,
    branch: str = MAIN_BRANCH,
    ns: str = "",
    state: bytes | None = None,
) -> CheckpointRecord:
    return CheckpointRecord(
        run_id=run_id,
        checkpoint_id=cid,
        branch=branch,
        parent_id=parent,
        state=state if state is not None else f"state-{cid}".encode(),
        ns=ns,
        seq=seq,
        metadata={"step": seq, "source": "loop"},
        schema_version=3,
        workflow_version="wf-1",
        created_at=1000.0 + seq,
    )


def chain(store: Store, run_id: str, n: int, *, ns: str = "") -> list[str]:
    """Commit c01..cNN on main; returns their ids."""
    ids, parent = [], None
    for i in range(1, n + 1):
        cid = f"c{i:02d}"
        store.commit_checkpoint(ckpt(run_id, cid, parent, seq=i, ns=ns), expected_head=parent)
        ids.append(cid)
        parent = cid
    return ids


def head_id(store: Store, run_id: str, branch: str = MAIN_BRANCH, ns: str = "") -> str | None:
    b = store.get_branch(run_id, ns, branch)
    return None if b is None else b.head_id


def write(run_id: str, cid: str, task: str, idx: int, value: bytes, ns: str = "") -> WriteRecord:
    return WriteRecord(run_id, cid, task, idx, f"chan-{idx}", value, ns, f"path/{task}")


def pending(run_id: str, iid: str, branch: str = MAIN_BRANCH, prompt: bytes | None = None):
    return InterruptRecord(run_id, branch, iid, "c01", prompt=prompt, created_at=time.time())


def rewrite_state(
    store: Store, run_id: str, checkpoint_id: str, change: Callable[[bytes], bytes], ns: str = ""
) -> None:
    """Alter a stored checkpoint's bytes through the engine's own connection."""
    if engine_of(store) == "redis":
        rewrite_state_redis(store, run_id, ns, checkpoint_id, change)
        return
    with store._txn() as txn:  # type: ignore[attr-defined]
        row = txn.execute(
            "SELECT state FROM remit_checkpoints WHERE run_id = ? AND ns = ? AND checkpoint_id = ?",
            (run_id, ns, checkpoint_id),
        ).fetchone()
        txn.execute(
            "UPDATE remit_checkpoints SET state = ? WHERE run_id = ? AND ns = ? "
            "AND checkpoint_id = ?",
            (change(bytes(row[0])), run_id, ns, checkpoint_id),
        )


def rewrite_state_redis(
    store: Store, run_id: str, ns: str, checkpoint_id: str, change: Callable[[bytes], bytes]
) -> None:
    # Layout (see remit_core.stores.redis): hash remit:{run}:ck, field "cid NUL ns",
    # value "JSON header, newline, state bytes".
    from remit_core.stores.redis import run_prefix

    client = store._client()  # type: ignore[attr-defined]
    key, field = run_prefix(run_id) + "ck", f"{checkpoint_id}\x00{ns}"
    header, _, state = client.hget(key, field).partition(b"\n")
    client.hset(key, field, header + b"\n" + change(state))


def flip_last_byte(b: bytes) -> bytes:
    return b[:-1] + bytes([b[-1] ^ 0x01])


# -- lifecycle -----------------------------------------------------------------


def test_setup_is_idempotent_and_records_migrations(store: Store) -> None:
    store.setup()
    store.setup()
    assert store.applied_migrations() == list(range(1, SCHEMA_VERSION + 1))


def test_setup_from_many_fresh_instances_at_once(store: Store) -> None:
    """Concurrent setup() calls (as from many processes starting together) all succeed."""
    stores = [type(store)(store.url) for _ in range(4)]  # type: ignore[call-arg]
    errors: list[BaseException] = []

    def go(s: Store) -> None:
        try:
            s.setup()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for s in stores:
        assert s.applied_migrations() == list(range(1, SCHEMA_VERSION + 1))
        s.close()


def test_sqlite_failed_transaction_rolls_back_and_raises_store_unavailable(
    tmp_path: Path,
) -> None:
    store = SQLiteStore(f"sqlite:///{tmp_path}/t.db?busy_timeout=100")
    store.setup()
    claim = "INSERT INTO remit_claims (run_id, scope, holder, fence, expires_at) "
    with pytest.raises(StoreUnavailable, match="no such table"):
        with store._txn() as txn:
            txn.execute(claim + "VALUES ('r', 's', 'h', 1, 1.0)")
            txn.execute("SELECT * FROM no_such_table")
    assert store.get_claim("r", "s") is None  # rolled back
    chain(store, "r", 1)  # and the connection takes transactions again
    blocker = sqlite3.connect(sqlite_path(store.url), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(StoreUnavailable, match="locked"):
            store.delete_run("r")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    store.delete_run("r")
    assert store.get_head("r", "", MAIN_BRANCH) is None
    store.close()


def test_postgres_head_read_is_a_key_lookup_however_long_the_run(run_id: str) -> None:
    # The head is read by its id: the pages read do not grow with the run's length.
    # (Read as a join, the planner, whose statistics had not seen the run grow,
    # scanned all of the run's checkpoints.) In a schema of its own: other tests'
    # rows, written meanwhile, would change the pages an index lookup reads.
    import psycopg
    from conftest import PG_URL

    from remit_core.stores._sql import _SELECT_HEAD

    schema = f"remit_head_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    store = PostgresStore(f"{PG_URL}?options=-csearch_path%3D{schema}")
    store.setup()
    pages = []
    parent = None
    try:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"SET search_path = {schema}")
            # (From 400 to 1200 checkpoints the indexes keep their depth; a read of the
            # run's checkpoints would read three times the pages.)
            for first, last in ((1, 400), (401, 1200)):
                for i in range(first, last + 1):
                    cid = f"c{i:04d}"
                    store.commit_checkpoint(ckpt(run_id, cid, parent, seq=i), expected_head=parent)
                    parent = cid
                plan = conn.execute(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + _SELECT_HEAD.replace("?", "%s"),
                    (run_id, "", run_id, "", MAIN_BRANCH),
                ).fetchone()[0][0]["Plan"]
                pages.append(plan["Shared Hit Blocks"] + plan["Shared Read Blocks"])
        assert head_id(store, run_id) == "c1200"
        assert pages[1] <= pages[0] + 1, pages
    finally:
        store.close()
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_postgres_pool_serves_more_threads_than_connections(run_id: str) -> None:
    # 8 threads on 2 connections: each waits its turn, none times out, and every
    # connection goes back to the pool (a free list beside the pool once starved
    # waiters here).
    from conftest import PG_URL

    store = PostgresStore(f"{PG_URL}?max_size=2")
    store.setup()
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait()
            parent = None
            for n in range(15):
                cid = f"t{i}-{n:02d}"
                store.commit_checkpoint(
                    ckpt(f"{run_id}-{i}", cid, parent, seq=n + 1), expected_head=parent
                )
                parent = cid
                assert head_id(store, f"{run_id}-{i}") == cid
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert all(not t.is_alive() for t in threads)
        assert store._pool is not None and store._pool._count <= 2
    finally:
        for i in range(8):
            store.delete_run(f"{run_id}-{i}")
        store.close()


def test_postgres_pool_drops_a_killed_connection_and_times_out_by_name(run_id: str) -> None:
    import psycopg
    from conftest import PG_URL

    store = PostgresStore(f"{PG_URL}?max_size=1")
    store.setup()
    try:
        with store._read() as txn:
            pid = txn.execute("SELECT pg_backend_pid()").fetchone()[0]
        with psycopg.connect(PG_URL, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            deadline = time.monotonic() + 30
            while (
                time.monotonic() < deadline
                and admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()[0]
            ):
                time.sleep(0.05)
        time.sleep(1.0)  # (the backend's last bytes reach its socket as it exits)
        # The server ended the idle pooled connection: the pool replaces it before use,
        # so the next statement works.
        assert store.get_head(run_id, "", MAIN_BRANCH) is None
        store.commit_checkpoint(ckpt(run_id, "c1", None, seq=1), expected_head=None)
        assert head_id(store, run_id) == "c1"
        with store._read() as txn:
            assert txn.execute("SELECT pg_backend_pid()").fetchone()[0] != pid
        # Every connection in use past the timeout: a clear error, not a hang.
        assert store._pool is not None
        store._pool._timeout = 0.2
        with store._read():
            with pytest.raises(StoreUnavailable, match="max_size"):
                store.get_head(run_id, "", MAIN_BRANCH)
        assert head_id(store, run_id) == "c1"
    finally:
        store.delete_run(run_id)
        store.close()
    with pytest.raises(ValueError, match="max_size"):
        PostgresStore(f"{PG_URL}?max_size=0")


def test_sqlite_file_of_schema_1_is_migrated_and_keeps_its_data(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/t.db"
    old = SQLiteStore(url)
    old.setup()
    chain(old, "r", 2)
    old.commit_checkpoint(
        ckpt("r", "c03", "c02", seq=3),
        expected_head="c02",
        blobs=[BlobRecord("r", "k", b"v")],
        writes=[write("r", "c03", "t", 0, b"w")],
    )
    old.begin_effect("r", "mail", "idem", now=1.0)
    conn = old._connection()  # back to what version 1 left: tables only
    for statement in _WITHOUT_EFFECT_CLAIMS:
        conn.execute(statement)
    for name in ("remit_commit_blobs", "remit_commit"):
        conn.execute(f"DROP VIEW {name}")
    conn.execute("DELETE FROM remit_migrations WHERE version > 1")
    old.close()
    store = SQLiteStore(url)
    store.setup()
    assert store.applied_migrations() == list(range(1, SCHEMA_VERSION + 1))
    # An intent recorded before migration 7 has no claim; one recorded after keeps it.
    assert store.get_effect("r", "mail") == EffectRecord("r", "mail", "idem", "intent", None, 1.0)
    claim = store.acquire_claim("r", "main", "A", now=0.0, lease=60.0)
    entry, _ = store.begin_effect("r", "mail2", "idem2", now=2.0, fence=FenceRef.of(claim))
    assert entry.claim == FenceRef.of(claim) == store.get_effect("r", "mail2").claim  # type: ignore[union-attr]
    assert [c.checkpoint_id for c in store.list_checkpoints("r", "")] == ["c03", "c02", "c01"]
    assert store.get_blobs("r", "", ["k"]) == {"k": b"v"}
    store.commit_checkpoint(
        ckpt("r", "c04", "c03", seq=4), expected_head="c03", blobs=[BlobRecord("r", "k2", b"v2")]
    )
    assert head_id(store, "r") == "c04"
    assert store.get_blobs("r", "", ["k2"]) == {"k2": b"v2"}
    store.close()


#: Back to an effect ledger before migration 7 (no record of an intent's claim).
_WITHOUT_EFFECT_CLAIMS = tuple(
    f"ALTER TABLE remit_effects DROP COLUMN {column}"
    for column in ("claim_scope", "claim_fence", "claim_holder")
)


def _set_up_again(tmp_path: Path, *older: str) -> SQLiteStore:
    """A store file made as an older Remit left it (`older`, run on a new file),
    then set up again: every migration is applied."""
    url = f"sqlite:///{tmp_path}/t.db"
    old = SQLiteStore(url)
    old.setup()
    conn = old._connection()
    for statement in older:
        conn.execute(statement)
    old.close()
    store = SQLiteStore(url)
    store.setup()
    assert store.applied_migrations() == list(range(1, SCHEMA_VERSION + 1))
    return store


def test_sqlite_file_of_schema_3_gets_commit_views_that_check_the_holder(
    tmp_path: Path,
) -> None:
    # Stand-ins for the views of migrations 2 and 3.
    store = _set_up_again(
        tmp_path,
        "DROP TRIGGER remit_commit_release_insert",
        "DROP VIEW remit_commit_release",
        "DROP TRIGGER remit_commit_blobs_insert",
        "DROP VIEW remit_commit_blobs",
        "DROP TRIGGER remit_commit_insert",
        "DROP VIEW remit_commit",
        "CREATE VIEW remit_commit AS SELECT 1 AS fence",
        "CREATE VIEW remit_commit_blobs AS SELECT * FROM remit_commit",
        *_WITHOUT_EFFECT_CLAIMS,
        "DELETE FROM remit_migrations WHERE version >= 4",
    )
    claim = store.acquire_claim("r", "main", "A", now=0.0, lease=60.0)
    stranger = FenceRef("r", "main", claim.fence, "B")
    for blobs in ([], [BlobRecord("r", "k", b"v")]):
        with pytest.raises(Fenced):
            store.commit_checkpoint(
                ckpt("r", "c01", None), expected_head=None, blobs=blobs, fence=stranger
            )
    store.commit_checkpoint(
        ckpt("r", "c01", None),
        expected_head=None,
        blobs=[BlobRecord("r", "k", b"v")],
        fence=FenceRef.of(claim),
    )
    assert head_id(store, "r") == "c01"
    store.close()


@pytest.mark.parametrize("engine", ["sqlite", "postgresql", "redis"])
def test_a_store_set_up_by_a_newer_remit_is_refused(engine: str, tmp_path: Path) -> None:
    """Each in a namespace of its own: a file, a PostgreSQL schema, a Redis database."""
    import psycopg
    from conftest import PG_URL
    from redis import Redis

    from remit_core.stores.redis import MIGRATIONS_KEY, RedisStore

    newer = SCHEMA_VERSION + 1
    if engine == "sqlite":
        url = f"sqlite:///{tmp_path}/t.db"
        setup_store: Any = SQLiteStore(url)
    elif engine == "postgresql":
        schema = f"remit_newer_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        url = f"{PG_URL}?options=-csearch_path%3D{schema}"
        setup_store = PostgresStore(url)
    else:
        url = "redis://127.0.0.1:6379/15"
        Redis.from_url(url).delete(MIGRATIONS_KEY)
        setup_store = RedisStore(url)
    try:
        setup_store.setup()
        if engine == "redis":
            Redis.from_url(url).hset(MIGRATIONS_KEY, str(newer), "0")
        else:
            if engine == "postgresql":  # (never the shared schema's migrations)
                with setup_store._read() as txn:
                    assert txn.execute("SELECT current_schema()").fetchone()[0] == schema
            with setup_store._txn() as txn:
                txn.execute(
                    "INSERT INTO remit_migrations (version, applied_at) VALUES (?, 0)", (newer,)
                )
        setup_store.close()
        reopened = type(setup_store)(url)
        with pytest.raises(VersionMismatch, match=f"schema {newer}.*upgrade remit"):
            reopened.setup()
        reopened.close()
    finally:
        if engine == "postgresql":
            with psycopg.connect(PG_URL, autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA {schema} CASCADE")
        elif engine == "redis":
            Redis.from_url(url).delete(MIGRATIONS_KEY)


def test_sqlite_full_commits_claims_at_normal_and_returns_to_full(tmp_path: Path) -> None:
    # A claim need not survive the loss of power (its holders die with the host),
    # so it skips FULL's flush; every other write keeps FULL.
    store = SQLiteStore(f"sqlite:///{tmp_path}/t.db?synchronous=FULL")
    store.setup()
    conn = store._connection()
    level = [conn.execute("PRAGMA synchronous").fetchone()[0]]
    writes: list[tuple[str, int]] = []  # (table, synchronous level it ran at)
    last = [""]

    def track(sql: str) -> None:
        if sql.startswith("PRAGMA synchronous = "):
            level[0] = {"NORMAL": 1, "FULL": 2}[sql.split("= ")[1]]
        elif sql.startswith(("INSERT INTO", "UPDATE")):
            write = (sql.split()[2 if sql.startswith("INSERT") else 1], level[0])
            if sql != last[0]:  # (a trigger's statements are traced as the outer one)
                writes.append(write)
        last[0] = sql

    conn.set_trace_callback(track)
    claim = store.acquire_claim("r", "main", "h", now=0.0, lease=60.0)
    claim = store.renew_claim(claim, now=1.0, lease=60.0)
    chain(store, "r", 2)
    store.release_claim(claim)
    conn.set_trace_callback(None)
    assert writes == [
        ("remit_claims", 1),  # take, renew and release at NORMAL
        ("remit_claims", 1),
        ("remit_commit", 2),  # checkpoints at FULL
        ("remit_commit", 2),
        ("remit_claims", 1),
    ]
    assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2
    released = store.get_claim("r", "main")
    assert released is not None and released.holder == "" and released.fence == claim.fence
    store.close()


# -- checkpoints and branches ---------------------------------------------------


def test_commit_appends_and_moves_head(store: Store, run_id: str) -> None:
    store.commit_checkpoint(ckpt(run_id, "c01", None, seq=1), expected_head=None)
    b = store.get_branch(run_id, "", MAIN_BRANCH)
    assert b is not None and (b.head_id, b.head_seq, b.fork_token) == ("c01", 1, None)
    store.commit_checkpoint(ckpt(run_id, "c02", "c01", seq=2), expected_head="c01")
    assert head_id(store, run_id) == "c02"
    got = store.get_checkpoint(run_id, "", "c02")
    assert got == ckpt(run_id, "c02", "c01", seq=2)
    assert store.get_checkpoint(run_id, "", "nope") is None
    assert store.get_checkpoint(run_id, "other-ns", "c02") is None


def test_list_checkpoints_newest_first_with_paging(store: Store, run_id: str) -> None:
    ids = chain(store, run_id, 5)
    chain(store, run_id, 2, ns="sub")
    assert [c.checkpoint_id for c in store.list_checkpoints(run_id, "")] == ids[::-1]
    assert len(store.list_checkpoints(run_id)) == 7
    assert [c.checkpoint_id for c in store.list_checkpoints(run_id, "", limit=2)] == ids[:2:-1][:2]
    page = store.list_checkpoints(run_id, "", before_id="c04", limit=2)
    assert [c.checkpoint_id for c in page] == ["c03", "c02"]
    assert [c.ns for c in store.list_checkpoints(run_id, "sub")] == ["sub", "sub"]


def test_commit_cas_failure_writes_nothing(store: Store, run_id: str) -> None:
    chain(store, run_id, 2)
    record = ckpt(run_id, "c03", "c01", seq=2)
    blob = BlobRecord(run_id, "k", b"v")
    w = write(run_id, "c03", "t", 0, b"w")
    with pytest.raises(HeadMoved) as err:
        store.commit_checkpoint(record, expected_head="c01", blobs=[blob], writes=[w])
    assert err.value.run_id == run_id
    assert head_id(store, run_id) == "c02"
    assert store.get_checkpoint(run_id, "", "c03") is None
    assert store.get_blobs(run_id, "", ["k"]) == {}
    assert store.get_writes(run_id, "", "c03") == []
    # Blobs alone, few or many (SQLite carries up to four in the commit statement).
    for n in (1, 4, 5):
        blobs = [BlobRecord(run_id, f"b{i}", b"v") for i in range(n)]
        with pytest.raises(HeadMoved):
            store.commit_checkpoint(record, expected_head="c01", blobs=blobs)
        assert store.get_blobs(run_id, "", [b.key for b in blobs]) == {}
    assert store.get_checkpoint(run_id, "", "c03") is None
    # Creating a branch that exists is a CAS failure too.
    with pytest.raises(HeadMoved):
        store.commit_checkpoint(ckpt(run_id, "c09", None), expected_head=None)
    assert head_id(store, run_id) == "c02"


def test_commit_of_an_existing_checkpoint_id_is_refused_atomically(
    store: Store, run_id: str
) -> None:
    chain(store, run_id, 2)
    with pytest.raises(HeadMoved):
        store.commit_checkpoint(ckpt(run_id, "c01", "c02", seq=3), expected_head="c02")
    b = store.get_branch(run_id, "", MAIN_BRANCH)
    assert b is not None and (b.head_id, b.head_seq) == ("c02", 2)
    assert store.get_checkpoint(run_id, "", "c01") == ckpt(run_id, "c01", None, seq=1)


def test_commit_stores_blobs_and_writes_in_the_same_transaction(store: Store, run_id: str) -> None:
    store.commit_checkpoint(
        ckpt(run_id, "c01", None),
        expected_head=None,
        blobs=[BlobRecord(run_id, "a", b"1"), BlobRecord(run_id, "b", b"2")],
        writes=[write(run_id, "c01", "t", 0, b"w0")],
    )
    assert store.get_blobs(run_id, "", ["a", "b", "missing"]) == {"a": b"1", "b": b"2"}
    assert store.get_blobs(run_id, "", []) == {}
    assert [w.value for w in store.get_writes(run_id, "", "c01")] == [b"w0"]
    # Blobs are insert-if-absent: a second commit does not replace a stored key.
    store.commit_checkpoint(
        ckpt(run_id, "c02", "c01", seq=2),
        expected_head="c01",
        blobs=[BlobRecord(run_id, "a", b"changed"), BlobRecord(run_id, "c", b"3")],
    )
    assert store.get_blobs(run_id, "", ["a", "c"]) == {"a": b"1", "c": b"3"}


def test_commit_batches_with_repeated_keys(store: Store, run_id: str) -> None:
    """Within one commit a blob key keeps its first value and a write slot its last."""
    store.commit_checkpoint(
        ckpt(run_id, "c01", None),
        expected_head=None,
        blobs=[BlobRecord(run_id, "k", b"first"), BlobRecord(run_id, "k", b"second")],
        writes=[write(run_id, "c01", "t", 0, b"w-first"), write(run_id, "c01", "t", 0, b"w-last")],
    )
    assert store.get_blobs(run_id, "", ["k"]) == {"k": b"first"}
    assert [w.value for w in store.get_writes(run_id, "", "c01")] == [b"w-last"]


def test_list_branches_and_create_branch_by_token(store: Store, run_id: str) -> None:
    chain(store, run_id, 3)
    fork = BranchRecord(run_id, "fork-x", "c01", "", 0, "c01", "tok-x", 2000.0)
    assert store.create_branch(fork) == fork
    # The same token again, even with another base and name, yields the stored branch.
    again = BranchRecord(run_id, "fork-y", "c02", "", 0, "c02", "tok-x", 3000.0)
    assert store.create_branch(again) == fork
    assert store.get_branch(run_id, "", "fork-y") is None
    # A name taken by another token is refused.
    with pytest.raises(HeadMoved):
        store.create_branch(BranchRecord(run_id, "fork-x", "c02", "", 0, "c02", "tok-z", 1.0))
    names = sorted(b.branch for b in store.list_branches(run_id))
    assert names == ["fork-x", MAIN_BRANCH]
    assert store.list_branches(run_id, "other") == []
    # A branch's head in one read: a fresh fork's head is its base.
    head = store.get_head(run_id, "", "fork-x")
    assert head is not None and head == store.get_checkpoint(run_id, "", "c01")
    assert store.get_head(run_id, "", "absent") is None
    assert store.get_head(run_id, "other", MAIN_BRANCH) is None
    # The fork branch continues by CAS from its base.
    store.commit_checkpoint(ckpt(run_id, "f01", "c01", seq=1, branch="fork-x"), expected_head="c01")
    assert head_id(store, run_id, "fork-x") == "f01"
    assert head_id(store, run_id) == "c03"


def test_a_head_read_sees_commits_and_deletes_of_other_connections(
    store: Store, run_id: str
) -> None:
    """Heads read or committed by one store object (SQLite remembers them) follow
    what a second one, on its own connection, commits and deletes."""
    other: Store = type(store)(store.url)  # type: ignore[call-arg]
    try:
        chain(store, run_id, 2)
        assert store.get_head(run_id, "", MAIN_BRANCH).checkpoint_id == "c02"  # type: ignore[union-attr]
        assert store.get_head(run_id, "", MAIN_BRANCH).checkpoint_id == "c02"  # type: ignore[union-attr]
        other.commit_checkpoint(ckpt(run_id, "c03", "c02", seq=3), expected_head="c02")
        assert store.get_head(run_id, "", MAIN_BRANCH).checkpoint_id == "c03"  # type: ignore[union-attr]
        with pytest.raises(HeadMoved):
            store.commit_checkpoint(ckpt(run_id, "c03b", "c02", seq=3), expected_head="c02")
        store.commit_checkpoint(ckpt(run_id, "c04", "c03", seq=4), expected_head="c03")
        assert other.get_head(run_id, "", MAIN_BRANCH).checkpoint_id == "c04"  # type: ignore[union-attr]
        store.delete_run(run_id)
        assert store.get_head(run_id, "", MAIN_BRANCH) is None
        other.commit_checkpoint(ckpt(run_id, "n01", None), expected_head=None)
        assert store.get_head(run_id, "", MAIN_BRANCH).checkpoint_id == "n01"  # type: ignore[union-attr]
        other.delete_run(run_id)
        assert store.get_head(run_id, "", MAIN_BRANCH) is None
    finally:
        other.close()


# -- fences ----------------------------------------------------------------------

FENCED_PRIMITIVES = [
    "commit_checkpoint",
    "put_writes",
    "open_interrupts",
    "consume_interrupt",
    "begin_effect",
    "adopt_effect",
    "finish_effect",
]


def _fenced_call(store: Store, name: str, run_id: str, fence: FenceRef) -> None:
    if name == "commit_checkpoint":
        store.commit_checkpoint(ckpt(run_id, "c02", "c01", seq=2), expected_head="c01", fence=fence)
    elif name == "put_writes":
        store.put_writes([write(run_id, "c01", "t", 0, b"x")], mode="overwrite", fence=fence)
    elif name == "open_interrupts":
        store.open_interrupts([pending(run_id, "new")], fence=fence)
    elif name == "consume_interrupt":
        store.consume_interrupt(run_id, MAIN_BRANCH, "i1", b"v", consumer="z", now=1.0, fence=fence)
    elif name == "begin_effect":
        store.begin_effect(run_id, "e-new", "idem", now=1.0, fence=fence)
    elif name == "adopt_effect":
        store.adopt_effect(run_id, "e1", held=None, fence=fence)
    else:
        store.finish_effect(run_id, "e1", b"out", now=1.0, fence=fence)


def _observable(store: Store, run_id: str) -> tuple[Any, ...]:
    e1 = store.get_effect(run_id, "e1")
    return (
        head_id(store, run_id),
        [(w.task_id, w.idx, w.value) for w in store.get_writes(run_id, "", "c01")],
        sorted((i.interrupt_id, i.status, i.value) for i in store.list_interrupts(run_id)),
        store.get_effect(run_id, "e-new"),
        None if e1 is None else (e1.status, e1.outcome, e1.claim),
    )


def _refused(
    store: Store, primitive: str, run_id: str, fence: FenceRef, match: str | None = None
) -> Fenced:
    """`primitive` under `fence` raises `Fenced` and changes nothing observable."""
    before = _observable(store, run_id)
    with pytest.raises(Fenced, match=match) as err:
        _fenced_call(store, primitive, run_id, fence)
    assert _observable(store, run_id) == before
    return err.value


def _fenced_targets(store: Store, run_id: str) -> None:
    """What `_fenced_call` writes to: a head, an open interrupt, an effect in doubt."""
    store.commit_checkpoint(ckpt(run_id, "c01", None), expected_head=None)
    store.open_interrupts([pending(run_id, "i1")])
    store.begin_effect(run_id, "e1", "idem-1", now=1.0)


@pytest.mark.parametrize("primitive", FENCED_PRIMITIVES)
def test_stale_fence_is_refused_and_writes_nothing(
    store: Store, run_id: str, primitive: str
) -> None:
    _fenced_targets(store, run_id)
    old = store.acquire_claim(run_id, "main", "A", now=0.0, lease=10.0)
    new = store.acquire_claim(run_id, "main", "B", now=20.0, lease=10.0)
    assert new.fence == old.fence + 1
    before = _observable(store, run_id)
    assert _refused(store, primitive, run_id, FenceRef.of(old)).run_id == run_id
    # A fence for a scope never claimed is stale too.
    _refused(store, primitive, run_id, FenceRef(run_id, "never", 1, "A"))
    # The current fence passes.
    _fenced_call(store, primitive, run_id, FenceRef.of(new))
    assert _observable(store, run_id) != before


def _lose_claims(store: Store, run_id: str) -> None:
    """What a crash of the engine does to takes it had not flushed: forgets them."""
    if engine_of(store) == "redis":
        from remit_core.stores.redis import run_prefix

        store._client().delete(run_prefix(run_id) + "cl")  # type: ignore[attr-defined]
        return
    with store._txn() as txn:  # type: ignore[attr-defined]
        txn.execute("DELETE FROM remit_claims WHERE run_id = ?", (run_id,))


@pytest.mark.parametrize("primitive", FENCED_PRIMITIVES)
def test_a_fence_is_its_holders_only_and_ends_with_release(
    store: Store, run_id: str, primitive: str
) -> None:
    _fenced_targets(store, run_id)
    # A take the engine lost hands its fence number out again, to another holder.
    lost = store.acquire_claim(run_id, "main", "A", now=0.0, lease=10.0)
    _lose_claims(store, run_id)
    taken = store.acquire_claim(run_id, "main", "B", now=0.0, lease=10.0)
    assert taken.fence == lost.fence
    before = _observable(store, run_id)
    _refused(store, primitive, run_id, FenceRef.of(lost), match="now held by 'B'")
    # Released, the claim keeps its fence, and refuses writes under it.
    store.release_claim(taken)
    _refused(store, primitive, run_id, FenceRef.of(taken), match="released")
    again = store.acquire_claim(run_id, "main", "B", now=1.0, lease=10.0)
    assert again.fence == taken.fence + 1
    _fenced_call(store, primitive, run_id, FenceRef.of(again))
    assert _observable(store, run_id) != before


def test_a_commit_gives_its_claim_up_only_if_it_holds(store: Store, run_id: str) -> None:
    claim = store.acquire_claim(run_id, "main", "A", now=0.0, lease=60.0)
    fence = FenceRef.of(claim)
    store.commit_checkpoint(ckpt(run_id, "c01", None), expected_head=None, fence=fence)
    # A commit that loses its compare-and-set (or is fenced) keeps the claim held.
    with pytest.raises(HeadMoved):
        store.commit_checkpoint(
            ckpt(run_id, "c02", "c00", seq=2), expected_head="c00", fence=fence, release=claim
        )
    with pytest.raises(Fenced):
        store.commit_checkpoint(
            ckpt(run_id, "c02", "c01", seq=2),
            expected_head="c01",
            fence=FenceRef(run_id, "main", claim.fence, "B"),
            release=claim,
        )
    assert store.get_claim(run_id, "main") == claim
    store.commit_checkpoint(
        ckpt(run_id, "c02", "c01", seq=2),
        expected_head="c01",
        blobs=[BlobRecord(run_id, "k", b"v")],
        fence=fence,
        release=claim,
    )
    assert head_id(store, run_id) == "c02"
    released = store.get_claim(run_id, "main")
    assert released is not None and released.holder == "" and released.fence == claim.fence
    assert store.acquire_claim(run_id, "main", "B", now=1.0, lease=60.0).fence == claim.fence + 1


@pytest.mark.parametrize(
    "blobs, writes",
    [(0, 0), (1, 0), (4, 0), (5, 0), (1, 2)],
    ids=["bare", "one-blob", "four-blobs", "five-blobs", "with-writes"],
)
def test_a_commit_of_any_shape_gives_its_claim_up_with_it(
    store: Store, run_id: str, blobs: int, writes: int
) -> None:
    """Each shape of commit (SQLite: one statement, or a transaction past what the
    statement carries) appends, stores its blobs and writes, and releases, or none."""
    claim = store.acquire_claim(run_id, "main", "A", now=0.0, lease=60.0)
    fence = FenceRef.of(claim)
    rows = [BlobRecord(run_id, f"k{i}", b"v%d" % i) for i in range(blobs)]
    pending = [write(run_id, "c01", "t", i, b"w%d" % i) for i in range(writes)]
    store.commit_checkpoint(
        ckpt(run_id, "c01", None), expected_head=None, blobs=rows, writes=pending,
        fence=fence, release=claim,
    )  # fmt: skip
    assert head_id(store, run_id) == "c01"
    assert store.get_blobs(run_id, "", [b.key for b in rows]) == {b.key: b.value for b in rows}
    assert [w.value for w in store.get_writes(run_id, "", "c01")] == [w.value for w in pending]
    released = store.get_claim(run_id, "main")
    assert released is not None and released.holder == "" and released.fence == claim.fence


@pytest.mark.parametrize("blobs", [0, 1])
def test_a_commit_releases_only_the_claim_it_names(store: Store, run_id: str, blobs: int) -> None:
    """A release rides with the commit of another run's claim: a claim taken over
    since (another holder, a higher fence) stays with its new holder."""
    stale = store.acquire_claim(run_id, "side", "A", now=0.0, lease=1.0)
    taken = store.acquire_claim(run_id, "side", "B", now=5.0, lease=60.0)
    claim = store.acquire_claim(run_id, "main", "C", now=5.0, lease=60.0)
    store.commit_checkpoint(
        ckpt(run_id, "c01", None),
        expected_head=None,
        blobs=[BlobRecord(run_id, "k", b"v")] * blobs,
        fence=FenceRef.of(claim),
        release=stale,
    )
    assert head_id(store, run_id) == "c01"
    assert store.get_claim(run_id, "side") == taken
    assert store.get_claim(run_id, "main") == claim


def test_sqlite_file_of_schema_4_gets_the_commit_that_releases(tmp_path: Path) -> None:
    store = _set_up_again(  # as a Remit of schema 4 left it
        tmp_path,
        "DROP TRIGGER remit_commit_release_insert",
        "DROP VIEW remit_commit_release",
        "DELETE FROM remit_migrations WHERE version = 5",
    )
    claim = store.acquire_claim("r", "main", "A", now=0.0, lease=60.0)
    store.commit_checkpoint(
        ckpt("r", "c01", None), expected_head=None, fence=FenceRef.of(claim), release=claim
    )
    assert head_id(store, "r") == "c01"
    released = store.get_claim("r", "main")
    assert released is not None and released.holder == ""
    store.close()


def test_a_checkpoint_and_its_writes_read_together(store: Store, run_id: str) -> None:
    assert store.get_checkpoint_and_writes(run_id, "", "c01") == (None, [])
    store.commit_checkpoint(ckpt(run_id, "c01", None), expected_head=None)
    record, writes = store.get_checkpoint_and_writes(run_id, "", "c01")
    assert record == store.get_checkpoint(run_id, "", "c01") and writes == []
    store.put_writes(
        [
            write(run_id, "c01", "t2", 0, b"c"),
            write(run_id, "c01", "t1", 1, b"b"),
            write(run_id, "c01", "t1", 0, b"a"),
        ],
        mode="overwrite",
    )
    record, writes = store.get_checkpoint_and_writes(run_id, "", "c01")
    assert record == store.get_checkpoint(run_id, "", "c01")
    assert writes == store.get_writes(run_id, "", "c01")
    assert [(w.task_id, w.idx, w.value) for w in writes] == [
        ("t1", 0, b"a"),
        ("t1", 1, b"b"),
        ("t2", 0, b"c"),
    ]


# -- step writes ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 64, 65, 200])
def test_batches_of_any_size_round_trip(store: Store, run_id: str, n: int) -> None:
    """Small and large batches of blobs and writes (PostgreSQL binds the two differently)."""
    blobs = [BlobRecord(run_id, f"k{i}", bytes([i % 256]) * 3) for i in range(n)]
    writes = [write(run_id, "c01", f"t{i % 7}", i, f"w{i}".encode()) for i in range(n)]
    first = ckpt(run_id, "c01", None)
    store.commit_checkpoint(first, expected_head=None, blobs=blobs, writes=writes)
    assert store.get_blobs(run_id, "", [b.key for b in blobs]) == {b.key: b.value for b in blobs}
    more = [write(run_id, "c01", "u", i, f"u{i}".encode()) for i in range(n)]
    store.put_writes(more + [write(run_id, "c01", "u", 0, b"later")], mode="first")
    store.put_writes([write(run_id, "c01", "t0", 0, b"over")] * 2, mode="overwrite")
    got = {(w.task_id, w.idx): w.value for w in store.get_writes(run_id, "", "c01")}
    assert len(got) == 2 * n
    assert got["u", 0] == b"u0" and got["t0", 0] == b"over"
    assert all(got["u", i] == f"u{i}".encode() for i in range(1, n))


def test_put_writes_modes(store: Store, run_id: str) -> None:
    store.put_writes(
        [
            write(run_id, "c1", "tb", 1, b"b1"),
            write(run_id, "c1", "ta", 0, b"a0"),
            write(run_id, "c1", "tb", 0, b"b0"),
        ],
        mode="first",
    )
    got = store.get_writes(run_id, "", "c1")
    assert [(w.task_id, w.idx, w.value) for w in got] == [
        ("ta", 0, b"a0"),
        ("tb", 0, b"b0"),
        ("tb", 1, b"b1"),
    ]
    assert got[0] == write(run_id, "c1", "ta", 0, b"a0")
    # "first": a present key keeps its value.
    store.put_writes([write(run_id, "c1", "ta", 0, b"zz")], mode="first")
    assert store.get_writes(run_id, "", "c1")[0].value == b"a0"
    # "overwrite": replaced.
    store.put_writes([write(run_id, "c1", "ta", 0, b"zz")], mode="overwrite")
    assert store.get_writes(run_id, "", "c1")[0].value == b"zz"
    # "expect_absent": a taken slot refuses the whole batch.
    with pytest.raises(WriteConflict) as err:
        store.put_writes(
            [write(run_id, "c1", "tc", 0, b"c0"), write(run_id, "c1", "tb", 1, b"again")],
            mode="expect_absent",
        )
    assert err.value.checkpoint_id == "c1"
    got = store.get_writes(run_id, "", "c1")
    assert [(w.task_id, w.idx, w.value) for w in got] == [
        ("ta", 0, b"zz"),
        ("tb", 0, b"b0"),
        ("tb", 1, b"b1"),
    ]
    store.put_writes([write(run_id, "c1", "tc", 0, b"c0")], mode="expect_absent")
    assert [(w.task_id, w.idx) for w in store.get_writes(run_id, "", "c1", after_idx=0)] == [
        ("tb", 1)
    ]
    assert store.get_writes(run_id, "other", "c1") == []


def test_fenced_writes_whose_slots_are_taken_are_no_stale_fence(store: Store, run_id: str) -> None:
    # A "first" batch that writes nothing under a live fence is no error; under a
    # stale fence it is, and it still writes nothing.
    claim = store.acquire_claim(run_id, "main", "A", now=0.0, lease=10.0)
    taken = [write(run_id, "c1", "t", i, b"old") for i in range(3)]
    store.put_writes(taken, mode="first", fence=FenceRef.of(claim))
    again = [write(run_id, "c1", "t", i, b"new") for i in range(3)]
    store.put_writes(again, mode="first", fence=FenceRef.of(claim))
    assert [w.value for w in store.get_writes(run_id, "", "c1")] == [b"old"] * 3
    store.acquire_claim(run_id, "main", "B", now=20.0, lease=10.0)
    for mode in ("first", "overwrite"):
        with pytest.raises(Fenced):
            store.put_writes(
                again + [write(run_id, "c1", "t", 9, b"x")], mode=mode, fence=FenceRef.of(claim)
            )  # type: ignore[arg-type]
    assert [w.value for w in store.get_writes(run_id, "", "c1")] == [b"old"] * 3


# -- interrupts -------------------------------------------------------------------------


def test_interrupt_consumed_once_and_second_value_not_stored(store: Store, run_id: str) -> None:
    store.open_interrupts([pending(run_id, "i1", prompt=b"ok?"), pending(run_id, "i2")])
    store.open_interrupts([pending(run_id, "i1", branch="fork-a")])
    i1 = store.get_interrupt(run_id, MAIN_BRANCH, "i1")
    assert i1 is not None and (i1.status, i1.prompt, i1.value) == ("pending", b"ok?", None)
    got = store.consume_interrupt(run_id, MAIN_BRANCH, "i1", b"first", consumer="A", now=5.0)
    assert (got.status, got.value, got.consumed_by, got.consumed_at) == (
        "consumed",
        b"first",
        "A",
        5.0,
    )
    with pytest.raises(ResumeConflict) as err:
        store.consume_interrupt(run_id, MAIN_BRANCH, "i1", b"second", consumer="B", now=6.0)
    assert (err.value.run_id, err.value.interrupt_id) == (run_id, "i1")
    stored = store.get_interrupt(run_id, MAIN_BRANCH, "i1")
    assert stored is not None and (stored.value, stored.consumed_by) == (b"first", "A")
    # Re-opening never resets a consumed interrupt.
    store.open_interrupts([pending(run_id, "i1")])
    stored = store.get_interrupt(run_id, MAIN_BRANCH, "i1")
    assert stored is not None and (stored.status, stored.value) == ("consumed", b"first")
    # Each branch has its own interrupts (L3).
    other = store.get_interrupt(run_id, "fork-a", "i1")
    assert other is not None and other.status == "pending"
    with pytest.raises(UnknownRecord):
        store.consume_interrupt(run_id, MAIN_BRANCH, "nope", b"v", consumer="A", now=1.0)
    assert store.get_interrupt(run_id, MAIN_BRANCH, "nope") is None
    assert [i.interrupt_id for i in store.list_interrupts(run_id, MAIN_BRANCH)] == ["i1", "i2"]
    assert len(store.list_interrupts(run_id)) == 3


def test_interrupts_selected_by_checkpoint_and_status(remit: Remit, run_id: str) -> None:
    """A resume reads the interrupts of one checkpoint, or the open ones: the store
    selects them, whatever else the run raised in earlier rounds."""
    for n in range(6):
        remit.open_interrupts(run_id, {f"r{n}": b"ok?"}, checkpoint_id=f"c{n % 3}")
    remit.open_interrupts(run_id, {"r9": b"ok?"}, branch="fork-a", checkpoint_id="c0")
    remit.consume(run_id, "r0", b"yes")
    remit.consume(run_id, "r4", b"no")

    def ids(**selected: Any) -> list[str]:
        return [i.interrupt_id for i in remit.interrupts(run_id, **selected)]

    assert ids(checkpoint_id="c0") == ["r0", "r3", "r9"]
    assert ids(branch=MAIN_BRANCH, checkpoint_id="c0") == ["r0", "r3"]
    assert ids(status="consumed") == ["r0", "r4"]
    assert ids(branch=MAIN_BRANCH, status="pending") == ["r1", "r2", "r3", "r5"]
    assert ids(branch=MAIN_BRANCH, checkpoint_id="c1", status="pending") == ["r1"]
    assert ids(checkpoint_id="c7") == []
    (answered,) = remit.interrupts(run_id, checkpoint_id="c1", status="consumed")
    assert (answered.interrupt_id, answered.value, answered.prompt) == ("r4", b"no", b"ok?")
    with pytest.raises(ValueError, match="status must be 'pending' or 'consumed'"):
        remit.interrupts(run_id, status="open")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="checkpoint_id"):
        remit.interrupts(run_id, checkpoint_id="")


# -- claims -------------------------------------------------------------------------------


def test_claim_at_head_returns_the_head_the_claim_starts_from(store: Store, run_id: str) -> None:
    claim, head, writes = store.acquire_claim_at_head(
        run_id, MAIN_BRANCH, "A", now=100.0, lease=10.0
    )
    assert (claim.holder, claim.fence, head, writes) == ("A", 1, None, [])
    chain(store, run_id, 2)
    store.commit_checkpoint(ckpt(run_id, "s1", None, ns="sub"), expected_head=None)
    again, head, writes = store.acquire_claim_at_head(
        run_id, MAIN_BRANCH, "A", now=101.0, lease=10.0
    )
    assert again.fence == 1 and head == store.get_head(run_id, "", MAIN_BRANCH)
    assert head is not None and head.checkpoint_id == "c02" and writes == []
    # The head's writes come with it, ordered as `get_writes`; not its parent's.
    store.put_writes(
        [
            write(run_id, "c02", "t2", 0, b"c"),
            write(run_id, "c02", "t1", 1, b"b"),
            write(run_id, "c02", "t1", 0, b"a"),
            write(run_id, "c01", "t0", 0, b"z"),
        ],
        mode="overwrite",
    )
    _, head, writes = store.acquire_claim_at_head(run_id, MAIN_BRANCH, "A", now=101.5, lease=10.0)
    assert head is not None and writes == store.get_writes(run_id, "", "c02")
    assert [(w.task_id, w.idx, w.value) for w in writes] == [
        ("t1", 0, b"a"),
        ("t1", 1, b"b"),
        ("t2", 0, b"c"),
    ]
    _, sub, writes = store.acquire_claim_at_head(
        run_id, MAIN_BRANCH, "A", now=102.0, lease=10.0, ns="sub"
    )
    assert sub is not None and sub.checkpoint_id == "s1" and writes == []
    with pytest.raises(ResumeConflict):
        store.acquire_claim_at_head(run_id, MAIN_BRANCH, "B", now=103.0, lease=10.0)
    assert store.get_claim(run_id, MAIN_BRANCH).holder == "A"  # type: ignore[union-attr]
    taken, head, _ = store.acquire_claim_at_head(run_id, MAIN_BRANCH, "B", now=200.0, lease=10.0)
    assert (taken.holder, taken.fence) == ("B", 2) and head is not None


def test_claim_lease_takeover_renew_release(store: Store, run_id: str) -> None:
    assert store.get_claim(run_id, "main") is None
    a = store.acquire_claim(run_id, "main", "A", now=100.0, lease=10.0)
    assert (a.holder, a.fence, a.expires_at) == ("A", 1, 110.0)
    with pytest.raises(ResumeConflict) as refused:
        store.acquire_claim(run_id, "main", "B", now=105.0, lease=10.0)
    # The refusal does not promise the lease will run out: a live holder renews it.
    assert "run in progress" in str(refused.value) and "when that run ends" in str(refused.value)
    # Re-entrant: the live holder keeps its fence and extends its lease.
    a2 = store.acquire_claim(run_id, "main", "A", now=106.0, lease=10.0)
    assert (a2.fence, a2.expires_at) == (1, 116.0)
    a3 = store.renew_claim(a2, now=108.0, lease=10.0)
    assert (a3.fence, a3.expires_at) == (1, 118.0)
    with pytest.raises(ResumeConflict):
        store.acquire_claim(run_id, "main", "B", now=117.0, lease=10.0)
    # Lease expiry: takeover with the next fence; the old holder is fenced off.
    b = store.acquire_claim(run_id, "main", "B", now=118.0, lease=10.0)
    assert (b.holder, b.fence) == ("B", 2)
    with pytest.raises(Fenced):
        store.renew_claim(a3, now=119.0, lease=10.0)
    store.release_claim(a3)  # a no-op: A no longer holds it
    assert store.get_claim(run_id, "main") == b
    # Release keeps the fence, so the next holder still gets a larger one.
    store.release_claim(b)
    released = store.get_claim(run_id, "main")
    assert released is not None and (released.holder, released.fence) == ("", 2)
    with pytest.raises(Fenced):
        store.renew_claim(b, now=120.0, lease=10.0)
    c = store.acquire_claim(run_id, "main", "A", now=120.0, lease=10.0)
    assert c.fence == 3
    # Scopes are independent.
    assert store.acquire_claim(run_id, "fork-1", "B", now=120.0, lease=10.0).fence == 1


def test_claim_same_holder_after_expiry_gets_a_new_fence(store: Store, run_id: str) -> None:
    a = store.acquire_claim(run_id, "main", "A", now=0.0, lease=1.0)
    again = store.acquire_claim(run_id, "main", "A", now=5.0, lease=1.0)
    assert again.fence == a.fence + 1


# -- effects ---------------------------------------------------------------------------------


def test_effect_ledger_intent_then_outcome_once(store: Store, run_id: str) -> None:
    assert store.get_effect(run_id, "charge#0") is None
    entry, created = store.begin_effect(run_id, "charge#0", "idem-1", now=10.0)
    assert created and (entry.status, entry.idempotency_key, entry.outcome) == (
        "intent",
        "idem-1",
        None,
    )
    again, created = store.begin_effect(run_id, "charge#0", "idem-other", now=11.0)
    assert not created and again == entry
    done = store.finish_effect(run_id, "charge#0", b"receipt-1", now=12.0)
    assert (done.status, done.outcome, done.done_at) == ("done", b"receipt-1", 12.0)
    # An entry already done is returned unchanged.
    assert store.finish_effect(run_id, "charge#0", b"receipt-2", now=13.0) == done
    assert store.get_effect(run_id, "charge#0") == done
    with pytest.raises(UnknownRecord) as err:
        store.finish_effect(run_id, "never-begun", b"x", now=1.0)
    assert err.value.effect_key == "never-begun"
    assert store.get_effect(run_id, "never-begun") is None


# -- whole runs ---------------------------------------------------------------------------------


def _populate(store: Store, run_id: str) -> None:
    store.commit_checkpoint(
        ckpt(run_id, "c01", None),
        expected_head=None,
        blobs=[BlobRecord(run_id, "k", b"v")],
        writes=[write(run_id, "c01", "t", 0, b"w")],
    )
    store.commit_checkpoint(ckpt(run_id, "c02", "c01", seq=2), expected_head="c01")
    store.create_branch(BranchRecord(run_id, "fork-a", "c01", "", 0, "c01", "tok", 1.0))
    store.open_interrupts([pending(run_id, "i1")])
    store.acquire_claim(run_id, "main", "A", now=0.0, lease=1.0)
    store.begin_effect(run_id, "e1", "idem", now=1.0)


def test_delete_run_removes_every_record_of_that_run_only(store: Store, run_id: str) -> None:
    other = f"{run_id}-other"
    _populate(store, run_id)
    _populate(store, other)
    store.delete_run(run_id)
    assert store.list_checkpoints(run_id) == []
    assert store.list_branches(run_id) == []
    assert store.get_blobs(run_id, "", ["k"]) == {}
    assert store.get_writes(run_id, "", "c01") == []
    assert store.list_interrupts(run_id) == []
    assert store.get_claim(run_id, "main") is None
    assert store.get_effect(run_id, "e1") is None
    assert len(store.list_checkpoints(other)) == 2
    assert store.get_effect(other, "e1") is not None
    # The run id is reusable from scratch.
    store.commit_checkpoint(ckpt(run_id, "c01", None), expected_head=None)
    assert head_id(store, run_id) == "c01"


def test_delete_checkpoints_refuses_heads_and_fork_bases(store: Store, run_id: str) -> None:
    ids = chain(store, run_id, 4)
    store.put_writes([write(run_id, "c02", "t", 0, b"w")], mode="first")
    store.create_branch(BranchRecord(run_id, "fork-a", "c01", "", 0, "c01", "tok", 1.0))
    deleted = store.delete_checkpoints(run_id, "", [*ids, "absent"])
    assert deleted == 2
    assert sorted(c.checkpoint_id for c in store.list_checkpoints(run_id)) == ["c01", "c04"]
    assert store.get_writes(run_id, "", "c02") == []
    assert head_id(store, run_id) == "c04"


def test_deleting_a_head_that_is_a_fork_base_changes_nothing(remit: Remit, run_id: str) -> None:
    remit.commit(run_id=run_id, checkpoint_id="d1", parent_id=None, state=b"1")
    remit.commit(run_id=run_id, checkpoint_id="d2", parent_id="d1", state=b"2")
    remit.fork(run_id, "d2", "tok")
    before = sorted((b.branch, b.head_id, b.base_id) for b in remit.branches(run_id))
    assert remit.delete_checkpoints(run_id, "", ["d2"]) == 0
    assert sorted((b.branch, b.head_id, b.base_id) for b in remit.branches(run_id)) == before
    remit.commit(run_id=run_id, checkpoint_id="d3", parent_id="d2", state=b"3")  # still a head
    with pytest.raises(TypeError):
        remit.delete_checkpoints(run_id, "", "d3")
    with pytest.raises(TypeError):
        remit.prune(run_id)


@pytest.mark.parametrize(
    ("bad", "error"),
    [(None, TypeError), (123, TypeError), ("", ValueError), ("a\x00b", ValueError)],
)
def test_a_bad_id_is_refused_alike_on_every_engine_and_nothing_is_written(
    remit: Remit, run_id: str, bad: Any, error: type[Exception]
) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: remit.commit(run_id=bad, checkpoint_id="c1", parent_id=None, state=b"s"),
        lambda: remit.commit(run_id=run_id, checkpoint_id=bad, parent_id=None, state=b"s"),
        lambda: remit.claim(bad),
        lambda: remit.claim_at_head(bad),
        lambda: remit.head(bad),
        lambda: remit.consume(run_id, bad, b"v"),
    ]
    for call in calls:
        with pytest.raises(error):
            call()
    assert remit.history(run_id) == [] and remit.store.get_claim(run_id, MAIN_BRANCH) is None
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    if bad is not None:  # (None is no token at all)
        with pytest.raises(error):
            remit.commit(
                run_id=run_id, checkpoint_id="c2", parent_id="c0", state=b"s", fork_token=bad
            )
        with pytest.raises(error):
            remit.fork(run_id, "c1", bad)
    assert [c.checkpoint_id for c in remit.history(run_id)] == ["c1"]
    assert [b.branch for b in remit.branches(run_id)] == [MAIN_BRANCH]
    with pytest.raises(ValueError):
        remit.history(run_id, limit=-1)


def test_copy_run(store: Store, run_id: str) -> None:
    target = f"{run_id}-copy"
    _populate(store, run_id)
    store.copy_run(run_id, target)
    src = store.list_checkpoints(run_id)
    dst = store.list_checkpoints(target)
    assert [c.checkpoint_id for c in dst] == [c.checkpoint_id for c in src]
    assert all(d.run_id == target for d in dst)
    assert [(d.state, d.parent_id, d.metadata) for d in dst] == [
        (s.state, s.parent_id, s.metadata) for s in src
    ]
    assert sorted(
        (b.branch, b.head_id, b.base_id, b.fork_token) for b in store.list_branches(target)
    ) == sorted((b.branch, b.head_id, b.base_id, b.fork_token) for b in store.list_branches(run_id))
    assert store.get_blobs(target, "", ["k"]) == {"k": b"v"}
    assert [w.value for w in store.get_writes(target, "", "c01")] == [b"w"]
    # A pending interrupt stays answerable in the copy; the ledger comes along; the
    # claim does not (the copy is free).
    assert [(i.interrupt_id, i.status) for i in store.list_interrupts(target)] == [
        ("i1", "pending")
    ]
    copied = store.get_effect(target, "e1")
    assert copied is not None and (copied.idempotency_key, copied.status) == ("idem", "intent")
    assert store.get_claim(target, "main") is None
    store.consume_interrupt(target, MAIN_BRANCH, "i1", b"v", consumer="x", now=2.0)
    assert store.list_interrupts(run_id)[0].status == "pending"  # the source's is its own
    # The copy continues independently of its source.
    store.commit_checkpoint(ckpt(target, "c03", "c02", seq=3), expected_head="c02")
    assert head_id(store, target) == "c03" and head_id(store, run_id) == "c02"


def test_a_fork_from_a_deleted_checkpoint_is_refused_and_makes_no_branch(
    store: Store, run_id: str
) -> None:
    chain(store, run_id, 3)
    assert store.delete_checkpoints(run_id, "", ["c01"]) == 1
    gone = BranchRecord(run_id, "f1", "c01", "", 0, "c01", "tok", 5.0)
    with pytest.raises(UnknownRecord, match="fork base does not exist") as err:
        store.create_branch(gone)
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c01")
    assert [b.branch for b in store.list_branches(run_id)] == [MAIN_BRANCH]
    # A token that already has its branch still answers with it.
    kept = BranchRecord(run_id, "f2", "c02", "", 0, "c02", "tok2", 5.0)
    assert store.create_branch(kept).base_id == "c02"
    assert store.delete_checkpoints(run_id, "", ["c02"]) == 0  # a fork base is kept
    assert store.create_branch(kept).base_id == "c02"


def test_postgres_prune_and_fork_of_one_checkpoint_never_leave_a_fork_without_base(
    run_id: str,
) -> None:
    """A delete of old checkpoints (`prune`) that has read which ones branches pin,
    and a fork made from one of them at that moment: the fork waits for the delete
    and is refused, so no branch is left whose base is gone. SQLite deletes in one
    exclusive write transaction and Redis in one script, so only PostgreSQL can
    interleave them."""
    import os
    import signal

    from conftest import PG_URL
    from store_cuts import wait_blocked_by

    store = PostgresStore(PG_URL)
    chain(store, run_id, 3)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the pruner: stops after reading the pinned checkpoints
        try:
            pruner = PostgresStore(PG_URL)
            with pruner._read() as txn:  # the connection the delete reuses
                backend = txn.execute("SELECT pg_backend_pid()").fetchone()[0]
            os.write(write_end, str(backend).encode())
            failpoints.arm("delete.in_delete", "stop")
            pruner.delete_checkpoints(run_id, "", ["c01"])
        finally:
            os._exit(0)
    os.close(write_end)
    pruner_backend = int(os.read(read_end, 64))
    os.close(read_end)
    forked: list[Any] = []
    try:
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        fork = threading.Thread(
            target=lambda: forked.append(
                outcome_of(
                    lambda: store.create_branch(
                        BranchRecord(run_id, "f1", "c01", "", 0, "c01", "tok", 5.0)
                    )
                )
            )
        )
        fork.start()
        # The fork has run its statements, or waits for the stopped pruner's lock.
        wait_blocked_by(pruner_backend, fork)
    finally:
        os.kill(pid, signal.SIGCONT)
        _, status = os.waitpid(pid, 0)
    fork.join()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    bases = {b.base_id for b in store.list_branches(run_id) if b.base_id is not None}
    kept = {c.checkpoint_id for c in store.list_checkpoints(run_id)}
    assert bases <= kept, (bases, kept, forked)
    assert forked == ["UnknownRecord"]


def outcome_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def test_postgres_copy_run_reads_one_snapshot_while_commits_go_on(run_id: str) -> None:
    """A copy taken while its source runs is the source at one instant: a commit
    landing between the copy's tables (here: after its checkpoints, before its
    branches) is in the copy whole or not at all. SQLite copies in one exclusive
    write transaction and Redis in one script, so only PostgreSQL can interleave."""
    import os
    import signal

    from conftest import PG_URL

    store = PostgresStore(PG_URL)
    target = f"{run_id}-copy"
    chain(store, run_id, 2)
    pid = os.fork()
    if pid == 0:  # the copier: stops inside its transaction, after the first table
        try:
            failpoints.arm("copy.in_copy", "stop")
            PostgresStore(PG_URL).copy_run(run_id, target)
        finally:
            os._exit(0)
    try:
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        store.commit_checkpoint(ckpt(run_id, "c03", "c02", seq=3), expected_head="c02")
    finally:
        os.kill(pid, signal.SIGCONT)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    copied = [c.checkpoint_id for c in store.list_checkpoints(target)]
    assert copied == ["c02", "c01"]
    assert head_id(store, target) == "c02"
    assert head_id(store, run_id) == "c03"


# -- the facade: commits, forks, validity --------------------------------------------------


def test_facade_commit_head_history_round_trip(remit: Remit, run_id: str) -> None:
    c1 = remit.commit(
        run_id=run_id,
        checkpoint_id="c01",
        parent_id=None,
        state=b"one",
        metadata={"step": 1},
        workflow_version="wf-1",
        schema_version=2,
        blobs={"ch.v1": b"blob-1"},
        writes=[write(run_id, "c01", "t", 0, b"w")],
    )
    assert (c1.state, c1.branch, c1.seq) == (b"one", MAIN_BRANCH, 1)
    remit.commit(run_id=run_id, checkpoint_id="c02", parent_id="c01", state=b"two")
    head = remit.head(run_id)
    assert head is not None and (head.checkpoint_id, head.state, head.seq) == ("c02", b"two", 2)
    got = remit.checkpoint(run_id, "c01")
    assert got is not None
    assert (got.state, got.metadata, got.workflow_version, got.schema_version) == (
        b"one",
        {"step": 1},
        "wf-1",
        2,
    )
    # Stored bytes are sealed; the facade hands back the caller's bytes.
    raw = remit.store.get_checkpoint(run_id, "", "c01")
    assert raw is not None and raw.state != b"one"
    assert [c.state for c in remit.history(run_id)] == [b"two", b"one"]
    assert remit.blobs(run_id, ["ch.v1", "absent"]) == {"ch.v1": b"blob-1"}
    assert [w.value for w in remit.writes(run_id, "c01")] == [b"w"]
    assert remit.head(run_id, branch="absent") is None
    b = remit.branch(run_id)
    assert b is not None and b.head_id == "c02"


def test_facade_commit_lost_race_is_head_moved(remit: Remit, run_id: str) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"1")
    stale = remit.plan(run_id, "c01")
    remit.commit(run_id=run_id, checkpoint_id="c02", parent_id="c01", state=b"2")
    with pytest.raises(HeadMoved):
        remit.commit(run_id=run_id, checkpoint_id="c02b", parent_id="c01", state=b"x", plan=stale)
    head = remit.head(run_id)
    assert head is not None and head.checkpoint_id == "c02"
    assert remit.checkpoint(run_id, "c02b") is None


def test_fork_without_token_is_refused(remit: Remit, run_id: str) -> None:
    for i, parent in enumerate([None, "c01", "c02"], start=1):
        remit.commit(run_id=run_id, checkpoint_id=f"c{i:02d}", parent_id=parent, state=b"s")
    with pytest.raises(ForkWithoutIntent) as err:
        remit.commit(run_id=run_id, checkpoint_id="x", parent_id="c01", state=b"s")
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c01")
    # A second root without a token is a fork too.
    with pytest.raises(ForkWithoutIntent):
        remit.commit(run_id=run_id, checkpoint_id="y", parent_id=None, state=b"s")
    assert [b.branch for b in remit.branches(run_id)] == [MAIN_BRANCH]
    assert remit.checkpoint(run_id, "x") is None and remit.checkpoint(run_id, "y") is None
    head = remit.head(run_id)
    assert head is not None and head.checkpoint_id == "c03"


def test_fork_with_token_makes_one_branch(remit: Remit, run_id: str) -> None:
    for i, parent in enumerate([None, "c01", "c02"], start=1):
        remit.commit(run_id=run_id, checkpoint_id=f"c{i:02d}", parent_id=parent, state=b"s")
    f1 = remit.commit(
        run_id=run_id, checkpoint_id="f01", parent_id="c01", state=b"f", fork_token="edit-1"
    )
    fork = remit.fork_branch(run_id, "edit-1")
    assert fork is not None and f1.branch == fork.branch != MAIN_BRANCH
    assert (fork.head_id, fork.base_id) == ("f01", "c01")
    main = remit.head(run_id)
    assert main is not None and main.checkpoint_id == "c03"
    # The fork continues by plain CAS from its head; the same token keeps its branch.
    f2 = remit.commit(run_id=run_id, checkpoint_id="f02", parent_id="f01", state=b"f")
    assert f2.branch == fork.branch
    f3 = remit.commit(
        run_id=run_id, checkpoint_id="f03", parent_id="f02", state=b"f", fork_token="edit-1"
    )
    assert f3.branch == fork.branch
    # Forking again from the same base with the same token is not a second branch.
    with pytest.raises(HeadMoved):
        remit.commit(
            run_id=run_id, checkpoint_id="f01b", parent_id="c01", state=b"f", fork_token="edit-1"
        )
    assert len(remit.branches(run_id)) == 2
    assert remit.fork(run_id, "c01", "edit-1") == remit.fork_branch(run_id, "edit-1")


def test_fork_api_same_token_same_branch(remit: Remit, run_id: str) -> None:
    for i, parent in enumerate([None, "c01", "c02"], start=1):
        remit.commit(run_id=run_id, checkpoint_id=f"c{i:02d}", parent_id=parent, state=b"s")
    first = remit.fork(run_id, "c02", "tok")
    other_process = Remit(remit.store.url)
    assert other_process.fork(run_id, "c02", "tok") == first
    assert first.branch == policy.fork_branch_name("tok")
    assert (first.head_id, first.base_id, first.fork_token) == ("c02", "c02", "tok")
    with pytest.raises(ForkWithoutIntent):
        remit.fork(run_id, "c01", "tok")
    with pytest.raises(UnknownRecord):
        remit.fork(run_id, "absent", "tok-2")
    assert len(remit.branches(run_id)) == 2
    # The fork branch's head is its base: committing after it stays on the fork.
    after = remit.commit(
        run_id=run_id, checkpoint_id="f01", parent_id="c02", state=b"f", fork_token="tok"
    )
    assert after.branch == first.branch
    main = remit.head(run_id)
    assert main is not None and main.checkpoint_id == "c03"


def test_fork_race_from_threads_yields_one_branch(store_url: str, run_id: str) -> None:
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"s")
    remit.commit(run_id=run_id, checkpoint_id="c02", parent_id="c01", state=b"s")
    barrier = threading.Barrier(6)
    results: list[Any] = []

    def go() -> None:
        barrier.wait()
        try:
            results.append(remit.fork(run_id, "c01", "race"))
        except Exception as exc:  # collected for the assertion below
            results.append(exc)

    threads = [threading.Thread(target=go) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(isinstance(r, BranchRecord) for r in results), results
    assert len({(r.branch, r.base_id) for r in results}) == 1
    assert len(remit.branches(run_id)) == 2


class OrderState(TypedDict):
    order_id: str
    amount: int
    log: list[str]


def test_invalid_write_is_refused_before_commit(remit: Remit, run_id: str) -> None:
    schema = StateSchema(OrderState)

    def commit_state(cid: str, parent: str | None, state: Any) -> None:
        valid = schema.validate(state, run_id=run_id, checkpoint_id=cid)
        remit.commit(run_id=run_id, checkpoint_id=cid, parent_id=parent, state=codec.dumps(valid))

    commit_state("c01", None, {"order_id": "o1", "amount": 5, "log": []})
    with pytest.raises(CheckpointInvalid) as err:
        commit_state("c02", "c01", {"order_id": "o1", "amount": "lots", "log": []})
    assert err.value.field == "amount"
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c02")
    with pytest.raises(CheckpointInvalid) as err:
        commit_state("c02", "c01", {"order_id": "o1", "amount": 1, "log": ["a", 3]})
    assert err.value.field == "log[1]"
    head = remit.head(run_id)
    assert head is not None and head.checkpoint_id == "c01"
    assert codec.loads(head.state)["amount"] == 5
    assert remit.checkpoint(run_id, "c02") is None


# -- records that cannot lie ---------------------------------------------------------------------


def test_records_handed_out_do_not_share_metadata(remit: Remit, run_id: str) -> None:
    """A head is remembered between reads (SQLite); what a caller does to the record
    it got never shows in the next read."""
    committed = remit.commit(
        run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"s", metadata={"step": 1}
    )
    committed.metadata["step"] = 99
    first = remit.head(run_id)
    assert first is not None and first.metadata == {"step": 1}
    first.metadata["step"] = 98
    again = remit.head(run_id)
    assert again is not None and again.metadata == {"step": 1} and again.state == b"s"


def test_corrupt_checkpoint_bytes_name_run_and_checkpoint(remit: Remit, run_id: str) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b'{"a": 1}')
    remit.commit(run_id=run_id, checkpoint_id="c02", parent_id="c01", state=b'{"a": 2}')
    rewrite_state(remit.store, run_id, "c02", flip_last_byte)
    for read in (
        lambda: remit.head(run_id),
        lambda: remit.checkpoint(run_id, "c02"),
        lambda: remit.history(run_id),
    ):
        with pytest.raises(CorruptRecord) as err:
            read()
        assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c02")
        assert "c02" in str(err.value) and run_id in str(err.value)
    # A claim that starts from a corrupt head is not kept.
    with pytest.raises(CorruptRecord):
        remit.claim_at_head(run_id)
    assert remit.claim(run_id).claim.fence == 2
    # Other checkpoints still read; unverified listing still lists.
    c1 = remit.checkpoint(run_id, "c01")
    assert c1 is not None and c1.state == b'{"a": 1}'
    assert len(remit.history(run_id, verify=False)) == 2


def test_payload_moved_to_another_checkpoint_is_corrupt(remit: Remit, run_id: str) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"one")
    remit.commit(run_id=run_id, checkpoint_id="c02", parent_id="c01", state=b"two")
    raw_c1 = remit.store.get_checkpoint(run_id, "", "c01")
    assert raw_c1 is not None
    rewrite_state(remit.store, run_id, "c02", lambda _: raw_c1.state)
    with pytest.raises(CorruptRecord) as err:
        remit.head(run_id)
    assert err.value.checkpoint_id == "c02"
    rewrite_state(remit.store, run_id, "c02", lambda _: b"not a frame")
    with pytest.raises(CorruptRecord):
        remit.head(run_id)


def test_metadata_that_does_not_decode_is_corrupt_naming_the_checkpoint(
    remit: Remit, run_id: str
) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"1", metadata={"a": 1})
    store: Any = remit.store
    if engine_of(store) == "redis":
        from remit_core.stores.redis import run_prefix

        key, field = run_prefix(run_id) + "ck", "c01\x00"
        _, _, state = store._client().hget(key, field).partition(b"\n")
        store._client().hset(key, field, b"{not json\n" + state)
    else:
        with store._txn() as txn:
            txn.execute(
                "UPDATE remit_checkpoints SET metadata = ? WHERE run_id = ? AND checkpoint_id = ?",
                ("not json", run_id, "c01"),
            )
    with pytest.raises(CorruptRecord) as err:
        remit.head(run_id)
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c01")


def test_unknown_record_format_is_version_mismatch(remit: Remit, run_id: str) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"one")
    rewrite_state(
        remit.store, run_id, "c01", lambda b: b[:3] + bytes([codec.RECORD_FORMAT + 1]) + b[4:]
    )
    with pytest.raises(VersionMismatch) as err:
        remit.head(run_id)
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c01")


def test_workflow_version_refusal(remit: Remit, run_id: str) -> None:
    remit.commit(
        run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"s", workflow_version="wf-1"
    )
    head = remit.head(run_id)
    assert head is not None
    policy.check_workflow_version(head, None)
    policy.check_workflow_version(head, ["wf-1", "wf-2"])
    with pytest.raises(VersionMismatch) as err:
        policy.check_workflow_version(head, ["wf-2"])
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c01")
    assert "wf-1" in str(err.value)


def test_schema_migration_on_read(remit: Remit, run_id: str) -> None:
    remit.commit(
        run_id=run_id,
        checkpoint_id="c01",
        parent_id=None,
        state=codec.dumps({"order_id": "o1", "cents": 500}),
        schema_version=1,
    )
    migrations = Migrations()

    @migrations.register(1)
    def cents_to_amount(old: dict[str, Any]) -> dict[str, Any]:
        return {"order_id": old["order_id"], "amount": old["cents"] // 100, "log": []}

    head = remit.head(run_id)
    assert head is not None and head.schema_version == 1
    reader = StateSchema(OrderState, version=2, migrations=migrations)
    state = reader.validate(reader.upgrade(codec.loads(head.state), head.schema_version))
    assert state == {"order_id": "o1", "amount": 5, "log": []}
    # Without a registered migration, or from a newer writer: refused, naming the record.
    for schema, version in (
        (StateSchema(OrderState, version=3, migrations=migrations), 1),
        (StateSchema(OrderState, version=1), 2),
    ):
        with pytest.raises(VersionMismatch) as err:
            schema.upgrade(codec.loads(head.state), version, run_id=run_id, checkpoint_id="c01")
        assert err.value.checkpoint_id == "c01"


# -- the facade: interrupts, claims, retention ------------------------------------------------


def test_facade_consume_once_with_sealed_values(remit: Remit, run_id: str) -> None:
    remit.open_interrupts(
        run_id, {"approve": b"approve order?", "other": None}, checkpoint_id="c01"
    )
    got = remit.consume(run_id, "approve", b"alice")
    assert (got.status, got.value, got.prompt) == ("consumed", b"alice", b"approve order?")
    assert got.consumed_by is not None and got.consumed_by.startswith(remit.holder + "/")
    with pytest.raises(ResumeConflict):
        Remit(remit.store).consume(run_id, "approve", b"mallory")
    stored = remit.interrupt(run_id, "approve")
    assert stored is not None and stored.value == b"alice"
    assert [(i.interrupt_id, i.status) for i in remit.interrupts(run_id)] == [
        ("approve", "consumed"),
        ("other", "pending"),
    ]
    raw = remit.store.get_interrupt(run_id, MAIN_BRANCH, "approve")
    assert raw is not None and raw.value != b"alice"


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def test_facade_claim_takeover_fences_the_old_holder(store: Store, run_id: str) -> None:
    clock = Clock()
    a_side, b_side = Remit(store, clock=clock, lease=5.0), Remit(store, clock=clock, lease=5.0)
    remit_a = a_side.claim(run_id, heartbeat=False)
    with pytest.raises(ResumeConflict):
        b_side.claim(run_id, heartbeat=False)
    a_side.commit(
        run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"a", fence=remit_a.fence
    )
    clock.now += 6.0
    remit_b = b_side.claim(run_id, heartbeat=False)
    assert remit_b.fence.fence == remit_a.fence.fence + 1
    with pytest.raises(Fenced):
        a_side.commit(
            run_id=run_id,
            checkpoint_id="c02",
            parent_id="c01",
            state=b"zombie",
            fence=remit_a.fence,
        )
    with pytest.raises(Fenced):
        a_side.consume(run_id, "i", b"v", fence=remit_a.fence)
    b_side.commit(
        run_id=run_id, checkpoint_id="c02", parent_id="c01", state=b"b", fence=remit_b.fence
    )
    head = a_side.head(run_id)
    assert head is not None and head.state == b"b"
    remit_a.release()  # the zombie's release leaves B's claim alone
    current = store.get_claim(run_id, MAIN_BRANCH)
    assert current is not None and current.fence == remit_b.fence.fence and current.holder
    remit_b.release()
    released = store.get_claim(run_id, MAIN_BRANCH)
    assert released is not None and (released.holder, released.fence) == ("", 2)


def test_facade_claim_heartbeat_keeps_the_lease(store: Store, run_id: str) -> None:
    owner, rival = Remit(store, lease=0.6), Remit(store, lease=0.6)
    with owner.claim(run_id) as handle:
        first_expiry = handle.claim.expires_at
        time.sleep(1.0)  # longer than the lease: only renewals keep it
        with pytest.raises(ResumeConflict):
            rival.claim(run_id, heartbeat=False)
        assert handle.claim.expires_at > first_expiry and not handle.lost
    rival.claim(run_id, heartbeat=False).release()


def test_facade_heartbeat_notices_a_takeover(store: Store, run_id: str) -> None:
    owner = Remit(store, lease=0.3)
    handle = owner.claim(run_id)
    # A rival whose clock is past the lease takes the run over.
    rival = store.acquire_claim(run_id, MAIN_BRANCH, "rival", now=time.time() + 60, lease=600)
    assert rival.fence == handle.fence.fence + 1
    deadline = time.monotonic() + 5.0
    while not handle.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    assert handle.lost
    handle.release()  # leaves the rival's claim alone
    assert store.get_claim(run_id, MAIN_BRANCH) == rival


@pytest.mark.parametrize(
    "lease",
    # A lease shorter than a store's round trip lapses while its holder runs; an int too
    # large for a float is refused as an infinite one (not with an `OverflowError`).
    [0, -1, float("nan"), float("inf"), 1e-9, 0.05, pytest.param(10**400, id="10**400")],
)
def test_a_lease_that_would_end_mutual_exclusion_is_refused(
    store: Store, run_id: str, lease: float
) -> None:
    with pytest.raises(ValueError, match="lease"):
        Remit(store, lease=lease)
    remit = Remit(store)
    with pytest.raises(ValueError, match="lease"):
        remit.claim(run_id, lease=lease)
    with pytest.raises(ValueError, match="lease"):
        remit.claim_at_head(run_id, lease=lease)
    assert store.get_claim(run_id, MAIN_BRANCH) is None  # nothing was taken


def test_lease_keeper_renews_claims_due_together_in_one_wake_up() -> None:
    keeper = _LeaseKeeper()
    added: list[float] = []
    renewed: list[float] = []

    class Beat:
        lease = 0.6  # a heartbeat every 0.2 s, at most 0.05 s early

        def _renew(self) -> bool:
            renewed.append(time.monotonic())
            return False  # one heartbeat each

    for _ in range(20):
        added.append(time.monotonic())
        keeper.add(Beat())  # type: ignore[arg-type]
        time.sleep(0.001)
    deadline = time.monotonic() + 5.0
    while len(renewed) < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(renewed) == 20
    # Never earlier than a quarter period before due; one wake-up per claim would be 20.
    assert all(r >= a + 0.2 - 0.05 - 1e-3 for a, r in zip(added, renewed, strict=True))
    assert keeper.wakeups <= 8  # (a loaded machine may spread the adds over a few windows)


def test_prune_never_deletes_a_head_or_fork_base(remit: Remit, run_id: str) -> None:
    parent = None
    for i in range(1, 7):
        remit.commit(run_id=run_id, checkpoint_id=f"c{i:02d}", parent_id=parent, state=b"s")
        parent = f"c{i:02d}"
    remit.commit(run_id=run_id, checkpoint_id="f01", parent_id="c02", state=b"f", fork_token="t")
    remit.commit(run_id=run_id, checkpoint_id="f02", parent_id="f01", state=b"f")
    remit.commit(run_id=run_id, checkpoint_id="s01", parent_id=None, state=b"s", ns="sub")
    with pytest.raises(ValueError):
        remit.prune([run_id], keep_last=0)
    assert remit.prune([run_id], keep_last=2) == 3  # c01, c03, c04
    left = {c.checkpoint_id for c in remit.history(run_id)}
    assert left == {"c02", "c05", "c06", "f01", "f02", "s01"}
    assert remit.prune([run_id]) == 2  # c05, f01
    assert {c.checkpoint_id for c in remit.history(run_id)} == {"c02", "c06", "f02", "s01"}
    assert remit.prune([run_id]) == 0
    for branch, expected in ((MAIN_BRANCH, "c06"), (policy.fork_branch_name("t"), "f02")):
        head = remit.head(run_id, branch=branch)
        assert head is not None and head.checkpoint_id == expected


def test_facade_delete_and_copy_run(remit: Remit, run_id: str) -> None:
    target = f"{run_id}-copy"
    remit.commit(
        run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"one", blobs={"k": b"v"}
    )
    remit.copy_run(run_id, target)
    copied = remit.head(target)
    assert copied is not None and (copied.checkpoint_id, copied.state) == ("c01", b"one")
    assert remit.blobs(target, ["k"]) == {"k": b"v"}
    remit.delete_run(run_id)
    assert remit.head(run_id) is None and remit.history(run_id) == []
    assert remit.head(target) is not None


def test_commit_after_a_head_another_process_moved(store: Store, run_id: str) -> None:
    """A process that last saw c02 as main's head still plans correctly once it moved."""
    here, there = Remit(store), Remit(type(store)(store.url))  # type: ignore[call-arg]
    here.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"1")
    here.commit(run_id=run_id, checkpoint_id="c02", parent_id="c01", state=b"2")
    there.commit(run_id=run_id, checkpoint_id="c03", parent_id="c02", state=b"3")
    with pytest.raises(ForkWithoutIntent):
        here.commit(run_id=run_id, checkpoint_id="x", parent_id="c02", state=b"x")
    forked = here.commit(
        run_id=run_id, checkpoint_id="f01", parent_id="c02", state=b"f", fork_token="t"
    )
    assert forked.branch == policy.fork_branch_name("t")
    # A fork head is continued by planning, never by guessing main.
    f2 = here.commit(run_id=run_id, checkpoint_id="f02", parent_id="f01", state=b"f")
    assert f2.branch == forked.branch
    head = there.head(run_id)
    assert head is not None and head.checkpoint_id == "c03"


def test_commit_after_main_was_rewound(store: Store, run_id: str) -> None:
    here, there = Remit(store), Remit(type(store)(store.url))  # type: ignore[call-arg]
    for i, parent in enumerate([None, "c01", "c02"], start=1):
        here.commit(run_id=run_id, checkpoint_id=f"c{i:02d}", parent_id=parent, state=b"s")
    there.store.move_head(run_id, "", MAIN_BRANCH, expected_head="c03", new_head="c02", new_seq=2)
    # c02 is main's head again: the next commit after it is a plain CAS at seq 3.
    again = here.commit(run_id=run_id, checkpoint_id="c03b", parent_id="c02", state=b"3b")
    assert (again.branch, again.seq) == (MAIN_BRANCH, 3)
    head = there.head(run_id)
    assert head is not None and (head.checkpoint_id, head.seq) == ("c03b", 3)
    children = sorted(c.checkpoint_id for c in here.history(run_id) if c.parent_id == "c02")
    assert children == ["c03", "c03b"]


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("synchronus=FULL", "unknown SQLite URL option 'synchronus'"),
        ("busy_timeout=soon", "busy_timeout='soon' is not an integer"),
        ("busy_timeout=-5", "busy_timeout=-5 is below 0"),
        ("synchronous=FULL&synchronous=NORMAL", "'synchronous' is given twice"),
    ],
)
def test_a_sqlite_url_option_that_is_not_understood_is_refused_naming_it(
    tmp_path: Path, query: str, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        SQLiteStore(f"sqlite:///{tmp_path}/t.db?{query}")
    assert not (tmp_path / "t.db").exists()  # nothing was opened


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("max_size=abc", "max_size='abc' is not an integer"),
        ("max_size=0", "max_size=0 is below 1"),
        ("max_size=2&min_size=5", "min_size=5 is above max_size=2"),
        ("min_size=1&min_size=2", "'min_size' is given twice"),
    ],
)
def test_a_postgres_pool_option_that_cannot_hold_is_refused_naming_it(
    query: str, named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        PostgresStore(f"postgresql://postgres@127.0.0.1:5432/test?{query}")


def test_a_postgres_min_size_alone_raises_the_default_max_size_to_it() -> None:
    store = PostgresStore("postgresql://postgres@127.0.0.1:5432/test?min_size=6")
    assert (store._min, store._max) == (6, 6)


def test_a_redis_url_option_redis_py_does_not_know_is_refused_naming_it() -> None:
    from remit_core.stores.redis import RedisStore

    with pytest.raises(ValueError, match="unknown Redis URL option 'socket_timout'"):
        RedisStore("redis://127.0.0.1:6379/0?socket_timout=2")
    # Options of redis-py's connections and pool are passed on.
    store = Remit("redis://127.0.0.1:6379/0?socket_timeout=5&max_connections=8").store
    assert isinstance(store, RedisStore) and store.list_checkpoints(uuid.uuid4().hex, "") == []


def test_a_sqlite_store_keeps_a_bounded_number_of_heads_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process that writes many runs does not keep every run's head: the oldest
    cached heads go, and are read from the file again when asked for."""
    from remit_core.stores import sqlite as engine

    monkeypatch.setattr(engine, "_HEADS_KEPT", 8)
    remit = Remit(f"sqlite:///{tmp_path}/t.db")
    runs = [f"run-{i}" for i in range(20)]
    for i, run in enumerate(runs):
        remit.commit(run_id=run, checkpoint_id="c1", parent_id=None, state=f"s{i}".encode())
    store = remit.store
    assert isinstance(store, SQLiteStore) and len(store._heads) == 8
    for i, run in enumerate(runs):
        head = remit.head(run)
        assert head is not None and head.state == f"s{i}".encode()
    assert len(store._heads) == 8
