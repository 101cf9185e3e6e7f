"""RemitRuntime on the real llama-index-workflows, on SQLite, PostgreSQL and Redis.

Each test drives a human-in-the-loop order workflow through the framework's
own API (`Workflow.run`, `Context.to_dict/from_dict`, `ctx.store`,
`wait_for_event`) and checks one contract item against what the Remit store
holds afterwards.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field
from workflows import Context, Workflow, step
from workflows.context.serializers import PickleSerializer
from workflows.errors import WorkflowCancelledByUser, WorkflowTimeoutError
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
    WorkflowFailedEvent,
)
from workflows.handler import WorkflowHandler

from remit_core import NOT_APPLIED, effect
from remit_core.errors import (
    CheckpointInvalid,
    Fenced,
    ForkWithoutIntent,
    RemitError,
    ResumeConflict,
    UnknownRecord,
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
    """prepare -> approve (waits for an `Answer`) -> charge (an effect).

    `hold` keeps `prepare` running until it is set; `crash` kills the process in it."""

    def __init__(
        self,
        bad_write: str = "",
        gate: asyncio.Event | None = None,
        hold: asyncio.Event | None = None,
        crash: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(timeout=None, **kw)
        self.bad_write = bad_write
        self.gate = gate
        self.hold = hold
        self.crash = crash

    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> Asked:
        ENTERED["prepare"] += 1
        await ctx.store.set("amount", ev.get("amount", 100))
        if self.hold is not None:
            await self.hold.wait()
        if self.crash:
            os.kill(os.getpid(), signal.SIGKILL)
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


class Classic(Workflow):
    """The framework's classic human in the loop: `ask` returns an `InputRequiredEvent`,
    `answer` takes the `HumanResponseEvent` (no `wait_for_event`)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context[Order], ev: StartEvent) -> InputRequiredEvent:
        ENTERED["ask"] += 1
        await ctx.store.set("amount", ev.get("amount", 100))
        return InputRequiredEvent(prefix="ok?")

    @step
    async def answer(self, ctx: Context[Order], ev: HumanResponseEvent) -> StopEvent:
        ENTERED["answer"] += 1
        await ctx.store.set("approved_by", ev.response)
        charge_card(await ctx.store.get("amount"))
        return StopEvent(result=ev.response)


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


class Checked(BaseModel, validate_assignment=True):
    amount: int = Field(default=0, ge=0)


class CheckedFlow(Workflow):
    """Parks at once; its state model validates assignments."""

    @step
    async def wait(self, ctx: Context[Checked], ev: StartEvent) -> StopEvent:
        await ctx.wait_for_event(Answer, waiter_event=InputRequiredEvent(prefix="?"))
        return StopEvent(result="done")


def test_an_unknown_field_in_an_external_edit_is_refused_naming_it(store_url: str) -> None:
    """P4: an edit naming a field the state model does not have (or a path into a value
    that has none), or one a model that validates assignments refuses, is refused with
    `CheckpointInvalid` naming it, not the framework's bare `ValueError` or pydantic's
    `ValidationError`; nothing is committed."""
    run, checked = new_run(), new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = await started(rt, run)
        history = rt.checkpoints(run)
        for path in ("amuont", "amount.cents"):
            with pytest.raises(CheckpointInvalid) as refused:
                await rt.update_state(wf, run, {"approved_by": "eve", path: 7})
            assert (refused.value.field, refused.value.run_id) == (path, run)
        assert rt.checkpoints(run) == history
        assert rt.get_state(wf, run) == Order(amount=100)

        flow = CheckedFlow(runtime=rt, timeout=None)
        assert await settle(flow.run(run_id=checked)) == "paused"
        history = rt.checkpoints(checked)
        with pytest.raises(CheckpointInvalid, match="does not satisfy") as refused:
            await rt.update_state(flow, checked, {"amount": -1})
        assert refused.value.field == "amount"
        assert rt.checkpoints(checked) == history

    asyncio.run(go())


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


