"""Probes of CrewAI flows as their users write them: joins, routers, async kickoffs, resumers.

Written from the contract (P1 no completed method runs again, P2 effects once,
P3 one token one fork, P4 invalid states are refused with the head unchanged,
P5 one resumer proceeds, L1 nothing stays claimed by a run that ended) against
real CrewAI flows in forked children, on every engine, with the fixtures and
helpers of `test_crewai_flows`. Among them the regressions of a kickoff or
resume cancelled by a timeout, a refused fork into a named id, and a
persistence made without the flow's schemas.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect
from test_crewai_flows import (
    applied,
    child,
    entered,
    kickoff,
    order_flow,
    paused_review,
    point,
    resume,
    review_flow,
    run,
)

from remit_core import effect
from remit_core.conformance.processes import Barrier
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence

ENGINES = ["sqlite", "postgresql", "redis"]


def join_flow(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> (left, right) -> and_ join (effect) -> route (a router) -> "go" ->
    ship (effect), or_(ship, "skip") -> finish; a dict state; built in a child."""
    from crewai.flow.flow import Flow, and_, listen, or_, router, start
    from crewai.flow.persistence import persist

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}

    pack = sink_effect(sink, "pack")

    send = sink_effect(sink, "send")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class JoinFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["log"] = ["prepare"]

        @listen(prepare)
        def left(self) -> None:
            journal.record("enter", "left")
            point(at, "left")
            self.state["left"] = True

        @listen(prepare)
        def right(self) -> None:
            journal.record("enter", "right")
            point(at, "right")
            self.state["right"] = True

        @listen(and_(left, right))
        def join(self) -> None:
            journal.record("enter", "join")
            point(at, "join.before")
            self.state["packed"] = pack()
            point(at, "join.after")

        @router(join)
        def route(self) -> str:
            journal.record("enter", "route")
            point(at, "route")
            return "go"

        @listen("go")
        def ship(self) -> None:
            journal.record("enter", "ship")
            point(at, "ship")
            self.state["sent"] = send()

        @listen(or_(ship, "skip"))
        def finish(self) -> str:
            journal.record("enter", "finish")
            point(at, "finish")
            self.state["done"] = True
            return "finished"

    return JoinFlow


