"""Probes of round 14: nested state models, inputs given to a restart, two pauses raced
by processes, an async flow killed between effects, and a feedback router feeding
`or_` and `and_` listeners.

Written from the contract and from what a CrewAI user expects of a persistence
backend (CrewAI restores a state with its model's `model_validate`, and merges
the inputs of `kickoff(inputs={"id": X, ...})` into the restored state), against
real CrewAI flows in forked children, with the helpers of `test_crewai_flows`,
on every engine.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import Later, sink_effect, stored_flow
from test_crewai_flows import applied, child, entered, kickoff, order_flow, point, run
from test_crewai_probes13 import two_reviews_flow

from remit_core.conformance.processes import Barrier
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence

# -- nested models in a state ------------------------------------------------------------------


def basket_flow(url: str, world: Path, *, alias: bool, lease: float = 30.0) -> type[Any]:
    """fill -> review (human feedback: pauses) -> pack (effect "pack"; with note "bad",
    makes a nested item invalid after its effect). The state nests models in a list and
    a dict; `alias`: the item's code is read by its alias `sku` only. Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    pack_effect = sink_effect(sink, "pack")
    key = "sku" if alias else "code"

    class Item(BaseModel):
        code: str = Field(alias="sku") if alias else Field()
        qty: int = Field(default=1, ge=0)

    class Basket(BaseModel):
        items: list[Item] = []
        by_code: dict[str, Item] = {}
        note: str = ""
        packed: str | None = None

    @persist(RemitFlowPersistence(url, lease=lease))
    class BasketFlow(Flow[Basket]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def fill(self) -> None:
            journal.record("enter", "fill")
            self.state.items.append(Item(**{key: "tea", "qty": 2}))
            self.state.by_code["tea"] = Item(**{key: "tea"})

        @listen(fill)
        @human_feedback(message="Pack it?", provider=Later())
        def review(self) -> str:
            return "basket"

        @listen(review)
        def pack(self) -> None:
            journal.record("enter", "pack")
            self.state.packed = pack_effect()
            if self.state.note == "bad":
                self.state.items[0].qty = -1  # the model does not validate assignments

    return BasketFlow


def basket_of(state: dict[str, Any]) -> Any:
    """The nested part of a basket state, as plain data whatever its keys' spelling."""
    items = [[i.get("code", i.get("sku")), i["qty"]] for i in state["items"]]
    return {"items": items, "by_code": sorted(state["by_code"])}


def test_a_nested_model_read_by_its_alias_comes_back_on_resume_and_restart(
    url: str, world: Path
) -> None:
    """P4: a state whose nested models read a field by its alias only (a list and a dict of
    them) pauses, is resumed from another process and kicked off again: each time CrewAI
    reads the saved state back with the model, and gets what was saved. (Before, Remit
    stored nested models by field name, which the model does not read: `from_pending`
    failed with a `ValidationError` and the flow could never be resumed.)"""
    started = run(lambda: kickoff(basket_flow(url, world, alias=True)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]

    def resumed() -> dict[str, Any]:
        flow_class = basket_flow(url, world, alias=True)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        flow.resume("ann")
        return flow.state.model_dump()

    done = run(resumed)
    assert done.ok, done.error_text()
    assert basket_of(done.value) == {"items": [["tea", 2]], "by_code": ["tea"]}
    again = run(lambda: kickoff(basket_flow(url, world, alias=True), inputs={"id": flow_id}))
    assert again.ok, again.error_text()
    assert again.value["state"] == done.value
    assert entered(world) == {"fill": 1, "pack": 1}
    assert applied(world) == {"pack": 1}


def test_a_nested_model_made_invalid_is_refused_naming_its_path_and_an_input_mends_the_run(
    url: str, world: Path
) -> None:
    """P4, P5, P2: a resume whose step leaves a nested item invalid (no `validate_assignment`)
    is `CheckpointInvalid` naming `items[0].qty`; the head keeps the valid state. The
    feedback it consumed is not lost: a restart with an input that overrides the saved
    `note` runs the step again (its effect returns its recorded outcome) and completes."""
    flow_id = f"basket-{uuid.uuid4().hex}"
    started = run(
        lambda: kickoff(basket_flow(url, world, alias=False), inputs={"id": flow_id, "note": "bad"})
    )
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()

    def resumed() -> None:
        flow_class = basket_flow(url, world, alias=False)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        flow.resume("ann")

    refused = run(resumed)
    assert refused.raised("CheckpointInvalid"), refused.summary()
    assert "items[0].qty" in refused.error_text()

    seen = run(lambda: stored_flow(url, flow_id))
    assert seen.ok, seen.summary()
    assert seen.value["kinds"] == ["feedback", "pause", "step"]  # CrewAI saves `review` first
    assert basket_of(seen.value["state"]) == {"items": [["tea", 2]], "by_code": ["tea"]}
    mended = run(
        lambda: kickoff(basket_flow(url, world, alias=False), inputs={"id": flow_id, "note": "ok"})
    )
    assert mended.ok, mended.error_text()
    assert mended.value["state"]["note"] == "ok"
    assert mended.value["state"]["packed"] is not None
    assert entered(world) == {"fill": 1, "pack": 2}
    assert applied(world) == {"pack": 1}


# -- inputs given to the restart of a crashed flow -------------------------------------------


def test_inputs_to_a_crashed_flows_restart_override_the_saved_state_or_are_refused(
    url: str, world: Path
) -> None:
    """A model flow SIGKILLed in `charge` before its effect. A restart with an input the
    model refuses is CrewAI's `ValueError` before any step, and gives the flow back at
    once (a correct restart right after it is not `ResumeConflict`). The restart with
    `amount` 7 continues with it, as CrewAI merges inputs into the restored state:
    `charge` runs once more with 7, the completed steps not at all, and the flow id
    loads the state the run ended with."""
    flow_id = f"order-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(
            order_flow(url, world, lease=1.0, points={"charge.before": "kill"}),
            inputs={"id": flow_id},
        )
    )
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead kickoff's claim runs out
    bad = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id, "amount": -1}))
    assert bad.raised("ValueError") and "amount" in bad.error_text(), bad.summary()
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1}
    good = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id, "amount": 7}))
    assert good.ok, good.error_text()
    assert good.value["state"]["amount"] == 7 and good.value["state"]["shipped"] is True
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 2, "ship": 1}
    assert applied(world) == {"charge": 1}
    loaded = run(lambda: RemitFlowPersistence(url).load_state(flow_id))
    assert loaded.ok and loaded.value == good.value["state"], loaded.summary()


