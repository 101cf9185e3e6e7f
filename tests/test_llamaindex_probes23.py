"""LlamaIndex probes, round 23, on SQLite, PostgreSQL and Redis.

State written to the context of a run that has ended (`await handler`, then
`ctx.store.set(...)`) is what the framework carries into the context's next run;
with Remit the next run began with the ended run's stored state, the write dropped
without a word. A write made as the run's `StopEvent` streams, before its task
ended, committed a checkpoint after the completed one whose status read "running":
the run's result was gone (`rt.result` said it had not ended) and `rt.recover`
started it again.
"""

import asyncio
import uuid
from typing import Any

import pytest
from workflows import Context, Workflow, step
from workflows.events import StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid
from remit_llamaindex import RemitRuntime

GUARD = 20.0


def new_run() -> str:
    return f"probe23-{uuid.uuid4().hex[:12]}"


class Tally(Workflow):
    @step
    async def count(self, ctx: Context, ev: StartEvent) -> StopEvent:
        runs = await ctx.store.get("runs", default=0)
        await ctx.store.set("runs", runs + 1)
        return StopEvent(result=await ctx.store.get("note", default=None))


def test_state_written_to_an_ended_runs_context_is_carried_into_its_next_run(
    store_url: str,
) -> None:
    first, second = new_run(), new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow = Tally(timeout=None, runtime=rt)
        ctx: Context[Any] = Context(flow)
        assert await asyncio.wait_for(flow.run(ctx=ctx, run_id=first), GUARD) is None
        history = rt.checkpoints(first)

        await ctx.store.set("note", "carried")
        handler = flow.run(ctx=ctx, run_id=second)
        assert await asyncio.wait_for(handler, GUARD) == "carried"
        assert await handler.ctx.store.get("runs") == 2
        assert rt.get_state(flow, second).get("note") == "carried"
        # The ended run is left as it was.
        assert rt.checkpoints(first) == history
        assert rt.get_state(flow, first).get("note") is None

    asyncio.run(go())


def test_a_carried_state_edited_by_hand_is_refused_naming_the_field(store_url: str) -> None:
    first = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow = Tally(timeout=None, runtime=rt)
        handler = flow.run(run_id=first)
        await asyncio.wait_for(handler, GUARD)
        snapshot = handler.ctx.to_dict()
        snapshot["state"]["state"] = "not a state payload"
        second = new_run()
        with pytest.raises(CheckpointInvalid) as refused:
            flow.run(ctx=Context.from_dict(flow, snapshot), run_id=second)
        assert refused.value.field == "state.state"

    asyncio.run(go())


def test_a_write_as_the_stop_event_streams_leaves_the_run_completed(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow = Tally(timeout=None, runtime=rt)
        handler = flow.run(run_id=run)
        async for ev in handler.stream_events():
            if isinstance(ev, StopEvent):
                await handler.ctx.store.set("note", "late")
        assert await asyncio.wait_for(handler, GUARD) is None
        await asyncio.sleep(0.3)  # (the run's task ends, its claim is given up)

        assert rt.status(run) == "completed"
        assert rt.checkpoints(run)[0].status == "completed"
        assert rt.result(run) is None
        assert rt.recover(flow, run) is None
        # The write stays in the context, for its next run.
        again = flow.run(ctx=handler.ctx, run_id=new_run())
        assert await asyncio.wait_for(again, GUARD) == "late"

    asyncio.run(go())
