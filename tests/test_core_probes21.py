"""Probes of the core and its engines, round 21: what a caller hands over.

- Step writes and blob keys given as a generator (or any one-pass iterator) were
  checked, which used it up, and then stored as nothing: `put_writes` and a
  commit's `writes=` acknowledged writes that were never kept, and `blobs` found
  none of the keys asked for.
- `arun_effect` given a plain function applied the effect, then failed awaiting its
  result: the outcome was lost and every replay raised `EffectInDoubt` for an
  effect that had happened once, cleanly.
- `run_effect` given a coroutine function recorded the intent and got a coroutine
  that never ran: an effect that never happened stayed in doubt for good.
- Processes sharing one explicit `Remit(holder=)` (a service's name, or a `Remit`
  made before a fork) gave each claim the same holder, so a second process got
  the first's live claim back as its own, same fence: two resumers ran at once.
- An interrupt record altered in the store was read as it stood: a consumed one set
  back to "pending" took a second value on the SQL engines, Redis read any status
  it did not know as "pending", and a time that is not a number was a bare
  `ValueError`. Each is now `CorruptRecord` naming the run and the interrupt, and
  nothing is stored.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest
import redis

from remit_core import (
    NOT_APPLIED,
    CorruptRecord,
    Remit,
    ResumeConflict,
    WriteRecord,
    arun_effect,
    effect,
    run_effect,
    step_scope,
)
from remit_core.stores.redis import _join, run_prefix
from remit_core.stores.sqlite import sqlite_path


@pytest.fixture
def remit(store_url: str) -> Any:
    with Remit(store_url) as r:
        yield r


# -- one-pass iterables --------------------------------------------------------


def test_step_writes_given_as_a_generator_are_all_stored(remit: Remit, run_id: str) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1")
    remit.put_writes(WriteRecord(run_id, "c1", "t", i, "ch", b"w%d" % i) for i in range(3))
    assert [w.value for w in remit.writes(run_id, "c1")] == [b"w0", b"w1", b"w2"]
    remit.put_writes(
        map(lambda i: WriteRecord(run_id, "c1", "u", i, "ch", b"x"), range(2)),
        mode="expect_absent",
    )
    assert [(w.task_id, w.idx) for w in remit.writes(run_id, "c1")][3:] == [("u", 0), ("u", 1)]


def test_a_commits_writes_given_as_a_generator_are_stored_with_it(
    remit: Remit, run_id: str
) -> None:
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1")
    remit.commit(
        run_id=run_id,
        checkpoint_id="c2",
        parent_id="c1",
        state=b"2",
        writes=(WriteRecord(run_id, "c2", "t", i, "ch", b"v") for i in range(2)),
    )
    assert [(w.task_id, w.idx) for w in remit.writes(run_id, "c2")] == [("t", 0), ("t", 1)]


def test_blob_keys_given_as_an_iterator_are_all_looked_up(remit: Remit, run_id: str) -> None:
    remit.commit(
        run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1", blobs={"a": b"A", "b": b"B"}
    )
    assert remit.blobs(run_id, (k for k in ["a", "b"])) == {"a": b"A", "b": b"B"}
    assert remit.blobs(run_id, iter(["b"])) == {"b": b"B"}


# -- effects given the other kind of function -------------------------------------


def test_arun_effect_given_a_plain_function_records_its_outcome_once(
    remit: Remit, run_id: str
) -> None:
    applied: list[str] = []

    def charge(key: str) -> dict[str, str]:
        applied.append(key)
        return {"charge": "ch-1"}

    async def step() -> Any:
        with step_scope(remit, run_id, "charge"):
            return await arun_effect("charge", charge)

    assert asyncio.run(step()) == {"charge": "ch-1"}
    assert asyncio.run(step()) == {"charge": "ch-1"}  # a replay: the recorded outcome
    assert len(applied) == 1
    entry = remit.store.get_effect(run_id, "charge/charge#0")
    assert entry is not None and entry.status == "done"


def test_run_effect_given_a_coroutine_function_is_refused_before_anything_is_recorded(
    remit: Remit, run_id: str
) -> None:
    applied: list[str] = []

    async def charge(key: str) -> str:
        applied.append(key)
        return "ch-1"

    async def found(key: str) -> Any:
        return NOT_APPLIED

    with step_scope(remit, run_id, "charge"):
        with pytest.raises(TypeError, match="arun_effect"):
            run_effect("charge", charge)
        with pytest.raises(TypeError, match="reconcile"):
            run_effect("charge", lambda key: "ch-1", reconcile=found)
    assert remit.store.get_effect(run_id, "charge/charge#0") is None

    async def step() -> Any:
        with step_scope(remit, run_id, "charge"):
            return await arun_effect("charge", charge)

    # Nothing left in doubt: the async call applies it, once.
    assert asyncio.run(step()) == "ch-1"
    assert len(applied) == 1


def test_a_blocking_effect_whose_function_returns_a_coroutine_says_so_and_never_runs_it(
    remit: Remit, run_id: str
) -> None:
    applied: list[str] = []

    async def charge(key: str) -> str:
        applied.append(key)
        return "ch-1"

    # A plain function that hands back a coroutine (a wrapper that hides it).
    @effect(reconcile=lambda key: NOT_APPLIED)
    def wrapped(*, idempotency_key: str) -> Any:
        return charge(idempotency_key)

    with step_scope(remit, run_id, "charge"):
        with pytest.raises(TypeError, match="returned an awaitable"):
            wrapped()
    assert applied == []


# -- an explicit holder shared by processes ----------------------------------------

_CLAIM = """
import os, sys
from remit_core import Remit, ResumeConflict
remit = Remit(sys.argv[1], holder="billing-service")
try:
    handle = remit.claim(sys.argv[2], heartbeat=False)
