"""Probes of round 13: CrewAI's `FlowPersistence` calls made directly, and a server.

A webhook server lists the flows that wait for feedback (`load_pending_feedback`)
and resumes them with `from_pending` / `resume_async` from one event loop while
other processes resume the same flows. Written from the contract and from what
CrewAI's own `SQLiteFlowPersistence` answers, against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, child, entered, paused_review, review_flow, run

from remit_core.conformance.processes import Barrier
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def pending_of(loaded: Any) -> Any:
    """What `load_pending_feedback` answered, as plain data: (state, paused method) or None."""
    return None if loaded is None else [loaded[0], loaded[1].method_name, loaded[1].flow_id]


def test_reading_pending_feedback_claims_nothing_and_answers_as_crewai_does(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P5, L1: `load_pending_feedback` called directly (a server listing what waits, or
    checking before `from_pending`) answers the same twice, before and after
    `clear_pending_feedback`, as CrewAI's own backend does, and claims nothing: the
    `from_pending` and resume that follow in the same process proceed at once (before,
    the first read held the claim for its lease, and both got `ResumeConflict`). A read
    from another process while a resumer holds the flow answers too. Once the feedback
    was consumed the read answers None, as CrewAI's after its clear."""
    flow_id = paused_review(url, world)

    def body() -> dict[str, Any]:
        from crewai.flow.persistence import SQLiteFlowPersistence

        flow_class = review_flow(url, world)
        persistence = flow_class.__flow_persistence_config__.persistence
        own = SQLiteFlowPersistence(str(tmp_path / "crewai.db"))
        _, context = persistence.load_pending_feedback(flow_id)
        own.save_pending_feedback(flow_id, context, {"id": flow_id, "approved_by": None})
        out: dict[str, Any] = {"remit": [], "crewai": []}
        for p, key in ((persistence, "remit"), (own, "crewai")):
            out[key].append(pending_of(p.load_pending_feedback(flow_id)))
            out[key].append(pending_of(p.load_pending_feedback(flow_id)))
        persistence.clear_pending_feedback(flow_id)  # Remit's deletes nothing (see README)
        out["after_clear"] = pending_of(persistence.load_pending_feedback(flow_id))
        flow = flow_class.from_pending(flow_id, persistence)
        out["while_held"] = pending_of(persistence.load_pending_feedback(flow_id))
        elsewhere = child(
            lambda: pending_of(RemitFlowPersistence(url).load_pending_feedback(flow_id))
        ).wait(timeout=120)
        out["elsewhere"] = elsewhere.value if elsewhere.ok else elsewhere.summary()
        flow.resume("ann")
        out["approved_by"] = flow.state.approved_by
        out["consumed"] = pending_of(persistence.load_pending_feedback(flow_id))
        return out

    out = run(body)
    assert out.ok, out.error_text()
    waiting = [{"approved_by": None, "id": flow_id}, "review", flow_id]
    assert out.value["remit"] == [waiting, waiting], out.value
    assert out.value["crewai"] == out.value["remit"], out.value
    assert out.value["after_clear"] == waiting
    assert out.value["while_held"] == waiting
    assert out.value["elsewhere"] == waiting
    assert out.value["approved_by"] == "ann"
    assert out.value["consumed"] is None
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}
    again = run(lambda: review_flow(url, world).from_pending(flow_id, RemitFlowPersistence(url)))
    assert again.raised("ResumeConflict") and "already given" in again.error_text()


