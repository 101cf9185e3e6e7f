"""Round 40 of the LlamaIndex probes, on SQLite, PostgreSQL and Redis: user errors and
races around one run id.

Held (pinned): two workflow classes started under one run id, at once and after the
first parked or ended: one runs, the other is refused before any step runs, and the
first run is left as it was. A typed answer its own model refuses, or of a type the
run does not wait for, consumes nothing and leaves the question open. A parked copy's
`handler.cancel_run()`, or `rt.cancel`, racing an answer from another runtime: the run
either ends cancelled with the answer refused, or takes the answer and pays once.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay
from pydantic import field_validator
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid, ForkWithoutIntent, ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 60


def new_run() -> str:
    return f"probe40-{uuid.uuid4().hex[:12]}"


# -- two workflow classes under one run id ----------------------------------------------


class Asking(Workflow):
    """Waits for an answer, then pays for it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("ask")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="pay?")
        )
        return StopEvent(result=pay(f"ask:{answer.response}"))


class Paying(Workflow):
    """Another workflow with a step of the same name: pays at once."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("paying")
        return StopEvent(result=pay("paying"))


def test_another_workflow_class_started_under_a_run_id_in_use_is_refused(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P5: `Paying` started under the id of an `Asking` run that has claimed
    but not yet stored its start gets `ResumeConflict`; started under it once the run
    is parked, `ForkWithoutIntent`; neither runs a step or stores anything, and the
    parked run is answered and pays once. Once that run has ended, `Paying` under its
    id is refused the same way, and the ended run keeps its result and history."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def main() -> None:
        rt, other = RemitRuntime(url, lease=1), RemitRuntime(url, lease=1)
        handler = Asking(runtime=rt).run(run_id=run)  # (claimed; nothing stored yet)
        with pytest.raises(ResumeConflict):
            Paying(runtime=other).run(run_id=run)
        await until_parked(rt, run)
        history = other.checkpoints(run)
        with pytest.raises(ForkWithoutIntent, match="already exists"):
            Paying(runtime=other).run(run_id=run)
        assert other.checkpoints(run) == history and other.status(run) == "waiting"
        resumed = await other.respond(
            Asking(runtime=other), run, HumanResponseEvent(response="ada")
        )
        assert await resumed == "ask:ada"
        with pytest.raises(ResumeConflict):
            await handler  # (its parked copy lost the run to the answer)
        ended = other.checkpoints(run)
        with pytest.raises(ForkWithoutIntent, match="already exists"):
            Paying(runtime=rt).run(run_id=run)
        assert rt.checkpoints(run) == ended and rt.result(run) == "ask:ada"

    asyncio.run(asyncio.wait_for(main(), GUARD))
    assert applied(tmp_path) == ["ask:ada"]
    assert "paying" not in entered(tmp_path)


# -- a typed answer its model refuses ---------------------------------------------------


class Decision(HumanResponseEvent):
    """A typed answer: a verdict and an amount that is not negative."""

    approved: bool
    amount: int = 0

    @field_validator("amount")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise ValueError("amount must not be negative")
        return value


class Deciding(Workflow):
    """Waits for a `Decision` and pays for it, with any extra the answer carries."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def decide(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("decide")
        d = await ctx.wait_for_event(Decision, waiter_event=InputRequiredEvent(prefix="ok?"))
        return StopEvent(result=pay(f"{d.approved}:{d.amount}:{d.get('note')}"))


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_a_typed_answer_its_model_refuses_consumes_nothing(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P4, P5: answers from another runtime that the waiter's `Decision` model refuses (a
    field set after construction to a value it does not take) are refused with
    `CheckpointInvalid` naming the field, and a plain `HumanResponseEvent` with
    `ResumeConflict`; nothing is consumed or stored and the run still waits. A valid
    answer then completes it, its extra field reaching the step, and pays once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def main() -> Any:
        rt = RemitRuntime(url, lease=1)
        Deciding(runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        other = RemitRuntime(url, lease=1)
        history = other.checkpoints(run)
        not_bool = Decision(response="r", approved=True)
        not_bool.approved = "maybe"  # type: ignore[assignment]
        negative = Decision(response="r", approved=True)
        negative.amount = -1
        for bad, field in ((not_bool, "approved"), (negative, "amount")):
            with pytest.raises(CheckpointInvalid) as refused:
                await other.respond(Deciding(runtime=other), run, bad)
            assert refused.value.field == field and refused.value.run_id == run
        with pytest.raises(ResumeConflict, match="waits for Decision"):
            await other.respond(Deciding(runtime=other), run, HumanResponseEvent(response="r"))
        assert other.checkpoints(run) == history and other.status(run) == "waiting"
        assert other.remit.interrupts(run, status="consumed") == []
        good = Decision(response="r", approved=True, amount=3, note="rush")
        return await (await other.respond(Deciding(runtime=other), run, good))

    assert asyncio.run(asyncio.wait_for(main(), GUARD)) == "True:3:rush"
    assert applied(tmp_path) == ["True:3:rush"]


# -- a cancel racing an answer from another runtime ------------------------------------


@pytest.mark.parametrize("cancel", ["handler.cancel_run", "rt.cancel"])
def test_a_cancel_racing_an_answer_from_another_runtime_ends_the_run_one_way(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cancel: str
) -> None:
    """P5, P2: the process that parked the run cancels it (its handler's `cancel_run`,
    which stops only its own copy, or `rt.cancel`, which ends the run) while another
    runtime answers it. `cancel_run`: the answer proceeds and pays once, the copy ends
    cancelled. `rt.cancel`: either the run ends cancelled and the answer is refused
    with `ResumeConflict`, paying nothing, or the answer proceeds and pays once and the
    cancel is refused with `ResumeConflict`; never both, never a second payment."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def main() -> tuple[str, BaseException | str, BaseException | str]:
        rt, other = RemitRuntime(url, lease=1), RemitRuntime(url, lease=1)
        handler = Asking(runtime=rt).run(run_id=run)
        await until_parked(rt, run)

        async def answer() -> str:
            resumed = await other.respond(
                Asking(runtime=other), run, HumanResponseEvent(response="ada")
            )
            return str(await resumed)

        async def stop() -> str:
            if cancel == "rt.cancel":
                return await rt.cancel(run)
            await handler.cancel_run()
            return "stopped"

        answered, stopped = await asyncio.gather(answer(), stop(), return_exceptions=True)
        with pytest.raises((WorkflowCancelledByUser, ResumeConflict)):
            await handler
        return rt.status(run), answered, stopped

    status, answered, stopped = asyncio.run(asyncio.wait_for(main(), GUARD))
    if status == "cancelled":
        assert cancel == "rt.cancel" and isinstance(answered, ResumeConflict)
        assert applied(tmp_path) == []
    else:
        assert (status, answered) == ("completed", "ask:ada")
        assert applied(tmp_path) == ["ask:ada"]
        if cancel == "rt.cancel":
            assert isinstance(stopped, ResumeConflict)
