"""Round 26 of the core probes: a claim's take against the other writes of the same
instant, on every engine.

Probed: each store statement that both reads and writes (PostgreSQL's commit,
step writes and take, each a CTE that reads one snapshot; the read-then-write
transactions of consumes, effects and forks; the Redis scripts against the calls
the engine makes in two round trips; SQLite's two-statement take) against a
concurrent commit, release, renewal or takeover, for the class of round 25: a
statement that waited for another transaction and then acted on a row newer than
what it read.

Found: a take at the head by a holder that the claim's row already names, while
a commit of that holder is in flight (one that gives the claim up, its last after
its lease lapsed, or one under its live lease). `Remit.claim_at_head` takes with a
holder of its own per call, so this is a `Store` caller's that reuses a holder (as
`acquire_claim` invites: the same holder gets its claim back). Before: PostgreSQL's
take waited for that commit, then returned the head from before it, read in its
statement's snapshot: the holder started again from a head it had already moved
past (round 25 re-read the head only when the row named another holder). After: a
take whose snapshot shows the claim held by anyone reads the head again once the
claim is its own; a released claim's take is still one round trip (pinned below).

Held (the loop of round 25, taken as the same holder): the same holder's take
again on SQLite (the take and the head's read run under the store's lock, after
the commit) and Redis (scripts; a take between its
commit and its release keeps the fence); and on every engine, a lapsed holder's
commit, consume of an interrupt and effect intent racing a takeover at the head:
either the write landed and the new holder starts from it and finds it, or it was
refused as `Fenced` (the claim row, locked by the write, read at its newest version).
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import psycopg
import pytest
from conftest import PG_URL
from store_cuts import wait_blocked_by
from test_core_probes25 import LEASE, take
from test_store import chain, ckpt, pending

from remit_core import MAIN_BRANCH, Fenced, ResumeConflict, Store, open_store
from remit_core.records import Claim, EffectRecord, FenceRef, InterruptRecord
from remit_core.stores import postgres


def waiter_of(backend: int) -> int:
    """The PostgreSQL backend that waits for a lock `backend` holds (there is one)."""
    with psycopg.connect(PG_URL, autocommit=True) as admin:
        row = admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            (backend,),
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("shape", ["releasing", "lapsed", "live"])
def test_a_holders_take_that_waited_for_its_own_commit_starts_from_it(
    run_id: str, shape: str
) -> None:
    """The holder's commit (the store's own, in another thread) holds the claim row
    and waits on a branch row a raw transaction keeps locked; the same holder's take
    at the head then waits on the commit. Once the commit lands, the take must start
    from it: `releasing` gives the claim up with the commit, `lapsed` commits after
    its lease ran out, `live` commits under a live lease. Before: PostgreSQL returned
    c02, the head its take's snapshot read before the commit."""
    store = open_store(PG_URL)
    chain(store, run_id, 2)
    start = time.time() - 2 * LEASE if shape == "lapsed" else time.time()
    claim = store.acquire_claim(run_id, MAIN_BRANCH, "holder", now=start, lease=LEASE)
    failed: list[BaseException] = []
    taken: list[tuple[Claim, str | None]] = []

    def commit() -> None:
        try:
            store.commit_checkpoint(
                ckpt(run_id, "c03", "c02", seq=3),
                expected_head="c02",
                fence=FenceRef.of(claim),
                release=claim if shape == "releasing" else None,
            )
        except BaseException as exc:  # (reported below)
            failed.append(exc)

    with psycopg.connect(PG_URL) as lock:
        backend = lock.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        lock.execute(
            "SELECT 1 FROM remit_branches WHERE run_id = %s AND ns = '' AND branch = %s FOR UPDATE",
            (run_id, MAIN_BRANCH),
        )
        committer = threading.Thread(target=commit)
        committer.start()
        wait_blocked_by(backend, committer)
        assert committer.is_alive(), failed
        taker = threading.Thread(target=lambda: taken.append(take(store, run_id, "holder")))
        taker.start()
        wait_blocked_by(waiter_of(backend), taker)
        assert taker.is_alive(), taken  # it waited for the commit in flight
        lock.rollback()
        committer.join()
        taker.join()
    assert not failed, failed
    ((won, head),) = taken
    fence = claim.fence if shape == "live" else claim.fence + 1
    assert (won.holder, won.fence) == ("holder", fence)
    assert head == "c03"


