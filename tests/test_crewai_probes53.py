"""Round 53 of the CrewAI probes: Remit's retention (`Remit.prune`, which keeps each
branch's head, its newest `keep_last` checkpoints and every fork base) run on a flow's
store while the flow waits: killed while a step waits in `ask()`, paused for feedback
and edited by an operator, left by a resumer that died after taking the feedback, forked
under a token, or forked from a pause; and while a flow runs in another process, or
after it was SIGKILLed behind an effect.

Found: Remit read from a flow's older checkpoints what a restart needs, and a prune
deletes them. (1) A step killed in `ask()` is run again from the state before it, read
from the checkpoint before the ask: pruned, the restart ran the step on the flow's
initial state: what the steps before it had done was lost (a note of `gather`'s gone;
P1, P6). (2) A restart after a resumer died behind a consumed feedback finds that
feedback through the pause it answered: with an operator's edit made on it and then a
prune, the flow asked its reviewer again, the answer it had taken lost (P5). (3) A fork
token names the same fork however far its source moved on, found by walking from the
source's head to the fork's base: with the checkpoints between pruned, the token was
refused (`ForkWithoutIntent`, "not on the line"; P3). (4) A fork of a pause kicked off
again meets the paused method's effects under the source's keys, found by walking back
through the fork's pauses: with its first pause pruned, the reviewer was asked again
(P2, P3). Now each checkpoint that needs it keeps what a restart reads (an ask, the
state its step started from; an edit of a pause or feedback, which one it was made on
and the pause's context; a fork's pause, the branch its occurrence first ran on), and a
fork's base is found from the branches. Held: a paused flow edited and pruned is
resumed from another process with its edit and its answer; a prune while a step runs in
another process, or after a SIGKILL behind an effect, leaves the run to finish, each
effect once.

Written from the contract and CrewAI's public API, against real CrewAI flows in forked
children SIGKILLed mid-step, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from test_crewai_flows import (
    applied,
    child,
    entered,
    kickoff,
    order_flow,
    point,
    resume,
    review_flow,
    run,
)

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence, fork_token


def asking_flow(url: str, world: Path, *, answer: str | None, asks: int) -> type[Any]:
    """gather (notes "gathered") -> confirm (notes "confirming", then asks `asks` times,
    noting each answer; the process waiting for the last is SIGKILLed when `answer` is
    None); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal = Journal(WorldDB(world))

    class Operator:
        def request_input(self, message: str, flow: Any, metadata: Any = None) -> str:
            if message == f"Question {asks}?" and answer is None:
                os.kill(os.getpid(), signal.SIGKILL)
            return f"{answer} to {message}"

    class Notes(BaseModel):
        notes: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class ConfirmFlow(Flow[Notes]):  # type: ignore[misc]
        _skip_auto_memory, input_provider = True, Operator()

        @start()
        def gather(self) -> None:
            journal.record("enter", "gather")
            self.state.notes = [*self.state.notes, "gathered"]

        @listen(gather)
        def confirm(self) -> None:
            journal.record("enter", "confirm")
            self.state.notes = [*self.state.notes, "confirming"]
            for i in range(1, asks + 1):
                self.state.notes = [*self.state.notes, str(self.ask(f"Question {i}?"))]

    return ConfirmFlow


@pytest.mark.parametrize("asks", [1, 2])
def test_a_step_killed_in_ask_and_pruned_runs_again_from_the_state_before_it(
    url: str, world: Path, asks: int
) -> None:
    """P1, P6 under retention: a step is SIGKILLed while it waits in its last `ask()`;
    the flow's store is then pruned to the checkpoints of its asks (`keep_last=asks`),
    which deletes the one `gather` saved. The restart runs the step again from the state
    it started from, so the flow ends as an uninterrupted run does (its notes begin
    "gathered", "confirming"). Before, the restart found nothing before the asks and ran
    the step on the initial state: `gather`'s note was lost. A read outside a kickoff
    returns the state as saved at the last ask; a further restart runs nothing."""
    flow_id = f"ask-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(asking_flow(url, world, answer=None, asks=asks), inputs={"id": flow_id})
    )
    assert crashed.status == "killed", crashed.summary()
    store = RemitFlowPersistence(url)
    assert [c.kind for c in store.checkpoints(flow_id)] == ["ask"] * asks + ["step"]
    assert store.remit.prune([flow_id], keep_last=asks) == 1
    assert [c.kind for c in store.checkpoints(flow_id)] == ["ask"] * asks
    asked = [f"None to Question {i}?" for i in range(1, asks)]
    assert store.load_state(flow_id)["notes"] == ["gathered", "confirming", *asked]
    time.sleep(1.2)  # the dead kickoff's claim runs out
    answered = [f"yes to Question {i}?" for i in range(1, asks + 1)]
    for _ in range(2):
        done = run(
            lambda: kickoff(
                asking_flow(url, world, answer="yes", asks=asks), inputs={"id": flow_id}
            )
        )
        assert done.ok, done.summary()
        notes = done.value["state"]["notes"]
        assert notes == ["gathered", "confirming", *answered], done.value
    assert entered(world) == {"gather": 1, "confirm": 2}


