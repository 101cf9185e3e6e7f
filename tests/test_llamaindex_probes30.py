"""LlamaIndex probes, round 30, on SQLite, PostgreSQL and Redis: `ctx.store.set` of a
path a typed state does not declare (a top-level field, a field of a nested model, a
field under a missing or scalar one) is refused as every other refused state write
is, with `CheckpointInvalid` naming the path, nothing stored and the run going on; a
model that validates assignments refuses a bad value the same way; a model with
`extra="allow"` takes an undeclared field, which a restore in another process reads.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llamaindex_parts import until_parked
from pydantic import BaseModel, ConfigDict, Field
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_llamaindex import RemitRuntime
from remit_llamaindex import _snapshot as snap

TESTS = str(Path(__file__).parent)
GUARD = 60


def new_run() -> str:
    return f"probe30-{uuid.uuid4().hex[:12]}"


@contextmanager
def runtime(url: str) -> Iterator[RemitRuntime]:
    """A runtime whose store connections are closed afterwards."""
    rt = RemitRuntime(url, lease=1)
    try:
        yield rt
    finally:
        rt.remit.close()


ANSWER = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes30 as probes

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    try:
        flow = getattr(probes, {flow!r})(runtime=rt)
        handler = await rt.respond(flow, {run!r}, HumanResponseEvent(response="ada"))
        print(json.dumps(await asyncio.wait_for(handler, 30)), flush=True)
    finally:
        rt.remit.close()

asyncio.run(main())
"""


