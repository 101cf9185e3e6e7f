"""Probes of `RemitRuntime` written from the contract, on SQLite, PostgreSQL and Redis.

A running context taken without its state (`ctx.to_dict(include_state=False)`, which
the framework documents as "restoring creates a fresh state store") no longer names
its Remit run, whose identity is the state's handle: restored, it went on as a new,
untracked run, once per restore, each taking the answer the stored run waits for (two
restores, two runs proceeding). It is refused with `ForkWithoutIntent` before anything
is stored; the run stays parked and answerable.

A run restored with a workflow that has no step for the stored run's pending work
(another workflow, or another shape of it) was accepted, its waiter silently dropped by
the framework, and the answer refused as if the run "waits for no event". It is
refused with `VersionMismatch` naming the step.

Arguments of the wrong type (`rt.context(wf, None)`, `rt.update_state(wf, run, None)`)
are `TypeError`s naming the argument; before, an `AttributeError` or a bare `TypeError`
from deep inside escaped. An event refused through `handler.ctx.send_event` is logged
once, without asyncio reporting it again as a task exception never retrieved.

`rt.respond` to a run parked with a live handler in this process left that handler
waiting for ever (the answer ran in another copy); a parent step awaiting a child that
was answered by its run id hung with it. Given the workflow that runs the parked copy,
respond now answers through it; otherwise the parked copies end with `ResumeConflict`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import uuid
from typing import Any

import pytest
from test_llamaindex_probes6 import Ask, parked_handler
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import ForkWithoutIntent, ResumeConflict, UnknownRecord, VersionMismatch
from remit_llamaindex import RemitRuntime

GUARD = 30


def new_run() -> str:
    return f"probe9-{uuid.uuid4().hex[:12]}"


def test_a_running_context_without_its_state_is_refused(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler: Any = await parked_handler(rt, run)
        stateless = handler.ctx.to_dict(include_state=False)
        assert stateless["is_running"] and stateless["state"] == {}
        await handler.cancel_run()
        history = rt.checkpoints(run)

        other = RemitRuntime(store_url)
        flow = Ask(timeout=None, runtime=other)
        for attempt in range(2):  # as often as it is restored
            taken = f"{run}-copy{attempt}"
            with pytest.raises(ForkWithoutIntent, match="include_state=False"):
                flow.run(ctx=Context.from_dict(flow, stateless), run_id=taken)
            with pytest.raises(UnknownRecord):
                other.status(taken)  # nothing stored under the copy's id
        assert rt.checkpoints(run) == history

        # The run itself is parked as it was, and one answer continues it.
        answered = await other.respond(flow, run, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(answered, GUARD) == "ada"

    asyncio.run(go())


class Renamed(Workflow):
    """`Ask` with its step under another name."""

    @step
    async def question(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who?"), timeout=None
        )
        return StopEvent(result=f"renamed:{answer.response}")


def test_a_run_restored_with_a_workflow_of_another_shape_is_refused_naming_the_step(
    store_url: str,
) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler: Any = await parked_handler(rt, run)
        await handler.cancel_run()
        history = rt.checkpoints(run)

        other = RemitRuntime(store_url)
        renamed = Renamed(timeout=None, runtime=other)
        with pytest.raises(VersionMismatch, match="'ask'") as refused:
            await other.respond(renamed, run, HumanResponseEvent(response="bob"))
        assert refused.value.run_id == run
        assert refused.value.checkpoint_id == history[0].checkpoint_id
        with pytest.raises(VersionMismatch, match="'ask'"):
            renamed.run(ctx=other.context(renamed, run))
        assert rt.checkpoints(run) == history
        assert not [i for i in rt.remit.interrupts(run) if i.status == "consumed"]

        # The workflow that wrote it answers it as usual.
        answered = await other.respond(
            Ask(timeout=None, runtime=other), run, HumanResponseEvent(response="ada")
        )
        assert await asyncio.wait_for(answered, GUARD) == "ada"

    asyncio.run(go())


def test_arguments_of_the_wrong_type_are_type_errors_naming_them(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler: Any = await parked_handler(rt, run)
        await handler.cancel_run()
        flow = Ask(timeout=None, runtime=rt)
        head = rt.checkpoints(run)[0].checkpoint_id
        history = rt.checkpoints(run)

        for call in (
            lambda: rt.context(flow, None),  # type: ignore[arg-type]
            lambda: rt.status(None),  # type: ignore[arg-type]
            lambda: rt.checkpoints(7),  # type: ignore[arg-type]
            lambda: rt.get_state(flow, None),  # type: ignore[arg-type]
            lambda: rt.result(None),  # type: ignore[arg-type]
            lambda: rt.recover(flow, None),  # type: ignore[arg-type]
            lambda: rt.fork(None, head, "t"),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError, match="run_id"):
                call()
        with pytest.raises(TypeError, match="fork_token"):
            rt.context(flow, run, checkpoint_id=head, fork_token=5)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="workflow"):
            rt.context(None, run)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="run_id"):
            await rt.respond(flow, None, HumanResponseEvent(response="x"))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="run_id"):
            await rt.cancel(None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="run_id"):
            await rt.update_state(flow, None, {"a": 1})  # type: ignore[arg-type]
        for values in (None, [("a", 1)]):
            with pytest.raises(TypeError, match="values"):
                await rt.update_state(flow, run, values)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="handler"):
            await rt.send_event(None, HumanResponseEvent(response="x"))  # type: ignore[arg-type]
        assert rt.checkpoints(run) == history and rt.status(run) == "waiting"

    asyncio.run(go())


class Stray(Event):
    """An event no step of `Ask` takes and no waiter waits for."""


def test_an_event_refused_through_the_context_is_logged_once(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = new_run()
    unretrieved: list[dict[str, Any]] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, c: unretrieved.append(c))
        rt = RemitRuntime(store_url)
        handler: Any = await parked_handler(rt, run)
        handler.ctx.send_event(Stray())
        for _ in range(100):
            if "event refused" in caplog.text:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        gc.collect()  # a task whose exception nobody retrieved reports it when collected
        await asyncio.sleep(0.05)
        handler.ctx.send_event(HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(handler, GUARD) == "ada"

    with caplog.at_level(logging.ERROR, logger="remit_llamaindex"):
        asyncio.run(go())
    gc.collect()
    refused = [r for r in caplog.records if r.name == "remit_llamaindex"]
    assert len(refused) == 1 and "event refused" in refused[0].getMessage()
    assert unretrieved == []


def test_respond_to_a_run_parked_here_does_not_leave_its_handler_waiting(
    store_url: str,
) -> None:
    """`rt.respond` to a run parked with a live handler in this process (a server's
    other request): given the workflow that runs it, the answer goes through that
    copy and both handlers end with the result; given another workflow instance, the
    answer runs in a copy of its own and the parked handler ends with `ResumeConflict`.
    Before, that handler waited for ever for an answer the run had taken."""
    same, other = new_run(), new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        flow = Ask(timeout=None, runtime=rt)
        started = flow.run(run_id=same)
        async for ev in started.stream_events():
            if isinstance(ev, InputRequiredEvent):
                break
        answered = await rt.respond(flow, same, HumanResponseEvent(response="ada"))
        assert answered.run_id == same
        assert await asyncio.wait_for(answered, GUARD) == "ada"
        assert await asyncio.wait_for(started, GUARD) == "ada"
        assert [c.status for c in rt.checkpoints(same)].count("completed") == 1
        with pytest.raises(ResumeConflict):
            await rt.respond(flow, same, HumanResponseEvent(response="bob"))

        waiting: Any = await parked_handler(rt, other)
        answered = await rt.respond(
            Ask(timeout=None, runtime=rt), other, HumanResponseEvent(response="eve")
        )
        assert await asyncio.wait_for(answered, GUARD) == "eve"
        with pytest.raises(ResumeConflict, match="respond"):
            await asyncio.wait_for(waiting, GUARD)
        assert rt.result(other) == "eve"
        assert [c.status for c in rt.checkpoints(other)].count("completed") == 1

    asyncio.run(go())


class ChildAsks(Event):
    """Tells the outside which child run waits for an answer."""

    run_id: str


class Delegate(Workflow):
    """A step starts an `Ask` child (no run id: named after the step) and awaits it."""

    @step
    async def delegate(self, ctx: Context, ev: StartEvent) -> StopEvent:
        child = Ask(timeout=None, runtime=self.runtime).run()
        ctx.write_event_to_stream(ChildAsks(run_id=child.run_id))
        return StopEvent(result=f"child said {await child}")


def test_a_child_answered_by_its_run_id_does_not_hang_its_parent(store_url: str) -> None:
    """A parent step awaits a child workflow that waits for an answer, sent to the
    child's run id with `rt.respond`. The copy the parent awaits ends with
    `ResumeConflict` (before, it waited for ever), which stops the parent's copy
    without committing; a recovery of the parent finds the child ended and goes on
    with its stored result."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        parent = Delegate(timeout=None, runtime=rt).run(run_id=run)
        child = None
        async for ev in parent.stream_events():
            if isinstance(ev, ChildAsks):
                child = ev.run_id
                break
        assert child is not None and child.startswith(f"{run}/")
        for _ in range(400):
            with contextlib.suppress(UnknownRecord):  # (not stored yet)
                if rt.status(child) == "waiting":
                    break
            await asyncio.sleep(0.05)
        answered = await rt.respond(
            Ask(timeout=None, runtime=rt), child, HumanResponseEvent(response="ada")
        )
        assert await asyncio.wait_for(answered, GUARD) == "ada"
        with pytest.raises(ResumeConflict):
            await asyncio.wait_for(parent, GUARD)
        assert rt.status(run) == "running"
        recovered = rt.recover(Delegate(timeout=None, runtime=rt), run)
        assert recovered is not None
        assert await asyncio.wait_for(recovered, GUARD) == "child said ada"
        assert rt.result(child) == "ada"

    asyncio.run(go())
