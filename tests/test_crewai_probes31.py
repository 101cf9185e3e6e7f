"""Probes of round 31: a flow's state shape changed between two deployments.

A dict-state flow whose class's `initial_state` gained a key since the flow was saved,
continued by the new deployment after a SIGKILL (a restart by id, a fork) or from a
pause (`from_pending`): the new key has its default, as a model state's added field
has, and a key a step deleted stays deleted (P1, P6: the continued run ends where an
uninterrupted run of the new deployment would). A paused flow loaded by a class whose
state model no longer reads its state (a type narrowed, a field dropped by a model
that forbids extra fields) is refused by `from_pending` as a restart by id is refused:
`VersionMismatch` naming the field, the pause still pending and free at once, nothing
lost (P4, P5); a model that only added a field with a default resumes it.

Real CrewAI flows in forked children, with the helpers of `test_crewai_flows`, on
every engine.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict
from test_crewai_flows import applied, child, entered, point

from remit_core import ResumeConflict
from remit_crewai import RemitFlowPersistence, fork_token

#: What deployment 1 of the dict-state flows starts with; deployment 2 adds `priority`.
FIRST = {"count": 0, "draft": "to delete"}
SECOND = {**FIRST, "priority": "normal"}


def tally_flow(
    url: str, world: Path, initial: dict[str, Any], points: dict[str, str] | None = None
) -> type[Any]:
    """prepare (counts, deletes `draft`) -> charge (effect) -> label (reads `priority`,
    a key deployment 2 added), on a dict state started from `initial`; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from crewai_parts import sink_effect

    from remit_core.conformance.world import EffectSink, Journal, WorldDB

    journal, sink, at = Journal(WorldDB(world)), EffectSink(WorldDB(world)), points or {}
    charge_card = sink_effect(sink, "charge")

    @persist(RemitFlowPersistence(url, lease=1.0))
    class TallyFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True
        initial_state = initial

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["count"] += 1
            del self.state["draft"]

        @listen(prepare)
        def charge(self) -> None:
            journal.record("enter", "charge")
            self.state["receipt"] = charge_card()
            point(at, "charge.after")

        @listen(charge)
        def label(self) -> None:
            journal.record("enter", "label")
            self.state["label"] = f"{self.state['priority']}:{self.state['count']}"

    return TallyFlow


def restart(flow_class: type[Any], flow_id: str) -> dict[str, Any]:
    """Kick `flow_id` off again with `flow_class` once the crashed holder's lease ran out
    (polled: each refused attempt gets `ResumeConflict` and runs nothing)."""
    deadline = time.monotonic() + 60
    while True:
        flow = flow_class(suppress_flow_events=True)
        try:
            flow.kickoff(inputs={"id": flow_id})
            return dict(flow.state)
        except Exception as exc:
            cause: BaseException | None = exc
            while cause is not None and not isinstance(cause, ResumeConflict):
                cause = cause.__cause__
            if cause is None or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_dict_flow_continued_by_a_deployment_that_added_a_key_gets_its_default(
    url: str, world: Path
) -> None:
    """Deployment 1 is SIGKILLed in `charge`, after its effect. Deployment 2, whose
    `initial_state` adds `priority`, restarts the flow by id in a new process: its
    steps read `priority` at its default (CrewAI clears a dict state before restoring
    it, so the key would be missing and `label` would fail), `draft`, which `prepare`
    deleted, stays deleted, and the flow ends as an uninterrupted run of deployment 2
    ends: each completed step entered once, the effect applied once. A fork of it made
    by a deployment 3 that adds `channel` gets that default too."""
    flow_id = f"tally-{uuid.uuid4().hex}"

    def first() -> None:
        flow = tally_flow(url, world, FIRST, {"charge.after": "kill"})(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})

    crashed = child(first).wait(120)
    assert crashed.status == "killed", crashed.summary()
    assert applied(world) == {"charge": 1}

    def second() -> dict[str, Any]:
        out = {"restarted": restart(tally_flow(url, world, SECOND), flow_id)}
        third = tally_flow(url, world, {**SECOND, "channel": "mail"})
        fork = third(suppress_flow_events=True)
        with fork_token("new deployment"):
            fork.kickoff(restore_from_state_id=flow_id)
        out["fork"] = {"id": fork.flow_id, "state": dict(fork.state)}
        return out

    done = child(second).wait(120)
    assert done.ok, done.summary()
    restarted = done.value["restarted"]
    receipt = restarted["receipt"]
    expected = {"id": flow_id, "count": 1, "receipt": receipt, "priority": "normal"}
    assert restarted == {**expected, "label": "normal:1"}
    assert entered(world) == {"prepare": 1, "charge": 2, "label": 1}
    assert applied(world) == {"charge": 1}
    store = RemitFlowPersistence(url)
    assert store.load_state(flow_id) == restarted
    fork = done.value["fork"]
    assert fork["id"] != flow_id
    assert fork["state"] == {**restarted, "id": fork["id"], "channel": "mail"}
    assert entered(world) == {"prepare": 1, "charge": 2, "label": 1}


