"""LlamaIndex probes, round 15, on SQLite, PostgreSQL and Redis.

A context of the framework's own (a vanilla `ctx.to_dict()`, or a dict written by
hand) whose state does not fit the workflow seeded a new Remit run anyway: an
untyped (`DictState`) state given to a `Context[Model]` workflow ran and was
committed untyped, its invalid values unchecked (P4); a typed state naming another
model class was imported and built as that class (deserialization ran the named
class's validators) and the run went on with it; a state value that does not
decode (a `PickleSerializer` value, which Remit never unpickles) raised the
framework's bare `ValueError` or `JSONDecodeError`. The seed's values are now
validated into the workflow's own model (`CheckpointInvalid` naming the field), the
class a payload names is never resolved, and a value that does not decode is
`CheckpointInvalid` naming its key; nothing is stored.

Also pinned (these held): a fan-out by `ctx.send_event` to a step with `num_workers=3`
whose one worker waits for a typed answer, joined by `ctx.collect_events`, answered in
a process SIGKILLed in the join after it paid, or in the answered worker after it
paid: recovery runs only the step in flight again and pays everything once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, enter, entered, pay
from pydantic import BaseModel, Field, model_validator
from test_llamaindex_probes10 import recovered
from test_llamaindex_probes11 import run_driver
from test_llamaindex_probes12 import until_parked
from test_llamaindex_probes13 import applied, crash_here
from workflows import Context, Workflow, step
from workflows.context.serializers import PickleSerializer
from workflows.errors import WorkflowCancelledByUser
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid
from remit_llamaindex import RemitRuntime

GUARD = 30
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe15-{uuid.uuid4().hex[:12]}"


class Untimed(Workflow):
    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)


async def paused(flow: Workflow) -> dict[str, Any]:
    """The framework's own pause of a run of `flow`: `ctx.to_dict()` once it asks."""
    handler = flow.run()
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    data = handler.ctx.to_dict()
    await handler.cancel_run()
    with pytest.raises(WorkflowCancelledByUser):
        await asyncio.wait_for(handler, GUARD)
    return json.loads(json.dumps(data))


async def answered(rt: RemitRuntime, flow: Workflow, data: dict[str, Any], run: str) -> Any:
    """Run `flow` from the context `data` as `run`, answer its question, its result."""
    handler = flow.run(ctx=Context.from_dict(flow, data), run_id=run)
    await asyncio.wait_for(until_parked(rt, run), GUARD)
    await rt.send_event(handler, HumanResponseEvent(response="ok"))
    return await asyncio.wait_for(handler, GUARD)


# -- a context whose state does not fit the workflow -----------------------------------

built: list[str] = []


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)
    note: str = ""


class Lookalike(BaseModel):
    """Another model with the fields of `Order`: building it is recorded."""

    amount: int = -1
    note: str = ""

    @model_validator(mode="before")
    @classmethod
    def _record(cls, data: Any) -> Any:
        built.append("Lookalike")
        return data


class Typed(Untimed):
    @step
    async def ask(self, ctx: Context[Order], ev: StartEvent) -> StopEvent:
        await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        state = await ctx.store.get_state()
        return StopEvent(result=(type(state).__name__, state.amount, state.note))


class Untyped(Untimed):
    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=await ctx.store.get("count", default=None))


def untyped_seed(**values: str) -> dict[str, Any]:
    """A `DictState` payload as the framework writes it (each value serialized)."""
    return {
        "store_type": "in_memory",
        "state_type": "DictState",
        "state_module": "workflows.context.state_store",
        "state_data": {"_data": values},
    }


def typed_seed(cls: type[BaseModel], **values: Any) -> dict[str, Any]:
    """A typed payload as the framework writes it, naming the class `cls`."""
    return {
        "store_type": "in_memory",
        "state_type": cls.__name__,
        "state_module": cls.__module__,
        "state_data": json.dumps(
            {
                "__is_pydantic": True,
                "value": values,
                "qualified_name": f"{cls.__module__}.{cls.__name__}",
            }
        ),
    }


