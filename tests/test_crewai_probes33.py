"""Probes of round 33: workflow versions and CrewAI's default persistence, through
CrewAI's public API. A flow written by one deployment (`workflow_version="v1"`) is
continued, resumed, forked and edited by others: a deployment of another version, one that
accepts the old one, an operator's persistence that declares no version, and a method
`@persist`ed by such a persistence. And Remit registered as CrewAI's default persistence
(`set_flow_persistence_factory`), resumed by CrewAI's simple `Flow.from_pending(flow_id)`.

Written from the contract (P4: a checkpoint written by a workflow version the reader does
not accept is refused, never returned as a state, and a refusal writes nothing; P5 and L1:
one of k concurrent resumers proceeds, the others get `ResumeConflict`, and a refused
resume leaves the pause pending and the flow free; P3: a refused fork makes no branch;
P1, P2) against real CrewAI flows in forked children, with the helpers of
`test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later
from test_crewai_flows import applied, entered, point, run

from remit_core.conformance.processes import Barrier, fork
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_core.effects import effect
from remit_crewai import RemitFlowPersistence, fork_token


def versioned_flow(url: str, world: Path, version: str, *, accepts: list[str] | None = None):  # type: ignore[no-untyped-def]
    """prepare -> review (pauses for feedback) -> approve -> ship (effect), a model state,
    persisted by workflow version `version`; the same class name for every version, as a
    deployment's flow keeps its name; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

    @effect(reconcile=sink.reconcile)
    def ship_parcel(*, idempotency_key: str) -> str:
        return sink.apply("ship", idempotency_key)

    class Parcel(BaseModel):
        note: str = ""
        approved_by: str | None = None
        receipt: str | None = None

    store = RemitFlowPersistence(url, workflow_version=version, accepts=accepts or [])

    @persist(store)
    class ParcelFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen(review)
        def approve(self) -> None:
            journal.record("enter", "approve")
            assert self.last_human_feedback is not None
            self.state.approved_by = self.last_human_feedback.feedback

        @listen(approve)
        def ship(self) -> None:
            journal.record("enter", "ship")
            self.state.receipt = ship_parcel()

    return ParcelFlow, Parcel


def _refusal(call: Any) -> dict[str, Any] | None:
    """How `call()` was refused (class, run id, message), or None if it was not."""
    try:
        call()
    except Exception as exc:
        return {
            "class": type(exc).__name__,
            "run_id": getattr(exc, "run_id", None),
            "message": str(exc),
        }
    return None


def paused_by(url: str, world: Path, version: str) -> str:
    """A flow of workflow version `version` paused at its review; returns its id."""

    def body() -> str:
        flow_class, _ = versioned_flow(url, world, version)
        flow = flow_class(suppress_flow_events=True)
        out = flow.kickoff(inputs={"id": f"parcel-{uuid.uuid4().hex}"})
        assert type(out).__name__ == "HumanFeedbackPending", out
        return str(flow.flow_id)

    made = run(body)
    assert made.ok, made.summary()
    return str(made.value)


def resume_with(url: str, world: Path, version: str, flow_id: str, feedback: str) -> Any:
    """`from_pending` + `resume` by the deployment of `version`, in a child."""

    def body() -> dict[str, Any]:
        flow_class, _ = versioned_flow(url, world, version)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        flow.resume(feedback)
        return dict(flow.state.model_dump())

    return run(body)


