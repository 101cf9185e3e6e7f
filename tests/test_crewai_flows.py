"""Real CrewAI flows on RemitFlowPersistence (no LLM, no network), on every engine.

CrewAI starts threads when a flow is built, so this process only imports it
and every flow runs in a forked child (`remit_core.conformance.processes.fork`),
which is also how a test SIGKILLs or SIGSTOPs a real process. Steps journal
their entries and apply effects to a sink with a payment API's key rule
(`remit_core.conformance.world`), shared by every process of a test.
"""

from __future__ import annotations

import enum
import os

os.environ.update(  # before CrewAI is imported: the network is closed
    CREWAI_DISABLE_TELEMETRY="true",
    CREWAI_DISABLE_TRACKING="true",
    OTEL_SDK_DISABLED="true",
    CREWAI_TRACING_ENABLED="false",
    CREWAI_DISABLE_VERSION_CHECK="true",
)

import contextlib  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Callable  # noqa: E402
from decimal import Decimal  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from crewai.flow.persistence.base import _persistence_registry  # noqa: E402
from crewai.flow.runtime import _resolve_persistence  # noqa: E402

from remit_core import CheckpointInvalid, StoreUnavailable, UnknownRecord, effect  # noqa: E402
from remit_core.conformance.processes import Barrier, Outcome, Worker, fork  # noqa: E402
from remit_core.conformance.world import EffectSink, Journal, WorldDB  # noqa: E402
from remit_crewai import RemitFlowPersistence, fork_token  # noqa: E402
from remit_crewai.probe import CrewAIProbe  # noqa: E402

ENGINES = ["sqlite", "postgresql", "redis"]
CrewAIProbe().preload()  # what every child needs, imported once here


def child(fn: Callable[[], Any], *, barrier: Barrier | None = None) -> Worker:
    """Start `fn` in a forked child; `.wait()` gives its JSON result or its error chain."""
    return fork(fn, barrier=barrier)


def run(fn: Callable[[], Any]) -> Outcome:
    return child(fn).wait(timeout=120)


def entered(world: Path) -> dict[str, int]:
    return dict(Journal(WorldDB(world)).entered())


def applied(world: Path) -> dict[str, int]:
    return dict(EffectSink(WorldDB(world)).counts())


def point(points: dict[str, str], name: str) -> None:
    """A crash point: SIGKILL, SIGSTOP, or wait for a file to appear, as armed."""
    action = points.get(name)
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        # At this thread: a process-directed SIGSTOP lets this thread run on for
        # a moment, into the effect's store transaction, whose SQLite lock the
        # stopped process would then hold for everyone.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    elif action is not None and action.startswith("wait:"):
        while not Path(action[5:]).exists():
            time.sleep(0.02)


