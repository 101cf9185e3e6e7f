"""Round 38 of the LlamaIndex probes, on SQLite, PostgreSQL and Redis: answers whose event
class is not the one the run takes, where the framework matches event classes exactly
(a step or waiter takes a subclass of the event only with `accept_event_subclasses`).

A run that asked the classic way (a step returns an `InputRequiredEvent`) and whose
answering step takes `Reply`, a subclass of `HumanResponseEvent`, was sent a plain
`HumanResponseEvent` through its live handler (`rt.send_event(handler, ...)`,
`handler.ctx.send_event`, or `rt.respond` with the workflow that runs the parked copy):
the event consumed the question's interrupt and was acknowledged, the framework dropped
it (no step takes it), and the run went on waiting while every later answer, the right
`Reply` too, was refused as "every input this run asked for was answered already": a
run nobody could ever finish. It is now refused with `ResumeConflict` before anything is
consumed (as `rt.respond` with another workflow instance already refused it), and the
`Reply` then finishes the run, paying once.

A run whose `wait_for_event(HumanResponseEvent)` was answered, and which then waits for
a `Reply` that a step takes (not a waiter), refused that `Reply` from every resumer (its
handler, `rt.respond` in another process) as a second answer to the consumed waiter
("interrupt was already consumed"), though the framework would never give a `Reply` to
that waiter: again a run nobody could finish. A consumed waiter is now matched as the
framework matches it (exactly, unless its step takes subclasses): the `Reply` reaches
its step, and a second `HumanResponseEvent` is still refused naming the consumed waiter.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, enter, entered, in_process, pay
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

TESTS = str(Path(__file__).parent)
GUARD = 60


def new_run() -> str:
    return f"probe38-{uuid.uuid4().hex[:12]}"


class Reply(HumanResponseEvent):
    """The answer the runs below take: a subclass of the framework's answer type."""


# -- a classic question answered by a step that takes a subclass ---------------------


class AskedForReply(Workflow):
    """`ask` returns an `InputRequiredEvent` (the classic question); `handle` takes only
    a `Reply` and pays for it. A plain `HumanResponseEvent` is taken by no step."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ev: StartEvent) -> InputRequiredEvent:
        enter("ask")
        return InputRequiredEvent(prefix="who approves?")

    @step
    async def handle(self, ev: Reply) -> StopEvent:
        enter("handle")
        return StopEvent(result=pay("approved-by-" + ev.response))


async def _refused_in_the_log(rt: RemitRuntime, run: str, caplog: pytest.LogCaptureFixture) -> None:
    """Until `handler.ctx.send_event`'s refusal is logged, or (unrefused) an interrupt of
    `run` is consumed."""
    for _ in range(400):
        if any("event refused" in r.getMessage() for r in caplog.records):
            return
        if await asyncio.to_thread(rt.remit.interrupts, run, status="consumed"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the event was neither refused nor delivered")


@pytest.mark.parametrize("how", ["rt.send_event", "rt.respond", "handler.ctx.send_event"])
def test_an_answer_no_step_takes_leaves_the_classic_question_open(
    url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """P5, liveness: a plain `HumanResponseEvent` sent through the live handler of a run
    whose answering step takes only `Reply` is refused (or, through the fire-and-forget
    `handler.ctx.send_event`, logged as refused) and consumes nothing: the question's
    interrupt stays open, and the `Reply` sent the same way finishes the run, paying
    once. The framework drops such an event; consumed for the question, it left the run
    waiting for an answer that every later one was refused as."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    caplog.set_level(logging.ERROR, logger="remit_llamaindex")
    run = new_run()

    async def main() -> Any:
        rt = RemitRuntime(url, lease=1)
        workflow = AskedForReply(runtime=rt)
        handler = workflow.run(run_id=run)
        await until_parked(rt, run)
        plain = HumanResponseEvent(response="eve")
        if how == "rt.send_event":
            with pytest.raises(ResumeConflict, match="no step takes it"):
                await rt.send_event(handler, plain)
        elif how == "rt.respond":  # (answered through the copy parked in this loop)
            with pytest.raises(ResumeConflict, match="no step takes it"):
                await rt.respond(workflow, run, plain)
        else:
            handler.ctx.send_event(plain)
            await _refused_in_the_log(rt, run, caplog)
        assert rt.remit.interrupts(run, status="consumed") == []
        assert len(rt.remit.interrupts(run, status="pending")) == 1
        assert rt.status(run) == "waiting"

        answer = Reply(response="ada")
        if how == "rt.send_event":
            await rt.send_event(handler, answer)
        elif how == "rt.respond":
            handler = await rt.respond(workflow, run, answer)
        else:
            handler.ctx.send_event(answer)
        return await handler

    assert asyncio.run(asyncio.wait_for(main(), GUARD)) == "approved-by-ada"
    assert applied(tmp_path) == ["approved-by-ada"]
    assert entered(tmp_path) == ["ask", "handle"]
    rt = RemitRuntime(url)
    assert rt.status(run) == "completed" and rt.result(run) == "approved-by-ada"
    assert rt.remit.interrupts(run, status="pending") == []
    assert len(rt.remit.interrupts(run, status="consumed")) == 1


