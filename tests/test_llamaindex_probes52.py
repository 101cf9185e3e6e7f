"""LlamaIndex probe round 52, on SQLite, PostgreSQL and Redis: events from outside that
answer no question (a fan-in a step gathers with `ctx.collect_events` from events other
processes send), across a SIGKILL of the sender.

Fixed: an event that a step takes and that answers no waiter or ask (the framework's
validation wants an outside event to be a `HumanResponseEvent`; one sent to a run that
never asked is an ordinary event, delivered without consume-once) was acknowledged by
`rt.respond` and `rt.send_event` as soon as it reached the control loop, before anything
of it was stored. A sender SIGKILLed right after the call returned lost it: the run's
head still read "waiting" for it, `rt.recover` returned None, and the run waited for
ever for an input its sender was told was delivered (P5: the value the run continues
with is the one acknowledged). A delivery of such an event now returns once its tick is
committed; a recovery continues with it.

Held (pinned): a step's async `@effect` that reached its target and awaits the answer
when this process stops its copy of the run (the task awaiting the handler cancelled,
then `rt.recover` in another runtime; or `handler.cancel_run()`) applies once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from llamaindex_sink import DIR_VAR, applied, enter, entered, in_process, pay, payments
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser
from workflows.events import HumanResponseEvent, StartEvent, StopEvent

from remit_core import NOT_APPLIED, effect
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 60
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe52-{uuid.uuid4().hex[:12]}"


class Tally(HumanResponseEvent):
    """One input of the fan-in, sent from outside by whoever has it."""

    n: int


class Gather(Workflow):
    """Opens, then gathers three `Tally` events sent from outside and pays their sum."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def open(self, ctx: Context, ev: StartEvent) -> None:
        enter("open")
        await ctx.store.set("opened", True)

    @step
    async def take(self, ctx: Context, ev: Tally) -> StopEvent | None:
        enter(f"take{ev.n}")
        got = ctx.collect_events(ev, [Tally, Tally, Tally])
        if got is None:
            return None
        numbers = sorted(e.n for e in got)
        pay(f"sum{sum(numbers)}")
        return StopEvent(result=numbers)


async def delivered(rt: RemitRuntime, flow: Workflow, run: str, event: Tally) -> Any:
    """`rt.respond`, retried while another sender (live, or dead until its lease ran
    out) holds the run or moved it on meanwhile: a refused event was not delivered."""
    for _ in range(GUARD * 10):
        try:
            return await rt.respond(flow, run, event)
        except ResumeConflict:
            await asyncio.sleep(0.1)
    raise AssertionError(f"run {run} never took {event!r}")


async def recovered(rt: RemitRuntime, flow: Workflow, run: str) -> Any:
    """`rt.recover`, retried while a dead process's claim has not run out yet."""
    for _ in range(GUARD * 10):
        try:
            return rt.recover(flow, run)
        except ResumeConflict:
            await asyncio.sleep(0.1)
    raise AssertionError(f"run {run} never became recoverable")


async def settled(rt: RemitRuntime, run: str) -> None:
    """Until the stored run no longer has work in flight (it waits, or it ended)."""
    for _ in range(GUARD * 20):
        if await asyncio.to_thread(rt.status, run) != "running":
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} never settled")


STARTED = """
import asyncio, os, signal, sys
sys.path.insert(0, {tests!r})
from llamaindex_parts import until_parked
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes52 import Gather, Tally

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = Gather(runtime=rt).run(run_id={run!r})
    await until_parked(rt, {run!r})
    if {send!r}:
        await rt.send_event(handler, Tally(n=1, response=""))
        print("ACK", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print("PARKED", flush=True)

asyncio.run(main())
"""

