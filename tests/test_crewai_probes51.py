"""Round 51 of the CrewAI probes: flows in processes forked from a process that had
already run flows (a pre-fork server's workers, a `multiprocessing` pool with fork, a
test's set-up child forked from a pytest worker), a fork while a thread of the parent
drives a flow or holds one of Remit's locks, and effects a step hands to its workers.

Found: CrewAI's event bus is one per process; its first event starts a pool of
handler threads and an event-loop thread. A child forked after that inherited the
pool's count of idle threads it did not have: the handlers of its next events were
queued for threads that never ran them, and a kickoff that paused waited for its pause
event's handlers without a timeout, for good. A listener of the loop (an async
handler) never ran in the child either, a bus lock a parent thread held at the fork
stayed held, and the child's `flush` waited its full timeout for handlers that were
running in the parent. So did the locks of Remit's sessions and of its cache of
stores' cores. Now every forked child's bus starts its own pool and loop, and the
child gets fresh locks (`remit_crewai._after_fork`).

Also found, in remit_core: the lock of its cache of open stores stayed held in such a
child (now renewed at fork); and an `@effect` called in two processes forked inside one
step was call 0 of the step in both, so the second was never applied and returned the
first's outcome (now refused with `RemitError` naming `key=`; with a key of the user's
each is applied once).

Each scenario runs in a forked "server" process of its own, so that what it does to
its event bus stays out of the pytest worker; the server forks the children whose
liveness is checked, each with a short timeout. Written from the contract (L1: no run
stays blocked; P5, P2: consume-once and effects once, also across forked workers) and
CrewAI's public API, against real CrewAI flows, with the helpers of `test_crewai_flows`,
on every engine.
"""

from __future__ import annotations

import contextvars
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from test_crewai_flows import (
    applied,
    child,
    entered,
    kickoff,
    paused_review,
    resume,
    review_flow,
    run,
)

from remit_core.conformance.processes import Barrier, Outcome

#: How long a forked child may take to pause or finish a flow (it takes about a second).
CHILD_TIMEOUT = 20.0
#: How long the server process of a scenario may take.
SERVER_TIMEOUT = 150.0


def seen(outcome: Outcome) -> Any:
    """A child's outcome as plain data: its value, or why it has none."""
    return outcome.value if outcome.ok else outcome.summary()


def kickoff_in_child(url: str, world: Path) -> Any:
    """Kick a review flow off to its pause in a forked child; its outcome as data."""
    return seen(child(lambda: kickoff(review_flow(url, world))).wait(timeout=CHILD_TIMEOUT))


def paused_here(url: str, world: Path, flows: int, *, at_once: bool) -> list[str]:
    """Kick `flows` review flows off to their pause in this process (one after another,
    or from as many threads at once); their ids."""
    ids: list[str] = []

    def one() -> None:
        out = kickoff(review_flow(url, world))
        assert out["out"] == "HumanFeedbackPending", out
        ids.append(out["id"])

    if not at_once:
        for _ in range(flows):
            one()
        return ids
    threads = [threading.Thread(target=one) for _ in range(flows)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ids) == flows
    return ids


@pytest.mark.parametrize("at_once", [False, True], ids=["in-turn", "at-once"])
def test_a_child_forked_after_flows_ran_pauses_resumes_and_forks_on(
    url: str, world: Path, at_once: bool
) -> None:
    """L1: a server runs three flows to their pause (in turn, or from three threads at
    once), then forks a child that kicks a fourth off to its pause, and one that resumes
    one of the server's flows to its end; the first forks a grandchild that kicks a fifth
    off. Each finishes at once (before, the kickoff to a pause hung in the child: the
    pause event's handlers were handed to the server's idle handler threads, which the
    child does not have), and the server then resumes another of its flows itself. Each
    step ran once, each effect applied once."""

    def server() -> dict[str, Any]:
        ids = paused_here(url, world, 3, at_once=at_once)

        def kickoff_and_fork_again() -> Any:
            return {
                "own": kickoff(review_flow(url, world)),
                "grandchild": kickoff_in_child(url, world),
            }

        paused = child(kickoff_and_fork_again).wait(timeout=2 * CHILD_TIMEOUT)
        resumed = child(lambda: resume(review_flow(url, world), ids[0], "ann"))
        resumed_there = seen(resumed.wait(timeout=CHILD_TIMEOUT))
        here = resume(review_flow(url, world), ids[1], "bob")  # the server's bus still works
        return {"paused": seen(paused), "resumed": resumed_there, "here": here["approved_by"]}

    out = run(server)
    assert out.ok, out.error_text()
    paused = out.value["paused"]
    assert isinstance(paused, dict), paused
    assert paused["own"]["out"] == "HumanFeedbackPending"
    assert isinstance(paused["grandchild"], dict), paused["grandchild"]
    assert paused["grandchild"]["out"] == "HumanFeedbackPending"
    assert isinstance(out.value["resumed"], dict), out.value["resumed"]
    assert out.value["resumed"]["approved_by"] == "ann"
    assert out.value["here"] == "bob"
    assert entered(world) == {"prepare": 5, "approve": 2, "ship": 2}
    assert applied(world) == {"ship": 2}