def till_flow(
    url: str, world: Path, *, points: dict[str, str] | None = None, required: tuple[str, ...] = ()
) -> type[Any]:
    """prepare -> charge (effect "charge") -> ship; a dict state checked by a JSON Schema
    (`amount` a non-negative integer; the keys `required`); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    charge_effect = sink_effect(sink, "charge")
    schema = {
        "type": "object",
        "properties": {"amount": {"type": "integer", "minimum": 0}},
        "required": list(required),
    }

    @persist(RemitFlowPersistence(url, lease=1.0, state_schema=schema))
    class TillFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.setdefault("amount", 100)

        @listen(prepare)
        def charge(self) -> None:
            journal.record("enter", "charge")
            point(at, "charge.before")
            self.state["receipt"] = charge_effect()

        @listen(charge)
        def ship(self) -> None:
            journal.record("enter", "ship")
            self.state["shipped"] = True

    return TillFlow


def test_an_invalid_input_to_a_crashed_dict_flows_restart_is_refused_before_any_step(
    url: str, world: Path
) -> None:
    """P4 (an input is an external update of the state): a dict flow SIGKILLed in `charge`
    before its effect, restarted with an `amount` its state schema refuses, is
    `CheckpointInvalid` naming `amount` before `charge` runs: no effect is applied with
    the invalid state (before, `charge` ran and charged with it, and only its save was
    refused; the charge's recorded outcome then stood for every later restart). The head
    keeps the valid state, and a restart with a valid input completes, charging once."""
    flow_id = f"till-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(
            till_flow(url, world, points={"charge.before": "kill"}), inputs={"id": flow_id}
        )
    )
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead kickoff's claim runs out
    bad = run(lambda: kickoff(till_flow(url, world), inputs={"id": flow_id, "amount": -5}))
    assert bad.raised("CheckpointInvalid") and "amount" in bad.error_text(), bad.summary()
    assert entered(world) == {"prepare": 1, "charge": 1}
    assert applied(world) == {}
    loaded = run(lambda: RemitFlowPersistence(url).load_state(flow_id))
    assert loaded.ok and loaded.value == {"id": flow_id, "amount": 100}, loaded.summary()
    good = run(lambda: kickoff(till_flow(url, world), inputs={"id": flow_id, "amount": 5}))
    assert good.ok, good.error_text()
    assert good.value["state"]["amount"] == 5 and good.value["state"]["shipped"] is True
    assert entered(world) == {"prepare": 1, "charge": 2, "ship": 1}
    assert applied(world) == {"charge": 1}


def test_an_invalid_input_to_a_new_dict_flow_is_refused_before_its_first_step(
    url: str, world: Path
) -> None:
    """P4: a new dict flow kicked off with an `amount` its state schema refuses is
    `CheckpointInvalid` naming `amount` before `prepare` runs (before, the steps ran, and
    their effects applied, until the first save was refused); so is an input the codec
    cannot read back. Rules on the whole state wait for the saves: a key the schema
    requires that a step sets is not asked of the inputs."""
    bad = run(lambda: kickoff(till_flow(url, world), inputs={"amount": -5}))
    assert bad.raised("CheckpointInvalid") and "amount" in bad.error_text(), bad.summary()
    odd = run(lambda: kickoff(till_flow(url, world), inputs={"amount": 1, "tag": object()}))
    assert odd.raised("CheckpointInvalid") and "tag" in odd.error_text(), odd.summary()
    assert entered(world) == {} and applied(world) == {}
    late = run(lambda: kickoff(till_flow(url, world, required=("receipt",)), inputs={"amount": 5}))
    assert late.raised("RuntimeError"), late.summary()  # `prepare`'s save lacks a receipt
    assert entered(world) == {"prepare": 1}
    fine = run(lambda: kickoff(till_flow(url, world, required=("amount",)), inputs={"note": "x"}))
    assert fine.ok, fine.error_text()
    assert fine.value["state"]["amount"] == 100 and fine.value["state"]["note"] == "x"
    assert applied(world) == {"charge": 1}


# -- two pauses, the second raced by processes -------------------------------------------------

RACERS = 4


def test_k_processes_resuming_a_flows_second_pause_let_one_proceed(url: str, world: Path) -> None:
    """P5, P2: a flow with two pauses; the first is answered, then `RACERS` processes released
    together by a barrier each `from_pending` and resume the second with their own value.
    Exactly one proceeds, the others get `ResumeConflict`; the state holds the winner's
    value and the first answer; every step and effect ran once; a later resume is refused."""

    def first() -> str:
        from crewai.flow.async_feedback.types import HumanFeedbackPending

        flow_class = two_reviews_flow(url, world)
        flow = flow_class(suppress_flow_events=True)
        assert isinstance(flow.kickoff(), HumanFeedbackPending)
        resumed = flow_class.from_pending(flow.flow_id, RemitFlowPersistence(url))
        assert isinstance(resumed.resume("bob"), HumanFeedbackPending)
        return str(flow.flow_id)

    started = run(first)
    assert started.ok, started.error_text()
    flow_id = started.value
    barrier = Barrier(RACERS)

    def racer(who: str) -> Any:
        def body() -> Any:
            flow_class = two_reviews_flow(url, world)
            persistence = RemitFlowPersistence(url)
            barrier.wait()
            try:
                flow = flow_class.from_pending(flow_id, persistence)
                flow.resume(who)
            except Exception as exc:
                return [type(exc).__name__]
            return ["ok", flow.state.model_dump()]

        return body

    workers = [child(racer(f"r{i}"), barrier=barrier) for i in range(RACERS)]
    assert barrier.release() == RACERS
    outcomes = [w.wait(timeout=120) for w in workers]
    assert all(o.ok for o in outcomes), [o.summary() for o in outcomes]
    results = [o.value for o in outcomes]
    winners = [(i, r[1]) for i, r in enumerate(results) if r[0] == "ok"]
    assert len(winners) == 1, results
    assert sorted(r[0] for r in results if r[0] != "ok") == ["ResumeConflict"] * (RACERS - 1)
    index, state = winners[0]
    assert state["first"] == "bob" and state["second"] == f"r{index}"
    loaded = run(lambda: RemitFlowPersistence(url).load_state(flow_id))
    assert loaded.ok and loaded.value == state, loaded.summary()
    late = run(
        lambda: two_reviews_flow(url, world).from_pending(flow_id, RemitFlowPersistence(url))
    )
    assert late.raised("ResumeConflict"), late.summary()
    assert entered(world) == {"prepare": 1, "middle": 1, "done": 1}
    assert applied(world) == {"mid": 1}


def test_inputs_to_a_paused_flows_restart_are_kept_with_its_pause(url: str, world: Path) -> None:
    """A paused flow kicked off again with an input that overrides its saved `note` pauses
    again at the same feedback (P1: `fill` is not run again), with the input in the state
    its pause keeps: `from_pending` from another process gets it, and the one feedback
    is consumed once."""
    flow_id = f"basket-{uuid.uuid4().hex}"
    started = run(lambda: kickoff(basket_flow(url, world, alias=False), inputs={"id": flow_id}))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    again = run(
        lambda: kickoff(
            basket_flow(url, world, alias=False), inputs={"id": flow_id, "note": "gift"}
        )
    )
    assert again.ok and again.value["out"] == "HumanFeedbackPending", again.summary()

    def resumed() -> dict[str, Any]:
        flow_class = basket_flow(url, world, alias=False)
        flow = flow_class.from_pending(flow_id, RemitFlowPersistence(url))
        loaded = flow.state.note
        flow.resume("ann")
        return {"loaded": loaded, "state": flow.state.model_dump()}

    done = run(resumed)
    assert done.ok, done.error_text()
    assert done.value["loaded"] == "gift" and done.value["state"]["note"] == "gift"
    late = run(
        lambda: basket_flow(url, world, alias=False).from_pending(
            flow_id, RemitFlowPersistence(url)
        )
    )
    assert late.raised("ResumeConflict"), late.summary()
    assert entered(world) == {"fill": 1, "pack": 1}
    assert applied(world) == {"pack": 1}


# -- an async flow killed between two effects of one method ---------------------------------


def async_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> settle (async effects "hold" then "capture") -> close, all `async def`;
    built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_core import effect

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}

    @effect(reconcile=sink.reconcile)
    async def hold(*, idempotency_key: str) -> str:
        return sink.apply("hold", idempotency_key)

    @effect(reconcile=sink.reconcile)
    async def capture(*, idempotency_key: str) -> str:
        return sink.apply("capture", idempotency_key)

    class Payment(BaseModel):
        hold: str | None = None
        capture: str | None = None
        closed: bool = False

    @persist(RemitFlowPersistence(url, lease=1.0))
    class PaymentFlow(Flow[Payment]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        async def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        async def settle(self) -> None:
            journal.record("enter", "settle")
            self.state.hold = await hold()
            point(at, "settle.between")
            self.state.capture = await capture()

        @listen(settle)
        async def close(self) -> None:
            journal.record("enter", "close")
            self.state.closed = True

    return PaymentFlow


def test_an_async_flow_killed_between_two_effects_of_a_step_applies_each_once(
    url: str, world: Path
) -> None:
    """P1, P2 (cells 11/12, async): `kickoff_async` SIGKILLed inside an async step after its
    first effect and before its second. The restart with `kickoff_async` runs only that
    step again: its first effect returns its recorded outcome, the second is applied
    once, and the state holds both receipts."""
    import asyncio

    flow_id = f"pay-{uuid.uuid4().hex}"

    def go(points: dict[str, str] | None) -> Any:
        async def main() -> dict[str, Any]:
            flow = async_flow(url, world, points=points)(suppress_flow_events=True)
            await flow.kickoff_async(inputs={"id": flow_id})
            return flow.state.model_dump()

        return lambda: asyncio.run(main())

    crashed = run(go({"settle.between": "kill"}))
    assert crashed.status == "killed", crashed.summary()
    assert applied(world) == {"hold": 1}
    time.sleep(1.2)  # the dead kickoff's claim runs out
    done = run(go(None))
    assert done.ok, done.error_text()
    assert done.value["closed"] is True and done.value["hold"] and done.value["capture"]
    assert entered(world) == {"prepare": 1, "settle": 2, "close": 1}
    assert applied(world) == {"hold": 1, "capture": 1}
    again = run(go(None))
    assert again.ok and again.value == done.value, again.summary()
    assert entered(world) == {"prepare": 1, "settle": 2, "close": 1}


# -- a feedback router feeding `or_` and `and_` listeners ---------------------------------------


def triage_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> review (`@human_feedback(emit=["ship", "hold"])`, pauses) -> "ship" ->
    pack (effect "pack"); `or_("ship", "hold")` -> log; `and_(pack, log)` -> done (effect
    "done"); a model state with a nested model; built in a child."""
    from crewai.flow.flow import Flow, and_, listen, or_, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    pack_effect, done_effect = sink_effect(sink, "pack"), sink_effect(sink, "done")

    class Trail(BaseModel):
        seen: list[str] = []

    class Triage(BaseModel):
        trail: Trail = Trail()
        outcome: str | None = None

    @persist(RemitFlowPersistence(url, lease=1.0))
    class TriageFlow(Flow[Triage]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.trail.seen.append("prepare")

        @listen(prepare)
        @human_feedback(
            message="Ship?", emit=["ship", "hold"], default_outcome="ship", provider=Later()
        )
        def review(self) -> str:
            return "order"

        @listen("ship")
        def pack(self) -> None:
            journal.record("enter", "pack")
            pack_effect()
            self.state.trail.seen.append("pack")

        @listen(or_("ship", "hold"))
        def log(self) -> None:
            journal.record("enter", "log")
            assert self.last_human_feedback is not None
            self.state.outcome = self.last_human_feedback.outcome

        @listen(and_(pack, log))
        def done(self) -> None:
            journal.record("enter", "done")
            done_effect()
            point(at, "done.after")
            self.state.trail.seen.append("done")

    return TriageFlow


def test_a_feedback_route_feeding_or_and_and_listeners_is_resumed_and_restarted_once(
    url: str, world: Path
) -> None:
    """P1, P2, P5: the resume of an `emit=` feedback takes the route "ship" (its default
    outcome); its `or_` and
    `and_` listeners run, and the join's step is SIGKILLed after its effect. The restart
    replays the route, the `or_` listener and the join's other side without running them,
    runs the join's step again (its effect returns its recorded outcome) and keeps the
    feedback's outcome; a second restart runs nothing; the pause is not answered twice."""
    started = run(lambda: kickoff(triage_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]

    def resumed() -> None:
        flow_class = triage_flow(url, world, points={"done.after": "kill"})
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        flow.resume("")  # no feedback: the default outcome (no LLM classifies it)

    crashed = run(resumed)
    assert crashed.status == "killed", crashed.summary()
    assert applied(world) == {"pack": 1, "done": 1}
    time.sleep(1.2)  # the dead resumer's claim runs out
    done = run(lambda: kickoff(triage_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.error_text()
    assert done.value["state"]["outcome"] == "ship"
    assert done.value["state"]["trail"] == {"seen": ["prepare", "pack", "done"]}
    assert entered(world) == {"prepare": 1, "pack": 1, "log": 1, "done": 2}
    again = run(lambda: kickoff(triage_flow(url, world), inputs={"id": flow_id}))
    assert again.ok and again.value["state"] == done.value["state"], again.summary()
    late = run(lambda: triage_flow(url, world).from_pending(flow_id, RemitFlowPersistence(url)))
    assert late.raised("ResumeConflict"), late.summary()
    assert entered(world) == {"prepare": 1, "pack": 1, "log": 1, "done": 2}
    assert applied(world) == {"pack": 1, "done": 1}


# -- a persistence given to the flow instance over the class's ------------------------------


def shop_flow(world: Path, crewai_db: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> charge (effect "charge") -> ship, `@persist`ed at class level to CrewAI's
    own SQLite backend; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import SQLiteFlowPersistence, persist

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    charge_effect = sink_effect(sink, "charge")

    @persist(SQLiteFlowPersistence(str(crewai_db)))
    class ShopFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["amount"] = 3

        @listen(prepare)
        def charge(self) -> None:
            journal.record("enter", "charge")
            self.state["receipt"] = charge_effect()
            point(at, "charge.after")

        @listen(charge)
        def ship(self) -> None:
            journal.record("enter", "ship")
            self.state["shipped"] = True

    return ShopFlow


def test_a_persistence_given_to_the_instance_drives_a_class_persisted_to_another_backend(
    url: str, world: Path, tmp_path: Path
) -> None:
    """`Flow(persistence=RemitFlowPersistence(...))` overrides the class's `@persist` backend
    for every save, as in CrewAI: SIGKILLed after `charge` applied its effect, the flow
    restarted with the same instance persistence runs only `charge` again (its effect
    returns its recorded outcome) and `ship` (P1, P2); the class's backend saw nothing."""
    crewai_db = tmp_path / "crewai.db"
    flow_id = f"shop-{uuid.uuid4().hex}"

    def go(points: dict[str, str] | None) -> Any:
        def body() -> dict[str, Any]:
            flow_class = shop_flow(world, crewai_db, points=points)
            flow = flow_class(
                persistence=RemitFlowPersistence(url, lease=1.0), suppress_flow_events=True
            )
            flow.kickoff(inputs={"id": flow_id})
            return dict(flow.state)

        return body

    crashed = run(go({"charge.after": "kill"}))
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead kickoff's claim runs out
    done = run(go(None))
    assert done.ok, done.error_text()
    assert done.value["shipped"] is True and done.value["amount"] == 3
    assert entered(world) == {"prepare": 1, "charge": 2, "ship": 1}
    assert applied(world) == {"charge": 1}

    def stores() -> Any:
        from crewai.flow.persistence import SQLiteFlowPersistence

        return [
            RemitFlowPersistence(url).load_state(flow_id),
            SQLiteFlowPersistence(str(crewai_db)).load_state(flow_id),
        ]

    seen = run(stores)
    assert seen.ok, seen.summary()
    assert seen.value == [done.value, None]