def paused_tally_flow(url: str, world: Path, initial: dict[str, Any]) -> type[Any]:
    """prepare (counts, deletes `draft`) -> review (pauses for feedback) -> send (effect;
    reads `priority`, a key deployment 2 added), on a dict state; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai_parts import Later, sink_effect

    from remit_core.conformance.world import EffectSink, Journal, WorldDB

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    send_mail = sink_effect(sink, "send")

    @persist(RemitFlowPersistence(url))
    class PausedTallyFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True
        initial_state = initial

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["count"] += 1
            del self.state["draft"]

        @listen(prepare)
        @human_feedback(message="Send it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "tally"

        @listen(review)
        def send(self) -> None:
            journal.record("enter", "send")
            feedback = self.last_human_feedback.feedback
            self.state["sent"] = f"{self.state['priority']}:{feedback}"
            self.state["receipt"] = send_mail()

    return PausedTallyFlow


def test_a_paused_dict_flow_resumed_by_a_deployment_that_added_a_key_keeps_its_own_keys(
    url: str, world: Path
) -> None:
    """Deployment 1 pauses with `draft` deleted by a step. Deployment 2 (which adds
    `priority` to `initial_state`) loads it with `from_pending`: the state is the paused
    one plus `priority` at its default; `draft` does not come back with its default
    (CrewAI loads a paused state over a new flow's initial state), and the resume and
    what it saves continue the state the pause saved."""

    def first() -> str:
        flow = paused_tally_flow(url, world, FIRST)(suppress_flow_events=True)
        paused = flow.kickoff()
        assert type(paused).__name__ == "HumanFeedbackPending"
        return str(flow.flow_id)

    started = child(first).wait(120)
    assert started.ok, started.summary()
    flow_id = started.value

    def second() -> dict[str, Any]:
        flow_class = paused_tally_flow(url, world, SECOND)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        loaded = dict(flow.state)
        flow.resume("ann")
        return {"loaded": loaded, "ended": dict(flow.state)}

    done = child(second).wait(120)
    assert done.ok, done.summary()
    assert done.value["loaded"] == {"id": flow_id, "count": 1, "priority": "normal"}
    ended = done.value["ended"]
    receipt = ended["receipt"]
    assert ended == {
        "id": flow_id,
        "count": 1,
        "priority": "normal",
        "sent": "normal:ann",
        "receipt": receipt,
    }
    assert RemitFlowPersistence(url).load_state(flow_id) == ended
    assert entered(world) == {"prepare": 1, "review": 1, "send": 1}
    assert applied(world) == {"send": 1}


class Ticket(BaseModel):
    """Deployment 1's state model."""

    amount: int = 0
    note: str = ""
    approved_by: str | None = None


class TicketNarrowed(BaseModel):
    """`note` narrowed to an int: the paused `"checked"` no longer fits."""

    amount: int = 0
    note: int = 0
    approved_by: str | None = None


class TicketStrict(BaseModel):
    """`note` dropped by a model that forbids extra fields: the paused one is refused."""

    model_config = ConfigDict(extra="forbid")

    id: str = ""
    amount: int = 0
    approved_by: str | None = None


class TicketGrown(BaseModel):
    """A field added with a default: the paused state still fits."""

    amount: int = 0
    note: str = ""
    approved_by: str | None = None
    priority: str = "normal"


def ticket_flow(url: str, world: Path, model: type[BaseModel]) -> type[Any]:
    """review (sets the amount and note, pauses) -> approve (effect); one flow class
    name whatever `model` is, as one class across deployments; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from crewai_parts import Later, sink_effect

    from remit_core.conformance.world import EffectSink, Journal, WorldDB

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    approve_ticket = sink_effect(sink, "approve")

    @persist(RemitFlowPersistence(url))
    class TicketFlow(Flow[model]):  # type: ignore[misc, valid-type]
        _skip_auto_memory = True

        @start()
        @human_feedback(message="Approve it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            self.state.amount = 42
            self.state.note = "checked"
            return "ticket"

        @listen(review)
        def approve(self) -> None:
            journal.record("enter", "approve")
            self.state.approved_by = self.last_human_feedback.feedback
            approve_ticket()

    return TicketFlow


def _refusal(exc: BaseException) -> dict[str, Any]:
    return {
        "error": [c.__name__ for c in type(exc).__mro__],
        "field": getattr(exc, "ids", {}).get("field"),
        "message": str(exc),
    }


def test_a_paused_flow_loaded_by_a_model_that_no_longer_reads_its_state_is_refused(
    url: str, world: Path
) -> None:
    """P4, nothing lost: `from_pending` by the flow's class in a deployment whose state
    model narrowed `note` to an int, or dropped it and forbids extra fields, raises
    `VersionMismatch` naming `note` (CrewAI raises a bare `ValueError`), as a restart
    by id with that class does; each time the pause stays pending and the claim is given
    back at once: a deployment whose model only added a field with a default resumes it
    right after (no `ResumeConflict` for the default 30 s lease), with the state the
    pause saved and the new field at its default; every step is entered once and the
    effect applied once."""

    def first() -> str:
        flow = ticket_flow(url, world, Ticket)(suppress_flow_events=True)
        paused = flow.kickoff()
        assert type(paused).__name__ == "HumanFeedbackPending"
        return str(flow.flow_id)

    started = child(first).wait(120)
    assert started.ok, started.summary()
    flow_id = started.value

    def second() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, model in [("narrowed", TicketNarrowed), ("strict", TicketStrict)]:
            flow_class = ticket_flow(url, world, model)
            store = flow_class.__flow_persistence_config__.persistence
            try:
                flow_class.from_pending(flow_id, store)
                out[name] = {}
            except Exception as exc:
                out[name] = _refusal(exc)
            out[f"{name} pending"] = store.load_pending_feedback(flow_id) is not None
            try:
                flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id})
                out[f"{name} restart"] = {}
            except Exception as exc:
                out[f"{name} restart"] = _refusal(exc)
        flow_class = ticket_flow(url, world, TicketGrown)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        flow.resume("ann")
        out["grown"] = flow.state.model_dump()
        return out

    done = child(second).wait(120)
    assert done.ok, done.summary()
    out = done.value
    for name in ("narrowed", "strict"):
        for how in (name, f"{name} restart"):
            assert "VersionMismatch" in out[how].get("error", []), (how, out[how])
            assert out[how]["field"] == "note", (how, out[how])
            assert "test_crewai_probes31.Ticket" in out[how]["message"], (how, out[how])
        assert out[f"{name} pending"] is True
    assert out["grown"] == {
        "id": flow_id,
        "amount": 42,
        "note": "checked",
        "approved_by": "ann",
        "priority": "normal",
    }
    assert entered(world) == {"review": 1, "approve": 1}
    assert applied(world) == {"approve": 1}


def first_asking_flow(url: str, world: Path, *, answer: str | None) -> type[Any]:
    """query, the start (n += 10, then `self.ask`: answered with `answer`, or the process
    SIGKILLed while it waits, when `answer` is None) -> close, on a dict state started from
    `initial_state`; built in a child."""
    import os
    import signal

    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_core.conformance.world import Journal, WorldDB

    journal = Journal(WorldDB(world))

    class Console:
        def request_input(self, message: str, flow: Any, metadata: Any = None) -> str:
            if answer is None:
                os.kill(os.getpid(), signal.SIGKILL)
            return answer

    @persist(RemitFlowPersistence(url, lease=1.0))
    class FirstAskingFlow(Flow[dict]):  # type: ignore[misc]
        _skip_auto_memory = True
        initial_state = {"n": 0, "tag": "new"}
        input_provider = Console()

        @start()
        def query(self) -> None:
            journal.record("enter", "query")
            self.state["n"] += 10
            self.state["answer"] = self.ask("Go on?")

        @listen(query)
        def close(self) -> None:
            journal.record("enter", "close")
            self.state["closed"] = f"{self.state['tag']}:{self.state['n']}"

    return FirstAskingFlow


def test_a_dict_flows_first_step_killed_while_it_asks_runs_again_from_its_initial_state(
    url: str, world: Path
) -> None:
    """P1, P6: the first step of a dict-state flow changes the state and calls `ask()`;
    CrewAI saves the state as it asks, and the process is SIGKILLed while it waits. No
    checkpoint precedes that step, so the restart runs it again from the flow's initial
    state, `initial_state`'s keys and defaults included (not from an empty state, where
    the step fails on its own key), and ends as an uninterrupted run ends."""
    flow_id = f"ask-{uuid.uuid4().hex}"

    def crash() -> None:
        first_asking_flow(url, world, answer=None)().kickoff(inputs={"id": flow_id})

    crashed = child(crash).wait(120)
    assert crashed.status == "killed", crashed.summary()
    assert RemitFlowPersistence(url).load_state(flow_id)["n"] == 10  # as saved at the ask
    done = child(lambda: restart(first_asking_flow(url, world, answer="yes"), flow_id)).wait(120)
    assert done.ok, done.summary()
    assert done.value == {"id": flow_id, "n": 10, "tag": "new", "answer": "yes", "closed": "new:10"}
    assert entered(world) == {"query": 2, "close": 1}
