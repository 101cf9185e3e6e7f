"""Round 29 of the core probes: a consume that stores writes in its own transaction.

`Remit.consume(..., writes=)` takes the interrupt and stores the writes a resume brings
beside its value (a LangGraph command's update and goto) as one act: both or neither,
on every engine, including a process SIGKILLed inside the consume. Real SQLite files,
PostgreSQL and Redis; real processes; no mocks."""

from __future__ import annotations

import multiprocessing as mp
import signal
import uuid
from typing import Any

import pytest

from remit_core import Remit, ResumeConflict, UnknownRecord, failpoints
from remit_core.records import WriteRecord

CTX = mp.get_context("fork")


def _paused(url: str) -> tuple[Remit, str]:
    remit = Remit(url)
    run_id = f"run-{uuid.uuid4().hex}"
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"{}")
    remit.open_interrupts(run_id, {"q": None}, checkpoint_id="c1")
    return remit, run_id


def _writes(run_id: str, *values: bytes, start: int = 0) -> list[WriteRecord]:
    return [
        WriteRecord(run_id, "c1", "null", start + i, "update", value)
        for i, value in enumerate(values)
    ]


def _stored(remit: Remit, run_id: str) -> dict[int, bytes]:
    return {w.idx: w.value for w in remit.writes(run_id, "c1")}


def test_the_value_and_the_writes_are_stored_together(store_url: str) -> None:
    remit, run_id = _paused(store_url)
    try:
        record = remit.consume(run_id, "q", b"yes", writes=_writes(run_id, b"a", b"b"))
        assert (record.status, record.value) == ("consumed", b"yes")
        assert _stored(remit, run_id) == {0: b"a", 1: b"b"}
    finally:
        remit.close()


def test_a_consume_refused_stores_none_of_its_writes(store_url: str) -> None:
    """Already consumed (ResumeConflict), or no such interrupt (UnknownRecord): the
    writes it brought are not stored."""
    remit, run_id = _paused(store_url)
    try:
        remit.consume(run_id, "q", b"first")
        with pytest.raises(ResumeConflict):
            remit.consume(run_id, "q", b"second", writes=_writes(run_id, b"late"))
        with pytest.raises(UnknownRecord):
            remit.consume(run_id, "nope", b"x", writes=_writes(run_id, b"stray"))
        assert _stored(remit, run_id) == {}
        assert remit.interrupt(run_id, "q").value == b"first"  # type: ignore[union-attr]
    finally:
        remit.close()


def test_a_taken_slot_keeps_its_value(store_url: str) -> None:
    """The writes are kept where their slots are taken ("first"): the slot stored
    before keeps its value, the new slot is stored."""
    remit, run_id = _paused(store_url)
    try:
        remit.put_writes(_writes(run_id, b"old"))
        remit.consume(run_id, "q", b"yes", writes=_writes(run_id, b"new", b"more"))
        assert _stored(remit, run_id) == {0: b"old", 1: b"more"}
    finally:
        remit.close()


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        (lambda run_id: _writes("run-other", b"x"), "run-other"),
        (lambda run_id: [WriteRecord(run_id, "", "t", 0, "c", b"v")], "checkpoint_id"),
        (lambda run_id: [WriteRecord(run_id, "c1", "t", 0, "c", "text")], "value"),
    ],
    ids=["another run", "no checkpoint id", "a str value"],
)
def test_a_refused_write_leaves_the_interrupt_pending(store_url: str, bad: Any, names: str) -> None:
    """A write the consume cannot store is refused, naming what was wrong, before
    anything is stored: the interrupt stays pending for the next resumer."""
    remit, run_id = _paused(store_url)
    try:
        with pytest.raises((ValueError, TypeError), match=names):
            remit.consume(run_id, "q", b"yes", writes=bad(run_id))
        assert remit.interrupt(run_id, "q").status == "pending"  # type: ignore[union-attr]
        assert _stored(remit, run_id) == {}
    finally:
        remit.close()


def test_a_failure_inside_the_consume_stores_neither(store_url: str) -> None:
    """An error raised inside the consume's transaction (after the writes were
    issued on a SQL engine): the interrupt stays pending and no write is stored."""
    remit, run_id = _paused(store_url)
    try:
        failpoints.arm("interrupt.in_consume", "raise")
        try:
            with pytest.raises(failpoints.FailpointHit):
                remit.consume(run_id, "q", b"yes", writes=_writes(run_id, b"a"))
        finally:
            failpoints.disarm("interrupt.in_consume")
        assert remit.interrupt(run_id, "q").status == "pending"  # type: ignore[union-attr]
        assert _stored(remit, run_id) == {}
        remit.consume(run_id, "q", b"yes", writes=_writes(run_id, b"a"))
        assert _stored(remit, run_id) == {0: b"a"}
    finally:
        remit.close()


@pytest.mark.parametrize("point", ["interrupt.in_consume", "interrupt.after_consume"])
def test_a_process_killed_in_or_after_the_consume_left_both_or_neither(
    store_url: str, point: str
) -> None:
    remit, run_id = _paused(store_url)
    remit.close()

    def doomed() -> None:
        failpoints.arm(point, "kill")
        Remit(store_url).consume(run_id, "q", b"yes", writes=_writes(run_id, b"a", b"b"))

    proc = CTX.Process(target=doomed)
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    remit = Remit(store_url)
    try:
        status = remit.interrupt(run_id, "q").status  # type: ignore[union-attr]
        stored = _stored(remit, run_id)
        assert (status, stored) in [("pending", {}), ("consumed", {0: b"a", 1: b"b"})]
        assert status == ("pending" if point == "interrupt.in_consume" else "consumed")
    finally:
        remit.close()
