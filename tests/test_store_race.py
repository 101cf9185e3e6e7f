"""Consume-once under a real race (P5): 16 OS processes, one interrupt, 20 rounds.

Workers are forked from the test process, open their own store connections,
and meet at a barrier before every round so that they really race. The same
harness run with a deliberately non-atomic claim (a read, then a write in a
second transaction) must see several winners in some round: the test can fail.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

from remit_core import MAIN_BRANCH, Remit, ResumeConflict, Store, codec, open_store

WORKERS = 16
ROUNDS = 20

Claimer = Callable[[Remit, str, str, bytes], None]


def atomic_claim(remit: Remit, run_id: str, interrupt_id: str, value: bytes) -> None:
    """The real thing: one atomic consume in the store."""
    remit.consume(run_id, interrupt_id, value)


def naive_claim(remit: Remit, run_id: str, interrupt_id: str, value: bytes) -> None:
    """Test-only and wrong on purpose: check, pause, then write in a second transaction."""
    store = remit.store
    current = store.get_interrupt(run_id, MAIN_BRANCH, interrupt_id)
    if current is None or current.status != "pending":
        raise ResumeConflict("already consumed", run_id=run_id, interrupt_id=interrupt_id)
    time.sleep(0.002)
    sealed = codec.seal(value, f"value\x00{MAIN_BRANCH}\x00{interrupt_id}")
    if store.url.startswith("redis"):
        naive_write_redis(store, run_id, interrupt_id, sealed)
        return
    with store._txn() as txn:  # type: ignore[attr-defined]
        txn.execute(
            "UPDATE remit_interrupts SET status = 'consumed', value = ?, consumed_by = ? "
            "WHERE run_id = ? AND branch = ? AND interrupt_id = ?",
            (sealed, remit.holder, run_id, MAIN_BRANCH, interrupt_id),
        )


def naive_write_redis(store: Store, run_id: str, interrupt_id: str, sealed: bytes) -> None:
    # Layout (see remit_core.stores.redis): hash remit:{run}:in, fields
    # "branch NUL interrupt NUL column"; a plain HSET, no script, no check.
    from remit_core.stores.redis import run_prefix

    member = f"{MAIN_BRANCH}\x00{interrupt_id}\x00"
    store._client().hset(  # type: ignore[attr-defined]
        run_prefix(run_id) + "in", mapping={member + "s": "consumed", member + "v": sealed}
    )


def _worker(url: str, run_id: str, idx: int, barrier: Any, results: Any, claimer: Claimer) -> None:
    remit = Remit(url)
    for rnd in range(ROUNDS):
        barrier.wait(timeout=60)
        try:
            claimer(remit, run_id, f"i{rnd:02d}", f"worker-{idx}".encode())
            results.put((rnd, idx, True))
        except ResumeConflict:
            results.put((rnd, idx, False))


def race(url: str, run_id: str, claimer: Claimer) -> dict[int, list[int]]:
    """Run the rounds; return, per round, the workers that believed they won."""
    remit = Remit(open_store(url))
    remit.open_interrupts(run_id, {f"i{r:02d}": None for r in range(ROUNDS)})
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(url, run_id, i, barrier, results, claimer))
        for i in range(WORKERS)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(WORKERS * ROUNDS)]
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * WORKERS
    winners: dict[int, list[int]] = {r: [] for r in range(ROUNDS)}
    for rnd, idx, won in outcomes:
        if won:
            winners[rnd].append(idx)
    return winners


def test_sixteen_processes_one_winner_every_round(store_url: str, run_id: str) -> None:
    winners = race(store_url, run_id, atomic_claim)
    assert {r: len(w) for r, w in winners.items()} == {r: 1 for r in range(ROUNDS)}
    # The stored value is the one acknowledged to the single winner.
    remit = Remit(store_url)
    for rnd, (idx,) in winners.items():
        stored = remit.interrupt(run_id, f"i{rnd:02d}")
        assert stored is not None and stored.value == f"worker-{idx}".encode()


def test_non_atomic_claim_is_caught(store_url: str, run_id: str) -> None:
    winners = race(store_url, run_id, naive_claim)
    assert max(len(w) for w in winners.values()) > 1


def test_processes_opening_a_new_sqlite_file_together_all_succeed(tmp_path: Any) -> None:
    """Turning a new file to WAL is not covered by SQLite's busy timeout; the store
    retries it, so no process fails with "database is locked" at start."""
    from remit_core.conformance.processes import Barrier, fork
    from remit_core.stores.sqlite import SQLiteStore

    for rnd in range(30):
        url = f"sqlite:///{tmp_path}/fresh-{rnd}.db"
        barrier = Barrier(8)

        def body(url: str = url, barrier: Barrier = barrier) -> int:
            barrier.wait()
            store = SQLiteStore(url)  # a new file: each process sets it up
            store.setup()
            return store.acquire_claim("r", "main", "h", now=1.0, lease=1.0).fence

        workers = [fork(body, barrier=barrier) for _ in range(8)]
        barrier.release(30)
        outcomes = [w.wait(60) for w in workers]
        failed = [o.error["message"] for o in outcomes if not o.ok]  # type: ignore[index]
        assert not failed, f"round {rnd}: {failed}"


def test_a_fork_while_other_threads_are_inside_sqlite_leaves_the_child_usable(
    tmp_path: Any,
) -> None:
    """Threads mid-statement at a fork (lease renewals, say) would leave SQLite's
    process-wide mutexes locked in the child, whose first open would hang (seen:
    about 1 fork in 100 without the store's fork hooks); the store holds forks
    until its statements are done."""
    import threading

    from remit_core.conformance.processes import fork
    from remit_core.stores.sqlite import SQLiteStore

    busy = SQLiteStore(f"sqlite:///{tmp_path}/busy.db")
    busy.setup()
    stop = threading.Event()

    def hammer(me: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            busy.acquire_claim(f"r{me}-{n % 50}", "main", "h", now=1.0, lease=1.0)

    threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        for i in range(400):

            def child(i: int = i) -> int:
                fresh = SQLiteStore(f"sqlite:///{tmp_path}/child-{i}.db")
                fresh.setup()
                return fresh.acquire_claim("r", "main", "h", now=1.0, lease=1.0).fence

            outcome = fork(child).wait(10)
            assert outcome.ok, f"fork {i}: {outcome.summary()}"
    finally:
        stop.set()
        for thread in threads:
            thread.join(5)