# -- a subclass sent to a step after its base type's waiter was answered -------------


class Approved(Event):
    who: str


class Countersigned(Workflow):
    """`approve` waits for a `HumanResponseEvent`; `finish` then waits for a `Reply` (a
    step that takes it, not a waiter), collects both and pays once."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def approve(self, ctx: Context, ev: StartEvent) -> Approved:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="approve?")
        )
        return Approved(who=answer.response)

    @step
    async def finish(self, ctx: Context, ev: Approved | Reply) -> StopEvent | None:
        enter("finish")
        both = ctx.collect_events(ev, [Approved, Reply])
        if both is None:
            return None
        approved, reply = both
        assert isinstance(approved, Approved) and isinstance(reply, Reply)
        return StopEvent(result=pay(f"{approved.who}+{reply.response}"))


async def answered_then_replied(
    rt: RemitRuntime, workflow: Workflow, run: str, tmp_path: Path, where: str
) -> Any:
    """Run a `Countersigned` shape until `finish` waits for its `Reply` after `approve`'s
    answer "ada"; check a second `HumanResponseEvent` is refused naming the consumed
    waiter with nothing stored; then send the `Reply` "bob" through the run's handler
    (and return the result) or cancel the parked handler (and return None)."""
    workflow.run(run_id=run)
    await until_parked(rt, run)
    handler = await rt.respond(workflow, run, HumanResponseEvent(response="ada"))
    # `finish` runs once `approve`'s result is committed (the head is running then),
    # and the head waits again once its result is.
    while "finish" not in entered(tmp_path) or rt.status(run) != "waiting":
        await asyncio.sleep(0.05)
    parked = rt.checkpoints(run)
    [consumed] = rt.remit.interrupts(run, status="consumed")
    with pytest.raises(ResumeConflict, match="already consumed") as refused:
        await rt.send_event(handler, HumanResponseEvent(response="eve"))
    assert refused.value.ids["interrupt_id"] == consumed.interrupt_id
    assert rt.checkpoints(run) == parked
    if where == "its handler":
        await rt.send_event(handler, Reply(response="bob"))
        return await handler
    await handler.cancel_run()  # (a parked copy's cancel writes nothing)
    return None


COUNTERSIGN = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes38 import Countersigned, Reply

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = await rt.respond(Countersigned(runtime=rt), {run!r}, Reply(response="bob"))
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("where", ["its handler", "another process"])
def test_a_subclass_of_an_answered_waiters_type_reaches_the_step_that_takes_it(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Liveness, P5: once `approve`'s waiter for `HumanResponseEvent` was answered, a
    `Reply` (a subclass, which the framework never gives that waiter) is delivered to
    `finish`, from the run's handler or by `rt.respond` in another process, and the run
    ends paying once; a second `HumanResponseEvent` is refused naming the consumed
    waiter, with nothing stored. Before, the `Reply` was refused as a second answer to
    that waiter from every resumer, and the run could never end."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    rt = RemitRuntime(url, lease=1)

    async def approved() -> Any:
        return await answered_then_replied(rt, Countersigned(runtime=rt), run, tmp_path, where)

    result = asyncio.run(asyncio.wait_for(approved(), GUARD))
    if where == "another process":
        done = in_process(COUNTERSIGN.format(tests=TESTS, url=url, run=run), tmp_path)
        assert done.returncode == 0, done.stderr
        result = done.stdout.split("RESULT ", 1)[1].strip()
    assert result == "ada+bob"
    assert applied(tmp_path) == ["ada+bob"]
    assert entered(tmp_path).count("approve") == 2  # (re-run from its top on its answer)
    assert entered(tmp_path).count("finish") == 2
    assert rt.status(run) == "completed" and rt.result(run) == "ada+bob"
