"""Round 50 of the CrewAI probes: a state model changed between deployments (a field added
with a default, one removed) resuming and restarting an old flow across a SIGKILL; a
listener that fails after its effect, restarted; a router whose label nobody listens for,
SIGKILLed beside a sibling; inputs a new flow's model refuses; `flow.state` changed by
the caller between `from_pending` and `resume`; threads of one process entering one
pause by every entry point at once; a flow kicked off by its own id inside its own step;
a long flow's store calls per step; flow ids shaped like a fork's; a flow id, route label
and feedback in non-Latin scripts through a pause and a crash; and, kept as a strict
expected failure, a PostgreSQL limit on the length of ids that a flow meets only after
its first step ran.

Found: no fault the shim can mend. The id limit (an id that fits the claim's index entry
but not a checkpoint's) is refused by the PostgreSQL store only when the first save is
written, after the first step ran; refusing it before the step needs the core to know the
engine's longest key, so it stays an expected failure here.

Written from the contract (P1, P2: nothing durably done is done again; P4: a state is
stored exactly or refused, nothing written; P5: one resumer proceeds) and CrewAI's public
API, against real CrewAI flows in forked children, with the helpers of
`test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import secrets
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect
from test_crewai_flows import applied, entered, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB

#: The longest a restart waits for a killed process's claim (lease 1 s here) to lapse.
PATIENCE = 60.0


def until_free(attempt: Any) -> Any:
    """`attempt()` again while another process holds the claim (a killed one's until it
    lapses)."""
    from remit_core import ResumeConflict

    deadline = time.monotonic() + PATIENCE
    while time.monotonic() < deadline:
        try:
            return attempt()
        except ResumeConflict:
            time.sleep(0.05)
    raise AssertionError("the claim was never free")


def stored(url: str, flow_id: str) -> dict[str, Any]:
    """What a new persistence reads of `flow_id`: its state and its checkpoints' kinds."""
    from remit_crewai import RemitFlowPersistence

    store = RemitFlowPersistence(url)
    return {
        "state": store.load_state(flow_id),
        "kinds": [c.kind for c in store.checkpoints(flow_id)],
    }


# -- a flow that pauses, then pays ----------------------------------------------------------


def pay_flow(
    url: str,
    world: Path,
    *,
    points: dict[str, str] | None = None,
    fail: bool = False,
    version: int = 1,
) -> type[Any]:
    """prepare -> review (pauses) -> pay (effect "pay"; `fail`: raises after it) -> close,
    with a model state; `version` 2 of the model dropped `note` and added `priority`
    (default 3). One builder, so both versions are one flow class by name."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    pay = sink_effect(sink, "pay")

    if version == 1:

        class Bill(BaseModel):
            amount: int = Field(default=0, ge=0)
            note: str = ""
            approved_by: str | None = None
            receipt: str | None = None
            closed: bool = False

    else:

        class Bill(BaseModel):  # type: ignore[no-redef]
            amount: int = Field(default=0, ge=0)
            approved_by: str | None = None
            receipt: str | None = None
            closed: bool = False
            priority: int = 3

    @persist(RemitFlowPersistence(url, lease=1.0))
    class PayFlow(Flow[Bill]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.amount = 10

        @listen(prepare)
        @human_feedback(message="Pay?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "bill"

        @listen(review)
        def pay(self) -> None:
            journal.record("enter", "pay")
            assert self.last_human_feedback is not None
            self.state.approved_by = self.last_human_feedback.feedback
            self.state.receipt = pay()
            point(at, "pay.after")
            if fail:
                raise RuntimeError("pay failed after paying")

        @listen(pay)
        def close(self) -> None:
            journal.record("enter", "close")
            self.state.closed = True

    return PayFlow


def paused_bill(url: str, world: Path, **inputs: Any) -> str:
    """A pay flow paused at its review; returns its id."""

    def body() -> str:
        flow = pay_flow(url, world)(suppress_flow_events=True)
        out = flow.kickoff(inputs=inputs or None)
        assert type(out).__name__ == "HumanFeedbackPending", out
        return str(flow.flow_id)

    started = run(body)
    assert started.ok, started.summary()
    return str(started.value)


def resumed(url: str, world: Path, flow_id: str, feedback: str, **kwargs: Any) -> Any:
    """`from_pending` + `resume(feedback)`: the state, or the error's class and text."""
    flow_class = pay_flow(url, world, **kwargs)
    flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
    try:
        flow.resume(feedback)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]
    return flow.state.model_dump()


