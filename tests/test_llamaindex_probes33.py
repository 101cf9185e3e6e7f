"""LlamaIndex probes, round 33, on SQLite, PostgreSQL and Redis.

`RemitWorkflowStore.query_events(run_id, limit=-1)` returned every event but the
last, without a word (the server's own stores answer a negative limit three ways:
all events, all but the last, an error), and a `limit` or `after_sequence` of the
wrong type failed with a bare slice error or one naming the core's `after_idx`. A
negative limit is now `ValueError`, a wrong type `TypeError` naming the argument;
every other call answers as the server's in-memory store does.

A private attribute (`PrivateAttr`) set on an event is dropped by the serializer: a
step's event, a resume value or a `StopEvent` subclass holding one was stored without
it, so a recovery (or `rt.result`) went on with the attribute's default. Such an
event is now refused where it enters (`CheckpointInvalid` naming `Event._attr`), as a
field the checkpoint would change is; one left at its default passes.

`rt.result` built the class a stored result names before checking it is a
`StopEvent`: a result naming a class of a loaded module that is not one (a class
replaced since) ran that class's code (`model_validate`) in a process that only read
a result. It is now refused (`CorruptRecord`) without building it.

Also pinned (this held): cancelling the task that awaits a handler, while its step is
inside an `@effect` or while the run waits for an answer, leaves the stored run
resumable; another process continues it from its prefix with the effect applied once
(once the copy left inside the effect has come out of it: the core keeps a claim
given up while an effect call of it still runs in its process).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from llama_agents.client.protocol.serializable_events import EventEnvelopeWithMetadata
from llama_agents.server._store.memory_workflow_store import MemoryWorkflowStore
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, enter, entered, pay, payments
from pydantic import PrivateAttr
from workflows import Context, Workflow, step
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent

from remit_core import NOT_APPLIED, effect
from remit_core.errors import CheckpointInvalid, CorruptRecord
from remit_llamaindex import RemitRuntime, RemitWorkflowStore

TESTS = str(Path(__file__).parent)
ROOT = str(Path(__file__).parent.parent)


def new_run() -> str:
    return f"probe33-{uuid.uuid4().hex[:12]}"


# -- the server store's event query with bad arguments ------------------------------------


class Note(Event):
    n: int


async def _three_events(store: Any, run: str) -> None:
    for n in range(3):
        await store.append_event(run, EventEnvelopeWithMetadata.from_event(Note(n=n)))


def test_server_event_query_refuses_a_negative_limit_and_wrong_types(store_url: str) -> None:
    """Valid calls answer as the framework's in-memory store does; a negative `limit` is
    `ValueError`, a `limit` or `after_sequence` of the wrong type a `TypeError` naming
    it, never a silent wrong answer."""

    async def go() -> None:
        remit, memory, run = RemitWorkflowStore(store_url), MemoryWorkflowStore(), new_run()
        await _three_events(remit, run)
        await _three_events(memory, run)
        for kw in (
            {},
            {"limit": 0},
            {"limit": 2},
            {"limit": 10},
            {"after_sequence": 0, "limit": 1},
            {"after_sequence": 2},
            {"after_sequence": 99},
            {"after_sequence": -5},
        ):
            got = [e.sequence for e in await remit.query_events(run, **kw)]
            assert got == [e.sequence for e in await memory.query_events(run, **kw)], kw
        assert await remit.query_events(new_run()) == []
        with pytest.raises(ValueError, match="limit"):
            await remit.query_events(run, limit=-1)
        for kw in ({"limit": "2"}, {"limit": 1.5}, {"limit": True}, {"after_sequence": "1"}):
            with pytest.raises(TypeError, match=next(iter(kw))):
                await remit.query_events(run, **kw)
        assert [e.sequence for e in await remit.query_events(run)] == [0, 1, 2]

    asyncio.run(go())


# -- private attributes the checkpoint drops ----------------------------------------------


class Tagged(Event):
    n: int
    _token: str = PrivateAttr(default="none")


class Receipt(StopEvent):
    total: int
    _signature: str = PrivateAttr(default="")


class Signed(HumanResponseEvent):
    _signer: str = PrivateAttr(default="")


class PassesTags(Workflow):
    @step
    async def start(self, ev: StartEvent) -> Tagged:
        tagged = Tagged(n=1)
        if ev.get("tag"):
            tagged._token = ev.get("tag")
        return tagged

    @step
    async def finish(self, ev: Tagged) -> StopEvent:
        return StopEvent(result=ev._token)


class SignsReceipt(Workflow):
    @step
    async def sign(self, ev: StartEvent) -> Receipt:
        receipt = Receipt(total=3)
        receipt._signature = "sig"
        return receipt


class AsksSigner(Workflow):
    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            Signed, waiter_event=InputRequiredEvent(prefix="sign?"), timeout=None
        )
        return StopEvent(result=answer.response)


def test_a_private_attribute_the_checkpoint_drops_is_refused_where_it_enters(
    store_url: str,
) -> None:
    """A step's event or a `StopEvent` subclass holding a private attribute fails the run
    with `CheckpointInvalid` naming it (committed as failed, never as a result that reads
    back without it); a resume value holding one is refused with the run still waiting;
    an attribute left at its default passes."""

    async def go() -> None:
        rt = RemitRuntime(store_url)
        plain = new_run()
        assert await PassesTags(runtime=rt, timeout=None).run(run_id=plain) == "none"

        tagged = new_run()
        with pytest.raises(CheckpointInvalid) as refused:
            await PassesTags(runtime=rt, timeout=None).run(run_id=tagged, tag="t-1")
        assert refused.value.field == "Tagged._token"
        assert rt.status(tagged) == "failed"

        signed = new_run()
        with pytest.raises(CheckpointInvalid) as refused:
            await SignsReceipt(runtime=rt, timeout=None).run(run_id=signed)
        assert refused.value.field == "Receipt._signature"
        assert rt.status(signed) == "failed"

        asked = new_run()
        flow = AsksSigner(runtime=rt, timeout=None)
        handler = flow.run(run_id=asked)
        await until_parked(rt, asked)
        answer = Signed(response="ada")
        answer._signer = "ada@example"
        with pytest.raises(CheckpointInvalid) as refused:
            await rt.respond(AsksSigner(runtime=rt, timeout=None), asked, answer)
        assert refused.value.field == "_signer"
        assert rt.status(asked) == "waiting"
        resumed = await rt.respond(flow, asked, Signed(response="bob"))
        assert await resumed == "bob"
        assert await handler == "bob"

    asyncio.run(go())


# -- a stored result naming a class that is not a StopEvent -------------------------------


class Finished(StopEvent):
    total: int


class Finishes(Workflow):
    @step
    async def go(self, ev: StartEvent) -> Finished:
        return Finished(total=7)


class _Trap:
    """Stands for a class that replaced `Finished` in this module: building it runs code."""

    built: list[object] = []

    def __init__(self, **values: object) -> None:
        _Trap.built.append(values)

    @classmethod
    def model_validate(cls, value: object) -> _Trap:
        cls.built.append(value)
        return cls()


def test_a_result_naming_a_class_that_is_not_a_stop_event_is_refused_unbuilt(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result's class was replaced since by one that is no `StopEvent`: reading the
    result is `CorruptRecord` naming run and checkpoint, and the class is never built."""
    run = new_run()

    async def go() -> object:
        return await Finishes(runtime=RemitRuntime(store_url), timeout=None).run(run_id=run)

    assert asyncio.run(go()) == Finished(total=7)
    assert RemitRuntime(store_url).result(run) == Finished(total=7)
    monkeypatch.setattr(sys.modules[__name__], "Finished", _Trap)
    _Trap.built.clear()
    rt = RemitRuntime(store_url)
    head = rt.checkpoints(run)[0].checkpoint_id
    with pytest.raises(CorruptRecord) as refused:
        rt.result(run)
    assert _Trap.built == []  # refused before anything of the class ran
    assert (refused.value.run_id, refused.value.checkpoint_id) == (run, head)
    assert "Finished" in str(refused.value)


