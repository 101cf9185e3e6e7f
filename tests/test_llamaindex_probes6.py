"""Probes of `RemitRuntime` written from the contract, on SQLite, PostgreSQL and Redis.

`rt.cancel` of a run parked with a live handler in this process ends that handler
too (as `handler.cancel_run()` would), instead of leaving it waiting for ever for an
answer the cancelled run can no longer take. `rt.context` given a fork's run id and
a checkpoint continues that fork, never the branch it was forked from: a fresh
fork's head is its base, a checkpoint stored on the original branch, and continuing
the original there would hand it the fork's answer (L3). `rt.result` answers what
awaiting the run's handler returned, also when a `StopEvent` subclass ended it.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ForkWithoutIntent
from remit_llamaindex import RemitRuntime

GUARD = 15


def new_run() -> str:
    return f"probe6-{uuid.uuid4().hex[:12]}"


class Ask(Workflow):
    """One step waits for an answer and returns it."""

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who?"), timeout=None
        )
        return StopEvent(result=answer.response)


class Done(StopEvent):
    total: int


class Total(Workflow):
    """Ends with a `StopEvent` subclass: awaiting the handler returns the event itself."""

    @step
    async def add(self, ctx: Context, ev: StartEvent) -> Done:
        return Done(total=ev.get("a", 0) + ev.get("b", 0))


async def parked_handler(rt: RemitRuntime, run: str) -> object:
    handler = Ask(timeout=None, runtime=rt).run(run_id=run)
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    return handler


def test_rt_cancel_ends_the_handler_of_a_run_parked_here(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = await parked_handler(rt, run)
        head = await rt.cancel(run)
        assert rt.status(run) == "cancelled"
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)  # type: ignore[arg-type]
        # Stopping the parked copy wrote nothing: the cancelled end is the head.
        assert rt.checkpoints(run)[0].checkpoint_id == head
        assert rt.status(run) == "cancelled"

    asyncio.run(go())


def test_a_checkpoint_given_with_a_fork_run_id_continues_that_fork(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow = Ask(timeout=None, runtime=rt)
        handler = await parked_handler(rt, run)
        await handler.cancel_run()  # type: ignore[attr-defined]
        base = rt.checkpoints(run)[0].checkpoint_id
        fork = rt.fork(run, base, fork_token="what-if")
        main_head = rt.checkpoints(run)[0].checkpoint_id

        forked = flow.run(ctx=rt.context(flow, fork, checkpoint_id=base))
        await rt.send_event(forked, HumanResponseEvent(response="eve"))
        assert await asyncio.wait_for(forked, GUARD) == "eve"
        assert rt.status(fork) == "completed" and rt.result(fork) == "eve"
        # The original branch did not move and still waits for its own answer.
        assert rt.status(run) == "waiting"
        assert [c for c in rt.checkpoints(run) if c.branch == "main"][0].checkpoint_id == main_head

        # A checkpoint that is not the fork's head is a fork of it: refused without a token.
        with pytest.raises(ForkWithoutIntent):
            flow.run(ctx=rt.context(flow, fork, checkpoint_id=base))

        resumed = await rt.respond(flow, run, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(resumed, GUARD) == "ada"
        assert rt.result(run) == "ada" and rt.result(fork) == "eve"

    asyncio.run(go())


def test_rt_result_is_what_the_handler_returned_for_a_stop_event_subclass(
    store_url: str,
) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        returned = await Total(runtime=rt).run(run_id=run, a=3, b=4)
        assert returned == Done(total=7)
        assert RemitRuntime(store_url).result(run) == returned

    asyncio.run(go())
