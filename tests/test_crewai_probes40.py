"""Probes of CrewAI flows under racing processes: a save left running by a cancelled
kickoff, resumers racing with feedback of the wrong type, and a held flow restarted
through a persistence given to the flow instead of its class's.

Written from the contract (P1 no completed step runs again, P2 effects once, P5 one
resumer proceeds, L1/L2 claims and fencing) against real CrewAI flows in forked
children, on every engine, with the helpers of `test_crewai_flows`.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import sink_effect, stored_flow
from test_crewai_flows import applied, child, entered, point, review_flow, run

from remit_core.conformance.processes import Barrier, reap
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence

RACERS = 8


def held_save_flow(url: str, world: Path, held: Path | None, go: Path | None) -> type[Any]:
    """prepare (effect "prep") -> charge (effect "charge") -> ship (effect "ship"), a
    model state. With `held`/`go`: the save after `charge` is held inside the state's
    serialization (in CrewAI's save thread) until `go` exists, `held` marking it there;
    `charge` waits for `go` itself when `go` is given without `held`; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, field_serializer

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    prep, charge_card, ship_it = (sink_effect(sink, k) for k in ("prep", "charge", "ship"))
    armed = {"hold": held is not None}

    class Order(BaseModel):
        prepared: str | None = None
        receipt: str | None = None
        shipped: str | None = None

        @field_serializer("receipt")
        def _receipt(self, value: str | None) -> str | None:
            if value is not None and armed["hold"] and held is not None and go is not None:
                armed["hold"] = False
                held.touch()
                point({"save": f"wait:{go}"}, "save")
            return value

    @persist(RemitFlowPersistence(url, lease=30.0))
    class HeldFlow(Flow[Order]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.prepared = prep()

        @listen(prepare)
        def charge(self) -> None:
            journal.record("enter", "charge")
            if held is None and go is not None:
                Path(f"{go}.charging").touch()
                point({"charge": f"wait:{go}"}, "charge")
            self.state.receipt = charge_card()

        @listen(charge)
        def ship(self) -> None:
            journal.record("enter", "ship")
            self.state.shipped = ship_it()

    return HeldFlow


def _wait_for(path: Path) -> None:
    point({"p": f"wait:{path}"}, "p")


@pytest.mark.parametrize("released", ["after_the_restart", "while_the_restart_holds_it"])
def test_a_save_left_running_by_a_cancelled_kickoff_never_overwrites_a_newer_head(
    url: str, world: Path, tmp_path: Path, released: str
) -> None:
    """L2, P1, P2: `kickoff_async` is cancelled (`task.cancel()`) while CrewAI's save after
    `charge` runs in its worker thread (held inside the state's serialization). The
    cancelled run gives the flow back; another process restarts it by id (`charge` was in
    flight, so it runs again; its effect returns its recorded outcome). The held save is
    then let go, after that restart finished or while it holds the flow: it must write
    nothing, so the head stays the restart's and a later restart runs nothing."""
    flow_id = f"late-{uuid.uuid4().hex}"
    held, go, cancelled = tmp_path / "held", tmp_path / "go", tmp_path / "cancelled"
    go_restart = tmp_path / "go-restart"

    def cancelled_run() -> dict[str, Any]:
        import asyncio
        import logging

        failures: list[str] = []

        class Failures(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                failures.append(record.getMessage())

        logging.getLogger("crewai").addHandler(Failures(logging.ERROR))
        flow_class = held_save_flow(url, world, held, go)

        async def go_on() -> bool:
            flow = flow_class(suppress_flow_events=True)
            task = asyncio.ensure_future(flow.kickoff_async(inputs={"id": flow_id}))
            await asyncio.to_thread(_wait_for, held)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return True
            return False

        # (`asyncio.run` returns once its worker threads are done: the held save ended.)
        was_cancelled = asyncio.run(go_on_and_mark(go_on, cancelled))
        return {"cancelled": was_cancelled, "failures": failures}

    first = child(cancelled_run)
    try:
        _wait_for(cancelled)
        if released == "after_the_restart":
            restarted = run(lambda: _kickoff_state(held_save_flow(url, world, None, None), flow_id))
            go.touch()
            late = first.wait(timeout=120)
        else:
            restart = child(
                lambda: _kickoff_state(held_save_flow(url, world, None, go_restart), flow_id)
            )
            _wait_for(Path(f"{go_restart}.charging"))
            go.touch()
            late = first.wait(timeout=120)
            go_restart.touch()
            restarted = restart.wait(timeout=120)
    finally:
        go.touch()
        go_restart.touch()
    assert late.ok and late.value["cancelled"] is True, late.summary()
    assert restarted.ok, restarted.summary()
    final = restarted.value
    assert final["shipped"] is not None and final["receipt"] is not None, final
    # The late save was refused: the head is still the restart's last save.
    assert stored_flow(url, flow_id)["state"] == {**final, "id": flow_id}
    assert any("charge" in failure for failure in late.value["failures"]), late.value
    again = run(lambda: _kickoff_state(held_save_flow(url, world, None, None), flow_id))
    assert again.ok and again.value == final, again.summary()
    assert entered(world) == {"prepare": 1, "charge": 2, "ship": 1}
    assert applied(world) == {"prep": 1, "charge": 1, "ship": 1}


async def go_on_and_mark(body: Any, mark: Path) -> Any:
    """Await `body()`, then create `mark` (the parent's sign that it returned)."""
    out = await body()
    mark.touch()
    return out


def _kickoff_state(flow_class: type[Any], flow_id: str) -> dict[str, Any]:
    """`kickoff(inputs={"id": flow_id})`; the flow's state after it, id left out."""
    flow = flow_class(suppress_flow_events=True)
    flow.kickoff(inputs={"id": flow_id})
    return {k: v for k, v in flow.state.model_dump().items() if k != "id"}


def test_racing_resumers_with_feedback_of_the_wrong_type_let_one_proceed(
    url: str, world: Path
) -> None:
    """P5, P2, L1: `RACERS` processes released together by a barrier each `from_pending` one
    pause and `resume` it, half with an int (CrewAI's feedback is a str), half with a str.
    An int is refused with `TypeError` and gives the flow back at once; at most one str
    resumer proceeds, every other gets `ResumeConflict`; nothing runs for a refused one.
    If none proceeded, the pause is still answerable. The flow continues once, with the
    winner's feedback, and a late resume is refused."""
    started = run(lambda: _paused(review_flow(url, world)))
    assert started.ok, started.summary()
    flow_id = started.value
    barrier = Barrier(RACERS)

    def racer(value: Any) -> Any:
        def go() -> dict[str, Any]:
            flow_class = review_flow(url, world)
            store = flow_class.__flow_persistence_config__.persistence
            barrier.wait()
            try:
                flow = flow_class.from_pending(flow_id, store)
                flow.resume(value)
            except Exception as exc:
                return {"value": value, "raised": type(exc).__name__}
            return {"value": value, "raised": None, "by": flow.state.approved_by}

        return go

    workers = [child(racer(7 if i % 2 else f"r{i}"), barrier=barrier) for i in range(RACERS)]
    try:
        assert barrier.release() == RACERS
        outs = [w.wait(timeout=120) for w in workers]
    finally:
        reap(workers)
    assert all(o.ok for o in outs), [o.summary() for o in outs]
    results = [o.value for o in outs]
    assert {r["raised"] for r in results} <= {None, "TypeError", "ResumeConflict"}, results
    assert all(r["raised"] != "TypeError" or r["value"] == 7 for r in results), results
    winners = [r for r in results if r["raised"] is None]
    assert len(winners) <= 1, results
    assert all(r["value"] != 7 for r in winners), results
    if not winners:
        last = run(lambda: _resume(review_flow(url, world), flow_id, "last"))
        assert last.ok, last.summary()
        winners = [{"value": "last", "by": last.value}]
    assert winners[0]["by"] == winners[0]["value"]
    late = run(lambda: _resume(review_flow(url, world), flow_id, "late"))
    assert late.raised("ResumeConflict"), late.summary()
    assert stored_flow(url, flow_id)["state"]["approved_by"] == winners[0]["value"]
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


def _paused(flow_class: type[Any]) -> str:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff()
    assert type(out).__name__ == "HumanFeedbackPending", out
    return str(flow.flow_id)


def _resume(flow_class: type[Any], flow_id: str, value: Any) -> Any:
    flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
    flow.resume(value)
    return flow.state.approved_by


def given_flow(url: str, world: Path, how: str, go: Path | None) -> Any:
    """prepare -> work (effect "work"; waits for `go` if given, marking `<go>.working`)
    -> done, a dict state; returns a maker of flow instances. `how`: "instance", a class
    `@persist`ed to the store, each instance given another persistence of it;
    "instance_only", no `@persist`, each instance given a persistence of the store.
    Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    work_it = sink_effect(sink, "work")

    class GivenFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["n"] = 1

        @listen(prepare)
        def work(self) -> None:
            journal.record("enter", "work")
            if go is not None:
                Path(f"{go}.working").touch()
                point({"work": f"wait:{go}"}, "work")
            self.state["worked"] = work_it()

        @listen(work)
        def done(self) -> None:
            journal.record("enter", "done")
            self.state["n"] += 1

    flow_class = persist(RemitFlowPersistence(url))(GivenFlow) if how == "instance" else GivenFlow

    def make() -> Any:
        return flow_class(suppress_flow_events=True, persistence=RemitFlowPersistence(url))

    return make


@pytest.mark.parametrize("how", ["instance", "instance_only"])
def test_a_held_flow_restarted_through_a_persistence_given_to_the_flow_is_refused(
    url: str, world: Path, tmp_path: Path, how: str
) -> None:
    """P5, P1, L2: one process drives a flow by id through a persistence given to the flow
    (`Flow(persistence=...)`, with or without a class-level `@persist` of the same store)
    and is held in `work`. Another process's `kickoff(inputs={"id": X})` the same way gets
    `ResumeConflict` and runs nothing; the holder finishes with every step once."""
    flow_id, go = f"given-{uuid.uuid4().hex}", tmp_path / "go"

    def drive(wait: Path | None) -> Any:
        def go_on() -> dict[str, Any]:
            flow = given_flow(url, world, how, wait)()
            flow.kickoff(inputs={"id": flow_id})
            return dict(flow.state)

        return go_on

    holder = child(drive(go))
    try:
        _wait_for(Path(f"{go}.working"))
        rival = run(drive(None))
    finally:
        go.touch()
    held = holder.wait(timeout=120)
    assert rival.raised("ResumeConflict"), rival.summary()
    assert held.ok and held.value["n"] == 2 and held.value["worked"], held.summary()
    assert entered(world) == {"prepare": 1, "work": 1, "done": 1}
    assert applied(world) == {"work": 1}
    if how == "instance":
        again = run(drive(None))
        assert again.ok and again.value == held.value, again.summary()
        assert entered(world) == {"prepare": 1, "work": 1, "done": 1}


def asking_flow(url: str, world: Path, who: str, go: Path | None) -> type[Any]:
    """prepare (n = 1) -> question (sets `who`; waits for `go` if given, marking
    `<go>.asking`; then `self.ask`, which CrewAI saves first) -> finish; a dict state;
    built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))

    class Yes:
        def request_input(self, message: str, flow: Any, metadata: Any = None) -> str:
            return "yes"

    @persist(RemitFlowPersistence(url, lease=30.0))
    class AskingFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(input_provider=Yes(), suppress_flow_events=True, **kwargs)

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["n"] = 1

        @listen(prepare)
        def question(self) -> None:
            journal.record("enter", "question")
            self.state["who"] = who
            if go is not None:
                Path(f"{go}.asking").touch()
                point({"ask": f"wait:{go}"}, "ask")
            self.state["answer"] = self.ask("Go on?")

        @listen(question)
        def finish(self) -> None:
            journal.record("enter", "finish")
            self.state["done"] = True

    return AskingFlow


def test_a_step_left_running_by_a_cancelled_kickoff_asks_without_overwriting_a_newer_head(
    url: str, world: Path, tmp_path: Path
) -> None:
    """L2, P1: `kickoff_async` is cancelled while its sync step `question` runs on in its
    worker thread. Another process restarts the flow by id and finishes it. Then the
    left-over step calls `ask()`, and CrewAI saves the state it holds: that save must not
    become the flow's head over the finished run's (a state with the old `who` and no
    `done`); the flow still reads and restarts as the restart left it."""
    flow_id, go, cancelled = f"asked-{uuid.uuid4().hex}", tmp_path / "go", tmp_path / "cancelled"

    def cancelled_run() -> bool:
        import asyncio

        flow_class = asking_flow(url, world, "first", go)

        async def go_on() -> bool:
            task = asyncio.ensure_future(flow_class().kickoff_async(inputs={"id": flow_id}))
            await asyncio.to_thread(_wait_for, Path(f"{go}.asking"))
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return True
            return False

        # (`asyncio.run` returns once its worker threads are done: the step asked.)
        return bool(asyncio.run(go_on_and_mark(go_on, cancelled)))

    def restart() -> dict[str, Any]:
        flow = asking_flow(url, world, "second", None)()
        flow.kickoff(inputs={"id": flow_id})
        return dict(flow.state)

    first = child(cancelled_run)
    try:
        _wait_for(cancelled)
        restarted = run(restart)
    finally:
        go.touch()
    late = first.wait(timeout=120)
    assert late.ok and late.value is True, late.summary()
    assert restarted.ok, restarted.summary()
    final = restarted.value
    assert final["who"] == "second" and final["done"] is True, final
    assert stored_flow(url, flow_id)["state"] == final
    again = run(restart)
    assert again.ok and again.value == final, again.summary()
    assert entered(world) == {"prepare": 1, "question": 2, "finish": 1}
