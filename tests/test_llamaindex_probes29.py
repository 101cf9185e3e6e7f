"""LlamaIndex probes, round 29, on SQLite, PostgreSQL and Redis: parked copies whose run
moved on elsewhere (a state write through their handler, a waiter's timeout firing in
them), the framework's two-question pause (`ctx.to_dict()` after each question, restored
in racing processes that answer through `handler.ctx.send_event`), a snapshot taken
while a step is in flight and restored after a SIGKILL, a typed state that refuses
values, the workflow timeout inside an effect, and a fan-out sent to named steps
SIGKILLed during its fan-in.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from llamaindex_parts import until_parked
from llamaindex_sink import DIR_VAR, applied, enter, entered, pay, payments
from pydantic import BaseModel, Field, field_validator
from workflows import Context, Workflow, step
from workflows.errors import WorkflowCancelledByUser, WorkflowTimeoutError
from workflows.events import (
    Event,
    HumanResponseEvent,
    InputRequiredEvent,
    StartEvent,
    StopEvent,
    WorkflowCancelledEvent,
    WorkflowFailedEvent,
)

from remit_core import NOT_APPLIED, effect
from remit_core.errors import CheckpointInvalid, ForkWithoutIntent, ResumeConflict
from remit_llamaindex import RemitRuntime, RunFailed
from remit_llamaindex import _snapshot as snap

TESTS = str(Path(__file__).parent)
GUARD = 60
#: A lease long enough that the parked copy's watcher (which looks at the stored head
#: once a third of it) never runs within a test: what ends the copy is the path tested.
LONG_LEASE = 600


def new_run() -> str:
    return f"probe29-{uuid.uuid4().hex[:12]}"


@contextmanager
def runtime(url: str, lease: float = 1) -> Iterator[RemitRuntime]:
    """A runtime whose store connections are closed afterwards."""
    rt = RemitRuntime(url, lease=lease)
    try:
        yield rt
    finally:
        rt.remit.close()


def run_code(code: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, DIR_VAR: str(tmp), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- a parked copy whose run moved on elsewhere ------------------------------------------


class Note(BaseModel):
    note: str = ""
    by: str | None = None


class Approval(Workflow):
    """Waits for an answer, then ends with the state it holds."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def approve(self, ctx: Context[Note], ev: StartEvent) -> StopEvent:
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        await ctx.store.set("by", answer.response)
        return StopEvent(result=(await ctx.store.get_state()).model_dump())


async def released(rt: RemitRuntime, run: str) -> None:
    """Until `run` is parked and the parking process has released its claim (a cancel,
    unlike an answer, does not wait for that release)."""
    await until_parked(rt, run)
    for _ in range(400):
        claim = await asyncio.to_thread(rt.remit.store.get_claim, run, "main")
        if claim is None or not claim.holder:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run} never released its claim")


async def move_on_elsewhere(url: str, run: str, how: str) -> None:
    """Answer (and end) or cancel `run` through another runtime, as another process would."""
    with runtime(url, lease=LONG_LEASE) as other:
        if how == "cancelled":
            await other.cancel(run)
            return
        resumed = await other.respond(
            Approval(runtime=other), run, HumanResponseEvent(response="bob")
        )
        assert await asyncio.wait_for(resumed, GUARD) == {"note": "", "by": "bob"}


@pytest.mark.parametrize("how", ["answered", "cancelled"])
def test_a_state_write_to_a_copy_whose_run_moved_on_is_refused_and_stops_it(
    store_url: str, how: str
) -> None:
    """P5, L3 of a parked copy: another runtime answered (or cancelled) the run this
    handler parked. A write through the handler's `ctx.store` is refused with
    `ResumeConflict` (the README: "another resumer holds or moved the run"), leaves the
    handler's state as it was, stores nothing, and the copy stops at once: its handler
    ends with `ResumeConflict` (`WorkflowCancelledByUser` for a cancelled run), as a
    refused answer stops it. (Before, the write raised `ForkWithoutIntent`, telling the
    user to pass a fork token, and the handler kept waiting until the parked copy's
    watcher looked at the head, a third of the lease later.)"""
    run = new_run()

    async def go() -> None:
        with runtime(store_url, lease=LONG_LEASE) as rt:
            flow = Approval(runtime=rt)
            handler = flow.run(run_id=run)
            await released(rt, run)
            await move_on_elsewhere(store_url, run, how)
            history = rt.checkpoints(run)
            with pytest.raises(ResumeConflict, match="moved on elsewhere"):
                await handler.ctx.store.set("note", "late")
            assert await handler.ctx.store.get("note") == ""
            ends = WorkflowCancelledByUser if how == "cancelled" else ResumeConflict
            with pytest.raises(ends):
                await asyncio.wait_for(handler, GUARD)
            assert rt.checkpoints(run) == history
            assert rt.status(run) == ("cancelled" if how == "cancelled" else "completed")
            assert rt.get_state(flow, run).note == ""

    asyncio.run(go())


