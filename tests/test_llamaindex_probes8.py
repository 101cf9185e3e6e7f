"""Probes of `RemitRuntime` written from the contract, on SQLite, PostgreSQL and Redis.

The framework documents a run's `Context` as the way "to resume or share state
across runs": `await wf.run(ctx=ctx, ...)` again once the run ended (or with
`Context.from_dict` of its `to_dict()`) starts a new run that begins with the ended
run's state. On Remit that is a new run of its own, under its own id, and the
ended run stays as it was; before, it answered the ended run's result again.

A run id naming a fork's branch that the store does not hold is unknown to
`rt.context(..., checkpoint_id=...)` and `rt.fork` as it is to the other reads
(`UnknownRecord`); before, the context failed later with a `ForkWithoutIntent` that
blamed the checkpoint, and `rt.fork` made a new branch of the run.

`rt.send_event(handler, ...)` once the handler's run has ended refuses the event with
`ResumeConflict`, as `rt.respond` does (naming the interrupt it would have answered);
before, it raised `UnknownRecord` advising to restore the run.

A state set on a `Context` before its run starts (the framework's staging store, not
validated) that fails the workflow's state model is refused with `CheckpointInvalid`
naming the field, before anything is stored; before, pydantic's own error escaped.

`RemitWorkflowStore.delete` with a query that has no filter deletes nothing, as the
server's own durable stores (SQLite, PostgreSQL) do; before, it deleted every handler.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import datetime, timezone

import pytest
from llama_agents.server import HandlerQuery, PersistentHandler
from pydantic import BaseModel, Field
from test_llamaindex_probes6 import Ask, parked_handler
from workflows import Context, Workflow, step
from workflows.events import HumanResponseEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid, ResumeConflict, UnknownRecord
from remit_llamaindex import RemitRuntime, RemitWorkflowStore

GUARD = 30


def new_run() -> str:
    return f"probe8-{uuid.uuid4().hex[:12]}"


class Visits(BaseModel):
    count: int = 0
    seen: list[str] = []


class Counter(Workflow):
    """Counts its runs in the state, and answers with the run's message and count."""

    @step
    async def count(self, ctx: Context[Visits], ev: StartEvent) -> StopEvent:
        async with ctx.store.edit_state() as state:
            state.count += 1
            state.seen.append(ev.get("msg"))
        return StopEvent(result=f"{ev.get('msg')}:{state.count}")


def test_a_context_of_an_ended_run_carries_its_state_into_a_new_run(store_url: str) -> None:
    first = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = Counter(timeout=None, runtime=rt)
        ctx: Context[Visits] = Context(wf)
        handler = wf.run(ctx=ctx, run_id=first, msg="a")
        assert await asyncio.wait_for(handler, GUARD) == "a:1"
        ended = rt.checkpoints(first)

        again = wf.run(ctx=ctx, msg="b")  # the same context, again
        assert await asyncio.wait_for(again, GUARD) == "b:2"
        second = again.run_id
        assert second != first
        assert rt.get_state(wf, second) == Visits(count=2, seen=["a", "b"])

        # The same through a snapshot of the ended run, in another runtime.
        other = RemitRuntime(store_url)
        flow = Counter(timeout=None, runtime=other)
        snapshot = again.ctx.to_dict()
        third = flow.run(ctx=Context.from_dict(flow, snapshot), msg="c")
        assert await asyncio.wait_for(third, GUARD) == "c:3"
        assert other.result(third.run_id) == "c:3"
        assert other.get_state(flow, third.run_id) == Visits(count=3, seen=["a", "b", "c"])

        # The ended runs were only read: their records are as they were.
        assert rt.checkpoints(first) == ended
        assert rt.result(first) == "a:1" and rt.result(second) == "b:2"
        assert rt.get_state(wf, first) == Visits(count=1, seen=["a"])

    asyncio.run(go())


def test_a_store_delete_without_a_filter_deletes_nothing(store_url: str) -> None:
    store = RemitWorkflowStore(store_url, namespace=uuid.uuid4().hex[:8])
    now = datetime.now(timezone.utc)
    runs = [new_run() for _ in range(3)]

    async def go() -> None:
        for n, run in enumerate(runs):
            status = "completed" if n else "running"
            await store.update(
                PersistentHandler(
                    handler_id=f"h-{run}",
                    workflow_name="w",
                    status=status,
                    run_id=run,
                    started_at=now,
                )
            )
        assert await store.delete(HandlerQuery()) == 0
        assert await store.delete(HandlerQuery(handler_id_in=[])) == 0
        left = await store.query(HandlerQuery())
        assert sorted(h.handler_id for h in left) == sorted(f"h-{r}" for r in runs)
        # A filter still deletes what it matches, and only that.
        assert await store.delete(HandlerQuery(status_in=["completed"])) == 2
        assert [h.handler_id for h in await store.query(HandlerQuery())] == [f"h-{runs[0]}"]

    asyncio.run(go())


