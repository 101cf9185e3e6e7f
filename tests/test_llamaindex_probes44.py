"""Round 44 of the LlamaIndex probes, on SQLite, PostgreSQL and Redis: typed events and
typed state across crashes and processes.

A run started with a `StartEvent` subclass (a nested model in it) and ended with a
`StopEvent` subclass, killed mid-run and recovered by another process, ends with the
typed result an uninterrupted run gives, read back typed by a third process; a result
the checkpoint cannot hold fails the run naming it, and stays failed for recoverers.
Three workers of one step (`num_workers=3`) writing a typed `Context[Model]` state,
each first trying a value the model refuses (caught), killed once all have paid,
recover with each item paid once and none of the refused values stored. Four
processes answering one `wait_for_event` question at once: one proceeds, the others
get a plain `ResumeConflict` (not `PauseAnswered`: nobody restored an old pause), and
a winner killed after paying is recovered without paying again. A typed state field
given a model its stored data would read back as another type (a union of models with
no discriminator, a subclass in a field of its base class, a model in an `Any` field)
is refused naming the field, instead of being silently taken as that other type.
"""

from __future__ import annotations

import asyncio
import json
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

from remit_core.errors import CheckpointInvalid, ResumeConflict
from remit_llamaindex import PauseAnswered, RemitRuntime, RunFailed

GUARD = 60
TESTS = str(Path(__file__).parent)


def new_run() -> str:
    return f"probe44-{uuid.uuid4().hex[:12]}"


async def recovered(rt: RemitRuntime, workflow: Workflow, run: str) -> Any:
    """`rt.recover`, retried while a dead process's claim has not run out yet."""
    for _ in range(GUARD * 10):
        try:
            return rt.recover(workflow, run)
        except ResumeConflict:
            await asyncio.sleep(0.1)
    raise AssertionError(f"run {run} never became recoverable")


# -- a typed start and a typed result across a crash -----------------------------------


class Address(BaseModel):
    city: str
    zip: str


class Begin(StartEvent):
    order: str
    ship_to: Address
    qty: int = Field(ge=1)


class Charged(Event):
    paid: str


class Shipped(StopEvent):
    order: str
    ship_to: Address
    charged: list[str]


class Ledger(BaseModel):
    order: str = ""
    charged: list[str] = Field(default_factory=list)


class TypedOrder(Workflow):
    """`take` charges for the order and keeps it in the typed state; `ship` pays the
    shipping and ends with a `Shipped` built from the start event and the state."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def take(self, ctx: Context[Ledger], ev: Begin) -> Charged:
        enter("take")
        paid = pay(f"{ev.order}x{ev.qty}")
        await ctx.store.set("order", ev.order)
        await ctx.store.set("charged", [paid])
        die_at("after-take")
        return Charged(paid=paid)

    @step
    async def ship(self, ctx: Context[Ledger], ev: Charged) -> Shipped:
        enter("ship")
        state = await ctx.store.get_state()
        paid = pay("ship-" + state.order)
        die_at("after-ship")
        return Shipped(
            order=state.order,
            ship_to=Address(city="Lyon", zip="69001"),
            charged=[*state.charged, paid],
        )


START_TYPED = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes44 import Address, Begin, TypedOrder

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    begin = Begin(order={order!r}, ship_to=Address(city="Lyon", zip="69001"), qty=2)
    print("RESULT", await TypedOrder(runtime=rt).run(start_event=begin, run_id={run!r}))

asyncio.run(main())
"""

READ_RESULT = """
import sys
sys.path.insert(0, {tests!r})
import test_llamaindex_probes44
from remit_llamaindex import RemitRuntime

rt = RemitRuntime({url!r}, lease=1)
result = rt.result({run!r})
print(type(result).__name__, type(result.ship_to).__name__, result.model_dump_json())
"""


