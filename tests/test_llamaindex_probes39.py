"""Round 39 of the LlamaIndex probes, on SQLite, PostgreSQL and Redis: a waiter of a step
with `accept_event_subclasses=True`, which the framework resolves with an event of the
type it waits for or of any subclass of it.

A run whose step (taking subclasses) waited for a `HumanResponseEvent`, was answered,
completed, and then waited for a `Reply` (a subclass) that another step takes, refused
that `Reply` from every resumer (its handler, `rt.respond` from another runtime) as
"interrupt was already consumed": the consumed waiter's step takes subclasses, so the
`Reply` was matched to it, though its step had completed and the framework gives the
`Reply` to the step that takes it. The run could never end. An event a step takes is
now delivered to it (a consumed waiter still held by the run is matched as before, and
its second answer refused), and a second plain `HumanResponseEvent`, which no step takes,
is still refused naming the consumed waiter.

Held: k resumers racing to answer such a waiter with the base type and the subclass
mixed: one proceeds with its own value, the others get `ResumeConflict`, one payment.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
import test_llamaindex_probes38 as probes38
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay
from test_llamaindex_probes38 import Approved, Reply, answered_then_replied
from workflows import Context, Workflow, step
from workflows.events import (
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 60


def new_run() -> str:
    return f"probe39-{uuid.uuid4().hex[:12]}"


# -- a subclass for a step, after a waiter that takes subclasses was answered ---------


class Countersigned(probes38.Countersigned):
    """Round 38's `Countersigned` whose `approve` takes subclasses: it waits for a
    `HumanResponseEvent`; `finish` then waits for a `Reply` (a step that takes it, not
    a waiter), collects both and pays."""

    @step(accept_event_subclasses=True)
    async def approve(self, ctx: Context, ev: StartEvent) -> Approved:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="approve?")
        )
        return Approved(who=answer.response)


@pytest.mark.parametrize("where", ["its handler", "another runtime"])
def test_a_subclass_a_step_takes_is_no_second_answer_to_a_waiter_taking_subclasses(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Liveness, P5: once `approve`'s waiter (its step takes subclasses) was answered and
    `approve` completed, a `Reply` reaches `finish`, the step that takes it, from the
    run's handler or by `rt.respond` of another runtime, and the run ends paying once.
    A second plain `HumanResponseEvent` (no step takes it) is still refused naming the
    consumed waiter, with nothing stored. Before, the `Reply` was refused as a second
    answer to that waiter, and the run could never end."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    rt = RemitRuntime(url, lease=1)

    async def main() -> Any:
        done = await answered_then_replied(rt, Countersigned(runtime=rt), run, tmp_path, where)
        if where == "its handler":
            return done
        other = RemitRuntime(url, lease=1)
        resumed = await other.respond(Countersigned(runtime=other), run, Reply(response="bob"))
        return await resumed

    assert asyncio.run(asyncio.wait_for(main(), GUARD)) == "ada+bob"
    assert applied(tmp_path) == ["ada+bob"]
    assert entered(tmp_path).count("approve") == 2  # (re-run from its top on its answer)
    assert rt.status(run) == "completed" and rt.result(run) == "ada+bob"


# -- racing answers of the base type and a subclass -----------------------------------


class SubclassApproval(Workflow):
    """`approve` (taking subclasses) waits for a `HumanResponseEvent` and pays for the
    answer it got, naming the answer's class."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step(accept_event_subclasses=True)
    async def approve(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="approve?")
        )
        return StopEvent(result=pay(f"{type(answer).__name__}:{answer.response}"))


def test_racing_answers_of_a_type_and_its_subclass_take_one(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2: four runtimes answer one waiter that takes subclasses at once, two with a
    `Reply` and two with a plain `HumanResponseEvent`: one proceeds with its own value,
    the others get `ResumeConflict`, and the step pays once, for the winner's answer."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    answers: list[HumanResponseEvent] = [
        Reply(response="r0"),
        HumanResponseEvent(response="r1"),
        Reply(response="r2"),
        HumanResponseEvent(response="r3"),
    ]

    async def main() -> str:
        rt = RemitRuntime(url, lease=1)
        SubclassApproval(runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        racers = [RemitRuntime(url, lease=1) for _ in answers]
        outcomes = await asyncio.gather(
            *(
                r.respond(SubclassApproval(runtime=r), run, a)
                for r, a in zip(racers, answers, strict=True)
            ),
            return_exceptions=True,
        )
        [won] = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
        assert all(isinstance(o, ResumeConflict) for i, o in enumerate(outcomes) if i != won)
        winner = outcomes[won]
        assert not isinstance(winner, BaseException)
        result = await winner
        assert result == f"{type(answers[won]).__name__}:{answers[won].response}"
        return str(result)

    result = asyncio.run(asyncio.wait_for(main(), GUARD))
    assert applied(tmp_path) == [result]
    assert len(RemitRuntime(url).remit.interrupts(run, status="consumed")) == 1
