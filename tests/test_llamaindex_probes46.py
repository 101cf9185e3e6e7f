"""LlamaIndex probe round 46: state values at the codec's edge, `edit_state` blocks that
raise, events whose validators change what they hold, and `@effect` in a served step.

A state value nested deeper than the serializer recurses (a list in a list, some
hundreds of levels down) was refused, at a few hundred levels, naming a path of
hundreds of `[0]`s and saying "a list cannot be stored as JSON", and deeper still the
step got a bare `RecursionError` (through `ctx.store` and the server's state store
alike): now `CheckpointInvalid` names the key and says it is nested too deeply, and
nothing is stored (P4).

Left open here, fixed in round 47: an `@effect` in a step the workflow server runs was
refused ("called outside a Remit step"), since the server's store saw no step
executions; it is now recorded and applied once.

Held: an `edit_state` block that raises midway (after changing a nested list in place)
stores nothing of the edit, in a running step and on a parked run; NaN and infinities
read back as themselves on every engine; a start, step or stop event whose validator
would read its stored copy as another value is refused before it could change under a
recovery, and one whose validator reads it back as it is runs on; a server SIGKILLed
while its run waits is answered through the next server on the store (each step before
the wait once, the answer once); `handler.cancel_run()` of a parked copy while another
process, stopped just after consuming the answer, holds the run: the run completes
once, paid once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay
from pydantic import BaseModel, Field, field_validator
from workflows import Context, Workflow, step
from workflows.context.serializers import JsonSerializer
from workflows.context.state_store import DictState
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import CheckpointInvalid, UnknownRecord
from remit_llamaindex import RemitRuntime, RemitWorkflowStore

GUARD = 60
TESTS = str(Path(__file__).parent)


def nested(depth: int) -> list[Any]:
    """A list holding a list ... `depth` levels down."""
    top: list[Any] = []
    inner = top
    for _ in range(depth):
        deeper: list[Any] = []
        inner.append(deeper)
        inner = deeper
    return top


#: Deeper than the serializer recurses, at a few hundred levels and far below.
DEPTHS = [600, 3 * sys.getrecursionlimit()]


def refusal(exc: Exception) -> list[str]:
    """The field a refusal names (or the class of an error that names none), and its text."""
    return [getattr(exc, "field", None) or type(exc).__name__, str(exc)[:300]]


async def parked(handler: Any) -> None:
    """Stream `handler` until its run asks its question (committed and parked)."""
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            return
    raise AssertionError("the run ended without asking")


async def answered(rt: RemitRuntime, flow: Workflow, run: str) -> Any:
    return await asyncio.wait_for(
        await rt.respond(flow, run, HumanResponseEvent(response="ok")), GUARD
    )


# -- a state value nested too deeply ----------------------------------------------------


class Box(BaseModel):
    data: list[Any] = Field(default_factory=list)
    n: int = 0


class DeepUntyped(Workflow):
    """Tries to store each `depths` value under "deep", noting what was refused."""

    @step
    async def go(self, ctx: Context, ev: StartEvent) -> StopEvent:
        await ctx.store.set("n", 1)
        refused = []
        for depth in ev.depths:
            try:
                await ctx.store.set("deep", nested(depth))
            except Exception as exc:  # (anything else is a finding: noted, not raised)
                refused.append(refusal(exc))
        await ctx.store.set("n", 2)
        return StopEvent(result=refused)


class DeepTyped(Workflow):
    @step
    async def go(self, ctx: Context[Box], ev: StartEvent) -> StopEvent:
        await ctx.store.set("n", 1)
        refused = []
        for depth in ev.depths:
            try:
                await ctx.store.set("data", nested(depth))
            except Exception as exc:  # (anything else is a finding: noted, not raised)
                refused.append(refusal(exc))
        await ctx.store.set("n", 2)
        return StopEvent(result=refused)


@pytest.mark.parametrize("workflow", [DeepUntyped, DeepTyped])
def test_a_state_value_nested_too_deeply_is_refused_naming_its_key(
    url: str, workflow: type[Workflow]
) -> None:
    """P4: the write raises `CheckpointInvalid` naming the key (the step catches it and
    goes on), not a bare `RecursionError` or a path hundreds of `[0]`s long, and the
    stored state holds nothing of it."""
    run = f"probe46-{uuid.uuid4().hex[:12]}"
    key = "deep" if workflow is DeepUntyped else "data"

    async def go() -> list[list[str]]:
        rt = RemitRuntime(url)
        try:
            result = await asyncio.wait_for(
                workflow(runtime=rt).run(run_id=run, depths=DEPTHS), GUARD
            )
            assert rt.status(run) == "completed"
            state = RemitRuntime(url).get_state(workflow(), run)
            if workflow is DeepUntyped:
                assert dict(state.items()) == {"n": 2}
            else:
                assert (state.data, state.n) == ([], 2)
            return list(result)
        finally:
            rt.remit.close()

    refused = asyncio.run(go())
    assert [field for field, _ in refused] == [key] * len(DEPTHS)
    assert all("nested too deeply" in message for _, message in refused), refused


def test_the_server_state_store_refuses_a_value_nested_too_deeply(store_url: str) -> None:
    """The server's state store (`RemitWorkflowStore.create_state_store`) the same way."""
    run = f"probe46-srv-{uuid.uuid4().hex[:10]}"
    namespace = uuid.uuid4().hex[:8]

    async def go() -> None:
        store = RemitWorkflowStore(store_url, namespace=namespace)
        state = store.create_state_store(run, DictState, serializer=JsonSerializer())
        await state.set("n", 1)
        refused = []
        for depth in DEPTHS:
            try:
                await state.set("deep", nested(depth))
            except Exception as exc:
                refused.append(refusal(exc))
        assert [field for field, _ in refused] == ["deep"] * len(DEPTHS)
        assert all("nested too deeply" in message for _, message in refused), refused
        fresh = RemitWorkflowStore(store_url, namespace=namespace).create_state_store(
            run, DictState, serializer=JsonSerializer()
        )
        assert dict((await fresh.get_state()).items()) == {"n": 1}

    asyncio.run(go())