def restarted(url: str, world: Path, flow_id: str, **kwargs: Any) -> dict[str, Any]:
    """`kickoff(inputs={"id": flow_id})` once the claim is free: the state it ends with."""
    flow = pay_flow(url, world, **kwargs)(suppress_flow_events=True)
    until_free(lambda: flow.kickoff(inputs={"id": flow_id}))
    return dict(flow.state.model_dump())


def test_a_flow_saved_by_an_older_model_resumes_and_restarts_after_a_crash(
    url: str, world: Path
) -> None:
    """A flow paused by version 1 of its state model is resumed by version 2 (a field
    added with a default, one removed), SIGKILLed after its payment, and restarted by
    version 2: the new field has its default, the removed one is gone, nothing completed
    runs again and the payment is applied once (P1, P2; CrewAI's own restore reads an old
    state with the new model the same way)."""
    flow_id = paused_bill(url, world, note="old")
    killed = run(
        lambda: resumed(url, world, flow_id, "alice", version=2, points={"pay.after": "kill"})
    )
    assert killed.status == "killed", killed.summary()
    assert applied(world) == {"pay": 1}

    done = run(lambda: restarted(url, world, flow_id, version=2))
    assert done.ok, done.summary()
    state = done.value
    assert state["priority"] == 3 and "note" not in state, state
    assert state["approved_by"] == "alice" and state["closed"] is True
    assert entered(world) == {"prepare": 1, "review": 1, "pay": 2, "close": 1}
    assert applied(world) == {"pay": 1}
    assert stored(url, flow_id)["state"] == {**state, "id": flow_id}


def test_a_listener_that_fails_after_its_effect_is_restarted_and_pays_once(
    url: str, world: Path
) -> None:
    """A resumed flow's listener applies its payment, then raises: the resume fails, the
    feedback stays given, and a restart in another process (the fault mended) runs the
    listener again with the recorded payment, then the rest, once (P1, P2, P5: the
    feedback is not asked for again)."""
    flow_id = paused_bill(url, world)
    failed = run(lambda: resumed(url, world, flow_id, "alice", fail=True))
    assert failed.ok, failed.summary()
    assert failed.value == ["RuntimeError", "pay failed after paying"]
    assert applied(world) == {"pay": 1}

    done = run(lambda: restarted(url, world, flow_id))
    assert done.ok, done.summary()
    assert done.value["approved_by"] == "alice" and done.value["closed"] is True
    assert entered(world) == {"prepare": 1, "review": 1, "pay": 2, "close": 1}
    assert applied(world) == {"pay": 1}
    again = run(lambda: restarted(url, world, flow_id))
    assert again.ok and again.value == done.value
    assert entered(world) == {"prepare": 1, "review": 1, "pay": 2, "close": 1}


def test_state_the_caller_changes_between_from_pending_and_resume(url: str, world: Path) -> None:
    """A caller changes `flow.state` between `from_pending` and `resume`, as CrewAI lets it:
    a valid change is what the resumed flow continues with and stores; an invalid one
    (`amount = -3`, the model does not validate assignments) is refused with
    `CheckpointInvalid` naming `amount`, nothing runs and the pause stays for one good
    resume, which pays once (P4, P5)."""
    kept = paused_bill(url, world)

    def change_note() -> dict[str, Any]:
        flow_class = pay_flow(url, world)
        flow = flow_class.from_pending(kept, flow_class.__flow_persistence_config__.persistence)
        flow.state.note = "rush"
        flow.resume("alice")
        return {"live": flow.state.model_dump(), **stored(url, kept)}

    done = run(change_note)
    assert done.ok, done.summary()
    assert done.value["live"]["note"] == "rush" and done.value["state"]["note"] == "rush"
    assert done.value["state"]["closed"] is True

    refused = paused_bill(url, world)

    def break_amount() -> Any:
        from remit_core import CheckpointInvalid

        flow_class = pay_flow(url, world)
        flow = flow_class.from_pending(refused, flow_class.__flow_persistence_config__.persistence)
        flow.state.amount = -3
        try:
            flow.resume("mallory")
        except Exception as exc:
            cause = exc if isinstance(exc, CheckpointInvalid) else exc.__cause__
            return [type(cause).__name__, getattr(cause, "field", None)]
        return "resumed"

    bad = run(break_amount)
    assert bad.ok and bad.value == ["CheckpointInvalid", "amount"], bad.summary()
    assert entered(world) == {"prepare": 2, "review": 2, "pay": 1, "close": 1}

    good = run(lambda: until_free(lambda: resumed(url, world, refused, "bob")))
    assert good.ok, good.summary()
    assert good.value["approved_by"] == "bob" and good.value["amount"] == 10
    assert applied(world) == {"pay": 2}  # one per flow
    assert entered(world) == {"prepare": 2, "review": 2, "pay": 2, "close": 2}