def test_a_fork_id_the_store_does_not_hold_is_unknown(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow = Ask(timeout=None, runtime=rt)
        handler = await parked_handler(rt, run)
        await handler.cancel_run()  # type: ignore[attr-defined]
        head = rt.checkpoints(run)[0].checkpoint_id
        branches = rt.remit.branches(run)
        unheld = f"{run}@fork-0123456789abcdef"
        with pytest.raises(UnknownRecord) as unknown:
            rt.context(flow, unheld, checkpoint_id=head)
        assert unknown.value.run_id == run
        with pytest.raises(UnknownRecord):
            rt.context(flow, unheld, checkpoint_id=head, fork_token="what-if")
        with pytest.raises(UnknownRecord):
            rt.fork(unheld, head, "what-if")
        assert rt.remit.branches(run) == branches
        # The run itself is as it was, and a real fork of it is made as usual.
        fork = rt.fork(run, head, "what-if")
        forked = flow.run(ctx=rt.context(flow, fork, checkpoint_id=head))
        await rt.send_event(forked, HumanResponseEvent(response="eve"))
        assert await asyncio.wait_for(forked, GUARD) == "eve"
        assert rt.status(run) == "waiting"

    asyncio.run(go())


def test_an_event_sent_to_the_handler_of_an_ended_run_is_a_resume_conflict(
    store_url: str,
) -> None:
    run, cancelled, stopped = new_run(), new_run(), new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = await parked_handler(rt, run)
        await rt.send_event(handler, HumanResponseEvent(response="ada"))  # type: ignore[arg-type]
        assert await asyncio.wait_for(handler, GUARD) == "ada"  # type: ignore[arg-type]
        history = rt.checkpoints(run)
        with pytest.raises(ResumeConflict) as refused:
            await rt.send_event(handler, HumanResponseEvent(response="bob"))  # type: ignore[arg-type]
        assert refused.value.interrupt_id == rt.remit.interrupts(run)[0].interrupt_id
        other = RemitRuntime(store_url)
        with pytest.raises(ResumeConflict):
            await other.respond(Ask(runtime=other), run, HumanResponseEvent(response="bob"))
        assert rt.checkpoints(run) == history and rt.result(run) == "ada"

        # Ended for good with `rt.cancel`: refused the same way.
        ended = await parked_handler(rt, cancelled)
        await rt.cancel(cancelled)
        with pytest.raises(ResumeConflict, match="ended"):
            await rt.send_event(ended, HumanResponseEvent(response="bob"))  # type: ignore[arg-type]
        assert rt.status(cancelled) == "cancelled"

        # A copy stopped while parked (`cancel_run`) leaves the run waiting: that run is
        # restored to be answered, as before.
        copy = await parked_handler(rt, stopped)
        await copy.cancel_run()  # type: ignore[attr-defined]
        with pytest.raises(UnknownRecord):
            await rt.send_event(copy, HumanResponseEvent(response="bob"))  # type: ignore[arg-type]
        answered = await rt.respond(Ask(runtime=rt), stopped, HumanResponseEvent(response="eve"))
        assert await asyncio.wait_for(answered, GUARD) == "eve"

    asyncio.run(go())


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)


class Charge(Workflow):
    @step
    async def charge(self, ctx: Context[Order], ev: StartEvent) -> StopEvent:
        return StopEvent(result=(await ctx.store.get_state()).amount)


def test_a_staged_state_that_fails_the_model_is_refused_naming_the_field(
    store_url: str,
) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = Charge(timeout=None, runtime=rt)
        ctx: Context[Order] = Context(wf)
        await ctx.store.set("amount", -1)  # the staging store does not validate
        with pytest.raises(CheckpointInvalid) as refused:
            await asyncio.wait_for(wf.run(ctx=ctx, run_id=run), GUARD)
        assert refused.value.field == "amount" and refused.value.run_id == run
        with pytest.raises(UnknownRecord):
            rt.status(run)  # nothing was stored

        staged: Context[Order] = Context(wf)
        await staged.store.set("amount", 7)
        assert await asyncio.wait_for(wf.run(ctx=staged, run_id=run), GUARD) == 7
        assert rt.get_state(wf, run) == Order(amount=7)

    asyncio.run(go())