def inspection_flow(url: str, world: Path, *, points: dict[str, str] | None = None) -> type[Any]:
    """receive -> inspect (human feedback: pauses) -> sign -> send (effect), a dict
    state; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai_parts import Later, sink_effect

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    send_crate = sink_effect(sink, "send")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class InspectionFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True
        initial_state = {"log": [], "approved_by": None, "note": ""}

        @start()
        def receive(self) -> None:
            journal.record("enter", "receive")
            self.state["log"] = [*self.state["log"], "receive"]

        @listen(receive)
        @human_feedback(message="Send it?", provider=Later())
        def inspect(self) -> str:
            journal.record("enter", "inspect")
            return "crate"

        @listen(inspect)
        def sign(self) -> None:
            journal.record("enter", "sign")
            assert self.last_human_feedback is not None, "the feedback was lost"
            self.state["approved_by"] = self.last_human_feedback.feedback
            point(at, "sign.after")
            self.state["log"] = [*self.state["log"], "sign"]

        @listen(sign)
        def send(self) -> None:
            journal.record("enter", "send")
            send_crate()
            self.state["log"] = [*self.state["log"], "send"]

    return InspectionFlow


def paused(url: str, world: Path) -> str:
    """A review flow kicked off to its pause in a child; its id."""
    started = run(lambda: kickoff(inspection_flow(url, world)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    return str(started.value["id"])


def resumed_by(url: str, world: Path, flow_id: str, who: str, **kw: Any) -> Any:
    """Resume review flow `flow_id` with `who` (in a child); its state."""
    flow_class = inspection_flow(url, world, **kw)
    flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
    flow.resume(who)
    return dict(flow.state)


def resume_in_child(url: str, world: Path, flow_id: str, **kw: Any) -> Any:
    return run(lambda: resumed_by(url, world, flow_id, "alice", **kw))


DONE = {"log": ["receive", "sign", "send"], "approved_by": "alice", "note": "rush"}


def test_a_paused_flow_edited_and_pruned_is_resumed_with_its_edit(url: str, world: Path) -> None:
    """P5, P1 under retention: a paused flow is edited (`edit_state`) and pruned to its
    head (the edit): the pause is still listed, with its context, and a resume from
    another process takes it, with the edit kept; the crate is sent once, and a late
    resume gets `ResumeConflict`."""
    flow_id = paused(url, world)
    store = RemitFlowPersistence(url)
    before = store.load_pending_feedback(flow_id)
    assert before is not None
    store.edit_state(flow_id, {"note": "rush"})
    assert store.remit.prune([flow_id], keep_last=1) == 2
    assert [c.kind for c in store.checkpoints(flow_id)] == ["edit"]
    listed = store.load_pending_feedback(flow_id)
    assert listed is not None and listed[0]["note"] == "rush"
    assert listed[1].method_name == "inspect" and listed[1].method_output == "crate"

    done = resume_in_child(url, world, flow_id)
    assert done.ok, done.summary()
    assert {k: done.value[k] for k in DONE} == DONE, done.value
    assert applied(world) == {"send": 1}
    assert entered(world) == {"receive": 1, "inspect": 1, "sign": 1, "send": 1}
    late = resume_in_child(url, world, flow_id)
    assert late.raised("ResumeConflict"), late.summary()


def test_a_flow_whose_resumer_died_edited_and_pruned_keeps_its_feedback(
    url: str, world: Path
) -> None:
    """P5, P1 under retention: the resumer takes the feedback and is SIGKILLed in the
    next step; an operator edits the flow and prunes it to that edit, which deletes the
    checkpoint of the feedback the edit was made on. The restart by id continues with
    the feedback it had ("alice"), never asks the reviewer again, sends once. Before,
    the restart found no feedback: the flow paused at `inspect` again, its answer lost.
    A late resume gets `ResumeConflict`, and a further restart runs nothing."""
    flow_id = paused(url, world)
    crashed = resume_in_child(url, world, flow_id, points={"sign.after": "kill"})
    assert crashed.status == "killed", crashed.summary()
    time.sleep(1.2)  # the dead resumer's claim runs out
    store = RemitFlowPersistence(url)
    store.edit_state(flow_id, {"note": "rush"})
    assert [c.kind for c in store.checkpoints(flow_id)] == ["edit", "feedback", "pause", "step"]
    assert store.remit.prune([flow_id], keep_last=1) == 3
    assert store.load_pending_feedback(flow_id) is None

    for _ in range(2):
        done = run(lambda: kickoff(inspection_flow(url, world), inputs={"id": flow_id}))
        assert done.ok and done.value["out"] != "HumanFeedbackPending", done.summary()
        assert {k: done.value["state"][k] for k in DONE} == DONE, done.value
    assert applied(world) == {"send": 1}
    assert entered(world) == {"receive": 1, "inspect": 1, "sign": 2, "send": 1}
    late = resume_in_child(url, world, flow_id)
    assert late.raised("ResumeConflict"), late.summary()


def test_a_prune_while_a_flow_runs_elsewhere_or_after_its_crash_leaves_it_whole(
    url: str, world: Path, tmp_path: Path
) -> None:
    """P1, P2, L1 under retention: a flow waits in `charge` after its effect in another
    process while its store is pruned to its head, twice; let go, it finishes (ship
    runs, the card was charged once). A second flow SIGKILLed after its charge is pruned
    to its head and restarted: `charge` runs again and returns its recorded receipt,
    applying nothing, and both end in the same state. A kickoff of either once finished
    runs nothing."""
    go, first, second = tmp_path / "go", f"order-{uuid.uuid4().hex}", f"order-{uuid.uuid4().hex}"
    store = RemitFlowPersistence(url)

    def waiting() -> Any:
        flow_class = order_flow(url, world, points={"charge.after": f"wait:{go}"})
        return kickoff(flow_class, inputs={"id": first})

    worker = child(waiting)
    deadline = time.monotonic() + 60
    while entered(world).get("charge") != 1 or applied(world) != {"charge": 1}:
        assert time.monotonic() < deadline, "the flow never reached its charge"
        time.sleep(0.05)
    assert store.remit.prune([first], keep_last=1) == 1  # (prepare's; adjust's is the head)
    assert store.remit.prune([first], keep_last=1) == 0
    go.touch()
    done = worker.wait(timeout=120)
    assert done.ok, done.summary()
    assert done.value["state"]["shipped"] and done.value["state"]["receipt"], done.value

    def killed() -> Any:
        flow_class = order_flow(url, world, lease=1.0, points={"charge.after": "kill"})
        return kickoff(flow_class, inputs={"id": second})

    crashed = run(killed)
    assert crashed.status == "killed", crashed.summary()
    assert applied(world) == {"charge": 2}
    assert store.remit.prune([second], keep_last=1) == 1
    time.sleep(1.2)  # the dead kickoff's claim runs out
    for flow_id in (second, first, second):
        again = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id}))  # noqa: B023
        assert again.ok, again.summary()
        state = again.value["state"]
        assert state["shipped"] and state["amount"] == 100, state
    assert applied(world) == {"charge": 2}
    assert entered(world) == {"prepare": 2, "adjust": 2, "charge": 3, "ship": 2}


def test_a_fork_token_gives_the_same_fork_after_its_source_was_pruned(
    url: str, world: Path
) -> None:
    """P3 under retention: a flow SIGKILLed in `charge` is forked under token "t" by
    `kickoff(restore_from_state_id=S)`; S is then restarted to its end and pruned to its
    head (its checkpoints between the fork's base and its head are deleted; the base is
    kept). The same token still names the same fork, by `store.fork` and by the same
    kickoff, which runs nothing more and applies nothing. Before, the fork's base could
    not be walked to from S's head: the token was refused with `ForkWithoutIntent`
    ("not on the line"). A new token forks S's head, which charges nothing again."""
    source = f"order-{uuid.uuid4().hex}"
    crashed = run(
        lambda: kickoff(
            order_flow(url, world, lease=1.0, points={"charge.before": "kill"}),
            inputs={"id": source},
        )
    )
    assert crashed.status == "killed", crashed.summary()

    def forked(token: str) -> Any:
        flow = order_flow(url, world)(suppress_flow_events=True)
        with fork_token(token):
            flow.kickoff(restore_from_state_id=source)
        return [flow.flow_id, flow.state.model_dump(exclude={"id"})]

    first = run(lambda: forked("t"))
    assert first.ok, first.summary()
    time.sleep(1.2)  # the dead kickoff's claim runs out
    done = run(lambda: kickoff(order_flow(url, world), inputs={"id": source}))
    assert done.ok, done.summary()
    assert applied(world) == {"charge": 2}
    store = RemitFlowPersistence(url)
    assert store.remit.prune([source], keep_last=1) == 3
    assert store.fork(source, fork_token="t") == first.value[0]
    again = run(lambda: forked("t"))
    assert again.ok, again.summary()
    assert again.value == first.value
    assert applied(world) == {"charge": 2}
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 3, "ship": 2}
    other = run(lambda: forked("u"))
    assert other.ok, other.summary()
    ended = {k: v for k, v in done.value["state"].items() if k != "id"}
    assert other.value[0] != first.value[0] and other.value[1] == ended, other.value
    assert applied(world) == {"charge": 2}


