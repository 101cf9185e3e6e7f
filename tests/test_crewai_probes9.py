"""Probes of round 9: CrewAI flows on every engine.

Written from the contract (P1: a restart runs no completed step again and a
finished flow's restart returns what its last step returned; P5: a pause's
feedback is consumed once, and a pause is never lost) against real CrewAI flows
in forked children, with the helpers of `test_crewai_flows`.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import Later, stored_flow
from test_crewai_flows import applied, entered, kickoff, resume, review_flow, run

from remit_core import failpoints
from remit_core.conformance.world import Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def test_a_pause_whose_process_died_before_opening_its_interrupt_is_resumed(
    url: str, world: Path
) -> None:
    """P5, L1: SIGKILL after the pause's checkpoint committed and before its interrupt was
    opened. The pause is not lost: once the lease ran out, `from_pending` opens the
    interrupt the paused head implies and the resume consumes it once; a second resume
    is refused."""

    flow_id = f"paused-{uuid.uuid4().hex}"

    def dying() -> dict[str, Any]:
        failpoints.arm("checkpoint.after_commit", "kill@2")  # prepare's save, then the pause's
        return kickoff(review_flow(url, world, lease=1.0), inputs={"id": flow_id})

    crashed = run(dying)
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead kickoff's claim runs out
    first = run(lambda: resume(review_flow(url, world, lease=1.0), flow_id, "ann"))
    assert first.ok and first.value["approved_by"] == "ann", first.summary()
    second = run(lambda: resume(review_flow(url, world, lease=1.0), flow_id, "eve"))
    assert second.raised("ResumeConflict"), second.summary()
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


def test_a_pause_whose_interrupt_failed_to_open_is_resumed_at_once(url: str, world: Path) -> None:
    """P5: the store fails after the pause's checkpoint committed, before its interrupt was
    opened (here a failpoint raising; a lost connection alike). The kickoff fails and gives
    the flow back, and `from_pending` right away opens the interrupt and resumes once."""
    flow_id = f"paused-{uuid.uuid4().hex}"

    def failing() -> dict[str, Any]:
        failpoints.arm("checkpoint.after_commit", "raise@2")
        return kickoff(review_flow(url, world), inputs={"id": flow_id})

    failed = run(failing)
    assert failed.raised("FailpointHit"), failed.summary()
    first = run(lambda: resume(review_flow(url, world), flow_id, "ann"))
    assert first.ok and first.value["approved_by"] == "ann", first.summary()
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


def verdict_flow(url: str, world: Path) -> type[Any]:
    """prepare -> review (`@human_feedback(emit=...)`, pauses; returns a dict), with no
    listener on its outcomes: the flow ends on the feedback method; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))

    @persist(RemitFlowPersistence(url))
    class VerdictFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(
            message="Keep it?", emit=["keep", "drop"], default_outcome="keep", provider=Later()
        )
        def review(self) -> dict[str, Any]:
            journal.record("enter", "review")
            return {"parcel": "box", "weight": 3}

    return VerdictFlow


def test_a_finished_flow_that_ended_on_feedback_returns_its_output_again(
    url: str, world: Path
) -> None:
    """P1: a flow that ended on an `emit=` feedback method, kicked off again, runs nothing
    and returns what its resume returned (the method's output), as a flow that ended on
    a plain step does."""
    started = run(lambda: kickoff(verdict_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]

    def resumed() -> Any:
        flow_class = verdict_flow(url, world)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        return flow.resume("")

    first = run(resumed)
    assert first.ok, first.summary()
    again = run(
        lambda: verdict_flow(url, world)(suppress_flow_events=True).kickoff(inputs={"id": flow_id})
    )
    assert again.ok, again.summary()
    assert first.value == again.value == {"parcel": "box", "weight": 3}
    assert entered(world) == {"prepare": 1, "review": 1}


def total_flow(url: str, *, state_schema: dict[str, Any] | None = None) -> type[Any]:
    """prepare -> total (returns a dict); a dict state; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    @persist(RemitFlowPersistence(url, state_schema=state_schema))
    class TotalFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            self.state["items"] = 2

        @listen(prepare)
        def total(self) -> dict[str, int]:
            return {"total": self.state["items"] * 10}

    return TotalFlow


def test_inputs_given_to_a_finished_flows_restart_are_kept(url: str) -> None:
    """`kickoff(inputs={"id": X, "note": ...})` of a finished flow runs nothing (P1) but
    merges the input into the state: the flow id loads that state afterwards, from any
    process, as with CrewAI's own backend (which runs every step again and saves it);
    an operator's edit and a later restart keep returning the last step's output."""
    flow_id = f"total-{uuid.uuid4().hex}"
    done = run(lambda: kickoff(total_flow(url), inputs={"id": flow_id}))
    assert done.ok, done.summary()

    def restarted() -> dict[str, Any]:
        flow = total_flow(url)(suppress_flow_events=True)
        out = flow.kickoff(inputs={"id": flow_id, "note": "late"})
        return {"out": out, "state": dict(flow.state)}

    again = run(restarted)
    assert again.ok, again.summary()
    assert again.value["out"] == {"total": 20}
    assert again.value["state"] == {"id": flow_id, "items": 2, "note": "late"}

    def later() -> dict[str, Any]:
        store = RemitFlowPersistence(url)
        loaded = store.load_state(flow_id)
        store.edit_state(flow_id, {"checked": True})
        flow = total_flow(url)(suppress_flow_events=True)
        return {
            "loaded": loaded,
            "out": flow.kickoff(inputs={"id": flow_id}),
            "kinds": [c.kind for c in store.checkpoints(flow_id)],
        }

    seen = run(later)
    assert seen.ok, seen.summary()
    assert seen.value["loaded"] == {"id": flow_id, "items": 2, "note": "late"}
    assert seen.value["out"] == {"total": 20}
    assert seen.value["kinds"] == ["edit", "edit", "step", "step"]


def test_an_invalid_input_to_a_finished_flows_restart_is_refused(url: str) -> None:
    """P4: the input a finished flow's restart merges is validated like a save; one that
    fails the state schema is `CheckpointInvalid` naming the field, and the head stays."""
    schema = {"type": "object", "properties": {"note": {"type": "string"}}}
    flow_id = f"total-{uuid.uuid4().hex}"
    done = run(lambda: kickoff(total_flow(url, state_schema=schema), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    bad = run(
        lambda: kickoff(total_flow(url, state_schema=schema), inputs={"id": flow_id, "note": 5})
    )
    assert bad.raised("CheckpointInvalid"), bad.summary()
    assert "note" in bad.error_text()

    seen = run(lambda: stored_flow(url, flow_id))
    assert seen.ok, seen.summary()
    assert seen.value == {"state": {"id": flow_id, "items": 2}, "kinds": ["step", "step"]}