def test_an_operators_edit_without_a_version_keeps_the_flows_own_version(
    url: str, world: Path
) -> None:
    """P4: an operator edits a paused v1 flow through a persistence made without
    `workflow_version` (an unversioned reader accepts every version). The edit runs no
    workflow code and completes no method: v1, which wrote the flow, still resumes it,
    with the edit, and its effect applies once. Before, the edit was stamped with the
    operator's empty version, and from then on v1's `from_pending`, `load_state` and
    `checkpoints` raised `VersionMismatch` for its own flow: an edit locked the flow's own
    deployment out."""
    flow_id = paused_by(url, world, "v1")

    def edit() -> dict[str, Any]:
        _, model = versioned_flow(url, world, "v1")
        operator = RemitFlowPersistence(url)
        operator.edit_state(flow_id, {"note": "fragile"}, state_type=model)
        v1 = RemitFlowPersistence(url, workflow_version="v1")
        return {
            "load_state": v1.load_state(flow_id),
            "kinds": [c.kind for c in v1.checkpoints(flow_id)],
            "pending": v1.load_pending_feedback(flow_id) is not None,
        }

    edited = run(edit)
    assert edited.ok, edited.error_text()
    assert edited.value["load_state"]["note"] == "fragile", edited.value
    assert edited.value["kinds"][0] == "edit" and edited.value["pending"], edited.value

    resumed = resume_with(url, world, "v1", flow_id, "alice")
    assert resumed.ok, resumed.error_text()
    assert resumed.value["note"] == "fragile" and resumed.value["approved_by"] == "alice"
    assert resumed.value["receipt"] is not None, resumed.value
    assert applied(world) == {"ship": 1}
    assert entered(world) == {"prepare": 1, "review": 1, "approve": 1, "ship": 1}


def test_an_operators_edit_of_a_finished_flow_still_restarts_under_its_version(
    url: str, world: Path
) -> None:
    """P4, P1: a finished v1 flow edited by an unversioned operator persistence is still
    v1's: v1's restart by id runs nothing and returns the edited state. Before, the
    restart raised `VersionMismatch` (the edit was stamped with no version)."""
    flow_id = paused_by(url, world, "v1")
    resumed = resume_with(url, world, "v1", flow_id, "bob")
    assert resumed.ok, resumed.error_text()

    def edit_and_restart() -> dict[str, Any]:
        flow_class, model = versioned_flow(url, world, "v1")
        RemitFlowPersistence(url).edit_state(flow_id, {"note": "late"}, state_type=model)
        flow = flow_class(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return dict(flow.state.model_dump())

    restarted = run(edit_and_restart)
    assert restarted.ok, restarted.error_text()
    assert restarted.value["note"] == "late" and restarted.value["approved_by"] == "bob"
    assert applied(world) == {"ship": 1}
    assert entered(world) == {"prepare": 1, "review": 1, "approve": 1, "ship": 1}


def test_another_version_is_refused_everywhere_and_the_pause_stays_for_its_own(
    url: str, world: Path
) -> None:
    """P4, P5, L1, P3: a v2 deployment that does not accept v1 meets a paused v1 flow.
    Its `from_pending` (with `resume` or `resume_async`), its restart by id (`kickoff` or
    `kickoff_async`), its `load_pending_feedback` and its fork (with a token) each raise
    `VersionMismatch` naming the run; nothing runs or is written, no fork branch is made,
    the flow is free at once, and v1 then resumes its pause with its effect applied
    once."""
    flow_id = paused_by(url, world, "v1")

    def other_version() -> dict[str, Any]:
        flow_class, _ = versioned_flow(url, world, "v2")
        v2 = flow_class.__flow_persistence_config__.persistence
        v1 = RemitFlowPersistence(url, workflow_version="v1")
        before = [c.checkpoint_id for c in v1.checkpoints(flow_id)]

        def restart() -> None:
            flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id})

        def restart_async() -> None:
            asyncio.run(flow_class(suppress_flow_events=True).kickoff_async(inputs={"id": flow_id}))

        def resume_async() -> None:
            asyncio.run(flow_class.from_pending(flow_id, v2).resume_async("mallory"))

        def forked() -> None:
            with fork_token("t-v2"):
                flow_class(suppress_flow_events=True).kickoff(restore_from_state_id=flow_id)

        refused = {
            "from_pending": _refusal(
                lambda: flow_class.from_pending(flow_id, v2).resume("mallory")
            ),
            "restart": _refusal(restart),
            "restart_async": _refusal(restart_async),
            "resume_async": _refusal(resume_async),
            "load_pending": _refusal(lambda: v2.load_pending_feedback(flow_id)),
            "store_fork": _refusal(lambda: v2.fork(flow_id, fork_token="t-v2")),
            "kickoff_fork": _refusal(forked),
        }
        return {
            "refused": refused,
            "after": [c.checkpoint_id for c in v1.checkpoints(flow_id)],
            "before": before,
            "fork_made": v1.remit.fork_branch(flow_id, "t-v2") is not None,
        }

    out = run(other_version)
    assert out.ok, out.error_text()
    for name, refused in out.value["refused"].items():
        assert refused is not None and refused["class"] == "VersionMismatch", (name, refused)
        assert refused["run_id"] == flow_id, (name, refused)
    assert out.value["after"] == out.value["before"], out.value
    assert out.value["fork_made"] is False
    assert entered(world) == {"prepare": 1, "review": 1}

    resumed = resume_with(url, world, "v1", flow_id, "alice")
    assert resumed.ok, resumed.error_text()
    assert resumed.value["approved_by"] == "alice" and resumed.value["receipt"] is not None
    assert applied(world) == {"ship": 1}
    assert entered(world) == {"prepare": 1, "review": 1, "approve": 1, "ship": 1}


