"""LlamaIndex probes, round 21, on SQLite, PostgreSQL and Redis.

A typed state field given a value its model accepts in another form (`{"n": "5"}`
for an int, a dict for a nested model, an ISO string for a datetime), through
`rt.update_state`, `ctx.store` or the server's state store, was refused with
`CheckpointInvalid` telling the user to "store plain JSON values", which it was. It
is now taken as the model reads it (what the checkpoint gives back): the live state
and every later read hold that same value.

An answer sent while a looping step was still on its way to asking again was refused
as "interrupt was already consumed", naming the previous round's interrupt. It is
still refused (the run would drop it), now saying that a step is still in flight.

`RemitWorkflowStore(poll_interval=...)` took any value: 0 or less made the server's
event streams read the store in a busy loop, anything but a number failed only inside
the first stream. It is now checked where the store is made, naming the option.
"""

import asyncio
import uuid
from datetime import datetime
from typing import Any

import pytest
from pydantic import BaseModel
from workflows import Context, Workflow, step
from workflows.context.serializers import JsonSerializer
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid, ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 20.0


def new_run() -> str:
    return f"probe21-{uuid.uuid4().hex[:12]}"


async def _until_asked(handler: Any) -> InputRequiredEvent:
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            return ev
    raise AssertionError("the run never asked")


# -- a typed value the model accepts in another form ---------------------------------------


class Inner(BaseModel):
    x: int = 0


class Typed(BaseModel):
    n: int = 0
    inner: Inner = Inner()
    when: datetime | None = None


class TypedFlow(Workflow):
    @step
    async def ask(self, ctx: Context[Typed], ev: StartEvent) -> StopEvent:
        await ctx.store.set("n", "5")  # the int field, given as a str
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="go?")
        )
        state = await ctx.store.get_state()
        return StopEvent(
            result={
                "answer": answer.response,
                "n": state.n,
                "x": state.inner.x,
                "when": None if state.when is None else state.when.isoformat(),
            }
        )


def test_a_typed_value_the_model_accepts_in_another_form_is_stored_as_it_reads(
    store_url: str,
) -> None:
    """`ctx.store.set("n", "5")`, `rt.update_state` of a stored run and of one parked
    in this process: each is stored as the model reads it, and read back the same."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = TypedFlow(runtime=rt).run(run_id=run)
        await asyncio.wait_for(_until_asked(handler), GUARD)
        await handler.cancel_run()  # parked: stored, resumable elsewhere
        assert RemitRuntime(store_url).get_state(TypedFlow(), run).n == 5

        editor = RemitRuntime(store_url)
        head = await editor.update_state(
            TypedFlow(), run, {"inner": {"x": 3}, "when": "2024-01-02T03:04:05"}
        )
        state = RemitRuntime(store_url).get_state(TypedFlow(), run)
        assert state == Typed(n=5, inner=Inner(x=3), when=datetime(2024, 1, 2, 3, 4, 5))

        # The value the state holds, in another form: nothing changes, nothing is stored.
        before = len(editor.checkpoints(run))
        assert await editor.update_state(TypedFlow(), run, {"n": "5"}) == head
        assert len(editor.checkpoints(run)) == before

        # A value the model refuses is still refused, naming the field.
        with pytest.raises(CheckpointInvalid) as refused:
            await editor.update_state(TypedFlow(), run, {"n": "five"})
        assert refused.value.field == "n"

        # Parked in this process: the edit goes through the live handler's store.
        rt2 = RemitRuntime(store_url)
        flow = TypedFlow(runtime=rt2)
        parked = flow.run(ctx=rt2.context(flow, run))
        await rt2.update_state(flow, run, {"inner.x": "7"})
        await rt2.send_event(parked, HumanResponseEvent(response="ok"))
        result = await asyncio.wait_for(parked, GUARD)
        assert result == {"answer": "ok", "n": 5, "x": 7, "when": "2024-01-02T03:04:05"}
        final = RemitRuntime(store_url).get_state(TypedFlow(), run)
        assert final.inner == Inner(x=7) and final.n == 5

    asyncio.run(go())


def test_the_server_state_store_takes_a_typed_value_as_its_model_reads_it(
    store_url: str,
) -> None:
    """The server's state store (`RemitWorkflowStore.create_state_store`) too."""
    from remit_llamaindex.server import RemitWorkflowStore

    run = new_run()

    async def go() -> None:
        store = RemitWorkflowStore(store_url)
        state = store.create_state_store(run, Typed, serializer=JsonSerializer())
        await state.set("n", "5")
        await state.set("inner", {"x": 3})
        assert await state.get("n") == 5
        fresh = RemitWorkflowStore(store_url).create_state_store(
            run, Typed, serializer=JsonSerializer()
        )
        assert await fresh.get_state() == Typed(n=5, inner=Inner(x=3))
        with pytest.raises(CheckpointInvalid) as refused:
            await state.set("n", "five")
        assert refused.value.field == "n"

    asyncio.run(go())