def test_a_child_forked_while_a_handler_runs_in_the_parent_does_not_wait_for_it(
    url: str, world: Path
) -> None:
    """L1: a server's listener of a custom event is still running (it waits for a gate)
    when the server forks a child that kicks a flow off to its pause and emits that event
    itself. The child finishes at once, its own listener call done (before, its kickoff
    waited out the full timeout of `flush` for the handler running in the parent, which
    does not run in the child)."""

    def server() -> Any:
        from crewai.events.base_events import BaseEvent
        from crewai.events.event_bus import crewai_event_bus

        class Nudge(BaseEvent):
            type: str = "remit_probe_nudge"

        gate, started = threading.Event(), threading.Event()
        calls: list[int] = []

        @crewai_event_bus.on(Nudge)
        def on_nudge(source: Any, event: Any) -> None:
            calls.append(os.getpid())
            started.set()
            if os.getpid() == parent:
                gate.wait(SERVER_TIMEOUT)

        parent = os.getpid()
        crewai_event_bus.emit(None, Nudge())
        assert started.wait(CHILD_TIMEOUT)

        def body() -> Any:
            begun = time.monotonic()
            out = kickoff(review_flow(url, world))
            future = crewai_event_bus.emit(None, Nudge())
            assert future is not None
            future.result(timeout=CHILD_TIMEOUT)
            return {
                "out": out["out"],
                "calls": calls[1:] == [os.getpid()],
                "took": time.monotonic() - begun,
            }

        try:
            return seen(child(body).wait(timeout=CHILD_TIMEOUT))
        finally:
            gate.set()

    out = run(server)
    assert out.ok, out.error_text()
    assert isinstance(out.value, dict), out.value
    assert out.value["out"] == "HumanFeedbackPending"
    assert out.value["calls"] is True
    assert out.value["took"] < CHILD_TIMEOUT / 2, out.value
    assert entered(world) == {"prepare": 1}


def test_an_async_listener_of_the_pause_runs_in_a_forked_child(url: str, world: Path) -> None:
    """L1: a server registers an async listener of CrewAI's `FlowPausedEvent` (CrewAI
    runs it on its bus's loop thread) and runs one flow to its pause; then it forks a
    child that does the same. The child's pause is heard in the child and the child
    finishes (before, its kickoff hung: the listener was queued on a loop whose thread
    the child does not have)."""

    def server() -> Any:
        from crewai.events.event_bus import crewai_event_bus
        from crewai.events.types.flow_events import FlowPausedEvent

        heard: list[list[Any]] = []

        @crewai_event_bus.on(FlowPausedEvent)
        async def on_pause(source: Any, event: Any) -> None:
            heard.append([os.getpid(), event.flow_id])

        first = kickoff(review_flow(url, world))
        assert heard == [[os.getpid(), first["id"]]], heard

        def body() -> Any:
            out = kickoff(review_flow(url, world))
            return {"out": out["out"], "heard": heard[1:] == [[os.getpid(), out["id"]]]}

        forked = seen(child(body).wait(timeout=CHILD_TIMEOUT))
        again = kickoff(review_flow(url, world))  # the server's loop still runs its listener
        return {"child": forked, "server": heard[1:] == [[os.getpid(), again["id"]]]}

    out = run(server)
    assert out.ok, out.error_text()
    assert out.value["child"] == {"out": "HumanFeedbackPending", "heard": True}
    assert out.value["server"] is True
    assert entered(world) == {"prepare": 3}