def order_flow(
    url: str, world: Path, *, lease: float = 30.0, points: dict[str, str] | None = None
) -> type[Any]:
    """prepare -> adjust -> charge (effect) -> ship, with a model state; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}

    @effect(reconcile=sink.reconcile)
    def charge_card(amount: int, *, idempotency_key: str) -> str:
        return sink.apply("charge", idempotency_key)

    class Order(BaseModel):
        amount: int = Field(default=0, ge=0)
        note: str = ""
        receipt: str | None = None
        shipped: bool = False

    @persist(RemitFlowPersistence(url, lease=lease))
    class OrderFlow(Flow[Order]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.amount = 100

        @listen(prepare)
        def adjust(self) -> None:
            journal.record("enter", "adjust")
            if self.state.note == "bad":
                self.state.amount = -5  # the model does not validate assignments

        @listen(adjust)
        def charge(self) -> None:
            journal.record("enter", "charge")
            point(at, "charge.before")
            self.state.receipt = charge_card(self.state.amount)
            point(at, "charge.after")

        @listen(charge)
        def ship(self) -> None:
            journal.record("enter", "ship")
            self.state.shipped = True

    return OrderFlow


def review_flow(
    url: str, world: Path, *, lease: float = 30.0, output: Any = "parcel", ask: bool = False
) -> type[Any]:
    """prepare -> review (human feedback: pauses; `ask`: after an effect that asks the
    reviewer) -> approve -> ship (effect); built in a child."""
    from crewai.flow.async_feedback.types import HumanFeedbackPending
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

    class Later:
        def request_feedback(self, context: Any, flow: Any) -> str:
            raise HumanFeedbackPending(context=context)

    @effect(reconcile=sink.reconcile)
    def ship_parcel(*, idempotency_key: str) -> str:
        return sink.apply("ship", idempotency_key)

    @effect(reconcile=sink.reconcile)
    def ask_reviewer(*, idempotency_key: str) -> str:
        return sink.apply("ask", idempotency_key)

    class Review(BaseModel):
        approved_by: str | None = None

    @persist(RemitFlowPersistence(url, lease=lease, feedback_schema={"type": "string"}))
    class ReviewFlow(Flow[Review]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> Any:
            if ask:
                ask_reviewer()
            return output

        @listen(review)
        def approve(self) -> None:
            journal.record("enter", "approve")
            assert self.last_human_feedback is not None
            feedback = self.last_human_feedback.feedback
            self.state.approved_by = getattr(feedback, "value", feedback)  # (an Enum's value)

        @listen(approve)
        def ship(self) -> None:
            journal.record("enter", "ship")
            ship_parcel()

    return ReviewFlow


def kickoff(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    out = flow.kickoff(**kwargs)
    state = dict(flow.state) if isinstance(flow.state, dict) else flow.state.model_dump()
    return {"id": flow.flow_id, "state": state, "out": type(out).__name__}


def resume(flow_class: type[Any], flow_id: str, value: Any) -> dict[str, Any]:
    flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
    flow.resume(value)
    return flow.state.model_dump()


def paused_review(url: str, world: Path, lease: float = 30.0) -> str:
    """A review flow paused at its feedback; returns its id."""
    started = run(lambda: kickoff(review_flow(url, world, lease=lease)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    return str(started.value["id"])


class Parcel(str, enum.Enum):
    BOX = "box"


def test_a_feedback_method_output_is_kept_as_crewai_makes_its_json(url: str, world: Path) -> None:
    """A `@human_feedback` method returning a str Enum: CrewAI's pause context holds it as
    it is, and its JSON (what CrewAI's own backend stores) is the str; so is Remit's."""
    started = run(lambda: kickoff(review_flow(url, world, output=Parcel.BOX)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    resumed = run(lambda: resume(review_flow(url, world, output=Parcel.BOX), flow_id, "ann"))
    assert resumed.ok and resumed.value["approved_by"] == "ann", resumed.summary()


def test_feedback_crewai_makes_json_of_is_consumed_once(url: str, world: Path) -> None:
    """P5: feedback that is a str Enum is consumed once, stored as CrewAI's JSON makes it
    (its str); a second resume is refused."""
    flow_id = paused_review(url, world)
    first = run(lambda: resume(review_flow(url, world), flow_id, Parcel.BOX))
    assert first.ok and first.value["approved_by"] == "box", first.summary()
    second = run(lambda: resume(review_flow(url, world), flow_id, "eve"))
    assert second.raised("ResumeConflict"), second.summary()
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}


def test_an_edit_of_a_model_state_is_validated_against_the_model_or_refused(
    url: str, world: Path
) -> None:
    """P4: an operator's `edit_state` on a flow whose state is a model is validated as a
    save is; without `state_type` it is refused (Remit records the model's name and
    imports nothing); nothing is written either way."""
    from pydantic import BaseModel, Field

    class Order(BaseModel):
        amount: int = Field(default=0, ge=0)
        shipped: bool = False

    def edited_flow() -> type[Any]:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist

        @persist(RemitFlowPersistence(url))
        class EditedFlow(Flow[Order]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                self.state.amount = 5

        return EditedFlow

    flow_id = f"edited-{uuid.uuid4().hex}"
    assert run(lambda: kickoff(edited_flow(), inputs={"id": flow_id})).ok
    persistence = RemitFlowPersistence(url)
    with pytest.raises(TypeError, match="Order state: pass edit_state"):
        persistence.edit_state(flow_id, {"amount": -5})
    with pytest.raises(CheckpointInvalid):
        persistence.edit_state(flow_id, {"amount": -5}, state_type=Order)
    assert persistence.load_state(flow_id)["amount"] == 5
    before = len(persistence.checkpoints(flow_id))
    with pytest.raises(CheckpointInvalid, match="no field 'amuont'") as typo:
        persistence.edit_state(flow_id, {"amuont": 7}, state_type=Order)
    assert typo.value.field == "amuont"
    assert len(persistence.checkpoints(flow_id)) == before
    persistence.edit_state(flow_id, {"amount": 7}, state_type=Order)
    assert persistence.load_state(flow_id)["amount"] == 7


@pytest.mark.parametrize("bad", [123, None])
def test_a_flow_id_that_is_not_a_str_is_refused_naming_it(url: str, world: Path, bad: Any) -> None:
    def body() -> Any:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist

        @persist(RemitFlowPersistence(url))
        class Plain(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def go(self) -> None:
                self.state["went"] = True

        return kickoff(Plain, inputs={"id": bad})

    out = run(body)
    assert out.raised("TypeError") and "flow id (inputs['id']) must be a str" in out.error_text()


def test_one_listener_run_twice_at_once_applies_each_runs_effect(url: str, world: Path) -> None:
    """P2: two routes to one listener at once are two occurrences of it, each with its own
    effect key: both charges apply (as with CrewAI's own backend), neither is dropped."""

    def flow() -> type[Any]:
        from crewai.flow.flow import Flow, listen, router, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

        @effect(reconcile=sink.reconcile)
        def charge(*, idempotency_key: str) -> str:
            return sink.apply("charge", idempotency_key)

        class Bills(BaseModel):
            receipts: list[str] = []

        @persist(RemitFlowPersistence(url))
        class TwiceFlow(Flow[Bills]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def start_a(self) -> None:
                pass

            @start()
            def start_b(self) -> None:
                pass

            @router(start_a)
            def route_first(self) -> str:
                return "bill"

            @router(start_b)
            def route_second(self) -> str:
                return "bill"

            @listen("bill")
            def pay(self) -> None:
                journal.record("enter", "pay")
                time.sleep(0.2)  # both runs in flight at once
                self.state.receipts.append(charge())

        return TwiceFlow

    done = run(lambda: kickoff(flow(), inputs={"id": f"twice-{uuid.uuid4().hex}"}))
    assert done.ok, done.summary()
    assert entered(world) == {"pay": 2} and applied(world) == {"charge": 2}
    assert len(set(done.value["state"]["receipts"])) == 2


def test_a_state_nested_too_deeply_is_refused_and_nothing_is_written(url: str) -> None:
    """P4: a state whose check goes past Python's recursion limit is `CheckpointInvalid`,
    not a raw `RecursionError`; nothing is written."""
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5000):
        inner["x"] = {}
        inner = inner["x"]
    persistence = RemitFlowPersistence(url)
    flow_id = f"deep-{uuid.uuid4().hex}"
    with pytest.raises(CheckpointInvalid, match="nested too deeply"):
        persistence.save_state(flow_id, "prepare", {"id": flow_id, "deep": deep})
    assert persistence.load_state(flow_id) is None


# -- CrewAI's rules for persistence classes ----------------------------------------


def test_type_name_plain_fields_and_lazy_connection(tmp_path: Path) -> None:
    """Registered under its class name, rebuilt from JSON by CrewAI, connects on first use."""
    missing = tmp_path / "no-such-dir" / "remit.db"
    p = RemitFlowPersistence(f"sqlite:///{missing}", lease=5, workflow_version="v3")
    assert p.persistence_type == "RemitFlowPersistence"
    assert _persistence_registry["RemitFlowPersistence"] is RemitFlowPersistence
    dumped = json.loads(json.dumps(p.model_dump(mode="json")))
    rebuilt = _resolve_persistence(dumped)
    assert isinstance(rebuilt, RemitFlowPersistence)
    assert rebuilt.model_dump() == p.model_dump()
    with pytest.raises(StoreUnavailable):  # nothing was opened before this call
        p.init_db()
    fine = RemitFlowPersistence(f"sqlite:///{tmp_path / 'lazy.db'}")
    assert not (tmp_path / "lazy.db").exists()
    fine.init_db()
    assert (tmp_path / "lazy.db").exists()


def test_parallel_listeners_and_threads_share_one_instance(url: str, world: Path) -> None:
    """Parallel listeners save one flow from two threads; threads save many flows at once."""

    def body() -> dict[str, Any]:
        import threading

        from crewai.flow.flow import Flow, and_, listen, start
        from crewai.flow.persistence import persist

        persistence = RemitFlowPersistence(url)

        @persist(persistence)
        class FanFlow(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def begin(self) -> None:
                self.state["seen"] = ["begin"]

            @listen(begin)
            def left(self) -> None:
                time.sleep(0.05)
                self.state["left"] = True

            @listen(begin)
            def right(self) -> None:
                time.sleep(0.05)
                self.state["right"] = True

            @listen(and_(left, right))
            def join(self) -> None:
                self.state["joined"] = True

        fan = kickoff(FanFlow)
        errors: list[str] = []

        def saver(i: int) -> None:
            try:
                for n in range(5):
                    persistence.save_state(f"thread-{i}-{uuid.uuid4().hex}", f"m{n}", {"n": n})
            except Exception as exc:
                errors.append(repr(exc))

        threads = [threading.Thread(target=saver, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        saved = persistence.checkpoints(fan["id"])
        return {"errors": errors, "completed": list(saved[0].completed), "count": len(saved)}

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["errors"] == []
    assert sorted(out.value["completed"]) == ["begin", "join", "left", "right"]
    assert out.value["count"] == 4


# -- P4: state validity ------------------------------------------------------------


def test_invalid_model_state_is_refused_and_the_flow_stays_loadable(url: str, world: Path) -> None:
    """A state that no longer validates fails the flow; the head stays; the id still loads."""
    flow_id = f"order-{uuid.uuid4().hex}"
    bad = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id, "note": "bad"}))
    assert bad.raised("CheckpointInvalid") and bad.raised("RuntimeError"), bad.summary()
    assert "amount" in bad.error_text() and flow_id in bad.error_text()

    def head() -> dict[str, Any]:
        saved = RemitFlowPersistence(url).checkpoints(flow_id)
        return {"methods": [c.method for c in saved], "amount": saved[0].state["amount"]}

    before = run(head)
    assert before.value == {"methods": ["prepare"], "amount": 100}, before.summary()
    again = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id, "note": "ok"}))
    assert again.ok, again.summary()
    assert again.value["state"]["shipped"] is True and again.value["state"]["amount"] == 100
    assert entered(world) == {"prepare": 1, "adjust": 2, "charge": 1, "ship": 1}


