"""Probes of round 19: records a restart or a resume reads besides the checkpoint body,
altered in the store; a flow's id changed by its own steps or by an edit; settings that
could never work; and a flow kicked off inside a step that runs again.

Written from the contract (P1, P2: nothing durably done is done again; P4: a stored
record that fails to decode or verify raises a clear error naming the run and what it
names, and an invalid write or setting is refused naming the field), against real
CrewAI flows in forked children (SIGKILL for crashes), with the helpers of
`test_crewai_flows`, on every engine. An altered record is sealed as Remit seals every
record, as a writer to the store could seal it: only its contents tell it apart.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect
from pydantic import ValidationError
from test_crewai_flows import (
    applied,
    entered,
    kickoff,
    paused_review,
    resume,
    review_flow,
    run,
)

from remit_core import codec
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_core.errors import RemitError
from remit_crewai import RemitFlowPersistence


def _error(call: Callable[[], Any]) -> dict[str, Any]:
    """What `call` raised: its class and the ids it names (None if it raised nothing)."""
    try:
        call()
    except Exception as exc:
        ids = exc.ids if isinstance(exc, RemitError) else {}
        return {"class": type(exc).__name__, **ids}
    return {"class": None}


def _feedback_entry(flow_id: str, **change: Any) -> dict[str, Any]:
    entry = {
        "interrupt": "review#0",
        "method": "review",
        "feedback": "ann",
        "outcome": None,
        "timestamp": "2026-01-01T00:00:00",
        "output": "parcel",
        "metadata": {},
    }
    return {**entry, **change}


#: Values a consumed feedback interrupt could hold that Remit never writes there.
CONSUMED: dict[str, Callable[[str], Any]] = {
    "a str": lambda flow_id: "ann",
    "an entry without its keys": lambda flow_id: {"interrupt": "review#0"},
    "an entry for another method": lambda flow_id: _feedback_entry(flow_id, method="ship"),
    "an entry for another interrupt": lambda flow_id: _feedback_entry(
        flow_id, interrupt="review#7"
    ),
    "feedback that is not a str": lambda flow_id: _feedback_entry(flow_id, feedback=["ann"]),
}


def test_a_restart_after_an_altered_consumed_feedback_is_refused_naming_it(
    url: str, world: Path
) -> None:
    """P4, P1: a restart of a paused flow whose feedback interrupt was consumed with a value
    of another shape than Remit writes (not a feedback entry, one that answers another
    method or interrupt, feedback that is not a str) raises `CorruptRecord` naming the run
    and the interrupt before any method runs. Before, the value went into the restart's
    ledger as it was: a bare `KeyError`/`TypeError` deep in the restart, or a ledger that
    counted another method as completed and skipped it."""
    flow_ids = {name: paused_review(url, world) for name in CONSUMED}
    persistence = RemitFlowPersistence(url)
    for name, value in CONSUMED.items():
        flow_id = flow_ids[name]
        [pending] = persistence.remit.interrupts(flow_id)
        persistence.remit.consume(flow_id, pending.interrupt_id, codec.dumps(value(flow_id)))

    def restarts() -> dict[str, dict[str, Any]]:
        return {
            name: _error(lambda f=flow_id: kickoff(review_flow(url, world), inputs={"id": f}))
            for name, flow_id in flow_ids.items()
        }

    out = run(restarts)
    assert out.ok, out.summary()
    for name, flow_id in flow_ids.items():
        assert out.value[name] == {
            "class": "CorruptRecord",
            "run_id": flow_id,
            "interrupt_id": "review#0",
        }, name
    assert entered(world) == {"prepare": len(CONSUMED)}


def _alter_pause(persistence: RemitFlowPersistence, flow_id: str, prompt: Any) -> str:
    """Commit, after the paused flow's head, a copy of its pause with context `prompt`:
    the id of the altered checkpoint."""
    remit = persistence.remit
    head = remit.head(flow_id)
    assert head is not None
    raw = codec.loads(head.state)
    raw["prompt"] = codec.dumps(prompt(codec.loads(raw["prompt"])))
    checkpoint_id = f"{999:012d}-{uuid.uuid4().hex[:12]}"
    remit.commit(
        run_id=flow_id,
        checkpoint_id=checkpoint_id,
        parent_id=head.checkpoint_id,
        state=codec.dumps(raw),
        metadata=dict(head.metadata),
    )
    return checkpoint_id


#: Pause contexts Remit never stores, each made from the real one.
CONTEXTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "a str": lambda context: "Ship it?",
    "a context without its method": lambda context: {
        k: v for k, v in context.items() if k != "method_name"
    },
    "the context of another method": lambda context: {**context, "method_name": "ship"},
    "outcomes that are a str": lambda context: {**context, "emit": "yes"},
}


def test_a_pause_whose_stored_context_was_altered_is_refused_naming_it(
    url: str, world: Path
) -> None:
    """P4, P5: `from_pending` of a paused flow whose pause context is not what Remit stores
    (not a dict, no method, another method's context, outcomes that are no list of str)
    raises `CorruptRecord` naming the run, the interrupt and the checkpoint, runs nothing,
    and gives the flow back (a second resumer gets the same error, not `ResumeConflict`);
    a direct `load_pending_feedback` raises it too. Before, CrewAI was handed the context
    as it was: a bare `KeyError`/`TypeError` (with the flow left claimed for its lease),
    or a resume that answered another method than the one the flow paused at."""
    flow_ids = {name: paused_review(url, world) for name in CONTEXTS}
    persistence = RemitFlowPersistence(url)
    altered = {
        name: _alter_pause(persistence, flow_ids[name], change) for name, change in CONTEXTS.items()
    }

    def resumes() -> dict[str, list[dict[str, Any]]]:
        return {
            name: [
                _error(lambda f=flow_id: resume(review_flow(url, world), f, "ann"))
                for _ in range(2)
            ]
            for name, flow_id in flow_ids.items()
        }

    out = run(resumes)
    assert out.ok, out.summary()
    for name, flow_id in flow_ids.items():
        refused = {
            "class": "CorruptRecord",
            "run_id": flow_id,
            "interrupt_id": "review#0",
            "checkpoint_id": altered[name],
        }
        assert out.value[name] == [refused, refused], name
        assert _error(lambda f=flow_id: persistence.load_pending_feedback(f)) == refused, name
    assert entered(world) == {"prepare": len(CONTEXTS)}


def test_an_edit_naming_another_id_is_refused_and_writes_nothing(url: str) -> None:
    """P4: `edit_state(X, {"id": Y, ...})` raises `CheckpointInvalid` naming the field
    `id`, and nothing is written (the head and the state stay as they were). Before, the
    edit was committed with its other changes and the `id` silently dropped: the caller
    was told nothing of the part of its edit that did not happen."""
    persistence = RemitFlowPersistence(url)
    flow_id = f"edit-{uuid.uuid4().hex}"
    persistence.save_state(flow_id, "step", {"id": flow_id, "n": 1})
    refused = _error(lambda: persistence.edit_state(flow_id, {"id": "another", "n": 2}))
    assert refused == {"class": "CheckpointInvalid", "run_id": flow_id, "field": "id"}
    assert persistence.load_state(flow_id) == {"id": flow_id, "n": 1}
    assert len(persistence.checkpoints(flow_id)) == 1
    persistence.edit_state(flow_id, {"id": flow_id, "n": 3})  # its own id is no change
    assert persistence.load_state(flow_id) == {"id": flow_id, "n": 3}


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("state_schema", {"type": "strin"}),
        ("feedback_schema", {"type": 5}),
        ("lease", float("inf")),
        ("lease", 0.01),  # shorter than a store round trip: it would lapse while held
    ],
)
def test_a_setting_that_could_never_work_is_refused_where_the_persistence_is_made(
    setting: str, value: Any, tmp_path: Path
) -> None:
    """A `state_schema` or `feedback_schema` that is no JSON Schema, or an endless lease,
    is refused as the persistence is made (at the flow's class definition), naming the
    setting. Before, it was accepted: a bad `state_schema` failed the first save, after
    the first step had run; a bad `feedback_schema` was recorded with the flow's pause and
    then failed its resume (and, recorded, every resume after, with any persistence); an
    endless lease failed the first save."""
    with pytest.raises(ValidationError) as caught:
        RemitFlowPersistence(f"sqlite:///{tmp_path}/remit.db", **{setting: value})
    assert [e["loc"] for e in caught.value.errors()] == [(setting,)]


def nested_flow(url: str, world: Path, *, kill: bool) -> type[Any]:
    """prepare -> work (effect "a"; kicks off Inner twice, without an id, each applying
    effect "b"; SIGKILL if `kill`; effect "c") -> done; dict states; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))
    a, b, c = (sink_effect(sink, kind) for kind in "abc")
    persistence = RemitFlowPersistence(url, lease=1.0)

    @persist(persistence)
    class Inner(Flow[dict[str, Any]]):
        _skip_auto_memory = True

        @start()
        def inner_step(self) -> str:
            journal.record("enter", "inner_step")
            return str(b())

    @persist(persistence)
    class Outer(Flow[dict[str, Any]]):
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        def work(self) -> None:
            journal.record("enter", "work")
            self.state["a"] = a()
            self.state["b"] = [Inner(suppress_flow_events=True).kickoff() for _ in range(2)]
            if kill:
                os.kill(os.getpid(), signal.SIGKILL)
            self.state["c"] = c()

        @listen(work)
        def done(self) -> None:
            journal.record("enter", "done")

    return Outer


