"""RemitRuntime on the real llama-index-workflows, on SQLite, PostgreSQL and Redis.

Each test drives a human-in-the-loop order workflow through the framework's
own API (`Workflow.run`, `Context.to_dict/from_dict`, `ctx.store`,
`wait_for_event`) and checks one contract item against what the Remit store
holds afterwards.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import pytest
from pydantic import BaseModel, Field
from workflows import Context, Workflow, step
from workflows.context.serializers import PickleSerializer
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)
from workflows.handler import WorkflowHandler

from remit_core import NOT_APPLIED, effect
from remit_core.errors import (
    CheckpointInvalid,
    Fenced,
    ForkWithoutIntent,
    RemitError,
    ResumeConflict,
)
from remit_llamaindex import RemitRuntime
from remit_llamaindex._run import JOURNAL_TASK
from remit_llamaindex.probe import _settle as settle

ENTERED: Counter[str] = Counter()
CHARGED: dict[str, int] = {}


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)
    approved_by: str | None = None
    charged: bool = False


class Asked(Event):
    pass


class Approved(Event):
    pass


class Answer(HumanResponseEvent):
    response: str = Field(min_length=1)


@effect(reconcile=lambda key: CHARGED.get(key, NOT_APPLIED))
def charge_card(amount: int, *, idempotency_key: str) -> int:
    CHARGED[idempotency_key] = CHARGED.get(idempotency_key, 0) + 1
    return amount


class OrderFlow(Workflow):
    """prepare -> approve (waits for an `Answer`) -> charge (an effect)."""

    def __init__(self, bad_write: str = "", gate: asyncio.Event | None = None, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        self.bad_write = bad_write
        self.gate = gate

    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> Asked:
        ENTERED["prepare"] += 1
        await ctx.store.set("amount", ev.get("amount", 100))
        if self.bad_write == "set":
            await ctx.store.set("amount", "lots")
        if self.bad_write == "model_construct":
            await ctx.store.set_state(Order.model_construct(amount=-5))
        return Asked()

    @step
    async def approve(self, ctx: Context[Order], ev: Asked) -> Approved:
        answer = await ctx.wait_for_event(
            Answer, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        ENTERED["approve"] += 1
        await ctx.store.set("approved_by", answer.response)
        return Approved()

    @step
    async def charge(self, ctx: Context[Order], ev: Approved) -> StopEvent:
        ENTERED["charge"] += 1
        if self.gate is not None:
            await self.gate.wait()
        charge_card(await ctx.store.get("amount"))
        await ctx.store.set("charged", True)
        return StopEvent(result="charged")


@pytest.fixture(autouse=True)
def _fresh_world() -> None:
    ENTERED.clear()
    CHARGED.clear()


def new_run() -> str:
    return f"li-{uuid.uuid4().hex[:12]}"


async def started(rt: RemitRuntime, run: str, **flow: Any) -> OrderFlow:
    wf = OrderFlow(runtime=rt, **flow)
    assert await settle(wf.run(run_id=run, amount=100)) == "paused"
    return wf


def test_pause_persists_and_another_runtime_resumes(store_url: str) -> None:
    """The journal and state are committed as the run goes; a new runtime (as in a new
    process) finishes it without re-running completed steps; the effect applies once."""
    run = new_run()

    async def go() -> None:
        await started(RemitRuntime(store_url), run)
        rt = RemitRuntime(store_url)
        history = rt.checkpoints(run)
        assert history[0].status == "waiting" and history[0].waiting
        parents = {c.checkpoint_id: c.parent_id for c in history}
        assert [parents[c.checkpoint_id] for c in history[:-1]] == [
            c.checkpoint_id for c in history[1:]
        ]
        journal = rt.remit.writes(run, history[0].checkpoint_id)
        assert [w.task_id for w in journal] == [JOURNAL_TASK] * len(journal) and journal

        wf = OrderFlow(runtime=rt)
        handler = await rt.respond(wf, run, Answer(response="alice"))
        assert await handler == "charged"
        state = rt.get_state(wf, run)
        assert (state.approved_by, state.charged) == ("alice", True)
        assert RemitRuntime(store_url).result(run) == "charged"
        assert rt.status(run) == "completed" and rt.recover(wf, run) is None

    asyncio.run(go())
    assert ENTERED == Counter(prepare=1, approve=1, charge=1)
    assert sorted(CHARGED.values()) == [1]


def test_a_second_response_is_refused_and_nothing_is_stored(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = await started(rt, run)
        handler = await rt.respond(wf, run, Answer(response="alice"))
        assert await handler == "charged"
        head = rt.checkpoints(run)[0].checkpoint_id
        values = [i.value for i in rt.remit.interrupts(run)]
        with pytest.raises(ResumeConflict) as refused:
            await rt.respond(OrderFlow(runtime=rt), run, Answer(response="bob"))
        assert refused.value.run_id == run and refused.value.interrupt_id
        assert rt.checkpoints(run)[0].checkpoint_id == head
        assert [i.value for i in rt.remit.interrupts(run)] == values
        assert rt.get_state(wf, run).approved_by == "alice"

    asyncio.run(go())
    assert ENTERED["approve"] == 1 and sorted(CHARGED.values()) == [1]


def test_response_to_a_resolved_waiter_of_a_live_run_is_refused(store_url: str) -> None:
    """Two responses back to back on one live handler: the first is consumed, the second
    is refused before the control loop sees it (the framework would overwrite the first)."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = OrderFlow(runtime=rt)
        handler = wf.run(run_id=run, amount=7)
        assert await settle(handler) == "paused"
        await rt.send_event(handler, Answer(response="alice"))
        with pytest.raises(ResumeConflict):
            await rt.send_event(handler, Answer(response="bob"))
        assert await handler == "charged"
        assert rt.get_state(wf, run).approved_by == "alice"

    asyncio.run(go())
    assert ENTERED["approve"] == 1


