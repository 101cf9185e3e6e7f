"""RemitWorkflowStore under the real workflow server (llama-agents-server), per engine."""

from __future__ import annotations

import asyncio
import gc
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import httpx
import pytest
from llama_agents.server import HandlerQuery, PersistentHandler, WorkflowServer
from pydantic import BaseModel, Field
from workflows import Context, Workflow, step
from workflows.context.serializers import JsonSerializer
from workflows.context.state_store import DictState
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid, Fenced, ResumeConflict, WriteConflict
from remit_llamaindex import RemitWorkflowStore


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)
    approved_by: str | None = None


class Asked(Event):
    pass


class OrderFlow(Workflow):
    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> Asked:
        await ctx.store.set("amount", ev.get("amount", 1))
        return Asked()

    @step
    async def approve(self, ctx: Context[Order], ev: Asked) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        await ctx.store.set("approved_by", answer.response)
        return StopEvent(result=answer.response)


def new_store(url: str, **kw: Any) -> RemitWorkflowStore:
    return RemitWorkflowStore(url, namespace=uuid.uuid4().hex[:8], **kw)


def handler(run_id: str, status: str = "running", **kw: Any) -> PersistentHandler:
    now = datetime.now(timezone.utc)
    return PersistentHandler(
        handler_id=f"h-{run_id}",
        workflow_name="order",
        status=status,
        run_id=run_id,
        started_at=now,
        updated_at=now,
        **kw,
    )


def tick(n: int) -> dict[str, Any]:
    return {"serialized_tick": f"tick-{n}"}


def test_server_runs_a_human_in_the_loop_workflow_on_remit(store_url: str) -> None:
    """The server persists handler, contiguous ticks and events, and validated state; the
    run survives a garbage collection while it waits (nothing else holds it then)."""
    store = new_store(store_url)
    server = WorkflowServer(workflow_store=store)
    server.add_workflow("order", OrderFlow(timeout=None), additional_events=[HumanResponseEvent])

    async def go() -> None:
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                started = await client.post(
                    "/workflows/order/run-nowait", json={"start_event": {"amount": 3}}
                )
                handler_id, run_id = started.json()["handler_id"], started.json()["run_id"]
                while not [
                    e for e in await store.query_events(run_id) if "InputRequired" in e.event.type
                ]:
                    await asyncio.sleep(0.02)
                await asyncio.sleep(0.1)
                gc.collect()
                answer = {"type": "HumanResponseEvent", "value": {"response": "alice"}}
                sent = await client.post(f"/events/{handler_id}", json={"event": answer})
                assert sent.status_code == 200
                for _ in range(200):
                    result = (await client.get(f"/results/{handler_id}")).json()
                    if result["status"] != "running":
                        break
                    await asyncio.sleep(0.02)
        assert (result["status"], result["result"]) == ("completed", "alice")
        ticks = [t.sequence for t in await store.get_ticks(run_id)]
        events = [e.sequence for e in await store.query_events(run_id)]
        assert ticks == list(range(len(ticks))) and len(ticks) > 4
        assert events == list(range(len(events)))
        (persisted,) = await store.query(HandlerQuery(run_id_in=[run_id]))
        assert persisted.status == "completed" and persisted.result is not None
        state = store.create_state_store(run_id, Order, serializer=JsonSerializer())
        assert await state.get_state() == Order(amount=3, approved_by="alice")

    asyncio.run(go())


def test_a_run_released_while_idle_is_reloaded_by_its_answer(store_url: str) -> None:
    """A waiting run goes idle (its claim released, its memory dropped); the answer makes
    the server reload it, and the reload's status write and its first tick write share
    one claim: the run completes, whether the server that started it answers or another."""
    deployment = uuid.uuid4().hex[:8]

    async def serve(handler_id: str | None, answer: bool) -> dict[str, Any]:
        store = RemitWorkflowStore(store_url, namespace=deployment)
        server = WorkflowServer(workflow_store=store, idle_timeout=0.2)
        server.add_workflow(
            "order", OrderFlow(timeout=None), additional_events=[HumanResponseEvent]
        )
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                if handler_id is None:
                    started = await client.post(
                        "/workflows/order/run-nowait", json={"start_event": {"amount": 3}}
                    )
                    handler_id = started.json()["handler_id"]
                    query = HandlerQuery(handler_id_in=[handler_id], is_idle=True)
                    while not await store.query(query):
                        await asyncio.sleep(0.05)
                    await asyncio.sleep(0.3)  # released from memory too
                result = {"handler_id": handler_id}
                if answer:
                    event = {"type": "HumanResponseEvent", "value": {"response": "alice"}}
                    sent = await client.post(f"/events/{handler_id}", json={"event": event})
                    assert sent.status_code == 200, sent.text
                    for _ in range(200):
                        result = (await client.get(f"/results/{handler_id}")).json()
                        if result["status"] != "running":
                            break
                        await asyncio.sleep(0.02)
        return result

    async def go() -> None:
        for _ in range(3):
            result = await serve(None, answer=True)
            assert (result["status"], result["result"]) == ("completed", "alice")
        started = await serve(None, answer=False)
        result = await serve(started["handler_id"], answer=True)
        assert (result["status"], result["result"]) == ("completed", "alice")

    asyncio.run(go())


