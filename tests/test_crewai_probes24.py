"""Probes of round 24: a persistence's settings assigned after it was made, a persistence
rebuilt from the JSON CrewAI makes of it in another working directory, an edit given
something other than a model as `state_type`, and a dict state holding a key that is
not a str.

Written from the contract (P4: every committed checkpoint satisfies the run's declared
state schema, an invalid write commits nothing and leaves the head where it was; P1: a
restart continues after the flow's head, which it must find) and from CrewAI's public
API (`FlowPersistence` is a pydantic model, which CrewAI serializes with a flow's
definition and rebuilds with `model_validate`), against real CrewAI flows in forked
children, with the helpers of `test_crewai_flows`, on every engine where the fault
concerns storage.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError
from test_crewai_flows import entered, run

from remit_core.conformance.world import Journal, WorldDB
from remit_core.errors import CheckpointInvalid
from remit_crewai import RemitFlowPersistence


def tally_flow(persistence: RemitFlowPersistence, world: Path) -> type[Any]:
    """prepare -> finish on a dict state, persisted by `persistence`; `key` in the state
    is the key `finish` adds (a str, or any other key a step may use); built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    journal = Journal(WorldDB(world))

    @persist(persistence)
    class TallyFlow(Flow[dict[str, Any]]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["n"] = self.state.get("n", 0) + 1

        @listen(prepare)
        def finish(self) -> None:
            journal.record("enter", "finish")
            self.state["n"] += 1
            if self.state.get("numbered"):
                self.state[7] = "a key that is not a str"

    return TallyFlow


def _kickoff(flow_class: type[Any], **kwargs: Any) -> dict[str, Any]:
    flow = flow_class(suppress_flow_events=True)
    flow.kickoff(**kwargs)
    return {"id": flow.flow_id, "state": dict(flow.state)}


def test_a_url_or_lease_assigned_after_the_persistence_was_made_is_checked_and_used(
    url: str, tmp_path: Path
) -> None:
    """`FlowPersistence` is a pydantic model, whose fields a user may assign. Before,
    `store.url = other` reported the new url while every save and read still went to the
    store pinned when the persistence was made (a flow meant for one database was saved
    in another), and `store.lease = -1` or `store.url = "mysql://..."` were taken as they
    were, to fail later, mid-run. Now an assignment is checked as the settings of a new
    persistence are (`ValidationError` naming it, the setting unchanged), and a flow
    kicked off after `url` was assigned is saved in, and continued from, that store."""
    world = tmp_path / "world.db"
    other_url = f"sqlite:///{tmp_path}/assigned-{uuid.uuid4().hex[:8]}.db"
    flow_id = f"assigned-{uuid.uuid4().hex}"

    def body() -> dict[str, Any]:
        persistence = RemitFlowPersistence(url)
        refused = []
        for name, value in (("lease", -1.0), ("url", "mysql://nowhere/db")):
            try:
                setattr(persistence, name, value)
            except ValidationError as exc:
                refused.append((name, exc.errors()[0]["loc"][0]))
        settings = (persistence.url, persistence.lease)
        persistence.url = other_url
        persistence.lease = 5.0
        flow_class = tally_flow(persistence, world)
        first = _kickoff(flow_class, inputs={"id": flow_id})
        again = _kickoff(flow_class, inputs={"id": flow_id})
        return {
            "refused": refused,
            "kept": settings == (url, 30.0),
            "first": first["state"]["n"],
            "again": again["state"]["n"],
            "in_other": RemitFlowPersistence(other_url).load_state(flow_id),
            "in_original": RemitFlowPersistence(url).load_state(flow_id),
        }

    done = run(body)
    assert done.ok, done.summary()
    assert done.value["refused"] == [["lease", "lease"], ["url", "url"]]
    assert done.value["kept"]
    assert done.value["first"] == done.value["again"] == 2
    assert done.value["in_other"] == {"id": flow_id, "n": 2}
    assert done.value["in_original"] is None
    assert entered(world) == {"prepare": 1, "finish": 1}  # the second kickoff ran nothing


def test_a_persistence_rebuilt_from_its_json_in_another_directory_reaches_the_same_file(
    tmp_path: Path,
) -> None:
    """CrewAI serializes a flow's persistence with its definition (`model_dump(mode=
    "json")`) and rebuilds it with `model_validate`. A relative SQLite path is resolved
    where the persistence is made; before, its JSON kept the path as it was given, so
    the persistence rebuilt by a process in another working directory reached another
    file: the flow saved by the first had no state there, and a restart ran it again
    from its start. Now the JSON holds the file the persistence reaches."""
    world, made_in, read_in = tmp_path / "world.db", tmp_path / "made", tmp_path / "read"
    made_in.mkdir()
    read_in.mkdir()
    flow_id = f"rebuilt-{uuid.uuid4().hex}"

    def make() -> dict[str, Any]:
        os.chdir(made_in)
        flow_class = tally_flow(RemitFlowPersistence("sqlite:///flows.db"), world)
        done = _kickoff(flow_class, inputs={"id": flow_id})
        definition = flow_class.flow_definition().model_dump(mode="json")
        return {"state": done["state"], "persistence": definition["persist"]["persistence"]}

    made = run(make)
    assert made.ok, made.summary()
    dumped = json.loads(json.dumps(made.value["persistence"]))

    def read() -> dict[str, Any]:
        from crewai.flow.runtime import _resolve_persistence

        os.chdir(read_in)
        rebuilt = _resolve_persistence(dumped)
        restarted = _kickoff(tally_flow(rebuilt, world), inputs={"id": flow_id})
        return {"loaded": rebuilt.load_state(flow_id), "restarted": restarted["state"]}

    done = run(read)
    assert done.ok, done.summary()
    assert done.value["loaded"] == made.value["state"] == {"id": flow_id, "n": 2}
    assert done.value["restarted"] == made.value["state"]
    assert entered(world) == {"prepare": 1, "finish": 1}
    assert not (read_in / "flows.db").exists()


class Order(BaseModel):
    amount: int = 0


def test_an_edit_given_something_else_than_a_model_as_state_type_is_refused_naming_it(
    url: str,
) -> None:
    """`edit_state(..., state_type=...)` takes the flow's state model. Before, a dict
    class, a model instance or a model's name given there raised a bare `AttributeError`
    or "unhashable type" from deep inside; now a `TypeError` says what `state_type` must
    be, and nothing is written."""
    persistence = RemitFlowPersistence(url)
    flow_id = f"typed-edit-{uuid.uuid4().hex}"
    persistence.save_state(flow_id, "prepare", Order(amount=1))
    head = persistence.checkpoints(flow_id)[0].checkpoint_id
    for wrong in (dict, Order(amount=3), "Order"):
        with pytest.raises(TypeError, match="state_type must be the flow's state model"):
            persistence.edit_state(flow_id, {"amount": 2}, state_type=wrong)  # type: ignore[arg-type]
    assert persistence.checkpoints(flow_id)[0].checkpoint_id == head
    persistence.edit_state(flow_id, {"amount": 2}, state_type=Order)
    assert persistence.load_state(flow_id) == {"id": flow_id, "amount": 2}


def test_a_dict_state_key_that_is_not_a_str_is_refused_and_the_flow_still_loads(
    url: str, tmp_path: Path
) -> None:
    """P4: a step of a dict-state flow that adds a key that is not a str (`state[7] = ...`)
    was saved, and that checkpoint could not be read back: every later `load_state`,
    `checkpoints` and restart of the flow raised `CorruptRecord`, the flow lost for
    good. Now the save is refused with `CheckpointInvalid` naming the key, nothing is
    written, the head stays the last good one, and a restart without the key finishes."""
    world = tmp_path / "world.db"
    flow_id = f"numbered-{uuid.uuid4().hex}"
    persistence = RemitFlowPersistence(url)

    def kickoff(numbered: bool) -> dict[str, Any]:
        flow_class = tally_flow(RemitFlowPersistence(url), world)
        return _kickoff(flow_class, inputs={"id": flow_id, "numbered": numbered})

    refused = run(lambda: kickoff(True))
    assert refused.raised("CheckpointInvalid"), refused.summary()
    assert "state key 7" in (refused.message_of("CheckpointInvalid") or "")
    saved = {"id": flow_id, "numbered": True, "n": 1}
    assert persistence.load_state(flow_id) == saved
    line = persistence.checkpoints(flow_id)
    assert [c.method for c in line] == ["prepare"]
    with pytest.raises(CheckpointInvalid, match="state key 7") as direct:
        persistence.save_state(flow_id, "finish", {**saved, 7: "x"})
    assert direct.value.field == "7"
    assert persistence.checkpoints(flow_id) == line

    done = run(lambda: kickoff(False))
    assert done.ok, done.summary()
    assert done.value["state"] == {"id": flow_id, "numbered": False, "n": 2}
    assert persistence.load_state(flow_id) == done.value["state"]
    assert entered(world) == {"prepare": 1, "finish": 2}
