"""LlamaIndex probes, round 13, on SQLite, PostgreSQL and Redis: a step that waits
twice in one execution (its first answer is kept by a resolved waiter, which a
checkpoint stored without its `requirements`: restored elsewhere, the second answer
was refused as a second response to the first waiter, and a crash while the step ran
again after its first answer ran the step twice on recovery), the framework's list
fan-out and fan-in (`-> list[E]`, `list[E]`, `Collect(Take(n))`) SIGKILLed in a
worker, approvals of the workers of a fan-out raced by processes behind a barrier
(a loser was refused naming another item's interrupt), a start event that fails
its own model, and the workflow timeout firing while a worker is in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay, payments
from pydantic import Field
from test_llamaindex_probes10 import recovered
from test_llamaindex_probes11 import run_driver
from workflows import Context, Workflow, step
from workflows.collect import Collect, Take
from workflows.errors import WorkflowCancelledByUser, WorkflowTimeoutError
from workflows.events import Event, InputRequiredEvent, StartEvent, StopEvent

from remit_core.errors import CheckpointInvalid, ResumeConflict
from remit_llamaindex import RemitRuntime

GUARD = 30
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe13-{uuid.uuid4().hex[:12]}"


def crash_here(point: str) -> None:
    if os.environ.get("PROBE13_CRASH") == point:
        os.kill(os.getpid(), signal.SIGKILL)


async def parked_at(rt: RemitRuntime, run: str, *asked: str, gone: str = "") -> None:
    """Until the run's head waits for an answer naming each of `asked` (and none naming
    `gone`), with its claim given up: parked there, any process may answer it."""
    deadline = time.monotonic() + GUARD
    while True:
        heads = await asyncio.to_thread(rt.checkpoints, run) if rt.remit.branch(run) else []
        waiting = heads[0].waiting if heads else ()
        here = all(any(f'"{a}"' in w for w in waiting) for a in asked)
        if here and not (gone and any(f'"{gone}"' in w for w in waiting)):
            claim = await asyncio.to_thread(rt.remit.store.get_claim, run, "main")
            if claim is None or not claim.holder:
                return
        assert time.monotonic() < deadline, f"the run did not park at {asked}"
        await asyncio.sleep(0.05)


# -- one step that waits twice ---------------------------------------------------------


class Ans(Event):
    q: str
    v: str


class TwoAsks(Workflow):
    """`ask` waits for the answer to "a" and pays for it, then, in the same execution,
    waits for the answer to "b" (`requirements` tell the two apart) and pays for that.
    The framework runs the step again from its top after each answer: the first wait
    then returns the answer its resolved waiter keeps."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        enter("ask")
        a = await ctx.wait_for_event(
            Ans, waiter_event=InputRequiredEvent(prefix="a"), requirements={"q": "a"}, timeout=None
        )
        crash_here("after-a")
        paid_a = pay(f"a:{a.v}")
        b = await ctx.wait_for_event(
            Ans, waiter_event=InputRequiredEvent(prefix="b"), requirements={"q": "b"}, timeout=None
        )
        return StopEvent(result=[paid_a, pay(f"b:{b.v}")])


RESTORE_DRIVER = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
from workflows import Context
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes13 import Ans, TwoAsks

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = TwoAsks(runtime=rt)
    with open({snapshot!r}) as f:
        handler = flow.run(ctx=Context.from_dict(flow, json.load(f)))
    await rt.send_event(handler, Ans(q="b", v="B"))
    print("RESULT", *await asyncio.wait_for(handler, 30), flush=True)
    try:
        await rt.respond(flow, {run!r}, Ans(q="b", v="B2"))
    except ResumeConflict as exc:
        print("REFUSED", exc.interrupt_id, flush=True)