def test_a_flow_kicked_off_inside_a_step_that_runs_again_is_continued_not_run_anew(
    url: str, world: Path
) -> None:
    """P1, P2: a step kicks off another Remit-backed flow twice without an id (CrewAI's
    default: a new id each time) and its process is SIGKILLed before the step completes;
    the restart runs the step again, and each inner flow is continued under the id it
    had, not run anew: each inner step ran once, each inner effect applied once, and the
    outer state holds the receipts the inner flows returned. Two kickoffs in one step are
    still two flows. Before, each kickoff of the step that ran again made a flow with a
    new id, which ran from its start: the inner effects applied twice."""
    flow_id = f"outer-{uuid.uuid4().hex}"
    crashed = run(lambda: kickoff(nested_flow(url, world, kill=True), inputs={"id": flow_id}))
    assert (crashed.status, crashed.signal) == ("killed", signal.SIGKILL), crashed.summary()
    assert entered(world) == {"prepare": 1, "work": 1, "inner_step": 2}
    time.sleep(1.5)  # the crashed process's lease runs out
    again = run(lambda: kickoff(nested_flow(url, world, kill=False), inputs={"id": flow_id}))
    assert again.ok, again.summary()
    assert entered(world) == {"prepare": 1, "work": 2, "inner_step": 2, "done": 1}
    assert applied(world) == {"a": 1, "b": 2, "c": 1}
    receipts = again.value["state"]["b"]
    assert len(set(receipts)) == 2 and all(r.startswith("b:") for r in receipts), receipts


