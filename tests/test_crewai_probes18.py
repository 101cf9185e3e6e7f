"""Probes of round 18: records in the store that were altered, read back by a restart.

Written from the contract (P4: a stored record that fails to decode or verify raises a
clear error naming the run and checkpoint; it is never returned as a wrong state) and
from what a restart does with a checkpoint's ledger (it replays the methods the ledger
says completed and runs the rest), against real CrewAI flows in forked children, with
the helpers of `test_crewai_flows`, on every engine. The altered records are sealed as
Remit seals every record, as a writer to the store could seal them: only their shape
tells them apart.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from test_crewai_flows import child, entered, kickoff

from remit_core import codec
from remit_core.errors import CorruptRecord
from remit_crewai import RemitFlowPersistence


def tally_flow(url: str, world: Path) -> type[Any]:
    """prepare (n = 1) -> finish (n + 1), a dict state, journalled; built in a child."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.persistence import persist

    from remit_core.conformance.world import Journal, WorldDB

    journal = Journal(WorldDB(world))

    @persist(RemitFlowPersistence(url))
    class TallyFlow(Flow[dict[str, Any]]):
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state["n"] = 1

        @listen(prepare)
        def finish(self) -> None:
            journal.record("enter", "finish")
            self.state["n"] += 1

    return TallyFlow


#: Checkpoint bodies of another shape than Remit writes, each as a change to a real one.
ALTERED: dict[str, dict[str, Any]] = {
    "a feedback entry that is a str": {"feedback": ["junk"]},
    "a feedback entry without its keys": {"feedback": [{}]},
    "a completed method that is not a str": {"completed": [1]},
    "a negative completion count": {"counts": {"prepare": -1, "finish": 1}},
    "a completion count that is a bool": {"counts": {"prepare": True, "finish": True}},
    "completions that do not match their counts": {"completed": ["prepare"]},
    "a state that is a list of pairs": {"state": [["id", "x"], ["n", 5]]},
    "a route list that is a str": {"routes": {"prepare": "abc"}},
    "an unknown kind": {"kind": "done"},
}


def _alter_head(persistence: RemitFlowPersistence, flow_id: str, change: dict[str, Any]) -> str:
    """Commit, after the flow's head, a copy of its body with `change`: the id of the
    altered checkpoint."""
    remit = persistence.remit
    head = remit.head(flow_id)
    assert head is not None
    raw = codec.loads(head.state)
    raw.update(change)
    checkpoint_id = f"{999:012d}-{uuid.uuid4().hex[:12]}"
    remit.commit(
        run_id=flow_id,
        checkpoint_id=checkpoint_id,
        parent_id=head.checkpoint_id,
        state=codec.dumps(raw),
        metadata=dict(head.metadata),
    )
    return checkpoint_id


def test_a_checkpoint_whose_ledger_was_altered_is_refused_naming_it(
    url: str, tmp_path: Path
) -> None:
    """P4, P1: a restart of a flow whose head checkpoint's ledger is not of the shape Remit
    writes (a feedback entry that is no feedback, a completion that is not a method
    name or whose count is negative or not an int, a state that is not a dict) raises
    `CorruptRecord` naming the run and the checkpoint before any method runs, and so do
    `load_state` and `checkpoints`. Before, such a ledger reached CrewAI: the restart
    ran completed methods again (a completion it could not read counted as none) or
    failed with a bare `TypeError`/`KeyError`, and a list state was read back as a dict."""
    world = tmp_path / "world.db"
    flow_ids = {name: f"altered-{uuid.uuid4().hex}" for name in ALTERED}

    def first_runs() -> list[str]:
        return [
            kickoff(tally_flow(url, world), inputs={"id": flow_id})["state"]["id"]
            for flow_id in flow_ids.values()
        ]

    done = child(first_runs).wait(120)
    assert done.ok and done.value == list(flow_ids.values()), done.summary()
    assert entered(world) == {"prepare": len(ALTERED), "finish": len(ALTERED)}

    persistence = RemitFlowPersistence(url)
    altered = {
        name: _alter_head(persistence, flow_ids[name], change) for name, change in ALTERED.items()
    }

    def restarts() -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, flow_id in flow_ids.items():
            try:
                out[name] = {"state": kickoff(tally_flow(url, world), inputs={"id": flow_id})}
            except CorruptRecord as exc:
                out[name] = {
                    "class": "CorruptRecord",
                    "run_id": exc.run_id,
                    "checkpoint_id": exc.checkpoint_id,
                }
            except Exception as exc:
                out[name] = {"class": type(exc).__name__, "message": str(exc)}
        return out

    again = child(restarts).wait(120)
    assert again.ok, again.summary()
    for name, flow_id in flow_ids.items():
        assert again.value[name] == {
            "class": "CorruptRecord",
            "run_id": flow_id,
            "checkpoint_id": altered[name],
        }, name
        for read in (persistence.load_state, persistence.checkpoints):
            try:
                read(flow_id)
            except CorruptRecord as exc:
                assert (exc.run_id, exc.checkpoint_id) == (flow_id, altered[name]), name
            else:
                raise AssertionError(f"{read.__name__} read {name} back")
    assert entered(world) == {"prepare": len(ALTERED), "finish": len(ALTERED)}