asyncio.run(main())
"""


def test_a_step_that_waits_twice_takes_its_second_answer_in_another_process(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, cell 8 within one step: "a" is answered here, then the run is paused the
    framework's way (`ctx.to_dict()` to a JSON file, `cancel_run()`). Another process
    restores the snapshot (`Context.from_dict`) and answers "b": the run finishes with
    both answers, each paid once; a second answer to "b" is refused naming b's
    interrupt. (Before, the restored waiter of "a" had lost its requirements, so the
    answer to "b" also resolved it and was refused as a second response to "a": the
    run could never go on.)"""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    snapshot = tmp_path / "snapshot.json"

    async def first_answer() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = TwoAsks(runtime=rt).run(run_id=run)
        await parked_at(rt, run, "a")
        await rt.send_event(handler, Ans(q="a", v="A"))
        await parked_at(rt, run, "b", gone="a")
        snapshot.write_text(json.dumps(handler.ctx.to_dict()))
        await handler.cancel_run()
        with pytest.raises(WorkflowCancelledByUser):
            await asyncio.wait_for(handler, GUARD)

    asyncio.run(first_answer())
    code = RESTORE_DRIVER.format(tests=TESTS, url=store_url, run=run, snapshot=str(snapshot))
    done = run_driver(code, tmp_path)
    lines = done.stdout.splitlines()
    assert lines[:1] == ["RESULT a:A b:B"], (done.stdout, done.stderr)
    assert len(lines) == 2 and lines[1].startswith("REFUSED ") and '"q":"b"' in lines[1], lines
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed" and rt.result(run) == ["a:A", "b:B"]
    assert applied(tmp_path) == ["a:A", "b:B"]
    assert entered(tmp_path) == ["ask"] * 3


CRASH_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes13 import Ans, TwoAsks, parked_at

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = TwoAsks(runtime=rt).run(run_id={run!r})
    await parked_at(rt, {run!r}, "a")
    await rt.send_event(handler, Ans(q="a", v="A"))
    await asyncio.wait_for(handler, 30)

asyncio.run(main())
"""


def test_a_crash_in_the_rerun_after_a_first_answer_reruns_the_step_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, L1: the process that answered "a" is SIGKILLed while `ask` runs again
    on that answer. Recovery runs the step once more (it was in flight), not twice,
    and parks at "b"; answered here, the run pays each answer once. (Before, the
    restored resolved waiter had no requirements, so the framework ran the step once
    for it beside the re-run of the step in flight.)"""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    code = CRASH_DRIVER.format(tests=TESTS, url=store_url, run=run)
    dead = run_driver(code, tmp_path, PROBE13_CRASH="after-a")
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)
    assert entered(tmp_path) == ["ask", "ask"] and applied(tmp_path) == []

    async def take_over() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, TwoAsks(runtime=rt), run)
        assert handler is not None
        await parked_at(rt, run, "b", gone="a")
        await asyncio.sleep(0.3)  # (a second run of the step would have entered by now)
        assert entered(tmp_path) == ["ask"] * 3
        await rt.send_event(handler, Ans(q="b", v="B"))
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(take_over()) == ["a:A", "b:B"]
    assert entered(tmp_path) == ["ask"] * 4
    assert applied(tmp_path) == ["a:A", "b:B"]


# -- the framework's list fan-out and fan-in -------------------------------------------


class Item(Event):
    name: str


class Paid(Event):
    name: str


class Chosen(Event):
    names: list[str]


class Every(Event):
    names: list[str]


class FanOut(Workflow):
    """`split` returns one `Item` per name of the start event (a collection stream)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def split(self, ctx: Context, ev: StartEvent) -> list[Item]:
        enter("split")
        return [Item(name=name) for name in ev.get("names")]


class Split(FanOut):
    """Three `work` workers pay for each item of `split`, "a" first, "c" last; `first`
    fires on the second `Paid` (`Collect(Take(2))`), `every` once the stream closes
    (`list[Paid]`); `finish` gathers both."""

    @step(num_workers=3)
    async def work(self, ctx: Context, ev: Item) -> Paid:
        enter(f"work:{ev.name}")
        await asyncio.sleep({"a": 0.0, "b": 0.2}.get(ev.name, 1.0))
        paid = pay(ev.name)
        crash_here(f"work:{ev.name}")
        return Paid(name=paid)

    @step
    async def first(self, ctx: Context, got: Annotated[list[Paid], Collect(Take(2))]) -> Chosen:
        enter("first")
        return Chosen(names=sorted(p.name for p in got))

    @step
    async def every(self, ctx: Context, got: list[Paid]) -> Every:
        enter("every")
        return Every(names=sorted(p.name for p in got))

    @step
    async def finish(self, ctx: Context, ev: Chosen | Every) -> StopEvent | None:
        got = ctx.collect_events(ev, [Chosen, Every])
        if got is None:
            return None
        enter("finish")
        return StopEvent(result=[e.names for e in got])


SPLIT_DRIVER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes13 import Split

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    await Split(runtime=rt).run(run_id={run!r}, names=["a", "b", "c"])

asyncio.run(main())
"""


