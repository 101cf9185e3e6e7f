"""LlamaIndex probes, round 26, on SQLite, PostgreSQL and Redis: crash and race timing
with `RemitRuntime`. A run that fans out with `ctx.send_event` to a step with
`num_workers=3` whose workers pay in parallel (one of them waits for a typed answer),
joined by `ctx.collect_events` over two event types, then asking a question the
classic way (`InputRequiredEvent` returned, `HumanResponseEvent` taken by another
step): the process delivering an answer is SIGKILLed holding the claim, and the
driver is SIGSTOPped past its lease, then continued.

A process SIGKILLed after it claimed a parked run to deliver an answer (before it
consumed the interrupt, or right after it committed the parked head) leaves its claim
held for its lease: an answer sent meanwhile waited for a release the dead process
never makes, and was refused after 5 s with `ResumeConflict` ("retry when ... the lease
runs out"), though the lease had run out long before. It is now delivered once the
lease has run out (L1).

A driver paused past its lease between its plan and its checkpoint write, or while it
held the claim to deliver an answer, had its write refused with the store's own
"write carries fence 1 of holder '...' but the claim's current fence is 4". The
refusal now says that its claim ran out, that another resumer took the run over, and
what was not stored or delivered (L2).
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

import pytest
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import ResumeConflict, UnknownRecord
from remit_llamaindex import RemitRuntime

GUARD = 30
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe26-{uuid.uuid4().hex[:12]}"


class Item(Event):
    i: int


class Done(Event):
    i: int
    paid: str


class Noted(Event):
    paid: str


class Ask(InputRequiredEvent):
    i: int


class Yes(HumanResponseEvent):
    i: int


class Mixed(Workflow):
    """`start` sends three `Item`s and returns a `Noted`; `work` (three workers) pays for
    each item in parallel, item 1 only once it is answered (`Yes`); `join` collects the
    three `Done` and the `Noted` (two event types), pays for the lot and asks the
    classic way; `finish` takes the `HumanResponseEvent` and pays for it."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Noted | Item:
        enter("start")
        for i in range(3):
            ctx.send_event(Item(i=i))
        return Noted(paid=pay("note"))

    @step(num_workers=3)
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter(f"work{ev.i}")
        if ev.i != 1:
            await asyncio.sleep(0.05 * ev.i)
            return Done(i=ev.i, paid=pay(f"item{ev.i}"))
        answer = await ctx.wait_for_event(
            Yes, waiter_event=Ask(i=1, prefix="ok?"), requirements={"i": 1}, timeout=None
        )
        return Done(i=ev.i, paid=pay(f"item1-{answer.response}"))

    @step
    async def join(self, ctx: Context, ev: Done | Noted) -> InputRequiredEvent | None:
        got = ctx.collect_events(ev, [Done, Done, Done, Noted])
        if got is None:
            return None
        enter("join")
        paid = pay("all:" + "+".join(sorted(e.paid for e in got)))
        await ctx.store.set("joined", paid)
        return InputRequiredEvent(prefix="ship?")

    @step
    async def finish(self, ctx: Context, ev: HumanResponseEvent) -> StopEvent:
        enter("finish")
        joined = await ctx.store.get("joined")
        return StopEvent(result=f"{joined}|{pay('ship-' + ev.response)}")


RESULT = "all:item0+item1-ok+item2+note|ship-go"
PAID = ["all:item0+item1-ok+item2+note", "item0", "item1-ok", "item2", "note", "ship-go"]


async def answer_next(rt: RemitRuntime, flow: Workflow, run: str) -> bool:
    """Answer what the run's head waits on (the worker's `Yes`, else the ask); False if
    it waits on nothing open."""
    head = (await asyncio.to_thread(rt.checkpoints, run))[0]
    waits = [w for w in head.waiting]
    if not waits:
        return False
    event: Event = (
        Yes(i=1, response="ok") if "Yes" in " ".join(waits) else HumanResponseEvent(response="go")
    )
    await rt.respond(flow, run, event)
    return True


async def drive(rt: RemitRuntime, flow: Workflow, run: str, handler: Any) -> Any:
    """Until the run has ended: answer each question it parks at, once."""
    deadline = time.monotonic() + GUARD
    while True:
        assert time.monotonic() < deadline, "the run did not end"
        try:
            status = await asyncio.to_thread(rt.status, run)
        except UnknownRecord:
            status = "none"
        if status == "completed":
            return await asyncio.to_thread(rt.result, run)
        if status == "waiting":
            try:
                await answer_next(rt, flow, run)
            except ResumeConflict:
                pass
        await asyncio.sleep(0.05)


DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes26 import Mixed, drive

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = Mixed(runtime=rt)
    handler = flow.run(run_id={run!r})
    print("RESULT", await drive(rt, flow, {run!r}, handler), flush=True)

asyncio.run(main())
"""


def run_driver(code: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp), **env},
        capture_output=True,
        text=True,
        timeout=90,
    )


RECOVER = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes26 import Mixed, drive

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = Mixed(runtime=rt)
    deadline = time.monotonic() + 30
    started = time.monotonic()
    while True:
        try:
            handler = rt.recover(flow, {run!r})
            break
        except ResumeConflict:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.1)
    print("TOOK", round(time.monotonic() - started, 2), flush=True)
    print("RESULT", await drive(rt, flow, {run!r}, handler), flush=True)

asyncio.run(main())
"""


