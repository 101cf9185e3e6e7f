"""Probes of round 16: a flow of parallel steps, an `and_` join, a router loop and an
`or_` listener SIGKILLed at each of its steps in turn, then restarted; and a step
SIGKILLed while it waits in `ask()`, after CrewAI saved the state it had changed so far.

Written from the contract (P1: a restart enters again only what was in flight, never a
completed step; P2: every effect applied once, counted at every call, not only by key;
P6: the restart ends in the state an uninterrupted run ends in) against real CrewAI
flows in forked children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from test_crewai_flows import child, kickoff

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_core.effects import effect
from remit_crewai import RemitFlowPersistence

# -- a flow killed at each of its steps in turn -----------------------------------------

#: How often an uninterrupted run enters each step of `mesh_flow` (11 steps in all).
MESH_STEPS = {
    "begin": 1,
    "left": 1,
    "right": 1,
    "join": 1,
    "check": 3,
    "redo": 2,
    "finish": 1,
    "tail": 1,
}


def mesh_flow(url: str, world: Path, kill_at: int | None = None) -> type[Any]:
    """begin -> left, right (side by side) -> join (`and_`) -> check (a router over
    `or_(join, redo)`: "again" twice, then "done") -> "again" -> redo -> check ...;
    "done" -> finish -> tail (`or_(finish, "never")`). Each step applies its own effect
    (every call journalled as "apply") and notes its receipt in the state; the
    `kill_at`-th step this process enters is SIGKILLed right after its effect."""
    import os
    import signal

    from crewai.flow.flow import Flow, and_, listen, or_, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    counter, lock = itertools.count(1), threading.Lock()

    def step(flow: Any, name: str) -> None:
        journal.record("enter", name)
        with lock:
            nth = next(counter)
        receipt = effects[name]()
        if nth == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        flow.state.receipts.append(receipt)

    def applying(name: str) -> Any:
        def apply(*, idempotency_key: str) -> str:
            journal.record("apply", name)  # every application, whatever its key
            return sink.apply(name, idempotency_key)

        return effect(apply, name=name, reconcile=sink.reconcile)

    effects = {name: applying(name) for name in MESH_STEPS}

    class Mesh(BaseModel):
        rounds: int = 0
        receipts: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class MeshFlow(Flow[Mesh]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            step(self, "begin")

        @listen(begin)
        def left(self) -> None:
            step(self, "left")

        @listen(begin)
        def right(self) -> None:
            step(self, "right")

        @listen(and_(left, right))
        def join(self) -> None:
            step(self, "join")

        @router(or_(join, "redo"))
        def check(self) -> str:
            step(self, "check")
            return "again" if self.state.rounds < 2 else "done"

        @listen("again")
        def redo(self) -> None:
            step(self, "redo")
            self.state.rounds += 1

        @listen("done")
        def finish(self) -> None:
            step(self, "finish")

        @listen(or_(finish, "never"))
        def tail(self) -> None:
            step(self, "tail")

    return MeshFlow


def journalled(world: Path, kind: str) -> Counter[str]:
    return Counter(e.name for e in Journal(WorldDB(world)).entries() if e.kind == kind)


def test_a_flow_killed_at_each_step_in_turn_restarts_to_the_same_end(
    url: str, tmp_path: Path
) -> None:
    """P1, P2, P6: one flow per step k of the 11 an uninterrupted run enters, each
    SIGKILLed right after the effect of its k-th step (in parallel children), then each
    restarted. Every restart finishes with the uninterrupted run's state (two rounds, one
    receipt per step run, each receipt once); every step's effect is called exactly as
    often as an uninterrupted run calls it (the killed step's effect returns its recorded
    outcome, so at most one call more, and none is applied twice); no step is entered
    again but what was in flight; and a further restart enters nothing."""
    total = sum(MESH_STEPS.values())
    worlds = {k: tmp_path / f"world-{k}" for k in range(1, total + 1)}
    ids = {k: f"mesh-{k}-{uuid.uuid4().hex}" for k in worlds}
    crashed = {
        k: child(lambda k=k: kickoff(mesh_flow(url, worlds[k], kill_at=k), inputs={"id": ids[k]}))
        for k in worlds
    }
    for k, worker in crashed.items():
        outcome = worker.wait(timeout=120)
        assert outcome.status == "killed", (k, outcome.summary())
    time.sleep(1.2)  # the dead kickoffs' claims run out
    restarted = {
        k: child(lambda k=k: kickoff(mesh_flow(url, worlds[k]), inputs={"id": ids[k]}))
        for k in worlds
    }
    for k, worker in restarted.items():
        outcome = worker.wait(timeout=120)
        assert outcome.ok, (k, outcome.error_text())
        state = outcome.value["state"]
        assert state["rounds"] == 2, (k, state)
        assert len(state["receipts"]) == total == len(set(state["receipts"])), (k, state)
        entered = journalled(worlds[k], "enter")
        extra = entered - Counter(MESH_STEPS)
        assert not Counter(MESH_STEPS) - entered, (k, entered)  # nothing skipped
        assert sum(extra.values()) <= 2 and all(n == 1 for n in extra.values()), (k, entered)
        assert journalled(worlds[k], "apply") == MESH_STEPS, k
        assert dict(EffectSink(WorldDB(worlds[k])).counts()) == MESH_STEPS, k
    for k in (1, total // 2, total):
        before = journalled(worlds[k], "enter")
        again = child(lambda k=k: kickoff(mesh_flow(url, worlds[k]), inputs={"id": ids[k]}))
        outcome = again.wait(timeout=120)
        assert outcome.ok, (k, outcome.error_text())
        assert journalled(worlds[k], "enter") == before, k


# -- a step killed while it asks ----------------------------------------------------------


def asking_flow(url: str, world: Path, *, answer: str | None) -> type[Any]:
    """count (n += 1) -> query (n += 10, then `self.ask`: answered with `answer`, or the
    process SIGKILLed while it waits, when `answer` is None); built in a child."""
    import os
    import signal

    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal = Journal(WorldDB(world))

    class Console:
        def request_input(self, message: str, flow: Any, metadata: Any = None) -> str:
            if answer is None:
                os.kill(os.getpid(), signal.SIGKILL)
            return answer

    class Tally(BaseModel):
        n: int = 0
        answer: str | None = None

    @persist(RemitFlowPersistence(url, lease=1.0))
    class AskingFlow(Flow[Tally]):  # type: ignore[misc]
        _skip_auto_memory = True
        input_provider = Console()

        @start()
        def count(self) -> None:
            journal.record("enter", "count")
            self.state.n += 1

        @listen(count)
        def query(self) -> None:
            journal.record("enter", "query")
            self.state.n += 10
            self.state.answer = self.ask("Go on?")

    return AskingFlow


def test_a_step_killed_while_it_asks_runs_again_from_the_state_before_it(
    url: str, world: Path
) -> None:
    """P1, P6: CrewAI saves the state as a step calls `ask()`, with what the step has
    changed so far. The step is SIGKILLed while it waits for the answer; the restart runs
    it again from its start, so it must start from the state before it (n = 1), not from
    the one saved as it asked (n = 11), or it adds its 10 twice. A read of the flow
    outside a kickoff still returns the state as it was saved, as CrewAI's own backend
    does; a further restart runs nothing and keeps the state."""
    flow_id = f"ask-{uuid.uuid4().hex}"
    crashed = child(
        lambda: kickoff(asking_flow(url, world, answer=None), inputs={"id": flow_id})
    ).wait(timeout=120)
    assert crashed.status == "killed", crashed.summary()
    assert RemitFlowPersistence(url).load_state(flow_id)["n"] == 11  # as saved at the ask
    time.sleep(1.2)  # the dead kickoff's claim runs out
    for _ in range(2):
        done = child(
            lambda: kickoff(asking_flow(url, world, answer="yes"), inputs={"id": flow_id})
        ).wait(timeout=120)
        assert done.ok, done.error_text()
        assert done.value["state"] == {"n": 11, "answer": "yes", "id": flow_id}, done.value
    assert journalled(world, "enter") == {"count": 1, "query": 2}


def test_a_persistence_naming_an_unknown_engine_is_refused_where_it_is_made() -> None:
    """A mistyped URL is refused as the persistence is made, naming it; before, the first
    kickoff failed with "could not prepare step"."""
    with pytest.raises(ValidationError, match=r"unsupported store URL 'mysql://h/db'"):
        RemitFlowPersistence("mysql://h/db")
    assert RemitFlowPersistence("postgres://postgres@127.0.0.1:5432/test").url.startswith(
        "postgres"
    )
