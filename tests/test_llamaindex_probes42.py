"""Round 42 of the LlamaIndex probes, on SQLite, PostgreSQL and Redis: forks of a run
whose step started a child under a run id of its own choosing.

A step that started a child under its own run id (`Shipment().run(run_id=f"{order}-
shipment")`) and then waited could not be continued on a fork of its waiting
checkpoint: the step, re-run on the fork from its top, started the child again and
was refused with `ForkWithoutIntent` ("run ... already exists"), because the child
named the original branch's step execution as its starter. Such starts are now
counted with the step's effect calls, so the fork's step finds the child its shared
prefix started (its stored result, paid once), also on a fork of the fork and on the
fork's recovery after a SIGKILL; a start the fork makes after its base under an id
the other branch took is still refused.

Held (pinned): four processes answering one question through `handler.ctx.send_event`
behind a barrier (one answer taken, three `ResumeConflict`); the stream of a run
recovered after a SIGKILL ends with its `StopEvent`; the workflow timeout firing while
a run waits leaves it resumable, and a cancelled run refuses answers."""

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
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)

from remit_core.errors import ForkWithoutIntent, ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 60
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe42-{uuid.uuid4().hex[:12]}"


class Shipment(Workflow):
    """The child: pays for shipping the order."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ship(self, ev: StartEvent) -> StopEvent:
        enter("ship")
        return StopEvent(result=pay(f"ship-{ev.order}"))


class ShipThenAsk(Workflow):
    """Starts the shipment under a run id named after the order, then asks who signs."""

    def __init__(self, rt: RemitRuntime, **kw: Any) -> None:
        super().__init__(timeout=None, runtime=rt, **kw)
        self.rt = rt

    @step
    async def place(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("place")
        order = ev.order
        got = await Shipment(runtime=self.rt).run(run_id=f"{order}-shipment", order=order)
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="sign?")
        )
        die_at("after-answer")
        return StopEvent(result=f"{got} by {answer.response}")


async def _parked(rt: RemitRuntime, wf: Workflow, run: str, **start: Any) -> None:
    handler = wf.run(run_id=run, **start)
    async for ev in handler.stream_events():
        if isinstance(ev, InputRequiredEvent):
            break
    await handler.cancel_run()


def test_a_fork_of_a_step_that_started_a_named_child_finds_the_shared_child(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P3: the step started a child under a run id of its own, then waits; a fork
    of the waiting checkpoint re-runs the step from its top, which starts the child
    again under that id: the child belongs to the prefix the fork shares, so the fork's
    step gets its stored result (as it gets an `@effect`'s recorded outcome) and the
    shipment is paid once; so does a fork of that fork; the original branch still
    answers and completes."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    rt = RemitRuntime(url, lease=1)

    async def answered(run_id: str, who: str) -> Any:
        handler = await rt.respond(ShipThenAsk(rt), run_id, HumanResponseEvent(response=who))
        return await asyncio.wait_for(handler, GUARD)

    async def scenario() -> tuple[Any, Any, Any, str, str]:
        await _parked(rt, ShipThenAsk(rt), run, order=order)
        waiting = [c for c in rt.checkpoints(run) if c.status == "waiting"]
        fork = rt.fork(run, waiting[0].checkpoint_id, fork_token="what-if")
        fork_waiting = [c for c in rt.checkpoints(fork) if c.status == "waiting"]
        forked = await answered(fork, "eve")
        again = rt.fork(fork, fork_waiting[0].checkpoint_id, fork_token="what-if-again")
        forked_again = await answered(again, "bob")
        return forked, forked_again, await answered(run, "ada"), fork, again

    forked, forked_again, main, fork, again = asyncio.run(scenario())
    assert forked == f"ship-{order} by eve"
    assert forked_again == f"ship-{order} by bob"
    assert main == f"ship-{order} by ada"
    assert applied(tmp_path) == [f"ship-{order}"]
    assert entered(tmp_path).count("ship") == 1
    assert {rt.status(r) for r in (run, fork, again)} == {"completed"}


def test_a_fork_from_before_the_named_child_started_is_refused_its_id(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P3: a fork of the run's first checkpoint (the step not yet run) starts the child
    under the id the original branch's step took after that base: that id names
    another run, so the fork's start is refused (`ForkWithoutIntent` naming it), the
    child's history is left as it was and nothing is paid again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    rt = RemitRuntime(url, lease=1)
    child = f"{order}-shipment"

    async def scenario() -> str:
        await _parked(rt, ShipThenAsk(rt), run, order=order)
        history = rt.checkpoints(child)
        first = rt.checkpoints(run)[-1]  # (newest first: the run's first checkpoint)
        fork = rt.fork(run, first.checkpoint_id, fork_token="before-the-child")
        wf = ShipThenAsk(rt)
        handler = wf.run(ctx=rt.context(wf, fork))
        with pytest.raises(ForkWithoutIntent) as refused:
            await asyncio.wait_for(handler, GUARD)
        assert refused.value.run_id == child
        assert rt.checkpoints(child) == history
        return fork

    asyncio.run(scenario())
    assert applied(tmp_path) == [f"ship-{order}"]
    assert entered(tmp_path).count("ship") == 1
    assert rt.status(run) == "waiting"


ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes42 as probes

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = await rt.respond(probes.ShipThenAsk(rt), {run!r}, HumanResponseEvent(response="eve"))
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


def test_a_fork_step_killed_after_it_found_the_shared_child_finds_it_again(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P3: the fork is answered in another process, whose re-run step got the
    shared child's result and is SIGKILLed before it ends; the fork's recovery re-runs
    the step once more, which finds the child again: one payment, the fork completes
    with the answer the dead process took, the original branch still waits."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    rt = RemitRuntime(url, lease=1)
    asyncio.run(_parked(rt, ShipThenAsk(rt), run, order=order))
    waiting = [c for c in rt.checkpoints(run) if c.status == "waiting"]
    fork = rt.fork(run, waiting[0].checkpoint_id, fork_token="killed-fork")
    code = ANSWER.format(tests=TESTS, url=url, run=fork)
    dead = in_process(code, tmp_path, kill="after-answer")
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)
    assert entered(tmp_path) == ["place", "ship", "place"]

    async def recovered() -> Any:
        handler = None
        while handler is None:
            try:
                handler = rt.recover(ShipThenAsk(rt), fork)
            except ResumeConflict:  # the dead process's lease has not run out yet
                await asyncio.sleep(0.1)
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(recovered()) == f"ship-{order} by eve"
    assert applied(tmp_path) == [f"ship-{order}"]
    assert entered(tmp_path) == ["place", "ship", "place", "place"]
    assert rt.status(fork) == "completed" and rt.status(run) == "waiting"


class Sign(Workflow):
    """Asks who signs, the framework's way, and pays for the signature."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def sign(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("sign")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who signs?")
        )
        return StopEvent(result=pay(f"signed-{answer.response}"))