def test_a_released_claims_take_at_the_head_is_one_statement(
    run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cost of reading the head again stays off the common path: a take of a
    claim released (or never taken) is one statement; a takeover of a lapsed lease
    is two."""
    store = open_store(PG_URL)
    chain(store, run_id, 2)
    real = postgres._PgTxn.execute
    statements: list[str] = []

    def counted(self: Any, sql: str, params: Any = ()) -> Any:
        statements.append(sql)
        return real(self, sql, params)

    monkeypatch.setattr(postgres._PgTxn, "execute", counted)
    first, head = take(store, run_id, "first")
    assert (first.fence, head, len(statements)) == (1, "c02", 1)
    store.release_claim(first)
    statements.clear()
    second, head = take(store, run_id, "second")
    assert (second.fence, head, len(statements)) == (2, "c02", 1)
    store.renew_claim(second, now=time.time() - 2 * LEASE, lease=LEASE)  # lapsed
    statements.clear()
    third, head = take(store, run_id, "third")
    assert (third.fence, head, len(statements)) == (3, "c02", 2)


def race(*calls: Any) -> list[Any]:
    """Run `calls` in threads that start together; each one's result or exception."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def lapsed(store: Store, run_id: str, holder: str) -> Claim:
    """A claim of `holder` whose lease has run out (its holder paused, or died)."""
    return store.acquire_claim(
        run_id, MAIN_BRANCH, holder, now=time.time() - 2 * LEASE, lease=LEASE
    )


@pytest.mark.parametrize("rounds", [20])
def test_a_lapsed_holders_commit_and_a_takeover_at_once_leave_one_story(
    store_url: str, run_id: str, rounds: int
) -> None:
    """Each round a holder whose lease lapsed commits the next checkpoint while
    another holder takes the run over at its head. In every interleaving one
    story holds: the commit landed and the takeover starts from it, or the commit
    was refused (`Fenced`) and the takeover starts from the head before it."""
    store = open_store(store_url)
    chain(store, run_id, 1)
    head = "c01"
    for i in range(2, rounds + 2):
        old = lapsed(store, run_id, f"old{i}")
        cid = f"c{i:02d}"
        committed, took = race(
            functools.partial(
                store.commit_checkpoint,
                ckpt(run_id, cid, head, seq=i),
                expected_head=head,
                fence=FenceRef.of(old),
            ),
            functools.partial(take, store, run_id, f"new{i}"),
        )
        claim, seen = took
        assert claim.fence == old.fence + 1
        if committed is None:
            assert seen == cid, f"round {i}: the commit landed; the takeover read {seen}"
            head = cid
        else:
            assert isinstance(committed, Fenced), committed
            assert seen == head, f"round {i}: refused commit, yet the takeover read {seen}"
        store.release_claim(claim)


def consume_as_successor(store: Store, run_id: str, iid: str, holder: str) -> InterruptRecord:
    """Take the run over at its head, consume `iid` under the new claim, give it up."""
    claim, _ = take(store, run_id, holder)
    try:
        return store.consume_interrupt(
            run_id, MAIN_BRANCH, iid, holder.encode(), consumer=holder,
            now=time.time(), fence=FenceRef.of(claim),
        )  # fmt: skip
    finally:
        store.release_claim(claim)


@pytest.mark.parametrize("rounds", [20])
def test_one_interrupt_consumed_by_a_lapsed_holder_and_its_successor_at_once(
    store_url: str, run_id: str, rounds: int
) -> None:
    """A lapsed holder consumes a pending interrupt while its successor takes the run
    over and consumes the same interrupt: exactly one value is stored, the value of
    the call that succeeded, and the lapsed holder never wins after the takeover."""
    store = open_store(store_url)
    chain(store, run_id, 1)
    for i in range(rounds):
        iid = f"i{i}"
        old = lapsed(store, run_id, f"old{i}")
        store.open_interrupts([pending(run_id, iid)], fence=FenceRef.of(old))
        first, second = race(
            functools.partial(
                store.consume_interrupt,
                run_id,
                MAIN_BRANCH,
                iid,
                b"old",
                consumer="old",
                now=time.time(),
                fence=FenceRef.of(old),
            ),  # fmt: skip
            functools.partial(consume_as_successor, store, run_id, iid, f"new{i}"),
        )
        stored = store.get_interrupt(run_id, MAIN_BRANCH, iid)
        assert stored is not None and stored.status == "consumed"
        wins = [r for r in (first, second) if not isinstance(r, Exception)]
        assert len(wins) == 1, (first, second)
        assert stored.value == wins[0].value
        assert isinstance(first, Fenced) or isinstance(second, ResumeConflict), (first, second)


def intent_as_successor(
    store: Store, run_id: str, key: str, holder: str
) -> tuple[EffectRecord, bool]:
    """Take the run over at its head, record `key`'s intent under the new claim, give it up."""
    claim, _ = take(store, run_id, holder)
    try:
        return store.begin_effect(run_id, key, holder, now=time.time(), fence=FenceRef.of(claim))
    finally:
        store.release_claim(claim)


@pytest.mark.parametrize("rounds", [20])
def test_an_effect_intent_by_a_lapsed_holder_and_its_successor_at_once_is_one_entry(
    store_url: str, run_id: str, rounds: int
) -> None:
    """A lapsed holder records an effect's intent while its successor takes over and
    records the same effect's: one entry, created by one of them; the lapsed holder's
    only if it came before the takeover (the successor then finds it)."""
    store = open_store(store_url)
    chain(store, run_id, 1)
    for i in range(rounds):
        key = f"s/charge#{i}"
        old = lapsed(store, run_id, f"old{i}")
        first, second = race(
            functools.partial(
                store.begin_effect, run_id, key, "old", now=time.time(), fence=FenceRef.of(old)
            ),
            functools.partial(intent_as_successor, store, run_id, key, f"new{i}"),
        )
        entry = store.get_effect(run_id, key)
        assert entry is not None
        assert isinstance(second, tuple), second  # the successor records the intent or finds it
        if isinstance(first, Fenced):
            assert second[1] and entry.idempotency_key == f"new{i}"
        else:
            assert first[1] and not second[1] and entry.idempotency_key == "old"