def test_a_run_id_that_reads_as_a_fork_is_refused_before_anything_is_stored(
    store_url: str,
) -> None:
    """A fork's run is addressed as "<run>@fork-...": a new run under such an id would be
    stored as run "<run>" and looked up as one of its branches. It is refused up front,
    naming the id; an "@fork-" that is not after the last "@" is an ordinary id."""
    base = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        mine = f"{base}@fork-and-knife.com"
        with pytest.raises(ValueError, match=mine):
            OrderFlow(runtime=rt).run(run_id=mine, amount=1)
        for lookup in (base, mine):
            with pytest.raises(UnknownRecord):
                rt.status(lookup)
        kept = f"{base}@fork-and-knife.com@example.org"
        assert await settle(OrderFlow(runtime=rt).run(run_id=kept, amount=1)) == "paused"
        assert rt.status(kept) == "waiting" and rt.checkpoints(kept)[0].branch == "main"

    asyncio.run(go())


# -- an event the run does not wait for ----------------------------------------------


DYING_IN_PREPARE = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_runtime import OrderFlow

async def main():
    flow = OrderFlow(runtime=RemitRuntime({url!r}, lease=1), crash=True)
    await flow.run(run_id={run!r}, amount=100)

asyncio.run(main())
"""


def test_an_answer_to_a_run_that_died_before_it_waits_is_refused(store_url: str) -> None:
    """P5: the process dies (SIGKILL) in `prepare`, before `approve` waits for the answer.
    The framework drops an event nothing waits for or takes, so an answer taken now would
    be acknowledged and lost, and the run would ask again. `respond` refuses it before
    anything runs or is stored; recovered and waiting, the run takes one answer."""
    run = new_run()
    code = DYING_IN_PREPARE.format(tests=str(Path(__file__).parent), url=store_url, run=run)
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL, child.stderr

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        wf = OrderFlow(runtime=rt)
        history = rt.checkpoints(run)
        assert (history[0].status, history[0].next_steps) == ("running", ("prepare",))
        for _ in range(2):  # while the dead process's lease lasts, and once it ran out
            with pytest.raises(ResumeConflict, match="recover") as refused:
                await rt.respond(wf, run, Answer(response="ada"))
            assert refused.value.run_id == run
            assert rt.checkpoints(run) == history and rt.remit.interrupts(run) == []
            await asyncio.sleep(1.5)
        assert ENTERED == Counter()
        handler = rt.recover(wf, run)
        assert handler is not None and await settle(handler) == "paused"
        await rt.send_event(handler, Answer(response="bob"))
        assert await handler == "charged"
        with pytest.raises(ResumeConflict):
            await rt.respond(OrderFlow(runtime=rt), run, Answer(response="eve"))
        assert rt.get_state(wf, run).approved_by == "bob"

    asyncio.run(go())
    assert ENTERED == Counter(prepare=1, approve=1, charge=1)
    assert list(CHARGED.values()) == [1]


class Ping(Event):
    n: int


class Pinged(Workflow):
    """Idle after its start; a `Ping` from outside is an ordinary event a step takes."""

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Ping | None:
        return None  # the `Ping` comes from outside

    @step
    async def pong(self, ctx: Context, ev: Ping) -> StopEvent:
        return StopEvent(result=ev.n)


def test_an_event_the_live_run_would_drop_is_refused(store_url: str) -> None:
    """An answer sent while the step before its waiter still runs (the framework drops
    it: no waiter yet, no step takes it) is refused, not acknowledged and lost; sent once
    the run waits, it is taken. An ordinary event a step takes is delivered as before."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        hold = asyncio.Event()
        wf = OrderFlow(runtime=rt, hold=hold)
        handler = wf.run(run_id=run, amount=5)
        while ENTERED["prepare"] == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(ResumeConflict, match="Answer") as refused:
            await rt.send_event(handler, Answer(response="early"))
        assert refused.value.run_id == run and rt.remit.interrupts(run) == []
        hold.set()
        assert await settle(handler) == "paused"
        await rt.send_event(handler, Answer(response="ada"))
        assert await handler == "charged"
        assert rt.get_state(wf, run).approved_by == "ada"

        idle = Pinged(runtime=rt, timeout=None).run(run_id=new_run())
        while rt.remit.branch(idle.run_id) is None or rt.status(idle.run_id) != "waiting":
            await asyncio.sleep(0.01)
        with pytest.raises(ResumeConflict, match="waits for no event"):
            await rt.send_event(idle, Answer(response="nobody asked"))
        await rt.send_event(idle, Ping(n=3))
        assert await idle == 3

    asyncio.run(go())
    assert ENTERED == Counter(prepare=1, approve=1, charge=1)


# -- classic human in the loop: InputRequiredEvent returned, HumanResponseEvent taken --


