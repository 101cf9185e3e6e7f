"""LlamaIndex probes, round 31, on SQLite, PostgreSQL and Redis: a context snapshot that
carries a fork token (`rt.context(..., fork_token=t).to_dict()`), restored where its
base cannot be read (another `workflow_version`, a workflow of another shape, a state
model that no longer declares a stored field), is refused as a restore of that
checkpoint is refused, and stores no branch: the refusal leaves the run as it was,
and the token still makes its one branch once a reader that accepts the base
restores the snapshot.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from pydantic import BaseModel, Field
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.conformance.adapter import Target
from remit_core.conformance.storage import corrupt_remit_checkpoint
from remit_core.errors import CorruptRecord, ResumeConflict, VersionMismatch
from remit_llamaindex import RemitRuntime

GUARD = 60


def new_run() -> str:
    return f"probe31-{uuid.uuid4().hex[:12]}"


@contextmanager
def runtime(url: str, version: str = "") -> Iterator[RemitRuntime]:
    """A runtime whose store connections are closed afterwards."""
    rt = RemitRuntime(url, lease=1, workflow_version=version)
    try:
        yield rt
    finally:
        rt.remit.close()


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)
    note: str = ""
    approved_by: str | None = None


class Asked(Event):
    pass


class OrderFlow(Workflow):
    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> Asked:
        await ctx.store.set("amount", ev.get("amount", 1))
        await ctx.store.set("note", "prepared")
        return Asked()

    @step
    async def approve(self, ctx: Context[Order], ev: Asked) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="charge it?")
        )
        await ctx.store.set("approved_by", answer.response)
        return StopEvent(result=answer.response)


class ReshapedFlow(Workflow):
    """The same workflow after a change that dropped the `approve` step."""

    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> StopEvent:
        return StopEvent(result="reshaped")


class Trimmed(BaseModel):
    """The state model after a change that dropped the `note` field."""

    amount: int = Field(default=0, ge=0)
    approved_by: str | None = None


class TrimmedFlow(Workflow):
    @step
    async def prepare(self, ctx: Context[Trimmed], ev: StartEvent) -> Asked:
        return Asked()

    @step
    async def approve(self, ctx: Context[Trimmed], ev: Asked) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="charge it?")
        )
        return StopEvent(result=answer.response)


def forks_of(rt: RemitRuntime, run: str) -> list[str]:
    """The branches the store holds for `run` besides its main one."""
    return sorted(b.branch for b in rt.remit.store.list_branches(run, "") if b.branch != "main")


async def parked_with_fork_snapshot(rt: RemitRuntime, run: str) -> tuple[Any, dict[str, Any]]:
    """Start `run` on `rt` until it waits; its handler and the snapshot of a context at
    its checkpoint before the waiting head, with a fork token."""
    flow = OrderFlow(runtime=rt)
    handler = flow.run(run_id=run, amount=5)
    await until_parked(rt, run)
    base = rt.checkpoints(run)[1].checkpoint_id
    return handler, rt.context(flow, run, checkpoint_id=base, fork_token="what-if").to_dict()


@pytest.mark.parametrize("reader", ["another version", "another shape", "another model"])
def test_a_fork_snapshot_refused_by_its_reader_stores_no_branch(url: str, reader: str) -> None:
    async def go() -> None:
        run = new_run()
        with runtime(url, "v1") as rt, runtime(url, "v2") as rt2:
            handler, snapshot = await parked_with_fork_snapshot(rt, run)
            head = rt.checkpoints(run)[0].checkpoint_id
            other: Workflow = {
                "another version": lambda: OrderFlow(runtime=rt2),
                "another shape": lambda: ReshapedFlow(runtime=rt),
                "another model": lambda: TrimmedFlow(runtime=rt),
            }[reader]()
            with pytest.raises(VersionMismatch) as refused:
                other.run(ctx=Context.from_dict(other, snapshot))
            assert refused.value.ids["run_id"] == run
            # Refused, and nothing stored: no branch, the run's head where it was.
            assert forks_of(rt, run) == []
            assert rt.checkpoints(run)[0].checkpoint_id == head
            assert rt.status(run) == "waiting"
            # The workflow that wrote the run restores the same snapshot: its one fork.
            flow = OrderFlow(runtime=rt)
            forked = flow.run(ctx=Context.from_dict(flow, snapshot))
            fork_run = forked.run_id
            assert fork_run.startswith(f"{run}@fork-")
            assert forks_of(rt, run) == [fork_run.rsplit("@", 1)[1]]
            await until_parked(rt, fork_run)
            answered = await rt.respond(flow, fork_run, HumanResponseEvent(response="eve"))
            assert await asyncio.wait_for(answered, GUARD) == "eve"
            assert rt.get_state(flow, fork_run).approved_by == "eve"
            assert rt.get_state(flow, run).approved_by is None
            # The original run still takes its own answer, once.
            resumed = await rt.respond(flow, run, HumanResponseEvent(response="ada"))
            assert await asyncio.wait_for(resumed, GUARD) == "ada"
            assert rt.status(run) == "completed"
            with pytest.raises(ResumeConflict):
                await asyncio.wait_for(handler, GUARD)

    asyncio.run(go())


def test_a_fork_snapshot_of_an_altered_checkpoint_stores_no_branch(
    url: str, tmp_path: Path
) -> None:
    async def go() -> None:
        run = new_run()
        with runtime(url) as rt:
            handler, snapshot = await parked_with_fork_snapshot(rt, run)
            base = snapshot["state"]["checkpoint_id"]
            head = rt.checkpoints(run)[0].checkpoint_id
            corrupt_remit_checkpoint(Target(url, "remit", url, tmp_path, "t"), run, base)
            flow = OrderFlow(runtime=rt)
            with pytest.raises(CorruptRecord) as refused:
                flow.run(ctx=Context.from_dict(flow, snapshot))
            assert (refused.value.ids["run_id"], refused.value.ids["checkpoint_id"]) == (run, base)
            assert forks_of(rt, run) == []
            assert rt.remit.branch(run) is not None
            assert rt.remit.branch(run).head_id == head  # type: ignore[union-attr]
            # The run itself, whose head is intact, still takes its answer.
            resumed = await rt.respond(flow, run, HumanResponseEvent(response="ada"))
            assert await asyncio.wait_for(resumed, GUARD) == "ada"
            with pytest.raises(ResumeConflict):
                await asyncio.wait_for(handler, GUARD)

    asyncio.run(go())
