"""LlamaIndex probes, round 34, on SQLite, PostgreSQL and Redis.

A checkpoint naming a class that the reading workflow's serializer does not allow
(`JsonSerializer(allowed_types=...)` without it) was refused with `CorruptRecord`, as if
its bytes had been altered: it is now `VersionMismatch`, the reader's refusal, naming
the run, the checkpoint and the class, with nothing run or stored.

A step with `num_workers=2` whose two workers both paid before their process was
SIGKILLed, and a `ctx.collect_events` fan-in that collects those workers' results and
the answer to a question asked the classic way (a step returns an
`InputRequiredEvent`), with the process killed between the collected events and after
the fan-in paid: every recovery pays each item once and ends as the uninterrupted run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, die_at, enter, entered, in_process, pay, payments
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.context.serializers import JsonSerializer
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ResumeConflict, VersionMismatch
from remit_llamaindex import RemitRuntime

TESTS = str(Path(__file__).parent)
GUARD = 60


def new_run() -> str:
    return f"probe34-{uuid.uuid4().hex[:12]}"


def applied(tmp: Path) -> list[str]:
    """Every application of `pay`, as what it paid for, sorted."""
    return sorted(line.split()[1] for line in payments(tmp))


# -- two workers that both paid, a fan-in of their results and an answer ---------------


class Item(Event):
    name: str


class Done(Event):
    name: str


class Fan(Workflow):
    """`start` sends two items and asks a question the classic way; `work` (two
    workers) pays for each item, both payments made before either worker returns;
    `gather` collects both results and the answer, then pays the total."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> InputRequiredEvent | Item:
        enter("start")
        ctx.send_event(Item(name="a"))
        ctx.send_event(Item(name="b"))
        return InputRequiredEvent(prefix="ship?")

    @step(num_workers=2)
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter("work-" + ev.name)
        pay("item-" + ev.name)
        sink = Path(os.environ[DIR_VAR])
        while not {"item-a", "item-b"} <= set(applied(sink)):
            await asyncio.sleep(0.01)  # the other worker has not paid yet
        die_at("both paid")  # the worker that paid second kills the process
        return Done(name=ev.name)

    @step
    async def gather(self, ctx: Context, ev: Done | HumanResponseEvent) -> StopEvent | None:
        enter("gather")
        got = ctx.collect_events(ev, [Done, Done, HumanResponseEvent])
        if got is None:
            if isinstance(ev, Done):
                die_at("first collected")
            return None
        names = sorted(e.name for e in got if isinstance(e, Done))
        answer = next(e.response for e in got if isinstance(e, HumanResponseEvent))
        total = pay("total-" + answer)
        die_at("total paid")
        return StopEvent(result=f"{'+'.join(names)}:{total}")


START = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from llamaindex_parts import until_parked
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes34 import Fan

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    Fan(runtime=rt).run(run_id={run!r})
    await until_parked(rt, {run!r})
    print("PARKED", flush=True)

