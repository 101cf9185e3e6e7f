"""State edits of a parked LlamaIndex run whose handler is live in this process, on
SQLite, PostgreSQL and Redis: an edit from outside (`rt.update_state`) and a write
through the handler (`handler.ctx.store.set`) that is refused.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from pydantic import BaseModel, Field
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid, ResumeConflict
from remit_llamaindex import RemitRuntime


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)
    note: str = ""
    approved_by: str | None = None


class Asked(Event):
    pass


class Approval(Workflow):
    """`prepare` sets the amount; `approve` waits for a `HumanResponseEvent` and ends
    with the state it then holds."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> Asked:
        await ctx.store.set("amount", 100)
        return Asked()

    @step
    async def approve(self, ctx: Context[Order], ev: Asked) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        await ctx.store.set("approved_by", answer.response)
        return StopEvent(result=(await ctx.store.get_state()).model_dump())


async def parked(rt: RemitRuntime, run: str) -> tuple[Approval, Any]:
    """Start `run` and return its workflow and live handler once the run is parked."""
    flow = Approval(runtime=rt)
    handler = flow.run(run_id=run)
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    while rt.checkpoints(run)[0].status != "waiting":
        await asyncio.sleep(0.02)
    return flow, handler


def new_run() -> str:
    return f"li-{uuid.uuid4().hex[:12]}"


def test_update_state_of_a_run_parked_here_keeps_its_handler_going(store_url: str) -> None:
    """A human edits the paused run (`rt.update_state`), then answers through the handler
    that is still live in this process. The edit must not leave that handler a stale
    copy whose answer is refused: the run goes on from the edited head, the edit is in
    the final state, and the history is one line. An invalid edit commits nothing."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow, handler = await parked(rt, run)
        before = rt.checkpoints(run)[0].checkpoint_id
        with pytest.raises(CheckpointInvalid) as invalid:
            await rt.update_state(flow, run, {"amount": -1})
        assert invalid.value.field == "amount"
        assert rt.checkpoints(run)[0].checkpoint_id == before
        edited = await rt.update_state(flow, run, {"amount": 7, "note": "halved"})
        head = rt.checkpoints(run)[0]
        assert (head.checkpoint_id, head.parent_id, head.status) == (edited, before, "waiting")
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        result = await handler
        assert result == {"amount": 7, "note": "halved", "approved_by": "ada"}
        history = rt.checkpoints(run)
        assert [c.parent_id for c in history[:-1]] == [c.checkpoint_id for c in history[1:]]
        assert {c.branch for c in history} == {"main"}

    asyncio.run(go())


def test_a_refused_state_write_to_a_parked_run_does_not_land_later(store_url: str) -> None:
    """A write through the live handler of a parked run is committed at once; while
    another resumer holds the run it is refused (`ResumeConflict`). The refused value
    must not stay in the handler's state, where the run's next checkpoint would
    commit it after all."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow, handler = await parked(rt, run)
        other = RemitRuntime(store_url)
        held = other.remit.claim(run, "main")
        with pytest.raises(ResumeConflict):
            await handler.ctx.store.set("note", "refused")
        held.release()
        assert await handler.ctx.store.get("note") == ""
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        assert (await handler)["note"] == ""
        assert rt.get_state(flow, run).model_dump()["note"] == ""

    asyncio.run(go())
