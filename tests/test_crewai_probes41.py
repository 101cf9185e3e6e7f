"""Probes of CrewAI flows whose late saves meet a resume in the same process (once, and
in a feedback loop), of racing restarts by id of a failed flow, and of a flow awaited in
another's step, cancelled with it and restarted.

Written from the contract (P1 no completed step runs again, P2 effects once, P5 one
resumer proceeds, L2 a run that gave its flow up writes nothing over a newer head)
against real CrewAI flows in forked children, on every engine, with the helpers of
`test_crewai_flows`.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect, stored_flow
from test_crewai_flows import applied, child, entered, point, run
from test_crewai_probes40 import _wait_for, go_on_and_mark

from remit_core.conformance.processes import Barrier, reap
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence

WAIT = 60.0  # (a bound on a wait that an event ends, never a synchronization)


def late_sibling_flow(url: str, world: Path) -> tuple[type[Any], dict[str, Any]]:
    """prepare -> review (pauses for feedback) -> deliver (effect "ship"), and beside
    review prepare -> side. The first instance's `side` is held until `go_side` is set;
    each resumer's `deliver` sets `in_deliver` and waits for `let_deliver`. Returns the
    class and its gates (`late_done` is set, and `late_error` holds what was raised, once
    the held instance's save after `side` ended; `resumed_side` once another instance's
    save after `side` ended). Built in a child."""
    import threading

    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    ship = sink_effect(sink, "ship")
    gates: dict[str, Any] = {
        name: threading.Event()
        for name in ("go_side", "in_deliver", "let_deliver", "late_done", "resumed_side")
    }
    gates.update(held=None, late_error=None, hold=True)

    class Parcel(BaseModel):
        side: str | None = None
        by: str | None = None
        shipped: str | None = None

    @persist(RemitFlowPersistence(url, lease=30.0))
    class LateFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True

        def _persist_method_completion(self, method_name: Any) -> None:
            try:
                super()._persist_method_completion(method_name)
            except Exception as exc:
                if self is gates["held"]:
                    gates["late_error"] = type(exc.__cause__ or exc).__name__
                raise
            finally:
                if method_name == "side":
                    gates["late_done" if self is gates["held"] else "resumed_side"].set()

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen(prepare)
        def side(self) -> None:
            journal.record("enter", "side")
            if gates["hold"]:
                gates["hold"], gates["held"] = False, self
                assert gates["go_side"].wait(WAIT)
                self.state.side = "left"
                return
            self.state.side = "resumed"

        @listen(review)
        def deliver(self) -> None:
            journal.record("enter", "deliver")
            assert self.last_human_feedback is not None
            self.state.by = self.last_human_feedback.feedback
            gates["in_deliver"].set()
            assert gates["let_deliver"].wait(WAIT)
            self.state.shipped = ship()

    return LateFlow, gates


@pytest.mark.parametrize("when", ["resuming_same_thread", "resuming_other_thread", "claimed"])
def test_a_late_siblings_save_never_goes_through_a_resume_in_the_same_process(
    url: str, world: Path, when: str
) -> None:
    """L2, P1, P5: `kickoff_async` pauses at review while its sibling `side` still runs.
    In the same process `from_pending` takes the pause, and its resume (`resume_async`
    in the same thread, or `resume` in another) is held in `deliver`, or has not begun
    ("claimed"). Then the old run's `side` completes: its save belongs to a run that gave
    the flow up, and must not go through the resumer's session (the old state over the
    resumer's, `side` completed in the resumer's ledger, which then never runs it): it is
    refused, the head stays, the resume runs `side` itself, its state is the head at the
    end, and a restart by id runs nothing."""
    flow_id = f"late-{uuid.uuid4().hex}"

    def body() -> dict[str, Any]:
        import asyncio
        import threading

        flow_class, gates = late_sibling_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence

        async def go_on() -> dict[str, Any]:
            first = flow_class(suppress_flow_events=True)
            out = await first.kickoff_async(inputs={"id": flow_id})
            assert type(out).__name__ == "HumanFeedbackPending", out
            second = flow_class.from_pending(flow_id, store)
            resumed: Any = None
            if when == "resuming_same_thread":
                resumed = asyncio.ensure_future(second.resume_async("ann"))
            elif when == "resuming_other_thread":
                resumed = threading.Thread(target=second.resume, args=("ann",))
                resumed.start()
            if resumed is not None:
                for gate in ("in_deliver", "resumed_side"):
                    assert await asyncio.to_thread(gates[gate].wait, WAIT)
            kept = store.load_state(flow_id)
            gates["go_side"].set()
            assert await asyncio.to_thread(gates["late_done"].wait, WAIT)
            meanwhile = store.load_state(flow_id)
            gates["let_deliver"].set()
            if resumed is None:
                await second.resume_async("ann")
            elif isinstance(resumed, threading.Thread):
                await asyncio.to_thread(resumed.join, WAIT)
            else:
                await resumed
            return {
                "state": second.state.model_dump(),
                "late_error": gates["late_error"],
                "kept": kept,
                "meanwhile": meanwhile,
            }

        return asyncio.run(go_on())

    done = run(body)
    assert done.ok, done.summary()
    final = done.value["state"]
    assert final["by"] == "ann" and final["side"] == "resumed" and final["shipped"], final
    assert stored_flow(url, flow_id)["state"] == final
    # The late save was refused: the head the resumer wrote stayed while it was held.
    assert done.value["late_error"] in {"ResumeConflict", "Fenced"}, done.value
    assert done.value["kept"]["side"] == (None if when == "claimed" else "resumed"), done.value
    assert done.value["meanwhile"] == done.value["kept"], done.value
    assert entered(world) == {"prepare": 1, "review": 1, "side": 2, "deliver": 1}

    def restart() -> dict[str, Any]:
        flow_class, _ = late_sibling_flow(url, world)
        flow = flow_class(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return dict(flow.state.model_dump())

    again = run(restart)
    assert again.ok and again.value == final, again.summary()
    assert entered(world) == {"prepare": 1, "review": 1, "side": 2, "deliver": 1}
    assert applied(world) == {"ship": 1}


def noted_loop_flow(url: str, world: Path) -> tuple[type[Any], dict[str, Any]]:
    """prepare -> review (pauses) -> decide (the feedback is the route) -> "revise" ->
    rework -> "redrafted" -> review again ... -> "approve" -> ship (effect "ship"); beside
    each review, `note` (listening to what review listens to) records its round, held
    until `gates["go"][round]` is set. `gates["done"][round]` is set, and
    `gates["error"][round]` holds what was raised, once the held note's save ended.
    Built in a child."""
    import collections
    import threading

    from crewai.flow.flow import Flow, listen, or_, router, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    ship = sink_effect(sink, "ship")
    gates: dict[str, Any] = {
        "go": collections.defaultdict(threading.Event),
        "done": collections.defaultdict(threading.Event),
        "error": {},
        "held": {},
    }

    class Notes(BaseModel):
        rounds: int = 0
        notes: list[int] = []
        answers: list[str] = []
        shipped: str | None = None

    @persist(RemitFlowPersistence(url, lease=30.0))
    class NotedLoop(Flow[Notes]):  # type: ignore[misc]
        _skip_auto_memory = True

        def _persist_method_completion(self, method_name: Any) -> None:
            late = [
                r for r, f in gates["held"].items() if f is self and not gates["done"][r].is_set()
            ]
            try:
                super()._persist_method_completion(method_name)
            except Exception as exc:
                for r in late:
                    gates["error"][r] = type(exc.__cause__ or exc).__name__
                raise
            finally:
                if method_name == "note":
                    for r in late:
                        gates["done"][r].set()

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(or_(prepare, "redrafted"))
        @human_feedback(message="Good?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return f"draft {self.state.rounds}"

        @listen(or_(prepare, "redrafted"))
        def note(self) -> None:
            journal.record("enter", "note")
            round_ = self.state.rounds
            gates["held"][round_] = self
            assert gates["go"][round_].wait(WAIT)
            self.state.notes.append(round_)

        @router(review)
        def decide(self) -> str:
            journal.record("enter", "decide")
            assert self.last_human_feedback is not None
            self.state.answers.append(self.last_human_feedback.feedback)
            return self.last_human_feedback.feedback

        @router("revise")
        def rework(self) -> str:
            journal.record("enter", "rework")
            self.state.rounds += 1
            return "redrafted"

        @listen("approve")
        def finish(self) -> None:
            journal.record("enter", "finish")
            self.state.shipped = ship()

    return NotedLoop, gates


ROUNDS = 4


@pytest.mark.parametrize("resumes", ["in_one_context", "in_threads"])
def test_late_sibling_saves_between_pauses_and_resumes_in_one_process(
    url: str, world: Path, resumes: str
) -> None:
    """P1, L2, P5: a feedback loop is kicked off and answered `ROUNDS + 1` times in one
    process, by `from_pending` + `resume_async` in the kickoff's own context, or by
    `from_pending` + `resume` each in a thread of its own; each pause leaves its sibling
    `note` running. Each round's note completes before the next `from_pending`: the save
    is its paused run's own, with no resume yet, so it is stored, never `Fenced`, and
    the resume does not run the note again. The last note completes once the last
    `from_pending` claimed the flow: refused, and that resume runs it. The loop ends
    with each round noted once, and a restart runs nothing."""
    flow_id = f"loop-{uuid.uuid4().hex}"

    def body() -> dict[str, Any]:
        import asyncio
        import threading

        flow_class, gates = noted_loop_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        gates["end"], workers = threading.Event(), []

        async def answer(round_: int, answer: str) -> tuple[Any, Any]:
            """Claim the pause, let the round's note complete (after the claim on the last
            round, before it on the others), resume."""
            if round_ < ROUNDS:
                gates["go"][round_].set()
                assert await asyncio.to_thread(gates["done"][round_].wait, WAIT)
            if resumes == "in_one_context":
                flow = flow_class.from_pending(flow_id, store)
                if round_ == ROUNDS:
                    gates["go"][round_].set()
                    assert await asyncio.to_thread(gates["done"][round_].wait, WAIT)
                return flow, await flow.resume_async(answer)
            claimed, go_resume, answered = (threading.Event() for _ in range(3))
            got: dict[str, Any] = {}

            def in_thread() -> None:
                async def serve() -> None:
                    try:
                        got["flow"] = flow_class.from_pending(flow_id, store)
                        claimed.set()
                        assert await asyncio.to_thread(go_resume.wait, WAIT)
                        got["out"] = await got["flow"].resume_async(answer)
                    except BaseException as exc:
                        got["error"] = repr(exc)
                    finally:
                        claimed.set()
                        answered.set()
                    # The loop lives on, as a server's: what its run left running goes on.
                    assert await asyncio.to_thread(gates["end"].wait, WAIT)

                asyncio.run(serve())

            worker = threading.Thread(target=in_thread)
            worker.start()
            workers.append(worker)
            assert await asyncio.to_thread(claimed.wait, WAIT)
            if round_ == ROUNDS:
                gates["go"][round_].set()
                assert await asyncio.to_thread(gates["done"][round_].wait, WAIT)
            go_resume.set()
            assert await asyncio.to_thread(answered.wait, WAIT)
            assert "error" not in got, (round_, got["error"])
            return got["flow"], got["out"]

        async def go_on() -> dict[str, Any]:
            flow = flow_class(suppress_flow_events=True)
            out = await flow.kickoff_async(inputs={"id": flow_id})
            try:
                for round_ in range(ROUNDS + 1):
                    assert type(out).__name__ == "HumanFeedbackPending", (round_, out)
                    flow, out = await answer(round_, "revise" if round_ < ROUNDS else "approve")
            finally:
                gates["end"].set()
                for worker in workers:
                    await asyncio.to_thread(worker.join, WAIT)
            return {"state": flow.state.model_dump(), "errors": gates["error"]}

        return asyncio.run(go_on())

    done = run(body)
    assert done.ok, done.summary()
    assert done.value["errors"] == {str(ROUNDS): "ResumeConflict"}, done.value
    final = done.value["state"]
    assert final["notes"] == list(range(ROUNDS + 1)) and final["shipped"], final
    assert final["answers"] == ["revise"] * ROUNDS + ["approve"], final
    assert stored_flow(url, flow_id)["state"] == final
    visits = {"prepare": 1, "review": ROUNDS + 1, "note": ROUNDS + 2, "decide": ROUNDS + 1}
    assert entered(world) == {**visits, "rework": ROUNDS, "finish": 1}

    def restart() -> dict[str, Any]:
        flow_class, _ = noted_loop_flow(url, world)
        flow = flow_class(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return dict(flow.state.model_dump())

    again = run(restart)
    assert again.ok and again.value == final, again.summary()
    assert entered(world) == {**visits, "rework": ROUNDS, "finish": 1}
    assert applied(world) == {"ship": 1}


RACERS = 8


def failing_flow(url: str, world: Path, *, fail: bool, go: Path | None) -> type[Any]:
    """prepare -> work (effect "work"; raises after it if `fail`; with `go`, the first
    process to begin it writes its pid to `<go>.pid`, creates `<go>.working` and waits
    for `go`) -> done, a dict state; built in a child."""
    import os

    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    work_it = sink_effect(sink, "work")

    @persist(RemitFlowPersistence(url, lease=30.0))
    class FailingFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["n"] = 1

        @listen(prepare)
        def work(self) -> None:
            journal.record("enter", "work")
            self.state["worked"] = work_it()
            if fail:
                raise RuntimeError("work failed")
            if go is not None:
                try:
                    marker = os.open(f"{go}.pid", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    return  # a second racer got here: it must not wait, the test fails
                os.write(marker, str(os.getpid()).encode())
                os.close(marker)
                Path(f"{go}.working").touch()
                point({"work": f"wait:{go}"}, "work")

        @listen(work)
        def done(self) -> None:
            journal.record("enter", "done")
            self.state["n"] += 1

    return FailingFlow


def test_racing_restarts_by_id_of_a_failed_flow_let_one_proceed(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P5, P1, P2, L1: a flow fails in `work` (after its effect). `RACERS` processes
    released together by a barrier each `kickoff(inputs={"id": X})` it: one proceeds (held
    in `work` until every other returned), every other gets `ResumeConflict` before any
    step. The winner skips `prepare`, runs `work` again (its effect returns the recorded
    outcome) and `done`; a later restart runs nothing."""
    flow_id, go = f"failed-{uuid.uuid4().hex}", tmp_path / "go"

    def first() -> str:
        flow = failing_flow(url, world, fail=True, go=None)(suppress_flow_events=True)
        try:
            flow.kickoff(inputs={"id": flow_id})
        except Exception as exc:
            return type(exc).__name__
        return "ran"

    failed = run(first)
    assert failed.ok and failed.value != "ran", failed.summary()
    barrier = Barrier(RACERS)

    def racer() -> dict[str, Any]:
        flow = failing_flow(url, world, fail=False, go=go)(suppress_flow_events=True)
        barrier.wait()
        flow.kickoff(inputs={"id": flow_id})
        return {"raised": None, "state": dict(flow.state)}

    workers = [child(racer, barrier=barrier) for _ in range(RACERS)]
    try:
        assert barrier.release() == RACERS
        _wait_for(Path(f"{go}.working"))
        holder = int(Path(f"{go}.pid").read_text())
        # Every other racer returns while the winner holds the flow in `work`.
        losers = [w.wait(timeout=120) for w in workers if w.pid != holder]
        held = entered(world)
    finally:
        go.touch()
    won = [w.wait(timeout=120) for w in workers if w.pid == holder]
    reap(workers)
    assert len(losers) == RACERS - 1 and len(won) == 1
    assert all(o.raised("ResumeConflict") for o in losers), [o.summary() for o in losers]
    assert held == {"prepare": 1, "work": 2}  # the losers ran no step
    assert won[0].ok and won[0].value["raised"] is None, won[0].summary()
    winner = won[0].value["state"]
    assert winner["n"] == 2 and winner["worked"], winner
    assert entered(world) == {"prepare": 1, "work": 2, "done": 1}
    assert applied(world) == {"work": 1}
    again = run(lambda: _kickoff_dict(failing_flow(url, world, fail=False, go=None), flow_id))
    assert again.ok and again.value == winner, again.summary()
    assert entered(world) == {"prepare": 1, "work": 2, "done": 1}


