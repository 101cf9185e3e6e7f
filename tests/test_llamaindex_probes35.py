"""LlamaIndex probes, round 35, on SQLite, PostgreSQL and Redis.

A run stored by one shape of a workflow and continued by another whose step of the
same name now takes another event class (the step kept its name, its event was
replaced) was run: the framework called the new step with the stored event of the old
class, the step failed on it, and the run was committed as `failed` for good (a
parked run's answer consumed with it). It is now refused with `VersionMismatch`
naming the step and the event, before anything runs or is stored, as a shape with no
step for the pending work already was; the code that wrote the run continues it.

A typed state holding an int of more digits than JSON text converts was refused with
`CheckpointInvalid` naming `<root>`, not the field: the field is named now.

Held: a typed state of many shapes (an enum, datetimes, a timedelta, a Decimal, a
UUID, bytes, a set, a tuple, nested models in a list and a dict, a union, a literal)
written by a step reads back equal, of the same types, in another process that
answers the run, and in the store's state afterwards.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import enum
import signal
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, die_at, enter, entered, in_process, pay, payments
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid, ResumeConflict, VersionMismatch
from remit_llamaindex import RemitRuntime

TESTS = str(Path(__file__).parent)
GUARD = 60


def new_run() -> str:
    return f"probe35-{uuid.uuid4().hex[:12]}"


# -- one workflow, two shapes: the second's steps take other event classes -------------


class Asked(Event):
    pass


class Approved(Event):
    who: str


class Review(Event):
    reviewer: str


class Billed(Event):
    who: str
    cents: int


class Ordering(Workflow):
    """The shape that writes the runs: ask, then charge the one who approved."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ev: StartEvent) -> Asked:
        enter("prepare")
        return Asked()

    @step
    async def approve(self, ctx: Context, ev: Asked) -> Approved:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="charge?"), timeout=None
        )
        return Approved(who=answer.response)

    @step
    async def charge(self, ev: Approved) -> StopEvent:
        enter("charge")
        die_at("charge")
        return StopEvent(result=pay("order-" + ev.who))


class OrderingReshaped(Workflow):
    """The same steps by name, each taking another event class than `Ordering`'s."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ev: StartEvent) -> Review:
        enter("prepare-v2")
        return Review(reviewer="desk")

    @step
    async def approve(self, ctx: Context, ev: Review) -> Billed:
        enter("approve-v2")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix=ev.reviewer), timeout=None
        )
        return Billed(who=answer.response, cents=100)

    @step
    async def charge(self, ev: Billed) -> StopEvent:
        enter("charge-v2")
        return StopEvent(result=pay(f"order-{ev.who}-{ev.cents}"))


async def _parked(url: str, run: str) -> None:
    """`Ordering` started, parked at its question, and this process's copy stopped as
    the framework documents it (`cancel_run`: the stored run stays parked)."""
    rt = RemitRuntime(url)
    handler = Ordering(runtime=rt).run(run_id=run)
    await until_parked(rt, run)
    await handler.cancel_run()


@pytest.mark.parametrize("way", ["respond", "context"])
def test_a_parked_run_continued_by_a_shape_whose_step_takes_another_event_is_refused(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """P4 (cell 23): the reshaped `approve` takes `Review`, the stored waiter's step was
    invoked with an `Asked`. The framework would re-run the new step on the old event,
    which fails, and the run (its answer consumed) would end `failed`. Refused naming
    the step and both event classes; nothing runs, nothing is stored, and the shape
    that wrote the run still takes the answer and charges once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def main() -> Any:
        await _parked(url, run)
        rt = RemitRuntime(url)
        before = await asyncio.to_thread(rt.checkpoints, run)
        reshaped = OrderingReshaped(runtime=rt)
        with pytest.raises(VersionMismatch) as refused:
            if way == "respond":
                await rt.respond(reshaped, run, HumanResponseEvent(response="eve"))
            else:
                reshaped.run(ctx=rt.context(reshaped, run))
        assert refused.value.ids["step"] == "approve"
        assert refused.value.run_id == run
        assert "Asked" in str(refused.value) and "Review" in str(refused.value)
        assert await asyncio.to_thread(rt.checkpoints, run) == before
        assert await asyncio.to_thread(rt.status, run) == "waiting"
        answered = await rt.respond(Ordering(runtime=rt), run, HumanResponseEvent(response="ada"))
        return await asyncio.wait_for(answered, GUARD)

    assert asyncio.run(main()) == "order-ada"
    assert [line.split()[1] for line in payments(tmp_path)] == ["order-ada"]
    assert not [name for name in entered(tmp_path) if name.endswith("-v2")]


START = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from test_llamaindex_probes35 import _parked

asyncio.run(_parked({url!r}, {run!r}))
print("PARKED", flush=True)
"""

ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes35 import Ordering

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = await rt.respond(Ordering(runtime=rt), {run!r}, HumanResponseEvent(response="ada"))
    print("ACK", flush=True)
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


async def _recovered(url: str, run: str) -> Any:
    """The run continued by `rt.recover` with `Ordering` once the dead process's lease
    ran out."""
    rt = RemitRuntime(url, lease=1)
    handler = None
    while handler is None:
        try:
            handler = rt.recover(Ordering(runtime=rt), run)
        except ResumeConflict:  # the dead process's lease has not run out yet
            await asyncio.sleep(0.1)
    return await asyncio.wait_for(handler, GUARD)


def test_a_run_killed_in_a_step_recovered_by_a_shape_that_takes_another_event_runs_nothing(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P4: `charge` was in flight on an `Approved` when its process was SIGKILLed
    (before it paid). A recovery by the reshaped workflow, whose `charge` takes `Billed`,
    is refused naming the step before it claims the run (the dead process's lease still
    holds it): no step runs, nothing is paid or stored. The shape that wrote the run
    recovers it and pays once."""
    run = new_run()
    started = in_process(START.format(tests=TESTS, url=url, run=run), tmp_path)
    assert started.stdout.split() == ["PARKED"], started.stderr
    killed = in_process(ANSWER.format(tests=TESTS, url=url, run=run), tmp_path, kill="charge")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout.split() == ["ACK"]
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    rt = RemitRuntime(url, lease=1)
    before = rt.checkpoints(run)
    for attempt in ("recover", "context"):
        reshaped = OrderingReshaped(runtime=rt)
        with pytest.raises(VersionMismatch) as refused:
            if attempt == "recover":
                rt.recover(reshaped, run)
            else:
                reshaped.run(ctx=rt.context(reshaped, run))
        assert refused.value.ids["step"] == "charge"
        assert "Approved" in str(refused.value) and "Billed" in str(refused.value)
    assert rt.checkpoints(run) == before and rt.status(run) == "running"
    assert payments(tmp_path) == [] and entered(tmp_path).count("charge") == 1
    assert asyncio.run(_recovered(url, run)) == "order-ada"
    assert [line.split()[1] for line in payments(tmp_path)] == ["order-ada"]
    assert entered(tmp_path).count("charge") == 2
    assert not [name for name in entered(tmp_path) if name.endswith("-v2")]


# -- a typed state of many shapes, across processes -----------------------------------


class Tint(enum.Enum):
    RED = "red"
    BLUE = 2


class Part(BaseModel):
    n: int = 0
    tags: list[str] = []


class Shapes(BaseModel):
    tint: Tint = Tint.RED
    when: dt.datetime | None = None
    day: dt.date | None = None
    span: dt.timedelta | None = None
    money: Decimal | None = None
    uid: uuid.UUID | None = None
    blob: bytes = b""
    names: set[str] = set()
    pair: tuple[int, str] | None = None
    parts: list[Part] = []
    by_name: dict[str, Part] = {}
    either: int | str = 0
    ratio: float = 0.0
    mode: Literal["a", "b"] = "a"
    big: int = 0


