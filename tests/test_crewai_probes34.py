"""Probes of round 34: a `from_pending` claim beside a refused kickoff of the same flow in
the same context, CrewAI's streaming and `akickoff` entry points, and forks of forks,
through CrewAI's public API.

Written from the contract (P5 and L1: a `from_pending` holds the paused flow until it
resumes or its lease ends, and a concurrent resumer, in this process or another, gets
`ResumeConflict`; a refused call runs nothing and gives back nothing it did not take.
P1, P2: a restart by any entry point runs nothing that completed, and effects apply
once. P3: a fork of a fork is one more branch, the same token gives the same branch)
against real CrewAI flows in forked children, with the helpers of `test_crewai_flows`,
on every engine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from test_crewai_flows import applied, child, entered, paused_review, review_flow, run

from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_core.effects import effect
from remit_crewai import RemitFlowPersistence, fork_token


def _wait_for(path: Path) -> None:
    """Block until `path` exists (another process's signal that it got there)."""
    for _ in range(6000):
        if path.exists():
            return
        time.sleep(0.02)
    raise AssertionError(f"{path} never appeared")


def _refusal_of(call: Any) -> str | None:
    """The class name of what `call()` raised, or None if it returned."""
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return None


@pytest.mark.parametrize("entry", ["sync", "async"])
def test_a_kickoff_refused_beside_a_held_from_pending_leaves_it_the_claim(
    url: str, world: Path, tmp_path: Path, entry: str
) -> None:
    """P5, L1: a process holds a paused flow by `from_pending` and, in the same context,
    kicks the flow off again by id (a retry, a second handler of one request): that
    kickoff is refused with `ResumeConflict` and must give back nothing, since it took
    nothing. Another process's resumer is still refused, and the `from_pending` holder's
    feedback is the one the flow continues with (it used to be released by the refused
    kickoff, so the other process took the pause and the holder's resume was refused)."""
    flow_id = paused_review(url, world)
    refused, answered = tmp_path / "refused", tmp_path / "answered"

    def holder() -> dict[str, Any]:
        flow_class = review_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        held = flow_class.from_pending(flow_id, store)
        if entry == "sync":
            again = _refusal_of(
                lambda: flow_class(suppress_flow_events=True).kickoff(inputs={"id": flow_id})
            )
        else:
            again = _refusal_of(
                lambda: asyncio.run(
                    flow_class(suppress_flow_events=True).kickoff_async(inputs={"id": flow_id})
                )
            )
        refused.touch()
        _wait_for(answered)
        if entry == "sync":
            held.resume("alice")
        else:
            asyncio.run(held.resume_async("alice"))
        return {"again": again, "state": held.state.model_dump()}

    holding = child(holder)
    _wait_for(refused)

    def other() -> Any:
        flow_class = review_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        flow = flow_class.from_pending(flow_id, store)
        flow.resume("bob")
        return flow.state.model_dump()

    rival = run(other)
    answered.touch()
    held = holding.wait(timeout=120)
    assert rival.raised("ResumeConflict"), rival.summary()
    assert held.ok, held.summary()
    assert held.value["again"] == "ResumeConflict"
    assert held.value["state"]["approved_by"] == "alice"
    assert entered(world) == {"prepare": 1, "approve": 1, "ship": 1}
    assert applied(world) == {"ship": 1}
    assert RemitFlowPersistence(url).load_pending_feedback(flow_id) is None


def order_flow(url: str, world: Path):  # type: ignore[no-untyped-def]
    """prepare -> review (pauses for feedback) -> charge (effect); a model state; built
    in a child."""
    from crewai.flow.async_feedback.types import HumanFeedbackPending
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    journal, sink = Journal(WorldDB(world)), EffectSink(WorldDB(world))

    class Later:
        def request_feedback(self, context: Any, flow: Any) -> str:
            raise HumanFeedbackPending(context=context)

    @effect(reconcile=sink.reconcile)
    def charge_card(*, idempotency_key: str) -> str:
        return sink.apply("charge", idempotency_key)

    class Order(BaseModel):
        amount: int = Field(default=0, ge=0)
        approved_by: str | None = None
        receipt: str | None = None

    @persist(RemitFlowPersistence(url))
    class StreamedOrder(Flow[Order]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.amount += 10

        @listen(prepare)
        @human_feedback(message="Charge it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "order"

        @listen(review)
        def charge(self) -> str:
            journal.record("enter", "charge")
            assert self.last_human_feedback is not None
            self.state.approved_by = self.last_human_feedback.feedback
            self.state.receipt = charge_card()
            return "charged"

    return StreamedOrder


def test_streaming_and_akickoff_entry_points_keep_the_contract(url: str, world: Path) -> None:
    """P1, P2, P3, P5 through the entry points no earlier probe drove: a flow started by
    `stream_events` pauses and saves its pause; `resume_async` consumes it once; a
    restart by `akickoff` and one by `stream_events` run nothing and apply nothing; a
    fork streamed under a token is one branch, the same one when streamed again, and
    applies nothing its shared prefix applied."""

    def body() -> dict[str, Any]:
        flow_class = order_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        streamed = flow_class(suppress_flow_events=True)
        frames = streamed.stream_events()
        list(frames)
        flow_id = streamed.flow_id
        pending = store.load_pending_feedback(flow_id) is not None
        resumed = flow_class.from_pending(flow_id, store)
        asyncio.run(resumed.resume_async("alice"))
        twice = _refusal_of(lambda: flow_class.from_pending(flow_id, store))
        again = flow_class(suppress_flow_events=True)
        out = asyncio.run(again.akickoff(inputs={"id": flow_id}))
        restreamed = flow_class(suppress_flow_events=True)
        list(restreamed.stream_events(inputs={"id": flow_id}))
        forks = []
        for _ in range(2):
            with fork_token("streamed"):
                forked = flow_class(suppress_flow_events=True)
                list(forked.stream_events(restore_from_state_id=flow_id))
            forks.append({"id": forked.flow_id, "state": forked.state.model_dump()})
        return {
            "id": flow_id,
            "pending": pending,
            "twice": twice,
            "out": out,
            "again": again.state.model_dump(),
            "restreamed": restreamed.state.model_dump(),
            "forks": forks,
        }

    done = run(body)
    assert done.ok, done.summary()
    got = done.value
    assert got["pending"] is True
    assert got["twice"] == "ResumeConflict"
    assert got["out"] == "charged"
    for state in (got["again"], got["restreamed"]):
        assert state["approved_by"] == "alice" and state["amount"] == 10, state
    first, second = got["forks"]
    assert first["id"] == second["id"] and first["id"].startswith(got["id"] + "@fork-")
    assert first["state"]["amount"] == 10 and first["state"]["receipt"] is not None
    assert entered(world) == {"prepare": 1, "review": 1, "charge": 1}
    assert applied(world) == {"charge": 1}
    saved = RemitFlowPersistence(url).load_state(got["id"])
    assert saved is not None and saved["amount"] == 10


def test_a_fork_of_a_fork_is_one_more_branch_and_its_token_gives_it_again(
    url: str, world: Path
) -> None:
    """P3, P2: `kickoff(restore_from_state_id=F)` of a fork F under a second token makes
    one new branch from F's head (the source and F keep theirs), the same branch when
    presented again; the first token presented from F gives F itself; no effect of the
    shared prefix applies again."""

    def body() -> dict[str, Any]:
        flow_class = order_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        source = flow_class(suppress_flow_events=True)
        source.kickoff()
        flow_id = source.flow_id
        flow_class.from_pending(flow_id, store).resume("alice")
        made: dict[str, Any] = {}
        for name, token, of in (
            ("first", "one", flow_id),
            ("second", "two", None),
            ("again", "two", None),
            ("back", "one", None),
        ):
            with fork_token(token):
                forked = flow_class(suppress_flow_events=True)
                forked.kickoff(
                    inputs={"amount": 50} if name == "first" else None,
                    restore_from_state_id=of or made["first"]["id"],
                )
            made[name] = {"id": forked.flow_id, "state": forked.state.model_dump()}
        return {
            "id": flow_id,
            "made": made,
            "heads": {
                name: (store.load_state(entry["id"]) or {}).get("amount")
                for name, entry in made.items()
            }
            | {"source": (store.load_state(flow_id) or {}).get("amount")},
        }

    done = run(body)
    assert done.ok, done.summary()
    got, made = done.value, done.value["made"]
    assert made["first"]["id"].startswith(got["id"] + "@fork-")
    assert made["second"]["id"].startswith(got["id"] + "@fork-")
    assert made["second"]["id"] != made["first"]["id"]
    assert made["again"]["id"] == made["second"]["id"]
    assert made["back"]["id"] == made["first"]["id"]
    assert made["second"]["state"]["amount"] == 50  # from the first fork's head
    assert got["heads"] == {"source": 10, "first": 50, "second": 50, "again": 50, "back": 50}
    assert entered(world) == {"prepare": 1, "review": 1, "charge": 1}
    assert applied(world) == {"charge": 1}


def counting_flows(url: str):  # type: ignore[no-untyped-def]
    """Two one-step flows, one with a model state (`amount >= 0`) and one with a dict
    state checked by `state_schema` (the same rule); built in a child."""
    from crewai.flow.flow import Flow, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    class Tally(BaseModel):
        amount: int = Field(default=0, ge=0)

    @persist(RemitFlowPersistence(url))
    class ModelTally(Flow[Tally]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def count(self) -> None:
            self.state.amount += 1

    schema = {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 0}}}

    @persist(RemitFlowPersistence(url, state_schema=schema))
    class DictTally(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True
        initial_state = {"amount": 0}

        @start()
        def count(self) -> None:
            self.state["amount"] += 1

    return {"model": ModelTally, "dict": DictTally}


@pytest.mark.parametrize("kind", ["model", "dict"])
def test_a_fork_refused_for_its_inputs_makes_no_branch_and_spends_no_token(
    url: str, kind: str
) -> None:
    """P3, P4: `kickoff(inputs=..., restore_from_state_id=S)` under a token, with an input
    the state refuses, raises `CheckpointInvalid` naming the field before the fork is
    made: no branch exists afterwards, so the token is still free, and a retry after S
    moved on forks from S's new head (the refused fork used to leave its branch at S's
    old head, and the retry silently continued from there)."""

    def body() -> dict[str, Any]:
        flow_class = counting_flows(url)[kind]
        store = flow_class.__flow_persistence_config__.persistence
        source = flow_class(suppress_flow_events=True)
        source.kickoff()
        flow_id = source.flow_id
        with fork_token("retry"):
            refused = flow_class(suppress_flow_events=True)
            try:
                refused.kickoff(inputs={"amount": -3}, restore_from_state_id=flow_id)
                refusal: dict[str, Any] | None = None
            except Exception as exc:
                refusal = {"class": type(exc).__name__, "field": getattr(exc, "field", None)}
        branch = store.remit.fork_branch(flow_id, "retry")
        moved = flow_class(suppress_flow_events=True)
        moved.kickoff(inputs={"id": flow_id, "amount": 7})
        with fork_token("retry"):
            forked = flow_class(suppress_flow_events=True)
            forked.kickoff(inputs={"amount": 8}, restore_from_state_id=flow_id)
        state = forked.state
        return {
            "refusal": refusal,
            "branch": None if branch is None else branch.branch,
            "source": (store.load_state(flow_id) or {}).get("amount"),
            "forked": state["amount"] if isinstance(state, dict) else state.amount,
            "fork_head": (store.load_state(forked.flow_id) or {}).get("amount"),
            "bases": [c.state.get("amount") for c in store.checkpoints(forked.flow_id)],
        }

    done = run(body)
    assert done.ok, done.summary()
    got = done.value
    assert got["refusal"] == {"class": "CheckpointInvalid", "field": "amount"}
    assert got["branch"] is None
    assert got["source"] == 7
    assert got["forked"] == 8 and got["fork_head"] == 8
    assert got["bases"][:2] == [8, 7], got["bases"]  # the fork's line starts at the moved head