def test_concurrent_resumers_one_proceeds_the_others_conflict(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        await started(rt, run)
        ENTERED.clear()
        outcomes = await asyncio.gather(
            *(rt.respond(OrderFlow(runtime=rt), run, Answer(response=f"r{i}")) for i in range(4)),
            return_exceptions=True,
        )
        handlers = [o for o in outcomes if isinstance(o, WorkflowHandler)]
        assert len(handlers) == 1
        assert all(isinstance(o, ResumeConflict) for o in outcomes if o not in handlers)
        assert await handlers[0] == "charged"
        winner = outcomes.index(handlers[0])
        assert rt.get_state(OrderFlow(runtime=rt), run).approved_by == f"r{winner}"

    asyncio.run(go())
    assert ENTERED == Counter(approve=1, charge=1)


@pytest.mark.parametrize("bad_write", ["model_construct", "set"])
def test_invalid_step_write_is_refused_and_nothing_persists(store_url: str, bad_write: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = OrderFlow(runtime=rt, bad_write=bad_write).run(run_id=run, amount=3)
        with pytest.raises(CheckpointInvalid) as refused:
            await handler
        assert refused.value.field == "amount" and refused.value.run_id == run
        head = rt.checkpoints(run)[0]
        assert head.next_steps == ("prepare",)
        assert rt.get_state(OrderFlow(runtime=rt), run).amount == 0

    asyncio.run(go())


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")
def test_invalid_external_edit_and_invalid_response_are_refused(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = await started(rt, run)
        head = rt.checkpoints(run)[0].checkpoint_id
        with pytest.raises(CheckpointInvalid) as refused:
            await rt.update_state(wf, run, {"amount": -5})
        assert refused.value.field == "amount"
        assert rt.checkpoints(run)[0].checkpoint_id == head
        slipped = Answer(response="placeholder")
        slipped.response = 12345  # assignment is not validated: the value slips past the model
        with pytest.raises(CheckpointInvalid, match="response"):
            await rt.respond(wf, run, slipped)
        assert [i.status for i in rt.remit.interrupts(run)] == ["pending"]
        new_head = await rt.update_state(wf, run, {"amount": 9})
        assert rt.checkpoints(run)[0].checkpoint_id == new_head != head
        handler = await rt.respond(wf, run, Answer(response="carol"))
        assert await handler == "charged"
        assert rt.get_state(wf, run).amount == 9

    asyncio.run(go())
    assert list(CHARGED.values()) == [1]


def test_restoring_one_snapshot_twice_is_a_fork(store_url: str) -> None:
    """`ctx.to_dict()` names the run's checkpoint: the first restore continues the run;
    the second needs a fork token, and one token makes one branch with its own id."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = OrderFlow(runtime=rt)
        handler = wf.run(run_id=run, amount=5)
        assert await settle(handler) == "paused"
        snapshot = handler.ctx.to_dict()
        assert snapshot["state"]["store_type"] == "remit"
        base = snapshot["state"]["checkpoint_id"]

        first = wf.run(ctx=Context.from_dict(wf, snapshot))
        assert first.run_id == run
        await rt.send_event(first, Answer(response="alice"))
        assert await first == "charged"

        with pytest.raises(ForkWithoutIntent) as refused:
            wf.run(ctx=Context.from_dict(wf, snapshot))
        assert refused.value.checkpoint_id == base
        assert len(rt.remit.branches(run)) == 1

        forked = wf.run(ctx=rt.context(wf, run, checkpoint_id=base, fork_token="what-if"))
        assert forked.run_id.startswith(f"{run}@fork-")
        await rt.send_event(forked, Answer(response="bob"))
        assert await forked == "charged"
        again = RemitRuntime(store_url).fork(run, base, "what-if")
        assert again == forked.run_id
        assert len(rt.remit.branches(run)) == 2
        assert rt.get_state(wf, run).approved_by == "alice"
        assert rt.get_state(wf, forked.run_id).approved_by == "bob"

    asyncio.run(go())


def test_pickle_serializer_is_refused(store_url: str) -> None:
    async def go() -> None:
        wf = OrderFlow(runtime=RemitRuntime(store_url), serializer=PickleSerializer())
        with pytest.raises(RemitError, match="never unpickles"):
            wf.run(run_id=new_run(), amount=1)

    asyncio.run(go())


def test_a_taken_over_run_is_fenced_and_stops(store_url: str) -> None:
    """L2: when another resumer takes the run over after the lease, the old driver's next
    commit is refused with `Fenced` and its run stops; the effect is not applied by it."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=0.5)
        await started(rt, run)
        gate = asyncio.Event()
        wf = OrderFlow(runtime=rt, gate=gate)
        handler = await rt.respond(wf, run, Answer(response="alice"))
        while ENTERED["charge"] == 0:
            await asyncio.sleep(0.01)
        (driving,) = [s.claim for s in rt._sessions.values() if s.claim is not None]
        driving.abandon()  # the holder stops renewing, as a paused process would
        time.sleep(0.6)
        thief = RemitRuntime(store_url).remit.claim(run, "main")
        gate.set()
        with pytest.raises(Fenced):
            await handler
        thief.release()

    asyncio.run(go())
    assert CHARGED == {}