def test_load_state_reads_a_state_back_as_it_was_saved(url: str, tmp_path: Path) -> None:
    """`load_state` outside a kickoff gives a state back as it was saved, as CrewAI's own
    backend does: without an "id" if it was saved without one, with the "id" it was
    saved with (before, Remit put the flow id in both). A fork's head, which holds the
    id of the flow it was forked from, still reads under the fork's id."""

    def body() -> dict[str, Any]:
        from crewai.flow.persistence import SQLiteFlowPersistence

        remit = RemitFlowPersistence(url)
        own = SQLiteFlowPersistence(str(tmp_path / "crewai.db"))
        saved = {
            "bare": {"count": 1},
            "other": {"id": "another-id", "count": 2},
        }
        out: dict[str, Any] = {}
        for name, state in saved.items():
            flow_id = f"{name}-{tmp_path.name}"
            for p in (remit, own):
                p.save_state(flow_id, "step", state)
            out[name] = [remit.load_state(flow_id), own.load_state(flow_id)]
        source = f"source-{tmp_path.name}"
        remit.save_state(source, "step", {"id": source, "count": 3})
        forked = remit.fork(source, fork_token="t")
        out["fork"] = [forked, remit.load_state(forked)]
        return out

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["bare"] == [{"count": 1}, {"count": 1}]
    assert out.value["other"] == [{"id": "another-id", "count": 2}] * 2
    forked, state = out.value["fork"]
    assert state == {"id": forked, "count": 3}