def test_threads_entering_one_pause_every_way_at_once_let_one_proceed(
    url: str, world: Path
) -> None:
    """Eight threads of one process enter one paused flow at once, half by `from_pending`
    + `resume`, half by `kickoff(inputs={"id": X})`, three rounds: one at a time holds the
    flow (a kickoff pauses it again, a resume ends it, a kickoff of the ended flow runs
    nothing), the others get `ResumeConflict`; the pause is answered once over all rounds,
    with the winner's feedback, and the payment is applied once (P5, P2)."""
    flow_id = paused_bill(url, world)

    def round_of_threads() -> list[Any]:
        import threading

        from remit_core import ResumeConflict

        flow_class = pay_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        barrier = threading.Barrier(8)
        results: list[Any] = [None] * 8

        def worker(i: int) -> None:
            barrier.wait()
            try:
                if i % 2:
                    flow = flow_class.from_pending(flow_id, store)
                    flow.resume(f"r{i}")
                    results[i] = "resumed"
                else:
                    flow = flow_class(suppress_flow_events=True)
                    out = flow.kickoff(inputs={"id": flow_id})
                    results[i] = "paused" if type(out).__name__ == "HumanFeedbackPending" else "ran"
            except ResumeConflict:
                results[i] = "conflict"
            except Exception as exc:
                results[i] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    winners: list[str] = []
    for _ in range(3):
        out = run(round_of_threads)
        assert out.ok, out.summary()
        assert set(out.value) <= {"resumed", "paused", "ran", "conflict"}, out.value
        winners += [f"r{i}" for i, r in enumerate(out.value) if r == "resumed"]
    assert len(winners) <= 1, winners  # the pause is answered once, in all rounds
    state = stored(url, flow_id)["state"]
    assert state["approved_by"] == (winners[0] if winners else None), state
    assert state["closed"] is bool(winners)
    assert applied(world) == ({"pay": 1} if winners else {})
    assert entered(world).get("pay", 0) == len(winners)


# -- a router whose label nobody listens for ------------------------------------------------