def test_a_list_fan_out_killed_in_a_worker_fires_each_fan_in_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2 with collection streams: the worker of "c" is SIGKILLed after paying, once
    "a" and "b" were paid and `first` (`Take(2)`) had fired on them. Recovery in this
    process runs only that worker again, then `every` and `finish`: `split` and
    `first` are not entered again, every item is paid once, and both fan-ins hold
    what they held in an uninterrupted run."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    dead = run_driver(
        SPLIT_DRIVER.format(tests=TESTS, url=store_url, run=run), tmp_path, PROBE13_CRASH="work:c"
    )
    assert dead.returncode == -signal.SIGKILL, (dead.stdout, dead.stderr)
    before = entered(tmp_path)
    assert sorted(before) == ["first", "split", "work:a", "work:b", "work:c"]

    async def take_over() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        handler = await recovered(rt, Split(runtime=rt), run)
        assert handler is not None
        return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(take_over()) == [["a", "b"], ["a", "b", "c"]]
    assert entered(tmp_path)[len(before) :] == ["work:c", "every", "finish"]
    assert sorted(applied(tmp_path)) == ["a", "b", "c"]
    keys = [line.split()[0] for line in payments(tmp_path)]
    assert len(set(keys)) == 3


# -- approvals of a fan-out's workers, raced by processes ------------------------------


class Approve(Event):
    name: str
    by: str


class Review(FanOut):
    """Each `review` worker waits for the `Approve` of its own item of `split`
    (`requirements`) inside the stream, then pays for it; `join` returns what was
    paid once the stream closes."""

    @step(num_workers=3)
    async def review(self, ctx: Context, ev: Item) -> Paid:
        enter(f"review:{ev.name}")
        ok = await ctx.wait_for_event(
            Approve,
            waiter_event=InputRequiredEvent(prefix=ev.name),
            requirements={"name": ev.name},
            timeout=None,
        )
        return Paid(name=pay(f"{ev.name}:{ok.by}"))

    @step
    async def join(self, ctx: Context, got: list[Paid]) -> StopEvent:
        enter("join")
        return StopEvent(result=sorted(p.name for p in got))


APPROVE_DRIVER = """
import asyncio, sys, time
sys.path.insert(0, {tests!r})
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes13 import Approve, Review, parked_at

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    rt.remit
    flow = Review(runtime=rt)
    while time.time() < {at!r}:
        time.sleep(0.001)
    deadline = time.monotonic() + 30
    while True:
        try:
            await rt.respond(flow, {run!r}, Approve(name={name!r}, by={by!r}))
            break
        except ResumeConflict as exc:
            if exc.interrupt_id is not None:  # (its interrupt was consumed: it lost)
                print("REFUSED", exc.interrupt_id, flush=True)
                return
            assert time.monotonic() < deadline, exc
            await asyncio.sleep(0.1)  # (another racer moved the run on: try again)
    print("WON", flush=True)
    # (Exit once this copy has parked the run again, or ended it: not mid-step.)
    while rt.status({run!r}) != "completed":
        try:
            await asyncio.wait_for(parked_at(rt, {run!r}, gone={name!r}), 1)
            break
        except asyncio.TimeoutError:
            pass

asyncio.run(main())
"""


