"""Probes of round 15: CrewAI's `FlowPersistence` calls with odd arguments, a pause made
again, many flows in one event loop, a router loop killed twice, a renamed feedback
method, racing kickoffs of one new id, and a flow persisted per method.

Written from the contract and from what CrewAI's own `SQLiteFlowPersistence` answers,
against real CrewAI flows in forked children, with the helpers of `test_crewai_flows`,
on every engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import Later, sink_effect
from test_crewai_flows import (
    applied,
    child,
    entered,
    kickoff,
    order_flow,
    paused_review,
    point,
    review_flow,
    run,
)
from test_crewai_probes13 import pending_of

from remit_core.conformance.processes import Barrier
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence

# -- CrewAI's persistence calls made directly ---------------------------------------------


def test_direct_calls_with_odd_ids_and_a_pause_saved_again_answer_as_crewai_does(
    url: str, tmp_path: Path
) -> None:
    """`init_db` twice, then `save_state` / `load_state` with flow ids holding a store's
    pattern characters (`*`, `?`, `[`, `%`, `_`), a space, `/`, `:` and non-ASCII letters,
    and method names with a space, answer as CrewAI's own backend does: each id reads its
    own state, an id saved nowhere reads None, and so does its pending feedback. A pause
    saved again for the same method (CrewAI's `save_pending_feedback` on a pause made
    anew) is read back with its newest context, as CrewAI's own backend replaces it
    (before, Remit kept the first pause's context: its output and time)."""
    tag = uuid.uuid4().hex[:8]

    def body() -> dict[str, Any]:
        from crewai.flow.async_feedback.types import PendingFeedbackContext
        from crewai.flow.persistence import SQLiteFlowPersistence

        remit = RemitFlowPersistence(url)
        remit.init_db()
        remit.init_db()
        own = SQLiteFlowPersistence(str(tmp_path / "crewai.db"))
        ids = [f"a*{tag}", f"a?{tag}", f"a[1]{tag}", f"{tag}%_", f"ü β/x:{tag}", f"{tag} "]
        out: dict[str, Any] = {"remit": [], "crewai": []}
        for p, key in ((remit, "remit"), (own, "crewai")):
            for n, flow_id in enumerate(ids):
                p.save_state(flow_id, "step one", {"id": flow_id, "n": n})
            out[key].append([p.load_state(i) for i in [*ids, f"a{tag}", f"ab{tag}"]])
            out[key].append(pending_of(p.load_pending_feedback(f"none{tag}")))
            p.clear_pending_feedback(f"none{tag}")
            flow_id = f"paused-{tag}"
            for output in ("first", "second"):
                context = PendingFeedbackContext(
                    flow_id=flow_id,
                    flow_class="flows.Review",
                    method_name="review",
                    method_output=output,
                    message="Ship it?",
                )
                p.save_pending_feedback(flow_id, context, {"id": flow_id, "output": output})
            loaded = p.load_pending_feedback(flow_id)
            out[key].append([*pending_of(loaded), loaded[1].method_output])
        return out

    out = run(body)
    assert out.ok, out.error_text()
    states, nothing, pause = out.value["remit"]
    assert [None if s is None else s["n"] for s in states] == [0, 1, 2, 3, 4, 5, None, None]
    assert nothing is None
    assert pause[1:] == ["review", f"paused-{tag}", "second"], pause
    assert out.value["remit"] == out.value["crewai"]


# -- a paused flow paused again -------------------------------------------------------------


def note_flow(url: str, world: Path, *, backend: Any = None) -> type[Any]:
    """prepare -> review (`emit=["ship", "hold"]`, default "ship"; pauses; its output reads
    the state's note) -> "ship" -> send (effect "ship"; keeps the feedback's output);
    `backend`: a persistence other than Remit's. Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    ship_effect = sink_effect(sink, "ship")

    class Note(BaseModel):
        note: str = ""
        reviewed: str | None = None
        outcome: str | None = None
        receipt: str | None = None

    @persist(backend if backend is not None else RemitFlowPersistence(url))
    class NoteFlow(Flow[Note]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(
            message="Ship it?", emit=["ship", "hold"], default_outcome="ship", provider=Later()
        )
        def review(self) -> str:
            journal.record("enter", "review")
            return f"parcel for {self.state.note}"

        @listen("ship")
        def send(self) -> None:
            journal.record("enter", "send")
            assert self.last_human_feedback is not None
            self.state.reviewed = self.last_human_feedback.output
            self.state.outcome = self.last_human_feedback.outcome
            self.state.receipt = ship_effect()

    return NoteFlow


def test_a_pause_made_again_by_a_restart_is_resumed_with_its_new_output(
    url: str, world: Path, tmp_path: Path
) -> None:
    """A paused flow kicked off again with a new `note` runs its feedback method again,
    which pauses again with an output made from the note. `from_pending` in another
    process gets that pause, as with CrewAI's own backend (before, Remit kept the first
    pause's context: the reviewer was shown, and the resumed flow continued with, the
    output made from the old note). `resume_async("")` collapses to the default outcome
    without an LLM, runs its route once (P2: the effect once), and a restart of the
    finished flow runs nothing and keeps the outcome."""

    def paused_again(backend: Any = None) -> Any:
        from crewai.flow.async_feedback.types import HumanFeedbackPending

        journal = world if backend is None else tmp_path / "crewai-world.db"
        flow_class = note_flow(url, journal, backend=backend)
        flow_id = f"note-{uuid.uuid4().hex}"
        first = flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id, "note": "a"})
        again = flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id, "note": "b"})
        assert isinstance(first, HumanFeedbackPending) and isinstance(again, HumanFeedbackPending)
        return flow_id

    def vanilla() -> Any:
        from crewai.flow.persistence import SQLiteFlowPersistence

        own = SQLiteFlowPersistence(str(tmp_path / "crewai.db"))
        return own.load_pending_feedback(paused_again(own))[1].method_output

    crewai = run(vanilla)
    assert crewai.ok and crewai.value == "parcel for b", crewai.summary()
    started = run(paused_again)
    assert started.ok, started.error_text()
    flow_id = started.value

    def resumed() -> Any:
        flow_class = note_flow(url, world)
        flow = flow_class.from_pending(flow_id, RemitFlowPersistence(url))
        shown = flow.pending_feedback.method_output
        asyncio.run(flow.resume_async(""))
        return [shown, flow.state.model_dump()]

    done = run(resumed)
    assert done.ok, done.error_text()
    shown, state = done.value
    assert shown == crewai.value
    assert state["reviewed"] == "parcel for b" and state["outcome"] == "ship", state
    again = run(lambda: kickoff(note_flow(url, world), inputs={"id": flow_id}))
    assert again.ok and again.value["state"] == state, again.summary()
    assert entered(world) == {"prepare": 1, "review": 2, "send": 1}  # each kickoff pauses
    assert applied(world) == {"ship": 1}


# -- many flows in one event loop -----------------------------------------------------------

FLOWS = 4


def async_review_flow(url: str, world: Path) -> type[Any]:
    """prepare (async, effect "prep") -> review (pauses) -> ship (async, effect "ship";
    keeps the feedback); steps yield to the event loop between their parts. Built in a
    child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    prep, ship_effect = sink_effect(sink, "prep"), sink_effect(sink, "ship")

    class Parcel(BaseModel):
        prepared: str | None = None
        by: str | None = None
        shipped: str | None = None

    @persist(RemitFlowPersistence(url))
    class AsyncReviewFlow(Flow[Parcel]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        async def prepare(self) -> None:
            journal.record("enter", "prepare")
            await asyncio.sleep(0.05)
            self.state.prepared = prep()

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        async def review(self) -> str:
            await asyncio.sleep(0.05)
            return "parcel"

        @listen(review)
        async def ship(self) -> None:
            journal.record("enter", "ship")
            assert self.last_human_feedback is not None
            self.state.by = self.last_human_feedback.feedback
            await asyncio.sleep(0.05)
            self.state.shipped = ship_effect()

    return AsyncReviewFlow


def test_many_flows_kicked_off_and_resumed_at_once_in_one_loop_keep_apart(
    url: str, world: Path
) -> None:
    """P2, P5: `FLOWS` new flows `kickoff_async` under one `asyncio.gather`, each applying
    an effect and pausing; another process resumes them all under one `gather` of
    `resume_async`, each with its own feedback. Each flow ends with its own feedback and
    its own receipts, every effect applied once per flow, and the restarts of all of them
    at once run nothing."""
    ids = [f"many-{i}-{uuid.uuid4().hex}" for i in range(FLOWS)]

    async def kickoffs(flow_class: type[Any]) -> list[str]:
        flows = [flow_class(suppress_flow_events=True) for _ in ids]
        outs = await asyncio.gather(
            *(f.kickoff_async(inputs={"id": i}) for f, i in zip(flows, ids, strict=True))
        )
        return [type(o).__name__ for o in outs]

    started = run(lambda: asyncio.run(kickoffs(async_review_flow(url, world))))
    assert started.ok and started.value == ["HumanFeedbackPending"] * FLOWS, started.summary()

    async def resumes() -> list[dict[str, Any]]:
        flow_class = async_review_flow(url, world)
        store = RemitFlowPersistence(url)
        flows = [flow_class.from_pending(i, store) for i in ids]
        await asyncio.gather(*(f.resume_async(f"by-{n}") for n, f in enumerate(flows)))
        return [f.state.model_dump() for f in flows]

    done = run(lambda: asyncio.run(resumes()))
    assert done.ok, done.error_text()
    assert [s["by"] for s in done.value] == [f"by-{n}" for n in range(FLOWS)]
    receipts = [r for s in done.value for r in (s["prepared"], s["shipped"])]
    assert None not in receipts and len(set(receipts)) == 2 * FLOWS
    assert entered(world) == {"prepare": FLOWS, "ship": FLOWS}
    assert applied(world) == {"prep": FLOWS, "ship": FLOWS}
    again = run(lambda: asyncio.run(kickoffs(async_review_flow(url, world))))
    assert again.ok, again.error_text()
    assert entered(world) == {"prepare": FLOWS, "ship": FLOWS}
    assert applied(world) == {"prep": FLOWS, "ship": FLOWS}


# -- a router loop killed twice ----------------------------------------------------------------


def loop_flow(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> check (a router: "again" while fewer than 3 rounds, then "done") ->
    "again" -> rework (effect "fix", then a crash point) -> check ...; "done" -> finish
    (effect "ship"). Crash points `check.<rounds>`, `rework.<rounds>`. Built in a child."""
    from crewai.flow.flow import Flow, listen, or_, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    fix, ship = sink_effect(sink, "fix"), sink_effect(sink, "ship")

    class Rounds(BaseModel):
        rounds: int = 0
        fixes: list[str] = []
        shipped: str | None = None

    @persist(RemitFlowPersistence(url, lease=1.0))
    class LoopFlow(Flow[Rounds]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @router(or_(prepare, "rework"))
        def check(self) -> str:
            journal.record("enter", "check")
            point(at, f"check.{self.state.rounds}")
            return "again" if self.state.rounds < 3 else "done"

        @listen("again")
        def rework(self) -> None:
            journal.record("enter", "rework")
            self.state.fixes.append(fix())
            point(at, f"rework.{self.state.rounds}")
            self.state.rounds += 1

        @listen("done")
        def finish(self) -> None:
            journal.record("enter", "finish")
            self.state.shipped = ship()

    return LoopFlow


def test_a_router_loop_killed_twice_finishes_with_each_rounds_effect_once(
    url: str, world: Path
) -> None:
    """P1, P2, P6: a loop through router `check` is SIGKILLed in `check` at round 1; the
    restart is SIGKILLed in `rework` at round 2, after that round's effect. The second
    restart replays both past rounds and finishes: each round's effect applied once (the
    killed round's under its own key, recorded), the state holds one receipt per round,
    and a third restart runs nothing."""
    flow_id = f"loop-{uuid.uuid4().hex}"

    def crash(points: dict[str, str]) -> None:
        crashed = run(lambda: kickoff(loop_flow(url, world, points), inputs={"id": flow_id}))
        assert crashed.status == "killed", crashed.summary()
        time.sleep(1.2)  # the dead kickoff's claim runs out

    crash({"check.1": "kill"})
    crash({"rework.2": "kill"})
    done = run(lambda: kickoff(loop_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.error_text()
    state = done.value["state"]
    assert state["rounds"] == 3 and state["shipped"] is not None, state
    assert len(set(state["fixes"])) == 3, state
    # Run 1: check x2 (killed), rework x1; run 2: check x2, rework x2 (killed);
    # run 3: rework of round 2 again, check once, finish.
    expected = {"prepare": 1, "check": 5, "rework": 4, "finish": 1}
    assert entered(world) == expected
    assert applied(world) == {"fix": 3, "ship": 1}
    again = run(lambda: kickoff(loop_flow(url, world), inputs={"id": flow_id}))
    assert again.ok and again.value["state"] == state, again.summary()
    assert entered(world) == expected


# -- a flow class changed between pause and resume -----------------------------------------


def renamed_review_flow(url: str) -> type[Any]:
    """A review flow whose feedback method (`review` when it paused) is now `review_v2`,
    its start; built in a child."""
    from crewai.flow.flow import Flow, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    @persist(RemitFlowPersistence(url))
    class ReviewFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        @human_feedback(message="Ship it?", provider=Later())
        def review_v2(self) -> str:
            return "parcel"

    return ReviewFlow


def test_a_flow_whose_feedback_method_was_renamed_is_refused_and_keeps_its_pause(
    url: str, world: Path
) -> None:
    """P4, P5, L1: a flow paused at `review` is resumed with a class whose feedback method
    is now `review_v2`: `VersionMismatch` naming `review` (before, CrewAI's bare
    `KeyError: 'review'` from the resume); nothing runs and nothing is consumed, and the
    flow is given back at once: an operator's edit goes through right away, and the
    resume with the right class, right away in another process, takes the pause once
    (with the edit), runs the rest once and applies its effect once."""
    flow_id = paused_review(url, world)

    def renamed() -> None:
        flow_class = renamed_review_flow(url)
        flow_class.from_pending(flow_id, RemitFlowPersistence(url)).resume("ann")

    refused = run(renamed)
    assert refused.raised("VersionMismatch"), refused.summary()
    assert "paused at method 'review', which ReviewFlow does not define" in refused.error_text()
    assert entered(world) == {"prepare": 1}

    def resumed() -> Any:
        flow_class = review_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        state_type = type(flow_class(suppress_flow_events=True).state)
        store.edit_state(flow_id, {"approved_by": "operator"}, state_type=state_type)
        flow = flow_class.from_pending(flow_id, store)
        before = flow.state.approved_by
        flow.resume("bob")
        return [before, flow.state.approved_by]

    done = run(resumed)
    assert done.ok, done.error_text()
    assert done.value == ["operator", "bob"]
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}
    late = run(lambda: review_flow(url, world).from_pending(flow_id, RemitFlowPersistence(url)))
    assert late.raised("ResumeConflict"), late.summary()


# -- k processes kicking off one new flow id ------------------------------------------------

RACERS = 4


def test_k_processes_kicking_off_one_new_flow_id_let_one_drive(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P5, P2: `RACERS` processes released together by a barrier each `kickoff(inputs={"id":
    X})` of one flow id no process has saved yet. One drives X (held in `charge` until the
    others are done); every other gets `ResumeConflict` and enters no method. Every step
    ran once, the charge applied once, and X loads the winner's state."""
    flow_id = f"race-{uuid.uuid4().hex}"
    go = tmp_path / "go"
    barrier = Barrier(RACERS)

    def racer() -> Any:
        flow_class = order_flow(url, world, points={"charge.before": f"wait:{go}"})
        barrier.wait()
        try:
            return ["ok", kickoff(flow_class, inputs={"id": flow_id})["state"]]
        except Exception as exc:
            return [type(exc).__name__]

    workers = [child(racer, barrier=barrier) for _ in range(RACERS)]
    assert barrier.release() == RACERS
    outcomes: dict[int, Any] = {}
    deadline = time.monotonic() + 90
    while len(outcomes) < RACERS - 1 and time.monotonic() < deadline:
        for n, worker in enumerate(workers):
            if n not in outcomes and (polled := worker.poll()) is not None:
                outcomes[n] = polled
        time.sleep(0.05)
    go.touch()  # the losers are done: let the winner through `charge`
    results = [(outcomes.get(n) or w.wait(timeout=120)) for n, w in enumerate(workers)]
    assert all(o.ok for o in results), [o.summary() for o in results]
    values = [o.value for o in results]
    winners = [v[1] for v in values if v[0] == "ok"]
    assert len(winners) == 1, values
    assert sorted(v[0] for v in values if v[0] != "ok") == ["ResumeConflict"] * (RACERS - 1)
    assert winners[0]["shipped"] is True and winners[0]["receipt"] is not None
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1, "ship": 1}
    assert applied(world) == {"charge": 1}
    loaded = run(lambda: RemitFlowPersistence(url).load_state(flow_id))
    assert loaded.ok and loaded.value == winners[0], loaded.summary()


# -- a flow persisted per method ------------------------------------------------------------


def per_method_flow(url: str, world: Path, *, backend: Any = None, kill: bool = False) -> Any:
    """prepare (saved) -> count (saved) -> ship (not saved; SIGKILLed if `kill`), with
    `@persist` on two methods only, to Remit or `backend`. Built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))
    store = backend if backend is not None else RemitFlowPersistence(url, lease=30.0)

    class PerMethodFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        @persist(store)
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["count"] = self.state.get("count", 0) + 1

        @listen(prepare)
        @persist(store)
        def count(self) -> None:
            journal.record("enter", "count")
            self.state["count"] += 10

        @listen(count)
        def ship(self) -> None:
            journal.record("enter", "ship")
            point({"ship": "kill"} if kill else {}, "ship")
            self.state["shipped"] = True

    return PerMethodFlow


def test_a_flow_persisted_per_method_restarts_at_once_after_a_crash_as_with_crewai(
    url: str, world: Path, tmp_path: Path
) -> None:
    """A flow `@persist`ed on two of its methods only is SIGKILLed in its third, after both
    saves. A restart with its id, right away and with a 30 s lease, is not refused (each
    save held the flow for its write alone: the dead process held nothing), and it does
    what it does on CrewAI's own backend: the same steps, and the flow id loads the same
    state."""

    def crash_and_restart(backend: Any, journal: Path) -> Any:
        flow_id = f"per-method-{uuid.uuid4().hex}"
        make = per_method_flow
        crashed = child(
            lambda: kickoff(make(url, journal, backend=backend, kill=True), inputs={"id": flow_id})
        ).wait(timeout=120)
        assert crashed.status == "killed", crashed.summary()
        restarted = kickoff(make(url, journal, backend=backend), inputs={"id": flow_id})
        loaded = (backend or RemitFlowPersistence(url)).load_state(flow_id)
        return [restarted["state"], loaded, entered(journal)]

    def vanilla() -> Any:
        from crewai.flow.persistence import SQLiteFlowPersistence

        own = SQLiteFlowPersistence(str(tmp_path / "crewai.db"))
        return crash_and_restart(own, tmp_path / "crewai-world.db")

    crewai = run(vanilla)
    assert crewai.ok, crewai.error_text()
    remit = run(lambda: crash_and_restart(None, world))
    assert remit.ok, remit.error_text()
    strip = [{k: v for k, v in s.items() if k != "id"} for s in remit.value[:2]]
    assert strip == [{k: v for k, v in s.items() if k != "id"} for s in crewai.value[:2]]
    assert remit.value[2] == crewai.value[2] == {"prepare": 2, "count": 2, "ship": 2}
