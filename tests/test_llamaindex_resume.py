"""Resuming LlamaIndex runs the ways the framework documents, on SQLite, PostgreSQL
and Redis: waiters told apart by `requirements`, a parked run stopped with
`cancel_run` or the workflow timeout and restored from `ctx.to_dict()`, and a
fork token presented again after its branch ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from llamaindex_parts import until_parked
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser, WorkflowTimeoutError
from workflows.events import Event, HumanResponseEvent, InputRequiredEvent, StartEvent, StopEvent
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core import NOT_APPLIED, codec, effect
from remit_core.errors import (
    CorruptRecord,
    EffectInDoubt,
    ForkWithoutIntent,
    ResumeConflict,
    UnknownRecord,
)
from remit_llamaindex import RemitRuntime, RunCheckpoint


class Reply(HumanResponseEvent):
    to: str


class ForA(Event):
    pass


class ForB(Event):
    pass


class Got(Event):
    who: str
    response: str


class Untimed(Workflow):
    """A workflow with no run timeout unless one is given: these runs park and wait."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("timeout", None)
        super().__init__(**kw)


class TwoWaiters(Untimed):
    """Two parallel steps wait for a `Reply`, each for its own `to` (`requirements`)."""

    @step
    async def fan(self, ctx: Context, ev: StartEvent) -> ForA | ForB | None:
        ctx.send_event(ForA())
        ctx.send_event(ForB())
        return None

    async def _wait(self, ctx: Context, who: str) -> Got:
        reply = await ctx.wait_for_event(
            Reply,
            waiter_event=InputRequiredEvent(prefix=f"{who}?"),
            requirements={"to": who},
            timeout=None,
        )
        return Got(who=who, response=reply.response)

    @step
    async def wait_a(self, ctx: Context, ev: ForA) -> Got:
        return await self._wait(ctx, "a")

    @step
    async def wait_b(self, ctx: Context, ev: ForB) -> Got:
        return await self._wait(ctx, "b")

    @step
    async def gather(self, ctx: Context, ev: Got) -> StopEvent | None:
        got = ctx.collect_events(ev, [Got, Got])
        if got is None:
            return None
        return StopEvent(result=sorted(f"{g.who}={g.response}" for g in got))


def new_run() -> str:
    return f"li-{uuid.uuid4().hex[:12]}"


def committed(rt: RemitRuntime, run: str) -> list[RunCheckpoint]:
    """The run's checkpoints, none while it has not committed its first one."""
    try:
        return rt.checkpoints(run)
    except UnknownRecord:
        return []