@pytest.mark.parametrize("kill", ["after-take", "after-ship"])
def test_a_typed_start_and_result_survive_a_crash_and_read_back_typed_elsewhere(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str
) -> None:
    """P1, P2, P3 with a `StartEvent` subclass holding a nested model and a `StopEvent`
    subclass: the process is SIGKILLed after a step paid and wrote the typed state.
    Another process recovers the run: it ends with a `Shipped` (not a dict) whose
    nested `Address` is a model, equal to what an uninterrupted run ends with; each
    payment is made once; a third process reads `rt.result` back as the same typed
    event."""
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"
    killed = in_process(
        START_TYPED.format(tests=TESTS, url=url, run=run, order=order), tmp_path, kill
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    expected = Shipped(
        order=order,
        ship_to=Address(city="Lyon", zip="69001"),
        charged=[f"{order}x2", "ship-" + order],
    )

    async def recover() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = await recovered(rt, TypedOrder(runtime=rt), run)
            assert handler is not None
            result = await asyncio.wait_for(handler, GUARD)
            assert rt.recover(TypedOrder(runtime=rt), run) is None
            return result, rt.status(run), rt.get_state(TypedOrder(runtime=rt), run)
        finally:
            rt.remit.close()

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    result, status, state = asyncio.run(asyncio.wait_for(recover(), GUARD))
    assert status == "completed"
    assert type(result) is Shipped and type(result.ship_to) is Address
    assert result.model_dump() == expected.model_dump()
    assert isinstance(state, Ledger) and state.order == order
    assert state.charged == [f"{order}x2"]
    assert sorted(applied(tmp_path)) == sorted([f"{order}x2", "ship-" + order])
    steps = entered(tmp_path)
    assert steps.count("take") == (2 if kill == "after-take" else 1)
    assert steps.count("ship") == (2 if kill == "after-ship" else 1)

    read = subprocess.run(
        [sys.executable, "-c", READ_RESULT.format(tests=TESTS, url=url, run=run)],
        capture_output=True,
        text=True,
        timeout=GUARD * 2,
        env={**os.environ, DIR_VAR: str(tmp_path)},
    )
    assert read.returncode == 0, read.stderr
    name, inner, dumped = read.stdout.strip().split(" ", 2)
    assert (name, inner) == ("Shipped", "Address")
    assert json.loads(dumped) == json.loads(expected.model_dump_json())


def test_a_fork_of_a_typed_start_reruns_it_typed_and_ends_typed(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P3 with a `StartEvent` subclass: a fork at the run's first checkpoint (its start
    event, nothing run yet) runs `take` again on the typed `Begin`, and ends with a
    typed `Shipped`; the branch's payments are its own (once each), the main run's
    stay once each, and another process reads both results back typed."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run, order = new_run(), f"o-{uuid.uuid4().hex[:8]}"

    async def go() -> tuple[Any, Any, str]:
        rt = RemitRuntime(url, lease=1)
        try:
            begin = Begin(order=order, ship_to=Address(city="Lyon", zip="69001"), qty=2)
            main = await asyncio.wait_for(
                TypedOrder(runtime=rt).run(start_event=begin, run_id=run), GUARD
            )
            first = rt.checkpoints(run)[-1]
            fork = rt.fork(run, first.checkpoint_id, fork_token="again-" + run)
            handler = rt.recover(TypedOrder(runtime=rt), fork)
            if handler is None:
                handler = TypedOrder(runtime=rt).run(ctx=rt.context(TypedOrder(runtime=rt), fork))
            branch = await asyncio.wait_for(handler, GUARD)
            return main, branch, fork
        finally:
            rt.remit.close()

    main, branch, fork = asyncio.run(go())
    for result in (main, branch):
        assert type(result) is Shipped and type(result.ship_to) is Address
        assert result.order == order and result.charged == [f"{order}x2", "ship-" + order]
    assert sorted(applied(tmp_path)) == sorted([f"{order}x2", "ship-" + order] * 2)
    assert entered(tmp_path) == ["take", "ship", "take", "ship"]
    for which in (run, fork):
        read = subprocess.run(
            [sys.executable, "-c", READ_RESULT.format(tests=TESTS, url=url, run=which)],
            capture_output=True,
            text=True,
            timeout=GUARD * 2,
            env={**os.environ, DIR_VAR: str(tmp_path)},
        )
        assert read.returncode == 0, read.stderr
        assert read.stdout.split(" ", 2)[:2] == ["Shipped", "Address"]


# -- a result the checkpoint cannot hold -------------------------------------------------


class Bad(StopEvent):
    tags: Any


class Unholdable(Workflow):
    """Pays, then ends with a result holding a set (JSON gives back a list)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def end(self, ctx: Context, ev: StartEvent) -> Bad:
        enter("end")
        pay("before-bad-result")
        return Bad(tags={"x", "y"})


def test_a_result_the_checkpoint_cannot_hold_fails_the_run_for_every_process(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P4 on the result: a `StopEvent` subclass whose untyped field holds a set fails
    the run with `CheckpointInvalid` naming the field; the run is stored as failed,
    `rt.result` raises `RunFailed`, a recovery from another runtime runs nothing (it
    returns `None`), and the payment made before it is made once."""
    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    run = new_run()

    async def go() -> None:
        rt = RemitRuntime(url, lease=1)
        try:
            with pytest.raises(CheckpointInvalid) as caught:
                await asyncio.wait_for(Unholdable(runtime=rt).run(run_id=run), GUARD)
            assert "tags" in str(caught.value.field) and "tags" in str(caught.value)
            assert rt.status(run) == "failed"
        finally:
            rt.remit.close()
        other = RemitRuntime(url, lease=1)
        try:
            assert other.recover(Unholdable(runtime=other), run) is None
            assert other.status(run) == "failed"
            with pytest.raises(RunFailed):
                other.result(run)
        finally:
            other.remit.close()

    asyncio.run(go())
    assert applied(tmp_path) == ["before-bad-result"]
    assert entered(tmp_path) == ["end"]


# -- three workers writing a typed state, killed mid-step --------------------------------


class Tally(BaseModel):
    a: int = Field(default=0, ge=0)
    b: int = Field(default=0, ge=0)
    c: int = Field(default=0, ge=0)
    note: str = ""


class Part(Event):
    name: str
    value: int


class Counted(Event):
    name: str


class _Barrier:
    paid: set[str] = set()
    all_paid: asyncio.Event | None = None
    refused: list[str] = []


class TypedWorkers(Workflow):
    """`fan` sends three parts; `work` (three workers) first tries a negative value and
    an edit with one (both refused, caught), then pays and sets its field; once all
    three have paid they return; `join` ends with the stored state."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def fan(self, ctx: Context[Tally], ev: StartEvent) -> Part | None:
        enter("fan")
        for name, value in (("a", 1), ("b", 2), ("c", 3)):
            ctx.send_event(Part(name=name, value=value))
        return None

    @step(num_workers=3)
    async def work(self, ctx: Context[Tally], ev: Part) -> Counted:
        enter("work-" + ev.name)
        try:
            await ctx.store.set(ev.name, -ev.value)
        except CheckpointInvalid as exc:
            _Barrier.refused.append(str(exc.field))
        try:
            async with ctx.store.edit_state() as state:
                state.note = "partial-" + ev.name
                setattr(state, ev.name, -1)
        except CheckpointInvalid as exc:
            _Barrier.refused.append(str(exc.field))
        paid = pay(f"part-{ev.name}")
        await ctx.store.set(ev.name, ev.value)
        if _Barrier.all_paid is None:
            _Barrier.all_paid = asyncio.Event()
        _Barrier.paid.add(paid)
        if len(_Barrier.paid) == 3:
            die_at("all-paid")
            _Barrier.all_paid.set()
        await _Barrier.all_paid.wait()
        return Counted(name=ev.name)

    @step
    async def join(self, ctx: Context[Tally], ev: Counted) -> StopEvent | None:
        every = ctx.collect_events(ev, [Counted, Counted, Counted])
        if every is None:
            return None
        state = await ctx.store.get_state()
        return StopEvent(result=[state.a, state.b, state.c, state.note])


START_WORKERS = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes44 import TypedWorkers

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    print("RESULT", await TypedWorkers(runtime=rt).run(run_id={run!r}), flush=True)

asyncio.run(main())
"""


def test_typed_workers_killed_mid_step_store_no_refused_value_and_pay_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P1, P2, P4 with `num_workers=3` on a `Context[Model]` state: each worker's
    refused writes (a `set` and an `edit_state` changing two fields, one refused) raise
    `CheckpointInvalid` naming the field and store nothing (the edit's other field
    neither); killed once all three have paid, the run recovered by another process
    ends with what an uninterrupted run ends with, each part paid once, and neither
    the head the killed process left nor the final one holds a refused value."""
    run = new_run()
    killed = in_process(START_WORKERS.format(tests=TESTS, url=url, run=run), tmp_path, "all-paid")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert sorted(applied(tmp_path)) == ["part-a", "part-b", "part-c"]

    async def recover() -> Any:
        _Barrier.paid, _Barrier.all_paid, _Barrier.refused = set(), None, []
        rt = RemitRuntime(url, lease=1)
        try:
            flow = TypedWorkers(runtime=rt)
            states = [rt.get_state(flow, run)]  # as the killed process left it
            handler = await recovered(rt, flow, run)
            assert handler is not None
            result = await asyncio.wait_for(handler, GUARD)
            states.append(rt.get_state(flow, run))
            return result, rt.status(run), sorted(_Barrier.refused), states
        finally:
            rt.remit.close()

    monkeypatch.setenv(DIR_VAR, str(tmp_path))
    result, status, refused, states = asyncio.run(asyncio.wait_for(recover(), GUARD))
    assert (result, status) == ([1, 2, 3, ""], "completed")
    assert refused == ["a", "a", "b", "b", "c", "c"]
    assert sorted(applied(tmp_path)) == ["part-a", "part-b", "part-c"]
    assert all(isinstance(s, Tally) and s.note == "" for s in states)
    assert all(s.a >= 0 and s.b >= 0 and s.c >= 0 for s in states)
    assert (states[1].a, states[1].b, states[1].c) == (1, 2, 3)
    assert entered(tmp_path).count("fan") == 1


# -- four processes answer one wait_for_event question; the winner dies -----------------


class Approval(BaseModel):
    approved_by: str = ""


class Approve(Workflow):
    """Asks who approves (`wait_for_event`), keeps the answer in the typed state, pays."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def approve(self, ctx: Context[Approval], ev: StartEvent) -> StopEvent:
        enter("approve")
        answer = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix="who approves?")
        )
        await ctx.store.set("approved_by", answer.response)
        die_at("after-answer")
        paid = pay("approved-" + answer.response)
        die_at("after-pay")
        return StopEvent(result=paid)


