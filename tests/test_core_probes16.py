"""Probes of the core and its engines, round 16: the effect ledger and state migrations.

- Calls of one step's effects from several threads (`asyncio.to_thread` copies
  the step's context, so its scope) could draw one occurrence twice: the second
  call then returned the first's recorded outcome and was never applied.
- A holder whose claim was taken over applied an effect left in doubt (the
  reconcile that answered "not applied", or an idempotent re-apply) before its
  first fenced write, the outcome's, was refused: only a first apply was fenced.
- A ledger entry altered in the store (done without an outcome, a status of no
  kind, a timestamp that is not a number) raised `AssertionError` or a bare
  `ValueError`, or was taken for an effect in doubt and applied again.
- A state migration that raised gave its own bare error, naming no record; a
  schema version or migration step that is not an int was never matched.
"""

from __future__ import annotations

import asyncio
import contextvars
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from remit_core import (
    NOT_APPLIED,
    CorruptRecord,
    Fenced,
    FenceRef,
    Migrations,
    Remit,
    RemitError,
    StateSchema,
    VersionMismatch,
    arun_effect,
    codec,
    run_effect,
    step_scope,
)
from remit_core.effects import SharedScope, StepScope
from remit_core.stores.redis import run_prefix
from remit_core.stores.sqlite import sqlite_path


@pytest.fixture
def remit(store_url: str) -> Iterator[Remit]:
    with Remit(store_url) as remit:
        yield remit


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch as often as the interpreter allows, so that races show."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


# -- effects called from several threads of one step ---------------------------------