SEND_AT_BARRIER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes42 as probes

async def main():
    rt = RemitRuntime({url!r}, lease=5)
    wf = probes.Sign(runtime=rt)
    handler = wf.run(ctx=rt.context(wf, {run!r}))
    print("READY", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    handler.ctx.send_event(HumanResponseEvent(response={who!r}))
    try:
        print("ACK", await asyncio.wait_for(handler, 60), flush=True)
    except ResumeConflict as exc:
        print("REFUSED", type(exc).__name__, flush=True)

asyncio.run(main())
"""


def test_four_processes_answering_through_their_handlers_take_one_answer(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2 with k=4 through the framework's own way to answer: each process restores
    the parked run's context, runs it, and, released together behind a barrier, sends
    its answer with `handler.ctx.send_event`. Exactly one run ends with its answer and
    pays once; every other copy ends with `ResumeConflict` (none hangs, none pays), and
    the stored result is the winner's."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    rt = RemitRuntime(url, lease=1)
    asyncio.run(_parked(rt, Sign(runtime=rt), run))
    env = {**os.environ, DIR_VAR: str(tmp_path)}
    racers = [f"r{i}" for i in range(4)]
    procs = {
        who: subprocess.Popen(
            [sys.executable, "-c", SEND_AT_BARRIER.format(tests=TESTS, url=url, run=run, who=who)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for who in racers
    }
    try:
        for proc in procs.values():
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "READY"
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outcome = {}
        for who, proc in procs.items():
            out, err = proc.communicate(timeout=GUARD * 2)
            assert proc.returncode == 0, err
            outcome[who] = out.split()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    winners = [who for who, said in outcome.items() if said[0] == "ACK"]
    assert len(winners) == 1, outcome
    assert outcome[winners[0]] == ["ACK", f"signed-{winners[0]}"]
    assert all(
        said == ["REFUSED", "ResumeConflict"] for w, said in outcome.items() if w not in winners
    ), outcome
    assert applied(tmp_path) == [f"signed-{winners[0]}"]
    assert rt.status(run) == "completed" and rt.result(run) == f"signed-{winners[0]}"


class Progress(Event):
    what: str


class Half(Event):
    pass


class Streamed(Workflow):
    """Writes progress to the stream in each of two steps; the second pays."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def first(self, ctx: Context, ev: StartEvent) -> Half:
        enter("first")
        ctx.write_event_to_stream(Progress(what="first"))
        return Half()

    @step
    async def second(self, ctx: Context, ev: Half) -> StopEvent:
        enter("second")
        ctx.write_event_to_stream(Progress(what="second"))
        paid = pay("second")
        die_at("in-second")
        return StopEvent(result=paid)


STREAM = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
import test_llamaindex_probes42 as probes

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = probes.Streamed(runtime=rt).run(run_id={run!r})
    async for ev in handler.stream_events():
        print("EVENT", type(ev).__name__, getattr(ev, "what", ""), flush=True)

asyncio.run(main())
"""


def test_the_stream_of_a_recovered_run_ends_with_its_result(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2: a process streaming a run is SIGKILLed in the second step after it paid;
    a recovery in another process streams the rest of the run: the re-run step's
    progress, then the `StopEvent` with the recorded payment, and the stream ends (no
    hang); the first step is not run again, the payment is applied once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = STREAM.format(tests=TESTS, url=url, run=run)
    dead = in_process(code, tmp_path, kill="in-second")
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)
    assert "EVENT Progress first" in dead.stdout
    rt = RemitRuntime(url, lease=1)

    async def streamed() -> tuple[list[tuple[str, str]], Any]:
        handler = None
        while handler is None:
            try:
                handler = rt.recover(Streamed(runtime=rt), run)
            except ResumeConflict:  # the dead process's lease has not run out yet
                await asyncio.sleep(0.1)
        seen: list[tuple[str, str]] = []

        async def consume() -> None:
            async for ev in handler.stream_events():
                seen.append((type(ev).__name__, getattr(ev, "what", "")))

        await asyncio.wait_for(consume(), GUARD)
        return seen, await asyncio.wait_for(handler, GUARD)

    seen, result = asyncio.run(streamed())
    assert result == "second"
    assert ("Progress", "second") in seen and ("Progress", "first") not in seen
    assert seen[-1] == ("StopEvent", "")
    assert entered(tmp_path) == ["first", "second", "second"]
    assert applied(tmp_path) == ["second"]


class QuickSign(Sign):
    """`Sign` under a workflow timeout shorter than any answer."""

    def __init__(self, **kw: Any) -> None:
        Workflow.__init__(self, timeout=0.5, **kw)


def test_a_timeout_while_parked_then_a_cancel_leave_the_run_as_documented(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P5: the workflow's timeout fires while the run waits for its answer: the
    handler raises `WorkflowTimeoutError`, the stored run still waits, and an answer
    from another runtime completes it, the step entered again only to take the answer
    and paying once. A second run cancelled while it waits (`rt.cancel`) is ended for
    good: an answer is refused with `ResumeConflict`, `rt.recover` returns None, and
    nothing is paid."""
    from workflows.errors import WorkflowTimeoutError

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    timed, cancelled = new_run(), new_run()
    rt = RemitRuntime(url, lease=1)

    async def scenario() -> Any:
        handler = QuickSign(runtime=rt).run(run_id=timed)
        with pytest.raises(WorkflowTimeoutError):
            await asyncio.wait_for(handler, GUARD)
        assert rt.status(timed) == "waiting"
        other = RemitRuntime(url, lease=1)
        answered = await other.respond(
            Sign(runtime=other), timed, HumanResponseEvent(response="ada")
        )
        result = await asyncio.wait_for(answered, GUARD)
        await _parked(rt, Sign(runtime=rt), cancelled)
        await rt.cancel(cancelled)
        with pytest.raises(ResumeConflict):
            await other.respond(Sign(runtime=other), cancelled, HumanResponseEvent(response="bob"))
        assert other.recover(Sign(runtime=other), cancelled) is None
        return result

    assert asyncio.run(scenario()) == "signed-ada"
    assert applied(tmp_path) == ["signed-ada"]
    assert entered(tmp_path) == ["sign", "sign", "sign"]
    assert rt.status(timed) == "completed" and rt.status(cancelled) == "cancelled"


class AskThenShip(ShipThenAsk):
    """Asks who signs first, then starts the shipment under the order's run id."""

    @step
    async def place(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("place")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="sign?")
        )
        got = await Shipment(runtime=self.rt).run(run_id=f"{ev.order}-shipment", order=ev.order)
        return StopEvent(result=f"{got} by {answer.response}")