@pytest.mark.parametrize("lock", ["_rwlock", "_futures_lock", "_instance_lock"])
def test_a_child_forked_while_a_parent_thread_holds_a_bus_lock_runs_on(
    url: str, world: Path, lock: str
) -> None:
    """L1: a thread of the server holds one of the event bus's locks (as while it
    registers a listener, settles a finished handler's future, or registers a new flow)
    at the moment the server forks a child that kicks a flow off to its pause. The child
    finishes (before, the lock stayed held in the child, where no thread would ever
    release it, and its kickoff hung)."""

    def server() -> Any:
        from crewai.events.event_bus import crewai_event_bus

        kickoff(review_flow(url, world))  # the bus has started
        held = getattr(crewai_event_bus, lock, None)
        if held is None:
            return "absent"
        taken, done = threading.Event(), threading.Event()

        def hold() -> None:
            acquire = getattr(held, "w_acquire", None) or held.acquire
            release = getattr(held, "w_release", None) or held.release
            acquire()
            taken.set()
            done.wait(SERVER_TIMEOUT)
            release()

        holder = threading.Thread(target=hold)
        holder.start()
        assert taken.wait(CHILD_TIMEOUT)
        try:
            return kickoff_in_child(url, world)
        finally:
            done.set()
            holder.join()

    out = run(server)
    assert out.ok, out.error_text()
    if out.value == "absent":
        pytest.skip(f"this CrewAI's event bus has no {lock}")
    assert isinstance(out.value, dict), out.value
    assert out.value["out"] == "HumanFeedbackPending"
    assert entered(world) == {"prepare": 2}


def test_pre_forked_workers_race_for_one_pause_and_exactly_one_resumes(
    url: str, world: Path
) -> None:
    """P5, P2, L1: a pre-fork server runs flows to their pause, then forks four workers
    that, released together, resume the same paused flow. Exactly one resumes it to its
    end; the others get `ResumeConflict`; all finish in time; the flow's later steps and
    its effect ran once, with the winner's value."""
    workers = 4

    def server() -> Any:
        from remit_crewai import RemitFlowPersistence

        ids = paused_here(url, world, 2, at_once=True)
        barrier = Barrier(workers)

        def worker(who: str) -> Any:
            def body() -> Any:
                flow_class = review_flow(url, world)
                barrier.wait()
                try:
                    return ["ok", resume(flow_class, ids[0], who)["approved_by"]]
                except Exception as exc:
                    return [type(exc).__name__]

            return body

        forked = [child(worker(f"w{i}"), barrier=barrier) for i in range(workers)]
        assert barrier.release(CHILD_TIMEOUT) == workers
        outcomes = [seen(w.wait(timeout=CHILD_TIMEOUT)) for w in forked]
        state = RemitFlowPersistence(url).load_state(ids[0])
        return {"outcomes": outcomes, "approved_by": state["approved_by"]}

    out = run(server)
    assert out.ok, out.error_text()
    outcomes = out.value["outcomes"]
    winners = [o for o in outcomes if o[0] == "ok"]
    assert len(winners) == 1, outcomes
    assert sorted(o[0] for o in outcomes if o[0] != "ok") == ["ResumeConflict"] * 3, outcomes
    assert out.value["approved_by"] == winners[0][1]
    assert entered(world) == {"prepare": 2, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}


def pool_resume(args: tuple[str, str, str, str]) -> list[Any]:
    """In a `multiprocessing` worker: resume flow `flow_id` with `value`; [pid, approved_by]."""
    url, world, flow_id, value = args
    return [os.getpid(), resume(review_flow(url, Path(world)), flow_id, value)["approved_by"]]


def test_a_multiprocessing_fork_pool_resumes_the_flows_its_parent_paused(
    url: str, world: Path
) -> None:
    """L1, P5, P2: a process pauses three flows, then resumes them from a `multiprocessing`
    pool of two workers made with the fork start method (a user's batch job). Every
    resume returns in time with its own value (before, a worker's run hung on the
    event bus it inherited); each flow's later steps and effect ran once, in a worker."""

    def server() -> Any:
        import multiprocessing

        ids = paused_here(url, world, 3, at_once=False)
        jobs = [(url, str(world), flow_id, f"v{n}") for n, flow_id in enumerate(ids)]
        with multiprocessing.get_context("fork").Pool(2) as pool:
            result = pool.map_async(pool_resume, jobs)
            result.wait(3 * CHILD_TIMEOUT)
            done = result.get(0) if result.ready() else "timeout"
        return {"pid": os.getpid(), "done": done}

    out = run(server)
    assert out.ok, out.error_text()
    done = out.value["done"]
    assert isinstance(done, list), done
    assert [value for _, value in done] == ["v0", "v1", "v2"]
    assert out.value["pid"] not in {pid for pid, _ in done}
    assert entered(world) == {"prepare": 3, "approve": 3, "ship": 3}
    assert applied(world) == {"ship": 3}