except ResumeConflict:
    print("conflict", flush=True)
    os._exit(0)
print("claimed", handle.claim.fence, flush=True)
os._exit(0)  # alive as far as the store knows: the lease runs on
"""


def _claim_in_a_process(store_url: str, run_id: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CLAIM, store_url, run_id],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "REMIT_FAILPOINTS": ""},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_processes_sharing_an_explicit_holder_do_not_share_a_claim(
    store_url: str, run_id: str
) -> None:
    first = _claim_in_a_process(store_url, run_id)
    assert first == "claimed 1"
    # The first process's lease is live: a second one under the same name is refused.
    assert _claim_in_a_process(store_url, run_id) == "conflict"
    with Remit(store_url, holder="billing-service") as here:
        with pytest.raises(ResumeConflict):
            here.claim(run_id, heartbeat=False)
        claim = here.store.get_claim(run_id, "main")
        assert claim is not None and claim.fence == 1
        assert claim.holder.startswith("billing-service/")


def test_a_remit_with_an_explicit_holder_made_before_a_fork_gives_each_child_its_own_claims(
    store_url: str,
) -> None:
    remit = Remit(store_url, holder="worker")
    runs = [f"run-{uuid.uuid4().hex}" for _ in range(2)]
    remit.claim(runs[0], heartbeat=False).release()  # the store set up, a serial drawn
    read, write = os.pipe()
    pids = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # the child: same serial next as its sibling, same holder name
            code = 1
            try:
                remit.claim(runs[1], heartbeat=False)
                code = 0
            except ResumeConflict:
                code = 3
            finally:
                os.write(write, b"%d" % code)
                os._exit(code)
        pids.append(pid)
        os.waitpid(pid, 0)  # one after the other: the first child's claim is live
    os.close(write)
    codes = sorted(os.read(read, 16).decode())
    os.close(read)
    assert codes == ["0", "3"]  # one claimed, the other conflicted
    remit.close()


def test_effect_refuses_a_generator_function_or_a_blocking_one_with_an_async_reconcile() -> None:
    def sends(to: str) -> Any:
        yield to

    async def asends(to: str) -> Any:
        yield to

    async def found(key: str) -> Any:
        return NOT_APPLIED

    with pytest.raises(TypeError, match="generator function"):
        effect(sends)
    with pytest.raises(TypeError, match="generator function"):
        effect(asends)
    with pytest.raises(TypeError, match="reconcile is a coroutine function"):
        effect(reconcile=found)(lambda to: to)
    # An async effect may have an async reconcile; a blocking one a plain reconcile.
    effect(reconcile=found)(found)
    effect(reconcile=lambda key: NOT_APPLIED)(lambda to: to)


# -- interrupt records altered in the store ---------------------------------------

_REDIS_INTERRUPT = {"status": "s", "value": "v", "created_at": "c"}


def _alter_interrupt(url: str, run_id: str, interrupt_id: str, column: str, value: Any) -> None:
    """Set one column of an interrupt of main behind the core's back."""
    if url.startswith("redis"):
        client = redis.Redis.from_url(url)
        field = _join("main", interrupt_id) + "\x00" + _REDIS_INTERRUPT[column]
        client.hset(run_prefix(run_id) + "in", field, value)
        client.close()
        return
    sql = f"UPDATE remit_interrupts SET {column} = ? WHERE run_id = ? AND interrupt_id = ?"
    if url.startswith("sqlite"):
        with sqlite3.connect(sqlite_path(url)) as conn:
            conn.execute(sql, (value, run_id, interrupt_id))
        return
    with psycopg.connect(url, autocommit=True) as pg:
        pg.execute(sql.replace("?", "%s"), (value, run_id, interrupt_id))