SENT = """
import asyncio, os, signal, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes52 import Gather, Tally, delivered

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    {wait}
    await delivered(rt, Gather(runtime=rt), {run!r}, Tally(n={n}, response=""))
    print("ACK", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["respond", "send_event"])
def test_an_event_acknowledged_to_a_sender_killed_at_once_is_delivered_by_the_recovery(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """P5, P1: a run parked with nothing asked waits for three `Tally` events a step
    gathers. The first is sent (`rt.respond` from another process, or
    `rt.send_event(handler, ...)` by the process driving the run) and the sender is
    SIGKILLed as soon as the call returns. The recovery continues with that event: the
    other two complete the run with all three, `open` is entered once, and the sum is
    paid once. (Before, the event was lost with the process: the head still read
    "waiting", `rt.recover` returned None, and the run waited for ever for a third.)"""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    started = in_process(
        STARTED.format(tests=TESTS, url=url, run=run, send=how == "send_event"), tmp_path
    )
    if how == "send_event":
        assert started.returncode == -signal.SIGKILL, (started.stdout, started.stderr)
    else:
        assert started.returncode == 0, started.stderr
        sent = in_process(SENT.format(tests=TESTS, url=url, run=run, n=1, wait=""), tmp_path)
        assert sent.returncode == -signal.SIGKILL, (sent.stdout, sent.stderr)
    assert "ACK" in (started.stdout if how == "send_event" else sent.stdout)

    async def go() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            flow = Gather(runtime=rt)
            handler = await recovered(rt, flow, run)
            assert handler is not None, "the acknowledged event was lost with its sender"
            await settled(rt, run)
            for n in (2, 3):
                handler = await delivered(rt, flow, run, Tally(n=n, response=""))
                await settled(rt, run)
            result = await asyncio.wait_for(handler, GUARD)
            assert rt.status(run) == "completed"
            assert rt.result(run) == result
            return result
        finally:
            rt.remit.close()

    assert asyncio.run(asyncio.wait_for(go(), GUARD * 2)) == [1, 2, 3]
    assert entered(tmp_path).count("open") == 1
    assert applied(tmp_path) == ["sum6"]


def test_racing_senders_each_killed_once_acknowledged_lose_no_event_and_double_none(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2, L1: three processes, released at once, each send one `Tally` to the
    parked run with `rt.respond` (a sender refused because another holds the run or
    moved it on sends again) and each is SIGKILLed as soon as its event is
    acknowledged, some while holding the run's claim. A recovery after the last one
    ends the run with each sender's event exactly once and pays the sum once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    started = in_process(STARTED.format(tests=TESTS, url=url, run=run, send=False), tmp_path)
    assert started.returncode == 0, started.stderr
    gate = tmp_path / "go"
    wait = f"while not os.path.exists({str(gate)!r}): await asyncio.sleep(0.01)"
    env = {**os.environ, DIR_VAR: str(tmp_path)}
    senders = [
        subprocess.Popen(
            [sys.executable, "-c", SENT.format(tests=TESTS, url=url, run=run, n=n, wait=wait)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (1, 2, 3)
    ]
    gate.touch()
    for sender in senders:
        out, err = sender.communicate(timeout=GUARD * 2)
        assert sender.returncode == -signal.SIGKILL and "ACK" in out, (out, err)

    async def go() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = await recovered(rt, Gather(runtime=rt), run)
            if handler is None:  # (the last sender's copy ended the run before it died)
                return rt.result(run)
            return await asyncio.wait_for(handler, GUARD)
        finally:
            rt.remit.close()

    assert asyncio.run(asyncio.wait_for(go(), GUARD * 2)) == [1, 2, 3]
    assert entered(tmp_path).count("open") == 1
    assert applied(tmp_path) == ["sum6"]


# -- a copy stopped while a step awaits an async effect -----------------------------------

#: Opened by the test once the copy stopped: until then the effect's call "hangs" after
#: it reached its target (a payment API slow to answer).
ANSWERED: asyncio.Event | None = None


def _reconcile(key: str) -> Any:
    hits = [line.split()[1] for line in payments(Path(os.environ[DIR_VAR])) if line.startswith(key)]
    return hits[0] if hits else NOT_APPLIED


@effect(reconcile=_reconcile)
async def slow_pay(what: str, *, idempotency_key: str) -> str:
    with (Path(os.environ[DIR_VAR]) / "sink.txt").open("a") as f:
        f.write(f"{idempotency_key} {what}\n")
    enter("applied")
    assert ANSWERED is not None
    await ANSWERED.wait()
    return what


class SlowCharge(Workflow):
    """One step, whose async effect reaches its target and then waits for its answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def charge(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("charge")
        return StopEvent(result=await slow_pay("order"))


async def until_applied(tmp: Path) -> None:
    for _ in range(GUARD * 20):
        if "applied" in entered(tmp):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the effect never applied")


@pytest.mark.parametrize("how", ["awaiter_cancelled", "cancel_run"])
def test_a_copy_stopped_inside_an_async_effect_that_reached_its_target_applies_it_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """P2, P1 (held): a step's async `@effect` has reached its target and awaits the
    answer when this process stops its copy of the run. Cancelling the task that awaits
    the handler (an `asyncio.wait_for` timeout) ends nothing: another runtime's
    `rt.recover` re-runs the step, whose call of the effect waits for the first copy's
    call in this process to be answered, then finds its outcome (or reconciles it: it
    happened) and completes with it, applying nothing again. `handler.cancel_run()`
    ends the run `cancelled`: `rt.recover` returns None and `rt.result` raises
    `WorkflowCancelledByUser`. Either way the charge reached its target once."""
    global ANSWERED
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        global ANSWERED
        ANSWERED = asyncio.Event()
        rt, other = RemitRuntime(url, lease=1), RemitRuntime(url, lease=1)
        try:
            handler = SlowCharge(runtime=rt).run(run_id=run)
            await until_applied(tmp_path)
            if how == "cancel_run":
                await handler.cancel_run()
                with pytest.raises(WorkflowCancelledByUser):
                    await asyncio.wait_for(handler, GUARD)
                assert rt.status(run) == "cancelled"
                assert other.recover(SlowCharge(runtime=other), run) is None
                with pytest.raises(WorkflowCancelledByUser):
                    other.result(run)
                ANSWERED.set()
                return
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(handler, 0.2)
            resumed = await recovered(other, SlowCharge(runtime=other), run)
            assert resumed is not None
            ANSWERED.set()  # (the target answers the first copy's call now)
            assert await asyncio.wait_for(resumed, GUARD) == "order"
            assert other.status(run) == "completed"
            assert other.result(run) == "order"
        finally:
            ANSWERED.set()
            rt.remit.close()
            other.remit.close()

    try:
        asyncio.run(asyncio.wait_for(go(), GUARD * 2))
    finally:
        ANSWERED = None
    assert applied(tmp_path) == ["order"]