# -- Remit's own process-wide locks, held by a parent thread at the fork -----------------------

#: Where each lock lives (module, attribute path), and who owns the fix if it stays held.
REMIT_LOCKS = {
    "sessions": ("remit_crewai._session", "sessions.lock"),
    "cores": ("remit_crewai.persistence", "_cores_lock"),
    "stores": ("remit_core.stores", "_cache_lock"),
}


@pytest.mark.parametrize(
    "lock",
    [
        "sessions",
        "cores",
        "stores",
    ],
)
def test_a_child_forked_while_a_parent_thread_holds_a_remit_lock_runs_on(
    url: str, world: Path, lock: str
) -> None:
    """L1: a thread of the server holds one of Remit's process-wide locks (as while a
    save looks up its session, or a persistence first opens its store) at the moment
    the server forks a child that kicks a flow off to its pause. The child finishes
    (before, the sessions' and the stores' cores' locks stayed held in the child and
    its kickoff hung)."""
    import importlib

    module, path = REMIT_LOCKS[lock]

    def server() -> Any:
        kickoff(review_flow(url, world))
        held: Any = importlib.import_module(module)
        for name in path.split("."):
            held = getattr(held, name)
        taken, done = threading.Event(), threading.Event()

        def hold() -> None:
            with held:
                taken.set()
                done.wait(SERVER_TIMEOUT)

        holder = threading.Thread(target=hold)
        holder.start()
        assert taken.wait(CHILD_TIMEOUT)
        try:
            return seen(
                child(lambda: kickoff(review_flow(url, world))).wait(timeout=CHILD_TIMEOUT / 2)
            )
        finally:
            done.set()
            holder.join()

    out = run(server)
    assert out.ok, out.error_text()
    assert isinstance(out.value, dict), out.value
    assert out.value["out"] == "HumanFeedbackPending"
    assert entered(world) == {"prepare": 2}


# -- a fork while the parent drives a flow -------------------------------------------------------


