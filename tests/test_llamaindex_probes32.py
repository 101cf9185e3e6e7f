"""LlamaIndex probes, round 32, on SQLite, PostgreSQL and Redis: a step that wrote to
the event stream and paid before its process was SIGKILLed, recovered under a consumer
of `stream_events` in another process; a waiting step with a `retry_policy` SIGKILLed
after its answer (in the attempt that fails, and in the retry); two questions asked the
classic way by a step with `num_workers=2`, answered at once by two processes behind a
barrier; and `ctx.store.edit_state()` through the handler of a parked run, raising
midway or leaving an invalid state. No bug was found: these pin what holds.
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
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, die_at, enter, entered, in_process, pay
from pydantic import BaseModel, Field
from workflows import Context, Workflow, step
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
)
from workflows.retry_policy import retry_policy, stop_after_attempt, wait_fixed

from remit_core.errors import CheckpointInvalid, ResumeConflict
from remit_llamaindex import RemitRuntime

TESTS = str(Path(__file__).parent)
GUARD = 60


def new_run() -> str:
    return f"probe32-{uuid.uuid4().hex[:12]}"


# -- the event stream across a pause, an answer in a process killed, a recovery ---------


class Progress(Event):
    note: str


class Asked(Event):
    pass


class Paid(Event):
    pass


class Streaming(Workflow):
    """Writes to the event stream in every step and pays before and after its answer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context, ev: StartEvent) -> Asked:
        enter("prepare")
        ctx.write_event_to_stream(Progress(note="prepare"))
        pay("deposit")
        return Asked()

    @step
    async def approve(self, ctx: Context, ev: Asked) -> Paid:
        enter("approve")
        ctx.write_event_to_stream(Progress(note="approve-asks"))
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="charge?"), timeout=None
        )
        ctx.write_event_to_stream(Progress(note="approve-answered"))
        pay("charge-" + answer.response)
        die_at("approve")
        return Paid()

    @step
    async def finish(self, ctx: Context, ev: Paid) -> StopEvent:
        enter("finish")
        ctx.write_event_to_stream(Progress(note="finish"))
        return StopEvent(result="done")


STREAM_UNTIL_ASKED = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import InputRequiredEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes32 import Streaming

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = Streaming(runtime=rt).run(run_id={run!r})
    async for ev in handler.stream_events():
        print("STREAM", type(ev).__name__, getattr(ev, "note", ""), flush=True)
        if isinstance(ev, InputRequiredEvent):
            break

asyncio.run(main())
"""

ANSWER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes32 import {flow}

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = await rt.respond({flow}(runtime=rt), {run!r}, HumanResponseEvent(response="ada"))
    print("ACK", flush=True)
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


def test_a_step_that_streamed_and_paid_then_was_killed_recovers_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2 with `stream_events`: a process streams the run until it asks and exits
    (the run parked); another answers and is SIGKILLed in `approve` after it streamed and
    paid. The recovery's stream carries only what runs after it (the re-run of `approve`
    from its top, then `finish`), never the events `prepare` wrote before the pause, and
    every payment is applied once: the re-run finds the charge recorded."""
    run = new_run()
    started = in_process(STREAM_UNTIL_ASKED.format(tests=TESTS, url=url, run=run), tmp_path)
    assert started.returncode == 0, started.stderr
    streamed = [line.split()[1:] for line in started.stdout.splitlines()]
    assert streamed == [
        ["Progress", "prepare"],
        ["Progress", "approve-asks"],
        ["InputRequiredEvent"],
    ]
    code = ANSWER.format(tests=TESTS, url=url, run=run, flow="Streaming")
    killed = in_process(code, tmp_path, kill="approve")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.stdout.split() == ["ACK"]
    assert applied(tmp_path) == ["deposit", "charge-ada"]

    async def recover() -> tuple[list[str], Any]:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = None
            while handler is None:
                try:
                    handler = rt.recover(Streaming(runtime=rt), run)
                except ResumeConflict:  # the dead process's lease has not run out yet
                    await asyncio.sleep(0.1)
            notes = [
                f"{type(ev).__name__}:{getattr(ev, 'note', '')}"
                async for ev in handler.stream_events()
            ]
            return notes, await asyncio.wait_for(handler, GUARD)
        finally:
            rt.remit.close()

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    notes, result = asyncio.run(asyncio.wait_for(recover(), GUARD))
    assert result == "done"
    assert notes == [
        "Progress:approve-asks",
        "Progress:approve-answered",
        "Progress:finish",
        "StopEvent:",
    ]
    assert applied(tmp_path) == ["deposit", "charge-ada"]
    assert entered(tmp_path) == ["prepare", "approve", "approve", "approve", "finish"]