class TimedAsk(Workflow):
    """Waits 2 s for an answer, else ends with "timed out"."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask(self, ctx: Context, ev: StartEvent) -> StopEvent:
        try:
            answer = await ctx.wait_for_event(
                HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=2
            )
        except asyncio.TimeoutError:
            return StopEvent(result="timed out")
        return StopEvent(result=answer.response)


@pytest.mark.parametrize("how", ["answered", "cancelled"])
def test_a_waiter_timeout_firing_in_a_copy_whose_run_moved_on_ends_it_as_lost(
    store_url: str, how: str
) -> None:
    """A run parked here with a timed wait is answered (or cancelled) through another
    runtime before the wait's timeout fires here. The copy left here then takes no
    decision of its own: its handler ends with `ResumeConflict` saying the run moved
    on (`WorkflowCancelledByUser` if it was cancelled), as the README says copies
    elsewhere end, its event stream ends, and it stores nothing; the stored run keeps
    the other runtime's outcome. (Before, the handler ended with `ForkWithoutIntent`,
    telling the user to pass a fork token, which no one had asked for.)"""
    run = new_run()

    async def go() -> None:
        with runtime(store_url, lease=LONG_LEASE) as rt:
            handler = TimedAsk(runtime=rt).run(run_id=run)
            await released(rt, run)
            with runtime(store_url, lease=LONG_LEASE) as other:
                if how == "cancelled":
                    await other.cancel(run)
                else:
                    resumed = await other.respond(
                        TimedAsk(runtime=other), run, HumanResponseEvent(response="bob")
                    )
                    assert await asyncio.wait_for(resumed, GUARD) == "bob"
            history = rt.checkpoints(run)
            seen: list[Event] = []

            async def stream() -> None:
                async for ev in handler.stream_events():
                    seen.append(ev)

            await asyncio.wait_for(stream(), GUARD)
            if how == "cancelled":
                with pytest.raises(WorkflowCancelledByUser):
                    await asyncio.wait_for(handler, GUARD)
                assert isinstance(seen[-1], WorkflowCancelledEvent)
            else:
                with pytest.raises(ResumeConflict, match="moved on elsewhere"):
                    await asyncio.wait_for(handler, GUARD)
                assert isinstance(seen[-1], WorkflowFailedEvent)
            assert rt.checkpoints(run) == history
            if how == "answered":
                assert (rt.status(run), rt.result(run)) == ("completed", "bob")
            else:
                assert rt.status(run) == "cancelled"

    asyncio.run(go())


# -- two questions, paused the framework's way, answered by racing processes -------------


class Question1(InputRequiredEvent):
    prefix: str


class Question2(InputRequiredEvent):
    prefix: str


class Answer1(HumanResponseEvent):
    response: str


class Answer2(HumanResponseEvent):
    response: str


class TwoQuestions(Workflow):
    """Asks twice the classic way, each question and answer of its own event class."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def ask1(self, ctx: Context, ev: StartEvent) -> Question1:
        enter("ask1")
        return Question1(prefix="first?")

    @step
    async def ask2(self, ctx: Context, ev: Answer1) -> Question2:
        enter("ask2")
        await ctx.store.set("first", pay("first-" + ev.response))
        return Question2(prefix="second?")

    @step
    async def finish(self, ctx: Context, ev: Answer2) -> StopEvent:
        enter("finish")
        return StopEvent(result=[await ctx.store.get("first"), pay("second-" + ev.response)])


