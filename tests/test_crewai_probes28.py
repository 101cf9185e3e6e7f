"""Probes of round 28: the FlowPersistence API called directly with odd arguments, flows
kicked off inside another flow's step and killed mid-way, three pauses answered from three
processes with one killed between answers, and long loops (their failure past Python's
recursion limit, and the size of their checkpoints).

Written from the contract and from CrewAI's public API, against real CrewAI flows in
forked children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, entered, kickoff, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence

# -- a flow kicked off inside another's step, killed mid-inner ---------------------------------


def outer_inner_flows(
    outer_url: str, inner_url: str, world: Path, *, points: dict[str, str] | None = None
) -> type[Any]:
    """Outer: prepare -> work (kicks off Inner without an id; effect "o") -> done.
    Inner: one -> two (effect "i2"; the crash point "inner.two") -> three (effect "i3").
    Inner persisted to `inner_url`, outer to `outer_url`; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    o, i2, i3 = (sink_effect(sink, k) for k in ("o", "i2", "i3"))

    @persist(RemitFlowPersistence(inner_url, lease=1.0))
    class Inner(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def one(self) -> None:
            journal.record("enter", "one")
            self.state["n"] = 1

        @listen(one)
        def two(self) -> None:
            journal.record("enter", "two")
            self.state["two"] = i2()
            point(at, "inner.two")

        @listen(two)
        def three(self) -> str:
            journal.record("enter", "three")
            self.state["three"] = i3()
            return f"{self.state['n']}:{self.state['two']}:{self.state['three']}"

    @persist(RemitFlowPersistence(outer_url, lease=1.0))
    class Outer(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        def work(self) -> None:
            journal.record("enter", "work")
            self.state["inner"] = Inner(suppress_flow_events=True).kickoff()
            self.state["o"] = o()

        @listen(work)
        def done(self) -> None:
            journal.record("enter", "done")

    return Outer


def _second_url(url: str, tmp_path: Path) -> str:
    """Another store of the same engine as `url`: a second SQLite file, or the same server
    (a second persistence on it)."""
    return f"sqlite:///{tmp_path / 'inner.db'}" if url.startswith("sqlite") else url


@pytest.mark.parametrize("stores", ["one", "two"])
def test_an_outer_flow_killed_inside_its_inner_flow_resumes_both_once(
    url: str, world: Path, tmp_path: Path, stores: str
) -> None:
    """P1, P2: an outer flow's step kicks off an inner flow (on the outer's store, or on a
    second one) whose process is SIGKILLed inside the inner flow's second step. The
    restart runs the outer step again, which continues the inner flow after its first
    step: each completed step ran once, each effect applied once. (Held before this
    round; kept as a probe of nested flows killed mid-inner.)"""
    flow_id = f"outer-{uuid.uuid4().hex}"
    inner_url = url if stores == "one" else _second_url(url, tmp_path)
    crashed = run(
        lambda: kickoff(
            outer_inner_flows(url, inner_url, world, points={"inner.two": "kill"}),
            inputs={"id": flow_id},
        )
    )
    assert crashed.status == "killed", crashed.summary()
    assert entered(world) == {"prepare": 1, "work": 1, "one": 1, "two": 1}
    time.sleep(1.3)
    again = run(lambda: kickoff(outer_inner_flows(url, inner_url, world), inputs={"id": flow_id}))
    assert again.ok, again.summary()
    assert entered(world) == {"prepare": 1, "work": 2, "one": 1, "two": 2, "three": 1, "done": 1}
    assert applied(world) == {"o": 1, "i2": 1, "i3": 1}
    assert again.value["state"]["inner"].startswith("1:i2:")


def three_reviews_flow(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> review1 -> review2 -> review3 (three feedback methods in a row, each
    pauses; review3 applies effect "r3" and has the crash point "review3") -> done (effect
    "done"; records the feedback history); a model state; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    r3, finish = sink_effect(sink, "r3"), sink_effect(sink, "done")

    class Answers(BaseModel):
        seen: list[str] = []
        history: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class ThreeReviews(Flow[Answers]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="1?", provider=Later())
        def review1(self) -> str:
            journal.record("enter", "review1")
            return "one"

        @listen(review1)
        @human_feedback(message="2?", provider=Later())
        def review2(self) -> str:
            journal.record("enter", "review2")
            assert self.last_human_feedback is not None
            self.state.seen.append(self.last_human_feedback.feedback)
            return "two"

        @listen(review2)
        @human_feedback(message="3?", provider=Later())
        def review3(self) -> str:
            journal.record("enter", "review3")
            assert self.last_human_feedback is not None
            self.state.seen.append(self.last_human_feedback.feedback)
            r3()
            point(at, "review3")
            return "three"

        @listen(review3)
        def done(self) -> None:
            journal.record("enter", "done")
            assert self.last_human_feedback is not None
            self.state.seen.append(self.last_human_feedback.feedback)
            self.state.history = [h.feedback for h in self.human_feedback_history]
            finish()

    return ThreeReviews


def _resume(url: str, world: Path, flow_id: str, value: str, **points: str) -> Any:
    from crewai.flow.async_feedback.types import HumanFeedbackPending

    flow_class = three_reviews_flow(url, world, points)
    flow = flow_class.from_pending(flow_id, RemitFlowPersistence(url, lease=1.0))
    out = flow.resume(value)
    return [
        type(out).__name__ if isinstance(out, HumanFeedbackPending) else "done",
        flow.state.model_dump(),
    ]


def test_three_pauses_answered_from_three_processes_one_killed_between_answers(
    url: str, world: Path
) -> None:
    """P5, P1, P2: three feedback methods in a row, each pause answered from another
    process; the second answer's process is SIGKILLed inside review3 after consuming it.
    A later `from_pending` gets `ResumeConflict` (that feedback was given); the restart
    by id pauses again at review3 with both answers, and the third answer finishes the
    flow: each answer reached its own pause once, the history holds the three, the
    effects applied once. (Held before this round; kept as a probe.)"""
    flow_id = f"three-{uuid.uuid4().hex}"
    started = run(lambda: kickoff(three_reviews_flow(url, world), inputs={"id": flow_id}))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    second = run(lambda: _resume(url, world, flow_id, "a"))
    assert second.ok and second.value[0] == "HumanFeedbackPending", second.summary()
    killed = run(lambda: _resume(url, world, flow_id, "b", review3="kill"))
    assert killed.status == "killed", killed.summary()
    time.sleep(1.3)
    late = run(lambda: _resume(url, world, flow_id, "x"))
    assert late.raised("ResumeConflict"), late.summary()
    again = run(lambda: kickoff(three_reviews_flow(url, world), inputs={"id": flow_id}))
    assert again.ok and again.value["out"] == "HumanFeedbackPending", again.summary()
    assert again.value["state"]["seen"] == ["a", "b"]
    last = run(lambda: _resume(url, world, flow_id, "c"))
    assert last.ok and last.value[0] == "done", last.summary()
    assert last.value[1]["seen"] == ["a", "b", "c"]
    assert last.value[1]["history"] == ["a", "b", "c"]
    assert applied(world) == {"r3": 1, "done": 1}
    assert entered(world) == {"prepare": 1, "review1": 1, "review2": 1, "review3": 2, "done": 1}
    stored = run(lambda: RemitFlowPersistence(url).load_state(flow_id))
    assert stored.ok and stored.value["seen"] == ["a", "b", "c"], stored.summary()


# -- long loops ------------------------------------------------------------------------------


def loop_flow(persistence: Any, world: Path | None, rounds: int, *, kill_at: int = 0) -> type[Any]:
    """step (a start the route "again" loops back to; applies "tick" if `world` is
    given; SIGKILLs its process as it enters round `kill_at`) -> route ("again"
    until `rounds` rounds ran, then "done") -> finish; a model state; built in a child."""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    tick = None if world is None else sink_effect(EffectSink(WorldDB(world)), "tick")

    class Rounds(BaseModel):
        n: int = 0

    @persist(persistence)
    class Loop(Flow[Rounds]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start("again")
        def step(self) -> None:
            if self.state.n + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if tick is not None:
                tick()
            self.state.n += 1

        @router(step)
        def route(self) -> str:
            return "again" if self.state.n < rounds else "done"

        @listen("done")
        def finish(self) -> int:
            return self.state.n

    return Loop


def test_a_loop_past_the_recursion_limit_fails_as_a_recursion_error_and_restarts(
    url: str, world: Path
) -> None:
    """A loop through a start runs as nested calls in CrewAI (a few per round), so a long
    enough one goes past Python's recursion limit, with or without Remit. Under Remit the
    flow fails with a `RecursionError` that says so, whichever call the limit hits: before,
    when it hit Remit's preparation of a step (about half the limits tried), the flow failed
    with `RemitError: Remit could not prepare step 'route': RecursionError(...)`, blaming
    Remit for CrewAI's limit. A restart under a higher limit continues the flow from its
    last save to its end, each round's effect applied once."""
    ids = [f"deep-{uuid.uuid4().hex}" for _ in range(4)]

    def deep() -> list[Any]:
        import logging
        import sys

        # As a script runs it: without the handlers pytest's log capture added, whose
        # formatting would be where the limit hits when CrewAI logs the failed step.
        logging.getLogger().handlers.clear()
        base, out = sys.getrecursionlimit(), []
        cls = loop_flow(RemitFlowPersistence(url, lease=1.0), None, 10**6)
        for extra, flow_id in enumerate(ids):
            sys.setrecursionlimit(base + extra)
            try:
                cls(suppress_flow_events=True, max_method_calls=10**7).kickoff(
                    inputs={"id": flow_id}
                )
                out.append(["finished"])
            except Exception as exc:
                out.append([isinstance(exc, RecursionError), type(exc).__name__, str(exc)])
        sys.setrecursionlimit(base)
        return out

    failed = run(deep)
    assert failed.ok, failed.summary()
    for is_recursion, name, message in failed.value:
        assert is_recursion, (name, message)
        assert "Remit could not" not in message, message
    told = [m for _, _, m in failed.value if "recursion limit" in m]
    assert told and all("CrewAI runs a loop through a start" in m for m in told), failed.value
    stored = run(lambda: RemitFlowPersistence(url).load_state(ids[0]))
    assert stored.ok and stored.value["n"] > 100, stored.summary()

    def restart() -> Any:
        import sys

        sys.setrecursionlimit(20_000)
        cls = loop_flow(RemitFlowPersistence(url), world, stored.value["n"] + 50)
        return cls(suppress_flow_events=True, max_method_calls=10**7).kickoff(inputs={"id": ids[0]})

    again = run(restart)
    assert again.ok and again.value == stored.value["n"] + 50, again.summary()


def test_a_loops_checkpoints_do_not_grow_with_its_rounds(url: str, world: Path) -> None:
    """Every checkpoint holds the ledger, and the ledger the route each router took each
    time. Stored as a list of every route, a loop's checkpoint grew with every round (a
    300-round loop's last checkpoint was 2.3 kB more than a 30-round one's, and the run's
    writes grew with the square of its rounds); stored as runs of one route, it does not
    grow, and a restart still replays each round's route: the flow killed in round 250
    restarts to its end, each round's effect applied once."""
    small, large = f"loop-{uuid.uuid4().hex}", f"loop-{uuid.uuid4().hex}"

    def both() -> list[int]:
        sizes = []
        for flow_id, rounds in ((small, 30), (large, 300)):
            flow = loop_flow(RemitFlowPersistence(url), None, rounds)
            flow(suppress_flow_events=True, max_method_calls=10**6).kickoff(inputs={"id": flow_id})
            head = RemitFlowPersistence(url).remit.head(flow_id)
            assert head is not None
            sizes.append(len(head.state))
        return sizes

    sizes = run(both)
    assert sizes.ok, sizes.summary()
    assert sizes.value[1] - sizes.value[0] < 16, sizes.value

    flow_id = f"loop-{uuid.uuid4().hex}"

    def loop(kill_at: int = 0) -> Any:
        flow = loop_flow(RemitFlowPersistence(url, lease=1.0), world, 300, kill_at=kill_at)
        return flow(suppress_flow_events=True, max_method_calls=10**6).kickoff(
            inputs={"id": flow_id}
        )

    crashed = run(lambda: loop(kill_at=250))
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.3)  # (the dead process's lease runs out)
    again = run(loop)
    assert again.ok and again.value == 300, again.summary()
    assert applied(world) == {"tick": 300}


def test_routes_stored_as_a_list_still_read_and_runs_past_the_completions_are_refused() -> None:
    """A checkpoint written before routes were stored as runs (a list of every route)
    still reads back the same ledger; runs that claim more routes than the router
    completed are not what Remit writes: `CorruptRecord` naming the run and checkpoint,
    before anything expands them."""
    from remit_core import CorruptRecord, codec
    from remit_crewai._ledger import decode

    def body(routes: Any) -> bytes:
        return codec.dumps(
            {
                "state": {"n": 3},
                "method": "route",
                "kind": "step",
                "completed": ["route", "step"],
                "counts": {"route": 3, "step": 3},
                "feedback": [],
                "routes": {"route": routes},
            }
        )

    old = decode(body(["again", "again", "done"]), run_id="r", checkpoint_id="c")
    new = decode(body({"runs": [["again", 2], ["done", 1]]}), run_id="r", checkpoint_id="c")
    assert old.ledger == new.ledger
    assert new.ledger.route("route", 1) == "again" and new.ledger.route("route", 2) == "done"
    with pytest.raises(CorruptRecord) as refused:
        decode(body({"runs": [["again", 10**12]]}), run_id="r", checkpoint_id="c")
    assert (refused.value.run_id, refused.value.checkpoint_id) == ("r", "c")
    assert "routes.route" in str(refused.value)


# -- the FlowPersistence API called directly -------------------------------------------------


def test_odd_arguments_to_the_pause_api_are_refused_as_its_other_methods_refuse_them(
    url: str,
) -> None:
    """A pause whose context names no method (`method_name=""`) is refused with the
    `ValueError` `save_state` gives an empty method name, before anything is written (it
    was stored, and its resume could answer no method); `clear_pending_feedback` with a
    flow id that is not a str raises the `TypeError` `load_pending_feedback` raises (it
    did nothing and said nothing)."""
    from crewai.flow.async_feedback.types import PendingFeedbackContext

    store = RemitFlowPersistence(url)
    flow_id = f"direct-{uuid.uuid4().hex}"
    nameless = PendingFeedbackContext(
        flow_id=flow_id, flow_class="x.F", method_name="", method_output=None, message="?"
    )
    with pytest.raises(ValueError, match="method name"):
        store.save_pending_feedback(flow_id, nameless, {"n": 1})
    assert store.load_state(flow_id) is None
    assert store.load_pending_feedback(flow_id) is None
    with pytest.raises(TypeError, match="must be a str"):
        store.load_pending_feedback(5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a str"):
        store.clear_pending_feedback(5)  # type: ignore[arg-type]
