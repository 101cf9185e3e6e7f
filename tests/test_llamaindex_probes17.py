"""LlamaIndex probes, round 17, on SQLite, PostgreSQL and Redis.

An event that resolves two waiters (one without requirements, one whose
requirements it meets) consumed their interrupts one at a time: refused at the
second (already answered), it left the first consumed with a value its sender was
told was not delivered; the live run then refused every answer to that waiter, and
a recovery would have continued with the refused value. Every interrupt an event
would answer is now checked before any is consumed.

A context snapshot whose Remit handle was edited or written by hand (no `run_id`,
a `checkpoint_id` that is no string) failed with a bare `KeyError`, or was taken as
a fork of the run; it is now `CheckpointInvalid` naming the field, and nothing is
stored.

`rt.send_event(handler, event, step=...)` skipped the framework's check of a
targeted send: an event aimed at a step that does not take it was delivered to
a waiter of another step (consuming its interrupt), and a step name with a typo
was refused as an event the run would drop, without naming the step. Both are now
refused before anything is delivered (`ResumeConflict` naming the step and what the
framework's own check of a targeted send says).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import CheckpointInvalid, ResumeConflict, UnknownRecord
from remit_llamaindex import RemitRuntime

GUARD = 20.0


def new_run() -> str:
    return f"probe17-{uuid.uuid4().hex[:12]}"


async def _until_waiting(rt: RemitRuntime, run: str, waiters: int) -> None:
    """Until the stored head waits for `waiters` interrupts."""
    for _ in range(400):
        try:
            checkpoints = await asyncio.to_thread(rt.checkpoints, run)
        except UnknownRecord:
            checkpoints = []
        if checkpoints and checkpoints[0].status == "waiting":
            if len(checkpoints[0].waiting) == waiters:
                return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} never waited for {waiters} interrupts")


class Got(Event):
    who: str
    answer: str


class TwoWaiters(Workflow):
    """Two steps wait for the same event type: one for any answer, one only for "b"."""

    @step
    async def first_only_b(self, ctx: Context, ev: StartEvent) -> Got:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, requirements={"response": "b"}, waiter_id="only-b"
        )
        return Got(who="first_only_b", answer=answer.response)

    @step
    async def then_any(self, ctx: Context, ev: StartEvent) -> Got:
        answer = await ctx.wait_for_event(HumanResponseEvent, waiter_id="any")
        return Got(who="then_any", answer=answer.response)

    @step
    async def both(self, ctx: Context, ev: Got) -> StopEvent | None:
        got = ctx.collect_events(ev, [Got, Got])
        if got is None:
            return None
        return StopEvent(result=sorted((g.who, g.answer) for g in got))


def test_an_answer_refused_at_one_of_its_waiters_consumes_none_of_them(url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        handler: Any = TwoWaiters(timeout=None, runtime=rt).run(run_id=run)
        await _until_waiting(rt, run, 2)
        await rt.send_event(handler, HumanResponseEvent(response="x"))  # answers "any"
        # "b" would answer both waiters; "any" has its answer already, so it is refused.
        with pytest.raises(ResumeConflict, match="already consumed") as refused:
            await rt.send_event(handler, HumanResponseEvent(response="b"))
        assert refused.value.interrupt_id is not None
        assert refused.value.interrupt_id.startswith("then_any:")
        stored = {i.interrupt_id.split(":")[0]: i for i in rt.remit.interrupts(run)}
        assert stored["then_any"].status == "consumed"
        # The refused value is stored nowhere: a recovery could not continue with it.
        assert stored["first_only_b"].status == "pending" and stored["first_only_b"].value is None
        await handler.cancel_run()

    asyncio.run(go())


class Ask(Workflow):
    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        await ctx.store.set("asked", True)
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who?")
        )
        return StopEvent(result=answer.response)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"run_id": None}, "state.run_id"),
        ({"run_id": 5}, "state.run_id"),
        ({"checkpoint_id": 7}, "state.checkpoint_id"),
        ({"branch": ["main"]}, "state.branch"),
        ({"fork_token": ""}, "state.fork_token"),
    ],
)
def test_a_hand_edited_handle_is_refused_naming_its_field(
    url: str, edit: dict[str, Any], field: str
) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        handler: Any = Ask(timeout=None, runtime=rt).run(run_id=run)
        await _until_waiting(rt, run, 1)
        snapshot = handler.ctx.to_dict()
        await handler.cancel_run()
        history = rt.checkpoints(run)
        handle = {k: v for k, v in {**snapshot["state"], **edit}.items() if v is not None}

        other = RemitRuntime(url)
        flow = Ask(timeout=None, runtime=other)
        copy = f"{run}-copy"
        with pytest.raises(CheckpointInvalid) as refused:
            flow.run(ctx=Context.from_dict(flow, {**snapshot, "state": handle}), run_id=copy)
        assert refused.value.field == field
        assert rt.checkpoints(run) == history
        with pytest.raises(UnknownRecord):
            other.status(copy)  # nothing stored under the copy's id either

        # The snapshot as it was given still continues the run.
        again = Ask(timeout=None, runtime=other)
        resumed: Any = again.run(ctx=Context.from_dict(again, snapshot))
        await other.send_event(resumed, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(resumed, GUARD) == "ada"

    asyncio.run(go())


class Poke(Event):
    n: int = 0


class Poked(Workflow):
    """A step that waits for an answer, and a step that takes `Poke`s sent from outside."""

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(HumanResponseEvent)
        return StopEvent(result=answer.response)

    @step
    async def poke(self, ctx: Context, ev: Poke) -> None:
        await ctx.store.set("poked", ev.n)


def test_a_send_aimed_at_a_step_is_checked_as_the_framework_checks_it(url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url)
        handler: Any = Poked(timeout=None, disable_validation=True, runtime=rt).run(run_id=run)
        await _until_waiting(rt, run, 1)
        history = rt.checkpoints(run)
        with pytest.raises(ResumeConflict, match="Step pokes does not exist"):
            await rt.send_event(handler, Poke(n=1), step="pokes")
        with pytest.raises(ResumeConflict, match="Step ask does not accept"):
            await rt.send_event(handler, Poke(n=2), step="ask")
        # An answer aimed at a step that does not take it reaches no waiter of another.
        with pytest.raises(ResumeConflict, match="Step poke does not accept"):
            await rt.send_event(handler, HumanResponseEvent(response="z"), step="poke")
        assert [i.status for i in rt.remit.interrupts(run)] in ([], ["pending"])
        assert rt.checkpoints(run) == history

        # Aimed right, a send still goes where it was sent; the answer goes untargeted.
        await rt.send_event(handler, Poke(n=3), step="poke")
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(handler, GUARD) == "ada"
        assert rt.get_state(Poked(disable_validation=True, runtime=rt), run)["poked"] == 3

    asyncio.run(go())