# -- an edit_state block that raises midway ---------------------------------------------


class Ledger(BaseModel):
    items: list[int] = Field(default_factory=list)
    n: int = 0
    x: float = 0.0


class Halfway(Exception):
    pass


class EditThenAsk(Workflow):
    """Edits its state in a block that raises after changing a nested list in place and
    a field, catches that, stores NaN and an infinity, then asks and ends."""

    @step
    async def go(self, ctx: Context[Ledger], ev: StartEvent) -> StopEvent:
        await ctx.store.set("items", [1])
        try:
            async with ctx.store.edit_state() as state:
                state.items.append(2)
                state.n = 5
                raise Halfway
        except Halfway:
            pass
        await ctx.store.set("x", float(ev.x))
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="go on?"), timeout=None
        )
        state = await ctx.store.get_state()
        return StopEvent(result=[state.items, state.n, str(state.x), answer.response])


@pytest.mark.parametrize("x", ["nan", "inf", "-inf"])
def test_an_edit_state_block_that_raises_stores_nothing_of_its_edit(url: str, x: str) -> None:
    """P4: the parked run's checkpoint (read in another runtime) holds the state as it was
    before the block, and a float NaN or infinity as itself; the run ends so too."""
    run = f"probe46-{uuid.uuid4().hex[:12]}"

    async def go() -> Any:
        rt = RemitRuntime(url)
        other = RemitRuntime(url)
        try:
            await asyncio.wait_for(parked(EditThenAsk(runtime=rt).run(run_id=run, x=x)), GUARD)
            state = other.get_state(EditThenAsk(), run)
            assert (state.items, state.n, str(state.x)) == ([1], 0, str(float(x)))
            return await answered(other, EditThenAsk(runtime=other), run)
        finally:
            rt.remit.close()
            other.remit.close()

    assert asyncio.run(go()) == [[1], 0, str(float(x)), "ok"]


class Ask(Workflow):
    @step
    async def go(self, ctx: Context[Ledger], ev: StartEvent) -> StopEvent:
        await ctx.store.set("items", [1])
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="?"), timeout=None
        )
        return StopEvent(result=[(await ctx.store.get_state()).items, answer.response])


