"""Probes of round 39: a model state that allows extra fields (`extra="allow"`), whose
steps assign attributes the model does not declare.

Pydantic keeps such a value as an extra field, and CrewAI restores a state with its model's
`model_validate`, which reads an extra field as it reads an `Any` field: a model or
dataclass put there comes back as a dict, an Enum as its value. Written from the contract
(P4: a stored record is never read back as a wrong state; an invalid write is refused with
a typed error naming the field and nothing is committed; P1: a restart continues after
what completed) and from the README's promise for a model in an `Any` field, against real
CrewAI flows in forked children, with the helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field
from test_crewai_flows import entered, kickoff, run

from remit_core import CheckpointInvalid
from remit_core.conformance.world import Journal, WorldDB
from remit_crewai import RemitFlowPersistence


class Dog(BaseModel):
    name: str = ""


@dataclasses.dataclass
class Spot:
    x: int = 0


class Size(enum.Enum):
    BIG = "big"


class Box(BaseModel):
    """A nested model that allows extra fields too."""

    model_config = ConfigDict(extra="allow")
    n: int = 0


class Kennel(BaseModel):
    """A model state that keeps what a step assigns beyond its declared fields."""

    model_config = ConfigDict(extra="allow")
    id: str = ""
    count: int = 0
    box: Box = Field(default_factory=Box)


#: Extra values a `Kennel` reads back as another type: (assign, field named).
RETYPED: dict[str, tuple[Callable[[Kennel], None], str]] = {
    "model": (lambda s: setattr(s, "pet", Dog(name="rex")), "pet"),
    "models-in-a-list": (lambda s: setattr(s, "pets", [Dog(name="rex")]), "pets[0]"),
    "dataclass": (lambda s: setattr(s, "spot", Spot(1)), "spot"),
    "model-in-a-dict": (lambda s: setattr(s, "yard", {"d": Dog()}), "yard.d"),
    "nested-models-extra": (lambda s: setattr(s.box, "pet", Dog()), "box.pet"),
    "enum": (lambda s: setattr(s, "size", Size.BIG), "size"),
}


@pytest.mark.parametrize("case", sorted(RETYPED))
def test_an_extra_field_its_model_would_read_back_as_another_type_is_refused(
    url: str, case: str
) -> None:
    """P4: a model, dataclass or Enum in an extra field is refused as it is in an `Any`
    field, with `CheckpointInvalid` naming the field; nothing is written, and a save of
    the same flow whose extra fields hold plain data then goes through and reads back as
    it was. Before, a model or dataclass there was stored as a dict, which the restart
    continued with (`self.state.pet.name` then fails), and an Enum there failed the save
    with the codec's bare `TypeError` naming no field."""
    assign, field = RETYPED[case]
    store = RemitFlowPersistence(url)
    flow_id = f"kennel-{uuid.uuid4().hex}"
    state = Kennel(id=flow_id)
    assign(state)
    with pytest.raises(CheckpointInvalid) as refused:
        store.save_state(flow_uuid=flow_id, method_name="adopt", state_data=state)
    assert refused.value.field == field, refused.value
    assert store.load_state(flow_id) is None
    assert store.checkpoints(flow_id) == []
    plain = Kennel(id=flow_id, count=1)
    plain.note = {"fed": (1, 2)}
    plain.box.tags = ["a"]
    store.save_state(flow_uuid=flow_id, method_name="adopt", state_data=plain)
    saved = store.load_state(flow_id)
    assert saved is not None
    assert (saved["note"], saved["box"]) == ({"fed": (1, 2)}, {"n": 0, "tags": ["a"]})
    assert Kennel.model_validate(saved) == plain


def kennel_flow(url: str, world: Path, *, pet_as_data: bool) -> type[Any]:
    """prepare (an extra field of plain data) -> adopt (a `Dog` in an extra field, or its
    data when `pet_as_data`) -> walk (reads the pet's name); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))

    @persist(RemitFlowPersistence(url))
    class KennelFlow(Flow[Kennel]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.count += 1
            self.state.note = "fed"

        @listen(prepare)
        def adopt(self) -> None:
            journal.record("enter", "adopt")
            dog = Dog(name="rex")
            self.state.pet = dog.model_dump() if pet_as_data else dog

        @listen(adopt)
        def walk(self) -> None:
            journal.record("enter", "walk")
            pet = self.state.pet
            self.state.walked = pet["name"] if pet_as_data else pet.name

    return KennelFlow


def test_a_step_that_puts_a_model_in_an_extra_field_fails_there_and_the_flow_restarts(
    url: str, world: Path
) -> None:
    """P4, P1: a step that assigns a model to a field its state model does not declare
    fails at its save (CrewAI's "State persistence failed", caused by `CheckpointInvalid`
    naming the field); the head stays at the step before, with its plain extra field,
    and a restart by id with a deployment that keeps the pet as data runs only the
    failed step and the rest. Before, the save was stored and the run went on: a restart
    would read the pet back as a dict."""
    flow_id = f"kennel-{uuid.uuid4().hex}"
    failed = run(
        lambda: kickoff(kennel_flow(url, world, pet_as_data=False), inputs={"id": flow_id})
    )
    assert failed.raised("CheckpointInvalid"), failed.summary()
    text = failed.error_text()
    assert "state field pet holds a " in text and "field='pet'" in text, text
    store = RemitFlowPersistence(url)
    assert [c.method for c in store.checkpoints(flow_id)] == ["prepare"]
    saved = store.load_state(flow_id)
    assert saved is not None and saved["note"] == "fed" and "pet" not in saved, saved
    assert entered(world) == {"prepare": 1, "adopt": 1}

    done = run(lambda: kickoff(kennel_flow(url, world, pet_as_data=True), inputs={"id": flow_id}))
    assert done.ok, done.summary()
    state = done.value["state"]
    assert (state["count"], state["note"], state["walked"]) == (1, "fed", "rex"), state
    assert entered(world) == {"prepare": 1, "adopt": 2, "walk": 1}
