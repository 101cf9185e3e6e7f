"""Round 47 of the CrewAI probes: a model state whose validators refuse what a step
assigns, a router loop with async steps and an `and_` join with effects, SIGKILLed at
several points and restarted, a `kickoff_async` and a `kickoff` racing to restart one
flow, and feedback in unusual text (emoji, NUL) with the error surfaces of
`from_pending` (an unknown flow id, another flow class).

Written from the contract and CrewAI's public API, against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, child, entered, point, run

from remit_core.conformance.processes import Barrier
from remit_core.conformance.world import EffectSink, Journal, WorldDB

PATIENCE = 60.0  # seconds to wait for a dead claim's lease (1 s here) to run out
ROUNDS = 3


def until_free(attempt: Any) -> Any:
    """`attempt()` again while another process holds the claim (a killed one's until it
    lapses)."""
    from remit_core import ResumeConflict

    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            return attempt()
        except ResumeConflict:
            continue
    raise AssertionError("the claim was never free")


# -- P4: validators that refuse what a step assigns ---------------------------------------


def sku_flow(url: str, world: Path) -> type[Any]:
    """prepare (effect "hold") -> label (assigns `wanted` to `sku`, and `refund`) -> ship
    (effect "ship"); the model's field validator wants an upper-case `sku`, its model
    validator a `refund` no larger than `amount`; assignments are not validated."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, field_validator, model_validator

    from remit_crewai import RemitFlowPersistence

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    hold, ship = sink_effect(sink, "hold"), sink_effect(sink, "ship")

    class Parcel(BaseModel):
        wanted: str = ""
        sku: str = "NONE"
        amount: int = 0
        refund: int = 0
        asked_refund: int = 0
        receipts: list[str] = []

        @field_validator("sku")
        @classmethod
        def upper_case(cls, value: str) -> str:
            if value != value.upper():
                raise ValueError("a sku is upper case")
            return value

        @model_validator(mode="after")
        def refund_fits(self) -> Parcel:
            if self.refund > self.amount:
                raise ValueError("the refund exceeds the amount")
            return self

    @persist(RemitFlowPersistence(url, lease=1.0))
    class SkuFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.amount = 10
            self.state.receipts.append(str(hold()))

        @listen(prepare)
        def label(self) -> None:
            journal.record("enter", "label")
            self.state.sku = self.state.wanted
            self.state.refund = self.state.asked_refund

        @listen(label)
        def send(self) -> None:
            journal.record("enter", "send")
            self.state.receipts.append(str(ship()))

    return SkuFlow


