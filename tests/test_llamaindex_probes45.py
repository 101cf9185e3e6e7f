"""LlamaIndex probe round 45: steps that take an injected resource, and events sent to
one named step (`ctx.send_event(ev, step=...)`), across a SIGKILL.

A step whose parameters include `Annotated[T, Resource(factory)]` is killed after it
paid; recovered in another process, the framework builds the resource again for the
re-run, and the payment is the recorded one (P1, P2). A step that sends events to named
steps and a join that collects their answers (`ctx.collect_events`) are killed at each
point (after the sends, inside a target after it paid, inside the join once it
collected both): recovery runs each step that completed never again, delivers each
targeted event to its step once, and pays every part once, ending as an unkilled run.
"""

from __future__ import annotations

import asyncio
import signal
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from workflows import Context, Workflow, step
from workflows.events import Event, StartEvent, StopEvent
from workflows.resource import Resource

from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 60
TESTS = str(Path(__file__).parent)


async def recovered(rt: RemitRuntime, workflow: Workflow, run: str) -> Any:
    """`rt.recover`, retried while a dead process's claim has not run out yet."""
    for _ in range(GUARD * 10):
        try:
            return rt.recover(workflow, run)
        except ResumeConflict:
            await asyncio.sleep(0.1)
    raise AssertionError(f"run {run} never became recoverable")


def finish(url: str, workflow: type[Workflow], run: str, tmp: Path) -> tuple[Any, str]:
    """Recover `run` in this process, journalling to `tmp`; its result and status."""

    async def go() -> tuple[Any, str]:
        rt = RemitRuntime(url, lease=1)
        try:
            flow = workflow(runtime=rt)
            handler = await recovered(rt, flow, run)
            assert handler is not None, "the killed run had already ended"
            return await asyncio.wait_for(handler, GUARD), rt.status(run)
        finally:
            rt.remit.close()

    return asyncio.run(asyncio.wait_for(go(), GUARD))


START = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes45 import {workflow}

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    print("RESULT", await {workflow}(runtime=rt).run(run_id={run!r}), flush=True)

asyncio.run(main())
"""


def start_killed(url: str, workflow: str, run: str, tmp: Path, kill: str) -> None:
    done = in_process(START.format(tests=TESTS, url=url, run=run, workflow=workflow), tmp, kill)
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stdout, done.stderr)


def run_unkilled(url: str, workflow: str, run: str, tmp: Path) -> str:
    done = in_process(START.format(tests=TESTS, url=url, run=run, workflow=workflow), tmp)
    assert done.returncode == 0, done.stderr
    return done.stdout.split("RESULT ", 1)[1].strip()


# -- a step with an injected resource -------------------------------------------------


class Stock:
    """What the resource factory builds: a fresh one for each process."""

    def __init__(self) -> None:
        enter("factory")
        self.left = 3


def make_stock() -> Stock:
    return Stock()


class Stocked(Workflow):
    """`reserve` takes a `Stock` resource, pays for the reservation, then ends."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def reserve(
        self, ev: StartEvent, stock: Annotated[Stock, Resource(make_stock)]
    ) -> StopEvent:
        enter("reserve")
        paid = pay("reservation")
        die_at("reserved")
        stock.left -= 1
        return StopEvent(result=f"{paid}:{stock.left}")


def test_a_step_with_a_resource_killed_after_paying_pays_once_with_a_new_resource(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2: the step re-runs (it had not completed) with a resource the framework
    builds anew in the recovering process, its payment is the recorded one, and the
    run ends with the result an unkilled run ends with."""
    run = f"probe45-{uuid.uuid4().hex[:12]}"
    start_killed(url, "Stocked", run, tmp_path, "reserved")
    assert applied(tmp_path) == ["reservation"]
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    result, status = finish(url, Stocked, run, tmp_path)
    assert (result, status) == ("reservation:2", "completed")
    assert applied(tmp_path) == ["reservation"]
    assert entered(tmp_path) == ["factory", "reserve", "factory", "reserve"]

    clean = tmp_path / "clean"
    clean.mkdir()
    assert run_unkilled(url, "Stocked", run + "-clean", clean) == result


# -- events sent to named steps, collected by a join ------------------------------------


class Left(Event):
    pass


class Right(Event):
    pass


class LeftDone(Event):
    paid: str


class RightDone(Event):
    paid: str


class Targeted(Workflow):
    """`fan` sends `Left` to step `left` and `Right` to step `right` (both accept either
    type: only the target may take it), pays, and returns nothing; each target pays
    for its part; `join` collects both answers, pays, and ends with what was paid."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def fan(self, ctx: Context, ev: StartEvent) -> Left | Right | None:
        enter("fan")
        ctx.send_event(Left(), step="left")
        ctx.send_event(Right(), step="right")
        pay("fan")
        die_at("sent")
        return None  # (its return type declares what it sends, as the framework asks)

    @step
    async def left(self, ev: Left | Right) -> LeftDone:
        enter(f"left<-{type(ev).__name__}")
        paid = pay("left")
        die_at("left-paid")
        return LeftDone(paid=paid)

    @step
    async def right(self, ev: Left | Right) -> RightDone:
        enter(f"right<-{type(ev).__name__}")
        return RightDone(paid=pay("right"))

    @step
    async def join(self, ctx: Context, ev: LeftDone | RightDone) -> StopEvent | None:
        got = ctx.collect_events(ev, [LeftDone, RightDone])
        if got is None:
            return None
        enter("join")
        die_at("joined")
        total = pay("join")
        return StopEvent(result="+".join([*(e.paid for e in got), total]))


@pytest.mark.parametrize("kill", ["sent", "left-paid", "joined"])
def test_events_sent_to_named_steps_reach_each_step_once_across_a_kill(
    url: str,
    kill: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """P1, P2: killed at `kill`, the run recovered in another process ends as an
    unkilled run does; `fan` and every target that completed never run again, each
    target gets only the event sent to it, once, and each part is paid once."""
    run = f"probe45-{uuid.uuid4().hex[:12]}"
    start_killed(url, "Targeted", run, tmp_path, kill)
    before = entered(tmp_path)
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    result, status = finish(url, Targeted, run, tmp_path)
    clean = tmp_path / "clean"
    clean.mkdir()
    assert (result, status) == (run_unkilled(url, "Targeted", run + "-clean", clean), "completed")
    assert result == "left+right+join"
    assert sorted(applied(tmp_path)) == ["fan", "join", "left", "right"]
    steps = entered(tmp_path)
    assert set(steps) <= {"fan", "left<-Left", "right<-Right", "join"}, steps
    after = steps[len(before) :]
    # Recovery runs a step at most once more; the step killed inside runs again, and
    # one that had completed before it (`fan`, after the sends) does not.
    assert all(after.count(name) <= 1 for name in set(after)), (before, after)
    assert steps.count("fan") == (2 if kill == "sent" else 1), steps
    assert steps.count("left<-Left") == (2 if kill == "left-paid" else 1), steps
    assert steps.count("join") == (2 if kill == "joined" else 1), steps
    assert 1 <= steps.count("right<-Right") <= 2, steps
