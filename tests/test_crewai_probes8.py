"""Probes of round 8: CrewAI flows on every engine.

Written from the contract (P1: a restart runs no completed step again; P5: one
resumer consumes a pause; fencing: a write that the run's next save would
overwrite is refused, never acknowledged and lost) against real CrewAI flows in
forked children, with the helpers of `test_crewai_flows`.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from crewai_parts import sink_effect
from test_crewai_flows import applied, entered, kickoff, paused_review, review_flow, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def two_store_flow(url: str, other: str, world: Path) -> type[Any]:
    """prepare -> pay (effect; `@persist`ed to the store `other`) -> ship, persisted to `url`
    at class level; a dict state; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    charge = sink_effect(sink, "charge")

    @persist(RemitFlowPersistence(url))
    class TwoStoresFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @persist(RemitFlowPersistence(other))
        def pay(self) -> None:
            journal.record("enter", "pay")
            self.state["receipt"] = charge()

        @listen(pay)
        def ship(self) -> None:
            journal.record("enter", "ship")
            self.state["shipped"] = True

    return TwoStoresFlow


def test_a_method_persisted_to_another_store_completes_in_the_flows_ledger(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1: a method `@persist`ed to another store than its class's completes in the ledger of
    the class's store, so a restart does not run it again; and its save to the other store
    holds no claim after the flow ended, so the restart (right away, in another process)
    and an edit through that store are not refused."""
    other = f"sqlite:///{tmp_path}/other-store.db"
    done = run(lambda: kickoff(two_store_flow(url, other, world)))
    assert done.ok, done.summary()
    flow_id = done.value["id"]

    def restart() -> dict[str, Any]:
        out = kickoff(two_store_flow(url, other, world), inputs={"id": flow_id})
        RemitFlowPersistence(other).edit_state(flow_id, {"note": "checked"})
        saved = RemitFlowPersistence(other).checkpoints(flow_id)
        return {"state": out["state"], "other": [c.method for c in saved]}

    again = run(restart)
    assert again.ok, again.summary()
    assert again.value["state"] == done.value["state"]
    assert again.value["other"] == ["", "pay"]  # the edit, then pay's own save
    assert entered(world) == {"prepare": 1, "pay": 1, "ship": 1}
    assert applied(world) == {"charge": 1}


def test_two_resumes_of_one_instance_at_once_let_one_proceed(url: str, world: Path) -> None:
    """P5: two `resume_async` of one `from_pending` instance, gathered: one consumes the
    feedback and runs the listeners; the other gets `ResumeConflict` and runs nothing."""
    flow_id = paused_review(url, world)

    def body() -> dict[str, Any]:
        import asyncio

        flow_class = review_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        flow = flow_class.from_pending(flow_id, store)

        async def both() -> list[Any]:
            return await asyncio.gather(
                flow.resume_async("alice"), flow.resume_async("bob"), return_exceptions=True
            )

        outs = asyncio.run(both())
        return {
            "errors": sorted(type(o).__name__ for o in outs if isinstance(o, BaseException)),
            "approved_by": flow.state.approved_by,
        }

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["errors"] == ["ResumeConflict"]
    assert out.value["approved_by"] in ("alice", "bob")
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


def test_an_edit_while_a_step_runs_in_this_process_is_refused_not_lost(url: str) -> None:
    """An operator's `edit_state` from another thread while a step of the flow runs in this
    process gets `ResumeConflict`, as from another process: written under the run's
    claim, it would be acknowledged and then overwritten by the step's save."""

    def body() -> dict[str, Any]:
        import threading

        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        store = RemitFlowPersistence(url)
        running, edited = threading.Event(), threading.Event()

        @persist(store)
        class SlowFlow(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def fill(self) -> None:
                self.state["items"] = 1

            @listen(fill)
            def pack(self) -> None:
                running.set()
                edited.wait(30)
                self.state["packed"] = True

        flow_id = f"slow-{uuid.uuid4().hex}"
        seen: dict[str, Any] = {}

        def edit() -> None:
            running.wait(30)
            try:
                store.edit_state(flow_id, {"note": "operator"})
                seen["edit"] = "written"
            except Exception as exc:
                seen["edit"] = type(exc).__name__
            edited.set()

        operator = threading.Thread(target=edit)
        operator.start()
        SlowFlow(suppress_flow_events=True).kickoff(inputs={"id": flow_id})
        operator.join()
        store.edit_state(flow_id, {"note": "operator"})  # the flow ended: the edit is taken
        return {
            "edit": seen["edit"],
            "kinds": [c.kind for c in store.checkpoints(flow_id)],
            "state": store.load_state(flow_id),
        }

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["edit"] == "ResumeConflict"
    assert out.value["kinds"] == ["edit", "step", "step"]
    assert out.value["state"]["note"] == "operator" and out.value["state"]["packed"] is True