asyncio.run(main())
"""

ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes34 import Fan

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = await rt.respond(Fan(runtime=rt), {run!r}, HumanResponseEvent(response="ada"))
    print("ACK", flush=True)
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


async def _recovered(url: str, run: str) -> Any:
    """The run continued by `rt.recover` once the dead process's lease ran out, then
    answered if it asks (nothing is awaited when it had been answered already)."""
    rt = RemitRuntime(url, lease=1)
    try:
        handler = None
        while handler is None:
            try:
                handler = rt.recover(Fan(runtime=rt), run)
            except ResumeConflict:  # the dead process's lease has not run out yet
                await asyncio.sleep(0.1)
        done = asyncio.ensure_future(handler)
        while not done.done():
            if await asyncio.to_thread(rt.status, run) == "waiting":
                answer = HumanResponseEvent(response="ada")
                return await asyncio.wait_for(await rt.respond(Fan(runtime=rt), run, answer), GUARD)
            await asyncio.sleep(0.05)
        return done.result()
    finally:
        rt.remit.close()


def test_uninterrupted_fan_run_pays_each_item_once(url: str, tmp_path: Path) -> None:
    """The reference run: started and parked in one process, answered in another."""
    run = new_run()
    started = in_process(START.format(tests=TESTS, url=url, run=run), tmp_path)
    assert started.stdout.split() == ["PARKED"], started.stderr
    answered = in_process(ANSWER.format(tests=TESTS, url=url, run=run), tmp_path)
    assert answered.stdout.split() == ["ACK", "RESULT", "a+b:total-ada"], answered.stderr
    assert applied(tmp_path) == ["item-a", "item-b", "total-ada"]


@pytest.mark.parametrize("kill", ["both paid", "first collected"])
def test_a_fan_killed_before_the_answer_recovers_and_pays_each_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str
) -> None:
    """P1, P2, P6: the process dies with both workers of `work` in flight after both
    paid, or after `gather` collected the first result; a recovery in another process
    re-runs only what was in flight (the payments come from the ledger), parks on the
    question, and the answer ends the run as the uninterrupted one."""
    run = new_run()
    killed = in_process(START.format(tests=TESTS, url=url, run=run), tmp_path, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert applied(tmp_path) == ["item-a", "item-b"]
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    result = asyncio.run(asyncio.wait_for(_recovered(url, run), GUARD))
    assert result == "a+b:total-ada"
    assert applied(tmp_path) == ["item-a", "item-b", "total-ada"]
    assert entered(tmp_path).count("start") == 1


@pytest.mark.parametrize("kill", ["total paid"])
def test_a_fan_in_killed_after_it_paid_recovers_with_the_acknowledged_answer(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str
) -> None:
    """P1, P2, P5: the answer completes the fan-in, which pays and dies; the recovery
    re-runs `gather` on the same collected events (the answer is not asked for again),
    finds the payment recorded, and ends as the uninterrupted run."""
    run = new_run()
    started = in_process(START.format(tests=TESTS, url=url, run=run), tmp_path)
    assert started.stdout.split() == ["PARKED"], started.stderr
    killed = in_process(ANSWER.format(tests=TESTS, url=url, run=run), tmp_path, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout.split() == ["ACK"]
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    result = asyncio.run(asyncio.wait_for(_recovered(url, run), GUARD))
    assert result == "a+b:total-ada"
    assert applied(tmp_path) == ["item-a", "item-b", "total-ada"]
    assert entered(tmp_path).count("start") == 1


# -- a checkpoint naming a class the reading workflow's serializer does not allow ------


class Note(BaseModel):
    text: str


class Asked(Event):
    pass


class Noting(Workflow):
    """Keeps a model value in an untyped state, then waits for an answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context, ev: StartEvent) -> Asked:
        await ctx.store.set("note", Note(text="fragile"))
        return Asked()

    @step
    async def approve(self, ctx: Context, ev: Asked) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        note = await ctx.store.get("note")
        return StopEvent(result=f"{answer.response}:{type(note).__name__}:{note.text}")


@pytest.mark.parametrize("read", ["get_state", "context", "respond"])
def test_a_class_the_readers_serializer_does_not_allow_is_a_version_mismatch(
    url: str, read: str
) -> None:
    """P4: a run whose untyped state holds a `Note`, read (`rt.get_state`, a run of
    `rt.context`, `rt.respond`) by a workflow whose `JsonSerializer(allowed_types=...)`
    does not list `Note`, is refused with
    `VersionMismatch` naming the run, the checkpoint and the class (the reader's choice;
    the bytes are intact, so not `CorruptRecord`), before anything runs or is stored;
    the run still waits, and a reader that allows the class answers it."""
    run = new_run()
    writer = JsonSerializer(allowed_types=[Note])

    async def scenario() -> None:
        rt = RemitRuntime(url, lease=1)
        other = RemitRuntime(url, lease=1)
        try:
            Noting(runtime=rt, serializer=writer).run(run_id=run)
            await until_parked(rt, run)
            before = other.checkpoints(run)
            head = before[0].checkpoint_id
            reader = Noting(runtime=other, serializer=JsonSerializer(allowed_types=[]))
            with pytest.raises(VersionMismatch) as refused:
                if read == "get_state":
                    other.get_state(reader, run)
                elif read == "context":
                    reader.run(ctx=other.context(reader, run))
                else:
                    await other.respond(reader, run, HumanResponseEvent(response="eve"))
            assert refused.value.ids["run_id"] == run
            assert refused.value.ids["checkpoint_id"] == head
            assert f"{__name__}.Note" in str(refused.value)
            assert other.checkpoints(run) == before
            assert other.status(run) == "waiting"
            allowed = Noting(runtime=other, serializer=JsonSerializer(allowed_types=[Note]))
            answer = HumanResponseEvent(response="ada")
            handler = await other.respond(allowed, run, answer)
            assert await asyncio.wait_for(handler, GUARD) == "ada:Note:fragile"
        finally:
            rt.remit.close()
            other.remit.close()

    asyncio.run(asyncio.wait_for(scenario(), GUARD))