async def asked(rt: RemitRuntime, run: str) -> WorkflowHandler:
    handler = Classic(runtime=rt).run(run_id=run, amount=100)
    assert await settle(handler) == "paused"
    for _ in range(100):  # parked: the claim is released with the ask's checkpoint
        if rt.status(run) == "waiting":
            return handler
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} did not park")


def test_classic_answer_to_a_completed_run_is_refused(store_url: str) -> None:
    """An answer to a classic run that already completed is refused before anything
    runs: no step re-runs, no second charge, nothing is stored."""
    run = new_run()

    async def go() -> None:
        await asked(RemitRuntime(store_url), run)
        first = RemitRuntime(store_url)
        answer = HumanResponseEvent(response="ada")
        handler = await first.respond(Classic(runtime=first), run, answer)
        assert await handler == "ada"
        rt = RemitRuntime(store_url)
        history = rt.checkpoints(run)
        interrupts = [(i.interrupt_id, i.status, i.value) for i in rt.remit.interrupts(run)]
        with pytest.raises(ResumeConflict) as refused:
            await rt.respond(Classic(runtime=rt), run, HumanResponseEvent(response="bob"))
        assert refused.value.interrupt_id == interrupts[0][0]
        assert rt.checkpoints(run) == history
        assert [(i.interrupt_id, i.status, i.value) for i in rt.remit.interrupts(run)] == interrupts
        assert rt.get_state(Classic(runtime=rt), run).approved_by == "ada"

    asyncio.run(go())
    assert ENTERED == Counter(ask=1, answer=1)
    assert list(CHARGED.values()) == [1]