ZOMBIE = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes26 import Mixed, drive

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = Mixed(runtime=rt)
    handler = flow.run(run_id={run!r})
    try:
        print("RESULT", await drive(rt, flow, {run!r}, handler), flush=True)
    except BaseException as exc:
        print("DRIVE", type(exc).__name__, exc, flush=True)
    try:
        print("HANDLER", await asyncio.wait_for(handler, 10), flush=True)
    except BaseException as exc:
        print("HANDLER", type(exc).__name__, exc, flush=True)

asyncio.run(main())
"""


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except FileNotFoundError:
        return False


def recover_elsewhere(url: str, run: str, tmp: Path) -> str:
    """Recover the run in another process and answer what it asks; its last line."""
    done = run_driver(RECOVER.format(tests=TESTS, url=url, run=run), tmp)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout.splitlines()[-1]


# -- the process that was delivering an answer dies holding the claim ---------------------


@pytest.mark.parametrize("point", ["claim.after_acquire=kill@2", "interrupt.before_consume=kill@1"])
def test_an_answer_after_the_deliverer_died_waits_out_only_the_lease(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """L1: the process answering the worker's wait is SIGKILLed after it claimed the run
    to deliver, before it consumed the interrupt; the head still waits, the dead
    process's claim is held for its lease (1 s). An answer sent at once is delivered as
    soon as that lease has run out, and the run ends paying everything once. (Before,
    the answer waited for a release that a dead process never makes, then was refused
    after 5 s with `ResumeConflict` telling to retry once the lease runs out, which
    it had, 4 s earlier.)"""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    dead = run_driver(
        DRIVER.format(tests=TESTS, url=store_url, run=run), tmp_path, REMIT_FAILPOINTS=point
    )
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)

    async def answer() -> tuple[float, Any]:
        rt = RemitRuntime(store_url, lease=1)
        flow = Mixed(runtime=rt)
        assert await asyncio.to_thread(rt.status, run) == "waiting"
        claim = await asyncio.to_thread(rt.remit.store.get_claim, run, "main")
        assert claim is not None and claim.holder  # (the dead process's, for its lease)
        began = time.monotonic()
        handler = await rt.respond(flow, run, Yes(i=1, response="ok"))
        took = time.monotonic() - began
        del handler
        return took, await drive(rt, flow, run, None)

    took, result = asyncio.run(answer())
    assert took < 3.0, f"the answer waited {took:.1f} s for a lease of 1 s"
    assert result == RESULT
    assert sorted(applied(tmp_path)) == PAID
    assert entered(tmp_path).count("start") == 1 and entered(tmp_path).count("work0") == 1


# -- a driver paused past its lease, then continued ----------------------------------------


@pytest.mark.parametrize(
    ("point", "says"),
    [
        ("checkpoint.before_commit=stop@3", "HANDLER Fenced"),
        ("interrupt.before_consume=stop@1", "DRIVE Fenced"),
        ("effect.before_intent=stop@3", "HANDLER Fenced"),
    ],
)
def test_a_driver_paused_past_its_lease_is_told_another_resumer_took_the_run_over(
    store_url: str, tmp_path: Path, point: str, says: str
) -> None:
    """L2, P2: the driver is SIGSTOPped at `point` (holding the claim, between its plan
    and its checkpoint write; claimed to deliver an answer, before consuming it; or in
    a worker, before its effect's intent is written),
    another process recovers the run past the lease and finishes it, then the paused
    driver is continued. Its write is refused with `Fenced` saying that its claim ran
    out, that another resumer took the run over and what was not stored or delivered;
    the run stays as the recovery ended it and every payment was applied once.
    (Before, the refusal was the store's own "write carries fence 1 of holder
    'host:pid:...' but the claim's current fence is 4", naming no run outcome.)"""
    run = new_run()
    zombie = subprocess.Popen(
        [sys.executable, "-c", ZOMBIE.format(tests=TESTS, url=store_url, run=run)],
        env={**os.environ, DIR_VAR: str(tmp_path), "REMIT_FAILPOINTS": point},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + GUARD
        while not stopped(zombie.pid):
            assert zombie.poll() is None, zombie.communicate()
            assert time.monotonic() < deadline, "the driver never reached its failpoint"
            time.sleep(0.05)
        time.sleep(1.5)  # (past its lease of 1 s)
        assert recover_elsewhere(store_url, run, tmp_path) == f"RESULT {RESULT}"
        os.kill(zombie.pid, signal.SIGCONT)
        out, err = zombie.communicate(timeout=60)
    finally:
        if zombie.poll() is None:
            os.kill(zombie.pid, signal.SIGKILL)
            zombie.wait()
    told = next((line for line in out.splitlines() if line.startswith(says)), "")
    assert "ran out and another resumer took the run over" in told, (out, err)
    assert "not stored" in told or "not delivered" in told, told
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed" and rt.result(run) == RESULT
    assert sorted(applied(tmp_path)) == PAID