async def parked(rt: RemitRuntime, run: str, waiting: int) -> None:
    """Wait until the run's head is parked with `waiting` open interrupts."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        history = committed(rt, run)
        if history and history[0].status == "waiting" and len(history[0].waiting) == waiting:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} did not park with {waiting} waiters")


async def paused_snapshot(
    rt: RemitRuntime, run: str, flow: type[Workflow], waiting: int = 1
) -> dict[str, Any]:
    """Start `flow` as `run`, and once it is parked with `waiting` waiters, pause it as
    the framework documents (`ctx.to_dict()`, then `cancel_run()`); returns the snapshot."""
    handler = flow(runtime=rt).run(run_id=run)
    await parked(rt, run, waiting=waiting)
    # The store shows the pause as its commit lands; the run's copy names it once the
    # commit has returned (under load, a moment later): a snapshot taken in between
    # names the checkpoint before, which a restore must treat as a fork.
    head = committed(rt, run)[0].checkpoint_id
    deadline = time.monotonic() + 20
    snapshot = handler.ctx.to_dict()
    while head not in json.dumps(snapshot) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        snapshot = handler.ctx.to_dict()
    await handler.cancel_run()
    return snapshot


def test_each_reply_reaches_the_waiter_whose_requirements_it_meets(store_url: str) -> None:
    """P5 with `requirements`: after a restore in another runtime, a reply for "b"
    consumes b's waiter only; a's stays pending for its own reply, and a second reply
    for "b" is refused."""
    run = new_run()

    async def go() -> None:
        first = RemitRuntime(store_url)
        started = TwoWaiters(runtime=first).run(run_id=run)
        await parked(first, run, waiting=2)
        await started.cancel_run()  # stopped here: the run stays parked
        rt = RemitRuntime(store_url)
        wf = TwoWaiters(runtime=rt)
        handler = await rt.respond(wf, run, Reply(to="b", response="yes-b"))
        await parked(rt, run, waiting=1)
        statuses = {i.interrupt_id: i.status for i in rt.remit.interrupts(run)}
        assert sorted(statuses.values()) == ["consumed", "pending"]
        (consumed,) = [i for i, s in statuses.items() if s == "consumed"]
        assert "wait_b" in consumed
        with pytest.raises(ResumeConflict):
            await rt.send_event(handler, Reply(to="b", response="again"))
        other = RemitRuntime(store_url)
        resumed = await other.respond(
            TwoWaiters(runtime=other), run, Reply(to="a", response="yes-a")
        )
        assert await asyncio.wait_for(resumed, 20) == ["a=yes-a", "b=yes-b"]
        for interrupt in other.remit.interrupts(run):
            who = "a" if "wait_a" in interrupt.interrupt_id else "b"
            assert f"yes-{who}".encode() in (interrupt.value or b"")
        await handler.cancel_run()  # this copy of the run waits for a reply it won't get

    asyncio.run(go())


def test_replies_to_a_restored_snapshot_reach_their_own_waiters(store_url: str) -> None:
    """The same through `Context.from_dict`: both replies sent to one restored run."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        snapshot = await paused_snapshot(rt, run, TwoWaiters, waiting=2)
        other = RemitRuntime(store_url)
        again = TwoWaiters(runtime=other)
        restored = again.run(ctx=Context.from_dict(again, snapshot))
        await other.send_event(restored, Reply(to="a", response="yes-a"))
        await other.send_event(restored, Reply(to="b", response="yes-b"))
        assert await asyncio.wait_for(restored, 20) == ["a=yes-a", "b=yes-b"]

    asyncio.run(go())


CHARGED: dict[str, int] = {}


@effect(reconcile=lambda key: CHARGED.get(key, NOT_APPLIED))
def charge_card(amount: int, *, idempotency_key: str) -> int:
    CHARGED[idempotency_key] = CHARGED.get(idempotency_key, 0) + 1
    return amount