def test_classic_second_answer_to_a_live_run_is_refused(store_url: str) -> None:
    """Two answers sent at once to one live classic run: the first consumes the ask,
    the second is refused, never acknowledged and then dropped."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = await asked(rt, run)
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        with pytest.raises(ResumeConflict) as refused:
            await rt.send_event(handler, HumanResponseEvent(response="bob"))
        assert refused.value.interrupt_id is not None
        assert await handler == "ada"
        (interrupt,) = rt.remit.interrupts(run)
        assert interrupt.status == "consumed" and b"ada" in (interrupt.value or b"")

    asyncio.run(go())
    assert ENTERED == Counter(ask=1, answer=1)


CRASHING_RESUMER = """
import asyncio, os, signal, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_runtime import Classic

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    await rt.respond(Classic(runtime=rt), {run!r}, HumanResponseEvent(response="ada"))
    print("ACK", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


def test_classic_answer_acknowledged_before_a_crash_is_delivered_by_recovery(
    store_url: str,
) -> None:
    """CRASH-DURING-RESUME on the classic pattern: a process acknowledges an answer and
    is SIGKILLed. The answer was durable before `respond` returned; recovery delivers it
    without asking again, and a second answer is refused."""
    run = new_run()
    asyncio.run(asked(RemitRuntime(store_url), run))
    code = CRASHING_RESUMER.format(tests=str(Path(__file__).parent), url=store_url, run=run)
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert (child.returncode, child.stdout.strip()) == (-signal.SIGKILL, "ACK"), child.stderr

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        (accepted,) = rt.remit.interrupts(run)
        assert accepted.status == "consumed" and b"ada" in (accepted.value or b"")
        deadline = time.monotonic() + 10
        while True:  # the dead resumer's lease runs out
            try:
                handler = rt.recover(Classic(runtime=rt), run)
                break
            except ResumeConflict:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        assert handler is not None
        assert await handler == "ada"
        assert rt.status(run) == "completed"
        with pytest.raises(ResumeConflict):
            await rt.respond(Classic(runtime=rt), run, HumanResponseEvent(response="bob"))
        assert rt.get_state(Classic(runtime=rt), run).approved_by == "ada"
        assert [i.value for i in rt.remit.interrupts(run)] == [accepted.value]

    asyncio.run(go())
    assert ENTERED["answer"] == 1 and list(CHARGED.values()) == [1]


def test_classic_losing_resumer_gets_resume_conflict(store_url: str) -> None:
    """A resumer that restored the parked run before the winner answered and finished it
    loses with `ResumeConflict` (not a fork error), as does one that restores after."""
    run = new_run()

    async def go() -> None:
        await asked(RemitRuntime(store_url), run)
        late = RemitRuntime(store_url)
        stale = Classic(runtime=late).run(ctx=late.context(Classic(runtime=late), run))
        winner = RemitRuntime(store_url)
        handler = await winner.respond(
            Classic(runtime=winner), run, HumanResponseEvent(response="ada")
        )
        assert await handler == "ada"
        head = winner.checkpoints(run)[0]
        with pytest.raises(ResumeConflict) as lost:
            await late.send_event(stale, HumanResponseEvent(response="bob"))
        assert lost.value.interrupt_id is not None
        with pytest.raises(ResumeConflict):
            await late.respond(Classic(runtime=late), run, HumanResponseEvent(response="eve"))
        assert winner.checkpoints(run)[0] == head
        assert winner.get_state(Classic(runtime=winner), run).approved_by == "ada"
        for session in list(late._sessions.values()):
            session.abort()  # the stale copy of the run is dropped, as its user would
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert ENTERED["answer"] == 1


RACING_RESUMER = """
import asyncio, os, sys, time
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_runtime import Classic

async def main(me):
    rt = RemitRuntime({url!r})
    rt.remit
    while not os.path.exists({go!r}):
        time.sleep(0.002)
    try:
        handler = await rt.respond(Classic(runtime=rt), {run!r}, HumanResponseEvent(response=me))
        print("OK", await handler, flush=True)
    except Exception as exc:
        print("ERR", type(exc).__name__, flush=True)

asyncio.run(main(sys.argv[1]))
"""


def test_classic_racing_resumers_one_proceeds_the_others_conflict(
    store_url: str, tmp_path: Path
) -> None:
    """K2-PROC-like race on the classic pattern: 4 processes answer at once; one proceeds,
    every other one gets `ResumeConflict`, whenever it loses."""
    run = new_run()
    asyncio.run(asked(RemitRuntime(store_url), run))
    go = tmp_path / "go"
    code = RACING_RESUMER.format(
        tests=str(Path(__file__).parent), url=store_url, run=run, go=str(go)
    )
    racers = [
        subprocess.Popen([sys.executable, "-c", code, f"r{i}"], stdout=subprocess.PIPE, text=True)
        for i in range(4)
    ]
    time.sleep(3)
    go.touch()
    outcomes = sorted(p.communicate(timeout=120)[0].strip() for p in racers)
    assert outcomes[:3] == ["ERR ResumeConflict"] * 3, outcomes
    winner = outcomes[3].removeprefix("OK ")
    assert outcomes[3].startswith("OK r")
    rt = RemitRuntime(store_url)
    assert rt.get_state(Classic(runtime=rt), run).approved_by == winner
    assert [i.status for i in rt.remit.interrupts(run)] == ["consumed"]


# -- what a checkpoint can hold --------------------------------------------------------


class Opaque:
    """An object the JSON serializer cannot store."""


UNSTORABLE: dict[str, Any] = {
    "when": dt.datetime(2020, 1, 2),
    "raw": b"x",
    "obj": Opaque(),
    "pair": (1, 2),
    "nested": {"at": [dt.date(2020, 1, 1)]},
    "ints": {1: "one"},
}


class Loose(Workflow):
    """Untyped state: each value reaches the checkpoint through the JSON serializer."""

    @step
    async def keep(self, ctx: Context, ev: StartEvent) -> StopEvent:
        refused = {}
        for key, value in UNSTORABLE.items():
            try:
                await ctx.store.set(key, value)
            except CheckpointInvalid as exc:
                refused[key] = exc.field
        await ctx.store.set("plain", {"n": [1, 2.5, None, True]})
        return StopEvent(result=refused)


def test_a_value_the_checkpoint_cannot_hold_is_refused_at_the_write(store_url: str) -> None:
    """P4: a datetime, bytes, an arbitrary object, or a value that would read back as
    another (a tuple as a list, an int key as a string) is refused at `set`, inside the
    step, with `CheckpointInvalid` naming the key; the step goes on, the run completes."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        refused = await Loose(runtime=rt).run(run_id=run)
        assert refused == {
            "when": "when",
            "raw": "raw",
            "obj": "obj",
            "pair": "pair",
            "nested": "nested.at[0]",
            "ints": "ints",
        }
        assert rt.status(run) == "completed"
        state = RemitRuntime(store_url).get_state(Loose(runtime=rt), run)
        assert dict(state.items()) == {"plain": {"n": [1, 2.5, None, True]}}

    asyncio.run(go())


class Mutating(Workflow):
    @step
    async def first(self, ctx: Context, ev: StartEvent) -> Asked:
        await ctx.store.set("d", {"n": 1})
        return Asked()

    @step
    async def second(self, ctx: Context, ev: Asked) -> StopEvent:
        (await ctx.store.get("d"))["when"] = dt.datetime(2020, 1, 1)  # in place: no write
        return StopEvent(result="done")


class Tagged(BaseModel):
    tags: list[str] = []


class MutatingTyped(Workflow):
    @step
    async def first(self, ctx: Context[Tagged], ev: StartEvent) -> Asked:
        await ctx.store.set("tags", ["a"])
        return Asked()

    @step
    async def second(self, ctx: Context[Tagged], ev: Asked) -> StopEvent:
        (await ctx.store.get("tags")).append(7)  # in place, storable, against the schema
        return StopEvent(result="done")


@pytest.mark.parametrize(
    ("flow", "field", "kept"),
    [(Mutating, "d.when", {"d": {"n": 1}}), (MutatingTyped, "tags[1]", {"tags": ["a"]})],
    ids=["unstorable", "against-the-schema"],
)
def test_a_run_whose_checkpoint_cannot_be_stored_is_committed_as_failed(
    store_url: str, flow: type[Workflow], field: str, kept: dict[str, Any]
) -> None:
    """A value that never passed a write (changed in place) is checked when the step's
    checkpoint is committed: one the serializer cannot store, or one against the schema
    (P4), makes the run raise `CheckpointInvalid` naming it, and the run is committed as
    failed with its last stored state, instead of staying "running" for recoveries that
    would fail the same way, or committing the invalid state."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = flow(runtime=rt).run(run_id=run)

        async def streamed() -> list[Any]:
            return [ev async for ev in handler.stream_events()]

        events = await asyncio.wait_for(streamed(), 20)  # the stream ends too
        assert isinstance(events[-1], WorkflowFailedEvent)
        with pytest.raises(CheckpointInvalid) as refused:
            await handler
        assert refused.value.field == field and refused.value.run_id == run
        other = RemitRuntime(store_url)
        assert other.status(run) == "failed"
        assert other.recover(flow(runtime=other), run) is None
        state = other.get_state(flow(runtime=other), run)
        assert (dict(state.items()) if hasattr(state, "items") else state.model_dump()) == kept

    asyncio.run(go())


def test_a_zombie_whose_run_was_finished_elsewhere_is_fenced(store_url: str) -> None:
    """L2: a holder paused past its lease while another process took the run over and
    finished it learns that it was fenced (`Fenced`), not that it would fork the run."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=0.5)
        await started(rt, run)
        gate = asyncio.Event()
        handler = await rt.respond(OrderFlow(runtime=rt, gate=gate), run, Answer(response="ada"))
        while ENTERED["charge"] == 0:
            await asyncio.sleep(0.01)
        (driving,) = [s.claim for s in rt._sessions.values() if s.claim is not None]
        driving.abandon()  # the holder stops renewing, as a paused process would
        await asyncio.sleep(0.7)
        successor = RemitRuntime(store_url)
        recovered = successor.recover(OrderFlow(runtime=successor), run)
        assert recovered is not None and await recovered == "charged"
        head = successor.checkpoints(run)[0]
        gate.set()
        with pytest.raises(Fenced):
            await handler
        assert successor.checkpoints(run)[0] == head and head.status == "completed"

    asyncio.run(go())
    assert ENTERED["charge"] == 2 and list(CHARGED.values()) == [1]


# -- sends a step made before it crashed -------------------------------------------


class Notify(Event):
    pass


class Extra(Event):
    pass


class Body(Event):
    pass


class Noted(Event):
    pass


class ExtraDone(Event):
    pass


def _applied(sink: str, key: str) -> Any:
    lines = Path(sink).read_text().split() if Path(sink).exists() else []
    return 1 if key in lines else NOT_APPLIED


def _mail(sink: str) -> Any:
    @effect(name="mail", reconcile=lambda key: _applied(sink, key))
    def mail(*, idempotency_key: str) -> int:
        with open(sink, "a") as f:
            f.write(idempotency_key + "\n")
        return 1

    return mail


class Sender(Workflow):
    """`start` sends `Notify`, then `Extra`, and returns `Body`; `crash` names the step
    whose completion it waits for and then kills the process (SIGKILL)."""

    def __init__(self, url: str, run: str, sink: str, crash: str = "", **kw: Any) -> None:
        super().__init__(timeout=60, **kw)
        self.url, self.run_name, self.sink, self.crash = url, run, sink, crash

    async def _die_once_completed(self, step_name: str) -> None:
        if self.crash != step_name:
            return
        rt = RemitRuntime(self.url)
        while not any(c.step == step_name for c in rt.checkpoints(self.run_name)):
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Body | Notify | Extra:
        ctx.send_event(Notify())
        await self._die_once_completed("notify")
        ctx.send_event(Extra())
        await self._die_once_completed("extra")
        return Body()

    @step
    async def notify(self, ctx: Context, ev: Notify) -> Noted:
        _mail(self.sink)()
        return Noted()

    @step
    async def extra(self, ctx: Context, ev: Extra) -> ExtraDone:
        _mail(self.sink)()
        return ExtraDone()

    @step
    async def end(self, ctx: Context, ev: Body | Noted | ExtraDone) -> StopEvent | None:
        if ctx.collect_events(ev, [Body, Noted, ExtraDone]) is None:
            return None
        return StopEvent(result="ok")


DYING_AFTER_A_SEND = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_runtime import Sender

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = Sender({url!r}, {run!r}, {sink!r}, crash={crash!r}, runtime=rt)
    if {crash!r} == "notify":
        await flow.run(run_id={run!r})
    else:
        await rt.recover(flow, {run!r})

asyncio.run(main())
"""


def test_a_send_made_before_a_crash_is_not_delivered_again(store_url: str, tmp_path: Path) -> None:
    """P1, P2: `start` sends `Notify` and dies (SIGKILL) after `notify` completed on it; its
    recovered re-run sends `Extra` and dies after `extra` completed; the next recovery
    finishes the run. Each re-run of `start` sends its events again, and the framework
    would take them as new: `notify` and `extra` would run again and their effects apply
    twice. Each completed step runs once, each effect applies once."""
    run, sink = new_run(), str(tmp_path / "sink.txt")
    for crash in ("notify", "extra"):
        code = DYING_AFTER_A_SEND.format(
            tests=str(Path(__file__).parent), url=store_url, sink=sink, crash=crash, run=run
        )
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert child.returncode == -signal.SIGKILL, child.stderr
        time.sleep(1.2)  # the dead process's lease runs out

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = rt.recover(Sender(store_url, run, sink, runtime=rt), run)
        assert handler is not None and await handler == "ok"
        steps = Counter(c.step for c in rt.checkpoints(run) if c.step)
        assert (steps["notify"], steps["extra"], steps["start"]) == (1, 1, 1)

    asyncio.run(go())
    assert len(Path(sink).read_text().split()) == 2


# -- how a run ends ----------------------------------------------------------------------


class Split(Event):
    pass


class Stalled(Workflow):
    """`fork` starts `slow` (in flight for a long while) and `wait` (a waiter)."""

    @step
    async def fork(self, ctx: Context, ev: StartEvent) -> Split | Notify | None:
        ctx.send_event(Split())
        ctx.send_event(Notify())
        return None

    @step
    async def slow(self, ctx: Context, ev: Split) -> StopEvent:
        await asyncio.sleep(30)
        return StopEvent(result="late")

    @step
    async def wait(self, ctx: Context, ev: Notify) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        return StopEvent(result=answer.response)


@pytest.mark.parametrize("stop", ["timeout", "cancel_run"])
def test_a_run_ended_with_a_step_in_flight_lists_nothing_to_run(store_url: str, stop: str) -> None:
    """A run that timed out or was cancelled while a step ran and a waiter waited has
    ended: its last checkpoint names no step to run next and no waiter (as `rt.cancel`
    writes), while the checkpoint before still names the step then in flight."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = Stalled(runtime=rt, timeout=1.0 if stop == "timeout" else None).run(run_id=run)
        while rt.remit.branch(run) is None or not any(
            c.waiting and c.next_steps == ("slow",) for c in rt.checkpoints(run)
        ):
            await asyncio.sleep(0.05)
        if stop == "cancel_run":
            await handler.cancel_run()
        with pytest.raises(WorkflowTimeoutError if stop == "timeout" else WorkflowCancelledByUser):
            await handler
        head, before = rt.checkpoints(run)[:2]
        assert head.status == ("failed" if stop == "timeout" else "cancelled")
        assert (head.next_steps, head.waiting) == ((), ())
        assert before.next_steps == ("slow",) and before.waiting

    asyncio.run(go())
