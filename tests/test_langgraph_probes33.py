"""RemitSaver keeps a datetime's and a time's `fold` (the second of a repeated local
hour): in a graph's state, in a model's field, in a pending write, in an interrupt's
value and in a resume value, read back in another process after the writer was
killed with SIGKILL or exited; through a `with_allowlist` clone and the async API
too. A value with fold=0 is stored as LangGraph stores it. Real LangGraph, real
stores, real processes; no mocks."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import multiprocessing as mp
import operator
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Annotated, Any
from zoneinfo import ZoneInfo

import pytest
from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.graph import END, START, StateGraph
from langgraph.types import Command, interrupt
from pydantic import BaseModel
from typing_extensions import TypedDict

from remit_core import CorruptRecord
from remit_langgraph import RemitSaver

LEASE = 1.0
CTX = mp.get_context("fork")
BERLIN = ZoneInfo("Europe/Berlin")
#: 2026-10-25 02:30 in Berlin happens twice; fold=1 is the second time (UTC+1).
NAIVE_LATE = dt.datetime(2026, 10, 25, 2, 30, fold=1)
NAIVE_EARLY = dt.datetime(2026, 10, 25, 2, 30)
BERLIN_LATE = dt.datetime(2026, 10, 25, 2, 30, 15, 500, fold=1, tzinfo=BERLIN)
UTC_LATE = dt.datetime(2026, 10, 25, 1, 30, fold=1, tzinfo=dt.timezone.utc)
#: What `fromtimestamp` gives in the repeated hour, made naive: fold=1.
LOCAL_LATE = dt.datetime.fromtimestamp(1792891800, BERLIN).replace(tzinfo=None)
CLOCK_LATE = dt.time(2, 30, fold=1)
CLOCK_ZONED = dt.time(2, 30, fold=1, tzinfo=dt.timezone(dt.timedelta(hours=1)))


class Slot(BaseModel):
    at: dt.datetime
    clock: dt.time


@dataclasses.dataclass
class Stamp:
    at: dt.datetime
    when: list[dt.datetime]


class Plan(TypedDict):
    at: dt.datetime
    slot: Slot
    seen: Annotated[list[Any], operator.add]


class Loose(TypedDict):
    extra: Any
    seen: Annotated[list[Any], operator.add]


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": f"lg33-{uuid.uuid4().hex}"}}


def folds(value: Any) -> list[tuple[str, int, Any]]:
    """Each datetime and time in `value` (containers, models, dataclasses walked): its
    repr, its fold and its UTC offset, in order (`==` ignores a naive value's fold)."""
    if isinstance(value, (dt.datetime, dt.time)):
        return [(repr(value), value.fold, value.utcoffset())]
    if isinstance(value, BaseModel):
        value = dict(value)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return [f for k in sorted(value) for f in folds(value[k])]
    if isinstance(value, (list, tuple)):
        return [f for v in value for f in folds(v)]
    return []


def same(got: Any, expected: Any) -> None:
    assert got == expected
    assert folds(got) == folds(expected)


STATE_IN: dict[str, Any] = {
    "at": NAIVE_LATE,
    "slot": Slot(at=BERLIN_LATE, clock=CLOCK_LATE),
    "seen": [],
}
STAMPED = [LOCAL_LATE, NAIVE_EARLY, UTC_LATE, Slot(at=NAIVE_LATE, clock=CLOCK_ZONED)]
QUESTION = {"at": BERLIN_LATE, "clock": CLOCK_LATE, "early": NAIVE_EARLY}
ANSWER = {"at": NAIVE_LATE, "zoned": BERLIN_LATE, "clock": CLOCK_ZONED}


def planning(saver: Any) -> Any:
    """stamp and ask run side by side from START: stamp writes its datetimes (a pending
    write once ask pauses); ask asks with a datetime and keeps the answer."""

    def stamp(state: Plan) -> dict[str, Any]:
        return {"seen": [["stamp", STAMPED]]}

    def ask(state: Plan) -> dict[str, Any]:
        answer = interrupt(QUESTION)
        return {"seen": [["ask", answer]]}

    builder = StateGraph(Plan)
    builder.add_node("stamp", stamp)
    builder.add_node("ask", ask)
    builder.add_edge(START, "stamp")
    builder.add_edge(START, "ask")
    builder.add_edge("stamp", END)
    builder.add_edge("ask", END)
    return builder.compile(checkpointer=saver)


def in_child(fn: Any, *, exitcode: int) -> None:
    proc = CTX.Process(target=fn)
    proc.start()
    proc.join(120)
    assert proc.exitcode == exitcode
    if exitcode == -signal.SIGKILL:
        time.sleep(LEASE + 0.2)  # a claim the dead process held runs out (L1)


@pytest.mark.parametrize("durability", ["sync", "async"])
def test_folds_survive_a_pause_killed_and_a_resume_in_another_process(
    url: str, durability: str
) -> None:
    """The state, a model in it, the pending write of a finished branch and the
    question, written by a process then killed with SIGKILL, read back in another with
    each datetime's and time's fold (and so its UTC offset) as written; the answer,
    given by a third process that exits, reads back with its folds too."""
    assert LOCAL_LATE.fold == 1
    cfg = config()

    def pause() -> None:
        saver = RemitSaver(url, lease=LEASE)
        planning(saver).invoke(STATE_IN, cfg, durability=durability)
        os.kill(os.getpid(), signal.SIGKILL)

    def resume() -> None:
        saver = RemitSaver(url, lease=LEASE)
        try:
            planning(saver).invoke(Command(resume=ANSWER), cfg, durability=durability)
        finally:
            saver.remit.close()

    in_child(pause, exitcode=-signal.SIGKILL)
    saver = RemitSaver(url, lease=LEASE)
    try:
        graph = planning(saver)
        paused = graph.get_state(cfg)
        same(paused.values["at"], NAIVE_LATE)
        same(paused.values["slot"], STATE_IN["slot"])
        same([i.value for i in paused.interrupts], [QUESTION])
        pending = saver.get_tuple(cfg)
        assert pending is not None
        written = [v for _, channel, v in pending.pending_writes or [] if channel == "seen"]
        same(written, [[["stamp", STAMPED]]])
    finally:
        saver.remit.close()

    in_child(resume, exitcode=0)
    saver = RemitSaver(url, lease=LEASE)
    try:
        done = planning(saver).get_state(cfg)
        assert done.next == ()
        same(done.values["at"], NAIVE_LATE)
        same(sorted(done.values["seen"], key=lambda s: s[0]), [["ask", ANSWER], ["stamp", STAMPED]])
    finally:
        saver.remit.close()


def loose(saver: Any) -> Any:
    def stamp(state: Loose) -> dict[str, Any]:
        return {"seen": [Stamp(at=state["extra"].at, when=[NAIVE_LATE, NAIVE_EARLY])]}

    builder = StateGraph(Loose)
    builder.add_node("stamp", stamp)
    builder.add_edge(START, "stamp")
    builder.add_edge("stamp", END)
    return builder.compile(checkpointer=saver)


def test_folds_survive_the_async_api_of_a_with_allowlist_clone(url: str) -> None:
    """A type outside the state schema (a dataclass in an `Any` channel), allowed by
    `with_allowlist`, written through `ainvoke` by a process that exits, reads back
    through `aget_state` and `aget_tuple` of another process's clone with the folds of
    its datetimes; a saver without the clone's allowlist refuses it."""
    cfg = config()
    extra = Stamp(at=BERLIN_LATE, when=[LOCAL_LATE])

    def write() -> None:
        saver = RemitSaver(url, lease=LEASE)
        try:
            clone = saver.with_allowlist([Stamp])
            asyncio.run(loose(clone).ainvoke({"extra": extra, "seen": []}, cfg))
        finally:
            saver.remit.close()

    in_child(write, exitcode=0)
    saver = RemitSaver(url, lease=LEASE)
    try:
        clone = saver.with_allowlist([Stamp])
        state = asyncio.run(loose(clone).aget_state(cfg))
        same(state.values["extra"], extra)
        same(state.values["seen"], [Stamp(at=BERLIN_LATE, when=[NAIVE_LATE, NAIVE_EARLY])])
        found = asyncio.run(clone.aget_tuple(cfg))
        assert found is not None
        same(found.checkpoint["channel_values"]["extra"], extra)
        with pytest.raises(CorruptRecord):
            saver.get_tuple(cfg)
    finally:
        saver.remit.close()


def test_fold_zero_is_stored_as_langgraph_stores_it_and_fold_one_reads_in_langgraph(
    tmp_path: Path,
) -> None:
    """A value whose datetimes have fold=0 is stored byte for byte as LangGraph's own
    serializer stores it (records of either read as before); one with fold=1 is read
    by LangGraph's own serializer with its folds as well."""
    saver = RemitSaver(f"sqlite:///{tmp_path}/fold.db", allowlist=[Slot, Stamp])
    try:
        own = JsonPlusSerializer(allowed_msgpack_modules=[Slot, Stamp])
        early = {
            "at": NAIVE_EARLY,
            "zoned": BERLIN_LATE.replace(fold=0),
            "slot": Slot(at=NAIVE_EARLY, clock=dt.time(2, 30)),
            "stamp": Stamp(at=UTC_LATE.replace(fold=0), when=[NAIVE_EARLY]),
        }
        stored = saver.serde.dumps_typed(early)
        assert stored == own.dumps_typed(early)
        same(saver.serde.loads_typed(own.dumps_typed(early)), own.loads_typed(stored))
        late = {**STATE_IN, "stamp": Stamp(at=BERLIN_LATE, when=[LOCAL_LATE, NAIVE_EARLY])}
        same(own.loads_typed(saver.serde.dumps_typed(late)), late)
    finally:
        saver.remit.close()