@pytest.mark.parametrize(("status", "says"), [("pending", "'pending' with"), ("done", "'done'")])
def test_a_consumed_interrupt_whose_status_was_altered_takes_no_second_value(
    remit: Remit, run_id: str, status: str, says: str
) -> None:
    remit.open_interrupts(run_id, {"approve": b"ok?"}, checkpoint_id="c1")
    remit.consume(run_id, "approve", b"alice")
    _alter_interrupt(remit.store.url, run_id, "approve", "status", status)
    with pytest.raises(CorruptRecord, match=says) as read:
        remit.interrupt(run_id, "approve")
    assert (read.value.run_id, read.value.interrupt_id) == (run_id, "approve")
    with pytest.raises(CorruptRecord, match=says):
        remit.interrupts(run_id)
    with pytest.raises(CorruptRecord, match=says):
        remit.consume(run_id, "approve", b"mallory")
    # Nothing of the second value was stored: the first is still there, consumed once.
    _alter_interrupt(remit.store.url, run_id, "approve", "status", "consumed")
    kept = remit.interrupt(run_id, "approve")
    assert kept is not None and (kept.status, kept.value) == ("consumed", b"alice")


@pytest.mark.parametrize("engine", ["sqlite", "redis"])  # (PostgreSQL's column is typed)
def test_an_interrupt_whose_time_is_not_a_number_is_corrupt_record(
    engine: str, tmp_path: Any, run_id: str
) -> None:
    url = f"sqlite:///{tmp_path}/t.db" if engine == "sqlite" else "redis://127.0.0.1:6379/0"
    with Remit(url) as remit:
        remit.open_interrupts(run_id, {"approve": b"ok?"}, checkpoint_id="c1")
        _alter_interrupt(url, run_id, "approve", "created_at", "noon")
        for read in (
            lambda: remit.interrupt(run_id, "approve"),
            lambda: remit.interrupts(run_id),
            lambda: remit.consume(run_id, "approve", b"alice"),
        ):
            with pytest.raises(CorruptRecord) as err:
                read()
            assert (err.value.run_id, err.value.interrupt_id) == (run_id, "approve")


@pytest.mark.parametrize("engine", ["sqlite", "redis"])  # (PostgreSQL's column is typed)
def test_a_branch_whose_head_seq_is_not_a_number_is_corrupt_record(
    engine: str, tmp_path: Any, run_id: str
) -> None:
    url = f"sqlite:///{tmp_path}/t.db" if engine == "sqlite" else "redis://127.0.0.1:6379/0"
    with Remit(url) as remit:
        remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"{}")
        if engine == "redis":
            client = redis.Redis.from_url(url)
            client.hset(run_prefix(run_id) + "br", _join("", "main") + "\x00q", "seven")
            client.close()
        else:
            with sqlite3.connect(sqlite_path(url)) as conn:
                conn.execute(
                    "UPDATE remit_branches SET head_seq = 'seven' WHERE run_id = ?", (run_id,)
                )
        with pytest.raises(CorruptRecord, match="stored branch 'main' does not decode") as err:
            remit.branches(run_id)
        assert err.value.run_id == run_id
        remit.delete_run(run_id)
