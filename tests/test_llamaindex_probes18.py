"""LlamaIndex probes, round 18, on SQLite, PostgreSQL and Redis.

`rt.result(run_id)` of a run that failed or was cancelled raised `UnknownRecord`
("run has not completed"), as if the run did not exist: a caller could not tell a
failed run from a missing one, nor read the stored error. It now raises what
awaiting the run's handler raised, as a child run started again does: `RunFailed`
carrying the stored error, `WorkflowCancelledByUser` for a cancelled run. A run that
has not ended still has no result (`UnknownRecord` naming its status).

A stored typed state was read into the reading workflow's model from its field
values, and pydantic drops a value the model does not declare: a field removed or
renamed since the checkpoint was written was lost without a word, on a restore, an
answer or `rt.get_state`, and the run's next checkpoint stored the state without it.
Such a read is now refused with `VersionMismatch` naming the field, before anything
runs or is stored; a schema of a higher version with a registered migration reads it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from llamaindex_parts import until_parked
from pydantic import BaseModel, ConfigDict
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core import Migrations, StateSchema
from remit_core.errors import UnknownRecord, VersionMismatch
from remit_llamaindex import RemitRuntime, RunFailed

GUARD = 20.0


def new_run() -> str:
    return f"probe18-{uuid.uuid4().hex[:12]}"


# -- rt.result of a run that ended without a result ------------------------------------


class Declines(Workflow):
    @step
    async def decide(self, ev: StartEvent) -> StopEvent:
        raise ValueError(f"declined {ev.get('order')}")


class Asks(Workflow):
    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=answer.response)


def test_rt_result_of_a_run_that_ended_without_a_result_raises_what_its_handler_raised(
    store_url: str,
) -> None:
    """A failed run's result is its stored error (`RunFailed`, as a child run started
    again raises it), a cancelled run's is `WorkflowCancelledByUser`, as awaiting their
    handlers raised; only a run that has not ended is `UnknownRecord`, naming its status."""
    failed, cancelled = new_run(), new_run()

    async def scenario() -> None:
        rt = RemitRuntime(store_url)
        with pytest.raises(ValueError, match="declined o-7"):
            await asyncio.wait_for(Declines(runtime=rt).run(run_id=failed, order="o-7"), GUARD)
        handler = Asks(runtime=rt).run(run_id=cancelled)
        await until_parked(rt, cancelled)
        with pytest.raises(UnknownRecord, match="'waiting'") as waiting:
            rt.result(cancelled)
        assert waiting.value.run_id == cancelled
        await rt.cancel(cancelled)
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)

    asyncio.run(scenario())
    reader = RemitRuntime(store_url)
    assert reader.status(failed) == "failed"
    with pytest.raises(RunFailed) as refused:
        reader.result(failed)
    assert refused.value.error == "ValueError: declined o-7"
    assert refused.value.run_id == failed
    assert refused.value.checkpoint_id == reader.checkpoints(failed)[0].checkpoint_id
    assert reader.status(cancelled) == "cancelled"
    with pytest.raises(WorkflowCancelledByUser, match=cancelled):
        reader.result(cancelled)


# -- a state field removed or renamed since the checkpoint was written -----------------


class OrderV1(BaseModel):
    amount: int = 0
    note: str = ""


class OrderV2(BaseModel):
    """`OrderV1` with `note` renamed to `memo`."""

    amount: int = 0
    memo: str = ""


class OrderV2Ignoring(OrderV2):
    model_config = ConfigDict(extra="ignore")


class FlowV1(Workflow):
    @step
    async def ask(self, ctx: Context[OrderV1], ev: StartEvent) -> StopEvent:
        await ctx.store.set("amount", 7)
        await ctx.store.set("note", "gift wrap")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=f"{answer.response}:{(await ctx.store.get_state()).note}")


class FlowV2(Workflow):
    @step
    async def ask(self, ctx: Context[OrderV2], ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=f"{answer.response}:{(await ctx.store.get_state()).memo}")


class FlowV2Ignoring(Workflow):
    @step
    async def ask(self, ctx: Context[OrderV2Ignoring], ev: StartEvent) -> StopEvent:
        return StopEvent(result="unused")


def renamed() -> StateSchema:
    migrations = Migrations()

    @migrations.register(1)
    def note_to_memo(state: dict[str, Any]) -> dict[str, Any]:
        return {"amount": state["amount"], "memo": state["note"]}

    return StateSchema(OrderV2, version=2, migrations=migrations)


def test_a_state_field_renamed_since_the_checkpoint_is_refused_not_dropped(
    store_url: str,
) -> None:
    """P4: the stored state holds `note`, which the resuming workflow's model no longer
    declares (renamed `memo`). Reading, restoring and answering the run are refused with
    `VersionMismatch` naming the field, before any step runs: the history is as it was
    and the interrupt still pending. A schema of version 2 with a migration reads the
    value as `memo`; a model that declares `extra="ignore"` drops it as it says."""
    run = new_run()

    async def scenario() -> str:
        rt = RemitRuntime(store_url)
        handler = FlowV1(runtime=rt).run(run_id=run)
        await until_parked(rt, run)
        snapshot = handler.ctx.to_dict()
        await handler.cancel_run()
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)
        history = rt.checkpoints(run)

        other = RemitRuntime(store_url)
        renamed_flow = FlowV2(runtime=other)
        with pytest.raises(VersionMismatch, match="'note'") as refused:
            other.get_state(renamed_flow, run)
        assert refused.value.ids["field"] == "note"
        assert (refused.value.run_id, refused.value.checkpoint_id) == (
            run,
            history[0].checkpoint_id,
        )
        with pytest.raises(VersionMismatch, match="'note'"):
            await other.respond(renamed_flow, run, HumanResponseEvent(response="eve"))
        with pytest.raises(VersionMismatch, match="'note'"):
            renamed_flow.run(ctx=Context.from_dict(renamed_flow, snapshot))
        assert other.checkpoints(run) == history
        assert [i.status for i in other.remit.interrupts(run)] == ["pending"]
        ignoring: Any = other.get_state(FlowV2Ignoring(runtime=other), run)
        assert (ignoring.amount, ignoring.memo) == (7, "")

        migrating = RemitRuntime(store_url, schema=renamed())
        state: Any = migrating.get_state(FlowV2(runtime=migrating), run)
        assert (state.amount, state.memo) == (7, "gift wrap")
        answered = await migrating.respond(
            FlowV2(runtime=migrating), run, HumanResponseEvent(response="ada")
        )
        return str(await asyncio.wait_for(answered, GUARD))

    assert asyncio.run(scenario()) == "ada:gift wrap"