def kick(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff(**kwargs)
    return {"id": flow.flow_id, "state": flow.state.model_dump(), "out": type(out).__name__}


def stored(url: str, flow_id: str) -> dict[str, Any]:
    from remit_crewai import RemitFlowPersistence

    store = RemitFlowPersistence(url)
    return {
        "state": store.load_state(flow_id),
        "methods": [c.method for c in store.checkpoints(flow_id)],
    }


@pytest.mark.parametrize(
    ("inputs", "field"),
    [({"wanted": "abc"}, "sku"), ({"wanted": "ABC", "asked_refund": 50}, "refund")],
    ids=["field-validator", "model-validator"],
)
def test_a_value_the_models_validators_refuse_is_refused_and_a_restart_continues(
    url: str, world: Path, inputs: dict[str, Any], field: str
) -> None:
    """P4: a step assigns (without `validate_assignment`) a value the model's field
    validator, or its model validator, refuses. The save raises `CheckpointInvalid`
    naming the flow and the message of the validator, nothing is stored for the step, the
    flow id still loads as it was after `prepare`, and a restart with good inputs
    continues: `prepare` and its effect are not done again."""
    flow_id = f"sku-{uuid.uuid4().hex}"
    bad = run(lambda: kick(sku_flow(url, world), inputs={"id": flow_id, **inputs}))
    assert bad.raised("CheckpointInvalid"), bad.summary()
    text = bad.message_of("CheckpointInvalid") or ""
    assert flow_id in text and field in text, text
    before = run(lambda: stored(url, flow_id))
    assert before.ok, before.summary()
    assert before.value["methods"] == ["prepare"], before.value
    assert before.value["state"]["sku"] == "NONE" and before.value["state"]["refund"] == 0
    good = {"wanted": "ABC", "asked_refund": 5}
    done = run(
        lambda: until_free(lambda: kick(sku_flow(url, world), inputs={"id": flow_id, **good}))
    )
    assert done.ok, done.summary()
    assert done.value["state"]["sku"] == "ABC" and done.value["state"]["refund"] == 5
    assert len(done.value["state"]["receipts"]) == 2
    assert entered(world) == {"prepare": 1, "label": 2, "send": 1}
    assert applied(world) == {"hold": 1, "ship": 1}


# -- P1, P2, P6: a router loop, async steps and an `and_` join, killed and restarted ---------


def loop_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """open (async) -> pack (effect "pack", each round) -> more (a router: "again" loops
    back to pack, ROUNDS times in all, then "done") -> bill (async, effect "bill") and label
    (effect "label") -> ship (`and_(bill, label)`, effect "ship")."""
    from crewai.flow.flow import Flow, and_, listen, or_, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    pack, bill, label, ship = (sink_effect(sink, k) for k in ("pack", "bill", "label", "ship"))

    class Box(BaseModel):
        rounds: int = 0
        log: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class LoopFlow(Flow[Box]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        async def open(self) -> None:
            journal.record("enter", "open")
            self.state.log.append("open")

        @listen(or_(open, "again"))
        def pack(self) -> None:
            journal.record("enter", "pack")
            receipt = str(pack())
            point(at, f"pack.{self.state.rounds}")
            self.state.rounds += 1
            self.state.log.append(f"pack {self.state.rounds} {receipt}")

        @router(pack)
        def more(self) -> str:
            journal.record("enter", "more")
            return "again" if self.state.rounds < ROUNDS else "done"

        @listen("done")
        async def bill(self) -> None:
            journal.record("enter", "bill")
            receipt = str(await _call(bill))
            if at.get("bill") == "fail":
                raise RuntimeError("bill failed")
            point(at, "bill")
            self.state.log.append(f"bill {receipt}")

        @listen("done")
        def label(self) -> None:
            journal.record("enter", "label")
            self.state.log.append(f"label {label()}")

        @listen(and_(bill, label))
        def ship(self) -> str:
            journal.record("enter", "ship")
            receipt = str(ship())
            point(at, "ship")
            self.state.log.append(f"ship {receipt}")
            return "shipped"

    return LoopFlow


async def _call(fn: Any) -> Any:
    return fn()


def kick_async(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    import asyncio

    flow = flow_class(suppress_flow_events=True)
    out = asyncio.run(flow.kickoff_async(**kwargs))
    return {"id": flow.flow_id, "state": flow.state.model_dump(), "out": out}


def settled(log: list[str]) -> list[str]:
    """The log with `bill` and `label` (run side by side) in one order."""
    return [*log[: ROUNDS + 1], *sorted(log[ROUNDS + 1 : ROUNDS + 3]), *log[ROUNDS + 3 :]]


@pytest.mark.parametrize("killed_at", ["pack.1", "bill", "ship"])
def test_a_loop_with_async_steps_and_a_join_killed_and_restarted_applies_each_effect_once(
    url: str, world: Path, killed_at: str
) -> None:
    """P1, P2, P6: SIGKILLed after the effect of the second round of `pack`, of `bill`
    (async, beside `label`), or of `ship` (an `and_` join), the flow restarted by id with
    `kickoff_async` ends in the state of an uninterrupted run: each round packs once,
    bill, label and ship apply once; completed methods are not entered again; a second
    restart runs nothing."""
    flow_id = f"loop-{uuid.uuid4().hex}"
    died = run(
        lambda: kick_async(
            loop_flow(url, world, points={killed_at: "kill"}), inputs={"id": flow_id}
        )
    )
    assert died.status == "killed", died.summary()
    done = run(
        lambda: until_free(lambda: kick_async(loop_flow(url, world), inputs={"id": flow_id}))
    )
    assert done.ok, done.summary()
    log = done.value["state"]["log"]
    assert done.value["state"]["rounds"] == ROUNDS and done.value["out"] == "shipped", log
    assert [line.split(" ")[0] for line in settled(log)] == [
        "open",
        *["pack"] * ROUNDS,
        "bill",
        "label",
        "ship",
    ], log
    assert applied(world) == {"pack": ROUNDS, "bill": 1, "label": 1, "ship": 1}
    assert EffectSink(WorldDB(world)).repeats() == {}
    once = {"open": 1, "more": ROUNDS, "pack": ROUNDS, "bill": 1, "label": 1, "ship": 1}
    name = killed_at.split(".")[0]
    assert entered(world) == {**once, name: once[name] + 1}
    again = run(lambda: kick_async(loop_flow(url, world), inputs={"id": flow_id}))
    assert again.ok and again.value["state"] == done.value["state"], again.summary()
    assert entered(world) == {**once, name: once[name] + 1}


def test_kickoff_async_and_kickoff_racing_to_restart_one_flow(url: str, world: Path) -> None:
    """P5, P2: a flow that failed in `bill` (after its effect; the flow is given back at
    once) is restarted by two processes behind a barrier, one with `kickoff_async`, one
    with `kickoff`. The one that claims it holds it in `ship` until the other has ended:
    that one gets `ResumeConflict` and runs nothing. The flow then ends once, each effect
    applied once."""
    flow_id = f"race-{uuid.uuid4().hex}"
    died = run(
        lambda: kick_async(loop_flow(url, world, points={"bill": "fail"}), inputs={"id": flow_id})
    )
    assert died.raised("RuntimeError") and "bill failed" in died.error_text(), died.summary()
    gate = world.parent / "gate"
    saved = run(lambda: stored(url, flow_id))
    assert saved.ok and "bill" not in saved.value["methods"], saved.summary()
    # `label` runs beside `bill`: CrewAI may cancel it when `bill` fails.
    label_again = int("label" not in saved.value["methods"])
    before = entered(world)
    barrier = Barrier(2)
    held = {"ship": f"wait:{gate}"}

    def racer(asynchronous: bool) -> Any:
        def body() -> Any:
            flow_class = loop_flow(url, world, points=held)
            barrier.wait()
            go = kick_async if asynchronous else kick
            return go(flow_class, inputs={"id": flow_id})["state"]

        return body

    workers = [child(racer(flag), barrier=barrier) for flag in (True, False)]
    barrier.release()
    first, deadline = None, time.monotonic() + 120
    while first is None:
        assert time.monotonic() < deadline, "neither restart ended"
        for w in workers:
            if (o := w.poll()) is not None:
                first = (w, o)
                break
        else:
            time.sleep(0.01)
    loser, lost = first
    assert lost.raised("ResumeConflict"), lost.summary()
    gate.touch()
    winner = next(w for w in workers if w is not loser)
    won = winner.wait(timeout=120)
    assert won.ok, won.summary()
    assert won.value["rounds"] == ROUNDS and len(won.value["log"]) == ROUNDS + 4
    assert applied(world) == {"pack": ROUNDS, "bill": 1, "label": 1, "ship": 1}
    assert entered(world) == {
        **before,
        "bill": before["bill"] + 1,
        "label": before.get("label", 0) + label_again,
        "ship": 1,
    }


# -- P5, P4: feedback text, and the errors of `from_pending` ---------------------------------


def ask_flow(url: str, world: Path) -> type[Any]:
    """prepare -> review (`@human_feedback`, pauses) -> pay (effect "pay"), dict state."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    pay = sink_effect(sink, "pay")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class AskFlow(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True
        initial_state = {"note": "", "who": None}

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["note"] = "ünïcødé 🎉 a\x00b"

        @listen(prepare)
        @human_feedback(message="Pay? 💳", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return f"order {self.state['note']}"

        @listen(review)
        def pay_it(self) -> str:
            journal.record("enter", "pay_it")
            self.state["who"] = self.last_human_feedback.feedback
            return str(pay())

    return AskFlow


def other_flow(url: str) -> type[Any]:
    """Another flow class with a method of the same name as `ask_flow`'s pause."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    @persist(RemitFlowPersistence(url, lease=1.0))
    class OtherFlow(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            pass

        @listen(prepare)
        @human_feedback(message="Other?", provider=Later())
        def review(self) -> str:
            return "other"

    return OtherFlow


def answer(flow_class: type[Any], flow_id: str, value: str) -> dict[str, Any]:
    flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
    out = flow.resume(value)
    return {"out": out, "state": dict(flow.state)}


FEEDBACK = "yes ✅ — ok\x00fine 🎉"


def test_feedback_and_state_in_any_unicode_with_nul_are_kept_exactly(url: str, world: Path) -> None:
    """P5, P1: a dict state holding emoji and a NUL pauses; the pause's context keeps
    them; feedback with emoji and a NUL is consumed once and lands in the state as given;
    a second answer is refused; a restart by id gives `last_human_feedback` back exactly
    and runs nothing again."""
    started = run(lambda: kick_dict(ask_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]

    def pending() -> list[str]:
        from remit_crewai import RemitFlowPersistence

        loaded = RemitFlowPersistence(url).load_pending_feedback(flow_id)
        assert loaded is not None
        return [loaded[0]["note"], str(loaded[1].method_output), loaded[1].message]

    assert run(pending).value == ["ünïcødé 🎉 a\x00b", "order ünïcødé 🎉 a\x00b", "Pay? 💳"]
    answered = run(lambda: answer(ask_flow(url, world), flow_id, FEEDBACK))
    assert answered.ok, answered.summary()
    assert answered.value["state"]["who"] == FEEDBACK
    assert run(lambda: answer(ask_flow(url, world), flow_id, "no")).raised("ResumeConflict")

    def restart() -> dict[str, Any]:
        flow = ask_flow(url, world)(suppress_flow_events=True)
        out = flow.kickoff(inputs={"id": flow_id})
        feedback = flow.last_human_feedback
        return {"out": out, "feedback": feedback.feedback if feedback else None, **flow.state}

    again = run(restart)
    assert again.ok, again.summary()
    assert again.value["feedback"] == FEEDBACK and again.value["who"] == FEEDBACK
    assert again.value["note"] == "ünïcødé 🎉 a\x00b"
    assert entered(world) == {"prepare": 1, "review": 1, "pay_it": 1}
    assert applied(world) == {"pay": 1}


def kick_dict(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff(**kwargs)
    return {"id": flow.flow_id, "state": dict(flow.state), "out": type(out).__name__}


def test_from_pending_of_an_unknown_id_or_by_another_flow_class_is_refused_clearly(
    url: str, world: Path
) -> None:
    """P4, P5: `from_pending` of an id nothing was saved for fails naming the id and
    stores nothing; `from_pending` of a paused flow by another flow class (whose pause
    method has the same name) raises `VersionMismatch` naming both classes, runs nothing,
    and the pause stays for its own class, which resumes it at once."""
    unknown = f"nope-{uuid.uuid4().hex}"
    missing = run(lambda: answer(ask_flow(url, world), unknown, "yes"))
    assert missing.raised("ValueError", "LookupError"), missing.summary()
    assert unknown in missing.error_text(), missing.error_text()
    assert run(lambda: stored_or_none(url, unknown)).value is None

    started = run(lambda: kick_dict(ask_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    wrong = run(lambda: answer(other_flow(url), flow_id, "yes"))
    assert wrong.raised("VersionMismatch"), wrong.summary()
    assert "OtherFlow" in wrong.error_text() and "AskFlow" in wrong.error_text()
    right = run(lambda: answer(ask_flow(url, world), flow_id, "yes"))
    assert right.ok and right.value["state"]["who"] == "yes", right.summary()
    assert entered(world) == {"prepare": 1, "review": 1, "pay_it": 1}
    assert applied(world) == {"pay": 1}


def stored_or_none(url: str, flow_id: str) -> Any:
    from remit_crewai import RemitFlowPersistence

    store = RemitFlowPersistence(url)
    return store.load_state(flow_id) or store.load_pending_feedback(flow_id)


def test_two_tasks_of_one_event_loop_driving_one_flow_id(url: str, world: Path) -> None:
    """P5: in one event loop, a `kickoff_async` of a new flow id holds the flow in `ship`;
    a second task's `kickoff_async`, and a thread's `kickoff`, of the same id meanwhile get
    `ResumeConflict` and run nothing; the first then ends, each effect applied once."""
    flow_id = f"tasks-{uuid.uuid4().hex}"
    gate = world.parent / "gate"

    def body() -> dict[str, Any]:
        import asyncio

        from remit_core import ResumeConflict

        journal = Journal(WorldDB(world))
        holder = loop_flow(url, world, points={"ship": f"wait:{gate}"})

        async def main() -> dict[str, Any]:
            first = holder(suppress_flow_events=True)
            held = asyncio.ensure_future(first.kickoff_async(inputs={"id": flow_id}))
            while dict(journal.entered()).get("ship", 0) == 0:
                assert not held.done(), held.exception()
                await asyncio.sleep(0.01)
            refused: list[str] = []
            second = loop_flow(url, world)(suppress_flow_events=True)
            try:
                await second.kickoff_async(inputs={"id": flow_id})
            except ResumeConflict:
                refused.append("task")
            third = loop_flow(url, world)(suppress_flow_events=True)
            try:
                await asyncio.to_thread(third.kickoff, inputs={"id": flow_id})
            except ResumeConflict:
                refused.append("thread")
            gate.touch()
            out = await held
            return {"refused": refused, "out": out, "state": first.state.model_dump()}

        return asyncio.run(main())

    done = run(body)
    assert done.ok, done.summary()
    assert done.value["refused"] == ["task", "thread"], done.value
    assert done.value["out"] == "shipped" and done.value["state"]["rounds"] == ROUNDS
    assert applied(world) == {"pack": ROUNDS, "bill": 1, "label": 1, "ship": 1}
    once = {"open": 1, "more": ROUNDS, "pack": ROUNDS, "bill": 1, "label": 1, "ship": 1}
    assert entered(world) == once


def test_from_pending_without_a_backend_uses_the_flow_class_persistence(
    url: str, world: Path
) -> None:
    """P5: `MyFlow.from_pending(flow_id)` without a backend (CrewAI's documented simple
    usage) for a class `@persist`ed to Remit finds the pause where the class saved it (not
    in CrewAI's default backend, which never held it): two such resumers race behind a
    barrier, one proceeds and the other gets `ResumeConflict`; the effect applies once. A
    flow class whose `@persist` is another backend keeps CrewAI's default lookup."""
    started = run(lambda: kick_dict(ask_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    barrier = Barrier(2)

    def resumer(who: str) -> Any:
        def body() -> Any:
            flow_class = ask_flow(url, world)
            barrier.wait()
            flow = flow_class.from_pending(flow_id)
            return {"out": flow.resume(who), "who": flow.state["who"]}

        return body

    workers = [child(resumer(who), barrier=barrier) for who in ("alice", "bob")]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    won = [o for o in outcomes if o.ok]
    assert len(won) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    assert won[0].value["who"] in ("alice", "bob")
    assert won[0].value["out"].startswith("pay:"), won[0].value
    assert entered(world) == {"prepare": 1, "review": 1, "pay_it": 1}
    assert applied(world) == {"pay": 1}

    def elsewhere() -> str:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import SQLiteFlowPersistence, persist

        @persist(SQLiteFlowPersistence(str(world.parent / "crewai.db")))
        class Elsewhere(Flow[dict[str, Any]]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def go(self) -> None:
                pass

        try:
            Elsewhere.from_pending(flow_id)
        except ValueError as exc:
            return type(exc).__name__
        return "found"

    assert run(elsewhere).value == "ValueError"