@pytest.mark.parametrize(
    ("killed_at", "again"),
    [
        ("join.before", {"join"}),
        ("join.after", {"join"}),
        ("route", {"route"}),
        ("ship", {"ship"}),
        ("finish", {"finish"}),
    ],
)
def test_a_restart_after_an_and_join_and_a_router_runs_each_method_once_more_at_most(
    url: str, world: Path, killed_at: str, again: set[str]
) -> None:
    """P1, P2: SIGKILLed behind an `and_` join, a router and an `or_` listener, the
    restart runs only the method that was in flight, and every effect applies once."""
    flow_id = f"join-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(join_flow(url, world, {killed_at: "kill"}), inputs={"id": flow_id})
    )
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)
    done = run(lambda: kickoff(join_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    state = done.value["state"]
    assert state["done"] is True and state["left"] and state["right"], state
    methods = ["prepare", "left", "right", "join", "route", "ship", "finish"]
    assert entered(world) == {m: 2 if m in again else 1 for m in methods}
    assert applied(world) == {"pack": 1, "send": 1}


def test_a_restart_after_one_side_of_an_and_join_runs_the_other_then_the_join(
    url: str, world: Path
) -> None:
    """P1: killed in `right` after `left` completed and was saved, the restart replays
    `left`, runs `right`, and the `and_` join still fires, once."""
    flow_id = f"join-side-{uuid.uuid4().hex}"
    marker = world.parent / "never"

    def left_saved() -> None:
        persistence = RemitFlowPersistence(url)
        while persistence.remit.head(flow_id) is None or "left" not in (
            persistence.checkpoints(flow_id)[0].completed
        ):
            time.sleep(0.02)

    worker = child(
        lambda: kickoff(join_flow(url, world, {"right": f"wait:{marker}"}), inputs={"id": flow_id})
    )
    assert run(left_saved).ok
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait(timeout=60).status == "killed"
    time.sleep(1.2)
    done = run(lambda: kickoff(join_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert entered(world) == {
        "prepare": 1,
        "left": 1,
        "right": 2,
        "join": 1,
        "route": 1,
        "ship": 1,
        "finish": 1,
    }
    assert applied(world) == {"pack": 1, "send": 1}


def test_two_async_kickoffs_of_one_id_in_one_loop_let_one_drive(url: str, world: Path) -> None:
    """P5 within a process: two flow instances `kickoff_async(inputs={"id": X})` at once
    under `asyncio.gather`; one drives X, the other is refused and runs nothing."""
    flow_id = f"gather-{uuid.uuid4().hex}"

    def body() -> Any:
        import asyncio

        flow_class = join_flow(url, world)

        async def one() -> Any:
            flow = flow_class(suppress_flow_events=True)
            try:
                await flow.kickoff_async(inputs={"id": flow_id})
                return "ok"
            except Exception as exc:
                return type(exc).__name__

        async def both() -> Any:
            return await asyncio.gather(one(), one())

        return asyncio.run(both())

    out = run(body)
    assert out.ok, out.summary()
    assert sorted(out.value) == ["ResumeConflict", "ok"], out.value
    assert applied(world) == {"pack": 1, "send": 1}
    assert entered(world)["prepare"] == 1


def test_k_processes_resuming_one_pause_two_ways_let_one_proceed(url: str, world: Path) -> None:
    """P5: of k processes, some `from_pending(...).resume(...)` and some
    `kickoff(inputs={"id": ...})` at once on one paused flow: at most one resume
    proceeds, the racers that lose get `ResumeConflict` and enter no method."""
    flow_id = paused_review(url, world)
    k = 4
    barrier = Barrier(k)

    def resumer(i: int) -> Callable[[], Any]:
        def body() -> Any:
            flow_class = review_flow(url, world)
            barrier.wait()
            if i % 2:
                return {"how": "kickoff", **kickoff(flow_class, inputs={"id": flow_id})}
            return {"how": "resume", "state": resume(flow_class, flow_id, f"reviewer-{i}")}

        return body

    workers = [child(resumer(i), barrier=barrier) for i in range(k)]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    winners = [o for o in outcomes if o.ok]
    # A kickoff that finds the pause again consumes nothing and ends at once; one
    # that ran after another ended is not a race lost: only one resume may consume.
    resumed = [o for o in winners if o.value["how"] == "resume"]
    assert winners and len(resumed) <= 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    if resumed:
        assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
        assert applied(world) == {"ship": 1}
    else:
        assert entered(world) == {"prepare": 1}
        assert applied(world) == {}


def test_a_dict_state_made_invalid_mid_run_is_refused_with_the_head_unchanged(
    url: str, world: Path
) -> None:
    """P4: a dict state checked by `state_schema` becomes invalid in the second method:
    `CheckpointInvalid` naming the field, the head is the first method's, and a restart
    runs the second method again (its effect once)."""
    flow_id = f"schema-{uuid.uuid4().hex}"
    schema = {
        "type": "object",
        "properties": {"amount": {"type": "integer", "minimum": 0}},
    }

    def build(bad: bool) -> type[Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

        charge = sink_effect(sink, "charge")

        @persist(RemitFlowPersistence(url, lease=1.0, state_schema=schema))
        class SchemaFlow(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                journal.record("enter", "prepare")
                self.state["amount"] = 10

            @listen(prepare)
            def adjust(self) -> None:
                journal.record("enter", "adjust")
                self.state["receipt"] = charge()
                self.state["amount"] = -1 if bad else 5

        return SchemaFlow

    def head() -> dict[str, Any]:
        saved = RemitFlowPersistence(url).checkpoints(flow_id)
        return {"methods": [s.method for s in saved], "amount": saved[0].state["amount"]}

    bad = run(lambda: kickoff(build(True), inputs={"id": flow_id}))
    assert bad.raised("CheckpointInvalid"), bad.summary()
    assert "amount" in bad.error_text()
    assert run(head).value == {"methods": ["prepare"], "amount": 10}
    good = run(lambda: kickoff(build(False), inputs={"id": flow_id}))
    assert good.ok, good.summary()
    assert good.value["state"]["amount"] == 5
    assert entered(world) == {"prepare": 1, "adjust": 2}
    assert applied(world) == {"charge": 1}


def slow_flow(url: str, world: Path) -> type[Any]:
    """prepare -> review (human feedback: pauses) -> slow (async: an effect, then a long
    wait while `state["slow"]` is unset) -> done; built in a child."""
    import asyncio

    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

    pack = sink_effect(sink, "pack")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class SlowFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        async def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Pack it?", provider=Later())
        def review(self) -> str:
            return "parcel"

        @listen(review)
        async def slow(self) -> None:
            journal.record("enter", "slow")
            self.state["packed"] = pack()
            self.state["by"] = self.last_human_feedback.feedback
            if not self.state.get("quick"):
                await asyncio.sleep(30)

        @listen(slow)
        def done(self) -> None:
            journal.record("enter", "done")
            self.state["done"] = True

    return SlowFlow


def test_a_cancelled_async_kickoff_and_resume_give_the_flow_back(url: str, world: Path) -> None:
    """L1: CrewAI ends no run that a timeout cancels, so its claim was renewed for as long
    as the process lived: every later kickoff got `ResumeConflict`. A cancelled
    `resume_async` and a cancelled `kickoff_async` now give the flow back at once; the
    next kickoff in the same process continues it (P1), the effect applied once (P2)."""
    flow_id = f"cancel-{uuid.uuid4().hex}"

    def body() -> Any:
        import asyncio

        flow_class = slow_flow(url, world)

        async def timed_out(run: Any) -> str:
            try:
                await asyncio.wait_for(run, 0.5)
            except TimeoutError:
                return "timed out"
            return "finished"

        async def go() -> dict[str, Any]:
            paused = await flow_class(suppress_flow_events=True).kickoff_async(
                inputs={"id": flow_id}
            )
            resumer = flow_class.from_pending(
                flow_id, flow_class.__flow_persistence_config__.persistence
            )
            first = await timed_out(resumer.resume_async("ann"))
            second = await timed_out(
                flow_class(suppress_flow_events=True).kickoff_async(inputs={"id": flow_id})
            )
            flow = flow_class(suppress_flow_events=True)
            await flow.kickoff_async(inputs={"id": flow_id, "quick": True})
            return {
                "paused": type(paused).__name__,
                "runs": [first, second],
                "state": dict(flow.state),
            }

        return asyncio.run(go())

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["paused"] == "HumanFeedbackPending"
    assert out.value["runs"] == ["timed out", "timed out"]
    state = out.value["state"]
    assert state["done"] is True and state["by"] == "ann", state
    assert entered(world) == {"prepare": 1, "slow": 3, "done": 1}
    assert applied(world) == {"pack": 1}


def test_a_step_still_running_after_its_kickoff_was_cancelled_holds_nothing(
    url: str, world: Path
) -> None:
    """L1: a sync step runs on in its worker thread after a timeout cancelled its kickoff,
    and then asks (CrewAI saves the state first): that save takes the claim only for
    its own write, so the next kickoff in the process continues the flow (P1)."""
    flow_id = f"ask-{uuid.uuid4().hex}"

    def body() -> Any:
        import asyncio

        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        journal = Journal(WorldDB(world))

        class Yes:
            def request_input(self, message: str, flow: Any, metadata: Any = None) -> str:
                return "yes"

        @persist(RemitFlowPersistence(url, lease=1.0))
        class AskFlow(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                journal.record("enter", "prepare")

            @listen(prepare)
            def question(self) -> None:
                journal.record("enter", "question")
                if not self.state.get("quick"):
                    time.sleep(1.0)
                self.state["answer"] = self.ask("Go on?")

        async def go() -> dict[str, Any]:
            try:
                await asyncio.wait_for(
                    AskFlow(suppress_flow_events=True, input_provider=Yes()).kickoff_async(
                        inputs={"id": flow_id}
                    ),
                    0.3,
                )
            except TimeoutError:
                pass
            await asyncio.sleep(1.5)  # the step's thread asks and ends meanwhile
            flow = AskFlow(suppress_flow_events=True, input_provider=Yes())
            await flow.kickoff_async(inputs={"id": flow_id, "quick": True})
            return dict(flow.state)

        return asyncio.run(go())

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["answer"] == "yes"
    assert entered(world) == {"prepare": 1, "question": 2}


def test_a_fork_behind_an_and_join_replays_the_join_and_runs_the_rest_on_its_branch(
    url: str, world: Path
) -> None:
    """P3, P2: forked with a token at the checkpoint the `and_` join wrote, the fork
    replays the join (its effect is the shared prefix's, not applied again) and runs
    the router and what follows on its own branch; the same token gives the same fork."""
    source = f"join-fork-{uuid.uuid4().hex}"
    assert run(lambda: kickoff(join_flow(url, world), inputs={"id": source})).ok

    def body() -> dict[str, Any]:
        persistence = RemitFlowPersistence(url)
        joined = next(c for c in persistence.checkpoints(source) if c.method == "join")
        forked = persistence.fork(source, fork_token="again", checkpoint_id=joined.checkpoint_id)
        again = persistence.fork(source, fork_token="again", checkpoint_id=joined.checkpoint_id)
        result = kickoff(join_flow(url, world), inputs={"id": forked})
        return {"same": forked == again, "forked": forked, "state": result["state"]}

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["same"] and out.value["forked"] != source
    assert out.value["state"]["done"] is True
    assert entered(world) == {
        "prepare": 1,
        "left": 1,
        "right": 1,
        "join": 1,
        "route": 2,
        "ship": 2,
        "finish": 2,
    }
    assert applied(world) == {"pack": 1, "send": 2}


def test_k_processes_forking_with_one_token_at_once_make_one_fork(url: str, world: Path) -> None:
    """P3: k processes `kickoff(restore_from_state_id=...)` a paused flow under one fork
    token at once: one fork, named alike in every process that was not refused, and the
    source still waits for its own feedback."""
    source = paused_review(url, world)
    k = 4
    barrier = Barrier(k)

    def forker() -> Any:
        from remit_crewai import fork_token

        flow_class = review_flow(url, world)
        barrier.wait()
        with fork_token("one"):
            return kickoff(flow_class, restore_from_state_id=source)

    workers = [child(forker, barrier=barrier) for _ in range(k)]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    made = {o.value["id"] for o in outcomes if o.ok}
    assert len(made) == 1 and source not in made, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    assert run(lambda: len(RemitFlowPersistence(url).remit.branches(source))).value == 2
    answered = run(lambda: resume(review_flow(url, world), source, "ann"))
    assert answered.ok and answered.value["approved_by"] == "ann", answered.summary()
    on_fork = run(lambda: resume(review_flow(url, world), made.pop(), "bob"))
    assert on_fork.ok and on_fork.value["approved_by"] == "bob", on_fork.summary()
    assert applied(world) == {"ship": 2}


def loop_review_flow(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> review (human feedback: pauses) -> decide (a router: the feedback is the
    route) -> "revise" -> rework (effect) -> "redrafted" -> review again ... -> "approve"
    -> ship (effect); built in a child."""
    from crewai.flow.flow import Flow, listen, or_, router, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}

    redraft = sink_effect(sink, "redraft")

    send = sink_effect(sink, "send")

    class Draft(BaseModel):
        drafts: int = 0
        answers: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class LoopReview(Flow[Draft]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(or_(prepare, "redrafted"))
        @human_feedback(message="Good?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return f"draft {self.state.drafts}"

        @router(review)
        def decide(self) -> str:
            journal.record("enter", "decide")
            assert self.last_human_feedback is not None
            self.state.answers.append(self.last_human_feedback.feedback)
            return self.last_human_feedback.feedback

        @router("revise")
        def rework(self) -> str:
            journal.record("enter", "rework")
            redraft()
            point(at, f"rework.{self.state.drafts}")
            self.state.drafts += 1
            return "redrafted"

        @listen("approve")
        def ship(self) -> None:
            journal.record("enter", "ship")
            send()

    return LoopReview


def test_a_feedback_loop_takes_each_pause_once_across_a_crash(url: str, world: Path) -> None:
    """P5, P1, P2: one feedback method pauses twice in a loop. The first answer routes to
    rework, which is SIGKILLed; the restart pauses again without asking the first pause
    again; the first answer presented again is refused; the second answer finishes."""
    started = run(lambda: kickoff(loop_review_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    dying = run(
        lambda: resume(loop_review_flow(url, world, {"rework.0": "kill"}), flow_id, "revise")
    )
    assert dying.status == "killed", dying.summary()
    time.sleep(1.2)
    again = run(lambda: kickoff(loop_review_flow(url, world), inputs={"id": flow_id}))
    assert again.ok and again.value["out"] == "HumanFeedbackPending", again.summary()
    assert again.value["state"]["drafts"] == 1
    done = run(lambda: resume(loop_review_flow(url, world), flow_id, "approve"))
    assert done.ok, done.summary()
    assert done.value["drafts"] == 1 and done.value["answers"] == ["revise", "approve"]
    stale = run(lambda: resume(loop_review_flow(url, world), flow_id, "revise"))
    assert stale.raised("ResumeConflict"), stale.summary()
    assert entered(world) == {"prepare": 1, "review": 2, "decide": 2, "rework": 2, "ship": 1}
    assert applied(world) == {"redraft": 1, "send": 1}


@pytest.mark.parametrize("token", [None, "named"])
def test_a_refused_fork_into_a_named_id_leaves_that_id_free(
    url: str, world: Path, token: str | None
) -> None:
    """P3, L1: `kickoff(inputs={"id": new}, restore_from_state_id=src)` is refused
    (`ForkWithoutIntent`, with or without a token: the fork's id is the token's). The
    kickoff had claimed `new` before CrewAI gave the flow that id, and kept it for as long
    as the process lived; now the next kickoff of `new` runs at once, and src is as it was."""
    source = f"src-{uuid.uuid4().hex}"
    new = f"new-{uuid.uuid4().hex}"
    assert run(lambda: kickoff(order_flow(url, world), inputs={"id": source})).ok

    def body() -> dict[str, Any]:
        from remit_core import ForkWithoutIntent
        from remit_crewai import fork_token

        flow_class = order_flow(url, world)
        try:
            with fork_token(token) if token else contextlib.nullcontext():
                kickoff(flow_class, inputs={"id": new}, restore_from_state_id=source)
            refused = "no"
        except ForkWithoutIntent:
            refused = "ForkWithoutIntent"
        fresh = kickoff(flow_class, inputs={"id": new})
        return {
            "refused": refused,
            "state": fresh["state"],
            "branches": len(RemitFlowPersistence(url).remit.branches(source)),
        }

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["refused"] == "ForkWithoutIntent"
    assert out.value["state"]["shipped"] is True and out.value["branches"] == 1
    assert entered(world) == {"prepare": 2, "adjust": 2, "charge": 2, "ship": 2}


def test_a_persistence_made_without_the_flows_schemas_still_checks_them(
    url: str, world: Path
) -> None:
    """P4: a paused flow whose persistence checks a `state_schema` and a `feedback_schema`.
    An operator's `edit_state`, and `from_pending`, through a `RemitFlowPersistence(url)`
    made without them (in another process) wrote `amount=-3` and consumed feedback the
    schema refuses; now the schemas the flow's checkpoints record are checked: the edit
    and the feedback are refused, nothing written, and valid ones go through."""
    schema = {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 0}}}
    answers = {"type": "string", "enum": ["yes", "no"]}

    def build() -> type[Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.human_feedback import human_feedback
        from crewai.flow.persistence import persist

        sink = EffectSink(WorldDB(world))

        @effect(reconcile=sink.reconcile)
        def charge(amount: int, *, idempotency_key: str) -> str:
            return sink.apply(f"charge-{amount}", idempotency_key)

        checked = RemitFlowPersistence(url, lease=1.0, state_schema=schema, feedback_schema=answers)

        @persist(checked)
        class PayFlow(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                self.state["amount"] = 10

            @listen(prepare)
            @human_feedback(message="Pay?", provider=Later())
            def review(self) -> str:
                return "invoice"

            @listen(review)
            def pay(self) -> None:
                charge(self.state["amount"])

        return PayFlow

    started = run(lambda: kickoff(build()))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]

    def edits() -> dict[str, Any]:
        from remit_core import CheckpointInvalid

        plain = RemitFlowPersistence(url)
        before = plain.checkpoints(flow_id)[0].checkpoint_id
        try:
            plain.edit_state(flow_id, {"amount": -3})
            invalid = "written"
        except CheckpointInvalid as exc:
            invalid = str(exc.field)
        unchanged = plain.checkpoints(flow_id)[0].checkpoint_id == before
        plain.edit_state(flow_id, {"amount": 25})
        return {"invalid": invalid, "unchanged": unchanged}

    edited = run(edits)
    assert edited.ok, edited.summary()
    assert edited.value == {"invalid": "amount", "unchanged": True}

    def resumed(value: str) -> Callable[[], Any]:
        def body() -> dict[str, Any]:
            flow = build().from_pending(flow_id, RemitFlowPersistence(url, lease=1.0))
            flow.resume(value)
            return dict(flow.state)

        return body

    refused = run(resumed("maybe"))
    assert refused.raised("CheckpointInvalid"), refused.summary()
    assert applied(world) == {}
    done = run(resumed("yes"))
    assert done.ok and done.value["amount"] == 25, done.summary()
    assert applied(world) == {"charge-25": 1}