# -- a waiting step with a retry policy, killed after its answer -----------------------


class Retrying(Workflow):
    """`approve` waits for its answer, pays, and fails its first attempt after paying;
    the framework retries it (the retry finds its answer without asking again)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context, ev: StartEvent) -> Asked:
        enter("prepare")
        return Asked()

    @step(retry_policy=retry_policy(wait=wait_fixed(0), stop=stop_after_attempt(3)))
    async def approve(self, ctx: Context, ev: Asked) -> StopEvent:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="charge?"), timeout=None
        )
        enter("answered")
        paid = pay("charge-" + answer.response)
        if entered(Path(os.environ[DIR_VAR])).count("answered") == 1:
            die_at("failing attempt")
            raise RuntimeError("flaky after paying")
        die_at("retry")
        return StopEvent(result=paid)


@pytest.mark.parametrize("kill", ["failing attempt", "retry"])
def test_a_retried_waiting_step_killed_after_its_answer_pays_once(
    url: str, tmp_path: Path, kill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P5 with a step `retry_policy`: the process that answered is SIGKILLed
    after `approve` paid, in the attempt about to fail or in its retry. The recovery
    runs `approve` again with the accepted answer (not asked again, no second answer
    taken) and the charge is applied once over every attempt and the crash."""
    run = new_run()
    monkeypatch.setenv(DIR_VAR, str(tmp_path))

    async def park() -> None:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = Retrying(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            await handler.cancel_run()  # this copy stops; the stored run stays parked
        finally:
            rt.remit.close()

    asyncio.run(park())
    code = ANSWER.format(tests=TESTS, url=url, run=run, flow="Retrying")
    killed = in_process(code, tmp_path, kill=kill)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert applied(tmp_path) == ["charge-ada"]

    async def recover() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = None
            while handler is None:
                try:
                    handler = rt.recover(Retrying(runtime=rt), run)
                except ResumeConflict:
                    await asyncio.sleep(0.1)
            result = await asyncio.wait_for(handler, GUARD)
            with pytest.raises(ResumeConflict):
                await rt.respond(Retrying(runtime=rt), run, HumanResponseEvent(response="eve"))
            return result, rt.status(run)
        finally:
            rt.remit.close()

    assert asyncio.run(asyncio.wait_for(recover(), GUARD)) == ("charge-ada", "completed")
    assert applied(tmp_path) == ["charge-ada"]
    assert entered(tmp_path).count("prepare") == 1


# -- two classic questions of parallel workers, answered by racing processes -----------


class Item(Event):
    name: str


class Taken(Event):
    who: str


class TwoQuestions(Workflow):
    """Two workers of `ask` each return a question (the classic pattern); `take` pays
    for each answer; `join` ends the run with both answers."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def fan(self, ctx: Context, ev: StartEvent) -> Item | None:
        for name in ("a", "b"):
            ctx.send_event(Item(name=name))
        return None

    @step(num_workers=2)
    async def ask(self, ctx: Context, ev: Item) -> InputRequiredEvent:
        enter("ask")
        return InputRequiredEvent(prefix=ev.name)

    @step(num_workers=2)
    async def take(self, ctx: Context, ev: HumanResponseEvent) -> Taken:
        enter("take")
        return Taken(who=pay("took-" + ev.response))

    @step
    async def join(self, ctx: Context, ev: Taken) -> StopEvent | None:
        both = ctx.collect_events(ev, [Taken, Taken])
        return None if both is None else StopEvent(result=sorted(t.who for t in both))


def open_asks(rt: RemitRuntime, run: str) -> dict[str, Any]:
    """The questions the stored head of `run` has open (returned, not answered)."""
    head = rt.remit.checkpoint(run, rt.checkpoints(run)[0].checkpoint_id)
    assert head is not None
    return dict(head.metadata.get("asks") or {})


ANSWER_AT_BARRIER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes32 import TwoQuestions

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    rt.status({run!r})  # (connected before the start)
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        await rt.respond(TwoQuestions(runtime=rt), {run!r}, HumanResponseEvent(response={who!r}))
    except ResumeConflict as exc:
        print("REFUSED", exc, flush=True)
    else:
        print("ACK", flush=True)

asyncio.run(main())
"""


def test_two_classic_questions_answered_at_once_take_each_acknowledged_answer_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2 with two open asks: two processes answer at once ("x" and "y"). Each
    answer is acknowledged or refused with `ResumeConflict` (an answer racing another
    may be refused, as the README says); an acknowledged answer is taken once, a refused
    one not at all. A racer leaves once acknowledged: `rt.recover` delivers its answer;
    sent again, a refused one completes the run. The run ends with exactly the two
    answers, each paid once, and a third answer is refused."""
    run = new_run()
    monkeypatch.setenv(DIR_VAR, str(tmp_path))

    async def park() -> None:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = TwoQuestions(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            while len(open_asks(rt, run)) < 2 or rt.status(run) != "waiting":
                await asyncio.sleep(0.05)
            await handler.cancel_run()
        finally:
            rt.remit.close()

    asyncio.run(park())
    env = {**os.environ, DIR_VAR: str(tmp_path)}
    procs = {
        who: subprocess.Popen(
            [
                sys.executable,
                "-c",
                ANSWER_AT_BARRIER.format(tests=TESTS, url=url, run=run, who=who),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for who in ("x", "y")
    }
    for proc in procs.values():
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outcome = {}
    for who, proc in procs.items():
        out, err = proc.communicate(timeout=GUARD * 2)
        assert proc.returncode == 0, err
        outcome[who] = out.split()[0]
    assert set(outcome.values()) <= {"ACK", "REFUSED"} and "ACK" in outcome.values()

    async def finish() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            flow = TwoQuestions(runtime=rt)
            # A racer leaves once its answer is acknowledged: recovery delivers it.
            while True:
                try:
                    handler = rt.recover(flow, run)
                    break
                except ResumeConflict:  # a racer's claim, until its lease runs out
                    await asyncio.sleep(0.1)
            for who, said in outcome.items():
                if said == "REFUSED":
                    answer = HumanResponseEvent(response=who)
                    if handler is None:
                        await rt.respond(flow, run, answer)
                    else:  # the recovered copy is live here: send through it
                        await rt.send_event(handler, answer)
            while rt.status(run) != "completed":
                await asyncio.sleep(0.05)
            with pytest.raises(ResumeConflict):
                await rt.respond(TwoQuestions(runtime=rt), run, HumanResponseEvent(response="z"))
            return rt.result(run)
        finally:
            rt.remit.close()

    assert asyncio.run(asyncio.wait_for(finish(), GUARD)) == ["took-x", "took-y"]
    assert sorted(applied(tmp_path)) == ["took-x", "took-y"]
    assert entered(tmp_path).count("take") == 2


# -- edit_state through the handler of a parked run -------------------------------------


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)
    approved_by: str | None = None


class OrderFlow(Workflow):
    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> Asked:
        await ctx.store.set("amount", ev.get("amount", 1))
        return Asked()

    @step
    async def approve(self, ctx: Context[Order], ev: Asked) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="charge it?")
        )
        await ctx.store.set("approved_by", answer.response)
        return StopEvent(result=await ctx.store.get("amount"))


def test_edit_state_of_a_parked_run_stores_all_of_a_block_or_nothing(url: str) -> None:
    """P4 with `ctx.store.edit_state()` on a parked run's handler (a write committed at
    once): a block that raises midway, or one that leaves a value the model refuses
    (`CheckpointInvalid` naming the field), stores nothing (the head where it was, the
    live state as it was); a block that completes is one new checkpoint, and the answer
    delivered in another runtime continues with it."""

    async def go() -> None:
        run = new_run()
        rt, other = RemitRuntime(url, lease=1), RemitRuntime(url, lease=1)
        try:
            handler = OrderFlow(runtime=rt).run(run_id=run, amount=3)
            await until_parked(rt, run)
            head = rt.checkpoints(run)[0].checkpoint_id
            with pytest.raises(RuntimeError, match="midway"):
                async with handler.ctx.store.edit_state() as state:
                    state.amount = 9
                    raise RuntimeError("midway")
            with pytest.raises(CheckpointInvalid) as refused:
                async with handler.ctx.store.edit_state() as state:
                    state.amount = 7
                    state.amount = -1
            assert refused.value.field == "amount"
            assert rt.checkpoints(run)[0].checkpoint_id == head
            assert (await handler.ctx.store.get_state()).amount == 3
            assert rt.get_state(OrderFlow(runtime=rt), run).amount == 3
            async with handler.ctx.store.edit_state() as state:
                state.amount = 11
            assert [c.checkpoint_id for c in rt.checkpoints(run)][1] == head
            answered = await other.respond(
                OrderFlow(runtime=other), run, HumanResponseEvent(response="ada")
            )
            assert await asyncio.wait_for(answered, GUARD) == 11
            assert other.get_state(OrderFlow(runtime=other), run) == Order(
                amount=11, approved_by="ada"
            )
        finally:
            rt.remit.close()
            other.remit.close()

    asyncio.run(go())