def two_reviews_flow(url: str, world: Path) -> type[Any]:
    """prepare -> review1 (feedback: pauses) -> middle (effect "mid") -> review2
    (feedback: pauses) -> done; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    mid = sink_effect(sink, "mid")

    class Reviews(BaseModel):
        first: str | None = None
        second: str | None = None

    @persist(RemitFlowPersistence(url))
    class TwoReviewsFlow(Flow[Reviews]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="First?", provider=Later())
        def review1(self) -> str:
            return "one"

        @listen(review1)
        def middle(self) -> None:
            journal.record("enter", "middle")
            mid()
            assert self.last_human_feedback is not None
            self.state.first = self.last_human_feedback.feedback

        @listen(middle)
        @human_feedback(message="Second?", provider=Later())
        def review2(self) -> str:
            return "two"

        @listen(review2)
        def done(self) -> None:
            journal.record("enter", "done")
            assert self.last_human_feedback is not None
            self.state.second = self.last_human_feedback.feedback

    return TwoReviewsFlow


def test_a_retried_resume_after_another_answered_its_pause_is_refused(
    url: str, world: Path
) -> None:
    """P1, P2, P5: A loads the flow paused at `review1`, and its resume fails before it
    takes the feedback (feedback that is not a str), giving the flow back. B resumes with
    "bob"; the flow runs on and pauses at `review2`. A retries its resume on the same
    instance: `ResumeConflict`, nothing runs (before, A's feedback for `review1` answered
    it again: `middle` ran a second time, applied its effect again and replaced B's
    acknowledged value), and `review2` still waits for its own feedback."""

    def body() -> dict[str, Any]:
        from crewai.flow.async_feedback.types import HumanFeedbackPending

        flow_class = two_reviews_flow(url, world)
        persistence = flow_class.__flow_persistence_config__.persistence
        flow = flow_class(suppress_flow_events=True)
        assert isinstance(flow.kickoff(), HumanFeedbackPending)
        flow_id = flow.flow_id
        first = flow_class.from_pending(flow_id, persistence)
        out: dict[str, Any] = {}
        try:
            first.resume(123)
        except TypeError:
            out["bad"] = "TypeError"
        second = flow_class.from_pending(flow_id, persistence)
        out["second"] = type(second.resume("bob")).__name__
        try:
            first.resume("alice")
            out["retry"] = "ran"
        except Exception as exc:
            out["retry"] = type(exc).__name__
        out["state"] = persistence.load_state(flow_id)
        out["waiting"] = pending_of(persistence.load_pending_feedback(flow_id))[1]
        last = flow_class.from_pending(flow_id, persistence)
        last.resume("cy")
        out["end"] = last.state.model_dump()
        return out

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["bad"] == "TypeError"
    assert out.value["second"] == "HumanFeedbackPending"
    assert out.value["retry"] == "ResumeConflict", out.value
    assert out.value["state"]["first"] == "bob"
    assert out.value["waiting"] == "review2"
    assert out.value["end"]["first"] == "bob" and out.value["end"]["second"] == "cy"
    assert entered(world) == {"prepare": 1, "middle": 1, "done": 1}
    assert applied(world) == {"mid": 1}


# -- a server: one event loop, many flows pending at once, other processes racing -------------

FLOWS = 4
TASKS = 2  # request handlers per flow in each serving process
RIVALS = 2  # processes that resume the same flows besides the server


def serve(url: str, world: Path, flow_ids: list[str], who: str, barrier: Barrier) -> Any:
    """A server process: one event loop; for every flow, `TASKS` request handlers at once
    that each `from_pending` it and `await resume_async(...)`, once `barrier` lets it
    go. Each handler's outcome: [flow, "ok", approved_by] or [flow, the error's class]."""
    flow_class = review_flow(url, world)
    persistence = flow_class.__flow_persistence_config__.persistence

    async def handle(flow_id: str, value: str) -> list[Any]:
        await asyncio.sleep(0)  # the handlers of every flow interleave
        try:
            flow = flow_class.from_pending(flow_id, persistence)
            await flow.resume_async(value)
        except Exception as exc:
            return [flow_id, type(exc).__name__]
        return [flow_id, "ok", flow.state.approved_by]

    async def main() -> list[Any]:
        barrier.wait()
        handlers = [
            handle(flow_id, f"{who}-{task}") for flow_id in flow_ids for task in range(TASKS)
        ]
        return await asyncio.gather(*handlers)

    return asyncio.run(main())


def test_a_server_resumes_many_pending_flows_from_one_loop_against_other_processes(
    url: str, world: Path
) -> None:
    """P5, P2: `FLOWS` flows pause. A server lists them (`load_pending_feedback`), then
    resumes each from `TASKS` handlers at once in its one event loop, while `RIVALS`
    other processes do the same, all released together once the listing is done. Each
    flow's pause is consumed by exactly one handler; every other gets `ResumeConflict`;
    each flow's state holds its winner's value, and each flow's steps and effect ran
    once. (Before, the listing held every flow's claim for its lease: the server's
    handlers and the rivals all got `ResumeConflict`, and no flow was resumed.)"""
    flow_ids = [paused_review(url, world) for _ in range(FLOWS)]
    barrier = Barrier(1 + RIVALS)

    def server(who: str, listing: bool) -> Any:
        def body() -> Any:
            listed = []
            if listing:  # the overview page, before the server takes requests
                persistence = RemitFlowPersistence(url)
                listed = [pending_of(persistence.load_pending_feedback(f)) for f in flow_ids]
            return {"listed": listed, "handled": serve(url, world, flow_ids, who, barrier)}

        return body

    workers = [child(server("server", True), barrier=barrier)]
    workers += [child(server(f"rival{i}", False), barrier=barrier) for i in range(RIVALS)]
    assert barrier.release() == 1 + RIVALS
    outcomes = [w.wait(timeout=180) for w in workers]
    assert all(o.ok for o in outcomes), [o.summary() for o in outcomes]
    assert [w[1] for w in outcomes[0].value["listed"]] == ["review"] * FLOWS
    handled = [h for o in outcomes for h in o.value["handled"]]
    assert len(handled) == FLOWS * TASKS * (1 + RIVALS)
    assert all(h[1] in ("ok", "ResumeConflict") for h in handled), handled
    winners = {h[0]: h[2] for h in handled if h[1] == "ok"}
    assert sorted(winners) == sorted(flow_ids), handled
    assert len([h for h in handled if h[1] == "ok"]) == FLOWS, handled

    def final_states() -> dict[str, Any]:
        persistence = RemitFlowPersistence(url)
        return {f: persistence.load_state(f)["approved_by"] for f in flow_ids}

    states = run(final_states)
    assert states.ok, states.summary()
    assert states.value == winners
    assert entered(world) == {"prepare": FLOWS, "approve": FLOWS, "ship": FLOWS}
    assert applied(world) == {"ship": FLOWS}
