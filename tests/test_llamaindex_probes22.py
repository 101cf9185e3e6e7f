"""LlamaIndex probes, round 22, on SQLite, PostgreSQL and Redis.

An answer that misses the `requirements=` of the one waiter of its type was refused
(rightly: nothing consumed, nothing stored), saying "no waiter of the run waits for
Reply ... (it waits for Reply)". The refusal now says what the waiter requires.
"""

import asyncio
import uuid
from typing import Any

import pytest
from llamaindex_parts import until_parked
from workflows import Context, Workflow, step
from workflows.events import Event, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 20.0


def new_run() -> str:
    return f"probe22-{uuid.uuid4().hex[:12]}"


# -- an answer that misses its waiter's requirements -------------------------------------------


class Reply(Event):
    to: str
    text: str


class Addressed(Workflow):
    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            Reply, waiter_event=InputRequiredEvent(prefix="?"), requirements={"to": "ada"}
        )
        return StopEvent(result=answer.text)


def test_an_answer_missing_its_waiters_requirements_is_refused_saying_what_they_are(
    store_url: str,
) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler: Any = Addressed(timeout=None, runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        history = rt.checkpoints(run)

        other = RemitRuntime(store_url)
        for send in (
            lambda: other.respond(
                Addressed(timeout=None, runtime=other), run, Reply(to="bob", text="no")
            ),
            lambda: rt.send_event(handler, Reply(to="bob", text="no")),
        ):
            with pytest.raises(ResumeConflict, match="waits for Reply with to='ada'"):
                await send()
        assert rt.checkpoints(run) == history
        assert not [i for i in rt.remit.interrupts(run) if i.status == "consumed"]

        await rt.send_event(handler, Reply(to="ada", text="yes"))
        assert await asyncio.wait_for(handler, GUARD) == "yes"

    asyncio.run(go())