def test_dict_state_keeps_its_types_or_is_refused(url: str, world: Path) -> None:
    """datetime, UUID, tuple, set and Decimal come back as themselves; an object is refused."""
    when = dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.timezone.utc)
    token = uuid.UUID("12345678-1234-5678-1234-567812345678")

    def body() -> dict[str, Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        @persist(RemitFlowPersistence(url))
        class TypedFlow(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def fill(self) -> None:
                self.state.update(
                    when=when, token=token, pair=(1, "a"), tags={"x", "y"}, price=Decimal("9.99")
                )

            @listen(fill)
            def spoil(self) -> None:
                if self.state.get("spoil"):
                    self.state["handle"] = object()

        good = TypedFlow(suppress_flow_events=True)
        good.kickoff()
        loaded = RemitFlowPersistence(url).load_state(good.state["id"]) or {}
        spoiled = TypedFlow(suppress_flow_events=True)
        try:
            spoiled.kickoff(inputs={"spoil": True})
            refused = ""
        except RuntimeError as exc:
            refused = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
        saved = RemitFlowPersistence(url).checkpoints(spoiled.state["id"])
        return {
            "same": loaded["when"] == when
            and loaded["token"] == token
            and loaded["pair"] == (1, "a")
            and loaded["tags"] == {"x", "y"}
            and loaded["price"] == Decimal("9.99"),
            "types": sorted(type(loaded[k]).__name__ for k in ("when", "token", "pair", "tags")),
            "refused": refused,
            "spoiled_methods": [c.method for c in saved],
        }

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["same"] is True
    assert out.value["types"] == ["UUID", "datetime", "set", "tuple"]
    assert out.value["refused"].startswith("CheckpointInvalid") and "handle" in out.value["refused"]
    assert out.value["spoiled_methods"] == ["fill"]


# -- P1 / P2: a restarted flow continues after what completed --------------------------


def _restart_after_lease(url: str, world: Path, flow_id: str) -> Outcome:
    time.sleep(1.2)
    return run(lambda: kickoff(order_flow(url, world, lease=1.0), inputs={"id": flow_id}))


def test_restart_after_a_crash_runs_only_what_did_not_complete(url: str, world: Path) -> None:
    """prepare and adjust ran once; charge re-ran without applying again; ship ran once."""
    flow_id = f"order-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(
            order_flow(url, world, lease=1.0, points={"charge.after": "kill"}),
            inputs={"id": flow_id},
        )
    )
    assert crashed.status == "killed" and applied(world) == {"charge": 1}
    done = _restart_after_lease(url, world, flow_id)
    assert done.ok, done.summary()
    assert done.value["state"]["shipped"] is True
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 2, "ship": 1}
    assert applied(world) == {"charge": 1}
    once_more = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id}))
    assert once_more.ok and once_more.value["state"] == done.value["state"]
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 2, "ship": 1}


def answered_flow(url: str, world: Path, *, kill: bool = False) -> type[Any]:
    """prepare -> review (a provider that answers at once, as the console does) -> approve."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal = Journal(WorldDB(world))

    class AtOnce:
        def request_feedback(self, context: Any, flow: Any) -> str:
            journal.record("enter", "asked")
            return "alice"

    class Review(BaseModel):
        approved_by: str | None = None

    @persist(RemitFlowPersistence(url, lease=1.0))
    class AnsweredFlow(Flow[Review]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=AtOnce())
        def review(self) -> str:
            return "parcel"

        @listen(review)
        def approve(self) -> None:
            journal.record("enter", "approve")
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            assert self.last_human_feedback is not None
            self.state.approved_by = self.last_human_feedback.feedback

    return AnsweredFlow


def test_a_restart_gives_back_feedback_a_provider_gave_at_once(url: str, world: Path) -> None:
    """P1: a feedback method whose provider answered at once (no pause) completed; a
    restart after a crash in the next step does not ask again and restores the answer."""
    flow_id = f"answered-{uuid.uuid4().hex}"
    crashed = run(lambda: kickoff(answered_flow(url, world, kill=True), inputs={"id": flow_id}))
    assert crashed.status == "killed"
    time.sleep(1.2)
    done = run(lambda: kickoff(answered_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["approved_by"] == "alice"
    assert entered(world) == {"prepare": 1, "asked": 1, "approve": 2}


def totals_flow(url: str, world: Path, *, kill: bool = False, total: Any = None) -> type[Any]:
    """count -> total (returns `total`, or the count as plain data); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))

    @persist(RemitFlowPersistence(url, lease=1.0))
    class TotalsFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def count(self) -> int:
            journal.record("enter", "count")
            self.state["n"] = self.state.get("n", 0) + 1
            return 7

        @listen(count)
        def total(self) -> Any:
            journal.record("enter", "total")
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if total is not None:
                return total
            return {"n": self.state["n"], "at": dt.date(2026, 12, 1), "pair": (1, "b")}

    return TotalsFlow


def kickoff_output(flow_class: type[Any], **kwargs: Any) -> Any:
    out = flow_class(suppress_flow_events=True).kickoff(**kwargs)
    return repr(out)


def test_a_finished_flow_kicked_off_again_returns_its_output_and_runs_nothing(
    url: str, world: Path
) -> None:
    """P1: the whole run is the prefix a restart continues: nothing runs, and the
    kickoff returns what the finished run returned (types kept)."""
    flow_id = f"totals-{uuid.uuid4().hex}"
    first = run(lambda: kickoff_output(totals_flow(url, world), inputs={"id": flow_id}))
    again = run(lambda: kickoff_output(totals_flow(url, world), inputs={"id": flow_id}))
    assert first.ok and again.ok, (first.summary(), again.summary())
    assert first.value == "{'n': 1, 'at': datetime.date(2026, 12, 1), 'pair': (1, 'b')}"
    assert again.value == first.value
    assert entered(world) == {"count": 1, "total": 1}