def _in_threads(n: int, work: Callable[[int], None]) -> None:
    """Run `work(i)` in `n` threads, each in a copy of this context (as `asyncio.to_thread`)."""
    threads = [
        threading.Thread(target=contextvars.copy_context().run, args=(work, i)) for i in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.mark.usefixtures("fast_switching")
@pytest.mark.parametrize("shared", [False, True])
def test_threads_of_one_step_draw_each_occurrence_once(
    tmp_path: Path, run_id: str, shared: bool
) -> None:
    """Every call draws its own occurrence key, whichever threads call at once; a key
    drawn twice made the second call return the first's outcome, never applied."""
    remit = Remit(f"sqlite:///{tmp_path}/draws.db")
    scope = SharedScope(remit, run_id, "s") if shared else StepScope(remit, run_id, "s")
    drawn: list[str] = []

    def draw(_: int) -> None:
        drawn.extend(scope.next_key("mail") for _ in range(25_000))

    _in_threads(8, draw)
    assert len(set(drawn)) == len(drawn) == 200_000


@pytest.mark.usefixtures("fast_switching")
def test_effects_of_one_step_called_from_several_threads_each_get_an_occurrence_of_their_own(
    remit: Remit, run_id: str
) -> None:
    applied: list[int] = []
    returned: dict[int, Any] = {}

    def send(i: int) -> Any:
        return run_effect("send", lambda key: applied.append(i) or i)

    def sender(t: int) -> None:
        for i in range(t * 100, t * 100 + 40):
            returned[i] = send(i)

    with step_scope(remit, run_id, "step"):
        _in_threads(4, sender)
    assert sorted(applied) == sorted(returned) and len(applied) == 160
    assert all(returned[i] == i for i in returned)


def test_an_effect_in_a_thread_outside_the_steps_context_says_how_to_reach_it(
    remit: Remit, run_id: str
) -> None:
    errors: list[BaseException] = []

    def mail() -> None:
        try:
            run_effect("mail", lambda key: key)
        except RemitError as exc:
            errors.append(exc)

    with step_scope(remit, run_id, "s"):
        thread = threading.Thread(target=mail)
        thread.start()
        thread.join()
    assert len(errors) == 1
    assert "outside a Remit step" in str(errors[0]) and "copy_context" in str(errors[0])


# -- a holder whose claim was taken over ---------------------------------------------


@pytest.mark.parametrize("mode", ["reconcile", "idempotent", "async reconcile"])
def test_a_holder_whose_claim_was_taken_over_applies_no_effect_left_in_doubt(
    remit: Remit, run_id: str, mode: str
) -> None:
    """A first apply is refused to a stale fence by its intent's write; an effect in
    doubt was reconciled ("not applied") or re-applied, then applied, and only the
    outcome's write was refused: the zombie had applied it already (L2)."""
    applied: list[str] = []
    old = remit.store.acquire_claim(run_id, "main", "A", now=0.0, lease=1.0)
    remit.store.begin_effect(run_id, "s/pay#0", "key-A", now=0.0, fence=FenceRef.of(old))
    new = remit.store.acquire_claim(run_id, "main", "B", now=5.0, lease=1.0)
    assert new.fence != old.fence

    def apply(key: str) -> str:
        applied.append(key)
        return "receipt"

    with step_scope(remit, run_id, "s", fence=FenceRef.of(old)), pytest.raises(Fenced):
        if mode == "reconcile":
            run_effect("pay", apply, reconcile=lambda key: NOT_APPLIED)
        elif mode == "idempotent":
            run_effect("pay", apply, idempotent=True)
        else:

            async def aapply(key: str) -> str:
                return apply(key)

            asyncio.run(arun_effect("pay", aapply, reconcile=lambda key: NOT_APPLIED))
    assert applied == []
    entry = remit.store.get_effect(run_id, "s/pay#0")
    assert entry is not None and entry.status == "intent"
    # The holder of the claim settles it, once, under the key it was begun with.
    with step_scope(remit, run_id, "s", fence=FenceRef.of(new)):
        assert run_effect("pay", apply, reconcile=lambda key: NOT_APPLIED) == "receipt"
    assert applied == ["key-A"]


def test_an_effect_another_caller_finished_while_this_one_reconciled_is_not_applied_again(
    remit: Remit, run_id: str
) -> None:
    """Between a reconcile's "not applied" and the apply, another caller (a process of
    its own, here the store directly) recorded the outcome: it is returned, not applied."""
    remit.store.begin_effect(run_id, "s/pay#0", "key-0", now=0.0)
    applied: list[str] = []

    def reconcile(key: str) -> Any:
        theirs = codec.seal(codec.dumps("theirs"), "effect\x00s/pay#0")
        remit.store.finish_effect(run_id, "s/pay#0", theirs, now=1.0)
        return NOT_APPLIED  # (asked before the other caller finished)

    with step_scope(remit, run_id, "s"):
        outcome = run_effect("pay", lambda key: applied.append(key) or "mine", reconcile=reconcile)
    assert outcome == "theirs" and applied == []


# -- ledger entries altered in the store ---------------------------------------------


#: The Redis field letter of each ledger column.
_REDIS_COLUMNS = {"idempotency_key": "k", "status": "s", "outcome": "o", "created_at": "c"}


def _alter(url: str, run_id: str, key: str, column: str, value: Any) -> None:
    """Set one column of an effect's ledger entry (None: remove it) behind the core's back."""
    if url.startswith("redis"):
        client = redis.Redis.from_url(url)
        field = f"{key}\x00{_REDIS_COLUMNS[column]}"
        if value is None:
            client.hdel(run_prefix(run_id) + "ef", field)
        else:
            client.hset(run_prefix(run_id) + "ef", field, value)
        client.close()
        return
    sql = f"UPDATE remit_effects SET {column} = ? WHERE run_id = ? AND effect_key = ?"
    if url.startswith("sqlite"):
        with sqlite3.connect(sqlite_path(url)) as conn:
            conn.execute(sql, (value, run_id, key))
        return
    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(sql.replace("?", "%s"), (value, run_id, key))


@pytest.mark.parametrize(
    ("column", "value", "says"),
    [
        ("outcome", None, "'done' without an outcome"),
        ("status", "dome", "'dome' with an outcome"),
    ],
)
def test_a_ledger_entry_altered_in_the_store_is_corrupt_record_on_every_engine(
    remit: Remit, run_id: str, column: str, value: Any, says: str
) -> None:
    applied: list[str] = []
    with step_scope(remit, run_id, "s"):
        run_effect("pay", lambda key: applied.append(key) or "receipt", idempotent=True)
    _alter(remit.store.url, run_id, "s/pay#0", column, value)
    with step_scope(remit, run_id, "s"), pytest.raises(CorruptRecord, match=says) as err:
        run_effect("pay", lambda key: applied.append(key) or "again", idempotent=True)
    assert (err.value.run_id, err.value.effect_key) == (run_id, "s/pay#0")
    assert len(applied) == 1


@pytest.mark.parametrize("engine", ["sqlite", "redis"])  # (PostgreSQL's column is typed)
def test_a_ledger_entry_whose_time_is_not_a_number_is_corrupt_record(
    engine: str, tmp_path: Path, run_id: str
) -> None:
    url = f"sqlite:///{tmp_path}/t.db" if engine == "sqlite" else "redis://127.0.0.1:6379/0"
    with Remit(url) as remit:
        with step_scope(remit, run_id, "s"):
            run_effect("pay", lambda key: "receipt")
        _alter(url, run_id, "s/pay#0", "created_at", "noon")
        with step_scope(remit, run_id, "s"), pytest.raises(CorruptRecord) as err:
            run_effect("pay", lambda key: "again")
        assert (err.value.run_id, err.value.effect_key) == (run_id, "s/pay#0")


def test_a_redis_ledger_entry_missing_its_key_is_corrupt_record(run_id: str) -> None:
    url = "redis://127.0.0.1:6379/0"
    with Remit(url) as remit:
        remit.store.begin_effect(run_id, "s/pay#0", "key-0", now=0.0)
        _alter(url, run_id, "s/pay#0", "idempotency_key", None)
        with step_scope(remit, run_id, "s"), pytest.raises(CorruptRecord) as err:
            run_effect("pay", lambda key: "again", idempotent=True)
        assert err.value.effect_key == "s/pay#0"


# -- state migrations ----------------------------------------------------------------


def test_a_migration_that_fails_is_version_mismatch_naming_the_record_and_step() -> None:
    migrations = Migrations()

    @migrations.register(1)
    def rename(state: dict[str, Any]) -> dict[str, Any]:
        return {"total": state["amount"]}

    schema = StateSchema(dict, version=2, migrations=migrations)
    with pytest.raises(VersionMismatch, match="migration from version 1 failed: KeyError") as err:
        schema.upgrade({"sum": 1}, 1, run_id="r1", checkpoint_id="c1")
    assert (err.value.run_id, err.value.checkpoint_id) == ("r1", "c1")
    assert isinstance(err.value.__cause__, KeyError)
    assert schema.upgrade({"amount": 3}, 1) == {"total": 3}


@pytest.mark.parametrize("version", ["2", 2.0, True, None])
def test_a_schema_version_that_is_not_an_int_is_refused_when_declared(version: Any) -> None:
    """A checkpoint's schema version is an int: "2" or 2.0 never equalled it, and every
    read raised "no migration from version 2" with the migration registered."""
    with pytest.raises(TypeError, match="version must be an int"):
        StateSchema(dict, version=version)
    with pytest.raises(TypeError, match="from_version must be an int"):
        Migrations().register(version)
    with pytest.raises(ValueError, match="0 or more"):
        StateSchema(dict, version=-1)
