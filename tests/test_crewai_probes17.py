"""Probes of round 17: an operator's edit validated against the user's own state model,
and restarts whose inputs, or whose flow class, do not fit the state the flow saved.

Written from the contract (P4: an external update that fails the state's schema is
refused with `CheckpointInvalid` naming the field, a stored state is never read back
as a wrong one, and nothing is written either way; a valid edit is never refused and
loses nothing) and from what CrewAI does with a model state (it runs a model without
an `id` field as a subclass of its `FlowState`, restores a state with the model's
`model_validate` and merges a kickoff's inputs into it), against real CrewAI flows in
forked children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from test_crewai_flows import child, kickoff

from remit_crewai import RemitFlowPersistence

# -- an edit validated against the user's model ---------------------------------------


class Loose(BaseModel):
    """A state model with no `id` field (CrewAI adds it) that ignores unknown keys."""

    amount: int = Field(default=0, ge=0)
    note: str = ""


class Strict(BaseModel):
    """The same, forbidding unknown keys."""

    model_config = ConfigDict(extra="forbid")
    amount: int = Field(default=0, ge=0)
    note: str = ""


def edited_flow(url: str, model: type[BaseModel]) -> type[Any]:
    """prepare (amount 5) -> finish (appends to note); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    @persist(RemitFlowPersistence(url))
    class EditedFlow(Flow[model]):  # type: ignore[misc, valid-type]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            self.state.amount = 5

        @listen(prepare)
        def finish(self) -> None:
            self.state.note += "+done"

    return EditedFlow


def test_an_edit_validated_by_the_users_model_keeps_the_flow_id(url: str) -> None:
    """P4: `edit_state(X, changes, state_type=M)` with the model the flow was written
    with, which has no `id` field (CrewAI gives the flow's state one): the edit keeps
    the flow's id in the stored state, as every save of CrewAI's does, and a model that
    forbids extra fields is not refused for it. The flow restarts from the edit."""
    persistence = RemitFlowPersistence(url)
    for model in (Loose, Strict):
        flow_id = f"edit-{uuid.uuid4().hex}"

        def start(model: type[BaseModel] = model, flow_id: str = flow_id) -> dict[str, Any]:
            return kickoff(edited_flow(url, model), inputs={"id": flow_id})

        done = child(start).wait(120)
        assert done.ok, done.summary()
        persistence.edit_state(flow_id, {"amount": 9}, state_type=model)
        assert persistence.load_state(flow_id) == {"amount": 9, "note": "+done", "id": flow_id}
        assert persistence.checkpoints(flow_id)[0].state["id"] == flow_id
        again = child(start).wait(120)
        assert again.ok and again.value["state"] == {
            "amount": 9,
            "note": "+done",
            "id": flow_id,
        }, again.summary()


# -- restarts whose inputs or class do not fit ------------------------------------------


class Address(BaseModel):
    zip: str = Field(default="00000", pattern=r"^\d{5}$")


class Shipment(BaseModel):
    amount: int = 0
    address: Address = Address()


class Reshaped(BaseModel):
    """Another model: `address` is no longer a nested model."""

    amount: int = 0
    address: int = 0


class Narrowed(BaseModel):
    """Another model: it has no `address` (restoring would drop it)."""

    amount: int = 0


def shipment_flow(url: str, world: Any, model: type[BaseModel] = Shipment) -> type[Any]:
    """prepare (amount + 5) -> ship, journalled; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_core.conformance.world import Journal, WorldDB

    journal = Journal(WorldDB(world))

    @persist(RemitFlowPersistence(url))
    class ShipmentFlow(Flow[model]):  # type: ignore[misc, valid-type]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.amount += 5

        @listen(prepare)
        def ship(self) -> None:
            journal.record("enter", "ship")

    return ShipmentFlow


def _attempt(flow_class: type[Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """A kickoff's state, or the class, bases and fields of what it raised."""
    try:
        return {"state": kickoff(flow_class, inputs=inputs)["state"]}
    except Exception as exc:
        bases = [c.__name__ for c in type(exc).__mro__]
        field = getattr(exc, "ids", {}).get("field")
        return {"error": bases, "field": field, "message": str(exc)}