def test_an_edit_state_block_on_a_parked_run_that_raises_commits_nothing(url: str) -> None:
    """An edit of a parked run through its handler (`handler.ctx.store.edit_state()`)
    that raises midway commits no checkpoint, and the run ends with its state as it was."""
    run = f"probe46-{uuid.uuid4().hex[:12]}"

    async def go() -> Any:
        rt = RemitRuntime(url)
        try:
            flow = Ask(runtime=rt)
            handler = flow.run(run_id=run)
            await asyncio.wait_for(parked(handler), GUARD)
            before = [c.checkpoint_id for c in rt.checkpoints(run)]
            with pytest.raises(Halfway):
                async with handler.ctx.store.edit_state() as state:
                    state.items.append(2)
                    state.n = 9
                    raise Halfway
            assert [c.checkpoint_id for c in rt.checkpoints(run)] == before
            assert (await handler.ctx.store.get_state()).items == [1]
            assert RemitRuntime(url).get_state(flow, run).items == [1]
            await handler.ctx.store.set("n", 3)  # the handler's store still takes writes
            return await answered(rt, flow, run), rt.get_state(flow, run).n
        finally:
            rt.remit.close()

    assert asyncio.run(go()) == ([[1], "ok"], 3)


# -- events whose validators change what they hold --------------------------------------


class Doubled(StartEvent):
    amount: int

    @field_validator("amount")
    @classmethod
    def twice(cls, v: int) -> int:
        return v * 2


class Trimmed(StartEvent):
    name: str

    @field_validator("name")
    @classmethod
    def trim(cls, v: str) -> str:
        return v.strip().lower()


class Bumped(Event):
    n: int

    @field_validator("n")
    @classmethod
    def bump(cls, v: int) -> int:
        return v + 10


class Tallied(StopEvent):
    total: int

    @field_validator("total")
    @classmethod
    def plus_one(cls, v: int) -> int:
        return v + 1


class Named(StopEvent):
    name: str

    @field_validator("name")
    @classmethod
    def trim(cls, v: str) -> str:
        return v.strip().lower()


class Begins(Workflow):
    """Ends at once: the start event alone is what is probed."""

    @step
    async def go(self, ev: Doubled) -> StopEvent:
        return StopEvent(result=ev.amount)


class Bumps(Workflow):
    @step
    async def go(self, ev: StartEvent) -> Bumped:
        return Bumped(n=1)

    @step
    async def end(self, ev: Bumped) -> StopEvent:
        return StopEvent(result=ev.n)


class Tallies(Workflow):
    @step
    async def go(self, ev: StartEvent) -> Tallied:
        return Tallied(total=1)


class Trims(Workflow):
    """Validators that read their own output back as it is: asks, then ends."""

    @step
    async def go(self, ctx: Context, ev: Trimmed) -> Named:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="?"), timeout=None
        )
        return Named(name=f" {ev.name}-{answer.response} ")


def test_a_start_event_its_validator_would_change_on_restore_is_refused_unstored(
    url: str,
) -> None:
    """P4, P6: `Doubled(amount=2)` holds 4, and its stored copy would read back as 8 in a
    recovery: refused with `CheckpointInvalid` naming the field, and no run is stored."""
    run = f"probe46-{uuid.uuid4().hex[:12]}"

    async def go() -> None:
        rt = RemitRuntime(url)
        try:
            with pytest.raises(CheckpointInvalid) as refused:
                await asyncio.wait_for(
                    Begins(runtime=rt).run(start_event=Doubled(amount=2), run_id=run), GUARD
                )
            assert refused.value.field == "Doubled.amount"
            with pytest.raises(UnknownRecord):
                rt.status(run)
        finally:
            rt.remit.close()

    asyncio.run(go())