ANSWER_FROM_SNAPSHOT = """
import asyncio, json, sys
sys.path.insert(0, {tests!r})
from workflows import Context
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes29 import Answer1, Answer2, Question2, TwoQuestions

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    flow = TwoQuestions(runtime=rt)
    with open({snapshot!r}) as f:
        data = json.load(f)
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        handler = flow.run(ctx=Context.from_dict(flow, data))
    except Exception as exc:
        print("REFUSED", type(exc).__name__, flush=True)
        return
    handler.ctx.send_event({answer}(response={who!r}))
    try:
        async for ev in handler.stream_events():
            if isinstance(ev, Question2):
                with open({out!r}, "w") as f:
                    json.dump(handler.ctx.to_dict(), f)
                await handler.cancel_run()
                print("PAUSED", flush=True)
                return
        print("RESULT", *await handler, flush=True)
    except Exception as exc:
        print("LOST", type(exc).__name__, flush=True)
    finally:
        rt.remit.close()

asyncio.run(main())
"""


#: What a racer that lost gets: its handler ends with `ResumeConflict` (it restored the
#: snapshot in time, and the winner consumed the answer first), or the restore itself is
#: refused, with `ResumeConflict` while the winner holds the run, or with `PauseAnswered`
#: (a `ResumeConflict` too) once the winner moved the run on from the snapshot.
LOSERS = {"LOST ResumeConflict", "REFUSED ResumeConflict", "REFUSED PauseAnswered"}


def answer_together(
    url: str, tmp: Path, snapshot: Path, answer: str, out: Path, k: int
) -> list[str]:
    """`k` processes restore `snapshot` and answer with `answer` at once (released together
    once all are ready); each one's last line."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                ANSWER_FROM_SNAPSHOT.format(
                    tests=TESTS,
                    url=url,
                    snapshot=str(snapshot),
                    answer=answer,
                    who=f"w{i}",
                    out=str(out),
                ),
            ],
            env={**os.environ, DIR_VAR: str(tmp)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(k)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("READY"), (line, p.communicate())
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    lasts = []
    for p, (stdout, stderr) in zip(procs, outs, strict=True):
        assert p.returncode == 0, (stdout, stderr)
        lasts.append(stdout.splitlines()[-1])
    return lasts


def test_two_questions_paused_the_frameworks_way_and_answered_by_racing_processes(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shape of a user-reported failure (a restored context re-launched a step in
    progress), with subclassed question and answer events: the run is paused after each
    question (`ctx.to_dict()` to a file, `cancel_run()`), and four processes restore
    that file (`Context.from_dict`) and answer through `handler.ctx.send_event` at once.
    Each round exactly one proceeds; each other one runs nothing (its handler ends with
    `ResumeConflict`, or its restore is refused with `PauseAnswered`, a `ResumeConflict`
    too, once the run moved on).
    Every step is entered once, each answer is paid once with the winner's value, and
    the first round's file, restored again, is refused as a fork."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    first = tmp_path / "first.json"
    second = tmp_path / "second.json"

    async def start() -> None:
        with runtime(store_url) as rt:
            handler = TwoQuestions(runtime=rt).run(run_id=run)
            async for ev in handler.stream_events():
                if isinstance(ev, Question1):
                    break
            first.write_text(json.dumps(handler.ctx.to_dict()))
            await handler.cancel_run()

    asyncio.run(start())
    lasts = answer_together(store_url, tmp_path, first, "Answer1", second, 4)
    assert lasts.count("PAUSED") == 1 and set(lasts) <= LOSERS | {"PAUSED"}, lasts
    won1 = [line.split()[1] for line in payments(tmp_path)]
    assert len(won1) == 1 and won1[0].startswith("first-w"), payments(tmp_path)

    lasts = answer_together(store_url, tmp_path, second, "Answer2", tmp_path / "none", 4)
    results = [line for line in lasts if line.startswith("RESULT")]
    assert len(results) == 1 and set(lasts) - set(results) <= LOSERS, lasts
    _, paid_first, paid_second = results[0].split()
    assert paid_first == won1[0] and paid_second.startswith("second-w")
    assert applied(tmp_path) == [paid_first, paid_second]
    assert entered(tmp_path) == ["ask1", "ask2", "finish"]

    async def again() -> None:
        with runtime(store_url) as rt:
            assert rt.status(run) == "completed"
            assert rt.result(run) == [paid_first, paid_second]
            flow = TwoQuestions(runtime=rt)
            with pytest.raises(ForkWithoutIntent):
                flow.run(ctx=Context.from_dict(flow, json.loads(first.read_text())))

    asyncio.run(again())
    assert entered(tmp_path) == ["ask1", "ask2", "finish"]


# -- a snapshot taken while a step is in flight, restored after a SIGKILL ----------------


class Prepared(Event):
    pass


class Progress(Event):
    what: str


class Charging(Workflow):
    """`prepare`, then `charge`: it streams `Progress`, waits until the snapshot file the
    driver writes on seeing it exists, and pays."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context, ev: StartEvent) -> Prepared:
        enter("prepare")
        await ctx.store.set("order", ev.get("order"))
        return Prepared()

    @step
    async def charge(self, ctx: Context, ev: Prepared) -> StopEvent:
        enter("charge")
        ctx.write_event_to_stream(Progress(what="charging"))
        taken = Path(os.environ[DIR_VAR]) / "snapshot.json"
        while not taken.exists():
            await asyncio.sleep(0.02)
        return StopEvent(result=pay("charge-" + await ctx.store.get("order")))


