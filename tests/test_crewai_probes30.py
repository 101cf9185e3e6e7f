"""Store connections ended in the middle of a CrewAI flow's run, and flow classes
sharing one persistence.

PostgreSQL backends terminated and Redis clients killed at the core's failpoints (a
claim, a commit, a resume's consume, an effect's outcome), in a forked child, while a
flow with a `@human_feedback` pause is kicked off by CrewAI's own restore idiom
(`kickoff(inputs={"id": X})`) and resumed by `from_pending` in the same process: every
error on the way is `StoreUnavailable`, never a raw driver error, and continuing the
flow afterwards enters each completed step once, applies each effect once and consumes
the feedback once (P1, P2, P5). Two flow classes on one persistence keep apart: one
never answers the other's pause, and the pause stays for its own class (P4, P5).
Real CrewAI, real servers, no mocks.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from conftest import engine_url
from store_cuts import cut, tagged
from test_crewai_flows import child

from remit_core import StoreUnavailable, VersionMismatch, failpoints
from remit_core.conformance.world import EffectSink, Journal, WorldDB


def order_flow(url: str, world: Path) -> tuple[Any, type[Any]]:
    """prepare -> review (pauses for feedback) -> charge (effect) -> notify (effect),
    persisted per class; each step journals its entry."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai_parts import Later, sink_effect
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    charge, notify = sink_effect(sink, "charge"), sink_effect(sink, "notify")

    class Order(BaseModel):
        id: str = ""
        prepared: bool = False
        approved_by: str | None = None
        receipt: str | None = None
        notified: str | None = None

    store = RemitFlowPersistence(url, lease=1.0)

    @persist(store)
    class OrderFlow(Flow[Order]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.prepared = True

        @listen(prepare)
        @human_feedback(message="Charge this order?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "order"

        @listen(review)
        def charge(self) -> None:
            journal.record("enter", "charge")
            self.state.approved_by = self.last_human_feedback.feedback
            self.state.receipt = charge()

        @listen(charge)
        def notify(self) -> None:
            journal.record("enter", "notify")
            self.state.notified = notify()

    return store, OrderFlow


def chain(exc: BaseException | None) -> list[str]:
    out = []
    while exc is not None:
        out.append(f"{type(exc).__module__}.{type(exc).__name__}")
        exc = exc.__cause__
    return out


POINTS = [
    "claim.in_acquire",
    "claim.after_acquire",
    "checkpoint.before_commit",
    "checkpoint.after_commit",
    "writes.before",
    "interrupt.before_consume",
    "interrupt.in_consume",
    "interrupt.after_consume",
    "effect.before_intent",
    "effect.after_apply",
    "effect.in_outcome",
]


@pytest.mark.parametrize("engine", ["postgresql", "redis"])
def test_connections_ended_mid_flow_are_store_unavailable_and_the_flow_ends_once(
    engine: str, tmp_path: Path
) -> None:
    """At each point in turn, on its first and second hit, the flow's connections are
    ended; the flow is then driven on (restore by id, or `from_pending` + `resume`) until
    it ends. Every error is `StoreUnavailable` (or CrewAI's wrapper of it), and each step
    is entered once at most beyond the one a lost write made run again, each effect
    applied once, the feedback given once."""
    cases = [(p, n) for p in POINTS for n in (1, 2)]
    url, name = tagged(engine)

    def drive() -> list[dict[str, Any]]:
        results = []
        for point, nth in cases:
            world = tmp_path / f"{point}-{nth}.db"
            store, flow_class = order_flow(url, world)
            real, hits, done = failpoints.hit, [0], []

            def hit(
                at: str,
                point: str = point,
                nth: int = nth,
                hits: list[int] = hits,
                done: list[int] = done,
                real: Any = real,
            ) -> None:
                if at == point:
                    hits[0] += 1
                    if hits[0] == nth and not done:
                        done.append(cut(engine, name))
                real(at)

            failpoints.hit = hit  # type: ignore[assignment]
            flow_id, errors = str(uuid.uuid4()), []
            try:
                for attempt in range(6):
                    try:
                        if attempt and store.load_pending_feedback(flow_id) is not None:
                            flow_class.from_pending(flow_id, store).resume("ann")
                        else:
                            flow_class().kickoff(inputs={"id": flow_id})
                    except Exception as exc:  # noqa: BLE001 - sorted below
                        errors.append(chain(exc))
                    state = store.load_state(flow_id)
                    if state is not None and state.get("notified"):
                        break
            finally:
                failpoints.hit = real  # type: ignore[assignment]
            results.append(
                {
                    "case": f"{point}@{nth}",
                    "cut": done,
                    "errors": errors,
                    "state": store.load_state(flow_id),
                    "entered": dict(Journal(WorldDB(world)).entered()),
                    "applied": dict(EffectSink(WorldDB(world)).counts()),
                }
            )
        return results

    outcome = child(drive).wait(timeout=300)
    assert outcome.status == "ok", outcome.error
    cuts = 0
    unavailable = f"{StoreUnavailable.__module__}.StoreUnavailable"
    for result in outcome.value:
        case = result["case"]
        cuts += bool(result["cut"] and result["cut"][0])
        for error in result["errors"]:
            # The user's error is Remit's typed one, or CrewAI's wrapper whose cause it is.
            wrapped = error[0] == "builtins.RuntimeError" and error[1:2] == [unavailable]
            assert error[0] == unavailable or wrapped, (case, error)
        state = result["state"]
        assert state is not None and state["approved_by"] == "ann", (case, state)
        assert state["receipt"] and state["notified"], (case, state)
        assert result["applied"] == {"charge": 1, "notify": 1}, (case, result)
        entered = result["entered"]
        assert entered["prepare"] == 1 and entered["review"] == 1, (case, entered)
        # A step whose write was lost runs again; each at most once more.
        assert entered["charge"] <= 2 and entered["notify"] <= 2, (case, entered)
        assert sum(entered.values()) - 4 <= len(result["errors"]), (case, result)
    assert cuts >= len(POINTS), outcome.value  # the cuts did reach live connections


@pytest.mark.parametrize("engine", ["sqlite", "postgresql", "redis"])
def test_two_flow_classes_on_one_persistence_keep_their_pauses_apart(
    engine: str, tmp_path: Path
) -> None:
    """Two flow classes share one persistence and one store: the other class's
    `from_pending` of a pause is refused with `VersionMismatch` (naming the paused method it
    lacks), a restart by id with it naming both classes; each runs
    nothing and leaves the pause pending; the pause's own class, in another process,
    then resumes it once."""
    url, world = engine_url(engine, tmp_path), tmp_path / "world.db"
    flow_id = str(uuid.uuid4())

    def classes() -> tuple[Any, type[Any], type[Any]]:
        store, order = order_flow(url, world)

        class Refund(order):  # type: ignore[misc,valid-type]
            """Another class on the same persistence (CrewAI carries no methods over)."""

        return store, order, Refund

    def pause() -> str:
        _, order, _ = classes()
        return type(order().kickoff(inputs={"id": flow_id})).__name__

    def other() -> list[str]:
        store, _, refund = classes()
        seen = []
        for attempt in (
            lambda: refund.from_pending(flow_id, store),
            lambda: refund().kickoff(inputs={"id": flow_id}),
        ):
            try:
                attempt()
                seen.append("ran")
            except VersionMismatch as exc:
                seen.append(str(exc))
            except Exception as exc:  # noqa: BLE001 - reported
                seen.append(repr(chain(exc)))
        seen.append("pending" if store.load_pending_feedback(flow_id) else "gone")
        return seen

    def resume() -> dict[str, Any] | None:
        store, order, _ = classes()
        order.from_pending(flow_id, store).resume("ann")
        return store.load_state(flow_id)

    first = child(pause).wait(timeout=120)
    assert first.value == "HumanFeedbackPending", first.error
    refused = child(other).wait(timeout=120)
    assert refused.status == "ok", refused.error
    assert len(refused.value) == 3 and refused.value[2] == "pending", refused.value
    # from_pending: the paused method is not the other class's; a restart: not its flow.
    assert "Refund" in refused.value[0] and "'review'" in refused.value[0], refused.value
    assert "OrderFlow" in refused.value[1] and "Refund" in refused.value[1], refused.value
    done = child(resume).wait(timeout=120)
    assert done.status == "ok", done.error
    assert done.value["approved_by"] == "ann" and done.value["notified"], done.value
    assert dict(Journal(WorldDB(world)).entered()) == {
        "prepare": 1,
        "review": 1,
        "charge": 1,
        "notify": 1,
    }
    assert dict(EffectSink(WorldDB(world)).counts()) == {"charge": 1, "notify": 1}
