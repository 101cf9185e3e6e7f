"""Probes of round 38: numbers a step assigns to a model state's float and Decimal fields.

A step that assigns an int to a field declared `float` or `Decimal` (`self.state.total =
sum(prices)`, `self.state.share = 1`) without `validate_assignment` leaves the int in the
state; CrewAI's own backend stores it and its restore reads it back as the field's type,
the same number. Written from the contract (P4: every committed checkpoint satisfies the
state's declared schema, an invalid write is refused naming the field and nothing is
written; P1, P2: a restart continues after what completed, effects once) and from the
drop-in promise (the flow code does not change), against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from crewai_parts import Later, sink_effect
from pydantic import BaseModel, Field
from test_crewai_flows import applied, entered, run

from remit_core import CheckpointInvalid
from remit_core.conformance.world import EffectSink, Journal, WorldDB
from remit_crewai import RemitFlowPersistence


class Line(BaseModel):
    price: float = 0.0


class Tally(BaseModel):
    """A state whose numbers are declared float or Decimal."""

    id: str = ""
    total: float = 0.0
    share: float | None = None
    amount: Decimal = Decimal(0)
    rates: dict[str, float] = Field(default_factory=dict)
    lines: list[Line] = Field(default_factory=list)
    count: int = 0
    receipt: str | None = None


def tally_flow(url: str, world: Path) -> type[Any]:
    """prepare (assigns ints to float and Decimal fields, a nested one included) -> review
    (pauses for feedback) -> charge (effect; fails once after it, as a card network that
    answers late) -> ship; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))
    charge_card = sink_effect(EffectSink(WorldDB(world)), "charge")

    @persist(RemitFlowPersistence(url))
    class TallyFlow(Flow[Tally]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.total = sum([1, 2])
            self.state.share = 1
            self.state.amount = 3
            self.state.rates = {"vat": 0}
            self.state.lines = [Line(price=1.5)]
            self.state.lines[0].price = 2

        @listen(prepare)
        @human_feedback(message="Charge it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return f"total {self.state.total}"

        @listen(review)
        def charge(self) -> None:
            journal.record("enter", "charge")
            self.state.receipt = charge_card()
            if journal.entered()["charge"] == 1:
                raise RuntimeError("the card network answered late")

        @listen(charge)
        def ship(self) -> None:
            journal.record("enter", "ship")

    return TallyFlow


def _numbers(state: dict[str, Any]) -> dict[str, str]:
    """The numbers of a `Tally` state, each as its repr (`3` for an int, `3.0` a float)."""
    values = {
        "total": state["total"],
        "share": state["share"],
        "amount": state["amount"],
        "vat": state["rates"]["vat"],
        "price": state["lines"][0]["price"],
    }
    return {k: repr(v) for k, v in values.items()}


_AS_DECLARED = {
    "total": "3.0",
    "share": "1.0",
    "amount": repr(Decimal(3)),
    "vat": "0.0",
    "price": "2.0",
}


def test_ints_in_float_fields_are_stored_as_their_numbers_and_the_flow_restarts_once(
    url: str, world: Path
) -> None:
    """P4, P1, P2: ints a step assigns to float and Decimal fields (a nested model's
    included) are the same numbers the model declares: the step's save, the pause, the
    resume and a restart after a failed step all store them as the model reads them, and
    the flow finishes with each step entered once more at most and the effect once. They
    used to be refused ("does not survive storage"), failing the flow at its first step:
    a flow CrewAI's own backend runs, failed by Remit."""

    def first() -> dict[str, Any]:
        flow_class = tally_flow(url, world)
        paused = flow_class(suppress_flow_events=True).kickoff()
        flow_id = paused.context.flow_id
        store = RemitFlowPersistence(url)
        return {"id": flow_id, "saved": _numbers(store.load_state(flow_id) or {})}

    started = run(first)
    assert started.ok, started.summary()
    flow_id = started.value["id"]
    assert started.value["saved"] == _AS_DECLARED, started.value
    assert entered(world) == {"prepare": 1, "review": 1}

    def answer() -> str:
        flow_class = tally_flow(url, world)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        try:
            flow.resume("yes")
        except RuntimeError as exc:
            return str(exc)
        return "finished"

    resumed = run(answer)
    assert resumed.ok, resumed.summary()
    assert "answered late" in resumed.value, resumed.value
    assert applied(world) == {"charge": 1}

    def restart() -> dict[str, Any]:
        flow = tally_flow(url, world)(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        store = RemitFlowPersistence(url)
        return {
            "state": _numbers(flow.state.model_dump()),
            "saved": _numbers(store.load_state(flow_id) or {}),
            "receipt": flow.state.receipt is not None,
        }

    done = run(restart)
    assert done.ok, done.summary()
    assert done.value == {"state": _AS_DECLARED, "saved": _AS_DECLARED, "receipt": True}
    assert entered(world) == {"prepare": 1, "review": 1, "charge": 2, "ship": 1}
    assert applied(world) == {"charge": 1}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("total", 2**53 + 1),
        ("count", True),
        ("count", "3"),
        ("total", "3"),
    ],
    ids=["int-no-float-holds", "bool-in-int", "str-in-int", "str-in-float"],
)
def test_a_number_its_model_would_read_back_as_another_value_is_still_refused(
    url: str, field: str, value: Any
) -> None:
    """P4: only an int whose number the declared type holds exactly is stored as that
    type; an int no float equals (2**53 + 1 reads back as 2**53), a bool in an int field
    (its text changes), a str of digits in a number field are values the model would
    change on restart: refused with `CheckpointInvalid` naming the field, nothing
    written, and a good save of the same flow then goes through."""
    store = RemitFlowPersistence(url)
    flow_id = f"tally-{uuid.uuid4().hex}"
    state = Tally(id=flow_id)
    setattr(state, field, value)
    with pytest.raises(CheckpointInvalid) as refused:
        store.save_state(flow_uuid=flow_id, method_name="prepare", state_data=state)
    assert refused.value.field == field
    assert store.load_state(flow_id) is None
    assert store.checkpoints(flow_id) == []
    good = Tally(id=flow_id, total=4, count=2)
    store.save_state(flow_uuid=flow_id, method_name="prepare", state_data=good)
    saved = store.load_state(flow_id)
    assert saved is not None
    assert (saved["total"], type(saved["total"]), saved["count"]) == (4.0, float, 2)