def test_a_version_that_accepts_the_old_one_resumes_it_and_the_old_one_then_stops(
    url: str, world: Path
) -> None:
    """P4: v2 with `accepts=["v1"]` resumes v1's pause; its checkpoints are v2's, so v1,
    which does not accept v2, is refused the finished flow by restart (nothing runs) while
    v2 restarts it, running nothing, the effect applied once."""
    flow_id = paused_by(url, world, "v1")

    def upgrade() -> dict[str, Any]:
        flow_class, _ = versioned_flow(url, world, "v2", accepts=["v1"])
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        flow.resume("carol")
        return dict(flow.state.model_dump())

    upgraded = run(upgrade)
    assert upgraded.ok, upgraded.error_text()
    assert upgraded.value["approved_by"] == "carol"

    def old_then_new() -> dict[str, Any]:
        old, _ = versioned_flow(url, world, "v1")
        new, _ = versioned_flow(url, world, "v2", accepts=["v1"])
        refused = _refusal(lambda: old(suppress_flow_events=True).kickoff(inputs={"id": flow_id}))
        flow = new(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return {"refused": refused, "state": dict(flow.state.model_dump())}

    out = run(old_then_new)
    assert out.ok, out.error_text()
    assert out.value["refused"] is not None, out.value
    assert out.value["refused"]["class"] == "VersionMismatch", out.value
    assert out.value["state"]["approved_by"] == "carol"
    assert applied(world) == {"ship": 1}
    assert entered(world) == {"prepare": 1, "review": 1, "approve": 1, "ship": 1}


def method_persisted_flow(url: str, world: Path, points: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """prepare -> label (also `@persist`ed by a persistence of this store made without a
    version, as a user adds `verbose=True` to one method) -> charge (effect; crash point
    "charge") -> done; the class persisted by workflow version v1; a dict state; built in
    a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}

    @effect(reconcile=sink.reconcile)
    def charge_card(*, idempotency_key: str) -> str:
        return sink.apply("charge", idempotency_key)

    @persist(RemitFlowPersistence(url, lease=1.0, workflow_version="v1"))
    class LabelFlow(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["amount"] = 7

        @listen(prepare)
        @persist(RemitFlowPersistence(url), verbose=True)
        def label(self) -> None:
            journal.record("enter", "label")
            self.state["label"] = "fragile"

        @listen(label)
        def charge(self) -> None:
            journal.record("enter", "charge")
            point(at, "charge")
            self.state["receipt"] = charge_card()

        @listen(charge)
        def done(self) -> None:
            journal.record("enter", "done")
            self.state["done"] = True

    return LabelFlow


def test_a_method_persisted_without_a_version_saves_under_its_flows_version(
    url: str, world: Path
) -> None:
    """P4, P1, P2: in a flow whose class is persisted by v1, one method is also
    `@persist`ed to the same store by a persistence made without a version. Its save goes
    into the flow's run, so it is v1's checkpoint: the flow killed in the next step
    restarts under v1, runs only what did not complete and charges once, and v1 lists all
    its checkpoints. Before, that save was stamped with no version: v1's restart raised
    `VersionMismatch` for its own flow (nothing ran, the flow stuck there), and v1's
    `checkpoints` refused the flow's own checkpoint."""
    flow_id = f"label-{uuid.uuid4().hex}"

    def crash() -> None:
        method_persisted_flow(url, world, {"charge": "kill"})(suppress_flow_events=True).kickoff(
            inputs={"id": flow_id}
        )

    crashed = run(crash)
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead process's lease runs out

    def restart() -> dict[str, Any]:
        flow = method_persisted_flow(url, world)(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        v1 = RemitFlowPersistence(url, workflow_version="v1")
        return {
            "state": dict(flow.state),
            "methods": [c.method for c in v1.checkpoints(flow_id)],
        }

    done = run(restart)
    assert done.ok, done.error_text()
    assert done.value["state"]["done"] is True and done.value["state"]["label"] == "fragile"
    assert done.value["methods"] == ["done", "charge", "label", "prepare"], done.value
    assert applied(world) == {"charge": 1}
    assert entered(world) == {"prepare": 1, "label": 1, "charge": 2, "done": 1}


def default_flow(url: str, world: Path, *, persisted: bool, kill_in_ship: bool = False):  # type: ignore[no-untyped-def]
    """The review flow of `versioned_flow` (no version) with Remit registered as CrewAI's
    default persistence (`set_flow_persistence_factory`, a new persistence per call, as
    CrewAI's factory contract allows); `persisted`: the class has a bare `@persist()`,
    else no `@persist` at all (CrewAI then saves only its pause, to the default backend).
    `kill_in_ship`: SIGKILL in ship after its effect. Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai.flow.persistence.factory import set_flow_persistence_factory
    from pydantic import BaseModel

    set_flow_persistence_factory(lambda: RemitFlowPersistence(url, lease=1.0))
    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

    @effect(reconcile=sink.reconcile)
    def ship_parcel(*, idempotency_key: str) -> str:
        return sink.apply("ship", idempotency_key)

    class Parcel(BaseModel):
        approved_by: str | None = None
        receipt: str | None = None

    class DefaultFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen(review)
        def approve(self) -> None:
            journal.record("enter", "approve")
            assert self.last_human_feedback is not None
            self.state.approved_by = self.last_human_feedback.feedback

        @listen(approve)
        def ship(self) -> None:
            journal.record("enter", "ship")
            self.state.receipt = ship_parcel()
            if kill_in_ship:
                os.kill(os.getpid(), signal.SIGKILL)

    return persist()(DefaultFlow) if persisted else DefaultFlow


def paused_by_default(url: str, world: Path, *, persisted: bool) -> str:
    def body() -> str:
        flow = default_flow(url, world, persisted=persisted)(suppress_flow_events=True)
        out = flow.kickoff(inputs={"id": f"default-{uuid.uuid4().hex}"})
        assert type(out).__name__ == "HumanFeedbackPending", out
        return str(flow.flow_id)

    made = run(body)
    assert made.ok, made.summary()
    return str(made.value)


@pytest.mark.parametrize("persisted", [True, False], ids=["bare-persist", "no-persist"])
def test_remit_as_crewais_default_backend_resumes_one_of_k_from_pending_without_a_backend(
    url: str, world: Path, persisted: bool
) -> None:
    """P5, P2: with Remit registered as CrewAI's default persistence, a flow with a bare
    `@persist()` (or none: CrewAI saves its pause to the default backend) pauses, and 4
    processes call CrewAI's simple form `Flow.from_pending(flow_id).resume(...)` (no
    backend passed: each call gets a new persistence from the factory) behind a barrier:
    exactly one proceeds, the others get `ResumeConflict`; the effect applies once, and a
    later resume is refused."""
    flow_id = paused_by_default(url, world, persisted=persisted)
    k = 4
    barrier = Barrier(k)

    def resumer(i: int) -> Any:
        def body() -> Any:
            flow_class = default_flow(url, world, persisted=persisted)
            barrier.wait()
            flow = flow_class.from_pending(flow_id)
            flow.resume(f"reviewer-{i}")
            return dict(flow.state.model_dump())

        return body

    workers = [fork(resumer(i), barrier=barrier) for i in range(k)]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    winners = [i for i, o in enumerate(outcomes) if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    assert outcomes[winners[0]].value["approved_by"] == f"reviewer-{winners[0]}"
    assert applied(world) == {"ship": 1}
    assert entered(world) == {"prepare": 1, "review": 1, "approve": 1, "ship": 1}

    def again() -> None:
        default_flow(url, world, persisted=persisted).from_pending(flow_id).resume("late")

    late = run(again)
    assert late.raised("ResumeConflict"), late.summary()
    assert applied(world) == {"ship": 1}
