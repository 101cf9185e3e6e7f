"""Probes of `RemitRuntime` written from the contract, on SQLite, PostgreSQL and Redis:
a restored `wait_for_event(..., timeout=...)` still times out (after a pause and after a
SIGKILL), an answer to a restored timed wait still wins over its timer, and a state
edit of a step in flight is never half in the checkpoint of a parallel step.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_llamaindex import RemitRuntime
from remit_llamaindex import _snapshot as snap

#: Seconds the probe's wait may last; a restored wait must end by itself (the guard
#: below only keeps a broken run from hanging the suite).
WAIT_TIMEOUT = 0.5
GUARD = 60


class TimedAsk(Workflow):
    """One step asks and waits with a timeout; the result says how the wait ended."""

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        try:
            answer = await ctx.wait_for_event(
                HumanResponseEvent,
                waiter_event=InputRequiredEvent(prefix="ok?"),
                timeout=ev.get("timeout", WAIT_TIMEOUT),
            )
        except asyncio.TimeoutError:
            return StopEvent(result="timed out")
        return StopEvent(result=answer.response)


def new_run() -> str:
    return f"probe3-{uuid.uuid4().hex[:12]}"


async def parked(rt: RemitRuntime, run: str, **start: Any) -> None:
    """Start `run`, let it park on its question, and stop this copy of it (the
    framework's documented pause)."""
    handler = TimedAsk(timeout=None, runtime=rt).run(run_id=run, **start)
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    await handler.cancel_run()


def test_a_restored_timed_wait_still_times_out(store_url: str) -> None:
    """The framework schedules a waiter's timeout in memory only: restored from its
    snapshot, the wait would last for ever. The restored run times out as the live
    one does, and the run completes through the step's own `TimeoutError` path."""
    run = new_run()

    async def go() -> None:
        await parked(RemitRuntime(store_url), run)
        rt = RemitRuntime(store_url)
        flow = TimedAsk(timeout=None, runtime=rt)
        handler = flow.run(ctx=rt.context(flow, run))
        assert await asyncio.wait_for(handler, GUARD) == "timed out"
        assert rt.status(run) == "completed"

    asyncio.run(go())


def test_an_answer_to_a_restored_timed_wait_is_taken(store_url: str) -> None:
    """Re-arming the timeout does not get in the way of an answer delivered in time."""
    run = new_run()

    async def go() -> None:
        await parked(RemitRuntime(store_url), run, timeout=GUARD)
        rt = RemitRuntime(store_url)
        answer = HumanResponseEvent(response="ada")
        handler = await rt.respond(TimedAsk(timeout=None, runtime=rt), run, answer)
        assert await asyncio.wait_for(handler, GUARD) == "ada"

    asyncio.run(go())


DYING_WHILE_WAITING = """
import asyncio, os, signal, sys
sys.path.insert(0, {tests!r})
from workflows.events import InputRequiredEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes3 import TimedAsk

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = TimedAsk(timeout=None, runtime=rt).run(run_id={run!r})
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_a_timed_wait_of_a_killed_process_times_out_where_it_is_restored(
    store_url: str,
) -> None:
    """The process waiting is SIGKILLed; a process that restores the run gets the
    timeout (the alive time the wait had left), not a wait for ever."""
    run = new_run()
    code = DYING_WHILE_WAITING.format(tests=str(Path(__file__).parent), url=store_url, run=run)
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        assert rt.status(run) == "waiting"
        flow = TimedAsk(timeout=None, runtime=rt)
        handler = flow.run(ctx=rt.context(flow, run))
        assert await asyncio.wait_for(handler, GUARD) == "timed out"
        assert rt.status(run) == "completed"

    asyncio.run(go())


# -- a state edit racing a parallel step's checkpoint ------------------------------------


class Pair(BaseModel):
    first: int = 0
    second: int = 0
    noted: str = ""


class Go(Event):
    pass


class Quick(Event):
    pass


class Done(Event):
    pass


class Racing(Workflow):
    """`edit` writes `noted`, then changes both fields in one `edit_state` block and,
    inside it, waits until `quick`'s step result is committed as a checkpoint."""

    def __init__(self, rt: RemitRuntime, run: str, **kw: Any) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt, self.run_key = rt, run

    @step
    async def start(self, ctx: Context[Pair], ev: StartEvent) -> Go | Quick | None:
        ctx.send_event(Go())
        return None

    @step
    async def edit(self, ctx: Context[Pair], ev: Go) -> Done:
        await ctx.store.set("noted", "yes")
        async with ctx.store.edit_state() as state:
            state.first = 1
            ctx.send_event(Quick())
            while not any(c.step == "quick" for c in self.rt.checkpoints(self.run_key)):
                await asyncio.sleep(0.02)
            state.second = 1
        return Done()

    @step
    async def quick(self, ctx: Context[Pair], ev: Quick) -> None:
        return None

    @step
    async def end(self, ctx: Context[Pair], ev: Done) -> StopEvent:
        return StopEvent(result="ok")


def test_a_state_edit_in_flight_is_never_half_in_a_checkpoint(store_url: str) -> None:
    """P1/P4: `quick` completes, and is checkpointed, while `edit` is inside its
    `edit_state` block: that checkpoint holds `edit`'s earlier `set` (not lost) and none
    of the block's changes (not half of them); the final one holds all of them."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        assert await asyncio.wait_for(Racing(rt, run).run(run_id=run), GUARD) == "ok"
        states = {}
        for c in rt.checkpoints(run):
            record = rt.remit.checkpoint(run, c.checkpoint_id)
            assert record is not None
            fields = snap.state_fields(snap.decode(record.state).get("state") or {}) or {}
            states[c.checkpoint_id] = (c.step, fields)
        assert all(f.get("first", 0) == f.get("second", 0) for _, f in states.values())
        (at_quick,) = [f for s, f in states.values() if s == "quick"]
        assert (at_quick["noted"], at_quick["first"]) == ("yes", 0)
        assert rt.get_state(Racing(rt, run), run) == Pair(first=1, second=1, noted="yes")

    asyncio.run(go())
