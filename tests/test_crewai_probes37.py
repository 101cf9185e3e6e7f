"""Probes of round 37: pause contexts a provider builds itself, and the persistence's pause
API called with contexts its own reader would refuse.

CrewAI hands the context of a pause to the feedback provider, which raises
`HumanFeedbackPending(context=...)` with it, or with a context of its own; the engine
passes that context to `save_pending_feedback`. Written from the contract (P4: an invalid
write is refused with a typed error and nothing is committed; a stored record is never
read back as a wrong one, and a write Remit accepted is never read back as corrupt; P5:
the pause stays answerable, its answer consumed once; P2: effects once) and from what
CrewAI's own `SQLiteFlowPersistence` answers, against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import sink_effect
from test_crewai_flows import applied, entered, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def _context(flow_id: str, **changes: Any) -> Any:
    from crewai.flow.async_feedback.types import PendingFeedbackContext

    fields: dict[str, Any] = {
        "flow_id": flow_id,
        "flow_class": "flows.Review",
        "method_name": "review",
        "method_output": "parcel",
        "message": "Ship it?",
    }
    return PendingFeedbackContext(**{**fields, **changes})


@pytest.mark.parametrize(
    "changes",
    [
        {"emit": "ship"},
        {"emit": ["ship", 5]},
        {"flow_class": None},
        {"flow_id": None},
        {"requested_at": "2026-01-01T00:00:00"},
    ],
    ids=["emit-a-str", "emit-not-all-str", "no-flow-class", "no-flow-id", "time-a-str"],
)
def test_a_pause_context_that_could_never_be_loaded_is_refused_writing_nothing(
    url: str, changes: dict[str, Any]
) -> None:
    """P4: `save_pending_feedback` with a context whose stored form the pause's reader
    refuses as not a context CrewAI paused with (an `emit` that is a str or holds a
    non-str, no flow class or flow id) raises `TypeError` naming the field; nothing is
    written: no state, no pause, no checkpoint, and the id is free for a good pause. It
    used to be written, after which `load_pending_feedback` and `from_pending` raised
    `CorruptRecord` for the flow for good (and a `requested_at` that is not a datetime
    raised a bare `AttributeError`)."""
    store = RemitFlowPersistence(url)
    flow_id = f"ctx-{uuid.uuid4().hex}"
    name = next(iter(changes))
    with pytest.raises(TypeError, match=name):
        store.save_pending_feedback(flow_id, _context(flow_id, **changes), {"id": flow_id})
    assert store.load_state(flow_id) is None
    assert store.load_pending_feedback(flow_id) is None
    assert store.checkpoints(flow_id) == []
    store.save_pending_feedback(flow_id, _context(flow_id), {"id": flow_id, "n": 1})
    loaded = store.load_pending_feedback(flow_id)
    assert loaded is not None
    assert loaded[0] == {"id": flow_id, "n": 1}
    assert (loaded[1].method_name, loaded[1].method_output) == ("review", "parcel")
    assert [c.kind for c in store.checkpoints(flow_id)] == ["pause"]


def test_a_pause_whose_emit_is_a_tuple_reads_back_as_crewai_reads_it(
    url: str, tmp_path: Path
) -> None:
    """P4: a context whose `emit` is a tuple of str (the `Sequence[str]` CrewAI's
    `@human_feedback` takes) is stored, and `load_pending_feedback` reads it back with
    the list CrewAI's own backend reads back. It used to be stored as a tuple and then
    read as a corrupt record."""
    from crewai.flow.persistence import SQLiteFlowPersistence

    flow_id = f"tuple-{uuid.uuid4().hex}"
    answers = []
    for store in (RemitFlowPersistence(url), SQLiteFlowPersistence(str(tmp_path / "own.db"))):
        context = _context(flow_id, emit=("ship", "hold"), default_outcome="hold")
        store.save_pending_feedback(flow_id, context, {"id": flow_id})
        loaded = store.load_pending_feedback(flow_id)
        assert loaded is not None
        answers.append([loaded[0], loaded[1].emit, loaded[1].default_outcome])
    assert answers[0] == answers[1] == [{"id": flow_id}, ["ship", "hold"], "hold"], answers


def routed_flow(url: str, world: Path, *, emit: Any) -> type[Any]:
    """prepare -> review (pauses; its provider raises the pending signal with the context
    it was given, with `emit` as the routes) -> "ship" -> send (effect) | "hold" -> park (the
    default route: "ship"); built in a child."""
    from crewai.flow.async_feedback.types import HumanFeedbackPending
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    send_parcel = sink_effect(sink, "send")

    class OwnRoutes:
        """A provider that hands its own routes on with the pause."""

        def request_feedback(self, context: Any, flow: Any) -> str:
            raise HumanFeedbackPending(context=dataclasses.replace(context, emit=emit))

    class Parcel(BaseModel):
        outcome: str | None = None
        receipt: str | None = None

    @persist(RemitFlowPersistence(url))
    class RoutedFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(
            message="Ship it?", emit=["ship", "hold"], default_outcome="ship", provider=OwnRoutes()
        )
        def review(self) -> str:
            journal.record("enter", "review")
            return "parcel"

        @listen("ship")
        def send(self) -> None:
            journal.record("enter", "send")
            self.state.outcome = "ship"
            self.state.receipt = send_parcel()

        @listen("hold")
        def park(self) -> None:
            journal.record("enter", "park")
            self.state.outcome = "hold"

    return RoutedFlow


def test_a_pause_a_provider_hands_on_with_tuple_routes_is_resumed_once(
    url: str, world: Path
) -> None:
    """P4, P5, P2: the provider raises the pending signal with routes as a tuple. The
    flow pauses, `from_pending` loads it (it used to raise `CorruptRecord`, the flow stuck
    for good), the resume takes the default route, and a second resume and a
    restart run nothing again: the effect once."""

    def body() -> dict[str, Any]:
        flow_class = routed_flow(url, world, emit=("ship", "hold"))
        store = flow_class.__flow_persistence_config__.persistence
        paused = flow_class(suppress_flow_events=True).kickoff()
        flow_id = paused.context.flow_id
        flow = flow_class.from_pending(flow_id, store)
        flow.resume("")  # (no feedback: the default route, "ship")
        again: str
        try:
            flow_class.from_pending(flow_id, store).resume("")
            again = "resumed"
        except Exception as exc:
            again = type(exc).__name__
        flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id})
        end = store.load_state(flow_id) or {}
        return {"paused": type(paused).__name__, "again": again, "outcome": end.get("outcome")}

    done = run(body)
    assert done.ok, done.summary()
    assert done.value["paused"] == "HumanFeedbackPending"
    assert done.value["again"] in {"ResumeConflict", "ValueError"}, done.value
    assert done.value["outcome"] == "ship"
    assert entered(world) == {"prepare": 1, "review": 1, "send": 1}
    assert applied(world) == {"send": 1}