def test_a_restart_returns_what_its_own_run_returned(url: str, world: Path) -> None:
    """After a crash the restart runs the rest, and returns its own last output; an
    output the codec cannot store is not kept: a later restart returns None."""
    flow_id = f"totals-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff_output(totals_flow(url, world, kill=True), inputs={"id": flow_id})
    )
    assert crashed.status == "killed"
    time.sleep(1.2)
    done = run(
        lambda: kickoff_output(
            totals_flow(url, world, total=threading.Lock()), inputs={"id": flow_id}
        )
    )
    assert done.ok and done.value.startswith("<unlocked _thread.lock"), done.summary()
    again = run(lambda: kickoff_output(totals_flow(url, world), inputs={"id": flow_id}))
    assert again.ok and again.value == "None", again.summary()
    assert entered(world) == {"count": 1, "total": 2}


# -- P5 / L1: one resumer claims the pending feedback ----------------------------------------


def test_concurrent_resumers_one_claims_the_feedback(url: str, world: Path) -> None:
    flow_id = paused_review(url, world)
    k = 4
    barrier = Barrier(k)

    def resumer(i: int) -> Callable[[], Any]:
        def body() -> Any:
            flow_class = review_flow(url, world)
            barrier.wait()
            return resume(flow_class, flow_id, f"reviewer-{i}")

        return body

    workers = [child(resumer(i), barrier=barrier) for i in range(k)]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    winners = [i for i, o in enumerate(outcomes) if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok)
    assert outcomes[winners[0]].value["approved_by"] == f"reviewer-{winners[0]}"
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


def test_a_resumer_that_dies_before_any_listener_loses_nothing(url: str, world: Path) -> None:
    """Killed after CrewAI cleared the pending feedback: after the lease, resume again."""
    flow_id = paused_review(url, world, lease=1.0)

    def dying() -> Any:
        from crewai.hooks.dispatch import InterceptionPoint, get_global_hook_list

        def die_before_approve(ctx: Any) -> None:
            if ctx.step_name == "approve":
                os.kill(os.getpid(), signal.SIGKILL)

        flow_class = review_flow(url, world, lease=1.0)
        get_global_hook_list(InterceptionPoint.PRE_STEP).insert(0, die_before_approve)
        return resume(flow_class, flow_id, "first")

    assert run(dying).status == "killed"
    early = run(lambda: resume(review_flow(url, world, lease=1.0), flow_id, "early"))
    assert early.raised("ResumeConflict"), early.summary()  # the dead claim is still leased
    time.sleep(1.2)
    later = run(lambda: resume(review_flow(url, world, lease=1.0), flow_id, "second"))
    assert later.ok, later.summary()
    assert later.value["approved_by"] == "second"
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    twice = run(lambda: resume(review_flow(url, world), flow_id, "third"))
    assert twice.raised("ResumeConflict") and "already given" in twice.error_text()


def test_feedback_is_validated_before_it_is_consumed(url: str, world: Path) -> None:
    """feedback_schema refuses a value; the pause stays pending and takes a valid one."""
    flow_id = paused_review(url, world)

    def with_schema(value: Any) -> Callable[[], Any]:
        def body() -> Any:
            flow_class = review_flow(url, world)
            flow_class.__flow_persistence_config__.persistence.feedback_schema = {
                "type": "string",
                "enum": ["yes"],
            }
            return resume(flow_class, flow_id, value)

        return body

    refused = run(with_schema("maybe"))
    assert refused.raised("CheckpointInvalid"), refused.summary()

    def pending() -> list[str]:
        remit = RemitFlowPersistence(url).remit
        return [i.status for i in remit.interrupts(flow_id)]

    assert run(pending).value == ["pending"]
    accepted = run(with_schema("yes"))
    assert accepted.ok, accepted.summary()
    assert accepted.value["approved_by"] == "yes"
    assert entered(world)["ship"] == 1


def test_async_steps_kickoff_async_and_resume_async(url: str, world: Path) -> None:
    """Async methods and an async effect under `kickoff_async` / `resume_async`."""

    def body() -> dict[str, Any]:
        import asyncio

        from crewai.flow.async_feedback.types import HumanFeedbackPending
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.human_feedback import human_feedback
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        from remit_core import current_scope

        sink = EffectSink(WorldDB(world))
        persistence = RemitFlowPersistence(url)

        @effect(reconcile=sink.reconcile)
        async def pay(*, idempotency_key: str) -> str:
            return sink.apply("pay", idempotency_key)

        class Later:
            def request_feedback(self, context: Any, flow: Any) -> str:
                raise HumanFeedbackPending(context=context)

        class Tab(BaseModel):
            who: str | None = None
            steps: list[str] = []

        @persist(persistence)
        class TabFlow(Flow[Tab]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            async def open_tab(self) -> None:
                scope = current_scope()
                self.state.steps.append(scope.step_key if scope else "")

            @listen(open_tab)
            @human_feedback(message="Settle?", provider=Later())
            async def review(self) -> str:
                return "tab"

            @listen(review)
            async def settle(self) -> None:
                assert self.last_human_feedback is not None
                self.state.who = self.last_human_feedback.feedback
                await pay()
                scope = current_scope()
                self.state.steps.append(scope.step_key if scope else "")

        async def main() -> dict[str, Any]:
            flow = TabFlow(suppress_flow_events=True)
            paused = await flow.kickoff_async()
            resumed = TabFlow.from_pending(flow.flow_id, persistence)
            await resumed.resume_async("carol")
            again = TabFlow(suppress_flow_events=True)
            await again.kickoff_async(inputs={"id": flow.flow_id})
            return {
                "paused": type(paused).__name__,
                "state": resumed.state.model_dump(exclude={"id"}),
                "restarted": again.state.model_dump(exclude={"id"}),
                "open_scope": current_scope() is not None,
            }

        return asyncio.run(main())

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["paused"] == "HumanFeedbackPending"
    assert out.value["state"] == {"who": "carol", "steps": ["main/open_tab#0", "main/settle#0"]}
    assert out.value["restarted"] == out.value["state"]
    assert out.value["open_scope"] is False
    assert applied(world) == {"pay": 1}


# -- P3: forks need a token ----------------------------------------------------------------


def test_restore_from_state_id_is_a_fork_that_needs_a_token(url: str, world: Path) -> None:
    source = f"order-{uuid.uuid4().hex}"
    assert run(lambda: kickoff(order_flow(url, world), inputs={"id": source})).ok

    def branches() -> int:
        return len(RemitFlowPersistence(url).remit.branches(source))

    refused = run(lambda: kickoff(order_flow(url, world), restore_from_state_id=source))
    assert refused.raised("ForkWithoutIntent"), refused.summary()
    assert run(branches).value == 1

    def forked(token: str) -> dict[str, Any]:
        with fork_token(token):
            return kickoff(order_flow(url, world), restore_from_state_id=source)

    first, second = run(lambda: forked("retry-1")), run(lambda: forked("retry-1"))
    assert first.ok and second.ok, (first.summary(), second.summary())
    assert first.value["id"] == second.value["id"] != source
    assert first.value["id"].startswith(f"{source}@fork-")
    assert first.value["state"] == second.value["state"]
    assert run(branches).value == 2
    # The fork continued after the source's head: nothing ran again, nothing was re-applied.
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1, "ship": 1}
    assert applied(world) == {"charge": 1}


