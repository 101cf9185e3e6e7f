"""Probes of the core and its engines, round 15: text order on a PostgreSQL database
whose default collation is a language's.

SQLite and Redis order ids by their characters (their UTF-8 bytes). PostgreSQL
ordered them by the database's default collation, which on most servers is a
language's (`en_US.UTF-8`, or an ICU locale): there "a" comes before "B", and
punctuation may weigh nothing. The same run listed its history in another order,
and a page of it (`before_id`) held other checkpoints, than on the other engines.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from conftest import ENGINES, PG_URL, engine_url

from remit_core import Remit, WriteRecord
from remit_core.stores import open_store
from remit_core.stores.base import SCHEMA_VERSION
from remit_core.stores.postgres import PostgresStore

#: A database of the test server whose default collation orders text as a language does.
_LANGUAGE_DB = "remit_probe15_icu"


def _language_db_url() -> str:
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        try:
            conn.execute(
                f"CREATE DATABASE {_LANGUAGE_DB} TEMPLATE template0 "
                "LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C.UTF-8'"
            )
        except psycopg.errors.DuplicateDatabase:
            pass
    return urlunsplit(urlsplit(PG_URL)._replace(path="/" + _LANGUAGE_DB))


@pytest.fixture(params=ENGINES)
def ordered_url(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[str]:
    """A store URL per engine; PostgreSQL's is a database with a language's collation."""
    yield (
        _language_db_url() if request.param == "postgresql" else engine_url(request.param, tmp_path)
    )


#: Ids whose order by character differs from a language's: "B" < "a" < "a-c" < "ab" < "c".
_IDS = ["a", "B", "c", "ab", "a-c"]
_BY_CHARACTER = sorted(_IDS)


def test_ids_are_ordered_by_their_characters_alike_on_every_engine(ordered_url: str) -> None:
    run_id = f"run-{uuid.uuid4().hex}"
    remit = Remit(open_store(ordered_url), clock=lambda: 1000.0)
    try:
        parent = None
        for cid in _IDS:
            remit.commit(run_id=run_id, checkpoint_id=cid, parent_id=parent, state=b"s")
            parent = cid
        newest_first = list(reversed(_BY_CHARACTER))
        assert [r.checkpoint_id for r in remit.history(run_id)] == newest_first
        # A page before "a" holds what sorts before it, on every engine.
        page = remit.history(run_id, before_id="a")
        assert [r.checkpoint_id for r in page] == ["B"]
        assert [r.checkpoint_id for r in remit.history(run_id, before_id="ab", limit=2)] == [
            "a-c",
            "a",
        ]
        remit.put_writes(
            [WriteRecord(run_id, "c", task, 0, "ch", b"v") for task in _IDS], mode="overwrite"
        )
        assert [w.task_id for w in remit.writes(run_id, "c")] == _BY_CHARACTER
        # Interrupts opened at one instant are listed by id.
        remit.open_interrupts(run_id, {iid: None for iid in _IDS})
        assert [i.interrupt_id for i in remit.interrupts(run_id)] == _BY_CHARACTER
    finally:
        remit.close()


def test_a_postgres_store_of_schema_5_is_migrated_to_character_order_keeping_its_data() -> None:
    url = _language_db_url()
    run_id = f"run-{uuid.uuid4().hex}"
    PostgresStore(url).setup()
    with psycopg.connect(url, autocommit=True) as conn, conn.transaction():
        # The store as schema 5 left it: its ids in the database's own collation.
        conn.execute("SELECT pg_advisory_xact_lock(7461313)")
        for table, column in (
            ("remit_checkpoints", "checkpoint_id"),
            ("remit_branches", "branch"),
            ("remit_writes", "task_id"),
            ("remit_interrupts", "interrupt_id"),
        ):
            conn.execute(f'ALTER TABLE {table} ALTER COLUMN {column} TYPE TEXT COLLATE "default"')
        conn.execute("DELETE FROM remit_migrations WHERE version > 5")
    old = Remit(PostgresStore(url))
    parent = None
    for cid in _IDS:
        old.commit(run_id=run_id, checkpoint_id=cid, parent_id=parent, state=cid.encode())
        parent = cid
    assert [r.checkpoint_id for r in old.history(run_id)][:2] == ["c", "B"]  # a language's order
    old.store.close()
    store = PostgresStore(url)
    store.setup()
    remit = Remit(store)
    try:
        assert remit.store.applied_migrations()[-1] == SCHEMA_VERSION
        history = remit.history(run_id)
        assert [r.checkpoint_id for r in history] == list(reversed(_BY_CHARACTER))
        assert [r.state for r in history] == [cid.encode() for cid in reversed(_BY_CHARACTER)]
        head = remit.head(run_id)
        assert head is not None and head.checkpoint_id == _IDS[-1]
    finally:
        store.close()
