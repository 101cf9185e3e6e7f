"""Probes of round 10: CrewAI flows under process faults, on every engine.

Written from the contract (P1: a restart runs again only what was in flight;
P2: every effect applies once, none is dropped) against real CrewAI flows in
forked children SIGKILLed mid-run, with the helpers of `test_crewai_flows`.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from crewai_parts import sink_effect
from test_crewai_flows import applied, child, entered, kickoff, point, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def twice_flow(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """start_a -> route_first -> "bill", start_b -> route_second (later) -> "bill": one
    listener, `pay` (effect), runs twice at once; the first run stops where `points` say.
    Built in a child."""
    import threading

    from crewai.flow.flow import Flow, listen, router, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    charge = sink_effect(sink, "charge")
    entries = [0]
    lock = threading.Lock()

    class Bills(BaseModel):
        receipts: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class TwiceFlow(Flow[Bills]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def start_a(self) -> None:
            pass

        @start()
        def start_b(self) -> None:
            time.sleep(0.3)  # the second run of pay starts after the first

        @router(start_a)
        def route_first(self) -> str:
            return "bill"

        @router(start_b)
        def route_second(self) -> str:
            return "bill"

        @listen("bill")
        def pay(self) -> None:
            journal.record("enter", "pay")
            with lock:
                entries[0] += 1
                first = entries[0] == 1
            if first:
                point(at, "pay.first")
            self.state.receipts.append(charge())

    return TwiceFlow


def test_a_run_of_a_listener_in_flight_beside_a_later_one_that_completed_applies_its_own_effect(
    url: str, world: Path
) -> None:
    """P1, P2: one listener runs twice at once; the later run completes and is saved, the
    earlier one is SIGKILLed before its effect. The restart runs the earlier one again, and
    its effect applies under its own key: two charges in all, none dropped (it took the
    later run's recorded receipt) and none twice."""
    flow_id = f"twice-{uuid.uuid4().hex}"
    marker = world.parent / "never"
    worker = child(
        lambda: kickoff(
            twice_flow(url, world, {"pay.first": f"wait:{marker}"}),
            inputs={"id": flow_id},
        )
    )

    def later_run_saved() -> None:
        persistence = RemitFlowPersistence(url)
        while persistence.remit.head(flow_id) is None or "pay" not in (
            persistence.checkpoints(flow_id)[0].completed
        ):
            time.sleep(0.02)

    assert run(later_run_saved).ok
    os.kill(worker.pid, signal.SIGKILL)
    assert worker.wait(timeout=60).status == "killed"
    assert applied(world) == {"charge": 1}
    time.sleep(1.2)  # the dead kickoff's claim runs out
    done = run(lambda: kickoff(twice_flow(url, world), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    assert entered(world) == {"pay": 3}
    assert applied(world) == {"charge": 2}
    assert len(set(done.value["state"]["receipts"])) == 2, done.value["state"]
