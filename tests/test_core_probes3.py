"""Probes of the core's public API as an outside caller writes them from CONTRACT.md.

Every public `Remit` call refuses a bad argument before the store is asked, with
the same error class on SQLite, PostgreSQL and Redis, naming the argument, and
writes nothing (read back from the store). Malformed tagged values read back
as `ValueError` (`CorruptRecord` in stored metadata), never as whatever the
decoder tripped on. Callers of one effect in several processes apply it once.
"""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import engine_url

from remit_core import (
    MAIN_BRANCH,
    CorruptRecord,
    EffectInDoubt,
    Fenced,
    Remit,
    WriteRecord,
    codec,
    run_effect,
    step_scope,
)

# -- bad arguments ---------------------------------------------------------------

Call = Callable[[Remit, str], Any]


def _write(run_id: str, **fields: Any) -> WriteRecord:
    base: dict[str, Any] = {
        "run_id": run_id,
        "checkpoint_id": "c1",
        "task_id": "t",
        "idx": 0,
        "channel": "ch",
        "value": b"v",
    }
    return WriteRecord(**{**base, **fields})


def _commit(**fields: Any) -> Call:
    def call(remit: Remit, run_id: str) -> Any:
        base = {"run_id": run_id, "checkpoint_id": "c2", "parent_id": "c1", "state": b"s"}
        return remit.commit(**{**base, **fields})

    return call


#: (call, what the error names, class); each call is otherwise valid.
BAD_CALLS: dict[str, tuple[Call, str, type[Exception]]] = {
    "checkpoint ns": (lambda r, run: r.checkpoint(run, "c1", ns=None), "ns", TypeError),
    "checkpoint_and_writes run": (
        lambda r, run: r.checkpoint_and_writes(1, "c1"),
        "run_id",
        TypeError,
    ),
    "branch name": (lambda r, run: r.branch(run, branch=""), "branch", ValueError),
    "branches run": (lambda r, run: r.branches(None), "run_id", TypeError),
    "head branch": (lambda r, run: r.head(run, branch=b"main"), "branch", TypeError),
    "head ns": (lambda r, run: r.head(run, ns="a\x00b"), "ns", ValueError),
    "fork_branch token": (lambda r, run: r.fork_branch(run, None), "fork_token", TypeError),
    "history ns": (lambda r, run: r.history(run, ns=7), "ns", TypeError),
    "history before": (lambda r, run: r.history(run, before_id=b"c9"), "before_id", TypeError),
    "history limit": (lambda r, run: r.history(run, limit=True), "limit", TypeError),
    "blobs key": (lambda r, run: r.blobs(run, [None]), "blob key", TypeError),
    "writes checkpoint": (lambda r, run: r.writes(run, None), "checkpoint_id", TypeError),
    "writes after_idx": (lambda r, run: r.writes(run, "c1", after_idx="1"), "after_idx", TypeError),
    "put_writes task": (
        lambda r, run: r.put_writes([_write(run, task_id=None)]),
        "task_id",
        TypeError,
    ),
    "put_writes channel": (
        lambda r, run: r.put_writes([_write(run, channel=1)]),
        "channel",
        TypeError,
    ),
    "put_writes idx": (lambda r, run: r.put_writes([_write(run, idx="0")]), "idx", TypeError),
    "put_writes idx range": (
        lambda r, run: r.put_writes([_write(run, idx=2**40)]),
        "idx",
        ValueError,
    ),
    "put_writes value": (lambda r, run: r.put_writes([_write(run, value="v")]), "value", TypeError),
    "put_writes mode": (
        lambda r, run: r.put_writes([_write(run)], mode="bogus"),
        "mode",
        ValueError,
    ),
    "open_interrupts branch": (
        lambda r, run: r.open_interrupts(run, {"i2": None}, branch=None),
        "branch",
        TypeError,
    ),
    "open_interrupts checkpoint": (
        lambda r, run: r.open_interrupts(run, {"i2": None}, checkpoint_id=""),
        "checkpoint_id",
        ValueError,
    ),
    "open_interrupts prompt": (
        lambda r, run: r.open_interrupts(run, {"i2": "ask"}),
        "prompt",
        TypeError,
    ),
    "open_interrupts list": (
        lambda r, run: r.open_interrupts(run, ["i2"]),
        "interrupts",
        TypeError,
    ),
    "consume branch": (lambda r, run: r.consume(run, "i1", b"v", branch=1), "branch", TypeError),
    "consume value": (lambda r, run: r.consume(run, "i1", "v"), "value", TypeError),
    "interrupt id": (lambda r, run: r.interrupt(run, None), "interrupt_id", TypeError),
    "interrupts branch": (lambda r, run: r.interrupts(run, branch=""), "branch", ValueError),
    "claim holder": (lambda r, run: r.claim(run, holder=123), "holder", TypeError),
    "claim_at_head ns": (lambda r, run: r.claim_at_head(run, ns=None), "ns", TypeError),
    "delete_checkpoints id": (
        lambda r, run: r.delete_checkpoints(run, "", ["c1", None]),
        "checkpoint_id",
        TypeError,
    ),
    "delete_checkpoints run": (
        lambda r, run: r.delete_checkpoints(None, "", ["c1"]),
        "run_id",
        TypeError,
    ),
    "prune keep_last": (lambda r, run: r.prune([run], keep_last="1"), "keep_last", TypeError),
    "commit state": (_commit(state="s"), "state", TypeError),
    "commit schema_version str": (_commit(schema_version="2"), "schema_version", TypeError),
    "commit schema_version None": (_commit(schema_version=None), "schema_version", TypeError),
    "commit schema_version bool": (_commit(schema_version=True), "schema_version", TypeError),
    "commit schema_version range": (_commit(schema_version=-1), "schema_version", ValueError),
    "commit blob key": (_commit(blobs={None: b"v"}), "blob key", TypeError),
    "commit blob value": (_commit(blobs={"k": "v"}), "blob value", TypeError),
    "commit write": (
        _commit(writes=[WriteRecord("r", "c2", "t", 0, "ch", b"v", ns=None)]),
        "ns",
        TypeError,
    ),  # type: ignore[arg-type]
    "plan parent": (lambda r, run: r.plan(run, ""), "parent_id", ValueError),
    # A lone surrogate has no UTF-8 form: no engine can store it.
    "commit checkpoint surrogate": (_commit(checkpoint_id="c\ud800"), "checkpoint_id", ValueError),
    "commit token surrogate": (_commit(fork_token="t\udfff"), "fork_token", ValueError),
    "claim run surrogate": (lambda r, run: r.claim(run + "\udc80"), "run_id", ValueError),
    "head branch surrogate": (lambda r, run: r.head(run, branch="m\ud800"), "branch", ValueError),
}