def test_restart_inputs_the_model_refuses_are_refused_naming_the_field(
    url: str, world: Any
) -> None:
    """P4: `kickoff(inputs={"id": X, ...})` whose inputs the state's model refuses (a
    nested model's field, a value of the wrong type), on a saved flow and on a new one:
    `CheckpointInvalid` naming the field (CrewAI alone raises a bare `ValueError`),
    no step runs, nothing is written, and the flow is free for a good restart in the
    same process at once. A new flow's kickoff without an id is refused the same way."""
    from test_crewai_flows import entered

    saved, new = f"ship-{uuid.uuid4().hex}", f"ship-{uuid.uuid4().hex}"

    def body() -> dict[str, Any]:
        flow_class = shipment_flow(url, world)
        out = {"first": _attempt(flow_class, {"id": saved})}
        out["nested"] = _attempt(flow_class, {"id": saved, "address": {"zip": "12"}})
        out["typed"] = _attempt(flow_class, {"id": saved, "address": 7})
        out["new"] = _attempt(flow_class, {"id": new, "address": {"zip": "x"}})
        out["unnamed"] = _attempt(flow_class, {"amount": "many"})
        out["good"] = _attempt(flow_class, {"id": saved, "address": {"zip": "12345"}})
        return out

    done = child(body).wait(120)
    assert done.ok, done.summary()
    out = done.value
    assert out["first"]["state"]["amount"] == 5
    refused = [("nested", "address.zip"), ("typed", "address"), ("new", "address.zip")]
    for name, field in [*refused, ("unnamed", "amount")]:
        assert "CheckpointInvalid" in out[name]["error"], out[name]
        assert out[name]["field"] == field, out[name]
    assert out["good"]["state"] == {"amount": 5, "address": {"zip": "12345"}, "id": saved}
    persistence = RemitFlowPersistence(url)
    assert persistence.load_state(new) is None
    assert [c.kind for c in persistence.checkpoints(saved)] == ["edit", "step", "step"]
    assert entered(world) == {"prepare": 1, "ship": 1}


def test_a_restart_by_a_class_whose_model_does_not_fit_the_saved_state_is_refused(
    url: str, world: Any
) -> None:
    """P4: a flow restarted by id with a flow class whose state model does not read the
    state the flow saved (renamed and reshaped since): `VersionMismatch` naming the model
    that saved it and the field, not a pydantic error from inside CrewAI; no step runs,
    nothing is written, and the class that saved it restarts the flow at once. A model
    that only lost a field (dropped on purpose) restarts it, as CrewAI's own restore
    does: its model ignores what it no longer declares."""
    from test_crewai_flows import entered

    flow_id = f"ship-{uuid.uuid4().hex}"

    def body() -> dict[str, Any]:
        out = {"first": _attempt(shipment_flow(url, world), {"id": flow_id})}
        out["other"] = _attempt(shipment_flow(url, world, Reshaped), {"id": flow_id})
        out["narrow"] = _attempt(shipment_flow(url, world, Narrowed), {"id": flow_id})
        out["again"] = _attempt(shipment_flow(url, world), {"id": flow_id})
        return out

    done = child(body).wait(120)
    assert done.ok, done.summary()
    out = done.value
    assert "VersionMismatch" in out["other"]["error"], out["other"]
    assert out["other"]["field"] == "address", out["other"]
    assert "test_crewai_probes17.Shipment" in out["other"]["message"], out["other"]
    assert "error" not in out["narrow"], out["narrow"]
    assert "address" not in out["narrow"]["state"], out["narrow"]
    assert "error" not in out["again"], out["again"]
    assert entered(world) == {"prepare": 1, "ship": 1}


class AmountOnly(BaseModel):
    """Another model than the flow's: it has no `note`."""

    amount: int = 0


def test_an_edit_validated_by_another_model_than_the_flows_loses_nothing(url: str) -> None:
    """P4, bad input loses nothing: `edit_state(X, changes, state_type=M)` with a model
    that lacks a field the flow's state holds (the wrong model passed by mistake) would
    drop that field from the stored state; it is refused with `CheckpointInvalid`
    naming the field, and nothing is written."""
    import pytest

    from remit_core import CheckpointInvalid

    flow_id = f"edit-{uuid.uuid4().hex}"
    done = child(lambda: kickoff(edited_flow(url, Loose), inputs={"id": flow_id})).wait(120)
    assert done.ok, done.summary()
    persistence = RemitFlowPersistence(url)
    before = persistence.checkpoints(flow_id)
    with pytest.raises(CheckpointInvalid, match="note") as refused:
        persistence.edit_state(flow_id, {"amount": 1}, state_type=AmountOnly)
    assert refused.value.field == "note"
    assert persistence.checkpoints(flow_id) == before
    assert persistence.load_state(flow_id) == {"amount": 5, "note": "+done", "id": flow_id}