def answer_elsewhere(url: str, flow: str, run: str) -> Any:
    """Answer the parked `run` of `flow` from another process; what the run ended with."""
    done = subprocess.run(
        [sys.executable, "-c", ANSWER.format(tests=TESTS, url=url, flow=flow, run=run)],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def stored_fields(rt: RemitRuntime, run: str) -> list[dict[str, Any]]:
    """The state fields of every stored checkpoint of `run`, newest first."""
    found = []
    for c in rt.checkpoints(run):
        record = rt.remit.checkpoint(run, c.checkpoint_id)
        assert record is not None
        found.append(snap.state_fields(snap.decode(record.state).get("state") or {}) or {})
    return found


# -- a path the typed state does not declare ------------------------------------------


class Inner(BaseModel):
    n: int = 0


class Ledger(BaseModel):
    amount: int = Field(default=0, ge=0)
    inner: Inner = Field(default_factory=Inner)
    approved_by: str | None = None


class AssignedInner(BaseModel):
    model_config = ConfigDict(validate_assignment=True)
    n: int = 0


class AssignedLedger(BaseModel):
    """The same state, with a model that validates each assignment itself."""

    model_config = ConfigDict(validate_assignment=True)
    amount: int = Field(default=0, ge=0)
    inner: AssignedInner = Field(default_factory=AssignedInner)
    approved_by: str | None = None


class Prepared(Event):
    refused: list[list[Any]]


#: Writes the state model refuses: what the write is, its path, its value.
UNDECLARED = [
    ("top", "no_such_field", 1),
    ("nested", "inner.missing", 1),
    ("under missing", "missing.deeper", 1),
    ("under scalar", "amount.deeper", 1),
]
BAD_VALUE = [("bad value", "amount", -1), ("bad nested value", "inner.n", "x")]


async def refusals(ctx: Context[Any], writes: list[tuple[str, str, Any]]) -> list[list[Any]]:
    """Set `amount` and `inner.n`, then make each of `writes` (caught): for each, the
    error's class, its `field`, whether it is a `ValueError`, and whether the state and
    a read of the path are as they were."""
    await ctx.store.set("amount", 5)
    await ctx.store.set("inner.n", 7)
    refused = []
    for name, path, value in writes:
        before = (await ctx.store.get_state()).model_dump()
        was = await ctx.store.get(path, default="unset")
        try:
            await ctx.store.set(path, value)
            refused.append([name, "accepted", None, False, False])
            continue
        except Exception as exc:  # what a step sees, whatever it is
            error = exc
        after = (await ctx.store.get_state()).model_dump()
        unread = await ctx.store.get(path, default="unset") == was
        refused.append(
            [
                name,
                type(error).__name__,
                getattr(error, "field", None),
                isinstance(error, ValueError),
                after == before and unread,
            ]
        )
    return refused


class Strict(Workflow):
    """`prepare` makes writes the model refuses (each caught) and goes on; `approve`
    waits for an answer, writes it and ends with the state."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context[Ledger], ev: StartEvent) -> Prepared:
        return Prepared(refused=await refusals(ctx, UNDECLARED + BAD_VALUE))

    @step
    async def approve(self, ctx: Context[Ledger], ev: Prepared) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        await ctx.store.set("approved_by", answer.response)
        state = (await ctx.store.get_state()).model_dump()
        return StopEvent(result={"refused": ev.refused, "state": state})


class Assigned(Workflow):
    """`Strict` over a state model that validates assignments."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context[AssignedLedger], ev: StartEvent) -> Prepared:
        return Prepared(refused=await refusals(ctx, UNDECLARED + BAD_VALUE))

    @step
    async def approve(self, ctx: Context[AssignedLedger], ev: Prepared) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        await ctx.store.set("approved_by", answer.response)
        state = (await ctx.store.get_state()).model_dump()
        return StopEvent(result={"refused": ev.refused, "state": state})


def refused_and_resumed_elsewhere(store_url: str, flow: type[Workflow]) -> None:
    run = new_run()

    async def park() -> None:
        with runtime(store_url) as rt:
            handler = flow(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            await handler.cancel_run()

    asyncio.run(park())
    result = answer_elsewhere(store_url, flow.__name__, run)
    assert result["refused"] == [
        [name, "CheckpointInvalid", path, True, True] for name, path, _ in UNDECLARED + BAD_VALUE
    ]
    assert result["state"] == {"amount": 5, "inner": {"n": 7}, "approved_by": "ada"}
    with runtime(store_url) as rt:
        stored = stored_fields(rt, run)
        assert stored and all(
            set(fields) <= {"amount", "inner", "approved_by"} for fields in stored
        )
        assert stored[0] == result["state"]
        state: Any = rt.get_state(flow(runtime=rt), run)
        assert state.model_dump() == result["state"]


def test_setting_a_path_the_typed_state_does_not_declare_is_refused_naming_it(
    store_url: str,
) -> None:
    """P4: with `Context[Ledger]`, `ctx.store.set` of a field the model does not declare
    (at the top, in a nested model, under a missing field, under a scalar) raises
    `CheckpointInvalid` (a `ValueError`) whose `field` is the path, as a bad value's
    write does; the step catches it, the state and a read of the path are as they
    were, and the run goes on. The run parked after the refusals is answered in another
    process, which ends it with the state the refusals kept; no stored checkpoint holds
    an undeclared field."""
    refused_and_resumed_elsewhere(store_url, Strict)


def test_a_model_that_validates_assignments_is_refused_with_checkpoint_invalid(
    store_url: str,
) -> None:
    """P4: with a state model that validates assignments (`validate_assignment=True`),
    the model refuses a bad value, or an undeclared field, inside `ctx.store.set` with
    its own `ValidationError`; Remit raises `CheckpointInvalid` naming the path instead,
    the same refusal a model without it gets, and nothing is stored."""
    refused_and_resumed_elsewhere(store_url, Assigned)


# -- a model that takes undeclared fields ----------------------------------------------


class Open(BaseModel):
    model_config = ConfigDict(extra="allow")
    amount: int = 0


class Extra(Workflow):
    """`prepare` sets undeclared fields of a model that allows them, then waits."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context[Open], ev: StartEvent) -> StopEvent:
        await ctx.store.set("amount", 3)
        await ctx.store.set("note", {"tags": ["a", "b"], "n": 1})
        await ctx.store.set("note.n", 2)
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        await ctx.store.set("approved_by", answer.response)
        return StopEvent(result=(await ctx.store.get_state()).model_dump())


def test_a_model_that_allows_extra_fields_keeps_one_set_across_processes(
    store_url: str,
) -> None:
    """P1, P4: with `extra="allow"`, `ctx.store.set` of an undeclared field (and a path
    into it) is taken as the framework takes it, stored in the checkpoint of the pause,
    and read back by the process that answers; `rt.get_state` reads it as well."""
    run = new_run()

    async def park() -> None:
        with runtime(store_url) as rt:
            handler = Extra(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            await handler.cancel_run()

    asyncio.run(park())
    note = {"tags": ["a", "b"], "n": 2}
    with runtime(store_url) as rt:
        assert stored_fields(rt, run)[0] == {"amount": 3, "note": note}
    result = answer_elsewhere(store_url, "Extra", run)
    assert result == {"amount": 3, "note": note, "approved_by": "ada"}
    with runtime(store_url) as rt:
        state: Any = rt.get_state(Extra(runtime=rt), run)
        assert state.model_dump() == result