def dead_end_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """begin -> decide (a router, effect "decide", returns "nowhere", a label no method
    listens for) beside side (effect "side"); `never` listens for "elsewhere"; dict state."""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    decide_effect, side_effect = sink_effect(sink, "decide"), sink_effect(sink, "side")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class DeadEnd(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")
            self.state["n"] = 1

        @router(begin)
        def decide(self) -> str:
            journal.record("enter", "decide")
            decide_effect()
            point(at, "decide.after")
            return "nowhere"

        @listen(begin)
        def side(self) -> str:
            journal.record("enter", "side")
            side_effect()
            point(at, "side.after")
            self.state["side"] = True
            return "side done"

        @listen("elsewhere")
        def never(self) -> None:
            journal.record("enter", "never")

    return DeadEnd


@pytest.mark.parametrize("where", ["decide.after", "side.after"])
def test_a_route_nobody_listens_for_ends_the_flow_and_a_crash_restarts_once(
    url: str, world: Path, where: str
) -> None:
    """A router returns a label no method listens for: the flow ends there, as with
    CrewAI. SIGKILLed after the router's or its sibling's effect, the flow is restarted
    twice in new processes: each effect is applied once, `never` never runs, nothing
    completed is entered again, and both restarts end in the same state (P1, P2, P6)."""
    flow_id = f"dead-end-{uuid.uuid4().hex}"

    def kickoff(points: dict[str, str]) -> list[Any]:
        flow = dead_end_flow(url, world, points=points)(suppress_flow_events=True)
        out = until_free(lambda: flow.kickoff(inputs={"id": flow_id}))
        return [out, dict(flow.state)]

    killed = run(lambda: kickoff({where: "kill"}))
    assert killed.status == "killed", killed.summary()
    first, second = run(lambda: kickoff({})), run(lambda: kickoff({}))
    assert first.ok and second.ok, (first.summary(), second.summary())
    assert first.value[1] == second.value[1] == {"id": flow_id, "n": 1, "side": True}
    assert applied(world) == {"decide": 1, "side": 1}
    counts = entered(world)
    assert "never" not in counts and counts["begin"] == 1, counts
    assert sorted([counts["decide"], counts["side"]]) == [1, 2], counts


# -- inputs a new flow refuses ----------------------------------------------------------------


@pytest.mark.parametrize(
    "inputs",
    [{"amount": -1}, {"amount": "many"}, {"note": 5}, {"approved_by": ["x"]}],
    ids=["below-min", "not-int", "not-str", "list"],
)
def test_inputs_a_new_flows_model_refuses_store_nothing_and_leave_the_id_free(
    url: str, world: Path, inputs: dict[str, Any]
) -> None:
    """`kickoff(inputs={"id": X, ...})` of a new flow whose model refuses an input raises
    `CheckpointInvalid` naming the field before any step: nothing is stored under X, and a
    later kickoff of X with good inputs starts it as a new flow (P4)."""
    flow_id = f"bill-{uuid.uuid4().hex}"
    field = next(iter(inputs))

    def kickoff(given: dict[str, Any]) -> Any:
        from remit_core import CheckpointInvalid

        flow = pay_flow(url, world)(suppress_flow_events=True)
        try:
            out = flow.kickoff(inputs={"id": flow_id, **given})
        except CheckpointInvalid as exc:
            return ["refused", exc.field, stored(url, flow_id)]
        return ["ran", type(out).__name__, stored(url, flow_id)]

    refused = run(lambda: kickoff(inputs))
    assert refused.ok, refused.summary()
    assert refused.value == ["refused", field, {"state": None, "kinds": []}]
    assert entered(world) == {}

    fine = run(lambda: kickoff({"note": "fine"}))
    assert fine.ok, fine.summary()
    assert fine.value[:2] == ["ran", "HumanFeedbackPending"]
    assert fine.value[2]["state"]["note"] == "fine" and fine.value[2]["kinds"] == ["pause", "step"]


# -- a flow kicked off by its own id inside its own step -------------------------------------


def nesting_flow(url: str, world: Path, inner: str) -> type[Any]:
    """first -> work (effect "work"; kicks off flow `inner` with this flow's own id: "same"
    this class, "other" another class on the same persistence) -> last; dict state."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    work_effect = sink_effect(sink, "work")
    store = RemitFlowPersistence(url, lease=1.0)

    @persist(store)
    class Other(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def other_step(self) -> None:
            journal.record("enter", "other_step")

    @persist(store)
    class Nesting(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def first(self) -> None:
            journal.record("enter", "first")

        @listen(first)
        def work(self) -> None:
            from remit_core import ResumeConflict

            journal.record("enter", "work")
            work_effect()
            nested = Nesting if inner == "same" else Other
            try:
                nested(suppress_flow_events=True).kickoff(inputs={"id": self.state["id"]})
                self.state["nested"] = "ran"
            except ResumeConflict:
                self.state["nested"] = "conflict"

        @listen(work)
        def last(self) -> None:
            journal.record("enter", "last")

    return Nesting


@pytest.mark.parametrize("inner", ["same", "other"])
def test_a_kickoff_of_a_flows_own_id_inside_its_step_is_refused(
    url: str, world: Path, inner: str
) -> None:
    """A step kicks off its own flow's id (with its own class, or another class on the same
    persistence), in the same thread: the inner kickoff gets `ResumeConflict` and runs
    nothing, and the outer flow goes on to its end, each step once (P5: one driver)."""
    flow_id = f"nest-{uuid.uuid4().hex}"

    def body() -> dict[str, Any]:
        flow = nesting_flow(url, world, inner)(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        return stored(url, flow_id)

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["state"] == {"id": flow_id, "nested": "conflict"}
    assert out.value["kinds"] == ["step", "step", "step"]
    assert entered(world) == {"first": 1, "work": 1, "last": 1}
    assert applied(world) == {"work": 1}


# -- a long flow --------------------------------------------------------------------------


def long_flow(url: str, steps: int) -> type[Any]:
    """s0 -> s1 -> ... -> s<steps-1>, each adding 1 to the dict state's `n`."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    def method(i: int) -> Any:
        def step(self: Any) -> None:
            self.state["n"] = self.state.get("n", 0) + 1

        step.__name__ = f"s{i}"
        return start()(step) if i == 0 else listen(f"s{i - 1}")(step)

    body: dict[str, Any] = {f"s{i}": method(i) for i in range(steps)}
    body["_skip_auto_memory"] = True
    return persist(RemitFlowPersistence(url))(type("Long", (Flow[dict],), body))  # type: ignore[no-any-return]


