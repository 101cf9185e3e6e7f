"""Probes of `RemitRuntime` written from the contract, on SQLite, PostgreSQL and Redis.

A resume value and an event a step returns or sends are stored with the
framework's `JsonSerializer`; a value it would give back as another (a tuple or set
as a list, bytes or an untyped datetime as a string) is refused where it enters,
naming its field, so a recovery never continues with a value other than the one
the run was given. Also: a fan-out step (`num_workers=3`) gathered by
`collect_events` whose process is SIGKILLed mid-fan-out, and k processes starting
one new run id at once.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core import NOT_APPLIED, effect
from remit_core.errors import CheckpointInvalid, ForkWithoutIntent, ResumeConflict, UnknownRecord
from remit_llamaindex import RemitRuntime

GUARD = 60
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe5-{uuid.uuid4().hex[:12]}"


# -- values the store would change ---------------------------------------------------------


class Dated(HumanResponseEvent):
    """An answer with a declared datetime field: stored and read back as a datetime."""

    when: dt.datetime


class Ask(Workflow):
    """One step waits for an answer (`HumanResponseEvent`, or the `answer` type it is
    given) and returns what it got, with its extra's type."""

    def __init__(self, answer: type[HumanResponseEvent] = HumanResponseEvent, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        self.answer = answer

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            self.answer, waiter_event=InputRequiredEvent(prefix="who?")
        )
        tags = answer.get("tags")
        when = getattr(answer, "when", None)
        return StopEvent(
            result={
                "who": answer.response,
                "tags": type(tags).__name__,
                "when": when.isoformat() if when is not None else None,
            }
        )


async def parked_handler(rt: RemitRuntime, run: str, flow: Ask | None = None) -> Any:
    handler = (flow or Ask(runtime=rt)).run(run_id=run)
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    return handler


def interrupt_states(rt: RemitRuntime, run: str) -> list[str]:
    return [i.status for i in rt.remit.interrupts(run)]


@pytest.mark.parametrize(
    "extra",
    [("a", "b"), {"a", "b"}, b"ab", dt.datetime(2020, 1, 2), {1: "a"}],
    ids=["tuple", "set", "bytes", "datetime", "int-key"],
)
def test_a_resume_value_the_store_would_change_is_refused_naming_its_field(
    store_url: str, extra: Any
) -> None:
    """P5: the interrupt stores the answer and a recovery continues with the stored
    copy, so an answer whose undeclared `tags` the serializer gives back as another
    value (a tuple as a list, ...) is refused with `CheckpointInvalid` naming `tags`,
    through `rt.respond` and through a live handler: nothing is consumed, the run
    still waits, and a plain answer is then taken."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = await parked_handler(rt, run)
        bad = HumanResponseEvent(response="ada", tags=extra)
        with pytest.raises(CheckpointInvalid) as live:
            await rt.send_event(handler, bad)
        assert live.value.field == "tags"
        await handler.cancel_run()
        assert interrupt_states(rt, run) == ["pending"]

        rt2 = RemitRuntime(store_url)
        with pytest.raises(CheckpointInvalid) as stored:
            await rt2.respond(Ask(runtime=rt2), run, bad)
        assert stored.value.field == "tags"
        assert rt2.status(run) == "waiting"
        assert interrupt_states(rt2, run) == ["pending"]

        good = HumanResponseEvent(response="ada", tags=["a", "b"])
        resumed = await rt2.respond(Ask(runtime=rt2), run, good)
        result = await asyncio.wait_for(resumed, GUARD)
        assert result == {"who": "ada", "tags": "list", "when": None}
        assert interrupt_states(rt2, run) == ["consumed"]

    asyncio.run(go())


def test_a_declared_field_the_store_reads_back_as_it_was_is_taken(store_url: str) -> None:
    """The check refuses only what would change: a datetime declared on the answer's
    own model is stored and read back as that datetime, so it is delivered."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = await parked_handler(rt, run, Ask(Dated, runtime=rt))
        await handler.cancel_run()
        when = dt.datetime(2020, 1, 2, 3, 4, 5)
        resumed = await rt.respond(Ask(Dated, runtime=rt), run, Dated(response="ada", when=when))
        result = await asyncio.wait_for(resumed, GUARD)
        assert result == {"who": "ada", "tags": "NoneType", "when": when.isoformat()}

    asyncio.run(go())