def test_a_named_child_a_fork_starts_after_its_base_is_the_forks_own(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P3 (pinned limit): a run id the step's code gives names one run in the store, for
    every branch. A fork answered before the original branch starts the child under
    that id after its base: the child is the fork's. The original branch's step, once
    answered, is refused that id (`ForkWithoutIntent` naming it), and nothing is paid
    twice; give a child a run id that names the branch to start one per branch."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    rt = RemitRuntime(url, lease=1)
    child = f"{order}-shipment"

    async def scenario() -> Any:
        await _parked(rt, AskThenShip(rt), run, order=order)
        waiting = [c for c in rt.checkpoints(run) if c.status == "waiting"]
        fork = rt.fork(run, waiting[0].checkpoint_id, fork_token="ship-on-the-fork")
        on_fork = await rt.respond(AskThenShip(rt), fork, HumanResponseEvent(response="eve"))
        forked = await asyncio.wait_for(on_fork, GUARD)
        on_main = await rt.respond(AskThenShip(rt), run, HumanResponseEvent(response="ada"))
        with pytest.raises(ForkWithoutIntent) as refused:
            await asyncio.wait_for(on_main, GUARD)
        assert refused.value.run_id == child
        return forked

    assert asyncio.run(scenario()) == f"ship-{order} by eve"
    assert applied(tmp_path) == [f"ship-{order}"]
    assert entered(tmp_path).count("ship") == 1
