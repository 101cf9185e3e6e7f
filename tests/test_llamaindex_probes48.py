"""LlamaIndex probe round 48: the moment a pause lands, on SQLite, PostgreSQL and Redis.

Fixed: the store shows a pause as its commit lands (`rt.status(run_id) == "waiting"`,
`rt.checkpoints`), and the run's copy named its checkpoint only once the commit had
returned. A snapshot (`handler.ctx.to_dict()`) taken in between, by a task of the same
process (or another thread) that waited for the store to show the pause, named the
checkpoint before, and its restore was refused as a fork (`ForkWithoutIntent`); it now
waits for a commit in flight. In the same moment the copy still held the run's claim:
`rt.respond` with the run's own workflow answered in a second copy (the run's own
handler ended with `ResumeConflict`), and `rt.update_state` was refused as if a step
were running; both now wait for that copy to park (a few milliseconds).

Held: the question streams only once its pause is named (the control loop streams a
tick's events after the runtime has committed it), and the store's open interrupt
likewise; an answer from another workflow object, or `rt.cancel`, in that moment; an
edit while a step runs is still refused at once; a process SIGKILLed just after its
pause landed leaves it answerable once (L1, P5); a second pause; the documented pause
gives the framework's own runtime's results, round after round.

Kept as a strict xfail: a question the step writes to the stream itself
(`ctx.write_event_to_stream(InputRequiredEvent(...))`, then `wait_for_event`) streams
while the step is in flight, before the pause is committed; the documented pause taken
as it streams names the checkpoint before the pause, and its restore is refused as a
fork, where the framework's own runtime re-runs the step.

The probes hold the commit that lands the pause for a moment after it landed
(`checkpoint.after_commit=sleep`, armed at that commit's hit, counted on a run of the
same workflow), so that each user falls in that moment every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core import failpoints
from remit_core.errors import ForkWithoutIntent, ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 30
TESTS = str(Path(__file__).parent)
#: Seconds the commit that lands the pause is held once it landed.
HOLD = 0.8


def new_run() -> str:
    return f"probe48-{uuid.uuid4().hex[:12]}"


class Ask(Workflow):
    """The classic pause: a step returns an `InputRequiredEvent`, another step takes
    the answer."""

    @step
    async def ask(self, ev: StartEvent) -> InputRequiredEvent:
        return InputRequiredEvent(prefix="who?")

    @step
    async def answer(self, ev: HumanResponseEvent) -> StopEvent:
        return StopEvent(result=f"hi {ev.response}")


class Prepared(Event):
    pass


class Wait(Workflow):
    """The waiter pause: a step waits for the answer, its question streamed as the
    waiter's event."""

    @step
    async def start(self, ev: StartEvent) -> Prepared:
        return Prepared()

    @step
    async def wait(self, ctx: Context, ev: Prepared) -> StopEvent:
        got = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who?")
        )
        return StopEvent(result=f"hi {got.response}")


FLOWS = [Ask, Wait]


def head_of(rt: RemitRuntime, run: str) -> str:
    return rt.checkpoints(run)[0].checkpoint_id


async def commits_to_pause(url: str, flow: type[Workflow]) -> int:
    """How many commits this process makes from a start of `flow` to its pause (every
    checkpoint of a run that parks at once is one commit): the hit of
    `checkpoint.after_commit` that lands the pause."""
    rt = RemitRuntime(url)
    run = new_run()
    handler = flow(runtime=rt).run(run_id=run)
    await until_parked(rt, run)
    await asyncio.sleep(0.2)  # (its claim released: nothing more is committed)
    count = len(rt.checkpoints(run))
    await handler.cancel_run()  # (a parked copy's cancel writes nothing)
    return count


@contextlib.asynccontextmanager
async def pause_held_open(url: str, flow: type[Workflow]) -> AsyncIterator[RemitRuntime]:
    """A runtime in which the commit that lands a run of `flow`'s pause is held open for
    `HOLD` seconds after it lands (the window in which the store shows the pause and the
    run's copy has not yet named it), for the block's first run of `flow`."""
    hit = await commits_to_pause(url, flow)
    rt = RemitRuntime(url)
    failpoints.arm("checkpoint.after_commit", f"sleep:{HOLD}@{hit}")
    try:
        yield rt
    finally:
        failpoints.disarm("checkpoint.after_commit")