class Approval(Untimed):
    """approve (waits for a `HumanResponseEvent`) -> charge (an effect)."""

    @step
    async def approve(self, ctx: Context, ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        charge_card(7)
        return StopEvent(result=answer.response)


@pytest.fixture(autouse=True)
def _no_charges() -> None:
    CHARGED.clear()


def test_cancel_run_while_parked_leaves_the_run_resumable(store_url: str) -> None:
    """The framework's documented pause: `ctx.to_dict()`, `cancel_run()`, later
    `Context.from_dict` and `run(ctx=...)`. Cancelling a parked run stops this
    process's copy only: the stored run stays parked, the restore continues it (same
    run, no fork), and restoring the same snapshot once it moved on is still a fork."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = Approval(runtime=rt)
        handler = wf.run(run_id=run)
        await parked(rt, run, waiting=1)
        snapshot = handler.ctx.to_dict()
        head = rt.checkpoints(run)[0]
        await handler.cancel_run()
        assert rt.checkpoints(run)[0] == head and rt.status(run) == "waiting"

        later = RemitRuntime(store_url)
        again = Approval(runtime=later)
        restored = again.run(ctx=Context.from_dict(again, snapshot))
        assert restored.run_id == run
        await later.send_event(restored, HumanResponseEvent(response="ada"))
        assert await restored == "ada"
        assert later.status(run) == "completed" and len(later.remit.branches(run)) == 1
        with pytest.raises(ForkWithoutIntent):
            again.run(ctx=Context.from_dict(again, snapshot))
        with pytest.raises(ResumeConflict):
            await later.respond(again, run, HumanResponseEvent(response="bob"))

    asyncio.run(go())
    assert list(CHARGED.values()) == [1]


def test_a_parked_run_is_ended_for_good_with_rt_cancel(store_url: str) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        snapshot = await paused_snapshot(rt, run, Approval)
        assert rt.status(run) == "waiting"
        head = await rt.cancel(run)
        assert rt.status(run) == "cancelled" and rt.checkpoints(run)[0].checkpoint_id == head
        assert await rt.cancel(run) == head  # already ended: nothing more is written

        later = RemitRuntime(store_url)
        again = Approval(runtime=later)
        with pytest.raises(ResumeConflict):
            await later.respond(again, run, HumanResponseEvent(response="ada"))
        with pytest.raises(ForkWithoutIntent):  # the snapshot is no longer the head
            again.run(ctx=Context.from_dict(again, snapshot))
        assert later.recover(again, run) is None
        assert later.checkpoints(run)[0].checkpoint_id == head

    asyncio.run(go())
    assert CHARGED == {}


def test_a_context_restored_against_another_store_is_unknown_there(
    store_url: str, tmp_path: Any
) -> None:
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        snapshot = await paused_snapshot(rt, run, Approval)
        elsewhere = RemitRuntime(f"sqlite:///{tmp_path}/elsewhere.db")
        other = Approval(runtime=elsewhere)
        with pytest.raises(UnknownRecord, match="does not hold"):
            other.run(ctx=Context.from_dict(other, snapshot))
        assert rt.status(run) == "waiting"

    asyncio.run(go())


def test_an_answer_reaches_the_handler_it_was_sent_to(store_url: str) -> None:
    """Two live restores of one parked run in one process (two requests of a server):
    the answer sent through the first is driven by the first, which returns the result;
    the second's answer is refused."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        snapshot = await paused_snapshot(rt, run, Approval)
        first, second = (Approval(runtime=rt) for _ in range(2))
        a = first.run(ctx=Context.from_dict(first, snapshot))
        b = second.run(ctx=Context.from_dict(second, snapshot))
        await rt.send_event(a, HumanResponseEvent(response="ada"))
        with pytest.raises(ResumeConflict):
            await rt.send_event(b, HumanResponseEvent(response="bob"))
        assert await asyncio.wait_for(a, 20) == "ada"
        with pytest.raises(ResumeConflict):  # the losing copy stopped
            await asyncio.wait_for(b, 20)

    asyncio.run(go())
    assert list(CHARGED.values()) == [1]


def test_a_refused_respond_leaves_another_live_copy_of_the_run_alone(store_url: str) -> None:
    """`rt.respond` refused (another resumer holds the run) stops the copy it restored,
    not another live copy of the run in this process (a server's other request), which
    goes on and is answered once the run is free."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        await paused_snapshot(rt, run, Approval)
        held = RemitRuntime(store_url).remit.claim(run)

        async def other_request() -> Any:
            # Restored while the refused respond's own copy exists, so it is the newer.
            while not rt._sessions:
                await asyncio.sleep(0)
            flow = Approval(runtime=rt)
            return flow.run(ctx=rt.context(flow, run))

        refused, copy = await asyncio.gather(
            rt.respond(Approval(runtime=rt), run, HumanResponseEvent(response="bob")),
            other_request(),
            return_exceptions=True,
        )
        assert isinstance(refused, ResumeConflict)
        held.release()
        await rt.send_event(copy, HumanResponseEvent(response="ada"))
        assert await asyncio.wait_for(copy, 20) == "ada"

    asyncio.run(go())
    assert list(CHARGED.values()) == [1]


class Asking(Untimed):
    """The classic human in the loop: `ask` returns an `InputRequiredEvent`, `answer`
    takes the `HumanResponseEvent` and charges."""

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> InputRequiredEvent:
        return InputRequiredEvent(prefix="ok?")

    @step
    async def answer(self, ctx: Context, ev: HumanResponseEvent) -> StopEvent:
        charge_card(7)
        return StopEvent(result=ev.response)


def _won_alone(rt: RemitRuntime, run: str, winner: str) -> None:
    """The stored run is the winner's alone: one line of checkpoints on one branch,
    ending completed with its answer, and no loser's cancelled or failed end."""
    history = rt.checkpoints(run)
    assert [c.parent_id for c in history[:-1]] == [c.checkpoint_id for c in history[1:]]
    assert {c.branch for c in history} == {"main"}
    assert [c.status for c in history].count("completed") == 1
    assert not {"cancelled", "failed"} & {c.status for c in history}
    assert rt.status(run) == "completed" and rt.result(run) == winner


@pytest.mark.parametrize("flow", [Approval, Asking], ids=["wait_for_event", "classic"])
def test_of_two_handlers_of_one_parked_run_the_loser_ends_with_resume_conflict(
    store_url: str, flow: type[Workflow]
) -> None:
    """P5, the framework's pause and resume in one event loop: two restores of one
    parked run each get an answer through `handler.ctx.send_event` (fire and forget).
    One proceeds; the other's handler and event stream end with `ResumeConflict`
    (not a hang, nor its workflow timeout), and it stores nothing. An event no step
    takes is dropped as the framework drops it: that copy goes on."""
    run = new_run()

    async def outcome(handler: Any) -> tuple[list[str], Any]:
        seen = [type(ev).__name__ async for ev in handler.stream_events()]
        try:
            return seen, await handler
        except ResumeConflict as exc:
            return seen, exc

    async def go() -> None:
        rt = RemitRuntime(store_url)
        snapshot = await paused_snapshot(rt, run, flow)
        first, second = (flow(runtime=rt, timeout=20) for _ in range(2))
        a = first.run(ctx=Context.from_dict(first, snapshot))
        b = second.run(ctx=Context.from_dict(second, snapshot))
        a.ctx.send_event(ForA())
        a.ctx.send_event(HumanResponseEvent(response="ada"))
        b.ctx.send_event(HumanResponseEvent(response="bob"))
        ends = await asyncio.gather(outcome(a), outcome(b))
        (won,) = [(seen, r) for seen, r in ends if isinstance(r, str)]
        (lost,) = [(seen, r) for seen, r in ends if isinstance(r, ResumeConflict)]
        assert won[0][-1] == "StopEvent" and lost[0][-1] == "WorkflowFailedEvent"
        _won_alone(rt, run, won[1])

    asyncio.run(go())
    assert list(CHARGED.values()) == [1]


RESUMER = """
import asyncio, json, os, sys
sys.path.insert(0, {tests!r})
from workflows import Context
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
import test_llamaindex_resume as t

async def main(me):
    flow = getattr(t, {flow!r})(runtime=RemitRuntime({url!r}), timeout=20)
    try:
        # (A restore that comes after the winner moved the run on, a slow start under
        # load, is refused at once: `PauseAnswered`, a `ResumeConflict` too.)
        handler = flow.run(ctx=Context.from_dict(flow, json.loads({snapshot!r})))
    finally:
        open(os.path.join({folder!r}, me), "w").close()
    while not os.path.exists(os.path.join({folder!r}, "go")):
        await asyncio.sleep(0.005)
    handler.ctx.send_event(HumanResponseEvent(response=me))
    print("OK", await handler, sum(t.CHARGED.values()), flush=True)

try:
    asyncio.run(main(sys.argv[1]))
except Exception as exc:
    kind = "ResumeConflict" if isinstance(exc, t.ResumeConflict) else type(exc).__name__
    print("ERR", kind, sum(t.CHARGED.values()), flush=True)
"""


@pytest.mark.parametrize("flow", [Approval, Asking], ids=["wait_for_event", "classic"])
def test_racing_resumers_of_a_restored_snapshot_lose_with_resume_conflict(
    store_url: str, flow: type[Workflow], tmp_path: Path
) -> None:
    """P5 across processes, the framework's documented way: 4 processes each restore the
    paused run's snapshot (`Context.from_dict`, `run(ctx=...)`), then answer through
    `handler.ctx.send_event` at once and await the handler. One proceeds and charges
    once; every other handler ends with `ResumeConflict` before its timeout, charges
    nothing, stores nothing and leaves no unretrieved refusal in the log. A process so
    slow to start that it restores the snapshot only after the winner answered is
    refused at its restore with `ResumeConflict` too (`PauseAnswered`), not with a
    plain `ForkWithoutIntent`."""
    run = new_run()

    async def pause() -> dict[str, Any]:
        return await paused_snapshot(RemitRuntime(store_url), run, flow)

    snapshot = json.dumps(asyncio.run(pause()))
    code = RESUMER.format(
        tests=str(Path(__file__).parent),
        flow=flow.__name__,
        url=store_url,
        snapshot=snapshot,
        folder=str(tmp_path),
    )
    names = [f"r{i}" for i in range(4)]
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", code, name],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    ]
    deadline = time.monotonic() + 60
    while not all((tmp_path / n).exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    ended = [p.communicate(timeout=120) for p in racers]
    outcomes = sorted(out.strip() for out, _ in ended)
    assert outcomes[:3] == ["ERR ResumeConflict 0"] * 3, outcomes
    assert outcomes[3].startswith("OK r") and outcomes[3].endswith(" 1"), outcomes
    assert not [err for _, err in ended if "never retrieved" in err]
    _won_alone(RemitRuntime(store_url), run, outcomes[3].split()[1])


def test_cancel_run_of_a_running_run_still_cancels_it(store_url: str) -> None:
    """A run that is not parked (a step in flight) is cancelled for good."""
    run = new_run()

    class Slow(Workflow):
        @step
        async def work(self, ctx: Context, ev: StartEvent) -> StopEvent:
            await asyncio.sleep(30)
            return StopEvent(result="late")

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = Slow(runtime=rt, timeout=None).run(run_id=run)
        while not committed(rt, run):
            await asyncio.sleep(0.05)
        await handler.cancel_run()
        assert rt.status(run) == "cancelled"
        assert rt.recover(Slow(runtime=rt, timeout=None), run) is None
        other = RemitRuntime(store_url)
        with pytest.raises(ResumeConflict, match="ended"):  # refused before anything runs
            await other.respond(Slow(runtime=other, timeout=None), run, Reply(to="x"))

    asyncio.run(go())


class Lingering(Untimed):
    """`work` stays in flight for a long while, then charges."""

    @step
    async def work(self, ctx: Context, ev: StartEvent) -> StopEvent:
        await asyncio.sleep(float(ev.get("seconds", 30)))
        charge_card(7)
        return StopEvent(result="late")


def test_rt_cancel_ends_a_run_whose_step_is_in_flight_in_this_process(store_url: str) -> None:
    """`rt.cancel` of a run this process drives stops the live run (as `cancel_run`) and
    the run's own claim commits the cancelled end: the step never finishes, a later
    answer or recovery gets the ended outcome."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        handler = Lingering(runtime=rt).run(run_id=run, seconds=2)
        while not committed(rt, run):
            await asyncio.sleep(0.05)
        head = await rt.cancel(run)
        assert rt.status(run) == "cancelled" and rt.checkpoints(run)[0].checkpoint_id == head
        with pytest.raises(WorkflowCancelledByUser):
            await handler
        assert await rt.cancel(run) == head
        assert rt.recover(Lingering(runtime=rt), run) is None
        other = RemitRuntime(store_url)
        with pytest.raises(ResumeConflict, match="ended"):
            await other.respond(Lingering(runtime=other), run, Reply(to="x"))
        await asyncio.sleep(2.2)  # when the step would have finished
        assert rt.checkpoints(run)[0].checkpoint_id == head

    asyncio.run(go())
    assert CHARGED == {}


LINGERING = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_resume import Lingering

async def main():
    await Lingering(runtime=RemitRuntime({url!r})).run(run_id={run!r}, seconds=60)

asyncio.run(main())
"""


def test_rt_cancel_of_a_run_another_process_drives_says_so(store_url: str) -> None:
    """A run whose step is in flight in another live process is not ended from here:
    `ResumeConflict` says that another process drives it, and nothing is written."""
    run = new_run()
    code = LINGERING.format(tests=str(Path(__file__).parent), url=store_url, run=run)
    driver = subprocess.Popen([sys.executable, "-c", code])
    try:

        async def go() -> None:
            rt = RemitRuntime(store_url)
            deadline = time.monotonic() + 30
            # Until the driver's step is in flight (the checkpoint that names it is
            # written): the driver writes nothing more while `work` sleeps.
            while time.monotonic() < deadline and not any(
                c.next_steps == ("work",) for c in committed(rt, run)
            ):
                await asyncio.sleep(0.05)
            history = rt.checkpoints(run)
            with pytest.raises(ResumeConflict, match="another live process drives the run"):
                await rt.cancel(run)
            assert rt.checkpoints(run) == history and rt.status(run) == "running"

        asyncio.run(go())
    finally:
        driver.kill()
        driver.wait()


def test_a_timeout_while_parked_leaves_the_run_resumable_elsewhere(store_url: str) -> None:
    """The workflow timeout firing in a process whose run is parked ends that process's
    copy only (as stopping the process would): the stored run stays parked, and another
    process resumes it, before or after the timeout fired."""
    early, late = new_run(), new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        timing_out = {r: Approval(runtime=rt, timeout=1.0).run(run_id=r) for r in (early, late)}
        for r in (early, late):
            await parked(rt, r, waiting=1)
        other = RemitRuntime(store_url)
        resumed = await other.respond(
            Approval(runtime=other), early, HumanResponseEvent(response="ada")
        )
        assert await resumed == "ada"
        for handler in timing_out.values():
            with pytest.raises(WorkflowTimeoutError):
                await handler
        assert other.status(early) == "completed" and other.status(late) == "waiting"
        resumed = await other.respond(
            Approval(runtime=other), late, HumanResponseEvent(response="bob")
        )
        assert await resumed == "bob"
        assert other.result(early) == "ada" and other.result(late) == "bob"

    asyncio.run(go())
    assert sorted(CHARGED.values()) == [1, 1]


def test_a_fork_token_presented_again_after_its_branch_completed(store_url: str) -> None:
    """P3: the same token, from any process, names the same branch; once that branch
    completed, running it again answers at once with its recorded result and writes
    nothing (it neither waits for an event nor stores the branch again)."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        wf = Approval(runtime=rt)
        handler = wf.run(run_id=run)
        await parked(rt, run, waiting=1)
        await rt.send_event(handler, HumanResponseEvent(response="ada"))
        assert await handler == "ada"
        base = next(c for c in rt.checkpoints(run) if c.status == "waiting").checkpoint_id
        forked = wf.run(ctx=rt.context(wf, run, checkpoint_id=base, fork_token="what-if"))
        await rt.send_event(forked, HumanResponseEvent(response="eve"))
        assert await forked == "eve"
        history = rt.checkpoints(run)

        other = RemitRuntime(store_url)
        again = Approval(runtime=other, timeout=5)
        ctx = other.context(again, run, checkpoint_id=base, fork_token="what-if")
        presented = again.run(ctx=ctx)
        assert presented.run_id == forked.run_id
        assert await asyncio.wait_for(presented, 2) == "eve"
        assert other.checkpoints(run) == history
        assert other.status(forked.run_id) == "completed" and other.result(forked.run_id) == "eve"
        with pytest.raises(ResumeConflict):
            await other.respond(again, forked.run_id, HumanResponseEvent(response="bob"))

    asyncio.run(go())
    assert list(CHARGED.values()) == [1, 1]


SENT: list[str] = []


def _send(key: str) -> str:
    SENT.append(key)
    if len(SENT) == 1:
        raise ConnectionError("mail server went away")
    return "sent"


@effect(name="mail")
def mail_plain(*, idempotency_key: str) -> str:
    return _send(idempotency_key)


@effect(name="mail", reconcile=lambda key: "sent" if SENT[1:].count(key) else NOT_APPLIED)
def mail_reconciled(*, idempotency_key: str) -> str:
    return _send(idempotency_key)


@effect(name="mail", idempotent=True)
def mail_idempotent(*, idempotency_key: str) -> str:
    return _send(idempotency_key)


class Mailer(Workflow):
    """One step that sends a mail through `mail`, retried once when it raises."""

    def __init__(self, mail: Any, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)
        self.mail = mail

    @step(retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(2)))
    async def send(self, ctx: Context, ev: StartEvent) -> StopEvent:
        return StopEvent(result=self.mail())


@pytest.mark.parametrize(
    "mail", [mail_reconciled, mail_idempotent], ids=["reconcile", "idempotent"]
)
def test_an_effect_whose_body_raised_is_retried_through_reconcile_or_idempotent(
    store_url: str, mail: Any
) -> None:
    """P2: an effect whose body raised may have reached its target (a timeout after the
    mail went out), so it stays in doubt; the step's retry applies it again through
    `reconcile` (it answers "not applied") or `idempotent=True` (the same key)."""
    SENT.clear()

    async def go() -> Any:
        return await Mailer(mail, runtime=RemitRuntime(store_url)).run(run_id=new_run())

    result = asyncio.run(go())
    assert result == "sent" and len(SENT) == 2 and SENT[0] == SENT[1]


def test_an_effect_whose_body_raised_is_in_doubt_without_reconcile(store_url: str) -> None:
    """Without `reconcile` or `idempotent`, its retry raises `EffectInDoubt`: Remit never
    applies an effect twice on a guess."""
    SENT.clear()
    run = new_run()

    async def go() -> Any:
        return await Mailer(mail_plain, runtime=RemitRuntime(store_url)).run(run_id=run)

    with pytest.raises(EffectInDoubt) as refused:
        asyncio.run(go())
    assert refused.value.run_id == run and len(SENT) == 1


def _edit_metadata(url: str, run_id: str, checkpoint_id: str, **changes: Any) -> None:
    """Change a stored checkpoint's metadata in place, as a writer of the store could."""
    if url.startswith("redis://"):
        from redis import Redis

        from remit_core.stores.redis import run_prefix

        client = Redis.from_url(url)
        key, field = run_prefix(run_id) + "ck", f"{checkpoint_id}\x00"
        head, _, state = client.hget(key, field).partition(b"\n")
        header = codec.loads(head)
        header[5] = {**header[5], **changes}
        client.hset(key, field, codec.dumps(header, exact=False) + b"\n" + state)
        client.close()
        return
    where = "WHERE run_id = {0} AND checkpoint_id = {0}"
    if url.startswith("sqlite:///"):
        conn: Any = sqlite3.connect(url.removeprefix("sqlite:///"))
        mark = "?"
    else:
        conn = psycopg.connect(url, autocommit=True)
        mark = "%s"
    with contextlib.closing(conn):
        select = f"SELECT metadata FROM remit_checkpoints {where.format(mark)}"
        (text,) = conn.execute(select, (run_id, checkpoint_id)).fetchone()
        meta = {**codec.loads(text.encode()), **changes}
        update = f"UPDATE remit_checkpoints SET metadata = {mark} {where.format(mark)}"
        conn.execute(update, (codec.dumps(meta, exact=False).decode(), run_id, checkpoint_id))
        conn.commit()


def test_edited_run_metadata_is_refused_as_corrupt(store_url: str) -> None:
    """P4: a parked run whose stored status was changed to "completed" (which would turn
    every answer away) is refused with `CorruptRecord` naming run and checkpoint."""
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url)
        started = TwoWaiters(runtime=rt).run(run_id=run)
        await parked(rt, run, waiting=2)
        await started.cancel_run()
        head = rt.checkpoints(run)[0].checkpoint_id
        _edit_metadata(store_url, run, head, status="completed", result=None)
        with pytest.raises(CorruptRecord) as refused:
            rt.status(run)
        assert (refused.value.run_id, refused.value.checkpoint_id) == (run, head)
        with pytest.raises(CorruptRecord):
            await rt.respond(TwoWaiters(runtime=rt), run, Reply(to="a", response="yes-a"))

    asyncio.run(go())


class Round(Event):
    n: int


class AskEachRound(Workflow):
    @step
    async def begin(self, ev: StartEvent) -> Round:
        return Round(n=0)

    @step
    async def ask(self, ctx: Context, ev: Round) -> Round | StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent,
            waiter_event=InputRequiredEvent(prefix=f"round {ev.n}?"),
            waiter_id=f"round-{ev.n}",
        )
        if answer.response == "stop":
            return StopEvent(result=ev.n)
        return Round(n=ev.n + 1)


