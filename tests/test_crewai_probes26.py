"""Probes of round 26: a flow instance kicked off again after a failed step, declared
flows that share a store, and a fork's inputs.

Written from the contract (P1: a restart continues strictly after the head, and no step
of the head's frontier is skipped; P3: a fork happens only by intent, once per token;
P4: a flow is continued only by the flow that wrote it) and from CrewAI's public API (an
`or_` listener fires once per run, `max_method_calls` bounds the calls of one method in
one execution, `Flow.from_declaration` builds a flow from a declaration), against real
CrewAI flows in forked children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from crewai_parts import sink_effect
from test_crewai_flows import applied, entered, run

from remit_crewai import RemitFlowPersistence


def or_flow(url: str, world: Path, fail_once: Path) -> type[Any]:
    """begin -> a -> side (an `or_` listener of a and of a route never taken; it raises
    the first time, as a flaky call would) -> after; a model state; built in a child."""
    from crewai.flow.flow import Flow, listen, or_, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    from remit_core.conformance.world import EffectSink, Journal, WorldDB

    journal = Journal(WorldDB(world))
    ship = sink_effect(EffectSink(WorldDB(world)), "ship")

    class Trail(BaseModel):
        log: list[str] = []

    @persist(RemitFlowPersistence(url, lease=1.0))
    class OrFlow(Flow[Trail]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def begin(self) -> None:
            journal.record("enter", "begin")
            self.state.log.append("begin")

        @listen(begin)
        def a(self) -> None:
            journal.record("enter", "a")
            self.state.log.append("a")

        @listen(or_(a, "never"))
        def side(self) -> None:
            journal.record("enter", "side")
            ship()
            if not fail_once.exists():
                fail_once.touch()
                raise RuntimeError("a flaky call failed")
            self.state.log.append("side")

        @listen(side)
        def after(self) -> None:
            journal.record("enter", "after")
            self.state.log.append("after")

    return OrFlow


def test_an_or_listener_that_failed_runs_when_its_instance_is_kicked_off_again(
    url: str, world: Path
) -> None:
    """P1: an `or_` listener raises; the flow is kicked off again on the same instance
    (a retry, which continues the flow). The retry must run the listener that failed and
    what follows it. Before, the instance still counted the `or_` listener as fired in
    its failed run: the retry replayed `begin` and `a`, never ran `side` or `after`, and
    ended as if it had finished."""

    def retry() -> dict[str, Any]:
        flow = or_flow(url, world, world.parent / "failed-once")(suppress_flow_events=True)
        try:
            flow.kickoff(inputs={"id": f"or-{uuid.uuid4().hex}"})
            first = "ok"
        except Exception as exc:
            first = type(exc).__name__
        flow.kickoff()
        return {"first": first, "state": flow.state.model_dump()}

    out = run(retry)
    assert out.ok, out.summary()
    assert out.value["first"] == "RuntimeError"
    assert out.value["state"]["log"] == ["begin", "a", "side", "after"], out.value
    assert entered(world) == {"begin": 1, "a": 1, "side": 2, "after": 1}
    assert applied(world) == {"ship": 1}


def test_a_loop_retried_on_its_instance_keeps_its_method_call_budget(url: str, world: Path) -> None:
    """A router loop bounded by CrewAI's `max_method_calls` (4: the uninterrupted run
    calls `check` 4 times, `rework` 3 times) fails in its second round and is kicked off
    again on the same instance. The retry is one execution, as on a new instance: it
    finishes. Before, the calls of the failed run still counted, and the retry failed
    with CrewAI's `RecursionError` ("called 4 times ... an infinite loop")."""
    from test_crewai_probes21 import loop_flow

    def retry() -> dict[str, Any]:
        flow_class = loop_flow(url, world, fail_once=world.parent / "failed-once")
        flow = flow_class(suppress_flow_events=True, max_method_calls=4)
        try:
            flow.kickoff()
            first = "ok"
        except Exception as exc:
            first = type(exc).__name__
        flow.kickoff()
        return {"first": first, "state": flow.state.model_dump()}

    out = run(retry)
    assert out.ok, out.summary()
    assert out.value["first"] == "RuntimeError"
    state = out.value["state"]
    assert state["rounds"] == 3 and state["done"] is True, state
    assert applied(world) == {"bill": 3}
    assert entered(world) == {"prepare": 1, "check": 4, "rework": 4, "finish": 1}