def test_a_child_forked_mid_step_does_not_inherit_the_parents_hold_on_the_flow(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P5, L2: a server's thread is inside a step of flow X (it holds X's claim) when the
    server forks a child. The child does not drive X as if it were the parent: its
    kickoff of X by id and its `edit_state` of X get `ResumeConflict` and run or write
    nothing, while its read of X answers. Once the child is done the parent's step
    completes and X finishes, each step run once, its effect once."""
    from crewai_parts import sink_effect

    gate, inside = tmp_path / "go", tmp_path / "inside"

    def gated_flow() -> type[Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        from remit_core.conformance.world import EffectSink, Journal, WorldDB
        from remit_crewai import RemitFlowPersistence

        journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
        pay = sink_effect(sink, "pay")

        class Order(BaseModel):
            note: str = ""
            paid: bool = False

        @persist(RemitFlowPersistence(url))
        class GatedFlow(Flow[Order]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def prepare(self) -> None:
                journal.record("enter", "prepare")

            @listen(prepare)
            def wait_then_pay(self) -> None:
                journal.record("enter", "wait_then_pay")
                inside.touch()
                while not gate.exists():
                    time.sleep(0.01)
                pay()
                self.state.paid = True

        return GatedFlow

    def server() -> Any:
        from remit_crewai import RemitFlowPersistence

        flow_class = gated_flow()
        flow = flow_class(suppress_flow_events=True)
        runner = threading.Thread(target=flow.kickoff)
        runner.start()
        deadline = time.monotonic() + CHILD_TIMEOUT
        while not inside.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        flow_id = flow.flow_id

        def body() -> Any:
            out: dict[str, Any] = {}
            store = RemitFlowPersistence(url)
            out["read"] = store.load_state(flow_id)
            try:
                flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id})
                out["kickoff"] = "ran"
            except Exception as exc:
                out["kickoff"] = type(exc).__name__
            try:
                store.edit_state(flow_id, {"note": "child"})
                out["edit"] = "written"
            except Exception as exc:
                out["edit"] = type(exc).__name__
            return out

        try:
            forked = seen(child(body).wait(timeout=CHILD_TIMEOUT))
        finally:
            gate.touch()
            runner.join(CHILD_TIMEOUT)
        return {"child": forked, "final": RemitFlowPersistence(url).load_state(flow_id)}

    out = run(server)
    assert out.ok, out.error_text()
    forked = out.value["child"]
    assert isinstance(forked, dict), forked
    assert forked["kickoff"] == "ResumeConflict", forked
    assert forked["edit"] == "ResumeConflict", forked
    assert forked["read"]["paid"] is False
    assert out.value["final"]["paid"] is True
    assert out.value["final"]["note"] == ""
    assert entered(world) == {"prepare": 1, "wait_then_pay": 1}
    assert applied(world) == {"pay": 1}


# -- effects called in workers a step starts -----------------------------------------------------


@pytest.mark.parametrize(
    "workers",
    [
        "forked",
        "forked-own-keys",
        "threads",
    ],
)
def test_effects_a_step_hands_to_its_workers_are_each_applied_once(
    url: str, world: Path, workers: str
) -> None:
    """P2: a step charges two items in two workers it starts (forked processes, or
    threads in the step's context), each an `@effect` call with its own item. Each item
    is charged exactly once, and each call returns its own outcome; a restart of the
    finished flow charges nothing again. Forked workers need a key of the user's
    (`key=`): without one, each worker's call is refused and nothing is charged."""

    def body() -> Any:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        from remit_core.conformance.world import EffectSink, WorldDB
        from remit_core.effects import effect
        from remit_crewai import RemitFlowPersistence

        sink = EffectSink(WorldDB(world))
        own_keys = workers == "forked-own-keys"

        def apply(item: str, *, idempotency_key: str) -> str:
            return sink.apply(f"charge-{item}", idempotency_key)

        charge = (
            effect(apply, reconcile=sink.reconcile, key=lambda item: f"charge:{item}")
            if own_keys
            else effect(apply, reconcile=sink.reconcile)
        )

        class Basket(BaseModel):
            receipts: list[str] = []

        @persist(RemitFlowPersistence(url))
        class BasketFlow(Flow[Basket]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def pay(self) -> None:
                items = ["a", "b"]
                if workers == "threads":
                    got: dict[str, str] = {}
                    threads = [  # in the step's context, as README asks
                        threading.Thread(
                            target=contextvars.copy_context().run,
                            args=(lambda i=i: got.__setitem__(i, charge(i)),),
                        )
                        for i in items
                    ]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    self.state.receipts = [got[i] for i in items]
                    return
                forked = [child(lambda i=i: charge(i)) for i in items]
                outcomes = [w.wait(timeout=CHILD_TIMEOUT) for w in forked]
                self.state.receipts = [str(o.value) if o.ok else o.summary() for o in outcomes]

        flow = BasketFlow(suppress_flow_events=True)
        flow.kickoff()
        BasketFlow(suppress_flow_events=True).kickoff(inputs={"id": flow.flow_id})
        return flow.state.receipts

    out = run(body)
    assert out.ok, out.error_text()
    receipts = out.value
    if workers == "forked":
        # Each forked worker would number its call as call 0 of the step, and the second
        # would get the first's outcome: refused, naming the way out; nothing applied.
        assert all(r.startswith("RemitError") and "forked from its step" in r for r in receipts), (
            receipts
        )
        assert applied(world) == {}
        return
    assert [r.split(":")[0] for r in receipts] == ["charge-a", "charge-b"], receipts
    assert applied(world) == {"charge-a": 1, "charge-b": 1}


def test_a_resumer_copied_into_a_forked_child_does_not_resume_with_the_parents_claim(
    url: str, world: Path
) -> None:
    """P5: a server takes a paused flow with `from_pending`, then forks a child that calls
    `resume` on the copy of that flow object it inherited (a hand-off to a worker), and
    resumes it itself after the child is done. Exactly one resume proceeds: the child's
    copy does not hold the server's claim, so it gets `ResumeConflict` and runs nothing;
    the server's resume proceeds with its value. The later steps and the effect ran once."""
    flow_id = paused_review(url, world)

    def server() -> Any:
        flow_class = review_flow(url, world)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)

        def handed_off() -> Any:
            try:
                flow.resume("child")
            except Exception as exc:
                return type(exc).__name__
            return ["ok", flow.state.approved_by]

        in_child = seen(child(handed_off).wait(timeout=CHILD_TIMEOUT))
        flow.resume("server")
        return {"child": in_child, "server": flow.state.approved_by}

    out = run(server)
    assert out.ok, out.error_text()
    assert out.value == {"child": "ResumeConflict", "server": "server"}
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}
