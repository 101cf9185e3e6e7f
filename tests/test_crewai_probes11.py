"""Probes of round 11: what a flow had in flight when it paused, on every engine.

Written from the contract (P1: a resume skips no step of the pause's frontier;
L1: no run stays blocked by a claimant that drives nothing; P2: effects once)
against real CrewAI flows in forked children, with the helpers of
`test_crewai_flows`. CrewAI runs the listeners of one method side by side; when
one of them pauses for feedback, a sibling may still be running.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, child, entered, kickoff, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def side_flow(url: str, world: Path, *, wait_for_pause: bool, pay_in_side: bool) -> type[Any]:
    """prepare -> review (pauses) -> deliver (effect "ship"), and beside review
    prepare -> slow_side (effect "side" if `pay_in_side`) -> after_side (effect "after").
    `wait_for_pause`: slow_side goes on only once the pause is saved and its claim given
    up. Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    side, after, ship = (sink_effect(sink, k) for k in ("side", "after", "ship"))
    store = RemitFlowPersistence(url)

    def paused_and_free(flow_id: str) -> bool:
        head = store.checkpoints(flow_id)
        claim = store.remit.store.get_claim(flow_id, "main")
        return bool(head) and head[0].kind == "pause" and claim is not None and not claim.holder

    class Side(BaseModel):
        side: str | None = None
        after: str | None = None
        by: str | None = None
        shipped: str | None = None

    @persist(store)
    class SideFlow(Flow[Side]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen(prepare)
        def slow_side(self) -> None:
            journal.record("enter", "slow_side")
            deadline = time.monotonic() + 60
            while wait_for_pause and not paused_and_free(self.state.id):
                assert time.monotonic() < deadline, "the flow never paused"
                time.sleep(0.02)
            self.state.side = side() if pay_in_side else "unpaid"

        @listen(slow_side)
        def after_side(self) -> None:
            journal.record("enter", "after_side")
            self.state.after = after()

        @listen(review)
        def deliver(self) -> None:
            journal.record("enter", "deliver")
            assert self.last_human_feedback is not None
            self.state.by = self.last_human_feedback.feedback
            self.state.shipped = ship()

    return SideFlow


def resume_state(flow_class: type[Any], flow_id: str, value: str) -> dict[str, Any]:
    flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
    flow.resume(value)
    return dict(flow.state.model_dump())


def test_a_step_running_beside_a_pause_runs_in_the_resume(url: str, world: Path) -> None:
    """P1, P2: slow_side is still running when review pauses; its effect comes after the
    pause gave the flow up, so it is refused (fenced) and slow_side never completes. It is
    in the pause's frontier: the resume runs it again (its effect once) and what follows
    it, beside review's listener; the resumed flow is finished (a restart runs nothing)."""
    flow_id = f"side-{uuid.uuid4().hex}"

    def build(wait: bool = False) -> type[Any]:
        return side_flow(url, world, wait_for_pause=wait, pay_in_side=True)

    started = run(lambda: kickoff(build(wait=True), inputs={"id": flow_id}))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    assert applied(world) == {}  # slow_side's effect came after the pause: refused
    resumed = run(lambda: resume_state(build(), flow_id, "ann"))
    assert resumed.ok, resumed.summary()
    assert resumed.value["by"] == "ann"
    assert resumed.value["side"] and resumed.value["after"], resumed.value
    assert applied(world) == {"side": 1, "after": 1, "ship": 1}
    assert entered(world) == {
        "prepare": 1,
        "review": 1,
        "slow_side": 2,
        "after_side": 1,
        "deliver": 1,
    }
    again = run(lambda: kickoff(build(), inputs={"id": flow_id}))
    assert again.ok, again.summary()
    assert entered(world)["slow_side"] == 2 and entered(world)["after_side"] == 1
    assert applied(world) == {"side": 1, "after": 1, "ship": 1}


def test_a_step_completing_after_an_async_kickoff_paused_leaves_the_flow_free(
    url: str, world: Path
) -> None:
    """L1, P1: `await kickoff_async()` in a loop that lives on (a server): review pauses,
    and slow_side, still running, completes afterwards. It must not claim the flow again
    (the claim would be renewed for as long as the server lives, and no resumer could
    ever take the pause): its completion is saved for itself, the step behind it does not
    start there, and a resume from another process takes the pause, runs that step and
    finishes the flow, each effect once."""
    flow_id = f"side-{uuid.uuid4().hex}"
    released = world.parent / "released"

    def build(wait: bool = False) -> type[Any]:
        return side_flow(url, world, wait_for_pause=wait, pay_in_side=False)

    def server() -> str:
        flow_class = build(wait=True)

        async def serve() -> str:
            out = await flow_class(suppress_flow_events=True).kickoff_async(inputs={"id": flow_id})
            deadline = time.monotonic() + 90
            while not released.exists() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the loop lives on, as a server's does
            return type(out).__name__

        return asyncio.run(serve())

    holder = child(server)
    try:
        store = RemitFlowPersistence(url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # slow_side's completion is saved, after the pause
            saved = store.checkpoints(flow_id) if store.remit.head(flow_id) else []
            if saved and saved[0].method == "slow_side":
                break
            time.sleep(0.05)
        assert saved and saved[0].method == "slow_side", saved
        resumed = run(lambda: resume_state(build(), flow_id, "ann"))
    finally:
        released.touch()
    served = holder.wait(timeout=120)
    assert served.ok and served.value == "HumanFeedbackPending", served.summary()
    assert resumed.ok, resumed.summary()
    assert resumed.value["by"] == "ann" and resumed.value["after"], resumed.value
    assert applied(world) == {"after": 1, "ship": 1}
    assert entered(world) == {
        "prepare": 1,
        "review": 1,
        "slow_side": 1,
        "after_side": 1,
        "deliver": 1,
    }
