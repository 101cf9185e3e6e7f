"""Round 48 of the CrewAI probes: a `kickoff_async` and a `kickoff` in two processes
starting one new flow id at once (held mid-flow, every wait bounded), `from_pending`
raced by k processes, method-level `@persist` beside the class's, a router loop
SIGKILLed and restarted, and model states a save must refuse.

Written from the contract (P1, P2: nothing durably done is done again; P4: a state is
stored exactly or refused; P5: one of k resumers proceeds; liveness: nothing hangs)
and CrewAI's public API, against real CrewAI flows in forked children, with the
helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import sink_effect
from test_crewai_flows import applied, child, entered, run

from remit_core.conformance.processes import Barrier, Outcome, Worker, reap
from remit_core.conformance.world import EffectSink, Journal, WorldDB

#: The longest any wait of these probes may take: past it the probe fails, never hangs.
PATIENCE = 60.0


def held_flow(url: str, world: Path, gate: Path) -> type[Any]:
    """begin (effect "open", then waits for `gate` to exist, at most PATIENCE) -> end
    (effect "close"); a model state. Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    open_, close = sink_effect(sink, "open"), sink_effect(sink, "close")

    class Ticket(BaseModel):
        opened: str | None = None
        closed: str | None = None

    @persist(RemitFlowPersistence(url))
    class HeldFlow(Flow[Ticket]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")
            self.state.opened = open_()
            deadline = time.monotonic() + PATIENCE
            while not gate.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("the gate never opened")
                time.sleep(0.02)

        @listen(begin)
        def end(self) -> None:
            journal.record("enter", "end")
            self.state.closed = close()

    return HeldFlow


def first_to_end(workers: list[Worker], timeout: float) -> tuple[Worker, Outcome] | None:
    """The first worker to end and how, or None if none ended within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in workers:
            if (o := w.poll()) is not None:
                return w, o
        time.sleep(0.01)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("attempt", range(3))
def test_kickoff_async_and_kickoff_of_one_new_flow_id_in_two_processes(
    url: str, world: Path, attempt: int
) -> None:
    """P5, P2, liveness: two processes start one new flow id behind a barrier, one with
    `await kickoff_async(inputs={"id": X})`, one with `kickoff(inputs={"id": X})`. The
    one that claims X is held in its first method (after its effect) until the other
    ended: that one gets `ResumeConflict` having run nothing. The gate then opens and
    the flow ends once; each effect is applied once, and a later kickoff of X runs
    nothing. Every wait is bounded: a hang fails the probe."""
    flow_id = f"new-{uuid.uuid4().hex}"
    gate = world.parent / "gate"
    barrier = Barrier(2)

    def racer(asynchronous: bool) -> Any:
        def body() -> Any:
            flow = held_flow(url, world, gate)(suppress_flow_events=True)
            barrier.wait()
            if asynchronous:
                asyncio.run(flow.kickoff_async(inputs={"id": flow_id}))
            else:
                flow.kickoff(inputs={"id": flow_id})
            return {"async": asynchronous, "state": flow.state.model_dump()}

        return body

    workers = [child(racer(flag), barrier=barrier) for flag in (True, False)]
    try:
        assert barrier.release(timeout=PATIENCE) == 2
        first = first_to_end(workers, PATIENCE)
        assert first is not None, f"neither kickoff ended; entered {entered(world)}"
        loser, lost = first
        assert lost.raised("ResumeConflict"), lost.summary()
        deadline = time.monotonic() + PATIENCE
        while applied(world) != {"open": 1} and time.monotonic() < deadline:
            time.sleep(0.01)  # the winner is held after its effect
        assert entered(world) == {"begin": 1} and applied(world) == {"open": 1}
        gate.touch()
        winner = next(w for w in workers if w is not loser)
        won = winner.wait(timeout=PATIENCE)
        assert won.ok, won.summary()
        state = won.value["state"]
        assert state["opened"] and state["closed"], state
    finally:
        gate.touch()
        reap(workers)
    assert entered(world) == {"begin": 1, "end": 1}
    assert applied(world) == {"open": 1, "close": 1}

    def again() -> dict[str, Any]:
        flow = held_flow(url, world, gate)(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return flow.state.model_dump()

    later = run(again)
    assert later.ok and later.value == state, later.summary()
    assert entered(world) == {"begin": 1, "end": 1}


RACER = """
import asyncio, json, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_crewai_probes48 import held_flow
mode, url, world, gate, flow_id, marks = sys.argv[1:]
flow = held_flow(url, Path(world), Path(gate))(suppress_flow_events=True)
Path(marks, mode).touch()
deadline = time.monotonic() + 60
while not Path(marks, "go").exists():
    assert time.monotonic() < deadline, "never released"
    time.sleep(0.002)
try:
    if mode == "async":
        asyncio.run(flow.kickoff_async(inputs={{"id": flow_id}}))
    else:
        flow.kickoff(inputs={{"id": flow_id}})
    print(json.dumps({{"ok": True, "state": flow.state.model_dump()}}))
except Exception as exc:
    print(json.dumps({{"ok": False, "class": type(exc).__name__, "message": str(exc)}}))
"""


@pytest.mark.timeout(400)
def test_kickoff_async_and_kickoff_of_one_new_flow_id_in_two_interpreters(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P5, P2, liveness: as above, with two fresh interpreters (each imports CrewAI and
    Remit itself): the one that claims the new id is held after its effect; the other
    ends with `ResumeConflict`; the flow then ends once. Every wait has a timeout."""
    import json
    import os
    import subprocess
    import sys

    flow_id = f"new-{uuid.uuid4().hex}"
    gate, marks = tmp_path / "gate", tmp_path / "marks"
    marks.mkdir()
    script = tmp_path / "racer.py"
    script.write_text(RACER.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true"}
    procs = {
        mode: subprocess.Popen(
            [sys.executable, str(script), mode, url, str(world), str(gate), flow_id, str(marks)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for mode in ("async", "sync")
    }
    try:
        deadline = time.monotonic() + 120
        while not all((marks / m).exists() for m in procs):
            assert time.monotonic() < deadline, "a racer never got ready"
            assert all(p.poll() is None for p in procs.values()), "a racer died early"
            time.sleep(0.01)
        (marks / "go").touch()
        ended = None
        while ended is None:
            assert time.monotonic() < deadline + PATIENCE, f"neither ended; {entered(world)}"
            ended = next((m for m, p in procs.items() if p.poll() is not None), None)
            time.sleep(0.01)
        out, err = procs[ended].communicate(timeout=PATIENCE)
        lost = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"stderr": err[-2000:]}
        assert lost.get("class") == "ResumeConflict", lost
        gate.touch()
        winner = next(m for m in procs if m != ended)
        out, err = procs[winner].communicate(timeout=PATIENCE)
        won = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"stderr": err[-2000:]}
        assert won.get("ok") is True, won
    finally:
        gate.touch()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=PATIENCE)
    assert entered(world) == {"begin": 1, "end": 1}
    assert applied(world) == {"open": 1, "close": 1}


# -- P5: one pause, resumed by k processes while others kick its id off -----------------


def pause_flow(url: str, world: Path, *, lease: float = 30.0) -> type[Any]:
    """prepare -> review (`@human_feedback`, pauses) -> pay (effect "pay"); a model
    state with a constrained field. Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai_parts import Later
    from pydantic import BaseModel, Field

    from remit_crewai import RemitFlowPersistence

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    pay = sink_effect(sink, "pay")

    class Bill(BaseModel):
        amount: int = Field(default=0, ge=0)
        who: str | None = None
        receipt: str | None = None

    @persist(RemitFlowPersistence(url, lease=lease))
    class PauseFlow(Flow[Bill]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.amount = 5

        @listen(prepare)
        @human_feedback(message="Pay?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return f"bill of {self.state.amount}"

        @listen(review)
        def pay_it(self) -> None:
            journal.record("enter", "pay_it")
            self.state.who = self.last_human_feedback.feedback
            self.state.receipt = pay()

    return PauseFlow


@pytest.mark.timeout(300)
def test_resumers_and_kickoffs_of_one_paused_id_consume_it_once(url: str, world: Path) -> None:
    """P5, P2, liveness: a paused flow is raced by three processes that `from_pending` +
    `resume` it (each its own answer) and two that `kickoff(inputs={"id": X})` it, all
    behind one barrier. At most one resume proceeds and its answer is the one stored;
    each other racer either gets `ResumeConflict` or (a kickoff that claimed the flow)
    pauses it again. If no resume won, a later resume takes the pause once. In the end
    the feedback was consumed once, `pay` applied once, and nothing hangs."""
    started = run(lambda: kick(pause_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    barrier = Barrier(5)

    def resumer(who: str) -> Any:
        def body() -> Any:
            cls = pause_flow(url, world)
            barrier.wait()
            flow = cls.from_pending(flow_id, cls.__flow_persistence_config__.persistence)
            flow.resume(who)
            return {"who": who, "state": flow.state.model_dump()}

        return body

    def kicker() -> Any:
        cls = pause_flow(url, world)
        barrier.wait()
        return {"kick": kick(cls, inputs={"id": flow_id})}

    workers = [child(resumer(w), barrier=barrier) for w in ("ann", "bob", "cy")]
    workers += [child(kicker, barrier=barrier) for _ in range(2)]
    try:
        assert barrier.release(timeout=PATIENCE) == 5
        outcomes = [w.wait(timeout=PATIENCE) for w in workers]
    finally:
        reap(workers)
    resumed = [o for o in outcomes[:3] if o.ok]
    assert len(resumed) <= 1, [o.summary() for o in outcomes]
    for o in outcomes[:3]:
        assert o.ok or o.raised("ResumeConflict"), o.summary()
    for o in outcomes[3:]:
        assert o.raised("ResumeConflict") or (
            o.ok and o.value["kick"]["out"] in ("HumanFeedbackPending", "NoneType")
        ), o.summary()
    if resumed:
        winner = resumed[0].value["who"]
    else:
        winner = "dee"
        late = run(resumer_after(url, world, flow_id, winner))
        assert late.ok, late.summary()
    assert applied(world) == {"pay": 1}
    assert entered(world)["pay_it"] == 1
    head = run(lambda: stored_state(url, flow_id))
    assert head.ok and head.value["who"] == winner and head.value["receipt"], head.summary()
    again = run(resumer_after(url, world, flow_id, "eve"))
    assert again.raised("ResumeConflict") or again.raised("ValueError"), again.summary()
    assert applied(world) == {"pay": 1}


def kick(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff(**kwargs)
    return {"id": flow.flow_id, "state": flow.state.model_dump(), "out": type(out).__name__}


def resumer_after(url: str, world: Path, flow_id: str, who: str) -> Any:
    def body() -> Any:
        cls = pause_flow(url, world)
        flow = cls.from_pending(flow_id, cls.__flow_persistence_config__.persistence)
        flow.resume(who)
        return flow.state.model_dump()

    return body


def stored_state(url: str, flow_id: str) -> Any:
    from remit_crewai import RemitFlowPersistence

    return RemitFlowPersistence(url).load_state(flow_id)


# -- P4, liveness: a save while a sibling step changes the shared state ------------------


def busy_flow(url: str, model: bool) -> type[Any]:
    """begin -> grow (adds 20000 keys to a nested dict, yielding to the loop now and
    then) and quick (completes at once, so its save runs in a thread while grow goes
    on) -> end; async steps on a dict state, or on a model state with a dict field.
    Built in a child."""
    from crewai.flow.flow import Flow, and_, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    class Book(BaseModel):
        book: dict[str, int] = {}
        done: list[str] = []

    def book(flow: Any) -> dict[str, int]:
        return flow.state.book if model else flow.state["book"]  # type: ignore[no-any-return]

    def done(flow: Any) -> list[str]:
        return flow.state.done if model else flow.state["done"]  # type: ignore[no-any-return]

    base = Flow[Book] if model else Flow

    @persist(RemitFlowPersistence(url))
    class BusyFlow(base):  # type: ignore[misc,valid-type]
        _skip_auto_memory = True

        @start()
        async def begin(self) -> None:
            if not model:
                self.state["book"], self.state["done"] = {}, []
            done(self).append("begin")

        @listen(begin)
        async def grow(self) -> None:
            for i in range(20000):
                book(self)[f"k{i}"] = i
                if i % 50 == 0:
                    await asyncio.sleep(0)
            done(self).append("grow")

        @listen(begin)
        async def quick(self) -> None:
            for _ in range(30):  # several saves of others while grow goes on
                await asyncio.sleep(0.001)
            done(self).append("quick")

        @listen(and_(grow, quick))
        async def end(self) -> None:
            done(self).append("end")

    return BusyFlow


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", [False, True], ids=["dict", "model"])
def test_a_save_while_a_sibling_step_changes_the_state_is_not_a_failed_flow(
    url: str, model: bool
) -> None:
    """P4, liveness: async steps run side by side on one state; CrewAI saves a step's
    completion in a thread while a sibling still adds keys to a nested dict of the
    state. The save stores a state as it was at one moment (not "dictionary changed
    size during iteration", which failed the whole flow with `RuntimeError("State
    persistence failed")`), the flow ends, and its head holds every key."""

    def body() -> dict[str, Any]:
        from remit_crewai import RemitFlowPersistence

        flow = busy_flow(url, model)(suppress_flow_events=True)
        asyncio.run(flow.kickoff_async())
        head = RemitFlowPersistence(url).load_state(flow.flow_id)
        assert head is not None
        return {"keys": len(head["book"]), "done": sorted(head["done"])}

    for _ in range(3):
        out = child(body).wait(timeout=PATIENCE * 2)
        assert out.ok, out.error_text()
        assert out.value == {"keys": 20000, "done": ["begin", "end", "grow", "quick"]}