def test_a_fork_of_a_pause_kicked_off_again_after_a_prune_asks_nothing_again(
    url: str, world: Path
) -> None:
    """P3, P2 under retention: a flow pauses after an effect that asks the reviewer; a
    fork of the pause is kicked off twice (each time it runs the paused method again to
    pause on its own branch, and the ask returns its recorded outcome), then the run is
    pruned to its heads, which deletes the fork's first pause. Kicked off a third time,
    the fork still meets the ask under the source's key: the reviewer is not asked
    again; the fork and then the source are resumed, each ships once. Before, the
    restart no longer found where the paused method first ran and asked again."""
    started = run(lambda: kickoff(review_flow(url, world, ask=True)))
    assert started.ok and started.value["out"] == "HumanFeedbackPending", started.summary()
    source = started.value["id"]
    store = RemitFlowPersistence(url)
    forked = store.fork(source, fork_token="t")
    for turn in range(3):
        if turn == 2:
            assert store.remit.prune([source], keep_last=1) == 2
        again = run(lambda: kickoff(review_flow(url, world, ask=True), inputs={"id": forked}))
        assert again.ok and again.value["out"] == "HumanFeedbackPending", again.summary()
        assert applied(world) == {"ask": 1}
    for flow_id, who in ((forked, "bob"), (source, "ann")):
        done = run(lambda: resume(review_flow(url, world, ask=True), flow_id, who))  # noqa: B023
        assert done.ok, done.summary()
        assert done.value["approved_by"] == who
    assert applied(world) == {"ask": 1, "ship": 2}
    assert entered(world) == {"prepare": 1, "approve": 2, "ship": 2}


def test_a_fork_of_a_paused_flow_edited_and_pruned_waits_for_its_own_feedback(
    url: str, world: Path
) -> None:
    """P3, P5 under retention: a paused flow is edited and pruned to the edit; a fork of
    it (`store.fork` with a token) still waits for its own feedback, listed with the
    pause's context, and resuming it from another process sends once with the fork's
    reviewer and the edit; the source's pause is still its own, answered once."""
    flow_id = paused(url, world)
    store = RemitFlowPersistence(url)
    store.edit_state(flow_id, {"note": "rush"})
    assert store.remit.prune([flow_id], keep_last=1) == 2
    forked = store.fork(flow_id, fork_token="t")
    listed = store.load_pending_feedback(forked)
    assert listed is not None and listed[1].method_name == "inspect", listed
    assert listed[0]["note"] == "rush"

    for who, target in (("bob", forked), ("alice", flow_id)):
        done = run(lambda: resumed_by(url, world, target, who))  # noqa: B023
        assert done.ok, done.summary()
        assert done.value["approved_by"] == who and done.value["note"] == "rush", done.value
    assert applied(world) == {"send": 2}
    assert entered(world) == {"receive": 1, "inspect": 1, "sign": 2, "send": 2}