# -- the task awaiting a handler cancelled mid-effect or while parked ---------------------


class _Gate:
    """Set in the test's process only: the effect then tells it that it applied and
    holds until released (in a recovering process it returns at once)."""

    inside: asyncio.Event | None = None
    release: asyncio.Event | None = None
    left: asyncio.Event | None = None


def _paid(key: str) -> object:
    hits = [
        line.split()[1] for line in payments(Path(os.environ[DIR_VAR])) if line.split()[0] == key
    ]
    return hits[0] if hits else NOT_APPLIED


@effect(reconcile=_paid)
async def pay_and_hold(what: str, *, idempotency_key: str) -> str:
    with (Path(os.environ[DIR_VAR]) / "sink.txt").open("a") as sink:
        sink.write(f"{idempotency_key} {what}\n")
    if _Gate.inside is not None and _Gate.release is not None and _Gate.left is not None:
        _Gate.inside.set()
        try:
            await _Gate.release.wait()
        finally:
            _Gate.left.set()
    return what


class Prepared(Event):
    pass


class Shop(Workflow):
    @step
    async def prepare(self, ev: StartEvent) -> Prepared:
        enter("prepare")
        return Prepared()

    @step
    async def charge(self, ev: Prepared) -> StopEvent:
        enter("charge")
        return StopEvent(result=await pay_and_hold("order"))