def test_approvals_of_fan_out_workers_raced_by_processes_are_each_taken_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P5, P2 with waiters inside a collection stream: the three workers of a parked
    fan-out wait for their own approval. Four processes answer at the same instant,
    two of them for "a" (by two people), one each for "b" and "c"; a racer that finds
    the run moved on by another tries again. Of the two for "a" exactly one wins and
    the other is refused naming a's interrupt; "b" and "c" are taken; the run ends
    with the winner's approval of "a"; every item is paid once; each worker ran
    twice (its wait, its re-run on the answer) and `split`, `join` once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def park() -> None:
        rt = RemitRuntime(store_url, lease=1)
        handler = Review(runtime=rt).run(run_id=run, names=["a", "b", "c"])
        await parked_at(rt, run, "a", "b", "c")
        await handler.cancel_run()  # (stops this copy; the stored run stays parked)

    asyncio.run(park())
    at = time.time() + 3
    racers = [("a", "ann"), ("a", "bob"), ("b", "cy"), ("c", "di")]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                APPROVE_DRIVER.format(tests=TESTS, url=store_url, run=run, name=n, by=b, at=at),
            ],
            env={**os.environ, DIR_VAR: str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n, b in racers
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    results = [out.strip() for out, _ in outs]
    assert results[2:] == ["WON", "WON"], outs
    assert sorted(results[:2])[1] == "WON", outs
    loser = sorted(results[:2])[0]
    assert loser.startswith("REFUSED ") and '"name":"a"' in loser, outs
    by = racers[results.index("WON")][1]
    rt = RemitRuntime(store_url)
    assert rt.status(run) == "completed"
    assert rt.result(run) == sorted([f"a:{by}", "b:cy", "c:di"])
    assert sorted(applied(tmp_path)) == sorted([f"a:{by}", "b:cy", "c:di"])
    assert sorted(entered(tmp_path)) == sorted(
        ["split", "join", *[f"review:{n}" for n in "abc"] * 2]
    )

    async def again() -> None:
        for name in "ca":
            with pytest.raises(ResumeConflict) as refused:
                await rt.respond(Review(runtime=rt), run, Approve(name=name, by="zed"))
            assert f'"name":"{name}"' in (refused.value.interrupt_id or ""), refused.value

    asyncio.run(again())
    assert len(applied(tmp_path)) == 3


# -- bad input, and the workflow timeout -------------------------------------------------


class Begin(StartEvent):
    order_id: str
    amount: int = Field(ge=0)


class Charge(Workflow):
    """One step pays for the amount its typed start event carries."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def charge(self, ctx: Context, ev: Begin) -> StopEvent:
        enter("charge")
        return StopEvent(result=pay(f"{ev.order_id}:{ev.amount}"))


def test_a_start_event_that_fails_its_own_model_is_refused_naming_the_field(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P4 at the run's input: a typed start event whose field was assigned a value its
    model refuses (`ge=0`; the framework's events do not validate assignments) is
    refused with `CheckpointInvalid` naming that field, before anything is stored or
    run; the run id stays free, and the run then starts with a valid event."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> Any:
        rt = RemitRuntime(store_url, lease=1)
        flow = Charge(runtime=rt)
        bad = Begin(order_id="o-1", amount=5)
        bad.amount = -5
        with pytest.raises(CheckpointInvalid) as refused:
            await flow.run(run_id=run, start_event=bad)
        assert refused.value.field == "Begin.amount" and refused.value.run_id == run
        assert "greater than or equal to 0" in str(refused.value)
        assert rt.remit.branch(run) is None and entered(tmp_path) == []
        return await flow.run(run_id=run, start_event=Begin(order_id="o-1", amount=5))

    assert asyncio.run(go()) == "o-1:5"
    assert applied(tmp_path) == ["o-1:5"] and entered(tmp_path) == ["charge"]


class Slow(Workflow):
    """`split` fans out "a" and "b"; the worker of "a" pays at once, the one of "b"
    takes longer than the run's timeout before it would pay."""

    @step
    async def split(self, ctx: Context, ev: StartEvent) -> list[Item]:
        return [Item(name=name) for name in ev.get("names")]

    @step(num_workers=2)
    async def work(self, ctx: Context, ev: Item) -> Paid:
        enter(f"work:{ev.name}")
        if ev.name != "a":
            await asyncio.sleep(30)
        return Paid(name=pay(ev.name))

    @step
    async def join(self, ctx: Context, got: list[Paid]) -> StopEvent:
        enter("join")
        return StopEvent(result=sorted(p.name for p in got))


def test_a_run_timed_out_with_a_worker_in_flight_stays_ended_everywhere(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workflow timeout fires while the worker of "b" is in flight: the handler
    raises `WorkflowTimeoutError` and the run's head records it as failed. Another
    runtime (as another process would) recovers nothing and gets a `ResumeConflict`
    for an event; "b" is never paid and no step runs again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(store_url, lease=1)
        with pytest.raises(WorkflowTimeoutError):
            await Slow(timeout=1.0, runtime=rt).run(run_id=run, names=["a", "b"])
        other = RemitRuntime(store_url, lease=1)
        assert other.status(run) == "failed"
        assert other.checkpoints(run)[0].next_steps == ()
        assert other.recover(Slow(timeout=None, runtime=other), run) is None
        with pytest.raises(ResumeConflict):
            await other.respond(Slow(timeout=None, runtime=other), run, Item(name="c"))
        await asyncio.sleep(0.3)

    asyncio.run(go())
    assert applied(tmp_path) == ["a"]
    assert sorted(entered(tmp_path)) == ["work:a", "work:b"]