def test_a_seed_of_another_shape_is_taken_as_the_declared_model_or_refused(
    store_url: str,
) -> None:
    """P4 for a context seeding a new run: an untyped state given to a `Context[Order]`
    workflow runs as an `Order` holding its values, and one whose value fails the model
    is refused naming the field; a typed state naming another class (`Lookalike`) runs
    as an `Order` with its values, without that class ever being built; an invalid one
    is refused naming the field. A refused seed stores nothing."""

    async def scenario() -> None:
        rt = RemitRuntime(store_url)
        data = await paused(Typed())
        built.clear()

        run = new_run()
        seed = {**data, "state": untyped_seed(amount="4", note='"hi"')}
        assert await answered(rt, Typed(runtime=rt), seed, run) == ("Order", 4, "hi")
        state: Any = rt.get_state(Typed(runtime=rt), run)
        assert type(state) is Order and (state.amount, state.note) == (4, "hi")

        run = new_run()
        seed = {**data, "state": typed_seed(Lookalike, amount=7, note="x")}
        assert await answered(rt, Typed(runtime=rt), seed, run) == ("Order", 7, "x")
        assert type(rt.get_state(Typed(runtime=rt), run)) is Order
        assert built == []

        for seed_state in (untyped_seed(amount="-3"), typed_seed(Lookalike, amount=-3)):
            run = new_run()
            flow = Typed(runtime=rt)
            with pytest.raises(CheckpointInvalid) as refused:
                flow.run(ctx=Context.from_dict(flow, {**data, "state": seed_state}), run_id=run)
            assert refused.value.field == "amount"
            assert rt.remit.branch(run) is None
        assert built == []

    asyncio.run(scenario())


class TypedLookalike(Untimed):
    @step
    async def ask(self, ctx: Context[Lookalike], ev: StartEvent) -> StopEvent:
        await ctx.store.set("amount", 5)
        await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result="done")


def test_a_stored_state_is_read_into_the_readers_model_never_the_class_it_names(
    store_url: str,
) -> None:
    """Deserialization runs no code the record chooses: a checkpoint whose state names a
    class (`Lookalike`, written by a workflow whose model it was) is read by a workflow
    declaring `Order` from its field values; the named class is never imported or
    built (its validator would run), as a class renamed or moved since reads too."""

    async def scenario() -> None:
        rt = RemitRuntime(store_url)
        run = new_run()
        handler = TypedLookalike(runtime=rt).run(run_id=run)
        await asyncio.wait_for(until_parked(rt, run), GUARD)
        built.clear()
        state: Any = rt.get_state(Typed(runtime=rt), run)
        assert type(state) is Order and (state.amount, state.note) == (5, "")
        assert built == []
        await handler.cancel_run()
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)

    asyncio.run(scenario())


class Thing:
    """A value JSON cannot hold: the framework's `PickleSerializer` pickles it."""

    def __init__(self, n: int) -> None:
        self.n = n


class Pickling(Untimed):
    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        await ctx.store.set("thing", Thing(1))
        await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result="done")


def test_a_seed_value_that_does_not_decode_is_refused_naming_its_key(store_url: str) -> None:
    """P4, no code on read: a context the framework paused with its `PickleSerializer`
    holds a pickled value; restored on Remit (with the default serializer) it is
    refused with `CheckpointInvalid` naming the key and saying Remit never unpickles,
    not the framework's bare decoding error; a state that is no state payload at all
    is refused so too. Nothing is stored, and the same context with a state that
    decodes runs."""

    async def scenario() -> None:
        handler = Pickling().run()
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                break
        data = json.loads(json.dumps(handler.ctx.to_dict(serializer=PickleSerializer())))
        await handler.cancel_run()
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)
        stored = data["state"]["state_data"]["_data"]["thing"]
        assert pickle.loads(base64.b64decode(stored)).n == 1  # (the framework pickled it)

        rt = RemitRuntime(store_url)
        run = new_run()
        flow = Untyped(runtime=rt)
        with pytest.raises(CheckpointInvalid, match="unpickle") as refused:
            flow.run(ctx=Context.from_dict(flow, data), run_id=run)
        assert refused.value.field == "thing"
        assert rt.remit.branch(run) is None

        for state in (
            {**data["state"], "state_data": "[1, 2]"},
            {"store_type": "elsewhere", "state_data": None},
        ):
            run = new_run()
            with pytest.raises(CheckpointInvalid):
                flow.run(ctx=Context.from_dict(flow, {**data, "state": state}), run_id=run)
            assert rt.remit.branch(run) is None

        run = new_run()
        seed = {**data, "state": untyped_seed(thing='"x"', count="2")}
        assert await answered(rt, Untyped(runtime=rt), seed, run) == 2

    asyncio.run(scenario())