SNAPSHOT_IN_FLIGHT = """
import asyncio, json, os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes29 import Charging, Progress

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    handler = Charging(runtime=rt).run(run_id={run!r}, order="o-1")
    async for ev in handler.stream_events():
        if isinstance(ev, Progress):
            folder = Path(os.environ["{dir_var}"])
            (folder / "snapshot.tmp").write_text(json.dumps(handler.ctx.to_dict()))
            (folder / "snapshot.tmp").rename(folder / "snapshot.json")
    print("RESULT", await handler, flush=True)

asyncio.run(main())
"""


def test_a_snapshot_taken_while_a_step_runs_restores_after_a_sigkill_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P3 through the framework's snapshot: `ctx.to_dict()` is taken while
    `charge` is in flight (on a stream event it writes), then the process is SIGKILLed
    right after `charge` paid. Restored from that file in another process
    (`Context.from_dict`, once the dead process's lease ran out), the run re-runs only
    `charge` (in flight), which finds its payment in the ledger; `prepare` is not run
    again; the restored handler's stream shows what the re-run wrote, then the end.
    The same file restored once more is a fork, refused."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    dead = run_code(
        SNAPSHOT_IN_FLIGHT.format(tests=TESTS, url=store_url, run=run, dir_var=DIR_VAR),
        tmp_path,
        REMIT_FAILPOINTS="effect.after_apply=kill",
    )
    assert dead.returncode == -9, (dead.stdout, dead.stderr)
    assert entered(tmp_path) == ["prepare", "charge"]
    assert applied(tmp_path) == ["charge-o-1"]
    data = json.loads((tmp_path / "snapshot.json").read_text())
    assert data["is_running"] and data["state"]["run_id"] == run

    async def restore() -> None:
        with runtime(store_url) as rt:
            flow = Charging(runtime=rt)
            for _ in range(400):
                try:
                    handler = flow.run(ctx=Context.from_dict(flow, data))
                    break
                except ResumeConflict:  # (the dead process's claim, until its lease ends)
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("never restored")
            seen = [type(ev).__name__ async for ev in handler.stream_events()]
            assert await asyncio.wait_for(handler, GUARD) == "charge-o-1"
            assert seen == ["Progress", "StopEvent"], seen
            assert rt.status(run) == "completed"
            with pytest.raises(ForkWithoutIntent):
                flow.run(ctx=Context.from_dict(flow, data))

    asyncio.run(restore())
    assert entered(tmp_path) == ["prepare", "charge", "charge"]
    assert applied(tmp_path) == ["charge-o-1"]


# -- a typed state that refuses values -------------------------------------------------


class Order(BaseModel):
    amount: int = Field(default=0, ge=0)
    note: str = ""
    tags: list[str] = Field(default_factory=list)
    approved_by: str | None = None

    @field_validator("note")
    @classmethod
    def _no_void(cls, value: str) -> str:
        if value == "void":
            raise ValueError("an order cannot be voided here")
        return value


REFUSED: list[tuple[str, str | None]] = []