async def restores_to_pause(url: str, flow: type[Workflow], snapshot: dict[str, Any]) -> Any:
    """Restore `snapshot` in another runtime and answer it: the run's result."""
    later = RemitRuntime(url)
    again = flow(runtime=later)
    restored = again.run(ctx=Context.from_dict(again, snapshot))
    await later.send_event(restored, HumanResponseEvent(response="ada"))
    return await asyncio.wait_for(restored, GUARD)


async def snapshot_in_window(
    url: str, flow: type[Workflow], run: str, parked: Callable[[RemitRuntime], Awaitable[Any]]
) -> tuple[str, str, Any]:
    """Start `run` with the commit that lands its pause held open for `HOLD` seconds
    after it lands, wait with `parked(rt)`, snapshot the run's context, cancel it and
    restore the snapshot elsewhere: (the head then, the snapshot, the restored result)."""
    async with pause_held_open(url, flow) as rt:
        handler = flow(runtime=rt).run(run_id=run)
        await parked(rt)
        snapshot = handler.ctx.to_dict()
        head = head_of(rt, run)
        await handler.cancel_run()
    return head, json.dumps(snapshot), await restores_to_pause(url, flow, snapshot)


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_a_snapshot_once_the_status_reads_waiting_restores_that_pause(
    store_url: str, flow: type[Workflow]
) -> None:
    """README: "check `rt.status(run_id) == "waiting"`". A task that does so and then
    snapshots the run's context (the framework's pause: `to_dict`, `cancel_run`) gets a
    snapshot of that pause, whose restore continues the run (no fork), also while the
    commit that landed the pause has not returned yet."""
    run = new_run()

    head, snapshot, result = asyncio.run(
        snapshot_in_window(store_url, flow, run, lambda rt: until_parked(rt, run))
    )
    assert head in snapshot
    assert result == "hi ada"


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_a_snapshot_once_the_store_lists_the_pause_restores_that_pause(
    store_url: str, flow: type[Workflow]
) -> None:
    """The same for a task that waits for the pause in `rt.checkpoints` (the head
    "waiting" with its question listed), while another task of the loop keeps it busy."""
    run = new_run()

    async def busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(0)

    async def listed(rt: RemitRuntime) -> None:
        for _ in range(GUARD * 100):
            found = await asyncio.to_thread(lambda: rt.checkpoints(run) if _seen(rt, run) else [])
            if found and found[0].status == "waiting" and found[0].waiting:
                return
            await asyncio.sleep(0.01)

    async def go() -> tuple[str, str, Any]:
        stop = asyncio.Event()
        noise = asyncio.get_running_loop().create_task(busy(stop))
        try:
            return await snapshot_in_window(store_url, flow, run, listed)
        finally:
            stop.set()
            await noise

    head, snapshot, result = asyncio.run(go())
    assert head in snapshot
    assert result == "hi ada"


