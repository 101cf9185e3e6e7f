"""Probes of round 35: state models whose validators change a value on the way back, a
stale resumer of a feedback loop that paused again at the same method, and async feedback
methods that pay before they pause, raced by resumers in several processes.

Written from the contract (P4: a committed checkpoint reads back as the state it was saved
from, or the save is refused naming the field, with the head where it was; P6: a restart
ends where an uninterrupted run ends; P5 and L2: one resumer consumes a pause, and one whose
claim lapsed while the flow moved on never answers the flow's newer pause; P1, P2) against
real CrewAI flows in forked children, with the helpers of `test_crewai_flows`, on every
engine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, child, entered, run
from test_crewai_probes5 import loop_review_flow

from remit_core.conformance.processes import Barrier, fork
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_core.effects import effect
from remit_crewai import RemitFlowPersistence


def _wait_for(path: Path) -> None:
    """Block until `path` exists (another process's signal that it got there)."""
    for _ in range(6000):
        if path.exists():
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def contact_flow(url: str, world: Path) -> type[Any]:
    """prepare -> collect (assigns its input as the address, which a field validator of the
    state model lowercases) -> send (effect); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, field_validator

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    send_mail = sink_effect(sink, "send")

    class Contact(BaseModel):
        source: str = ""
        email: str = ""
        tries: int = 0
        sent_to: str = ""

        @field_validator("email")
        @classmethod
        def _normalise(cls, value: str) -> str:
            return value.strip().lower()

    @persist(RemitFlowPersistence(url))
    class ContactFlow(Flow[Contact]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.tries += 1

        @listen(prepare)
        def collect(self) -> None:
            journal.record("enter", "collect")
            self.state.email = self.state.source  # no validate_assignment

        @listen(collect)
        def send(self) -> None:
            journal.record("enter", "send")
            send_mail()
            self.state.sent_to = self.state.email

    return ContactFlow


def test_a_value_its_models_validator_would_change_on_restart_is_refused_naming_it(
    url: str, world: Path
) -> None:
    """P4, P6: a step assigns, without `validate_assignment`, an address the state model's
    field validator lowercases when CrewAI restores the state. Stored as it was, a restart
    would go on with another state than the run had (the uninterrupted run sends to the
    address as assigned, a restart to the lowercased one, and `load_state` gives the
    first): the save is refused with `CheckpointInvalid` naming the field, nothing is
    written, the head stays at the last good step, and a restart with an input the model
    reads back as it is finishes from there, the effect once. (It used to be stored as it
    was.)"""

    def body() -> dict[str, Any]:
        flow_class = contact_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        flow = flow_class(suppress_flow_events=True)
        try:
            flow.kickoff(inputs={"source": "  Alice@Example.COM "})
            refusal: dict[str, Any] | None = None
        except RuntimeError as exc:
            cause = exc.__cause__
            refusal = {"class": type(cause).__name__, "field": getattr(cause, "field", None)}
        head = store.load_state(flow.flow_id)
        methods = [c.method for c in store.checkpoints(flow.flow_id)]
        again = flow_class(suppress_flow_events=True)
        again.kickoff(inputs={"id": flow.flow_id, "source": "alice@example.com"})
        return {
            "refusal": refusal,
            "head": None if head is None else {k: head[k] for k in ("email", "tries")},
            "methods": methods,
            "end": again.state.model_dump(exclude={"id"}),
            "stored": (store.load_state(flow.flow_id) or {}).get("sent_to"),
        }

    done = run(body)
    assert done.ok, done.summary()
    got = done.value
    assert got["refusal"] == {"class": "CheckpointInvalid", "field": "email"}
    assert got["head"] == {"email": "", "tries": 1}, got["head"]
    assert got["methods"][0] == "prepare", got["methods"]
    assert got["end"]["sent_to"] == "alice@example.com" == got["stored"], got
    assert got["end"]["tries"] == 1
    assert entered(world) == {"prepare": 1, "collect": 2, "send": 1}
    assert applied(world) == {"send": 1}


def test_a_stale_resumer_of_a_loop_paused_again_at_the_same_method_is_refused(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P5, L2: A loads pause 1 of a feedback loop (`from_pending`) and stalls past its
    lease; B answers pause 1 ("revise"), the loop reworks once and pauses again at the same
    method. A's late answer ("approve") must not be taken for pause 2: it is refused,
    nothing runs, pause 2 still waits and its own answer finishes the flow once."""
    started = run(lambda: {"id": loop_review_flow(url, world)().kickoff().context.flow_id})
    assert started.ok, started.summary()
    flow_id = started.value["id"]
    loaded, go = tmp_path / "loaded", tmp_path / "go"

    def stale() -> dict[str, Any]:
        flow_class = loop_review_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        held = flow_class.from_pending(flow_id, store)
        loaded.touch()
        _wait_for(go)
        held.resume("approve")
        return held.state.model_dump()

    holder = child(stale)
    _wait_for(loaded)
    time.sleep(1.3)  # past the 1 s lease of `loop_review_flow`

    def answer(value: str) -> Any:
        def body() -> Any:
            flow_class = loop_review_flow(url, world)
            flow = flow_class.from_pending(
                flow_id, flow_class.__flow_persistence_config__.persistence
            )
            out = flow.resume(value)
            return {"out": type(out).__name__, "state": flow.state.model_dump()}

        return body

    revised = run(answer("revise"))
    assert revised.ok and revised.value["out"] == "HumanFeedbackPending", revised.summary()
    go.touch()
    late = holder.wait(timeout=120)
    assert late.raised("ResumeConflict") or late.raised("Fenced"), late.summary()
    pending = run(lambda: RemitFlowPersistence(url).load_pending_feedback(flow_id) is not None)
    assert pending.ok and pending.value is True, pending.summary()
    assert "ship" not in entered(world)
    done = run(answer("approve"))
    assert done.ok and done.value["out"] == "NoneType", done.summary()
    assert done.value["state"]["answers"] == ["revise", "approve"]
    assert entered(world) == {"prepare": 1, "review": 2, "decide": 2, "rework": 1, "ship": 1}
    assert applied(world) == {"redraft": 1, "send": 1}


def paying_review_flow(url: str, world: Path) -> type[Any]:
    """open (async) -> review (async `@human_feedback`: pays a deposit, then pauses) ->
    settle (async, effect); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

    @effect(reconcile=sink.reconcile)
    async def deposit(*, idempotency_key: str) -> str:
        return sink.apply("deposit", idempotency_key)

    @effect(reconcile=sink.reconcile)
    async def settle_up(*, idempotency_key: str) -> str:
        return sink.apply("settle", idempotency_key)

    class Tab(BaseModel):
        deposit: str | None = None
        who: str | None = None
        receipt: str | None = None

    @persist(RemitFlowPersistence(url))
    class PayingReview(Flow[Tab]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        async def open_tab(self) -> None:
            journal.record("enter", "open_tab")

        @listen(open_tab)
        @human_feedback(message="Settle?", provider=Later())
        async def review(self) -> str:
            journal.record("enter", "review")
            self.state.deposit = await deposit()
            return "tab"

        @listen(review)
        async def settle(self) -> str:
            journal.record("enter", "settle")
            assert self.last_human_feedback is not None
            self.state.who = self.last_human_feedback.feedback
            self.state.receipt = await settle_up()
            return "settled"

    return PayingReview


def test_k_async_resumers_of_a_method_that_paid_then_paused_let_one_proceed(
    url: str, world: Path
) -> None:
    """P2, P5: an async feedback method pays a deposit, then pauses. A restart by
    `kickoff_async` runs it again and pauses again without paying again; then 4 processes
    `resume_async` the pause behind a barrier: exactly one proceeds, the others get
    `ResumeConflict`; the deposit and the settlement each apply once, and the state holds
    the winner's answer."""

    def start_and_restart() -> dict[str, Any]:
        flow_class = paying_review_flow(url, world)
        first = flow_class(suppress_flow_events=True)
        paused = asyncio.run(first.kickoff_async())
        again = flow_class(suppress_flow_events=True)
        repaused = asyncio.run(again.kickoff_async(inputs={"id": first.flow_id}))
        return {
            "id": first.flow_id,
            "outs": [type(paused).__name__, type(repaused).__name__],
            "deposit": again.state.deposit,
        }

    started = run(start_and_restart)
    assert started.ok, started.summary()
    assert started.value["outs"] == ["HumanFeedbackPending", "HumanFeedbackPending"]
    assert applied(world) == {"deposit": 1}
    flow_id = started.value["id"]
    k = 4
    barrier = Barrier(k)

    def resumer(i: int) -> Any:
        def body() -> Any:
            flow_class = paying_review_flow(url, world)
            store = flow_class.__flow_persistence_config__.persistence
            barrier.wait()

            async def go() -> Any:
                flow = flow_class.from_pending(flow_id, store)
                out = await flow.resume_async(f"reviewer-{i}")
                return {"out": out, "state": flow.state.model_dump()}

            return asyncio.run(go())

        return body

    workers = [fork(resumer(i), barrier=barrier) for i in range(k)]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    winners = [i for i, o in enumerate(outcomes) if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), [
        o.summary() for o in outcomes
    ]
    won = outcomes[winners[0]].value
    assert won["out"] == "settled" and won["state"]["who"] == f"reviewer-{winners[0]}"
    assert won["state"]["deposit"] == started.value["deposit"] is not None
    assert applied(world) == {"deposit": 1, "settle": 1}
    assert entered(world)["settle"] == 1