@pytest.mark.parametrize(("workflow", "field"), [(Bumps, "Bumped.n"), (Tallies, "Tallied.total")])
def test_a_step_or_stop_event_its_validator_would_change_fails_the_run(
    url: str, workflow: type[Workflow], field: str
) -> None:
    """P4, P6: a step's event (or its `StopEvent` subclass) that a recovery would read as
    another value fails the run naming the field, committed as `failed`, with no
    result a reader could take for the one the step returned."""
    run = f"probe46-{uuid.uuid4().hex[:12]}"

    async def go() -> None:
        rt = RemitRuntime(url)
        try:
            with pytest.raises(CheckpointInvalid) as refused:
                await asyncio.wait_for(workflow(runtime=rt).run(run_id=run), GUARD)
            assert refused.value.field == field
            assert rt.status(run) == "failed"
        finally:
            rt.remit.close()

    asyncio.run(go())


def test_events_whose_validators_read_them_back_as_they_are_run_across_processes(
    url: str,
) -> None:
    """Validators that normalise (strip, lower) read their stored copy back unchanged: the
    run starts, parks, is answered by another runtime, and its result reads back the same
    from the store."""
    run = f"probe46-{uuid.uuid4().hex[:12]}"

    async def go() -> tuple[Any, Any]:
        rt = RemitRuntime(url)
        other = RemitRuntime(url)
        try:
            handler = Trims(runtime=rt).run(start_event=Trimmed(name="  ADA "), run_id=run)
            await asyncio.wait_for(parked(handler), GUARD)
            result = await answered(other, Trims(runtime=other), run)
            return result, RemitRuntime(url).result(run)
        finally:
            rt.remit.close()
            other.remit.close()

    result, stored = asyncio.run(go())
    assert isinstance(result, Named) and result.name == "ada-ok"
    assert isinstance(stored, Named) and stored.name == "ada-ok"


# -- @effect in a step the workflow server runs -----------------------------------------


class Charge(Workflow):
    @step
    async def charge(self, ev: StartEvent) -> StopEvent:
        return StopEvent(result=pay("served"))


def test_an_effect_in_a_served_step_is_recorded_and_applied_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a user of the server with Remit's store expects of `@effect` (P2): recorded
    in the run's ledger and applied once (round 47; crashes: test_llamaindex_probes47)."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    from llama_agents.server import WorkflowServer

    async def go() -> dict[str, Any]:
        store = RemitWorkflowStore(store_url, namespace=uuid.uuid4().hex[:8])
        server = WorkflowServer(workflow_store=store)
        server.add_workflow("charge", Charge(timeout=None))
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                done = await client.post("/workflows/charge/run", json={"start_event": {}})
                return dict(done.json())

    done = asyncio.run(asyncio.wait_for(go(), GUARD))
    stop = done["result"]  # the server gives the `StopEvent` whole
    assert (done["status"], stop["value"]["result"]) == ("completed", "served"), done
    assert applied(tmp_path) == ["served"]


# -- a server SIGKILLed while its run waits for an answer -------------------------------


class Asked(Event):
    pass


class Approval(Workflow):
    """`prepare` pays, then `approve` waits for an answer and ends with it."""

    @step
    async def prepare(self, ev: StartEvent) -> Asked:
        enter("prepare")
        return Asked()

    @step
    async def approve(self, ctx: Context, ev: Asked) -> StopEvent:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        enter(f"answered:{answer.response}")
        return StopEvent(result=answer.response)


def approval_server(store: RemitWorkflowStore) -> Any:
    from llama_agents.server import WorkflowServer

    server = WorkflowServer(workflow_store=store)
    server.add_workflow("approval", Approval(timeout=None), additional_events=[HumanResponseEvent])
    return server


WAITING_SERVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
import httpx
from remit_llamaindex import RemitWorkflowStore
from test_llamaindex_probes46 import approval_server