ANSWER_AT_BARRIER = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from workflows.events import HumanResponseEvent
from remit_core.errors import ResumeConflict
from remit_llamaindex import RemitRuntime
from test_llamaindex_probes44 import Approve

async def main():
    rt = RemitRuntime({url!r}, lease=1)
    rt.status({run!r})
    print("READY", flush=True)
    sys.stdin.readline()
    try:
        answer = HumanResponseEvent(response={who!r})
        handler = await rt.respond(Approve(runtime=rt), {run!r}, answer)
    except ResumeConflict as exc:
        print("REFUSED", type(exc).__name__, flush=True)
    else:
        print("ACK", await handler, flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("kill", ["after-answer", "after-pay"])
def test_four_processes_answer_one_wait_and_a_winner_killed_after_paying_pays_once(
    url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: str
) -> None:
    """P5, P2 with k=4 on a `wait_for_event` question: four processes answer at once.
    The three losers get a plain `ResumeConflict` (not `PauseAnswered`: none restored
    an old pause); the winner is SIGKILLed after taking the answer (before or after
    paying); a recovery in another process
    ends the run with the winner's answer, paid once, and a fifth answer is refused."""
    run = new_run()
    monkeypatch.setenv(DIR_VAR, str(tmp_path))

    async def park() -> None:
        rt = RemitRuntime(url, lease=1)
        try:
            handler = Approve(runtime=rt).run(run_id=run)
            await until_parked(rt, run)
            await handler.cancel_run()
        finally:
            rt.remit.close()

    asyncio.run(park())
    env = {**os.environ, DIR_VAR: str(tmp_path), "LLAMAINDEX_PROBE_KILL": kill}
    racers = [f"r{i}" for i in range(4)]
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
        for who in racers
    }
    for proc in procs.values():
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
    for proc in procs.values():
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outcome: dict[str, tuple[int, list[str]]] = {}
    for who, proc in procs.items():
        out, err = proc.communicate(timeout=GUARD * 2)
        outcome[who] = (proc.returncode, out.split())
    killed = [who for who, (code, _) in outcome.items() if code == -signal.SIGKILL]
    assert len(killed) == 1, outcome
    winner = killed[0]
    assert (
        sorted(said for who, (code, said) in outcome.items() if who != winner)
        == [["REFUSED", "ResumeConflict"]] * 3
    ), outcome
    assert applied(tmp_path) == ([] if kill == "after-answer" else ["approved-" + winner])

    async def recover() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            flow = Approve(runtime=rt)
            handler = await recovered(rt, flow, run)
            assert handler is not None
            result = await asyncio.wait_for(handler, GUARD)
            with pytest.raises(ResumeConflict) as late:
                await rt.respond(Approve(runtime=rt), run, HumanResponseEvent(response="late"))
            assert not isinstance(late.value, PauseAnswered)
            return result, rt.status(run), rt.get_state(flow, run).approved_by
        finally:
            rt.remit.close()

    monkeypatch.delenv("LLAMAINDEX_PROBE_KILL", raising=False)
    assert asyncio.run(asyncio.wait_for(recover(), GUARD)) == (
        "approved-" + winner,
        "completed",
        winner,
    )
    assert applied(tmp_path) == ["approved-" + winner]