def _snapshot(remit: Remit, run_id: str) -> tuple[Any, ...]:
    """Everything a run holds, read back from the store."""
    s = remit.store
    return (
        [(c.checkpoint_id, c.branch, c.schema_version) for c in s.list_checkpoints(run_id, None)],
        [(b.branch, b.head_id) for b in s.list_branches(run_id, None)],
        [(i.interrupt_id, i.branch, i.status) for i in s.list_interrupts(run_id)],
        s.get_writes(run_id, "", "c1"),
        s.get_claim(run_id, MAIN_BRANCH),
        s.get_blobs(run_id, "", ["k"]),
    )


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_a_bad_argument_is_refused_alike_on_every_engine_and_nothing_is_written(
    store_url: str, run_id: str, name: str
) -> None:
    call, names, error = BAD_CALLS[name]
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    remit.open_interrupts(run_id, {"i1": None}, checkpoint_id="c1")
    before = _snapshot(remit, run_id)
    with pytest.raises(error, match=names):
        call(remit, run_id)
    assert _snapshot(remit, run_id) == before


def test_an_effect_with_a_bad_key_or_run_is_refused_before_the_ledger(
    store_url: str, run_id: str
) -> None:
    remit = Remit(store_url)
    applied: list[str] = []
    with step_scope(remit, run_id, "s"), pytest.raises(TypeError, match="effect key"):
        run_effect("e", applied.append, key=5)  # type: ignore[arg-type]
    with step_scope(remit, None, "s"), pytest.raises(TypeError, match="run_id"):  # type: ignore[arg-type]
        run_effect("e", applied.append)
    assert applied == [] and remit.store.get_effect(run_id, "5") is None


def test_a_fence_of_another_run_is_refused_and_nothing_is_written(
    store_url: str, run_id: str
) -> None:
    """A claim fences its own run's writes: presented for another run (whose claim
    it does not hold), a commit, writes, interrupts, a consume and an effect are
    refused before the store is asked."""
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    remit.open_interrupts(run_id, {"i1": None}, checkpoint_id="c1")
    other = remit.claim(f"{run_id}-other", heartbeat=False)
    fence = other.fence
    before = _snapshot(remit, run_id)
    applied: list[str] = []
    refused: list[Call] = [
        _commit(fence=fence),
        lambda r, run: r.put_writes([_write(run)], fence=fence),
        lambda r, run: r.open_interrupts(run, {"i2": None}, fence=fence),
        lambda r, run: r.consume(run, "i1", b"v", fence=fence),
    ]
    for call in refused:
        with pytest.raises(Fenced, match="fence of run"):
            call(remit, run_id)
    with step_scope(remit, run_id, "s", fence=fence), pytest.raises(Fenced):
        run_effect("e", applied.append)
    assert applied == [] and remit.store.get_effect(run_id, "s/e#0") is None
    assert _snapshot(remit, run_id) == before
    other.release()