class ParkedShop(Workflow):
    @step
    async def prepare(self, ev: StartEvent) -> Prepared:
        enter("prepare")
        return Prepared()

    @step
    async def approve(self, ctx: Context, ev: Prepared) -> StopEvent:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=pay("charge-" + answer.response))


CONTINUE = """
import asyncio, sys
sys.path[:0] = [{tests!r}, {root!r}]
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes33 import ParkedShop, Shop

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    if {parked!r}:
        handler = await rt.respond(ParkedShop(runtime=rt, timeout=None), {run!r},
                                   HumanResponseEvent(response="ada"))
    else:
        handler = rt.recover(Shop(runtime=rt, timeout=None), {run!r})
    print("RESULT", await handler)

asyncio.run(main())
"""


@pytest.mark.parametrize("where", ["inside-effect", "parked"])
def test_cancelling_the_task_awaiting_a_handler_leaves_the_run_resumable(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The awaiting task is cancelled (as `asyncio.wait_for` does on its timeout) while
    the step is inside its effect, or while the run waits for an answer: the stored run
    is not ended, another process continues it from its prefix (no completed step
    entered again) with every effect applied once, and the copy left in this process
    stores nothing afterwards. While the copy left here is still inside its effect,
    the run's claim is kept for that call: another process is refused until it ends."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, parked = new_run(), where == "parked"

    async def go() -> None:
        _Gate.inside, _Gate.release, _Gate.left = asyncio.Event(), asyncio.Event(), asyncio.Event()
        rt = RemitRuntime(store_url, lease=1)
        flow = ParkedShop(runtime=rt, timeout=None) if parked else Shop(runtime=rt, timeout=None)
        awaiting = asyncio.ensure_future(flow.run(run_id=run))
        if parked:
            await until_parked(rt, run)
        else:
            await _Gate.inside.wait()
        awaiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await awaiting
        assert rt.status(run) == ("waiting" if parked else "running")
        code = CONTINUE.format(tests=TESTS, root=ROOT, url=store_url, run=run, parked=parked)

        async def other_process() -> subprocess.CompletedProcess[str]:
            return await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-c", code],
                env={**os.environ, DIR_VAR: str(tmp_path)},
                capture_output=True,
                text=True,
                timeout=120,
            )

        if not parked:
            # The copy left here is still inside its effect: its claim is kept for it,
            # so another process is refused (it would take the effect for one in
            # doubt); once the copy comes out of it, the claim is given up.
            refused = await other_process()
            assert refused.returncode != 0 and "ResumeConflict" in refused.stderr, refused
            _Gate.release.set()
            await _Gate.left.wait()
            # (the gate opens inside the effect: its call records the outcome, then
            # gives the kept claim up)
            deadline = asyncio.get_running_loop().time() + 30
            while (claim := rt.remit.store.get_claim(run, "main")) and claim.holder:
                assert asyncio.get_running_loop().time() < deadline, "the claim stayed kept"
                await asyncio.sleep(0.02)
        done = await other_process()
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == ("charge-ada" if parked else "order")
        stored = [c.checkpoint_id for c in rt.checkpoints(run)]
        await asyncio.sleep(0.5)  # room for a wrong write of the copy; nothing may change
        assert [c.checkpoint_id for c in rt.checkpoints(run)] == stored
        assert rt.status(run) == "completed"
        assert rt.result(run) == ("charge-ada" if parked else "order")

    try:
        asyncio.run(go())
    finally:
        _Gate.inside = _Gate.release = _Gate.left = None
    assert len(payments(tmp_path)) == 1
    steps = entered(tmp_path)
    assert steps.count("prepare") == 1
    assert steps == (
        ["prepare", "approve", "approve"] if parked else ["prepare", "charge", "charge"]
    )