class Typed(Workflow):
    """`prepare` makes five writes the model refuses (each caught), then waits; the
    answer is written and the run ends with the state."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def prepare(self, ctx: Context[Order], ev: StartEvent) -> StopEvent:
        await ctx.store.set("amount", 5)
        await ctx.store.set("tags", ["a"])

        async def edit() -> None:
            async with ctx.store.edit_state() as state:
                state.tags.append("b")
                state.amount = -9

        writes = {
            "set": lambda: ctx.store.set("amount", -1),
            "validator": lambda: ctx.store.set("note", "void"),
            "type": lambda: ctx.store.set("tags", "not a list"),
            "constructed": lambda: ctx.store.set_state(Order.model_construct(amount=-2)),
            "edit": edit,
        }
        for name, write in writes.items():
            try:
                await write()
                REFUSED.append((name, "accepted"))
            except CheckpointInvalid as exc:
                REFUSED.append((name, exc.field))
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="ok?"), timeout=None
        )
        await ctx.store.set("approved_by", answer.response)
        return StopEvent(result=(await ctx.store.get_state()).model_dump())


def test_values_a_typed_state_refuses_leave_it_as_it_was_across_a_resume(
    store_url: str,
) -> None:
    """P4: inside a step, five writes the `Context[Order]` model refuses (`set`, a
    field validator, a wrong type, `set_state` of a `model_construct`, an `edit_state`
    block that also changed a list in place) each raise `CheckpointInvalid` naming the
    field; the step catches them and goes on. The run resumed by another runtime
    continues from the state before the refusals, with none of the block's changes,
    and no stored checkpoint of the run holds a value the model refuses."""
    run = new_run()
    REFUSED.clear()

    async def go() -> None:
        with runtime(store_url) as rt:
            Typed(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            with runtime(store_url) as other:
                flow = Typed(runtime=other)
                resumed = await other.respond(flow, run, HumanResponseEvent(response="ada"))
                result = await asyncio.wait_for(resumed, GUARD)
                assert result == {"amount": 5, "note": "", "tags": ["a"], "approved_by": "ada"}
                for c in other.checkpoints(run):
                    record = other.remit.checkpoint(run, c.checkpoint_id)
                    assert record is not None
                    fields = snap.state_fields(snap.decode(record.state).get("state") or {})
                    Order.model_validate(fields or {})

    asyncio.run(go())
    # (The framework runs the waiting step again from its top when its answer arrives.)
    assert (
        REFUSED
        == [
            ("set", "amount"),
            ("validator", "note"),
            ("type", "tags"),
            ("constructed", "amount"),
            ("edit", "amount"),
        ]
        * 2
    )


# -- the workflow timeout inside an effect ---------------------------------------------

INSIDE = threading.Event()
RELEASE = threading.Event()


def _paid(key: str) -> Any:
    hits = [line for line in payments(Path(os.environ[DIR_VAR])) if line.split()[0] == key]
    return hits[0].split()[1] if hits else NOT_APPLIED


@effect(reconcile=_paid)
def slow_pay(what: str, *, idempotency_key: str) -> str:
    """Pays, then holds until released: the workflow's timeout fires meanwhile."""
    with (Path(os.environ[DIR_VAR]) / "sink.txt").open("a") as f:
        f.write(f"{idempotency_key} {what}\n")
    INSIDE.set()
    RELEASE.wait(GUARD)
    return what


class Shop(Workflow):
    @step
    async def prepare(self, ev: StartEvent) -> Prepared:
        enter("prepare")
        return Prepared()

    @step
    async def charge(self, ev: Prepared) -> StopEvent:
        enter("charge")
        return StopEvent(result=await asyncio.to_thread(slow_pay, "order"))