async def main():
    store = RemitWorkflowStore({url!r}, namespace={ns!r}, lease={lease!r})
    server = approval_server(store)
    async with server.contextmanager():
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
            body = {{"start_event": {{}}}}
            started = await client.post("/workflows/approval/run-nowait", json=body)
            run_id = started.json()["run_id"]
            asked = lambda events: [e for e in events if "InputRequired" in e.event.type]
            while not asked(await store.query_events(run_id)):
                await asyncio.sleep(0.02)
            print(started.json()["handler_id"], flush=True)
            await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_server_killed_while_its_run_waits_is_answered_through_the_next_server(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """L1, P1: the server process is SIGKILLed while its run waits for an answer (its
    claim still held); an answer posted at once to a server started on the same store
    reloads the run (started moments ago, it is not resumed at start-up: the server's
    start-up resume racing the reload could drop the answer, in the framework), which
    writes once the dead holder's lease ran out, and completes:
    `prepare` is not entered again, `approve` (waiting at the kill) runs again from its
    top as the framework re-runs a waiting step, and the answer is taken once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    ns, lease = uuid.uuid4().hex[:8], 2.0
    code = WAITING_SERVER.format(tests=TESTS, url=store_url, ns=ns, lease=lease)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        handler_id = child.stdout.readline().strip()
        assert handler_id, child.communicate(timeout=GUARD)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert entered(tmp_path) == ["prepare", "approve"]

    async def restart() -> dict[str, Any]:
        store = RemitWorkflowStore(store_url, namespace=ns, lease=lease)
        server = approval_server(store)
        async with server.contextmanager():
            transport = httpx.ASGITransport(app=server.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                # Posted at once, while the dead server's claim has not run out yet.
                answer = {"type": "HumanResponseEvent", "value": {"response": "ada"}}
                sent = await client.post(f"/events/{handler_id}", json={"event": answer})
                deadline = time.monotonic() + GUARD
                assert sent.status_code == 200, sent.text
                while time.monotonic() < deadline:
                    result = (await client.get(f"/results/{handler_id}")).json()
                    if result.get("status") != "running":
                        return dict(result)
                    await asyncio.sleep(0.1)
                raise AssertionError("the resumed run did not end")

    result = asyncio.run(restart())
    assert (result["status"], result.get("result")) == ("completed", "ada"), result
    assert entered(tmp_path) == ["prepare", "approve", "approve", "answered:ada"]


# -- handler.cancel_run() racing an answer from another process -------------------------


class Confirm(Workflow):
    """Asks, then pays for what it was told and ends with it."""

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("ask")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="?"), timeout=None
        )
        enter(f"told:{answer.response}")
        return StopEvent(result=pay(answer.response))


ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes46 import Confirm

async def main():
    rt = RemitRuntime({url!r})
    handler = await rt.respond(Confirm(runtime=rt), {run!r}, HumanResponseEvent(response="ada"))
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP: its state in /proc reads "T")."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_cancel_run_of_a_parked_copy_racing_an_answer_from_another_process(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P2, P5: another process consumes the answer and is stopped there (failpoint
    `interrupt.after_consume=stop`, its claim held); this process then cancels its parked
    copy (`handler.cancel_run()`), and the other process goes on: the cancel stops only
    this copy and writes nothing, the answer is taken once, and the run completes with
    it, paid once."""
    from workflows.errors import WorkflowCancelledByUser

    from remit_core.errors import ResumeConflict

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = f"probe46-{uuid.uuid4().hex[:12]}"
    code = ANSWER.format(tests=TESTS, url=url, run=run)

    async def go() -> tuple[str, str, Any]:
        rt = RemitRuntime(url)
        try:
            handler = Confirm(runtime=rt).run(run_id=run)
            await asyncio.wait_for(parked(handler), GUARD)
            env = {**os.environ, "REMIT_FAILPOINTS": "interrupt.after_consume=stop"}
            other = subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                deadline = time.monotonic() + GUARD
                while not stopped(other.pid):
                    assert other.poll() is None and time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                await handler.cancel_run()
                try:
                    ended: Any = await asyncio.wait_for(handler, GUARD)
                except (WorkflowCancelledByUser, ResumeConflict) as exc:
                    ended = type(exc)
                other.send_signal(signal.SIGCONT)
                out, err = await asyncio.to_thread(other.communicate, timeout=GUARD * 2)
            finally:
                if other.poll() is None:
                    other.kill()
                    other.wait()
            assert other.returncode == 0, err
            return out.split("RESULT ", 1)[1].strip(), rt.status(run), ended
        finally:
            rt.remit.close()

    result, status, ended = asyncio.run(go())
    assert (result, status) == ("ada", "completed")
    assert ended in (WorkflowCancelledByUser, ResumeConflict), ended
    assert applied(tmp_path) == ["ada"]
    assert entered(tmp_path).count("told:ada") == 1