def test_fork_from_an_older_checkpoint(url: str, world: Path) -> None:
    """`fork(checkpoint_id=...)`: refused without a token; with one, runs only what follows."""
    source = f"order-{uuid.uuid4().hex}"
    assert run(lambda: kickoff(order_flow(url, world), inputs={"id": source})).ok

    def body() -> dict[str, Any]:
        from remit_core import ForkWithoutIntent

        persistence = RemitFlowPersistence(url)
        after_adjust = next(c for c in persistence.checkpoints(source) if c.method == "adjust")
        try:
            persistence.fork(source, fork_token=None, checkpoint_id=after_adjust.checkpoint_id)
            refused = False
        except ForkWithoutIntent:
            refused = True
        forked = persistence.fork(
            source, fork_token="replay", checkpoint_id=after_adjust.checkpoint_id
        )
        again = persistence.fork(
            source, fork_token="replay", checkpoint_id=after_adjust.checkpoint_id
        )
        result = kickoff(order_flow(url, world), inputs={"id": forked})
        return {"refused": refused, "same": forked == again, "state": result["state"]}

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["refused"] and out.value["same"]
    assert out.value["state"]["shipped"] is True
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 2, "ship": 2}
    assert applied(world) == {"charge": 2}  # the fork's own charge, keyed by its branch


def test_the_same_fork_token_continues_its_fork_after_the_source_moved_on(
    url: str, world: Path
) -> None:
    """P3: a kickoff that forked a paused flow, presented again with its token after the
    source was answered (its head moved on), continues the same fork, from any process;
    each line takes its own feedback once."""
    source = paused_review(url, world)

    def forked() -> dict[str, Any]:
        with fork_token("retry-fork"):
            return kickoff(review_flow(url, world), restore_from_state_id=source)

    first = run(forked)
    assert first.ok and first.value["out"] == "HumanFeedbackPending", first.summary()
    answered = run(lambda: resume(review_flow(url, world), source, "ann"))
    assert answered.ok and answered.value["approved_by"] == "ann", answered.summary()
    again = run(forked)
    assert again.ok, again.summary()
    assert again.value["id"] == first.value["id"] != source
    assert again.value["out"] == "HumanFeedbackPending"  # the fork still waits for its answer
    on_fork = run(lambda: resume(review_flow(url, world), first.value["id"], "bob"))
    assert on_fork.ok and on_fork.value["approved_by"] == "bob", on_fork.summary()
    assert run(lambda: len(RemitFlowPersistence(url).remit.branches(source))).value == 2
    assert entered(world) == {"prepare": 1, "approve": 2, "ship": 2}
    assert applied(world) == {"ship": 2}  # once on each line


def test_a_fork_made_after_the_feedback_was_given_keeps_it(url: str, world: Path) -> None:
    """P3: CrewAI saves the feedback method's checkpoint before the step that consumes
    the feedback; a fork made there continues with that feedback, as a restart from
    there does, instead of pausing for it again."""
    source = paused_review(url, world)
    answered = run(lambda: resume(review_flow(url, world), source, "ann"))
    assert answered.ok, answered.summary()

    def body() -> dict[str, Any]:
        persistence = RemitFlowPersistence(url)
        given = next(c for c in persistence.checkpoints(source) if c.kind == "feedback")
        forked = persistence.fork(source, fork_token="after", checkpoint_id=given.checkpoint_id)
        return kickoff(review_flow(url, world), inputs={"id": forked})

    out = run(body)
    assert out.ok and out.value["out"] != "HumanFeedbackPending", out.summary()
    assert out.value["state"]["approved_by"] == "ann"
    assert entered(world) == {"prepare": 1, "approve": 2, "ship": 2}
    assert applied(world) == {"ship": 2}  # the fork's own ship, keyed by its branch


def test_a_fork_of_a_pause_does_not_apply_again_what_the_paused_method_applied(
    url: str, world: Path
) -> None:
    """P2, P3: a restart runs a paused feedback method again so that it pauses again;
    on a fork of the pause, restarted twice and then answered, the effect that method
    applied before the fork is the shared prefix's: met under its key, not applied."""
    started = run(lambda: kickoff(review_flow(url, world, ask=True)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    source = str(started.value["id"])

    def fork_and_restart() -> dict[str, Any]:
        forked = RemitFlowPersistence(url).fork(source, fork_token="again")
        outs = [kickoff(review_flow(url, world, ask=True), inputs={"id": forked})["out"]]
        outs.append(kickoff(review_flow(url, world, ask=True), inputs={"id": forked})["out"])
        return {"id": forked, "outs": outs}

    forked = run(fork_and_restart)
    assert forked.ok and forked.value["outs"] == ["HumanFeedbackPending"] * 2, forked.summary()
    answered = run(lambda: resume(review_flow(url, world, ask=True), forked.value["id"], "bob"))
    assert answered.ok and answered.value["approved_by"] == "bob", answered.summary()
    assert applied(world) == {"ask": 1, "ship": 1}


# -- fencing: two processes cannot both drive one flow --------------------------------------


def test_a_second_driver_is_refused_before_any_step(url: str, world: Path, tmp_path: Path) -> None:
    """While one process drives a flow, `kickoff(inputs={"id": ...})` elsewhere runs nothing."""
    flow_id, go = f"order-{uuid.uuid4().hex}", tmp_path / "go"
    first = child(
        lambda: kickoff(
            order_flow(url, world, points={"charge.before": f"wait:{go}"}), inputs={"id": flow_id}
        )
    )
    while entered(world).get("charge") != 1:
        time.sleep(0.02)
    rival = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id}))
    assert rival.raised("ResumeConflict"), rival.summary()
    go.touch()
    done = first.wait(timeout=60)
    assert done.ok and done.value["state"]["shipped"] is True, done.summary()
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1, "ship": 1}


def test_a_zombie_whose_lease_was_taken_over_is_fenced(url: str, world: Path) -> None:
    """SIGSTOPped in charge past its lease; a restart takes over; the zombie's save is refused."""
    flow_id = f"order-{uuid.uuid4().hex}"
    zombie = child(
        lambda: kickoff(
            order_flow(url, world, lease=1.0, points={"charge.before": "stop"}),
            inputs={"id": flow_id},
        )
    )
    assert zombie.wait(timeout=60, stopped_counts=True).status == "stopped"
    taken = _restart_after_lease(url, world, flow_id)
    assert taken.ok, taken.summary()
    zombie.cont()
    end = zombie.wait(timeout=60)
    assert end.raised("Fenced"), end.summary()
    head = run(lambda: RemitFlowPersistence(url).load_state(flow_id))
    assert head.value == {**taken.value["state"], "id": flow_id}
    assert applied(world) == {"charge": 1}


# -- P1 / P2: a restart takes the route a completed router took -------------------------------