def renaming_flow(url: str, world: Path, *, model: bool, rename: bool) -> type[Any]:
    """prepare (n = 1) -> rename (sets the state's id to another if `rename`; n + 1) ->
    finish (n + 10); a model or a dict state; journalled; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal = Journal(WorldDB(world))

    class Tally(BaseModel):
        n: int = 0

    def get(state: Any, key: str) -> Any:
        return getattr(state, key) if model else state[key]

    def put(state: Any, key: str, value: Any) -> None:
        if model:
            setattr(state, key, value)
        else:
            state[key] = value

    class RenamingFlow(Flow[Tally] if model else Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            put(self.state, "n", 1)

        @listen(prepare)
        def rename(self) -> None:
            journal.record("enter", "rename")
            if rename:
                put(self.state, "id", f"renamed-{get(self.state, 'id')}")
            put(self.state, "n", get(self.state, "n") + 1)

        @listen(rename)
        def finish(self) -> None:
            journal.record("enter", "finish")
            put(self.state, "n", get(self.state, "n") + 10)

    return persist(RemitFlowPersistence(url))(RenamingFlow)


@pytest.mark.parametrize("model", [False, True], ids=["dict", "model"])
def test_a_step_that_changes_the_flows_id_is_refused_before_anything_saves_it(
    url: str, world: Path, model: bool
) -> None:
    """P4, P3: a step that sets the state's `id` to another (dict or model state) fails with
    `CheckpointInvalid` naming `id` and the flow, before its save: nothing is stored under
    the other id, the flow keeps its checkpoints, and it is given back at once (a restart
    right after needs no lease to run out; with a step that keeps the id it finishes,
    running only what had not completed). Before, CrewAI saved the rest of the run under
    the new id, a second flow made silently from the first's past, while the first stayed
    unfinished and claimed; its restart ran the renaming step again into the other id,
    whose claim the first run still held."""
    flow_id = f"rename-{uuid.uuid4().hex}"
    persistence = RemitFlowPersistence(url)

    def first() -> dict[str, Any]:
        flow_class = renaming_flow(url, world, model=model, rename=True)
        return _error(lambda: kickoff(flow_class, inputs={"id": flow_id}))

    refused = run(first)
    assert refused.ok, refused.summary()
    assert refused.value == {"class": "CheckpointInvalid", "field": "id", "run_id": flow_id}
    assert persistence.load_state(f"renamed-{flow_id}") is None
    assert [c.method for c in persistence.checkpoints(flow_id)] == ["prepare"]
    again = run(
        lambda: kickoff(
            renaming_flow(url, world, model=model, rename=False), inputs={"id": flow_id}
        )
    )
    assert again.ok, again.summary()
    assert again.value["state"] == {"id": flow_id, "n": 12}
    assert entered(world) == {"prepare": 1, "rename": 2, "finish": 1}


def renaming_review_flow(url: str, world: Path, *, rename: bool) -> type[Any]:
    """prepare -> review (human feedback: pauses; sets the state's id to another first if
    `rename`) -> approve; a dict state; journalled; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))

    @persist(RemitFlowPersistence(url))
    class RenamingReviewFlow(Flow[dict[str, Any]]):
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")

        @listen(prepare)
        @human_feedback(message="Ship it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            if rename:
                self.state["id"] = f"renamed-{self.state['id']}"
            return "parcel"

        @listen(review)
        def approve(self) -> None:
            journal.record("enter", "approve")

    return RenamingReviewFlow


def test_a_feedback_method_that_changes_the_flows_id_is_refused_before_its_pause_is_saved(
    url: str, world: Path
) -> None:
    """P4, P5: a `@human_feedback` method that sets the state's `id` to another before it
    pauses: the pause is refused with `CheckpointInvalid` naming `id` and the flow, nothing
    is stored under the other id (no pause to resume there), and the flow is given back at
    once: a restart right after pauses it under its own id. Before, the pause was saved
    under the other id, a second flow made silently from the first's past, which
    `from_pending` would resume, while the first stayed unfinished."""
    flow_id = f"rename-{uuid.uuid4().hex}"
    persistence = RemitFlowPersistence(url)

    def first() -> dict[str, Any]:
        flow_class = renaming_review_flow(url, world, rename=True)
        return _error(lambda: kickoff(flow_class, inputs={"id": flow_id}))

    refused = run(first)
    assert refused.ok, refused.summary()
    assert refused.value == {"class": "CheckpointInvalid", "field": "id", "run_id": flow_id}
    assert persistence.load_state(f"renamed-{flow_id}") is None
    assert persistence.load_pending_feedback(f"renamed-{flow_id}") is None
    again = run(
        lambda: kickoff(renaming_review_flow(url, world, rename=False), inputs={"id": flow_id})
    )
    assert again.ok and again.value["out"] == "HumanFeedbackPending", again.summary()
    assert again.value["id"] == flow_id
    assert entered(world) == {"prepare": 1, "review": 2}