SHAPED: dict[str, Any] = {
    "tint": Tint.BLUE,
    "when": dt.datetime(2024, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=5))),
    "day": dt.date(2024, 2, 29),
    "span": dt.timedelta(days=1, microseconds=7),
    "money": Decimal("1.10"),
    "uid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "blob": b"\x00abc",
    "names": {"x", "y"},
    "pair": (1, "a"),
    "parts": [Part(n=1, tags=["q"])],
    "by_name": {"k": Part(n=2)},
    "either": "5",
    "ratio": 0.1,
    "mode": "b",
}


def differing(state: BaseModel) -> list[str]:
    """The fields of `state` that are not `SHAPED`'s value, of its type."""
    return sorted(
        name
        for name, value in SHAPED.items()
        if getattr(state, name) != value or type(getattr(state, name)) is not type(value)
    )


class Shaping(Workflow):
    """Writes every `SHAPED` value, asks, then reads them back after the answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def keep(self, ctx: Context[Shapes], ev: StartEvent) -> Asked:
        for name, value in SHAPED.items():
            await ctx.store.set(name, value)
        return Asked()

    @step
    async def check(self, ctx: Context[Shapes], ev: Asked) -> StopEvent:
        await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="go?"), timeout=None
        )
        return StopEvent(result=differing(await ctx.store.get_state()))


SHAPED_ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes35 import Shaping, differing

async def main():
    rt = RemitRuntime({url!r})
    print("STORED", differing(rt.get_state(Shaping(runtime=rt), {run!r})), flush=True)
    handler = await rt.respond(Shaping(runtime=rt), {run!r}, HumanResponseEvent(response="go"))
    print("READ", await handler, flush=True)

asyncio.run(main())
"""


def test_a_typed_state_of_many_shapes_reads_back_equal_in_another_process(
    url: str, tmp_path: Path
) -> None:
    """P4: every value the step wrote reads back equal and of its own type, in the
    process that answers (from the store, and inside the resumed step), and here."""
    run = new_run()

    async def main() -> None:
        rt = RemitRuntime(url)
        handler = Shaping(runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        await handler.cancel_run()

    asyncio.run(main())
    answered = in_process(SHAPED_ANSWER.format(tests=TESTS, url=url, run=run), tmp_path)
    assert answered.stdout.splitlines() == ["STORED []", "READ []"], answered.stderr
    rt = RemitRuntime(url)
    assert rt.status(run) == "completed" and rt.result(run) == []
    assert differing(rt.get_state(Shaping(runtime=rt), run)) == []


class Counting(Workflow):
    """Sets a typed int field to an int of 5001 digits, then asks."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def keep(self, ctx: Context[Shapes], ev: StartEvent) -> Asked:
        await ctx.store.set("ratio", 0.5)
        try:
            await ctx.store.set("big", 10**5000)
        except CheckpointInvalid as exc:
            await ctx.store.set("mode", "b")
            ctx.write_event_to_stream(Event(field=exc.field, message=exc.message))
        return Asked()

    @step
    async def check(self, ctx: Context[Shapes], ev: Asked) -> StopEvent:
        await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="go?"), timeout=None
        )
        return StopEvent(result="done")


def test_an_int_json_text_cannot_hold_is_refused_naming_its_field(url: str) -> None:
    """P4: an int of more digits than JSON text converts cannot be stored; the write is
    refused naming the field (not `<root>`), the step goes on, and the stored state holds
    the step's other writes and the field's old value."""
    run = new_run()

    async def main() -> list[Event]:
        rt = RemitRuntime(url)
        handler = Counting(runtime=rt).run(run_id=run)
        seen: list[Event] = []
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                break
            seen.append(ev)
        await until_parked(rt, run)
        await handler.cancel_run()
        return seen

    refused = [ev for ev in asyncio.run(main()) if ev.get("field") is not None]
    assert [ev.get("field") for ev in refused] == ["big"]
    assert "cannot be stored" in refused[0].get("message")
    rt = RemitRuntime(url)
    stored = rt.get_state(Counting(runtime=rt), run)
    assert (stored.big, stored.ratio, stored.mode) == (0, 0.5, "b")