def test_an_answer_reads_the_interrupts_its_run_waits_on_not_every_rounds(
    store_url: str,
) -> None:
    """A run that asks each round, answered through a new runtime and workflow each
    time (as another process would): restoring it for the 9th answer reads the
    interrupt it waits on, not the 8 its earlier rounds consumed."""
    run = f"rounds-{uuid.uuid4().hex[:12]}"
    read: list[int] = []

    def counting(rt: RemitRuntime) -> None:
        store = rt.remit.store
        listed, got = store.list_interrupts, store.get_interrupt

        def counted_list(*args: Any, **kwargs: Any) -> Any:
            found = listed(*args, **kwargs)
            read.append(len(found))
            return found

        def counted_get(*args: Any, **kwargs: Any) -> Any:
            found = got(*args, **kwargs)
            read.append(found is not None)
            return found

        store.list_interrupts = counted_list  # type: ignore[method-assign]
        store.get_interrupt = counted_get  # type: ignore[method-assign]

    async def main() -> Any:
        rt = RemitRuntime(store_url)
        flow = AskEachRound(timeout=None)
        flow._runtime = rt
        handlers = [flow.run(run_id=run)]
        await until_parked(rt, run)
        for n in range(9):
            rt = RemitRuntime(store_url)
            if n == 8:
                read.clear()
                counting(rt)
            flow = AskEachRound(timeout=None)
            flow._runtime = rt
            answer = HumanResponseEvent(response="stop" if n == 8 else f"go {n}")
            handlers.append(await rt.respond(flow, run, answer))
            if n == 8:
                break
            for _ in range(400):  # until the next round asks
                head = (await asyncio.to_thread(rt.checkpoints, run))[0]
                if head.status == "waiting" and any(f"round-{n + 1}" in w for w in head.waiting):
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"round {n + 1} never asked: {head}")
        result = await asyncio.wait_for(handlers[-1], 20.0)
        # The copies left parked by earlier rounds can take no answer: stop them here.
        for parked in handlers[:-1]:
            await parked.cancel_run()
        await asyncio.gather(*handlers[:-1], return_exceptions=True)
        return result

    assert asyncio.run(main()) == 8
    assert 0 < sum(read) <= 3, read
    assert len(RemitRuntime(store_url).remit.interrupts(run)) == 9
    assert RemitRuntime(store_url).status(run) == "completed"
