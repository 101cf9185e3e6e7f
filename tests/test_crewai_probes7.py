"""A resume continues a flow's joins where the pause left them: CrewAI flows on every engine.

Probes written from the contract (P1: a resume skips no step of the head's
frontier and runs no completed step again; P2: effects once) against real
CrewAI flows in forked children, with the helpers of `test_crewai_flows`.
`from_pending` builds a new flow instance, which knows nothing of the `and_`
and `or_` listeners the flow had already fed before it paused: without the
joins kept with the pause, a join waiting on the paused method never fires,
and an `or_` listener that already ran runs (and applies its effects) again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, entered, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def two_reviews_flow(url: str, world: Path) -> type[Any]:
    """prepare -> first (pauses) -> either = or_(first, second), which sends (effect) ->
    second (pauses); both = and_(first, second) ships (effect); a dict state; built in
    a child."""
    from crewai.flow.flow import Flow, and_, listen, or_, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    send = sink_effect(sink, "send")
    ship = sink_effect(sink, "ship")

    @persist(RemitFlowPersistence(url))
    class ReviewsFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="First review?", provider=Later())
        def first(self) -> str:
            journal.record("enter", "first")
            return "draft"

        @listen(or_(first, "second"))
        def either(self) -> None:
            journal.record("enter", "either")
            self.state["sent"] = send()

        @listen(either)
        @human_feedback(message="Second review?", provider=Later())
        def second(self) -> str:
            journal.record("enter", "second")
            return "draft"

        @listen(and_(first, second))
        def both(self) -> None:
            journal.record("enter", "both")
            self.state["reviewers"] = [f.feedback for f in self.human_feedback_history]
            self.state["shipped"] = ship()

    return ReviewsFlow


def test_a_resume_fires_the_join_behind_two_pauses_and_no_or_listener_twice(
    url: str, world: Path
) -> None:
    """Two pauses in turn, each resumed in its own process: the `and_` listener runs once,
    after the second, with both reviewers' feedback; the `or_` listener that ran after
    the first does not run (or send) again."""

    def pause() -> str:
        flow = two_reviews_flow(url, world)(suppress_flow_events=True)
        out = flow.kickoff()
        assert type(out).__name__ == "HumanFeedbackPending", out
        return str(flow.flow_id)

    paused = run(pause)
    assert paused.ok, paused.summary()
    flow_id = paused.value

    def resume(feedback: str) -> dict[str, Any]:
        flow_class = two_reviews_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        flow = flow_class.from_pending(flow_id, store)
        flow.suppress_flow_events = True
        out = flow.resume(feedback)
        return {"out": type(out).__name__, "state": dict(flow.state)}

    first = run(lambda: resume("alice"))
    assert first.ok and first.value["out"] == "HumanFeedbackPending", first.summary()
    second = run(lambda: resume("bob"))
    assert second.ok, second.summary()
    assert second.value["state"]["reviewers"] == ["alice", "bob"]
    assert "shipped" in second.value["state"]
    assert entered(world) == {"prepare": 1, "first": 1, "second": 1, "either": 1, "both": 1}
    assert applied(world) == {"send": 1, "ship": 1}

    def restart() -> dict[str, Any]:
        flow = two_reviews_flow(url, world)(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return dict(flow.state)

    again = run(restart)
    assert again.ok, again.summary()
    assert again.value == second.value["state"]
    assert entered(world) == {"prepare": 1, "first": 1, "second": 1, "either": 1, "both": 1}
    assert applied(world) == {"send": 1, "ship": 1}