def counted_calls(url: str, steps: int) -> dict[str, Any]:
    """Run a long flow of `steps` methods, then restart it by id, with the real store's
    calls counted (the claim's renewals aside): per phase, calls by name."""
    flow_class = long_flow(url, steps)
    store = flow_class.__flow_persistence_config__.persistence.remit.store
    seen: Counter[str] = Counter()
    names = [
        n for n in dir(type(store)) if not n.startswith("_") and n not in ("renew_claim", "close")
    ]
    names = [n for n in names if callable(getattr(store, n))]

    def counting(name: str) -> Any:
        call = getattr(store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            seen[name] += 1
            return call(*args, **kwargs)

        return counted

    flow_id = f"long-{uuid.uuid4().hex}"
    for name in names:
        setattr(store, name, counting(name))
    try:
        flow = flow_class(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        ran, n = dict(seen), flow.state["n"]
        seen.clear()
        again = flow_class(suppress_flow_events=True)
        again.kickoff(inputs={"id": flow_id})
        restart = dict(seen)
    finally:
        for name in names:
            delattr(store, name)
    return {"n": n, "again": again.state["n"], "run": ran, "restart": restart}


def test_a_long_flows_store_calls_per_step_do_not_grow_with_its_length(url: str) -> None:
    """A flow of 30 and one of 300 methods in a row: each step costs the same store calls
    (one branch read and one commit a step), and the restart of the finished flow makes as
    many calls for 300 steps as for 30: it reads its head, not its line."""
    short = run(lambda: counted_calls(url, 30))
    long = run(lambda: counted_calls(url, 300))
    assert short.ok and long.ok, (short.summary(), long.summary())
    assert short.value["n"] == short.value["again"] == 30
    assert long.value["n"] == long.value["again"] == 300
    per_step = {k: v for k, v in long.value["run"].items() if v >= 300}
    assert per_step == {"get_branch": 300, "commit_checkpoint": 300}, long.value["run"]
    fixed = {k: v for k, v in long.value["run"].items() if v < 300}
    assert fixed == {k: v for k, v in short.value["run"].items() if v < 30}
    assert long.value["restart"] == short.value["restart"], (long.value, short.value)
    assert "commit_checkpoint" not in long.value["restart"]


# -- ids ----------------------------------------------------------------------------------


def test_an_id_shaped_like_a_fork_is_refused_before_any_step(url: str, world: Path) -> None:
    """Remit names a fork `<run>@fork-<16 hex>`. A kickoff of such an id that no fork made
    (for a run that does not exist, and for one that does), and a direct `save_state` of
    one, raise `UnknownRecord` naming the fork before any step runs, and write nothing:
    the real flow's state is untouched."""
    base = f"inv-{uuid.uuid4().hex[:8]}"

    def body() -> list[Any]:
        from remit_core import UnknownRecord
        from remit_crewai import RemitFlowPersistence

        flow_class = dead_end_flow(url, world)
        store = RemitFlowPersistence(url)
        out: list[Any] = []
        for flow_id in (f"{base}@fork-0123456789abcdef", base, f"{base}@fork-fedcba9876543210"):
            flow = flow_class(suppress_flow_events=True)
            try:
                flow.kickoff(inputs={"id": flow_id})
                out.append(["ran", store.load_state(flow_id)])
            except UnknownRecord as exc:
                out.append(["refused", "fork-" in str(exc), store.load_state(flow_id)])
        shaped = f"x{base}@fork-0123456789abcdef"
        try:
            store.save_state(shaped, "m", {"id": shaped})
            out.append(["saved"])
        except UnknownRecord:
            out.append(["refused", store.load_state(shaped), store.load_state(f"x{base}")])
        return out

    out = run(body)
    assert out.ok, out.summary()
    assert out.value == [
        ["refused", True, None],
        ["ran", {"id": base, "n": 1, "side": True}],
        ["refused", True, None],
        ["refused", None, None],
    ]
    assert entered(world) == {"begin": 1, "decide": 1, "side": 1}


#: The length of an id (of random hex digits) that fits the index entry of a claim on
#: PostgreSQL but not that of a checkpoint.
NEAR_LIMIT = 2680


def test_an_id_too_long_for_the_store_is_refused_before_any_step(url: str, world: Path) -> None:
    """An id a store cannot hold is refused before the flow's first step runs, nothing
    stored; one it can hold runs the flow. PostgreSQL keeps the ids of a record in an index
    entry of at most 2704 bytes: an id of 2680 characters fits a claim's entry but not a
    checkpoint's, and is refused at the claim, before the first step."""
    flow_id = secrets.token_hex(NEAR_LIMIT // 2)  # (PostgreSQL compresses a repetitive one)

    def body() -> Any:
        flow = dead_end_flow(url, world)(suppress_flow_events=True)
        try:
            flow.kickoff(inputs={"id": flow_id})
        except (ValueError, RuntimeError) as exc:
            return ["refused", f"{type(exc).__name__}: {exc}"[:200], stored(url, flow_id)]
        return ["ran", stored(url, flow_id)]

    out = run(body)
    assert out.ok, out.summary()
    # (SQLite and Redis hold ids of any length.)
    assert out.value[0] == ("refused" if url.startswith("postgresql") else "ran"), out.value
    if out.value[0] == "refused":
        assert "too long" in out.value[1], out.value
        assert entered(world) == {}, out.value
        assert out.value[2] == {"state": None, "kinds": []}
    else:
        assert out.value[1]["state"] == {"id": flow_id, "n": 1, "side": True}
        assert applied(world) == {"decide": 1, "side": 1}


def unicode_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> review (pauses) -> decide (a router: the label "支払い") -> pay (effect
    "pay", listens for "支払い") -> close; dict state. (CrewAI takes only ASCII method
    names; route labels and flow ids may be any text.)"""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    from remit_crewai import RemitFlowPersistence

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    pay = sink_effect(sink, "pay")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class Bestellung(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Zahlen? 払いますか?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "prüfen ✓"

        @router(review)
        def decide(self) -> str:
            journal.record("enter", "decide")
            return "支払い"

        @listen("支払い")
        def pay_now(self) -> None:
            journal.record("enter", "pay_now")
            self.state["receipt"] = pay()
            self.state["by"] = self.last_human_feedback.feedback  # type: ignore[union-attr]
            point(at, "pay.after")

        @listen(pay_now)
        def close(self) -> None:
            journal.record("enter", "close")
            self.state["closed"] = True

    return Bestellung


def test_a_unicode_id_and_route_through_a_pause_a_crash_and_a_restart(
    url: str, world: Path
) -> None:
    """A flow id and a route label in non-Latin scripts, with feedback in them too: the
    flow pauses, is resumed from another process and SIGKILLed after its payment, then
    restarted: the route is replayed, the payment applied once, the feedback and the id
    kept exactly (P1, P2, P4)."""
    flow_id = f"bestellung-ü-注文-{uuid.uuid4().hex[:8]}"

    def kickoff() -> str:
        flow = unicode_flow(url, world)(suppress_flow_events=True)
        out = flow.kickoff(inputs={"id": flow_id})
        return type(out).__name__

    def resume() -> None:
        flow_class = unicode_flow(url, world, points={"pay.after": "kill"})
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        flow.resume("ja, 払う 🧾")

    def restart() -> dict[str, Any]:
        flow = unicode_flow(url, world)(suppress_flow_events=True)
        until_free(lambda: flow.kickoff(inputs={"id": flow_id}))
        return dict(flow.state)

    started = run(kickoff)
    assert started.ok and started.value == "HumanFeedbackPending", started.summary()
    killed = run(resume)
    assert killed.status == "killed", killed.summary()
    done = run(restart)
    assert done.ok, done.summary()
    assert done.value["id"] == flow_id and done.value["by"] == "ja, 払う 🧾"
    assert done.value["closed"] is True
    assert stored(url, flow_id)["state"] == done.value
    assert entered(world) == {"prepare": 1, "review": 1, "decide": 1, "pay_now": 2, "close": 1}
    assert applied(world) == {"pay": 1}
