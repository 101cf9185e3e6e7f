"""Probes of round 23: a line's checkpoints beside a corrupt fork, a copied persistence,
and model states whose nested models would come back as other types.

Written from the contract (P4: a stored record that fails to verify raises an error
naming it, and is never returned as a wrong state; P6: a recovery ends where an
uninterrupted run ends) and from CrewAI's public API (`FlowPersistence` is a pydantic
model, so `model_copy` is one), against real CrewAI flows in forked children, with the
helpers of `test_crewai_flows`, on every engine.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field, ValidationError
from test_crewai_flows import child, entered, kickoff, run
from test_crewai_probes18 import tally_flow

from remit_core.errors import CorruptRecord
from remit_crewai import RemitFlowPersistence


def _corrupt(persistence: RemitFlowPersistence, run_id: str, checkpoint_id: str) -> None:
    """Flip the last byte of a stored checkpoint, below the core (its checksum fails)."""
    store: Any = persistence.remit.store
    if store.url.startswith("redis"):
        from remit_core.stores.redis import _join, run_prefix

        key, field = run_prefix(run_id) + "ck", _join(checkpoint_id, "")
        stored = store._client().hget(key, field)
        store._client().hset(key, field, stored[:-1] + bytes([stored[-1] ^ 0xFF]))
        return
    raw = store.get_checkpoint(run_id, "", checkpoint_id).state
    with store._txn() as txn:
        txn.execute(
            "UPDATE remit_checkpoints SET state = ? WHERE run_id = ? AND checkpoint_id = ?",
            (raw[:-1] + bytes([raw[-1] ^ 0xFF]), run_id, checkpoint_id),
        )


def test_the_checkpoints_of_a_line_are_listed_beside_a_corrupt_checkpoint_of_its_fork(
    url: str, tmp_path: Path
) -> None:
    """P4: `checkpoints(X)` walks X's line only. A checkpoint of a fork of X whose bytes
    were altered is the fork's error: `checkpoints(fork)` raises `CorruptRecord` naming
    it, while X's own line is still listed and X still restarts. Before, `checkpoints(X)`
    verified every checkpoint of the run, every branch's, and raised the fork's
    `CorruptRecord` for X: an operator could no longer list, nor pick a checkpoint to
    fork from, a flow whose own records were sound."""
    world = tmp_path / "world.db"
    flow_id = f"line-{uuid.uuid4().hex}"
    persistence = RemitFlowPersistence(url)
    done = run(lambda: kickoff(tally_flow(url, world), inputs={"id": flow_id})["state"])
    assert done.ok and done.value["n"] == 2, done.summary()
    line = persistence.checkpoints(flow_id)
    assert [c.method for c in line] == ["finish", "prepare"]

    forked = persistence.fork(flow_id, fork_token="again", checkpoint_id=line[-1].checkpoint_id)
    ran = run(lambda: kickoff(tally_flow(url, world), inputs={"id": forked})["state"])
    assert ran.ok and ran.value["n"] == 2, ran.summary()
    fork_head = persistence.checkpoints(forked)[0]
    assert fork_head.checkpoint_id not in {c.checkpoint_id for c in line}
    _corrupt(persistence, flow_id, fork_head.checkpoint_id)

    assert persistence.checkpoints(flow_id) == line
    with pytest.raises(CorruptRecord) as refused:
        persistence.checkpoints(forked)
    assert (refused.value.run_id, refused.value.checkpoint_id) == (
        flow_id,
        fork_head.checkpoint_id,
    )
    again = run(lambda: kickoff(tally_flow(url, world), inputs={"id": flow_id})["state"])
    assert again.ok and again.value["n"] == 2, again.summary()
    assert entered(world) == {"prepare": 1, "finish": 2}  # the fork ran finish once more


def test_a_copy_of_a_persistence_given_another_url_writes_to_that_store(
    url: str, tmp_path: Path
) -> None:
    """`FlowPersistence` is a pydantic model; `model_copy(update={"url": other})` is how a
    user makes the same persistence for another store. Before, the copy reported the new
    `url` but wrote to, and read from, the original's store (pinned when it was made):
    a flow meant for one database was saved in another. Now the copy reaches its own
    store, a copy without a new url keeps the original's, and an update is checked as
    a new persistence's settings are (pydantic's copy checks nothing)."""
    original = RemitFlowPersistence(url, workflow_version="v1")
    other_url = f"sqlite:///{tmp_path}/other-{uuid.uuid4().hex[:8]}.db"
    copy = original.model_copy(update={"url": other_url})
    assert copy.url == other_url and copy.workflow_version == "v1"

    flow_id = f"copied-{uuid.uuid4().hex}"
    copy.save_state(flow_id, "prepare", {"id": flow_id, "n": 1})
    assert RemitFlowPersistence(other_url).load_state(flow_id) == {"id": flow_id, "n": 1}
    assert original.load_state(flow_id) is None

    same_store = original.model_copy(update={"workflow_version": "v1"})
    same_store.save_state(flow_id, "prepare", {"id": flow_id, "n": 2})
    assert original.load_state(flow_id) == {"id": flow_id, "n": 2}

    with pytest.raises(ValidationError, match="lease"):
        original.model_copy(update={"lease": -1.0})
    with pytest.raises(ValidationError, match="url"):
        original.model_copy(update={"url": "mysql://nowhere/db"})


class Cat(BaseModel):
    name: str = ""


class Dog(BaseModel):
    name: str = ""


class Animal(BaseModel):
    name: str = ""


class Puppy(Animal):
    toy: str = "ball"


class TaggedCat(BaseModel):
    kind: Literal["cat"] = "cat"
    name: str = ""


class TaggedDog(BaseModel):
    kind: Literal["dog"] = "dog"
    name: str = ""


class Pets(BaseModel):
    count: int = 0
    pet: Cat | Dog | None = None
    pets: list[Cat | Dog] = []
    anything: Any = None
    animal: Animal | None = None
    tagged: TaggedCat | TaggedDog | None = Field(default=None, discriminator="kind")


#: Field, value a step sets it to, the path the refusal names, and the type the model
#: would read it back as.
RETYPED: dict[str, tuple[str, Any, str, str]] = {
    "a union of models the data cannot tell apart": ("pet", Dog(name="rex"), "pet", "Cat"),
    "such a union in a list": ("pets", [Cat(), Dog(name="fido")], "pets[1]", "Cat"),
    "a model in an Any field": ("anything", Dog(name="any"), "anything", "dict"),
    "a subclass in a field of its base class": ("animal", Puppy(name="pup"), "animal", "Animal"),
}


def pets_flow(url: str, world: Path, field: str, value: Any) -> type[Any]:
    """count (a plain save) -> adopt (sets `field` to `value`), journalled; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_core.conformance.world import Journal, WorldDB

    journal = Journal(WorldDB(world))

    @persist(RemitFlowPersistence(url))
    class PetsFlow(Flow[Pets]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def count(self) -> None:
            journal.record("enter", "count")
            self.state.count = 1

        @listen(count)
        def adopt(self) -> None:
            journal.record("enter", "adopt")
            setattr(self.state, field, value)

    return PetsFlow


@pytest.mark.parametrize("case", sorted(RETYPED))
def test_a_nested_model_that_would_come_back_as_another_type_is_refused(
    url: str, tmp_path: Path, case: str
) -> None:
    """P4, P6: Remit stores a model state's values, not their types (reading imports no
    names), and CrewAI restores a state with its model's `model_validate`. A field that
    takes several models whose data it cannot tell apart (a union without a
    discriminator, `Any`, a base class given a subclass) reads a stored `Dog` back as a
    `Cat`, a dict, or the base class with the subclass's fields lost. Before, such a
    save was stored, and the flow restarted with another state than the one it saved
    (a step testing `isinstance` would take another path than an uninterrupted run).
    Now the save raises `CheckpointInvalid` naming the field and the type it would come
    back as; nothing of the step is written and the head stays where it was."""
    world = tmp_path / "world.db"
    field, value, path, back = RETYPED[case]
    flow_id = f"pets-{uuid.uuid4().hex}"
    out = run(lambda: kickoff(pets_flow(url, world, field, value), inputs={"id": flow_id}))
    assert out.raised("CheckpointInvalid"), out.summary()
    text = out.error_text()
    assert f"state field {path} holds a " in text and f"field={path!r}" in text, text
    assert re.search(rf"reads back as a ([\w.]+\.)?{back}:", text), text
    persistence = RemitFlowPersistence(url)
    assert [c.method for c in persistence.checkpoints(flow_id)] == ["count"]
    assert persistence.load_state(flow_id)[field] in (None, [])


def test_models_the_data_tells_apart_come_back_as_themselves_after_a_restart(
    url: str, tmp_path: Path
) -> None:
    """P6, the control: a union with a `Literal` discriminator, and each model declared
    as itself, are stored; a restart of the finished flow reads them back as the types
    the run had, and runs nothing again."""
    world = tmp_path / "world.db"
    flow_id = f"tagged-{uuid.uuid4().hex}"
    value = [TaggedDog(name="rex")]

    def types_after(kick: Any) -> dict[str, Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist

        from remit_core.conformance.world import Journal, WorldDB

        journal = Journal(WorldDB(world))

        @persist(RemitFlowPersistence(url))
        class TaggedFlow(Flow[Pets]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def count(self) -> None:
                journal.record("enter", "count")
                self.state.count += 1

            @listen(count)
            def adopt(self) -> None:
                journal.record("enter", "adopt")
                self.state.tagged = value[0]
                self.state.pet = Cat(name="tom")
                self.state.animal = Animal(name="generic")

        flow = TaggedFlow(suppress_flow_events=True)
        kick(flow)
        state = flow.state
        return {
            "count": state.count,
            "types": [type(v).__name__ for v in (state.tagged, state.pet, state.animal)],
        }

    first = run(lambda: types_after(lambda f: f.kickoff(inputs={"id": flow_id})))
    assert first.ok, first.summary()
    assert first.value == {"count": 1, "types": ["TaggedDog", "Cat", "Animal"]}
    again = child(lambda: types_after(lambda f: f.kickoff(inputs={"id": flow_id}))).wait(120)
    assert again.ok and again.value == first.value, again.summary()
    assert entered(world) == {"count": 1, "adopt": 1}