def declared(name: str, methods: dict[str, Any]) -> dict[str, Any]:
    """A declarative flow (CrewAI's `Flow.from_declaration`) of a dict state, persisted."""
    return {
        "name": name,
        "state": {"type": "dict", "default": {"n": 0}},
        "persist": {"enabled": True},
        "methods": methods,
    }


ORDERS = declared(
    "Orders",
    {
        "seed": {"start": True, "do": {"call": "expression", "expr": "1"}},
        "ship": {"listen": "seed", "do": {"call": "expression", "expr": "2"}},
    },
)
REFUNDS = declared(
    "Refunds",
    {
        "seed": {"start": True, "do": {"call": "expression", "expr": "10"}},
        "refund": {"listen": "seed", "do": {"call": "expression", "expr": "20"}},
    },
)


def test_a_declared_flow_continued_by_another_declared_flow_is_refused_naming_both(
    url: str,
) -> None:
    """P1, P4: every declarative flow is an instance of CrewAI's own `Flow` class, so the
    flow class a checkpoint records told two declared flows apart no better than not at
    all: `Refunds` kicked off with the id of a finished `Orders` flow skipped its own
    `seed` (a method of `Orders` of that name completed), ran `refund` on the orders'
    state, and saved it into the orders' flow. Now a checkpoint records the declared
    flow's name too, and another declared flow is refused (`VersionMismatch` naming
    both) before anything runs or is written; the flow's own declaration continues it."""

    def body() -> dict[str, Any]:
        from crewai.flow.flow import Flow

        store = RemitFlowPersistence(url)
        flow_id = f"decl-{uuid.uuid4().hex}"
        orders = Flow.from_declaration(contents=ORDERS, persistence=store)
        orders.kickoff(inputs={"id": flow_id})
        before = [(c.method, c.kind) for c in store.checkpoints(flow_id)]
        refunds = Flow.from_declaration(contents=REFUNDS, persistence=store)
        try:
            refunds.kickoff(inputs={"id": flow_id})
            other = "ran"
        except Exception as exc:
            other = f"{type(exc).__name__}: {exc}"
        after = [(c.method, c.kind) for c in store.checkpoints(flow_id)]
        again = Flow.from_declaration(contents=ORDERS, persistence=store)
        return {
            "before": before,
            "other": other,
            "after": after,
            "again": again.kickoff(inputs={"id": flow_id}),
        }

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["other"].startswith("VersionMismatch"), out.value
    assert "Orders" in out.value["other"] and "Refunds" in out.value["other"], out.value
    assert out.value["after"] == out.value["before"] == [["ship", "step"], ["seed", "step"]]
    assert out.value["again"] == 2


def test_a_fork_leaves_the_callers_inputs_as_they_were(url: str) -> None:
    """P3: `kickoff(inputs=given, restore_from_state_id=S)` inside `fork_token("t1")`, then
    the same `given` for a fork under `fork_token("t2")`. Each fork gets the inputs the
    caller gave, and `given` is not changed. Before, the first fork wrote its own id into
    the caller's dict, and the second kickoff, now naming the first fork's id, was refused
    with `ForkWithoutIntent` although it ran inside a fork token."""

    def body() -> dict[str, Any]:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist

        @persist(RemitFlowPersistence(url))
        class Counted(Flow[dict[str, Any]]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def count(self) -> None:
                self.state["n"] = self.state.get("n", 0) + 1

        from remit_crewai import fork_token

        source = f"src-{uuid.uuid4().hex}"
        Counted(suppress_flow_events=True).kickoff(inputs={"id": source})
        given = {"topic": "x"}
        forks = []
        for token in ("t1", "t2"):
            with fork_token(token):
                flow = Counted(suppress_flow_events=True)
                flow.kickoff(inputs=given, restore_from_state_id=source)
            forks.append({"id": flow.flow_id, "state": dict(flow.state)})
        return {"source": source, "given": given, "forks": forks}

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["given"] == {"topic": "x"}
    first, second = out.value["forks"]
    assert first["id"] != second["id"]
    for fork in (first, second):
        assert fork["id"].startswith(out.value["source"] + "@fork-"), fork
        assert fork["state"]["topic"] == "x" and fork["state"]["n"] == 1, fork