def test_a_lost_append_race_is_refused_not_renumbered(store_url: str) -> None:
    """Server A appends tick 0 and goes idle; server C reads the journal and appends 1;
    A, still expecting slot 1, is refused with `WriteConflict` (never written as 2)."""
    run_id = f"srv-{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        a, b, c = (new_store(store_url) for _ in range(3))
        await a.append_tick(run_id, tick(0))
        with pytest.raises(ResumeConflict):  # each refused append runs as its own run task
            await asyncio.create_task(b.append_tick(run_id, tick(0)))
        await a.update(handler(run_id, idle_since=datetime.now(timezone.utc)))
        assert [t.sequence for t in await c.get_ticks(run_id)] == [0]
        await c.append_tick(run_id, tick(1))
        await c.update(handler(run_id, idle_since=datetime.now(timezone.utc)))
        with pytest.raises(WriteConflict):
            await asyncio.create_task(a.append_tick(run_id, tick(1)))
        assert [t.tick_data for t in await c.get_ticks(run_id)] == [tick(0), tick(1)]

    asyncio.run(go())


def test_a_failed_tick_append_stops_the_run(store_url: str) -> None:
    """The server swallows a failed `append_tick`; the store cancels the run's task and
    refuses the run's later writes, so the run cannot go on with a gap in its journal."""
    run_id = f"srv-{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        owner, other = new_store(store_url), new_store(store_url)
        await owner.append_tick(run_id, tick(0))

        async def control_loop() -> None:
            try:
                await other.append_tick(run_id, tick(0))
            except ResumeConflict:
                pass  # what the server's tick persistence does: log and go on
            await asyncio.sleep(10)

        task = asyncio.create_task(control_loop())
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ResumeConflict):
            await other.append_event(run_id, _envelope())
        assert [t.sequence for t in await owner.get_ticks(run_id)] == [0]

    asyncio.run(go())


def test_status_change_of_a_taken_over_run_is_fenced(store_url: str) -> None:
    run_id = f"srv-{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        deployment = uuid.uuid4().hex[:8]
        zombie = RemitWorkflowStore(store_url, lease=0.4, namespace=deployment)
        successor = RemitWorkflowStore(store_url, namespace=deployment)
        await zombie.update(handler(run_id))
        zombie._claims[run_id].abandon()  # the holder stops renewing, as a paused process
        time.sleep(0.5)
        await successor.get_ticks(run_id)
        await successor.append_tick(run_id, tick(0))
        with pytest.raises(Fenced):
            await zombie.update(handler(run_id, status="completed"))
        (stored,) = await successor.query(HandlerQuery(run_id_in=[run_id]))
        assert stored.status == "running"

    asyncio.run(go())


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_state_writes_are_validated_and_nothing_invalid_is_stored(store_url: str) -> None:
    run_id = f"srv-{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        store = new_store(store_url)
        state = store.create_state_store(run_id, Order, serializer=JsonSerializer())
        await state.set("amount", 5)
        with pytest.raises(CheckpointInvalid) as refused:
            await state.set_state(Order.model_construct(amount=-5))
        assert "amount" in str(refused.value)
        with pytest.raises(CheckpointInvalid):
            await state.set("amount", "lots")
        fresh = new_store(store_url).create_state_store(run_id, Order, serializer=JsonSerializer())
        assert await fresh.get_state() == Order(amount=5)

    asyncio.run(go())


class Inner(BaseModel):
    score: int = Field(default=0, ge=0)


class Scored(BaseModel):
    count: int = Field(default=0, ge=0)
    inner: Inner = Field(default_factory=Inner)


class BadWrites(Workflow):
    """Each invalid write is caught in the step; the result lists the fields refused."""

    @step
    async def write(self, ctx: Context[Scored], ev: StartEvent) -> StopEvent:
        refused: list[str | None] = []
        for path, value in [("count", -1), ("count", "abc"), ("inner.score", -2)]:
            try:
                await ctx.store.set(path, value)
            except CheckpointInvalid as exc:
                refused.append(exc.field)
        try:
            async with ctx.store.edit_state() as state:
                state.count = -5
        except CheckpointInvalid as exc:
            refused.append(exc.field)
        return StopEvent(result=refused)


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_an_invalid_state_write_in_a_served_step_names_the_field(store_url: str) -> None:
    """P4 under the server: `CheckpointInvalid` names the field (nested ones too), as
    `RemitRuntime` does, and the state stays valid."""
    store = new_store(store_url)
    server = WorkflowServer(workflow_store=store)
    server.add_workflow("bad", BadWrites(timeout=None))

    async def go() -> None:
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                done = await client.post("/workflows/bad/run", json={"start_event": {}})
                body = done.json()
        assert body["result"]["value"]["result"] == ["count", "count", "inner.score", "count"]
        state = store.create_state_store(body["run_id"], Scored, serializer=JsonSerializer())
        assert await state.get_state() == Scored()

    asyncio.run(go())


def test_server_state_refuses_a_value_json_cannot_store(store_url: str) -> None:
    """A value the JSON serializer cannot store, or would read back as another value, is
    refused with `CheckpointInvalid` naming the key, not a bare `ValueError`."""
    run_id = f"srv-{uuid.uuid4().hex[:10]}"

    async def go() -> None:
        state = new_store(store_url).create_state_store(
            run_id, DictState, serializer=JsonSerializer()
        )
        await state.set("n", 1)
        for key, value in [("when", datetime(2020, 1, 1)), ("pair", (1, 2))]:
            with pytest.raises(CheckpointInvalid) as refused:
                await state.set(key, value)
            assert refused.value.field == key
        fresh = new_store(store_url).create_state_store(
            run_id, DictState, serializer=JsonSerializer()
        )
        assert dict((await fresh.get_state()).items()) == {"n": 1}

    asyncio.run(go())


def _envelope() -> Any:
    from llama_agents.client.protocol.serializable_events import EventEnvelopeWithMetadata

    return EventEnvelopeWithMetadata.from_event(StopEvent(result="x"))
