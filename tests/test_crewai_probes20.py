"""Probes of round 20: a flow continued by a flow class other than the one that wrote it,
a fork token that reaches kickoffs nested in the forked flow's steps, and Decimal NaNs.

Written from the contract (P1, P2: nothing durably done is done again, and a step run
again continues what it started; P4: a reader refuses a record written by a workflow it
does not accept, with an error naming both; bad values get a typed error, never a bare
one) against real CrewAI flows in forked children, with the helpers of
`test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

from crewai_parts import Later
from test_crewai_flows import (
    applied,
    entered,
    kickoff,
    order_flow,
    paused_review,
    review_flow,
    run,
)

from remit_core.conformance.world import Journal, WorldDB
from remit_crewai import RemitFlowPersistence, fork_token
from remit_crewai._storable import same


def _name(cls: type[Any]) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def other_flow(url: str, world: Path, *, accepts: list[str] | None = None) -> type[Any]:
    """Another flow class with a model state of the same shape as `order_flow`'s and
    methods of the same names (`prepare`, `ship`); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel

    journal = Journal(WorldDB(world))

    class Refund(BaseModel):
        amount: int = 0
        note: str = ""
        receipt: str | None = None
        shipped: bool = False
        approved_by: str | None = None

    @persist(RemitFlowPersistence(url, accepts=accepts or []))
    class RefundFlow(Flow[Refund]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "other.prepare")

        @listen(prepare)
        @human_feedback(message="Refund it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "other.review")
            return "refund"

        @listen(review)
        def ship(self) -> None:
            journal.record("enter", "other.ship")
            self.state.shipped = False

    return RefundFlow


def _class_error(call: Any) -> dict[str, Any]:
    try:
        out = call()
    except Exception as exc:
        return {"class": type(exc).__name__, "message": str(exc), **getattr(exc, "ids", {})}
    return {"class": None, "out": out}


def test_a_flow_continued_by_another_flow_class_is_refused_naming_both(
    url: str, world: Path
) -> None:
    """P4, P1: a flow written by one flow class and continued by another (a restart by id,
    a fork of it, `from_pending` of its pause) raises `VersionMismatch` naming both
    classes before anything runs; nothing is written and the flow is given back at once
    (its own class continues it right away). Before, the other class restarted it and
    skipped its own methods that shared a name with the writer's (`prepare`), or
    answered the writer's pause with its own method of that name. A class listed in
    `accepts=` (a flow class renamed since) continues it."""
    done = run(lambda: kickoff(order_flow(url, world), inputs={"id": f"o-{uuid.uuid4().hex}"}))
    assert done.ok, done.summary()
    flow_id = done.value["id"]
    paused = paused_review(url, world)
    persistence = RemitFlowPersistence(url)
    before = {f: persistence.checkpoints(f) for f in (flow_id, paused)}

    def others() -> dict[str, Any]:
        cls = other_flow(url, world)
        out = {"restart": _class_error(lambda: kickoff(cls, inputs={"id": flow_id}))}

        def fork() -> Any:
            with fork_token("refund"):
                return kickoff(cls, restore_from_state_id=flow_id)

        out["fork"] = _class_error(fork)
        out["pending"] = _class_error(
            lambda: cls.from_pending(paused, RemitFlowPersistence(url)).resume("ann")
        )
        out["name"] = _name(cls)
        return out

    out = run(others)
    assert out.ok, out.summary()
    refused = out.value
    for how in ("restart", "fork", "pending"):
        assert refused[how]["class"] == "VersionMismatch", (how, refused[how])
        assert "OrderFlow" in refused[how]["message"] or "ReviewFlow" in refused[how]["message"]
        assert refused["name"] in refused[how]["message"], (how, refused[how])
    assert refused["restart"]["run_id"] == flow_id
    assert entered(world) == {"prepare": 2, "adjust": 1, "charge": 1, "ship": 1}
    assert {f: persistence.checkpoints(f) for f in (flow_id, paused)} == before

    def own() -> Any:
        again = kickoff(order_flow(url, world), inputs={"id": flow_id})
        cls = review_flow(url, world)
        flow = cls.from_pending(paused, RemitFlowPersistence(url))
        flow.resume("ann")
        return [again["state"], flow.state.approved_by]

    mine = run(own)
    assert mine.ok, mine.summary()
    assert mine.value[0]["shipped"] is True and mine.value[1] == "ann"
    assert applied(world) == {"charge": 1, "ship": 1}

    def as_main() -> Any:
        # The writer's class loaded under another module name (its file run as a script,
        # a recovery importing it): the same flow, continued.
        cls = order_flow(url, world)
        cls.__module__ = "__main__"
        return kickoff(cls, inputs={"id": flow_id})["state"]

    same_flow = run(as_main)
    assert same_flow.ok, same_flow.summary()

    def renamed() -> Any:
        writer = _name(order_flow(url, world))
        return kickoff(other_flow(url, world, accepts=[writer]), inputs={"id": flow_id})

    accepted = run(renamed)
    assert accepted.ok, accepted.summary()
    assert accepted.value["state"]["receipt"] == mine.value[0]["receipt"]


def limits_flow(url: str) -> type[Any]:
    """A flow whose model reads a field by its alias and keeps any value in `cap`, set by
    its one step from the kickoff's `raw` input; built in a child."""
    from crewai.flow.flow import Flow, start
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, ConfigDict, Field

    class Limits(BaseModel):
        model_config = ConfigDict(populate_by_name=True)
        raw: str = ""
        cap: Any = None
        owner: str = Field(default="", alias="ownerName")

    @persist(RemitFlowPersistence(url))
    class LimitsFlow(Flow[Limits]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def cap_it(self) -> None:
            self.state.cap = Decimal(self.state.raw)

    return LimitsFlow


NANS = ["NaN", "-NaN", "sNaN", "1.50"]


def test_a_decimal_nan_in_a_state_is_stored_as_it_is(url: str) -> None:
    """P4: a Decimal NaN (quiet, negative or signalling) in a model state is plain data the
    codec reads back as itself: it is saved and read back, types and sign included. Before,
    a model that reads a field by its alias made the save compare the state read back
    with the state written: a quiet NaN never compared equal (the save refused it as
    "does not survive storage"), a signalling one raised a bare `InvalidOperation`; the
    flow failed either way."""
    ids = {raw: f"cap-{uuid.uuid4().hex}" for raw in NANS}

    def body() -> dict[str, Any]:
        cls = limits_flow(url)
        return {
            raw: _class_error(lambda r=raw: kickoff(cls, inputs={"id": ids[r], "raw": r}))
            for raw in NANS
        }

    out = run(body)
    assert out.ok, out.summary()
    persistence = RemitFlowPersistence(url)
    for raw in NANS:
        assert out.value[raw]["class"] is None, (raw, out.value[raw])
        cap = persistence.load_state(ids[raw])["cap"]
        assert type(cap) is Decimal and str(cap) == raw, (raw, cap)


def test_same_tells_decimal_nans_apart_without_raising() -> None:
    """`same` is total over Decimals: a NaN is the same as a NaN of its kind and sign, and
    never as another value (a signalling NaN raises nothing)."""
    values = [Decimal(v) for v in ("NaN", "-NaN", "sNaN", "-sNaN", "NaN7", "1", "2")]
    for i, a in enumerate(values):
        for j, b in enumerate(values):
            assert same(a, Decimal(str(b))) is (i == j), (a, b)


def test_a_fork_token_does_not_reach_a_flow_kicked_off_inside_the_forks_step(
    url: str, world: Path
) -> None:
    """P1, P2, P3: a fork (`kickoff(restore_from_state_id=X)` under a fork token) whose step
    kicks off another Remit-backed flow without an id is SIGKILLed before that step
    completes; the same token continues the fork, whose step runs again: each inner flow
    is continued under the id it had, not run anew (each inner step ran once per place,
    each inner effect applied once). Before, the fork token reached the kickoffs nested
    in the fork's step, which then got a new id each time (as a fork names its run) and
    ran from their start again: the inner effects applied twice on the fork."""
    import signal
    import time

    from test_crewai_probes19 import nested_flow

    flow_id = f"outer-{uuid.uuid4().hex}"
    crashed = run(lambda: kickoff(nested_flow(url, world, kill=True), inputs={"id": flow_id}))
    assert (crashed.status, crashed.signal) == ("killed", signal.SIGKILL), crashed.summary()
    assert applied(world) == {"a": 1, "b": 2}
    time.sleep(1.5)  # the crashed process's lease runs out

    def fork(kill: bool) -> Any:
        with fork_token("again"):
            out = kickoff(nested_flow(url, world, kill=kill), restore_from_state_id=flow_id)
            # The token still holds in its block: the same kickoff again is the same fork.
            again = kickoff(nested_flow(url, world, kill=kill), restore_from_state_id=flow_id)
            assert again["id"] == out["id"], (out, again)
            return out

    forked = run(lambda: fork(True))
    assert (forked.status, forked.signal) == ("killed", signal.SIGKILL), forked.summary()
    assert applied(world) == {"a": 2, "b": 4}
    time.sleep(1.5)
    done = run(lambda: fork(False))
    assert done.ok, done.summary()
    assert done.value["id"] != flow_id
    assert applied(world) == {"a": 2, "b": 4, "c": 1}
    assert entered(world) == {"prepare": 1, "work": 3, "inner_step": 4, "done": 1}