def _kickoff_dict(flow_class: type[Any], flow_id: str) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    flow.kickoff(inputs={"id": flow_id})
    return dict(flow.state)


def nested_flows(url: str, world: Path, held: Path | None, go: Path | None) -> type[Any]:
    """An outer flow, o_prepare (effect "o_prep") -> o_call (awaits an inner flow's
    `kickoff_async` and keeps its state) -> o_done (effect "o_done"); the inner flow,
    i_prepare (effect "i_prep") -> i_work (effect "i_work"; with `held`, creates it and
    waits for `go` first). Both persisted by Remit; dict states; returns the outer
    class; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    effects = {k: sink_effect(sink, k) for k in ("o_prep", "o_done", "i_prep", "i_work")}

    @persist(RemitFlowPersistence(url, lease=30.0))
    class InnerFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def i_prepare(self) -> None:
            journal.record("enter", "i_prepare")
            self.state["prepared"] = effects["i_prep"]()

        @listen(i_prepare)
        def i_work(self) -> None:
            journal.record("enter", "i_work")
            if held is not None and go is not None:
                held.touch()
                point({"i_work": f"wait:{go}"}, "i_work")
            self.state["worked"] = effects["i_work"]()

    @persist(RemitFlowPersistence(url, lease=30.0))
    class OuterFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def o_prepare(self) -> None:
            journal.record("enter", "o_prepare")
            self.state["prepared"] = effects["o_prep"]()

        @listen(o_prepare)
        async def o_call(self) -> None:
            journal.record("enter", "o_call")
            inner = InnerFlow(suppress_flow_events=True)
            await inner.kickoff_async()
            self.state["inner"] = dict(inner.state)

        @listen(o_call)
        def o_done(self) -> None:
            journal.record("enter", "o_done")
            self.state["done"] = effects["o_done"]()

    return OuterFlow


@pytest.mark.parametrize("late", ["before_the_restart", "after_the_restart"])
def test_a_flow_awaited_in_a_step_cancelled_with_its_outer_flow_continues_once(
    url: str, world: Path, tmp_path: Path, late: str
) -> None:
    """P1, P2, L2: an outer flow's async step awaits an inner flow (both persisted by
    Remit); the outer `kickoff_async` is cancelled while the inner's `i_work` runs in its
    worker thread, which completes (its effect applied) before or after another process
    restarts the outer flow by id. The restart continues both flows (the inner under
    the same id, made from the step): no completed step runs again, `i_work` (never
    durably completed) runs again with its effect's recorded outcome, each effect
    once, and the heads are the restart's."""
    flow_id = f"outer-{uuid.uuid4().hex}"
    held, go, cancelled = tmp_path / "held", tmp_path / "go", tmp_path / "cancelled"

    def cancelled_run() -> bool:
        import asyncio

        outer_class = nested_flows(url, world, held, go)

        async def go_on() -> bool:
            flow = outer_class(suppress_flow_events=True)
            task = asyncio.ensure_future(flow.kickoff_async(inputs={"id": flow_id}))
            await asyncio.to_thread(_wait_for, held)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                return True
            return False

        # (`asyncio.run` returns once its worker threads are done: `i_work` ended.)
        return bool(asyncio.run(go_on_and_mark(go_on, cancelled)))

    def restart() -> dict[str, Any]:
        return _kickoff_dict(nested_flows(url, world, None, None), flow_id)

    first = child(cancelled_run)
    try:
        _wait_for(cancelled)
        if late == "before_the_restart":
            go.touch()
            left = first.wait(timeout=120)
        restarted = run(restart)
    finally:
        go.touch()
    if late == "after_the_restart":
        left = first.wait(timeout=120)
    assert left.ok and left.value is True, left.summary()
    assert restarted.ok, restarted.summary()
    final = restarted.value
    assert final["prepared"] and final["done"], final
    assert final["inner"]["prepared"] and final["inner"]["worked"], final
    assert stored_flow(url, flow_id)["state"] == final
    inner_id = final["inner"]["id"]
    assert stored_flow(url, inner_id)["state"] == final["inner"]
    again = run(restart)
    assert again.ok and again.value == final, again.summary()
    # (`i_work` was in flight when its run was cancelled: CrewAI never saves it, so it
    # runs again; its effect gives the recorded outcome.)
    assert entered(world) == {
        "o_prepare": 1,
        "o_call": 2,
        "i_prepare": 1,
        "i_work": 2,
        "o_done": 1,
    }
    assert applied(world) == {"o_prep": 1, "o_done": 1, "i_prep": 1, "i_work": 1}