def test_the_workflow_timeout_inside_an_effect_ends_the_run_and_recovery_runs_nothing(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2: the workflow's `timeout` fires while `charge` is inside its effect (run off
    the event loop, so it goes on after the timeout). The handler raises the
    framework's `WorkflowTimeoutError`; the run is committed as failed, and stays so
    once the effect returns; `rt.recover` runs nothing and `rt.result` raises
    `RunFailed` naming the timeout; the effect was applied once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    INSIDE.clear()
    RELEASE.clear()
    run = new_run()

    async def go() -> None:
        with runtime(store_url) as rt:
            handler = Shop(runtime=rt, timeout=1).run(run_id=run)
            assert await asyncio.to_thread(INSIDE.wait, GUARD)
            with pytest.raises(WorkflowTimeoutError):
                await asyncio.wait_for(handler, GUARD)
            assert rt.status(run) == "failed"
            history = rt.checkpoints(run)
            RELEASE.set()
            with runtime(store_url) as other:
                assert other.recover(Shop(runtime=other, timeout=None), run) is None
                with pytest.raises(RunFailed, match="WorkflowTimeoutError"):
                    other.result(run)
                assert other.checkpoints(run) == history

    try:
        asyncio.run(go())
    finally:
        RELEASE.set()
    assert entered(tmp_path) == ["prepare", "charge"]
    assert applied(tmp_path) == ["order"]


# -- a fan-out sent to named steps, SIGKILLed during its fan-in ----------------------------


class Item(Event):
    i: int


class Extra(Event):
    pass


class Done(Event):
    i: int
    paid: str


class Side(Event):
    paid: str


class Named(Workflow):
    """`start` sends four `Item`s to `work` (four workers) and one `Extra` to `side`, each
    with `step=`; `join` collects the `Side` and the four `Done`, and pays for the lot."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def start(self, ctx: Context, ev: StartEvent) -> Item | Extra | None:
        enter("start")
        for i in range(4):
            ctx.send_event(Item(i=i), step="work")
        ctx.send_event(Extra(), step="side")
        return None

    @step(num_workers=4)
    async def work(self, ctx: Context, ev: Item) -> Done:
        enter(f"work{ev.i}")
        return Done(i=ev.i, paid=await asyncio.to_thread(pay, f"item{ev.i}"))

    @step
    async def side(self, ctx: Context, ev: Extra) -> Side:
        enter("side")
        return Side(paid=pay("side"))

    @step
    async def join(self, ctx: Context, ev: Done | Side) -> StopEvent | None:
        got = ctx.collect_events(ev, [Side, Done, Done, Done, Done])
        if got is None:
            return None
        return StopEvent(result=pay("all:" + "+".join(sorted(e.paid for e in got))))


NAMED_RESULT = "all:item0+item1+item2+item3+side"

START_NAMED = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes29 import Named

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    print("RESULT", await Named(runtime=rt).run(run_id={run!r}), flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize(
    "point",
    [
        "step.after=kill@2",
        "step.after=kill@6",
        "effect.after_apply=kill@3",
        "checkpoint.after_commit=kill@7",
    ],
)
def test_a_fan_out_sent_to_named_steps_killed_during_its_fan_in_pays_each_once(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    """P1, P2, P6: events sent with `step=` to a four-worker step and to another step,
    collected by one `collect_events` of two types; the process is SIGKILLed after some
    workers completed (or paid, or a checkpoint was committed). Recovered in
    another process, the run ends with every item once; each payment was applied once;
    no worker that completed before the crash and no `start` runs again."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()
    dead = run_code(
        START_NAMED.format(tests=TESTS, url=store_url, run=run), tmp_path, REMIT_FAILPOINTS=point
    )
    assert dead.returncode == -9, (dead.stdout, dead.stderr)
    before = entered(tmp_path)
    paid_before = applied(tmp_path)

    async def recover() -> Any:
        with runtime(store_url) as rt:
            flow = Named(runtime=rt)
            for _ in range(400):
                try:
                    handler = rt.recover(flow, run)
                    break
                except ResumeConflict:  # (the dead process's claim, until its lease ends)
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError("never recovered")
            assert handler is not None
            return await asyncio.wait_for(handler, GUARD)

    assert asyncio.run(recover()) == NAMED_RESULT
    assert sorted(applied(tmp_path)) == sorted(
        [NAMED_RESULT, "side", *(f"item{i}" for i in range(4))]
    )
    after = entered(tmp_path)[len(before) :]
    assert "start" not in after, (before, after)
    # A worker runs again at most once (if it was in flight at the crash); one that had
    # not started runs once.
    for i in range(4):
        name = f"work{i}"
        assert after.count(name) in ({0, 1} if name in before else {1}), (before, after)
    assert applied(tmp_path)[: len(paid_before)] == paid_before
