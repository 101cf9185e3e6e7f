"""Probes of round 25: the order in which a restart follows a replayed router's route,
and a loop through a start method that waits for a route.

Written from the contract (P1: a restart continues strictly after the head; P2: effects
once; P6: any recovery reaches the state an uninterrupted run reaches) and from CrewAI's
public API (a trigger's routers run first, then its plain listeners, then the listeners
of the routes they took; `@start("route")` runs each time a router takes that route),
against real CrewAI flows in forked children SIGKILLed mid-step, with the helpers of
`test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from test_crewai_flows import applied, entered, kickoff, point, run

from remit_crewai import RemitFlowPersistence


def fan_flow(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """begin -> (decide, a router -> "go" -> follow; note, a plain listener of begin); a
    model state; built in a child. CrewAI runs a trigger's routers first, then its plain
    listeners, then the listeners of the routes: `note` completes before `follow` starts,
    and `follow` reads what `note` wrote."""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_core.conformance.world import Journal, WorldDB

    journal, at = Journal(WorldDB(world)), points or {}

    class Fan(BaseModel):
        note: str = ""
        seen: str = ""

    @persist(RemitFlowPersistence(url, lease=1.0))
    class FanFlow(Flow[Fan]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")

        @router(begin)
        def decide(self) -> str:
            journal.record("enter", "decide")
            return "go"

        @listen(begin)
        def note(self) -> None:
            journal.record("enter", "note")
            point(at, "note")
            self.state.note = "noted"

        @listen("go")
        def follow(self) -> None:
            journal.record("enter", "follow")
            self.state.seen = self.state.note or "nothing"

    return FanFlow


def test_a_restart_runs_a_triggers_listeners_before_its_replayed_routers_route(
    url: str, world: Path
) -> None:
    """P6: CrewAI runs the plain listeners of a trigger before the listeners of the route
    a router of that trigger took. SIGKILLed in such a plain listener (after the router
    completed), the restart ran the route's listener first, as it replayed the router,
    and the flow ended in a state no uninterrupted run reaches (`follow` saw no note).
    Now a replayed router's route is followed where CrewAI follows it."""
    plain = run(lambda: kickoff(fan_flow(url, world), inputs={"id": f"fan-{uuid.uuid4().hex}"}))
    assert plain.ok, plain.summary()
    assert plain.value["state"]["seen"] == "noted"
    flow_id = f"fan-{uuid.uuid4().hex}"
    crashed = run(lambda: kickoff(fan_flow(url, world, {"note": "kill"}), inputs={"id": flow_id}))
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead kickoff's claim runs out
    done = run(lambda: kickoff(fan_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["seen"] == "noted", done.value
    assert entered(world) == {"begin": 2, "decide": 2, "note": 3, "follow": 2}


def loop_flow(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """setup -> go (a router) -> "again" -> tick (a start that waits for "again", with an
    effect) -> check (a router: "again" twice, then "done") -> "done" -> finish; a dict
    state; built in a child. `tick.<n>` is the crash point of the n-th round."""
    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist
    from crewai_parts import sink_effect

    from remit_core.conformance.world import EffectSink, Journal, WorldDB

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    tally = sink_effect(sink, "tally")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class LoopFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def setup(self) -> None:
            journal.record("enter", "setup")
            self.state["rounds"] = 0

        @router(setup)
        def go(self) -> str:
            journal.record("enter", "go")
            return "again"

        @start("again")
        def tick(self) -> None:
            journal.record("enter", "tick")
            tally()
            self.state["rounds"] += 1
            point(at, f"tick.{self.state['rounds']}")

        @router(tick)
        def check(self) -> str:
            journal.record("enter", "check")
            return "again" if self.state["rounds"] < 3 else "done"

        @listen("done")
        def finish(self) -> None:
            journal.record("enter", "finish")
            self.state["finished"] = True

    return LoopFlow


def test_a_loop_through_a_start_that_waits_for_a_route_restarts_in_the_round_in_flight(
    url: str, world: Path
) -> None:
    """P1, P2: a start method that waits for a route (`@start("again")`) is run again by
    CrewAI each time a router takes that route. SIGKILLed in its third round, the
    restart replays the two rounds that completed and runs the third: each round's
    effect applies once, and the flow ends as an uninterrupted run does."""
    flow_id = f"loop-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(loop_flow(url, world, {"tick.3": "kill"}), inputs={"id": flow_id})
    )
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead kickoff's claim runs out
    done = run(lambda: kickoff(loop_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert done.value["state"]["rounds"] == 3 and done.value["state"]["finished"], done.value
    assert entered(world) == {"setup": 1, "go": 1, "tick": 4, "check": 3, "finish": 1}
    assert applied(world) == {"tally": 3}
