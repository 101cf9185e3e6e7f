"""Probes of round 32: what a flow that asks for feedback every round reads of its consumed
feedback. Its consumed interrupts grow by one a round; reading its pending feedback, resuming
it, and restarting it after a SIGKILL must read what that round needs, not every round's.

Written from the contract and from CrewAI's public API, against real CrewAI flows in
forked children, with the helpers of `test_crewai_flows`, on every engine; the store reads
are counted on the real store, under the persistence.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crewai_parts import Later
from test_crewai_flows import entered, kickoff, point, resume, run

from remit_core.conformance.world import Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def asking_loop(url: str, world: Path, points: dict[str, str] | None = None) -> type[Any]:
    """prepare -> review (pauses for feedback each round) -> decide (records the answer;
    the crash point "decide.<round>") -> "revise" loops to review, "approve" -> ship; a
    model state; built in a child."""
    from crewai.flow.flow import Flow, listen, or_, router, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal, at = Journal(WorldDB(world)), points or {}

    class Rounds(BaseModel):
        answers: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class AskingLoop(Flow[Rounds]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(or_(prepare, "revise"))
        @human_feedback(message="Good?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return f"draft {len(self.state.answers)}"

        @router(review)
        def decide(self) -> str:
            journal.record("enter", "decide")
            assert self.last_human_feedback is not None
            point(at, f"decide.{len(self.state.answers)}")
            self.state.answers.append(self.last_human_feedback.feedback)
            return self.last_human_feedback.feedback

        @listen("approve")
        def ship(self) -> None:
            journal.record("enter", "ship")

    return AskingLoop


def paused_after(url: str, world: Path, rounds: int) -> str:
    """A loop paused after `rounds` answers "revise" (in one child); returns its id."""

    def body() -> str:
        flow_class = asking_loop(url, world)
        started = kickoff(flow_class, inputs={"id": f"loop-{uuid.uuid4().hex}"})
        assert started["out"] == "HumanFeedbackPending"
        for _ in range(rounds):
            resume(flow_class, started["id"], "revise")
        return str(started["id"])

    made = run(body)
    assert made.ok, made.summary()
    return str(made.value)


def counting_reads(url: str, world: Path, fn: Callable[[type[Any]], Any]) -> dict[str, Any]:
    """Run `fn(flow_class)` in this process with the real store's interrupt reads counted:
    the calls that read interrupts, and the records they returned (each decoded and
    verified by the core). The claim's renewals are not counted (nor wrapped)."""
    flow_class = asking_loop(url, world)
    store = flow_class.__flow_persistence_config__.persistence.remit.store
    seen: Counter[str] = Counter()
    list_interrupts, get_interrupt = store.list_interrupts, store.get_interrupt

    def listed(*args: Any, **kwargs: Any) -> Any:
        rows = list_interrupts(*args, **kwargs)
        seen["calls"] += 1
        seen["records"] += len(rows)
        return rows

    def got(*args: Any, **kwargs: Any) -> Any:
        row = get_interrupt(*args, **kwargs)
        seen["calls"] += 1
        seen["records"] += row is not None
        return row

    store.list_interrupts, store.get_interrupt = listed, got
    try:
        value = fn(flow_class)
    finally:
        del store.list_interrupts, store.get_interrupt
    return {"reads": dict(seen), "value": value}


def restart(flow_class: type[Any], flow_id: str) -> dict[str, Any]:
    """`kickoff(inputs={"id": flow_id})`: the restart replays each completed round's
    methods, which CrewAI counts toward `max_method_calls` (100 by default)."""
    flow = flow_class(suppress_flow_events=True, max_method_calls=10**6)
    out = flow.kickoff(inputs={"id": flow_id})
    return {"state": flow.state.model_dump(), "out": type(out).__name__}


#: The rounds the late loop has answered before it is read: it pauses in round 200.
LATE = 199


def round_reads(url: str, world: Path, flow_id: str) -> dict[str, Any]:
    """In three children, on the loop `flow_id` paused at a round: the reads of reading its
    pending feedback, of one resumed round (to the next pause), and, after a resume
    SIGKILLed in `decide` (its answer consumed, not yet saved), of the restart (which
    pauses again). Returns the reads and the restart's state."""
    persistence_reads = run(
        lambda: counting_reads(
            url,
            world,
            lambda flow_class: (
                flow_class.__flow_persistence_config__.persistence.load_pending_feedback(flow_id)[
                    1
                ].method_name
            ),
        )
    )
    assert persistence_reads.ok and persistence_reads.value["value"] == "review"
    resumed = run(
        lambda: counting_reads(url, world, lambda flow_class: resume(flow_class, flow_id, "revise"))
    )
    assert resumed.ok, resumed.summary()
    answered = len(resumed.value["value"]["answers"])
    dying = run(
        lambda: resume(asking_loop(url, world, {f"decide.{answered}": "kill"}), flow_id, "revise")
    )
    assert dying.status == "killed", dying.summary()
    time.sleep(1.3)  # the dead resumer's lease (1 s) runs out
    restarted = run(
        lambda: counting_reads(url, world, lambda flow_class: restart(flow_class, flow_id))
    )
    assert restarted.ok and restarted.value["value"]["out"] == "HumanFeedbackPending", (
        restarted.summary()
    )
    return {
        "pending": persistence_reads.value["reads"],
        "resume": resumed.value["reads"],
        "restart": restarted.value["reads"],
        "answers": restarted.value["value"]["state"]["answers"],
    }


def test_a_feedback_loops_reads_of_its_feedback_do_not_grow_with_its_rounds(
    url: str, world: Path
) -> None:
    """P5, P1: a cyclic flow that pauses for feedback every round consumes one interrupt a
    round. Reading its pending feedback, resuming a round, and restarting it after a
    resumer was SIGKILLed with its answer consumed and not yet saved read as many
    interrupt records (and make as many interrupt reads) at round 200 as at round 2; the
    restart still replays that consumed answer (once), and each round's answer is
    consumed once. (Before this round each of them read every round's interrupt.)"""
    early = round_reads(url, world, paused_after(url, world, 1))
    late_id = paused_after(url, world, LATE)
    late = round_reads(url, world, late_id)
    paths = ("pending", "resume", "restart")
    assert [late[p] for p in paths] == [early[p] for p in paths]
    # The killed round's answer was consumed before the crash: the restart replays it.
    assert early["answers"] == ["revise"] * 3 and late["answers"] == ["revise"] * (LATE + 2)

    def finish() -> dict[str, Any]:
        from remit_core import ResumeConflict

        flow_class = asking_loop(url, world)
        done = resume(flow_class, late_id, "approve")
        try:
            resume(flow_class, late_id, "approve")
            stale = "resumed"
        except ResumeConflict as exc:
            stale = str(getattr(exc, "interrupt_id", None))
        remit = flow_class.__flow_persistence_config__.persistence.remit
        consumed = remit.interrupts(late_id, status="consumed")
        return {
            "answers": done["answers"],
            "stale": stale,
            "consumed": [i.interrupt_id for i in consumed],
            "pending": len(remit.interrupts(late_id, status="pending")),
        }

    out = run(finish)
    assert out.ok, out.summary()
    assert out.value["answers"] == ["revise"] * (LATE + 2) + ["approve"]
    # One interrupt per round, each consumed once; the stale resume names the last one.
    assert out.value["consumed"] == [f"review#{n}" for n in range(LATE + 3)], out.value
    assert out.value["pending"] == 0
    assert out.value["stale"] == out.value["consumed"][-1]
    assert entered(world)["ship"] == 1
