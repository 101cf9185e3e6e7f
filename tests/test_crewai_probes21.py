"""Probes of round 21: what a refused fork leaves behind, a flow instance kicked off
again, one flow id kicked off from two threads or tasks at once, a router loop recovered
from two copies of one store, and `emit=` feedback refused or raced.

Written from the contract (P1, P2: nothing durably done is done again; P3: a fork is
made only with its token, and a refused fork makes nothing; P4: a reader refuses a flow
written by a class it does not accept, before anything is written; P5: one resumer
consumes a pause; P6: recoveries of copies of one store end alike) against real CrewAI
flows in forked children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from test_crewai_flows import applied, entered, kickoff, order_flow, run
from test_crewai_probes20 import other_flow

from remit_crewai import RemitFlowPersistence, fork_token

#: How long a kickoff held at a gate waits for its rival to end before the gate opens.
GATE_PATIENCE = 60.0


def test_a_fork_refused_for_another_flow_class_makes_no_branch_and_spends_no_token(
    url: str, world: Path
) -> None:
    """P3, P4: `kickoff(restore_from_state_id=X)` under a fork token by a flow class that
    did not write X is refused with `VersionMismatch`, and makes nothing: no fork branch
    exists for the token afterwards, and the token is still free, so the class that wrote
    X forks with it from X's head. Before, the fork branch was made (and the token spent
    on it) before the class was checked."""
    done = run(lambda: kickoff(order_flow(url, world), inputs={"id": f"o-{uuid.uuid4().hex}"}))
    assert done.ok, done.summary()
    flow_id = done.value["id"]
    persistence = RemitFlowPersistence(url)

    def refused() -> dict[str, Any]:
        with fork_token("t-refused"):
            try:
                kickoff(other_flow(url, world), restore_from_state_id=flow_id)
            except Exception as exc:
                return {"class": type(exc).__name__, "message": str(exc)}
        return {"class": None}

    out = run(refused)
    assert out.ok, out.summary()
    assert out.value["class"] == "VersionMismatch", out.value
    assert persistence.remit.fork_branch(flow_id, "t-refused") is None
    assert [b.branch for b in persistence.remit.branches(flow_id)] == ["main"]

    def own() -> dict[str, Any]:
        with fork_token("t-refused"):
            return kickoff(order_flow(url, world), restore_from_state_id=flow_id)

    forked = run(own)
    assert forked.ok, forked.summary()
    assert forked.value["id"] != flow_id
    assert forked.value["state"]["shipped"] is True
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1, "ship": 1}
    assert applied(world) == {"charge": 1}


def test_one_flow_id_kicked_off_from_two_threads_at_once_runs_once(url: str, world: Path) -> None:
    """P5, P1: two threads of one process kick off one flow id at once (each its own
    instance, behind a barrier): exactly one runs the flow, the other gets
    `ResumeConflict` before any method body runs; every step entered once, the effect
    applied once, and nothing is left claimed (a later kickoff by id runs nothing).
    The one that claims the flow is held in `charge` until the other kickoff ended, so
    the two meet however slowly either thread runs (a watchdog opens the gate after
    `GATE_PATIENCE` s, so a kickoff that never ends fails the probe, never hangs it)."""
    import threading

    flow_id = f"o-{uuid.uuid4().hex}"
    gate = world.parent / "gate"

    def race() -> list[str]:
        cls = order_flow(url, world, points={"charge.before": f"wait:{gate}"})
        barrier = threading.Barrier(2)
        out: list[str] = []

        def one() -> None:
            barrier.wait()
            try:
                kickoff(cls, inputs={"id": flow_id})
                out.append("ok")
            except Exception as exc:
                out.append(type(exc).__name__)
            finally:
                gate.touch()  # the first to end lets the other go on

        watchdog = threading.Timer(GATE_PATIENCE, gate.touch)
        watchdog.start()
        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        watchdog.cancel()
        again = kickoff(cls, inputs={"id": flow_id})
        return sorted(out) + [str(again["state"]["shipped"])]

    out = run(race)
    assert out.ok, out.summary()
    assert out.value == ["ResumeConflict", "ok", "True"], out.value
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1, "ship": 1}
    assert applied(world) == {"charge": 1}


def test_one_instance_kicked_off_twice_without_an_id_continues_its_flow(
    url: str, world: Path
) -> None:
    """P1, P2: a flow instance kicked off a second time without an id keeps its flow id
    (CrewAI's rule), so it is the same run: the second kickoff continues it, as
    `kickoff(inputs={"id": ...})` does, and runs nothing again (each step entered once,
    the effect applied once, one more checkpoint at most). Before, CrewAI ran every step
    again under the same flow id and the effect was applied a second time (a new
    occurrence of `charge`, so a new effect key). A new instance still runs a new flow."""

    def twice() -> dict[str, Any]:
        cls = order_flow(url, world)
        flow = cls(suppress_flow_events=True)
        flow.kickoff()
        first = flow.flow_id
        flow.kickoff(inputs={"note": "again"})
        other = cls(suppress_flow_events=True)
        other.kickoff()
        return {
            "ids": [first, flow.flow_id, other.flow_id],
            "state": flow.state.model_dump(),
        }

    out = run(twice)
    assert out.ok, out.summary()
    first, second, other = out.value["ids"]
    assert first == second != other
    assert out.value["state"]["note"] == "again" and out.value["state"]["shipped"] is True
    assert RemitFlowPersistence(url).load_state(first)["note"] == "again"
    assert entered(world) == {"prepare": 2, "adjust": 2, "charge": 2, "ship": 2}
    assert applied(world) == {"charge": 2}  # once per flow


def test_one_flow_id_kicked_off_from_two_tasks_at_once_runs_once(url: str, world: Path) -> None:
    """P5, P1: two asyncio tasks of one event loop kick off one flow id at once with
    `kickoff_async` (each its own instance): exactly one runs the flow, the other gets
    `ResumeConflict` before any method body runs; each step entered once, the effect
    applied once, and nothing is left claimed (a later kickoff by id finishes at once).
    The one that claims the flow is held in `charge` (a sync step: CrewAI runs it in a
    thread) until the other kickoff ended; a watchdog opens the gate after
    `GATE_PATIENCE` s, so a kickoff that never ends fails the probe, never hangs it."""
    import asyncio
    import threading

    flow_id = f"o-{uuid.uuid4().hex}"
    gate = world.parent / "gate"

    def race() -> list[str]:
        cls = order_flow(url, world, points={"charge.before": f"wait:{gate}"})

        async def one() -> str:
            try:
                await cls(suppress_flow_events=True).kickoff_async(inputs={"id": flow_id})
            except Exception as exc:
                return type(exc).__name__
            finally:
                gate.touch()  # the first to end lets the other go on
            return "ok"

        async def both() -> list[str]:
            return list(await asyncio.gather(one(), one()))

        watchdog = threading.Timer(GATE_PATIENCE, gate.touch)
        watchdog.start()
        out = sorted(asyncio.run(both()))
        watchdog.cancel()
        again = kickoff(cls, inputs={"id": flow_id})
        return [*out, str(again["state"]["shipped"])]

    out = run(race)
    assert out.ok, out.summary()
    assert out.value == ["ResumeConflict", "ok", "True"], out.value
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1, "ship": 1}
    assert applied(world) == {"charge": 1}


def loop_flow(
    url: str, world: Path, *, kill_at: int | None = None, fail_once: Path | None = None
) -> type[Any]:
    """prepare -> check (a router) -> "again" -> rework (effect) -> check ... -> "done" ->
    finish; `kill_at`: SIGKILL in that round of rework, after its effect; `fail_once`:
    rework's second round raises after its effect, unless that file exists (it makes
    it). Built in a child."""
    import os
    import signal

    from crewai.flow.flow import Flow, listen, or_, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_core import effect
    from remit_core.conformance.world import EffectSink, Journal, WorldDB

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

    @effect(reconcile=sink.reconcile)
    def bill(*, idempotency_key: str) -> str:
        return sink.apply("bill", idempotency_key)

    class Rounds(BaseModel):
        rounds: int = 0
        receipts: list[str] = []
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
            return "again" if self.state.rounds < 3 else "done"

        @listen("again")
        def rework(self) -> None:
            journal.record("enter", "rework")
            self.state.receipts.append(bill())
            if self.state.rounds == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if fail_once is not None and self.state.rounds == 1 and not fail_once.exists():
                fail_once.touch()
                raise RuntimeError("round two failed")
            self.state.rounds += 1

        @listen("done")
        def finish(self) -> None:
            journal.record("enter", "finish")
            self.state.done = True

    return LoopFlow


def test_a_router_loop_killed_mid_cycle_recovers_alike_from_two_copies(tmp_path: Path) -> None:
    """P6, P1, P2: a router loop SIGKILLed in its second round, after that round's effect;
    the store and the outside world are copied twice and each copy is recovered by its
    own process: both end in the same state, having applied the same effects under the
    same keys (the killed round's effect met again, not applied again), entering the
    same steps."""
    import shutil
    import signal
    import time

    from remit_core.conformance.world import EffectSink, WorldDB

    store, world = tmp_path / "remit.db", tmp_path / "world.db"
    flow_id = f"loop-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(loop_flow(f"sqlite:///{store}", world, kill_at=1), inputs={"id": flow_id})
    )
    assert (crashed.status, crashed.signal) == ("killed", signal.SIGKILL), crashed.summary()
    time.sleep(1.2)  # the crashed process's lease runs out
    copies = []
    for n in range(2):
        folder = tmp_path / f"copy{n}"
        folder.mkdir()
        for f in tmp_path.glob("*.db*"):
            shutil.copy(f, folder / f.name)
        copies.append(folder)
    ends = []
    for folder in copies:
        url, copied = f"sqlite:///{folder / 'remit.db'}", folder / "world.db"
        done = run(lambda u=url, w=copied: kickoff(loop_flow(u, w), inputs={"id": flow_id}))
        assert done.ok, done.summary()
        keys = sorted(k for _, k, _ in EffectSink(WorldDB(copied)).applications())
        ends.append((done.value["state"], keys, entered(copied)))
    assert ends[0] == ends[1]
    state, keys, steps = ends[0]
    assert state["rounds"] == 3 and state["done"] is True and len(state["receipts"]) == 3
    assert len(keys) == len(set(keys)) == 3
    assert steps == {"prepare": 1, "check": 4, "rework": 4, "finish": 1}


def test_a_paused_instance_kicked_off_again_without_an_id_pauses_again_once(
    url: str, world: Path
) -> None:
    """P1, P2, P5: a paused flow instance kicked off again without an id continues its
    flow: the completed `prepare` is not entered again, the feedback method pauses at the
    same interrupt again (its effect met again under its key, not applied again), and
    one resume from another process answers it and finishes the flow. Before, CrewAI
    ran the flow again from `prepare` under the same flow id."""
    from test_crewai_flows import resume, review_flow

    def twice() -> list[Any]:
        flow = review_flow(url, world, ask=True)(suppress_flow_events=True)
        first = flow.kickoff()
        second = flow.kickoff()
        return [flow.flow_id, type(first).__name__, type(second).__name__]

    out = run(twice)
    assert out.ok, out.summary()
    flow_id, first, second = out.value
    assert first == second == "HumanFeedbackPending"
    remit = RemitFlowPersistence(url).remit
    assert [(i.interrupt_id, i.status) for i in remit.interrupts(flow_id)] == [
        ("review#0", "pending")
    ]
    done = run(lambda: resume(review_flow(url, world, ask=True), flow_id, "ann"))
    assert done.ok, done.summary()
    assert done.value["approved_by"] == "ann"
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ask": 1, "ship": 1}


def test_emit_feedback_refused_by_its_schema_leaves_the_pause_answerable(
    url: str, world: Path
) -> None:
    """P4, P5: feedback to an `emit=` pause that `feedback_schema` refuses raises
    `CheckpointInvalid` naming the interrupt; no routed listener completes, the pause is
    still pending and listed, the claim is given back at once, and the next resume (here
    through a persistence whose schema takes it) is consumed once and takes its route."""
    from test_crewai_flows import feedback_route_flow, resume

    def build(schema: dict[str, Any]) -> type[Any]:
        cls = feedback_route_flow(url, world)
        cls.__flow_persistence_config__.persistence.feedback_schema = schema
        return cls

    started = run(lambda: kickoff(feedback_route_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    refused = run(lambda: resume(build({"type": "string", "minLength": 1}), flow_id, ""))
    assert refused.raised("CheckpointInvalid"), refused.summary()
    persistence = RemitFlowPersistence(url)
    assert [i.status for i in persistence.remit.interrupts(flow_id)] == ["pending"]
    assert persistence.load_pending_feedback(flow_id) is not None
    assert applied(world) == {}
    done = run(lambda: resume(build({"type": "string"}), flow_id, ""))
    assert done.ok, done.summary()
    assert done.value["log"] == ["ship", "notify"]
    assert [i.status for i in persistence.remit.interrupts(flow_id)] == ["consumed"]
    assert entered(world)["notify"] == 1 and entered(world)["review"] == 1
    assert applied(world) == {"notify": 1}


def test_a_loop_retried_on_its_instance_after_a_failed_step_runs_the_rest_once(
    url: str, world: Path
) -> None:
    """P1, P2: a router loop whose second round raises is kicked off again on the same
    instance without an id (a retry after the error): it continues the flow, replaying
    round one and running round two again (its effect met under its key, not applied
    again), and finishes after the same rounds an uninterrupted run makes. Before, the
    retry ran the flow again from its start under the same flow id."""

    def retry() -> dict[str, Any]:
        flow = loop_flow(url, world, fail_once=world.parent / "failed-once")(
            suppress_flow_events=True
        )
        try:
            flow.kickoff()
            first = "ok"
        except Exception as exc:
            first = type(exc).__name__
        flow.kickoff()
        return {"first": first, "state": flow.state.model_dump()}

    out = run(retry)
    assert out.ok, out.summary()
    assert out.value["first"] == "RuntimeError"
    state = out.value["state"]
    assert state["rounds"] == 3 and state["done"] is True, state
    assert applied(world) == {"bill": 3}
    assert entered(world) == {"prepare": 1, "check": 4, "rework": 4, "finish": 1}


def test_racing_resumers_of_an_emit_pause_route_once(url: str, world: Path) -> None:
    """P5, P2: four processes resume one `emit=` pause at once (behind a barrier): exactly
    one consumes it and takes its route, the others get `ResumeConflict` and run nothing;
    the routed listeners run once and their effect is applied once."""
    from test_crewai_flows import child, feedback_route_flow, resume

    from remit_core.conformance.processes import Barrier

    started = run(lambda: kickoff(feedback_route_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    flow_id = started.value["id"]
    k = 4
    barrier = Barrier(k)

    def resumer() -> Any:
        cls = feedback_route_flow(url, world)
        barrier.wait()
        return resume(cls, flow_id, "")

    workers = [child(resumer, barrier=barrier) for _ in range(k)]
    barrier.release()
    outcomes = [w.wait(timeout=120) for w in workers]
    winners = [o for o in outcomes if o.ok]
    assert len(winners) == 1, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok)
    assert winners[0].value["log"] == ["ship", "notify"]
    assert entered(world) == {"prepare": 1, "review": 1, "ship": 1, "notify": 1}
    assert applied(world) == {"notify": 1}
