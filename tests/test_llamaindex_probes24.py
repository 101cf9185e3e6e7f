"""LlamaIndex probes, round 24, on SQLite, PostgreSQL and Redis.

Restoring a run (`rt.context`, `rt.respond`, `rt.recover`, `Context.from_dict`)
decoded the value accepted for every interrupt the run had ever consumed, though
only the ones its head still waits on are delivered again: each restore of a
long-lived run cost its whole history of answers, and a run whose finished round
had been answered with an event class since renamed or removed was refused with
`VersionMismatch`, though nothing it still holds names that class. A restore now
decodes only the accepted values of what the head waits on.
"""

import asyncio
import sys
import types
import uuid
from typing import Any

from llamaindex_parts import until_parked
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_llamaindex import RemitRuntime

GUARD = 20.0


def new_run() -> str:
    return f"probe24-{uuid.uuid4().hex[:12]}"


# -- an earlier round answered with a class the reading code no longer has ------------------


def _module() -> types.ModuleType:
    """A module of the workflow's own classes, loaded as an import would load it."""
    module = types.ModuleType(f"probe24_flow_{uuid.uuid4().hex[:8]}")
    sys.modules[module.__name__] = module
    return module


def _event(module: types.ModuleType, name: str, **fields: type) -> Any:
    cls = type(name, (Event,), {"__module__": module.__name__, "__annotations__": fields})
    setattr(module, name, cls)
    return cls


def _two_rounds(first_answer: type[Event], between: type[Event]) -> Workflow:
    """`first` waits for a `first_answer`, then `second` waits for a human response."""

    class TwoRounds(Workflow):
        @step
        async def first(self, ctx: Context, ev: StartEvent) -> between:  # type: ignore[valid-type]
            await ctx.wait_for_event(first_answer, waiter_event=InputRequiredEvent(prefix="1?"))
            return between()

        @step
        async def second(self, ctx: Context, ev: between) -> StopEvent:  # type: ignore[valid-type]
            answer = await ctx.wait_for_event(
                HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="2?")
            )
            return StopEvent(result=answer.response)

    return TwoRounds(timeout=None)


async def _parked_at_second_round(rt: RemitRuntime, run: str) -> None:
    for _ in range(400):
        head = (await asyncio.to_thread(rt.checkpoints, run))[0]
        if head.status == "waiting" and any("HumanResponseEvent" in w for w in head.waiting):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} never reached its second round")


def test_a_round_answered_with_a_class_removed_since_does_not_block_the_next_answer(
    store_url: str,
) -> None:
    """P4, P5: the first round was answered with `Old`, and that round is over; the
    run waits for a human response. The reading code has no `Old` any more (its first
    step waits for `New`). Nothing the run still holds names `Old`: `rt.context`
    restores it and `rt.respond` answers it, running on to its result, instead of
    refusing it with `VersionMismatch` over an answer it will never read again."""
    module = _module()
    old = _event(module, "Old", text=str)
    between = _event(module, "Between")
    run = new_run()

    async def first_round() -> None:
        rt = RemitRuntime(store_url)
        writer = _two_rounds(old, between)
        writer._runtime = rt
        handler = writer.run(run_id=run)
        await until_parked(rt, run)
        await rt.send_event(handler, old(text="first"))
        await _parked_at_second_round(rt, run)
        await handler.cancel_run()  # (a parked copy's cancel writes nothing)

    asyncio.run(first_round())
    del module.Old  # removed in the reading code, its round long over
    new = _event(module, "New", text=str)

    async def second_round() -> Any:
        rt = RemitRuntime(store_url)
        reader = _two_rounds(new, between)
        reader._runtime = rt
        rt.context(reader, run)
        handler = await rt.respond(reader, run, HumanResponseEvent(response="second"))
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(second_round()) == "second"
    assert RemitRuntime(store_url).status(run) == "completed"