# -- a model value its field would read back as another type ----------------------------


class Animal(BaseModel):
    name: str


class Dog(Animal):
    bark: str = "woof"


class Card(BaseModel):
    amount: int


class Cash(BaseModel):
    amount: int


class Pets(BaseModel):
    how: Card | Cash | None = None
    pet: Animal | None = None
    pets: list[Animal] = Field(default_factory=list)
    anything: Any = None
    n: int = 0


class Keep(Workflow):
    """Tries one state write given by the start event's `case`, reports what it got."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(timeout=None, **kw)

    @step
    async def keep(self, ctx: Context[Pets], ev: StartEvent) -> StopEvent:
        path, value = SHAPE_CASES[ev.case]
        try:
            await ctx.store.set(path, value)
        except CheckpointInvalid as exc:
            return StopEvent(result={"refused": exc.field, "text": str(exc)})
        return StopEvent(result={"kept": repr(await ctx.store.get(path))})


SHAPE_CASES: dict[str, tuple[str, Any]] = {
    "union": ("how", Cash(amount=5)),
    "subclass": ("pet", Dog(name="rex", bark="grr")),
    "subclass-in-list": ("pets", [Animal(name="a"), Dog(name="b")]),
    "model-in-any": ("anything", Card(amount=1)),
}
SHAPE_FIELDS = {
    "union": "how",
    "subclass": "pet",
    "subclass-in-list": "pets[1]",
    "model-in-any": "anything",
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_a_model_its_field_would_read_back_as_another_type_is_refused_naming_it(
    url: str, case: str
) -> None:
    """P4: a typed state field given a model that its stored data would be read back
    as another type of (a union of models with no discriminator, a subclass in a field
    of its base class, a model in an `Any` field) is refused with `CheckpointInvalid`
    naming the field, rather than taken silently as the other type (a `Cash` turned
    into a `Card`, a `Dog` losing its `bark`); the state stays as it was, here and in
    another runtime, as `rt.update_state` of the same value is refused."""
    run = new_run()

    async def go() -> tuple[Any, Any, Any]:
        rt = RemitRuntime(url, lease=1)
        try:
            result = await asyncio.wait_for(Keep(runtime=rt).run(run_id=run, case=case), GUARD)
            path, value = SHAPE_CASES[case]
            with pytest.raises(CheckpointInvalid) as edit:
                await rt.update_state(Keep(runtime=rt), run, {path: value})
            other = RemitRuntime(url, lease=1)
            try:
                return result, edit.value, other.get_state(Keep(runtime=other), run)
            finally:
                other.remit.close()
        finally:
            rt.remit.close()

    result, edit, state = asyncio.run(go())
    assert result.get("refused") == SHAPE_FIELDS[case], result
    assert "would come back as" in result["text"]
    assert edit.field == SHAPE_FIELDS[case]
    assert state == Pets()


def test_values_in_the_form_their_model_reads_are_still_taken_as_it_reads_them(
    url: str,
) -> None:
    """The documented other side: plain data a typed field reads as its model (a dict
    for a model, digits for an int, the exact class) is taken and stored as it reads."""
    run = new_run()

    async def go() -> Any:
        rt = RemitRuntime(url, lease=1)
        try:
            await rt.update_state(
                Keep(runtime=rt),
                (await _started(rt, run)),
                {"pet": {"name": "x"}, "n": "5", "how": Card(amount=2), "pets": [Animal(name="y")]},
            )
            return rt.get_state(Keep(runtime=rt), run)
        finally:
            rt.remit.close()

    state = asyncio.run(go())
    assert state == Pets(pet=Animal(name="x"), n=5, how=Card(amount=2), pets=[Animal(name="y")])
    assert type(state.how) is Card


async def _started(rt: RemitRuntime, run: str) -> str:
    """`run` of `Keep`, ended after one refused write (its state left as it was)."""
    await asyncio.wait_for(Keep(runtime=rt).run(run_id=run, case="union"), GUARD)
    return run
