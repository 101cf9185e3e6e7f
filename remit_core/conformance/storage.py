"""Direct access to a probe's store, below the framework: copies and corruption.

Any framework's adapter may use these for its Remit targets.
`copy_remit_run(source, dest, run_id)` copies everything a Remit store holds
for one run (checkpoints, branches, blobs, writes, interrupts, claims, the
effect ledger) to `dest = source.relocated(...)`, keeping the run id, so that
effect idempotency keys, claims and fences are those of the original: a
recovery on the copy is a recovery of the crashed store (RECOVER-TWICE).
`corrupt_remit_checkpoint` alters one stored byte of a checkpoint, as a bad
disk or a careless hand would (CORRUPT-RECORD).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from remit_core.conformance.adapter import Target
from remit_core.stores import open_store
from remit_core.stores.sqlite import sqlite_path as stores_sqlite_path

#: Every table of the SQL engines that holds rows of a run (all keyed by `run_id`).
_SQL_TABLES = (
    "remit_checkpoints",
    "remit_branches",
    "remit_blobs",
    "remit_writes",
    "remit_interrupts",
    "remit_claims",
    "remit_effects",
)


def sqlite_path(url: str) -> Path:
    """The file of a `sqlite:///path` URL, as the store reads it (`ValueError` if the
    URL names none)."""
    return Path(stores_sqlite_path(url))


def backup_sqlite(source: Path, dest: Path) -> None:
    """A consistent copy of a SQLite file (its WAL included), as SQLite's backup API makes it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    src = sqlite3.connect(source, timeout=60)
    dst = sqlite3.connect(dest)
    try:
        src.backup(dst)
    finally:
        dst.close()
        src.close()


def create_schema(target: Target) -> None:
    """Create the PostgreSQL schema a relocated target lives in."""
    import psycopg

    schema = target.schema
    assert schema is not None, "only a relocated PostgreSQL target has its own schema"
    base = target.url.split("?", 1)[0]
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')


def copy_remit_run(source: Target, dest: Target, run_id: str) -> None:
    """Copy run `run_id` of the Remit store at `source` to `dest`, keeping the run id."""
    if source.engine == "sqlite":
        backup_sqlite(sqlite_path(source.url), sqlite_path(dest.url))
    elif source.engine == "postgresql":
        _copy_postgres(source, dest, run_id)
    elif source.engine == "redis":
        _copy_redis(source, dest, run_id)
    else:
        raise ValueError(f"cannot copy a store at {source.url!r}")


def _copy_postgres(source: Target, dest: Target, run_id: str) -> None:
    import psycopg

    create_schema(dest)
    open_store(dest.url)  # creates the tables in the copy's schema
    schema = dest.schema
    with psycopg.connect(source.url, autocommit=False) as conn, conn.transaction():
        for table in _SQL_TABLES:
            conn.execute(
                f'INSERT INTO "{schema}".{table} SELECT * FROM {table} WHERE run_id = %s',
                (run_id,),
            )


def _copy_redis(source: Target, dest: Target, run_id: str) -> None:
    from redis import Redis

    from remit_core.stores.redis import RUNS_KEY, run_keys

    open_store(dest.url)
    src, dst = Redis.from_url(source.url), Redis.from_url(dest.url)
    try:
        for key in run_keys(run_id):
            dumped = src.dump(key)
            if dumped is not None:
                dst.restore(key, 0, dumped, replace=True)
        if src.sismember(RUNS_KEY, run_id):
            dst.sadd(RUNS_KEY, run_id)
    finally:
        src.close()
        dst.close()


def flip_middle_byte(data: bytes) -> bytes:
    """`data` with its middle byte inverted."""
    raw = bytearray(data)
    raw[len(raw) // 2] ^= 0xFF
    return bytes(raw)


def corrupt_remit_checkpoint(target: Target, run_id: str, checkpoint_id: str, ns: str = "") -> None:
    """Invert one byte of the stored state of a checkpoint in the Remit store at `target`."""
    if target.engine == "sqlite":
        conn = sqlite3.connect(sqlite_path(target.url), timeout=60)
        try:
            _corrupt_sql(conn.execute, "?", run_id, ns, checkpoint_id)
            conn.commit()
        finally:
            conn.close()
    elif target.engine == "postgresql":
        import psycopg

        with psycopg.connect(target.url, autocommit=True) as pg:
            _corrupt_sql(pg.execute, "%s", run_id, ns, checkpoint_id)
    elif target.engine == "redis":
        from redis import Redis

        from remit_core.stores.redis import run_prefix

        client = Redis.from_url(target.url)
        try:
            key, field = run_prefix(run_id) + "ck", f"{checkpoint_id}\x00{ns}"
            stored = client.hget(key, field)
            if not isinstance(stored, bytes):
                raise LookupError(f"no checkpoint {checkpoint_id!r} of run {run_id!r}")
            header, _, state = stored.partition(b"\n")
            client.hset(key, field, header + b"\n" + flip_middle_byte(state))
        finally:
            client.close()
    else:
        raise ValueError(f"cannot corrupt a store at {target.url!r}")


def _corrupt_sql(execute: Any, mark: str, run_id: str, ns: str, checkpoint_id: str) -> None:
    where = f"WHERE run_id = {mark} AND ns = {mark} AND checkpoint_id = {mark}"
    row = execute(f"SELECT state FROM remit_checkpoints {where}", (run_id, ns, checkpoint_id))
    found = row.fetchone()
    if found is None:
        raise LookupError(f"no checkpoint {checkpoint_id!r} of run {run_id!r}")
    state = bytes(found[0])
    execute(
        f"UPDATE remit_checkpoints SET state = {mark} {where}",
        (flip_middle_byte(state), run_id, ns, checkpoint_id),
    )


def discard_copy(dest: Target, run_id: str) -> None:
    """Remove what a copy left on a server (its schema, or the run's keys); files stay.

    Best effort: a catalog race with other sessions' DDL is retried, then left.
    """
    for attempt in range(3):
        try:
            _discard(dest, run_id)
            return
        except Exception:
            time.sleep(0.2 * (attempt + 1))


def _discard(dest: Target, run_id: str) -> None:
    if dest.engine == "postgresql" and dest.schema:
        import psycopg

        with psycopg.connect(dest.url.split("?", 1)[0], autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{dest.schema}" CASCADE')
    elif dest.engine == "redis" and dest.kind == "remit":
        open_store(dest.url).delete_run(run_id)