def route_flow(
    url: str, world: Path, *, lease: float = 30.0, points: dict[str, str] | None = None
) -> type[Any]:
    """prepare -> route (a router, returns an Enum) -> "go" -> pack (effect) -> ship."""
    import enum

    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}

    @effect(reconcile=sink.reconcile)
    def pack_parcel(*, idempotency_key: str) -> str:
        return sink.apply("pack", idempotency_key)

    class Route(str, enum.Enum):
        GO = "go"
        WAIT = "wait"

    class Parcel(BaseModel):
        receipt: str | None = None
        shipped: bool = False

    @persist(RemitFlowPersistence(url, lease=lease))
    class RouteFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @router(prepare)
        def route(self) -> Route:
            journal.record("enter", "route")
            return Route.GO

        @listen("go")
        def pack(self) -> None:
            journal.record("enter", "pack")
            point(at, "pack.before")
            self.state.receipt = pack_parcel()

        @listen(pack)
        def ship(self) -> str:
            journal.record("enter", "ship")
            point(at, "ship.start")
            self.state.shipped = True
            return "shipped"

        @listen("wait")
        def hold(self) -> None:
            journal.record("enter", "hold")

    return RouteFlow


@pytest.mark.parametrize(
    ("killed_at", "entries"),
    [
        ("pack.before", {"prepare": 1, "route": 1, "pack": 2, "ship": 1}),
        ("ship.start", {"prepare": 1, "route": 1, "pack": 1, "ship": 2}),
    ],
)
def test_a_restart_takes_the_route_a_completed_router_took(
    url: str, world: Path, killed_at: str, entries: dict[str, int]
) -> None:
    """SIGKILLed behind a router: the restart fires the recorded route, runs what did not
    complete, and neither re-enters the router nor applies the effect twice."""
    flow_id = f"parcel-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(
            route_flow(url, world, lease=1.0, points={killed_at: "kill"}), inputs={"id": flow_id}
        )
    )
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)
    done = run(lambda: kickoff(route_flow(url, world, lease=1.0), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["shipped"] is True and done.value["out"] == "str"
    assert entered(world) == entries
    assert applied(world) == {"pack": 1}

    def route_recorded() -> dict[str, tuple[str | None, ...]]:
        from remit_crewai._ledger import decode

        remit = RemitFlowPersistence(url).remit
        head = remit.head(flow_id)
        assert head is not None
        return decode(head.state, run_id=flow_id, checkpoint_id=head.checkpoint_id).ledger.routes

    assert run(route_recorded).value == {"route": ["go"]}  # a tuple, as JSON


def test_a_restart_inside_a_loop_runs_the_occurrence_that_was_in_flight(
    url: str, world: Path
) -> None:
    """check (a router) -> "again" -> rework -> check ... -> "done" -> finish, SIGKILLed in
    rework's second round: the restart replays round one, then runs round two for real."""

    def build(points: dict[str, str] | None = None) -> type[Any]:
        from crewai.flow.flow import Flow, listen, or_, router, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        journal, at = Journal(WorldDB(world)), points or {}

        class Rounds(BaseModel):
            rounds: int = 0
            done: bool = False

        @persist(RemitFlowPersistence(url, lease=1.0))
        class LoopFlow(Flow[Rounds]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                journal.record("enter", "prepare")

            @router(or_(prepare, "rework"))
            def check(self) -> str:
                journal.record("enter", "check")
                return "again" if self.state.rounds < 2 else "done"

            @listen("again")
            def rework(self) -> None:
                journal.record("enter", "rework")
                point(at, f"rework.{self.state.rounds}")
                self.state.rounds += 1

            @listen("done")
            def finish(self) -> None:
                journal.record("enter", "finish")
                self.state.done = True

        return LoopFlow

    flow_id = f"loop-{uuid.uuid4().hex}"
    crashed = run(lambda: kickoff(build({"rework.1": "kill"}), inputs={"id": flow_id}))
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)
    done = run(lambda: kickoff(build(), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["rounds"] == 2 and done.value["state"]["done"] is True
    assert entered(world) == {"prepare": 1, "check": 3, "rework": 3, "finish": 1}
    again = run(lambda: kickoff(build(), inputs={"id": flow_id}))
    assert again.ok and again.value["state"] == done.value["state"], again.summary()
    assert entered(world) == {"prepare": 1, "check": 3, "rework": 3, "finish": 1}


@pytest.mark.parametrize(
    ("killed_at", "entries"),
    [
        ("work.1", {"prepare": 1, "work": 3, "check": 2, "finish": 1}),
        ("finish", {"prepare": 1, "work": 2, "check": 2, "finish": 2}),
    ],
)
def test_a_restart_re_arms_an_or_listener_a_replayed_route_loops_back_to(
    url: str, world: Path, killed_at: str, entries: dict[str, int]
) -> None:
    """work (`or_(prepare, "again")`, not a router) -> check (a router) -> "again" -> work
    ... -> "done" -> finish, SIGKILLed in a later round: the restart replays the route
    "again" into work once more, as CrewAI re-arms the fired `or_` listener, and finishes."""

    def build(points: dict[str, str] | None = None) -> type[Any]:
        from crewai.flow.flow import Flow, listen, or_, router, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        journal, at = Journal(WorldDB(world)), points or {}

        class Rounds(BaseModel):
            rounds: int = 0
            done: bool = False

        @persist(RemitFlowPersistence(url, lease=1.0))
        class LoopFlow(Flow[Rounds]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                journal.record("enter", "prepare")

            @listen(or_(prepare, "again"))
            def work(self) -> None:
                journal.record("enter", "work")
                point(at, f"work.{self.state.rounds}")
                self.state.rounds += 1

            @router(work)
            def check(self) -> str:
                journal.record("enter", "check")
                return "again" if self.state.rounds < 2 else "done"

            @listen("done")
            def finish(self) -> None:
                journal.record("enter", "finish")
                point(at, "finish")
                self.state.done = True

        return LoopFlow

    flow_id = f"or-loop-{uuid.uuid4().hex}"
    crashed = run(lambda: kickoff(build({killed_at: "kill"}), inputs={"id": flow_id}))
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)
    done = run(lambda: kickoff(build(), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["rounds"] == 2 and done.value["state"]["done"] is True
    assert entered(world) == entries


def feedback_route_flow(
    url: str,
    world: Path,
    *,
    lease: float = 30.0,
    points: dict[str, str] | None = None,
    review_starts: bool = False,
) -> type[Any]:
    """The README's routing pattern: review (`@human_feedback(emit=...)`, pauses) ->
    "approved" -> ship -> notify (effect), "rejected" -> drop. `review_starts`: review
    is the start method (CrewAI skips a completed start on its own path)."""
    from crewai.flow.async_feedback.types import HumanFeedbackPending
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}

    class Later:
        def request_feedback(self, context: Any, flow: Any) -> str:
            raise HumanFeedbackPending(context=context)

    @effect(reconcile=sink.reconcile)
    def send_notice(*, idempotency_key: str) -> str:
        return sink.apply("notify", idempotency_key)

    class Order(BaseModel):
        log: list[str] = []

    asks = human_feedback(
        message="Ship it?",
        emit=["approved", "rejected"],
        default_outcome="approved",
        provider=Later(),
    )

    @persist(RemitFlowPersistence(url, lease=lease))
    class ReviewFlow(Flow[Order]):  # type: ignore[misc]
        _skip_auto_memory = True

        if review_starts:

            @start()
            @asks
            def review(self) -> str:
                journal.record("enter", "review")
                return "parcel"

        else:

            @start()
            def prepare(self) -> None:
                journal.record("enter", "prepare")

            @listen(prepare)
            @asks
            def review(self) -> str:
                journal.record("enter", "review")
                return "parcel"

        @listen("approved")
        def ship(self) -> None:
            journal.record("enter", "ship")
            point(at, "ship.start")
            self.state.log.append("ship")

        @listen(ship)
        def notify(self) -> str:
            journal.record("enter", "notify")
            send_notice()
            self.state.log.append("notify")
            return "shipped"

        @listen("rejected")
        def drop(self) -> None:
            journal.record("enter", "drop")

    return ReviewFlow


@pytest.mark.parametrize("review_starts", [False, True])
def test_a_restart_after_a_feedback_route_continues_behind_it(
    url: str, world: Path, review_starts: bool
) -> None:
    """Resumed with `emit=` feedback, SIGKILLed in the routed listener: the restart takes
    the route the feedback chose and finishes; the feedback is not asked again."""

    def build(**kw: Any) -> type[Any]:
        return feedback_route_flow(url, world, lease=1.0, review_starts=review_starts, **kw)

    started = run(lambda: kickoff(build()))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    dying = run(lambda: resume(build(points={"ship.start": "kill"}), flow_id, ""))
    assert dying.status == "killed", dying.summary()
    time.sleep(1.2)
    done = run(lambda: kickoff(build(), inputs={"id": flow_id}))
    assert done.ok and done.value["out"] == "str", done.summary()
    assert done.value["state"]["log"] == ["ship", "notify"]
    before = {} if review_starts else {"prepare": 1}
    assert entered(world) == {**before, "review": 1, "ship": 2, "notify": 1}
    assert applied(world) == {"notify": 1}


# -- P5 / L2: a resumer whose claim lapsed is refused -----------------------------------------


@pytest.mark.parametrize("rival_in", ["a thread", "the same thread"])
def test_a_stale_resumer_is_refused_after_another_resumed(
    url: str, world: Path, rival_in: str
) -> None:
    """A's `from_pending` outlives its lease; B (same process) resumes and finishes; then
    A's resume is fenced: nothing runs again, nothing is applied again, B's value stays."""
    flow_id = paused_review(url, world, lease=1.0)

    def body() -> dict[str, Any]:
        flow_class = review_flow(url, world, lease=1.0)
        persistence = flow_class.__flow_persistence_config__.persistence
        stale = flow_class.from_pending(flow_id, persistence)
        time.sleep(1.3)
        rival: dict[str, Any] = {}

        def resume_as_bob() -> None:
            try:
                rival["approved_by"] = resume(flow_class, flow_id, "bob")["approved_by"]
            except Exception as exc:
                rival["error"] = repr(exc)

        if rival_in == "a thread":
            thread = threading.Thread(target=resume_as_bob)
            thread.start()
            thread.join()
        else:
            resume_as_bob()
        refused: list[str] = []
        try:
            stale.resume("alice")
        except Exception as exc:
            cause: BaseException | None = exc
            while cause is not None:
                refused.append(type(cause).__name__)
                cause = cause.__cause__
        head = persistence.load_state(flow_id) or {}
        return {"rival": rival, "refused": refused, "approved_by": head.get("approved_by")}

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["rival"] == {"approved_by": "bob"}
    assert "Fenced" in out.value["refused"], out.value
    assert out.value["approved_by"] == "bob"
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


# -- P2: a flow awaited inside another's step keeps the outer step's scope --------------------


def test_an_awaited_nested_flow_keeps_the_outer_steps_scope(url: str, world: Path) -> None:
    """An async step awaits a Remit-backed flow (one that finishes, one that fails); the
    outer step's effect scope and kickoff are intact after each, effects apply once."""

    def body() -> dict[str, Any]:
        import asyncio

        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        from remit_core import current_scope

        sink = EffectSink(WorldDB(world))
        persistence = RemitFlowPersistence(url)

        @effect(reconcile=sink.reconcile)
        async def pay(*, idempotency_key: str) -> str:
            return sink.apply("pay", idempotency_key)

        class Steps(BaseModel):
            scopes: list[str] = []

        def scope_key() -> str:
            scope = current_scope()
            return scope.step_key if scope is not None else "none"

        @persist(persistence)
        class Inner(Flow[Steps]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            async def work(self) -> str:
                self.state.scopes.append(scope_key())
                return "inner"

        @persist(persistence)
        class Failing(Flow[Steps]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            async def work(self) -> None:
                raise ValueError("inner step failed")

        @persist(persistence)
        class Outer(Flow[Steps]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            async def first(self) -> None:
                await pay()
                self.state.scopes.append(scope_key())
                inner = Inner(suppress_flow_events=True)
                await inner.kickoff_async()
                self.state.scopes.extend([*inner.state.scopes, scope_key()])
                with contextlib.suppress(ValueError):
                    await Failing(suppress_flow_events=True).kickoff_async()
                self.state.scopes.append(scope_key())
                await pay()

            @listen(first)
            async def second(self) -> None:
                self.state.scopes.append(scope_key())

        async def main() -> dict[str, Any]:
            outer = Outer(suppress_flow_events=True)
            await outer.kickoff_async()
            return {"scopes": outer.state.scopes, "after": scope_key()}

        return asyncio.run(main())

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value == {
        "scopes": ["main/first#0", "main/work#0", "main/first#0", "main/first#0", "main/second#0"],
        "after": "none",
    }
    assert applied(world) == {"pay": 2}


# -- P4: values that would read back as another type are refused --------------------------------


def test_dict_state_refuses_what_would_come_back_as_another_type(url: str) -> None:
    """Enums, a namedtuple, OrderedDict, defaultdict, bytearray and a zone with daylight
    saving would be read back changed: each save is refused naming its key; nothing stored."""

    def body() -> dict[str, Any]:
        import collections
        import enum
        from zoneinfo import ZoneInfo

        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        class Color(str, enum.Enum):
            RED = "red"

        class Size(enum.IntEnum):
            ONE = 1

        point_type = collections.namedtuple("point_type", "x y")
        values: dict[str, Any] = {
            "str_enum": Color.RED,
            "int_enum": Size.ONE,
            "namedtuple": point_type(1, 2),
            "ordered": collections.OrderedDict(a=1),
            "defaulted": collections.defaultdict(list, a=[1]),
            "buffer": bytearray(b"x"),
            "zoned": dt.datetime(2024, 3, 1, tzinfo=ZoneInfo("Europe/Paris")),
            "nested": {"inner": [1, (2, Color.RED)]},
        }
        persistence = RemitFlowPersistence(url)

        def spoiling(name: str, value: Any) -> type[Any]:
            @persist(persistence)
            class TypedFlow(Flow[dict]):  # type: ignore[misc]
                _skip_auto_memory = True

                @start()
                def fill(self) -> None:
                    self.state["plain"] = 1

                @listen(fill)
                def spoil(self) -> None:
                    self.state[name] = value

            return TypedFlow

        out: dict[str, Any] = {}
        for name, value in values.items():
            flow = spoiling(name, value)(suppress_flow_events=True)
            try:
                flow.kickoff()
                out[name] = "stored"
            except RuntimeError as exc:
                cause = exc.__cause__
                out[name] = f"{type(cause).__name__} {getattr(cause, 'field', None)}"
            saved = persistence.checkpoints(flow.state["id"])
            out[name] += f" {[c.method for c in saved]}"
        return out

    out = run(body)
    assert out.ok, out.error_text()
    refused = "CheckpointInvalid {} ['fill']"
    assert out.value == {
        name: refused.format(field)
        for name, field in [
            ("str_enum", "str_enum"),
            ("int_enum", "int_enum"),
            ("namedtuple", "namedtuple"),
            ("ordered", "ordered"),
            ("defaulted", "defaulted"),
            ("buffer", "buffer"),
            ("zoned", "zoned"),
            ("nested", "nested.inner[1][1]"),
        ]
    }


def test_model_state_refuses_a_field_that_would_not_read_back(url: str) -> None:
    """An object in an `Any` or arbitrary-type field, or an Enum in an `Any` field, is
    refused naming the field, nothing stored; an Enum-typed field is kept as its Enum."""

    def body() -> dict[str, Any]:
        import enum

        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel, ConfigDict

        class Color(str, enum.Enum):
            RED = "red"

        class Blob:
            pass

        class Loose(BaseModel):
            model_config = ConfigDict(arbitrary_types_allowed=True)
            anything: Any = None
            blob: Blob | None = None
            color: Color | None = None

        persistence = RemitFlowPersistence(url)

        def filling(field: str, value: Any) -> type[Any]:
            @persist(persistence)
            class LooseFlow(Flow[Loose]):  # type: ignore[misc]
                _skip_auto_memory = True

                @start()
                def fill(self) -> None:
                    setattr(self.state, field, value)

            return LooseFlow

        out: dict[str, Any] = {}
        for name, field, value in [
            ("object in Any", "anything", Blob()),
            ("arbitrary type", "blob", Blob()),
            ("Enum in Any", "anything", Color.RED),
            ("Enum field", "color", Color.RED),
        ]:
            flow_class = filling(field, value)
            flow = flow_class(suppress_flow_events=True)
            try:
                flow.kickoff()
                again = flow_class(suppress_flow_events=True)
                again.kickoff(inputs={"id": flow.state.id})
                out[name] = repr(getattr(again.state, field))
            except RuntimeError as exc:
                cause = exc.__cause__
                out[name] = f"{type(cause).__name__} {getattr(cause, 'field', None)}"
                out[name] += f" {persistence.load_state(flow.state.id)}"
        return out

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value == {
        "object in Any": "CheckpointInvalid anything None",
        "arbitrary type": "CheckpointInvalid blob None",
        "Enum in Any": "CheckpointInvalid anything None",
        "Enum field": "<Color.RED: 'red'>",
    }


# -- saves made outside a kickoff of their own flow ---------------------------------------------


def test_parallel_steps_of_a_flow_persisted_per_method_take_turns(url: str) -> None:
    """Method-level `@persist`: parallel listeners save one flow at once from several
    threads, each claiming it for its save; they wait for each other, none is refused."""

    def body() -> dict[str, Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        persistence = RemitFlowPersistence(url)
        together = threading.Barrier(4, timeout=30)  # the saves follow at once

        def branch(name: str) -> Any:
            @listen("begin")
            @persist(persistence)
            def method(self: Any) -> None:
                self.state[name] = True
                together.wait()

            method.__name__ = name
            return method

        @start()
        @persist(persistence)
        def begin(self: Any) -> None:
            self.state["begun"] = True

        names = ["a", "b", "c", "d"]
        body = {"_skip_auto_memory": True, "begin": begin, **{n: branch(n) for n in names}}
        fanned = kickoff(type("PerMethodFlow", (Flow,), body))
        saved = persistence.checkpoints(fanned["id"])
        return {"completed": sorted(saved[0].completed), "count": len(saved)}

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value == {"completed": ["a", "b", "begin", "c", "d"], "count": 5}


def test_a_save_for_another_flow_inside_a_step_leaves_it_unclaimed(url: str) -> None:
    """A step of a Remit-backed flow runs a flow persisted per method and saves a third
    flow directly: once each save is written, those flows are free for other drivers."""

    def body() -> dict[str, Any]:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist

        persistence = RemitFlowPersistence(url)
        other = f"other-{uuid.uuid4().hex}"

        class Inner(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            @persist(persistence)
            def work(self) -> None:
                self.state["worked"] = True

        @persist(persistence)
        class Outer(Flow[dict]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def run_inner(self) -> None:
                self.state["inner"] = kickoff(Inner)["id"]
                persistence.save_state(other, "noted", {"by": self.flow_id})

        outer = Outer(suppress_flow_events=True)
        outer.kickoff()
        free = {}
        for flow_id in (outer.state["inner"], other):
            try:  # a claim of its own, as another driver takes it
                persistence.remit.claim(flow_id, "main", lease=5, heartbeat=False).release()
                free[flow_id] = True
            except Exception as exc:
                free[flow_id] = repr(exc)
        return {"free": list(free.values()), "other": persistence.load_state(other)}

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["free"] == [True, True]
    assert out.value["other"]["by"]


def test_persistence_calls_with_arguments_of_wrong_types_are_refused_writing_nothing(
    url: str,
) -> None:
    """`save_state` / `save_pending_feedback` called with a method name or pause context
    of the wrong type raise `TypeError` naming it; nothing is written."""
    persistence = RemitFlowPersistence(url)
    flow_id = f"typed-{uuid.uuid4().hex}"
    with pytest.raises(TypeError, match="method name must be a str, got int"):
        persistence.save_state(flow_id, 5, {"n": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="method name must be a str, got NoneType"):
        persistence.save_state(flow_id, None, {"n": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="context must be a PendingFeedbackContext, got dict"):
        persistence.save_pending_feedback(flow_id, {"method_name": "review"}, {"n": 1})  # type: ignore[arg-type]
    assert persistence.load_state(flow_id) is None
    assert persistence.load_pending_feedback(flow_id) is None


def test_an_edit_of_a_flow_that_has_no_checkpoint_is_refused(url: str) -> None:
    """An operator's edit of a flow id that has no checkpoint (a typo) makes no flow."""
    persistence = RemitFlowPersistence(url)
    flow_id = f"never-run-{uuid.uuid4().hex}"
    with pytest.raises(UnknownRecord, match="no checkpoint to edit"):
        persistence.edit_state(flow_id, {"amount": 7})
    assert persistence.load_state(flow_id) is None
    assert persistence.checkpoints(flow_id) == []