def _seen(rt: RemitRuntime, run: str) -> bool:
    return rt.remit.branch(run) is not None


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_a_snapshot_from_another_thread_once_the_status_reads_waiting(
    store_url: str, flow: type[Workflow]
) -> None:
    """A run driven in a thread of its own (its own event loop), watched from the main
    thread with plain calls: once `rt.status` reads "waiting", the snapshot names the
    pause."""
    run = new_run()
    hit = asyncio.run(commits_to_pause(store_url, flow))
    rt = RemitRuntime(store_url)
    started = threading.Event()
    stop = threading.Event()
    box: dict[str, Any] = {}

    def drive() -> None:
        async def main() -> None:
            box["handler"] = flow(runtime=rt).run(run_id=run)
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)
            await box["handler"].cancel_run()

        asyncio.run(main())

    failpoints.arm("checkpoint.after_commit", f"sleep:{HOLD}@{hit}")
    driver = threading.Thread(target=drive)
    driver.start()
    try:
        assert started.wait(GUARD)
        asyncio.run(until_parked(rt, run))
        snapshot = box["handler"].ctx.to_dict()
        head = head_of(rt, run)
    finally:
        failpoints.disarm("checkpoint.after_commit")
        stop.set()
        driver.join(GUARD)
    assert head in json.dumps(snapshot)
    assert asyncio.run(restores_to_pause(store_url, flow, snapshot)) == "hi ada"


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_a_snapshot_as_the_question_streams_restores_that_pause(
    store_url: str, flow: type[Workflow]
) -> None:
    """The framework's documented pause: snapshot as the `InputRequiredEvent` arrives
    in the stream. It streams once its pause is committed and named (held: the control
    loop streams a tick's events after the runtime's `on_tick`)."""
    run = new_run()

    async def go() -> tuple[str, str, Any]:
        async with pause_held_open(store_url, flow) as rt:
            handler = flow(runtime=rt).run(run_id=run)
            snapshot: dict[str, Any] = {}
            async for ev in handler.stream_events():
                if isinstance(ev, InputRequiredEvent):
                    snapshot = handler.ctx.to_dict()
                    break
            head = head_of(rt, run)
            await handler.cancel_run()
        return head, json.dumps(snapshot), await restores_to_pause(store_url, flow, snapshot)

    head, snapshot, result = asyncio.run(go())
    assert head in snapshot
    assert result == "hi ada"


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_a_snapshot_once_the_question_is_open_in_the_store(
    store_url: str, flow: type[Workflow]
) -> None:
    """A task that waits for the run's open interrupt (`rt.remit.interrupts`) before it
    snapshots: the interrupt is opened once the pause is named (held)."""
    run = new_run()

    async def opened(rt: RemitRuntime) -> None:
        for _ in range(GUARD * 100):
            found = await asyncio.to_thread(rt.remit.interrupts, run)
            if any(i.status == "pending" for i in found):
                return
            await asyncio.sleep(0.01)

    head, snapshot, result = asyncio.run(snapshot_in_window(store_url, flow, run, opened))
    assert head in snapshot
    assert result == "hi ada"


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_an_answer_once_the_status_reads_waiting_goes_on_in_the_parked_handler(
    store_url: str, flow: type[Workflow]
) -> None:
    """README: `rt.respond` of a run parked in this event loop by the same workflow
    answers through that copy, so its handler goes on too. Also when the answer comes
    as soon as `rt.status` reads "waiting", before the copy that committed the pause
    has released its claim: the run's own handler gets the result, not
    `ResumeConflict` (the answer taken by a second copy of its own)."""
    run = new_run()

    async def go() -> tuple[Any, Any]:
        async with pause_held_open(store_url, flow) as rt:
            wf = flow(runtime=rt)
            handler = wf.run(run_id=run)
            await until_parked(rt, run)
            answered = await rt.respond(wf, run, HumanResponseEvent(response="ada"))
        return await asyncio.wait_for(answered, GUARD), await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(go()) == ("hi ada", "hi ada")
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed"
    assert len(rt.remit.branches(run)) == 1


class Note(BaseModel):
    text: str = "-"


class NotedAsk(Workflow):
    """`Ask` with a typed state the answer reads."""

    @step
    async def ask(self, ctx: Context[Note], ev: StartEvent) -> InputRequiredEvent:
        return InputRequiredEvent(prefix="who?")

    @step
    async def answer(self, ctx: Context[Note], ev: HumanResponseEvent) -> StopEvent:
        note = await ctx.store.get_state()
        return StopEvent(result=f"{note.text} {ev.response}")


def test_an_edit_once_the_status_reads_waiting_is_made_through_the_parked_copy(
    store_url: str,
) -> None:
    """README: `rt.update_state` of a parked run whose handler is live in this process
    edits it through that handler, which goes on from the edited head. Also when the
    edit comes as soon as `rt.status` reads "waiting": not refused as if a step of the
    run were running, and the handler then answered takes the edit."""
    run = new_run()

    async def go() -> tuple[str, str, Any]:
        async with pause_held_open(store_url, NotedAsk) as rt:
            wf = NotedAsk(runtime=rt)
            handler = wf.run(run_id=run)
            await until_parked(rt, run)
            edited = await rt.update_state(wf, run, {"text": "hello"})
        head = head_of(rt, run)
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        return edited, head, await asyncio.wait_for(handler, GUARD)

    edited, head, result = asyncio.run(go())
    assert edited == head
    assert result == "hello ada"
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed"
    assert len(rt.remit.branches(run)) == 1