class Item(Event):
    name: str


class Returns(Workflow):
    """`make` returns (or, with `send=True`, sends) an event carrying a tuple in an
    undeclared field; `use` would take it."""

    entered: list[str] = []

    def __init__(self, send: bool = False, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        self.send = send

    @step
    async def make(self, ctx: Context, ev: StartEvent) -> Item | None:
        item = Item(name="x", tags=("t", "u"))
        if self.send:
            ctx.send_event(item)
            return None
        return item

    @step
    async def use(self, ctx: Context, ev: Item) -> StopEvent:
        Returns.entered.append("use")
        return StopEvent(result=type(ev.tags).__name__)


@pytest.mark.parametrize("send", [False, True], ids=["returned", "sent"])
def test_an_event_the_checkpoint_would_change_fails_the_run(store_url: str, send: bool) -> None:
    """P1/P6: a step's returned or sent event is checkpointed before the step that
    takes it runs, and a crash re-runs that step on the stored copy. An event value
    the checkpoint would give back as another (a tuple as a list) fails the run with
    `CheckpointInvalid` naming it (as the README says of a value carried by an event),
    and the run is committed as failed, instead of a re-run seeing a list where the
    live run had a tuple."""
    run = new_run()
    Returns.entered.clear()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        with pytest.raises(CheckpointInvalid) as refused:
            await asyncio.wait_for(Returns(send, runtime=rt).run(run_id=run), GUARD)
        assert refused.value.field == "Item.tags"
        assert rt.status(run) == "failed"
        assert Returns.entered == []

    asyncio.run(go())


class Echo(Workflow):
    @step
    async def only(self, ctx: Context, ev: StartEvent) -> StopEvent:
        return StopEvent(result=list(ev.get("pair")))


def test_a_start_value_the_checkpoint_would_change_is_refused_before_anything_is_stored(
    store_url: str,
) -> None:
    """P1/P4: `run(pair=(1, 2))` would be checkpointed as a list, and a crash in the
    first step would re-run it on that list: the start is refused with
    `CheckpointInvalid` naming `StartEvent.pair`, nothing is stored, and the same
    run id then starts with plain values."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        with pytest.raises(CheckpointInvalid) as refused:
            await asyncio.wait_for(Echo(runtime=rt).run(run_id=run, pair=(1, 2)), GUARD)
        assert refused.value.field == "StartEvent.pair"
        with pytest.raises(UnknownRecord):
            rt.status(run)
        assert await asyncio.wait_for(Echo(runtime=rt).run(run_id=run, pair=[1, 2]), GUARD) == [
            1,
            2,
        ]
        assert rt.status(run) == "completed"

    asyncio.run(go())


# -- fan-out gathered by collect_events, SIGKILLed mid-way -----------------------------


def journal_path() -> Path:
    return Path(os.environ["PROBE5_DIR"]) / "journal.txt"


def sink_path() -> Path:
    return Path(os.environ["PROBE5_DIR"]) / "sink.txt"


def enter(name: str) -> None:
    with journal_path().open("a") as f:
        f.write(f"{name} {os.getpid()}\n")


def shipped_keys() -> list[str]:
    if not sink_path().exists():
        return []
    return [line.split()[0] for line in sink_path().read_text().splitlines()]


@effect(reconcile=lambda key: 1 if key in shipped_keys() else NOT_APPLIED)
def ship(name: str, *, idempotency_key: str) -> int:
    with sink_path().open("a") as f:
        f.write(f"{idempotency_key} {name}\n")
    return 1


class Shipped(Event):
    name: str


class Fan(Workflow):
    """start sends one `Item` per name; three `work` workers ship each; `gather`
    collects every `Shipped`. `PROBE5_CRASH` names an item whose worker is SIGKILLed
    after its effect, once the others have been gathered."""

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        enter("start")
        names = list(ev.get("names"))
        await ctx.store.set("count", len(names))
        for name in names:
            ctx.send_event(Item(name=name))
        return None

    @step(num_workers=3)
    async def work(self, ctx: Context, ev: Item) -> Shipped:
        enter(f"work:{ev.name}")
        ship(ev.name)
        if os.environ.get("PROBE5_CRASH") == ev.name:
            await asyncio.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        return Shipped(name=ev.name)

    @step
    async def gather(self, ctx: Context, ev: Shipped) -> StopEvent | None:
        got = ctx.collect_events(ev, [Shipped] * await ctx.store.get("count"))
        if got is None:
            return None
        enter("gather")
        return StopEvent(result=sorted(e.name for e in got))


FAN_CRASH = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes5 import Fan

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    await Fan(timeout=None, runtime=rt).run(run_id={run!r}, names=["a", "b", "c"])

asyncio.run(main())
"""


def test_a_fan_out_killed_mid_way_reruns_only_the_worker_in_flight(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1/P2 with `num_workers=3` and `collect_events`: the worker of "c" is SIGKILLed
    after its effect, once "a" and "b" were shipped and gathered. Recovery re-enters
    only that worker (not `start`, not the finished workers), keeps what `gather`
    had collected, and each item is shipped once."""
    monkeypatch.setenv("PROBE5_DIR", str(tmp_path))
    monkeypatch.setenv("PROBE5_CRASH", "c")
    run = new_run()
    code = FAN_CRASH.format(tests=TESTS, url=store_url, run=run)
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    before = [line.split()[0] for line in journal_path().read_text().splitlines()]
    assert sorted(before) == ["start", "work:a", "work:b", "work:c"]
    monkeypatch.delenv("PROBE5_CRASH")

    async def go() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        deadline = time.monotonic() + GUARD
        while True:
            try:
                handler = rt.recover(Fan(timeout=None, runtime=rt), run)
                assert handler is not None
                return await asyncio.wait_for(handler, GUARD)
            except ResumeConflict:  # the dead process's lease has not run out yet
                assert time.monotonic() < deadline
                await asyncio.sleep(0.3)

    assert asyncio.run(go()) == ["a", "b", "c"]
    after = [line.split()[0] for line in journal_path().read_text().splitlines()]
    assert sorted(after[len(before) :]) == ["gather", "work:c"]
    keys = shipped_keys()
    assert len(keys) == len(set(keys)) == 3


# -- k processes starting one new run id ----------------------------------------------

START_RACE = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes5 import Fan

async def main():
    rt = RemitRuntime({url!r}, lease=5)
    rt.remit
    flow = Fan(timeout=None, runtime=rt)
    while time.time() < {at!r}:
        time.sleep(0.001)
    try:
        print("RESULT", await flow.run(run_id={run!r}, names=["a"]))
    except Exception as exc:
        print("REFUSED", type(exc).__name__)

asyncio.run(main())
"""


def test_k_processes_starting_one_new_run_id_run_it_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """4 processes start a new run under one id at the same instant: one runs it,
    the others are refused (`ResumeConflict` or `ForkWithoutIntent`) and enter no
    step; the effect is applied once."""
    monkeypatch.setenv("PROBE5_DIR", str(tmp_path))
    run = new_run()
    code = START_RACE.format(tests=TESTS, url=store_url, run=run, at=time.time() + 4)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [o for o in outs if o.startswith("RESULT")] == ["RESULT ['a']"], outs
    assert len([o for o in outs if o.startswith("REFUSED")]) == 3, outs
    refused = {o.split()[1] for o in outs if o.startswith("REFUSED")}
    assert refused <= {ResumeConflict.__name__, ForkWithoutIntent.__name__}, outs
    entered = sorted(line.split()[0] for line in journal_path().read_text().splitlines())
    assert entered == ["gather", "start", "work:a"]
    assert len(shipped_keys()) == 1
