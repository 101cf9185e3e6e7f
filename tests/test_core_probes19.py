"""Probes of the core and its engines, round 19: a store used by two Remit versions at
once (a rolling upgrade), and Redis replies lost after a script ran.

A PostgreSQL migration that changes a column's type outdates the statements every
other session has prepared: this process's next use of one failed with psycopg's
"cached plan must not change result type", not a `RemitError`, and kept failing on
that connection. And a Redis URL could ask redis-py to re-send a command after a
timeout or a lost connection: a script that had run ran again, so a consume that
landed answered `ResumeConflict` and an effect's first intent read as one in doubt.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from conftest import PG_URL, REDIS_URL

from remit_core import (
    EffectInDoubt,
    Remit,
    ResumeConflict,
    VersionMismatch,
    effect,
    step_scope,
)
from remit_core.stores.base import SCHEMA_VERSION
from remit_core.stores.redis import RedisStore, run_prefix

# -- a newer Remit migrates a PostgreSQL store this process uses ------------------------


@pytest.fixture
def pg_schema() -> Iterator[str]:
    """A PostgreSQL schema of its own (migrations here never touch the shared one)."""
    schema = f"remit_up_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema
    finally:
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


def _newer_migration(schema: str, version: int | None) -> None:
    """What a newer Remit's `setup()` does in another session: change a column's type
    (as migration 6 changed the collation of ids), and record its number."""
    with psycopg.connect(PG_URL, autocommit=True) as conn, conn.transaction():
        conn.execute(f"SET LOCAL search_path = {schema}")
        conn.execute("ALTER TABLE remit_checkpoints ALTER COLUMN workflow_version TYPE VARCHAR")
        if version is not None:
            conn.execute(
                "INSERT INTO remit_migrations (version, applied_at) VALUES (%s, 0)", (version,)
            )


def test_postgres_statements_outdated_by_a_newer_remits_migration_refuse_clearly(
    pg_schema: str,
) -> None:
    """This process keeps running while a newer Remit migrates the store: its next
    reads and writes raise `VersionMismatch` saying to upgrade (not psycopg's "cached
    plan must not change result type"), and nothing stored is changed by them."""
    url = f"{PG_URL}?options=-csearch_path%3D{pg_schema}&max_size=1"
    remit = Remit(url)
    run_id = f"run-{uuid.uuid4().hex}"
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    assert remit.head(run_id) is not None  # (its statements are prepared now)
    _newer_migration(pg_schema, SCHEMA_VERSION + 1)
    for _ in range(2):  # (the same connection, or its replacement)
        with pytest.raises(VersionMismatch, match=rf"schema {SCHEMA_VERSION + 1}.*upgrade remit"):
            remit.head(run_id)
    with pytest.raises(VersionMismatch, match="upgrade remit"):
        remit.history(run_id)
    # What is stored is as it was: a Remit of the newer schema's knowledge reads it.
    with psycopg.connect(PG_URL, autocommit=True) as conn:
        conn.execute(f"SET search_path = {pg_schema}")
        rows = conn.execute(
            "SELECT checkpoint_id, state FROM remit_checkpoints WHERE run_id = %s", (run_id,)
        ).fetchall()
    assert [r[0] for r in rows] == ["c1"]
    remit.close()


def test_postgres_a_type_change_without_a_newer_schema_is_read_again(pg_schema: str) -> None:
    """A column changed without a newer migration (an operator's edit) outdates the
    prepared statements too: the store drops the connection and reads again, so
    the call answers instead of failing on every later use of that connection."""
    url = f"{PG_URL}?options=-csearch_path%3D{pg_schema}&max_size=1"
    remit = Remit(url)
    run_id = f"run-{uuid.uuid4().hex}"
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    assert remit.history(run_id)[0].checkpoint_id == "c1"
    _newer_migration(pg_schema, None)
    for _ in range(2):
        assert remit.history(run_id)[0].checkpoint_id == "c1"
        head = remit.head(run_id)
        assert head is not None and head.checkpoint_id == "c1"
    remit.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s2")
    assert [c.checkpoint_id for c in remit.history(run_id)] == ["c2", "c1"]
    remit.close()


# -- Redis: a script re-sent after its reply was lost -------------------------------------


@pytest.mark.parametrize(
    "option", ["retry_on_timeout=true", "retry_on_error=ConnectionError,TimeoutError"]
)
def test_a_redis_url_that_asks_redis_py_to_resend_commands_is_refused(option: str) -> None:
    """redis-py re-sends a command whose reply a timeout or a dropped connection lost:
    a script that had run runs again. Refused where the store is made, naming it."""
    with pytest.raises(ValueError, match=option.split("=")[0] + ".*run twice"):
        RedisStore(f"{REDIS_URL}?{option}")
    with pytest.raises(ValueError, match=option.split("=")[0]):
        Remit(f"{REDIS_URL}?socket_timeout=5&{option}")


class _Resending(RedisStore):
    """A store whose every script runs twice, as a re-send of one whose reply was lost."""

    def _run(self, name: str, keys: Any, args: Any) -> Any:
        super()._run(name, keys, args)
        return super()._run(name, keys, args)


def test_what_each_redis_script_answers_when_re_sent_after_it_ran(run_id: str) -> None:
    """Why a re-send is refused: a consume that landed answers `ResumeConflict`, and an
    effect's first intent reads as one in doubt (never applied, yet `EffectInDoubt`).
    A commit re-sent is found stored, and the other scripts answer as the first run."""
    remit = Remit(_Resending(REDIS_URL))
    remit.store.setup()
    # Commit: the core finds it stored (a retry of a commit that landed).
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    assert [c.checkpoint_id for c in remit.history(run_id)] == ["c1"]
    claim = remit.claim(run_id, heartbeat=False)  # the same holder: its claim again
    assert remit.store.get_claim(run_id, "main").holder == claim.claim.holder  # type: ignore[union-attr]
    remit.open_interrupts(run_id, {"i1": b"p"}, checkpoint_id="c1")  # left as it is
    with pytest.raises(ResumeConflict):
        remit.consume(run_id, "i1", b"v1")
    stored = remit.interrupt(run_id, "i1")
    assert stored is not None and stored.value == b"v1"  # consumed, with this value

    applied: list[int] = []

    @effect
    def charge(amount: int) -> int:
        applied.append(amount)
        return amount

    with step_scope(remit, run_id, "step", fence=claim.fence), pytest.raises(EffectInDoubt):
        charge(5)
    assert applied == []  # never applied, yet in doubt for good
    claim.release()
    remit.close()
    del remit
    raw = RedisStore(REDIS_URL)
    raw._cmd("DEL", *(run_prefix(run_id) + k for k in ("ck", "ix", "br", "in", "cl", "ef")))