# -- Part 2: other users of the moment a pause lands -----------------------------------


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_an_answer_from_another_workflow_once_the_status_reads_waiting(
    store_url: str, flow: type[Workflow]
) -> None:
    """README: `rt.respond` with another workflow object answers in a copy of its own,
    and the copy parked in this event loop ends with `ResumeConflict`. Also as soon as
    `rt.status` reads "waiting": the answer is taken once, the run completes on one
    branch, and the parked handler does not wait for ever."""
    run = new_run()

    async def go() -> tuple[Any, BaseException | None]:
        async with pause_held_open(store_url, flow) as rt:
            handler = flow(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            answered = await rt.respond(flow(runtime=rt), run, HumanResponseEvent(response="ada"))
        result = await asyncio.wait_for(answered, GUARD)
        try:
            await asyncio.wait_for(handler, GUARD)
        except ResumeConflict as exc:
            return result, exc
        return result, None

    result, stopped = asyncio.run(go())
    assert result == "hi ada"
    assert isinstance(stopped, ResumeConflict)
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed"
    assert len(rt.remit.branches(run)) == 1


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_a_cancel_once_the_status_reads_waiting_ends_the_run(
    store_url: str, flow: type[Workflow]
) -> None:
    """`rt.cancel` as soon as `rt.status` reads "waiting" (the copy that parked the run
    still holding its claim): the run ends cancelled, its handler with
    `WorkflowCancelledByUser`, and a later answer is refused with nothing stored."""
    run = new_run()

    async def go() -> BaseException | None:
        async with pause_held_open(store_url, flow) as rt:
            handler = flow(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            await rt.cancel(run)
        try:
            await asyncio.wait_for(handler, GUARD)
        except WorkflowCancelledByUser as exc:
            return exc
        return None

    assert isinstance(asyncio.run(go()), WorkflowCancelledByUser)
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "cancelled"
    count = len(rt.checkpoints(run))

    async def answer() -> None:
        await rt.respond(flow(runtime=rt), run, HumanResponseEvent(response="late"))

    with pytest.raises(ResumeConflict):
        asyncio.run(answer())
    assert len(rt.checkpoints(run)) == count


class Slow(Workflow):
    """A step that runs for a while, then the classic pause."""

    @step
    async def work(self, ctx: Context[Note], ev: StartEvent) -> InputRequiredEvent:
        await asyncio.sleep(3)
        return InputRequiredEvent(prefix="who?")

    @step
    async def answer(self, ctx: Context[Note], ev: HumanResponseEvent) -> StopEvent:
        return StopEvent(result=ev.response)


def test_an_edit_while_a_step_runs_is_still_refused_at_once(store_url: str) -> None:
    """`rt.update_state` while a step of the run is running in this process is refused
    with `ResumeConflict` at once (not after waiting for the run to park), and nothing
    is stored."""
    run = new_run()

    async def go() -> tuple[float, int, int]:
        rt = RemitRuntime(store_url)
        wf = Slow(runtime=rt)
        handler = wf.run(run_id=run)
        for _ in range(GUARD * 100):
            if _seen(rt, run) and rt.checkpoints(run):
                break
            await asyncio.sleep(0.01)
        before = len(rt.checkpoints(run))
        began = time.monotonic()
        with pytest.raises(ResumeConflict):
            await rt.update_state(wf, run, {"text": "x"})
        took = time.monotonic() - began
        after = len(rt.checkpoints(run))
        await handler.cancel_run()
        with contextlib.suppress(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)
        return took, before, after

    took, before, after = asyncio.run(go())
    assert took < 1.0
    assert after == before


CHILD = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from test_llamaindex_probes48 import {flow}
from remit_llamaindex import RemitRuntime

async def main():
    rt = RemitRuntime({url!r}, lease=2.0)
    handler = {flow}(runtime=rt).run(run_id={run!r})
    await handler

asyncio.run(main())
"""


@pytest.mark.parametrize("flow", FLOWS, ids=lambda f: f.__name__)
def test_a_process_killed_as_its_pause_lands_leaves_the_pause_answerable(
    store_url: str, flow: type[Workflow]
) -> None:
    """A process SIGKILLed right after the commit that parks the run landed (before its
    copy named it, opened the question in the store or released its claim): the run
    reads "waiting" and, once the dead claim's lease has run out, an answer from another
    process is taken once and completes the run (L1, P5); a second is refused."""
    run = new_run()
    hit = asyncio.run(commits_to_pause(store_url, flow))
    code = CHILD.format(tests=TESTS, flow=flow.__name__, url=store_url, run=run)
    env = {**os.environ, "REMIT_FAILPOINTS": f"checkpoint.after_commit=kill@{hit}"}
    killed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "waiting"
    assert rt.recover(flow(runtime=rt), run) is None  # (a waiting run: nothing to recover)

    async def answer(who: str) -> Any:
        handler = await rt.respond(flow(runtime=rt), run, HumanResponseEvent(response=who))
        return await asyncio.wait_for(handler, GUARD)

    deadline = time.monotonic() + GUARD
    while True:
        try:
            result = asyncio.run(answer("ada"))
            break
        except ResumeConflict:  # (the dead claim's lease has not run out yet)
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert result == "hi ada"
    assert rt.status(run) == "completed"
    with pytest.raises(ResumeConflict):
        asyncio.run(answer("bob"))
    assert rt.result(run) == "hi ada"
    assert [i.status for i in rt.remit.interrupts(run)] == ["consumed"]


class Twice(Workflow):
    """Asks twice: the answer to the first question leads to the second."""

    @step
    async def ask(self, ev: StartEvent) -> InputRequiredEvent:
        return InputRequiredEvent(prefix="first?")

    @step
    async def answer(self, ctx: Context, ev: HumanResponseEvent) -> InputRequiredEvent | StopEvent:
        got = await ctx.store.get("got", default=[])
        got = [*got, ev.response]
        await ctx.store.set("got", got)
        if len(got) < 2:
            return InputRequiredEvent(prefix="second?")
        return StopEvent(result="+".join(got))


def test_a_snapshot_at_the_second_pause_once_the_status_reads_waiting(store_url: str) -> None:
    """The same at a run's second pause, reached by an answer given through the run's
    own handler (`rt.respond` of the copy parked here): once the store shows the second
    pause, the snapshot names it and its restore takes the second answer."""
    run = new_run()

    async def to_second(rt: RemitRuntime, name: str) -> tuple[Any, int]:
        wf = Twice(runtime=rt)
        handler = wf.run(run_id=name)
        await until_parked(rt, name)
        first = len(rt.checkpoints(name))
        await rt.respond(wf, name, HumanResponseEvent(response="a"))
        return handler, first

    async def calibrate() -> int:
        rt = RemitRuntime(store_url)
        name = new_run()
        handler, first = await to_second(rt, name)
        for _ in range(GUARD * 100):
            listed = rt.checkpoints(name)
            if len(listed) > first and listed[0].status == "waiting":
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        count = len(rt.checkpoints(name))
        await handler.cancel_run()
        return count

    async def go() -> tuple[str, str, Any]:
        hit = await calibrate()
        rt = RemitRuntime(store_url)
        failpoints.arm("checkpoint.after_commit", f"sleep:{HOLD}@{hit}")
        try:
            handler, first = await to_second(rt, run)
            for _ in range(GUARD * 100):
                listed = await asyncio.to_thread(rt.checkpoints, run)
                if len(listed) > first and listed[0].status == "waiting":
                    break
                await asyncio.sleep(0.01)
            snapshot = handler.ctx.to_dict()
            head = head_of(rt, run)
            await handler.cancel_run()
        finally:
            failpoints.disarm("checkpoint.after_commit")
        later = RemitRuntime(store_url)
        again = Twice(runtime=later)
        restored = again.run(ctx=Context.from_dict(again, snapshot))
        await later.send_event(restored, HumanResponseEvent(response="b"))
        return head, json.dumps(snapshot), await asyncio.wait_for(restored, GUARD)

    head, snapshot, result = asyncio.run(go())
    assert head in snapshot
    assert result == "a+b"


@pytest.mark.parametrize("flow", [*FLOWS, Twice], ids=lambda f: f.__name__)
def test_the_documented_pause_matches_the_frameworks_own_runtime(
    store_url: str, flow: type[Workflow]
) -> None:
    """Differential: the framework's documented pause (snapshot as each question streams,
    `cancel_run`, `Context.from_dict`, answer) gives the same results on `RemitRuntime`
    as on the framework's own runtime, round after round."""

    async def paused(wf: Workflow, ctx: Context | None) -> dict[str, Any]:
        handler = wf.run(ctx=ctx) if ctx is not None else wf.run()
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                snapshot = handler.ctx.to_dict()
                await handler.cancel_run()
                return snapshot
        raise AssertionError("no question streamed")

    async def rounds(make: Any) -> Any:
        snapshot = await paused(make(), None)
        for who in ("ada", "bob", "eve"):
            wf = make()
            handler = wf.run(ctx=Context.from_dict(wf, snapshot))
            handler.ctx.send_event(HumanResponseEvent(response=who))
            async for ev in handler.stream_events():
                if isinstance(ev, InputRequiredEvent):
                    snapshot = handler.ctx.to_dict()
                    await handler.cancel_run()
                    break
            else:
                return await asyncio.wait_for(handler, GUARD)
        raise AssertionError("the run did not end")

    own = asyncio.run(rounds(lambda: flow()))
    rt = RemitRuntime(store_url)
    on_remit = asyncio.run(rounds(lambda: flow(runtime=rt)))
    assert on_remit == own


class WriteThenWait(Workflow):
    """The question written to the stream by the step itself, then waited for."""

    @step
    async def start(self, ev: StartEvent) -> Prepared:
        return Prepared()

    @step
    async def wait(self, ctx: Context, ev: Prepared) -> StopEvent:
        ctx.write_event_to_stream(InputRequiredEvent(prefix="who?"))
        got = await ctx.wait_for_event(HumanResponseEvent)
        return StopEvent(result=f"hi {got.response}")


@pytest.mark.xfail(
    strict=True,
    raises=ForkWithoutIntent,
    reason="a question the step writes to the stream itself (ctx.write_event_to_stream, "
    "then wait_for_event) streams while the step is in flight, before its pause is "
    "committed: a snapshot taken as it streams names the checkpoint before the pause, "
    "and its restore is refused as a fork (the framework's own runtime re-runs the step)",
)
def test_a_snapshot_as_a_question_the_step_wrote_streams_matches_the_framework(
    store_url: str,
) -> None:
    """Differential: the documented pause on a step that writes its question to the
    stream and then waits gives the framework's own runtime's result."""

    async def answer(restored: Any, rt: RemitRuntime | None) -> None:
        """Once the restored step waits again (an answer sent before is dropped by the
        framework, refused by Remit)."""
        for _ in range(GUARD * 10):
            await asyncio.sleep(0.1)
            if rt is not None:
                with contextlib.suppress(ResumeConflict):
                    await rt.send_event(restored, HumanResponseEvent(response="ada"))
                    return
            elif "HumanResponseEvent" in json.dumps(restored.ctx.to_dict()["workers"]):
                restored.ctx.send_event(HumanResponseEvent(response="ada"))
                return
        raise AssertionError("the restored step never waited again")

    async def paused_and_answered(rt: RemitRuntime | None) -> Any:
        wf = WriteThenWait(runtime=rt) if rt is not None else WriteThenWait()
        handler = wf.run()
        snapshot: dict[str, Any] = {}
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                snapshot = handler.ctx.to_dict()
                await handler.cancel_run()
                break
        wf = WriteThenWait(runtime=rt) if rt is not None else WriteThenWait()
        restored = wf.run(ctx=Context.from_dict(wf, snapshot))
        await answer(restored, rt)
        return await asyncio.wait_for(restored, GUARD)

    own = asyncio.run(paused_and_answered(None))
    assert own == "hi ada"
    assert asyncio.run(paused_and_answered(RemitRuntime(store_url))) == own