def test_writes_of_another_run_ride_with_the_fenced_runs_own(store_url: str, run_id: str) -> None:
    """A fence guards its run's writes; another run's writes in the same call are
    written with them while the claim holds, and with them refused once it is lost."""
    remit = Remit(store_url)
    index = f"{run_id}-index"
    claim = remit.claim(run_id, heartbeat=False)
    both = [_write(run_id, checkpoint_id="h"), _write(index, checkpoint_id="h")]
    remit.put_writes(both, mode="overwrite", fence=claim.fence)
    remit.put_writes([], fence=claim.fence)  # (nothing to guard: nothing refused)
    assert [len(remit.writes(r, "h")) for r in (run_id, index)] == [1, 1]
    stale = claim.fence
    claim.release()
    remit.claim(run_id, heartbeat=False)  # another holder: the old fence is stale
    moved = [_write(run_id, checkpoint_id="h2"), _write(index, checkpoint_id="h2")]
    with pytest.raises(Fenced):
        remit.put_writes(moved, mode="overwrite", fence=stale)
    assert [remit.writes(r, "h2") for r in (run_id, index)] == [[], []]


# -- malformed tagged values -------------------------------------------------------------

MALFORMED = [
    b'{"$remit":"tuple","v":5}',
    b'{"$remit":"timedelta","v":"x"}',
    b'{"$remit":"bytes","v":"!!"}',
    b'{"$remit":"decimal","v":"abc"}',
    b'{"$remit":"dict","v":[1]}',
    b'{"$remit":"datetime","v":5}',
    b'{"$remit":"uuid","v":[]}',
    b'{"$remit":"frozenset","v":[{"a":1}]}',
]


@pytest.mark.parametrize("data", MALFORMED)
def test_a_tagged_value_of_the_wrong_shape_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match="malformed|base64"):
        codec.loads(data)


@pytest.mark.parametrize("engine", ["sqlite", "postgresql"])
def test_stored_metadata_with_a_malformed_tag_is_corrupt_record(
    engine: str, run_id: str, tmp_path: Path
) -> None:
    remit = Remit(engine_url(engine, tmp_path))
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    with remit.store._txn() as txn:  # type: ignore[attr-defined]
        txn.execute(
            "UPDATE remit_checkpoints SET metadata = ? WHERE run_id = ?",
            ('{"$remit":"tuple","v":5}', run_id),
        )
    with pytest.raises(CorruptRecord) as err:
        remit.history(run_id)
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c1")


# -- one effect, callers in several processes -----------------------------------------


def _sink(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("CREATE TABLE IF NOT EXISTS calls (key TEXT NOT NULL)")
    return conn


def _effect_caller(url: str, run_id: str, sink: Path, barrier: Any, results: Any) -> None:
    remit = Remit(url)

    def charge(key: str) -> str:
        with _sink(sink) as conn:
            conn.execute("INSERT INTO calls (key) VALUES (?)", (key,))
        return f"receipt-{key[:8]}"

    barrier.wait(timeout=60)
    try:
        with step_scope(remit, run_id, "charge"):
            results.put(run_effect("charge", charge, key="order-1"))
    except EffectInDoubt:
        results.put("in doubt")


def test_callers_of_one_effect_key_in_several_processes_apply_it_once(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """No claim, no reconcile, not idempotent: the first caller applies it; each
    other one gets its recorded outcome or `EffectInDoubt`, never a second apply."""
    sink = tmp_path / "sink.db"
    _sink(sink).close()
    Remit(store_url)  # sets the store up before the race
    ctx = mp.get_context("fork")
    k = 4
    barrier, results = ctx.Barrier(k), ctx.Queue()
    procs = [
        ctx.Process(target=_effect_caller, args=(store_url, run_id, sink, barrier, results))
        for _ in range(k)
    ]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in range(k)]
    for p in procs:
        p.join(timeout=30)
    assert [p.exitcode for p in procs] == [0] * k
    with _sink(sink) as conn:
        keys = [row[0] for row in conn.execute("SELECT key FROM calls")]
    assert len(keys) == 1
    receipt = f"receipt-{keys[0][:8]}"
    assert receipt in outcomes and set(outcomes) <= {receipt, "in doubt"}


def test_a_claim_handed_to_the_lease_keeper_is_released_at_its_next_beat(
    store_url: str, run_id: str
) -> None:
    """`release_soon` (what a finalizer may call: no lock, no round trip) has the
    lease keeper release the claim at its next beat, well before the lease runs out;
    the holder's own release afterwards is free, and the run can be claimed again."""
    remit = Remit(store_url, lease=0.9)
    handle = remit.claim(run_id)
    taken = remit.store.get_claim(run_id, "main")
    assert taken is not None and taken.holder == handle.claim.holder
    handle.release_soon()
    deadline = time.monotonic() + 0.8  # (a beat is a third of the lease: 0.3 s)
    # (the handle counts as given up before the store's release returns: wait for both)
    after = remit.store.get_claim(run_id, "main")
    while (not handle.released or after is None or after.holder) and (time.monotonic() < deadline):
        time.sleep(0.02)
        after = remit.store.get_claim(run_id, "main")
    assert handle.released, "the lease keeper did not release the claim"
    assert after is not None and after.holder == "", "the store still holds the claim"
    assert remit.clock() < taken.expires_at  # released, not expired
    handle.release()  # (a second release makes no round trip)
    remit.claim(run_id, heartbeat=False).release()