# -- an answer sent while a looping step has not asked again yet ----------------------------


class Round(Event):
    n: int


# (entered, release) of the test running: the second round's step sets the first and
# waits for the second, so the test knows a step is in flight before it answers.
_gates: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}


class AskEachRound(Workflow):
    @step
    async def begin(self, ev: StartEvent) -> Round:
        return Round(n=0)

    @step
    async def ask(self, ctx: Context, ev: Round) -> Round | StopEvent:
        if ev.n == 1:
            entered, release = _gates["current"]
            entered.set()
            await release.wait()  # the second round, on its way to asking
        answer = await ctx.wait_for_event(
            HumanResponseEvent,
            waiter_event=InputRequiredEvent(prefix=f"round {ev.n}"),
        )
        if ev.n == 1:
            return StopEvent(result=answer.response)
        return Round(n=ev.n + 1)


def test_an_answer_sent_before_a_loop_asks_again_says_a_step_is_in_flight(
    store_url: str,
) -> None:
    """Refused by the live handler (`rt.send_event`) and by another resumer
    (`rt.respond`), with a message that says a step is still in flight, not that the
    previous round's interrupt was consumed; the answer sent once the run asks again
    is taken."""
    run = new_run()

    async def go() -> None:
        entered, release = asyncio.Event(), asyncio.Event()
        _gates["current"] = (entered, release)
        rt = RemitRuntime(store_url)
        handler = AskEachRound(runtime=rt, timeout=GUARD).run(run_id=run)
        await asyncio.wait_for(_until_asked(handler), GUARD)
        await rt.send_event(handler, HumanResponseEvent(response="first"))
        await asyncio.wait_for(entered.wait(), GUARD)

        with pytest.raises(ResumeConflict) as early:
            await rt.send_event(handler, HumanResponseEvent(response="early"))
        assert "in flight" in str(early.value)
        assert "already consumed" not in str(early.value)

        other = RemitRuntime(store_url)
        with pytest.raises(ResumeConflict) as elsewhere:
            await other.respond(AskEachRound(runtime=other), run, HumanResponseEvent(response="x"))
        assert "in flight" in str(elsewhere.value)
        assert "already consumed" not in str(elsewhere.value)

        release.set()
        asked = await asyncio.wait_for(_until_asked(handler), GUARD)
        assert asked.prefix == "round 1"
        await rt.send_event(handler, HumanResponseEvent(response="second"))
        assert await asyncio.wait_for(handler, GUARD) == "second"

    try:
        asyncio.run(go())
    finally:
        _gates.pop("current", None)


# -- the workflow store's poll interval ------------------------------------------------------


@pytest.mark.parametrize(
    ("poll_interval", "error"),
    [
        (0, ValueError),
        (-1.0, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("0.2", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_a_workflow_store_poll_interval_is_checked_where_it_is_made(
    poll_interval: Any, error: type[Exception]
) -> None:
    from remit_llamaindex.server import RemitWorkflowStore

    with pytest.raises(error, match="poll_interval"):
        RemitWorkflowStore("sqlite:///remit.db", poll_interval=poll_interval)
    assert RemitWorkflowStore("sqlite:///remit.db", poll_interval=1).poll_interval == 1.0


class Classic(Workflow):
    """The classic pattern: one step asks, another takes the answer (and runs a while)."""

    @step
    async def ask(self, ev: StartEvent) -> InputRequiredEvent:
        return InputRequiredEvent(prefix="approve?")

    @step
    async def take(self, ev: HumanResponseEvent) -> StopEvent:
        entered, release = _gates["current"]
        entered.set()
        await release.wait()
        return StopEvent(result=ev.response)


def test_a_second_classic_answer_while_its_taker_is_in_flight_stays_refused(
    store_url: str,
) -> None:
    """An answer to the classic pattern's one question, sent while the step that took
    the first answer still runs, is refused as before (the question was answered),
    not delivered as an ordinary event to that step: the run ends with the first."""
    run = new_run()

    async def go() -> None:
        entered, release = asyncio.Event(), asyncio.Event()
        _gates["current"] = (entered, release)
        rt = RemitRuntime(store_url)
        handler = Classic(runtime=rt, timeout=GUARD).run(run_id=run)
        await asyncio.wait_for(_until_asked(handler), GUARD)
        await rt.send_event(handler, HumanResponseEvent(response="first"))
        await asyncio.wait_for(entered.wait(), GUARD)
        with pytest.raises(ResumeConflict, match="answered already"):
            await rt.send_event(handler, HumanResponseEvent(response="second"))
        release.set()
        assert await asyncio.wait_for(handler, GUARD) == "first"

    try:
        asyncio.run(go())
    finally:
        _gates.pop("current", None)
