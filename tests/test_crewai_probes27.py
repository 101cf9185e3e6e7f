"""Probes of round 27: long loops through a start, run and restarted.

Written from the contract (P1: a restart continues strictly after the head; P6: recovery
reaches the end an uninterrupted run reaches) and from CrewAI's public API (a router
that routes back to a `@start(label)` is CrewAI's loop; `max_method_calls` bounds it),
against real CrewAI flows in forked children, with the helpers of `test_crewai_flows`,
on every engine.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import sink_effect
from test_crewai_flows import applied, entered, run

from remit_crewai import RemitFlowPersistence

#: Rounds of the long loop: CrewAI runs a loop through a start as nested calls, and its
#: own backend gets through this many under Python's default recursion limit.
ROUNDS = 300
#: The round the restarted loop's first process dies in.
KILLED_AT = 200


def start_loop(persistence: Any, world: Path | None = None, *, kill_at: int = 0) -> type[Any]:
    """step (a start that the route "again" loops back to; applies `tick` when `world`
    is given; SIGKILLs its process as it enters round `kill_at`) -> route ("again" until
    `ROUNDS` rounds ran, then "done") -> finish; a model state; built in a child."""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_core.conformance.world import EffectSink, Journal, WorldDB

    journal = None if world is None else Journal(WorldDB(world))
    tick = None if world is None else sink_effect(EffectSink(WorldDB(world)), "tick")

    class Rounds(BaseModel):
        n: int = 0

    @persist(persistence)
    class StartLoop(Flow[Rounds]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start("again")
        def step(self) -> None:
            if journal is not None:
                journal.record("enter", "step")
            if self.state.n + 1 == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if tick is not None:
                tick()
            self.state.n += 1

        @router(step)
        def route(self) -> str:
            return "again" if self.state.n < ROUNDS else "done"

        @listen("done")
        def finish(self) -> int:
            return self.state.n

    return StartLoop


def test_a_loop_through_a_start_runs_as_many_rounds_as_with_crewais_own_backend(
    url: str, tmp_path: Path
) -> None:
    """A router loops back to its `@start("again")` for `ROUNDS` rounds. CrewAI's own
    SQLite backend runs it to its end; so must Remit, as a drop-in. Before, every round
    nested two more calls (Remit's wrappers of CrewAI's start and listener runners, which
    wrap them for every flow of the process), and both flows failed with `RecursionError`
    at about half the rounds CrewAI's own reaches without Remit installed."""

    def body() -> dict[str, Any]:
        from crewai.flow.persistence.sqlite import SQLiteFlowPersistence

        own = SQLiteFlowPersistence(str(tmp_path / "crewai.db"))
        mine = RemitFlowPersistence(url)
        flow_id = f"loop-{uuid.uuid4().hex}"
        out: dict[str, Any] = {}
        for name, persistence in (("crewai", own), ("remit", mine)):
            flow = start_loop(persistence)(suppress_flow_events=True, max_method_calls=10**6)
            try:
                out[name] = flow.kickoff(inputs={"id": f"{name}-{flow_id}"})
            except Exception as exc:
                out[name] = f"{type(exc).__name__}: {exc}"[:200]
        out["stored"] = mine.load_state(f"remit-{flow_id}")
        return out

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["crewai"] == ROUNDS, out.value  # (what CrewAI's own backend runs)
    assert out.value["remit"] == ROUNDS, out.value
    assert out.value["stored"]["n"] == ROUNDS, out.value


def test_a_long_loop_killed_late_restarts_to_its_end_with_each_rounds_effect_once(
    url: str, world: Path
) -> None:
    """P1, P6: the loop's process is SIGKILLed as it enters round `KILLED_AT`; a new
    process restarts the flow by its id. The restart replays the completed rounds and runs
    the rest: it ends with `ROUNDS` rounds, each round's effect applied once. Before, the
    replay nested four calls per round and the restart failed with `RecursionError`: a
    flow that ran fine could not be recovered."""
    flow_id = f"loop-{uuid.uuid4().hex}"

    def first() -> Any:
        flow_class = start_loop(RemitFlowPersistence(url, lease=1.0), world, kill_at=KILLED_AT)
        return flow_class(suppress_flow_events=True, max_method_calls=10**6).kickoff(
            inputs={"id": flow_id}
        )

    def restart() -> Any:
        flow_class = start_loop(RemitFlowPersistence(url, lease=1.0), world)
        return flow_class(suppress_flow_events=True, max_method_calls=10**6).kickoff(
            inputs={"id": flow_id}
        )

    killed = run(first)
    assert killed.status == "killed", killed.summary()
    time.sleep(1.2)  # (the dead process's lease runs out)
    out = run(restart)
    assert out.ok, out.summary()
    assert out.value == ROUNDS
    assert applied(world) == {"tick": ROUNDS}
    assert entered(world) == {"step": ROUNDS + 1}  # (the killed round entered twice)
    assert RemitFlowPersistence(url).load_state(flow_id)["n"] == ROUNDS  # type: ignore[index]
