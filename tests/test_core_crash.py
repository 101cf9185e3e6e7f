"""SIGKILL at every failpoint of a checkpoint commit and of the effect API, then recover.

A forked child arms one failpoint with `kill` and runs the operation; it dies
by a real SIGKILL at that point. A recovery in a fresh process then replays
the same operation. Whatever the point and the engine, the store ends with
exactly one commit, and the effect sink with exactly one application (or,
for an effect with neither `reconcile` nor `idempotent` that was left in
doubt, with `EffectInDoubt` and still at most one application).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from remit_core import (
    NOT_APPLIED,
    EffectInDoubt,
    ForkWithoutIntent,
    Remit,
    failpoints,
    open_store,
    run_effect,
    step_scope,
)
from remit_core.records import WriteRecord


def in_child(fn: Callable[[], Any]) -> tuple[int | None, Any]:
    """Run `fn` in a forked process; returns (killing signal or None, fn's JSON result)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        os.close(read_end)
        try:
            out: dict[str, Any] = {"ok": fn()}
        except BaseException as exc:
            out = {"error": type(exc).__name__, "message": str(exc)}
        os.write(write_end, json.dumps(out).encode())
        os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    signum = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return signum, json.loads(b"".join(chunks)) if chunks else None


class Sink:
    """The outside world: an SQLite file that counts every application of an effect.

    Like a payment API it answers "did key K happen?", and ignores a repeated
    idempotency key when the caller asks it to deduplicate.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._conn() as conn:
            conn.execute(
                "CREATE TABLE IF NOT EXISTS calls (key TEXT NOT NULL, applied INTEGER NOT NULL)"
            )

    def _conn(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, isolation_level=None, timeout=30)

    def apply(self, key: str, *, dedup: bool) -> str:
        with self._conn() as conn:
            applied = not (dedup and self.applications(key))
            conn.execute("INSERT INTO calls (key, applied) VALUES (?, ?)", (key, int(applied)))
        return f"receipt-{key[:12]}"

    def applications(self, key: str | None = None) -> int:
        with self._conn() as conn:
            sql = "SELECT COUNT(*) FROM calls WHERE applied = 1"
            row = conn.execute(sql + " AND key = ?", (key,)) if key else conn.execute(sql)
            return int(row.fetchone()[0])

    def attempts(self) -> list[str]:
        with self._conn() as conn:
            return [r[0] for r in conn.execute("SELECT key FROM calls").fetchall()]

    def reconcile(self, key: str) -> Any:
        return f"receipt-{key[:12]}" if self.applications(key) else NOT_APPLIED


# -- checkpoint commit ---------------------------------------------------------------

COMMIT_POINTS = ["checkpoint.before_commit", "checkpoint.in_commit", "checkpoint.after_commit"]


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_sigkill_during_commit_then_recovery_commits_once(
    store_url: str, run_id: str, point: str
) -> None:
    open_store(store_url)  # set up before forking
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c01", parent_id=None, state=b"first")

    def step(checkpoint_id: str) -> str:
        """The step after c01, as a resumer runs it: commit its output after c01."""
        r = Remit(store_url)
        try:
            r.commit(run_id=run_id, checkpoint_id=checkpoint_id, parent_id="c01", state=b"second")
        except ForkWithoutIntent:
            return "already committed"
        return "committed"

    def crash() -> str:
        failpoints.arm(point, "kill")
        return step("c02")

    signum, out = in_child(crash)
    assert (signum, out) == (signal.SIGKILL, None)
    landed = point == "checkpoint.after_commit"
    head = remit.head(run_id)
    assert head is not None and head.checkpoint_id == ("c02" if landed else "c01")

    # Two recoveries in new processes replay the step (with a fresh checkpoint id, as a
    # re-executed step would); only one commit after c01 may ever exist.
    first = in_child(lambda: step("c02-recovered"))
    second = in_child(lambda: step("c02-again"))
    assert first == (None, {"ok": "already committed" if landed else "committed"})
    assert second == (None, {"ok": "already committed"})
    children = [c for c in remit.history(run_id) if c.parent_id == "c01"]
    assert len(children) == 1
    head = remit.head(run_id)
    assert head is not None and head.checkpoint_id == children[0].checkpoint_id
    assert head.state == b"second"
    assert [b.branch for b in remit.branches(run_id)] == ["main"]


# -- the effect API ------------------------------------------------------------------

EFFECT_POINTS = [
    "effect.before_intent",
    "effect.after_intent",
    "effect.after_apply",
    "effect.in_outcome",
    "effect.after_outcome",
]
#: Whether the sink saw the effect before the kill, and what the ledger then holds.
AFTER_CRASH = {
    "effect.before_intent": (0, None),
    "effect.after_intent": (0, "intent"),
    "effect.after_apply": (1, "intent"),
    "effect.in_outcome": (1, "intent"),
    "effect.after_outcome": (1, "done"),
}


def charge(store_url: str, run_id: str, sink: Sink, mode: str) -> str:
    """The probe's `charge` step: one effect, declared per `mode`."""
    remit = Remit(store_url)
    with step_scope(remit, run_id, "charge"):
        result = run_effect(
            "charge",
            lambda key: sink.apply(key, dedup=mode == "idempotent"),
            reconcile=sink.reconcile if mode == "reconcile" else None,
            idempotent=mode == "idempotent",
        )
    return str(result)


@pytest.mark.parametrize("mode", ["reconcile", "idempotent", "neither"])
@pytest.mark.parametrize("point", EFFECT_POINTS)
def test_sigkill_in_effect_then_recovery_applies_once(
    store_url: str, run_id: str, tmp_path: Path, point: str, mode: str
) -> None:
    open_store(store_url)
    remit = Remit(store_url)
    sink = Sink(tmp_path / "sink.db")

    def crash() -> str:
        failpoints.arm(point, "kill")
        return charge(store_url, run_id, sink, mode)

    signum, out = in_child(crash)
    assert (signum, out) == (signal.SIGKILL, None)
    applied_before, ledger_status = AFTER_CRASH[point]
    assert sink.applications() == applied_before
    entry = remit.store.get_effect(run_id, "charge/charge#0")
    assert (None if entry is None else entry.status) == ledger_status

    signum, first = in_child(lambda: charge(store_url, run_id, sink, mode))
    assert signum is None
    in_doubt = mode == "neither" and ledger_status == "intent"
    if in_doubt:
        # Neither reconcile nor idempotent: refuse rather than risk a second application.
        assert first["error"] == EffectInDoubt.__name__
        assert run_id in first["message"] and "charge/charge#0" in first["message"]
        assert sink.applications() == applied_before
        entry = remit.store.get_effect(run_id, "charge/charge#0")
        assert entry is not None and entry.status == "intent"
        return
    assert sink.applications() == 1
    keys = sink.attempts()
    assert len(set(keys)) == 1  # every attempt carried the same idempotency key
    assert first["ok"] == f"receipt-{keys[0][:12]}"
    # A further recovery returns the recorded outcome without touching the sink.
    attempts = len(keys)
    signum, again = in_child(lambda: charge(store_url, run_id, sink, mode))
    assert (signum, again) == (None, first)
    assert len(sink.attempts()) == attempts
    entry = remit.store.get_effect(run_id, "charge/charge#0")
    assert entry is not None and entry.status == "done" and entry.idempotency_key == keys[0]


# -- a stopped process ---------------------------------------------------------------


def test_a_stop_lets_another_threads_sqlite_write_finish_first(tmp_path: Path) -> None:
    """A process stopped at a point (the zombie of the L2 tests) is stopped between
    statements: another of its threads inside an SQLite write (a lease renewal, say)
    commits first, so other processes can write to the file while it is stopped."""
    url = f"sqlite:///{tmp_path / 'remit.db'}"
    store = open_store(url)
    first = WriteRecord("run", "ckpt", "task", 0, "channel", b"first")
    pid = os.fork()
    if pid == 0:  # the zombie: a writer thread in its transaction, this thread stops
        try:
            # expect_absent writes in a transaction, and the point is inside it.
            failpoints.arm("writes.in_txn", "sleep:1.0")
            failpoints.arm("step.before", "stop")
            writer = threading.Thread(
                target=store.put_writes, args=([first],), kwargs={"mode": "expect_absent"}
            )
            writer.start()
            time.sleep(0.3)
            failpoints.hit("step.before")
            writer.join()
        finally:
            os._exit(0)
    try:
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        other = open_store(url + "?busy_timeout=500")
        other.put_writes(
            [WriteRecord("run", "ckpt", "task", 1, "channel", b"second")], mode="first"
        )
        assert [w.value for w in other.get_writes("run", "", "ckpt")] == [b"first", b"second"]
    finally:
        os.kill(pid, signal.SIGCONT)
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