# -- a send_event fan-out, one worker waiting for an answer, joined, SIGKILLed -----------


class Item(Event):
    i: int


class Done(Event):
    i: int
    paid: str


class Ask(InputRequiredEvent):
    i: int


class Yes(HumanResponseEvent):
    i: int


class Fan(Untimed):
    """`start` sends three items; `work` (three workers) pays for each, item 1 only once
    it is answered; `join` collects the three and pays for the lot."""

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | None:
        enter("start")
        for i in range(3):
            ctx.send_event(Item(i=i))
        return None

    @step(num_workers=3)
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter(f"work{ev.i}")
        if ev.i != 1:
            return Done(i=ev.i, paid=pay(f"item{ev.i}"))
        answer = await ctx.wait_for_event(
            Yes, waiter_event=Ask(i=1, prefix="ok?"), requirements={"i": 1}, timeout=None
        )
        paid = pay(f"item1-{answer.response}")
        crash_here("work1")
        return Done(i=ev.i, paid=paid)

    @step
    async def join(self, ctx: Context, ev: Done) -> StopEvent | None:
        got = ctx.collect_events(ev, [Done] * 3)
        if got is None:
            return None
        enter("join")
        paid = pay("all:" + "+".join(sorted(d.paid for d in got)))
        crash_here("join")
        return StopEvent(result=paid)


FAN_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes15 import Fan, Yes, until_parked

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = Fan(runtime=rt).run(run_id={run!r})
    await until_parked(rt, {run!r})
    await rt.send_event(handler, Yes(i=1, response="ok"))
    await asyncio.wait_for(handler, 30)

asyncio.run(main())
"""


@pytest.mark.parametrize("point", ["join", "work1"])
def test_a_fan_out_with_a_waiting_worker_killed_after_paying_pays_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """P1, P2: the process that answered worker 1 is SIGKILLed after a payment (in the
    join, or in the answered worker). Recovery here runs only the step in flight
    again: `start` and the other workers are not entered again, every item and the
    join are paid once, and the join holds all three items."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = FAN_DRIVER.format(tests=TESTS, url=store_url, run=run)
    dead = run_driver(code, tmp_path, PROBE13_CRASH=point)
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)
    before = entered(tmp_path)

    async def take_over() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Fan(runtime=rt), run)
        assert handler is not None
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(take_over()) == "all:item0+item1-ok+item2"
    again = entered(tmp_path)[len(before) :]
    assert again == (["join"] if point == "join" else ["work1", "join"])
    assert sorted(before[:4]) == ["start", "work0", "work1", "work2"]
    assert sorted(applied(tmp_path)) == ["all:item0+item1-ok+item2", "item0", "item1-ok", "item2"]


def test_a_runtime_naming_an_unknown_engine_is_refused_where_it_is_made() -> None:
    """A mistyped URL is refused as the runtime is made, naming it; before, the first run
    failed with it."""
    with pytest.raises(ValueError, match=r"unsupported store URL 'mysql://h/db'"):
        RemitRuntime("mysql://h/db")
    assert RemitRuntime("redis://127.0.0.1:6379/0").url == "redis://127.0.0.1:6379/0"
