"""Probes of round 22: the checkpoints a reader of another workflow version lists, a
state saved directly (CrewAI's `save_state` / `save_pending_feedback`, called by a user)
as a dict for a flow whose state is a model, and a flow on a relative SQLite path whose
process changes its working directory.

Written from the contract (P4: every committed checkpoint satisfies the run's declared
state schema, an invalid write commits nothing and leaves the head where it was, and a
record written by a workflow version the reader does not accept is never returned as a
state; P1 and L1: a flow's own saves continue its run and its claim is given back)
against real CrewAI flows in forked children, with the helpers of `test_crewai_flows`,
on every engine where the fault concerns storage.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from test_crewai_flows import applied, entered, kickoff, order_flow, run

from remit_crewai import RemitFlowPersistence


def _refusal(call: Any) -> dict[str, Any] | None:
    """How `call()` was refused (class, ids, field), or None if it was not."""
    try:
        call()
    except Exception as exc:
        return {
            "class": type(exc).__name__,
            "run_id": getattr(exc, "run_id", None),
            "checkpoint_id": getattr(exc, "checkpoint_id", None),
            "field": getattr(exc, "field", None),
            "message": str(exc),
        }
    return None


def test_checkpoints_written_by_a_version_the_reader_does_not_accept_are_refused(
    url: str,
) -> None:
    """P4: a persistence of workflow version v2 listing the checkpoints of a flow written
    by v1 gets `VersionMismatch` naming the run and a checkpoint, as its `load_state` does;
    before, `checkpoints` returned v1's states to it as if it accepted them. A reader that
    lists v1 in `accepts=` still reads them."""
    flow_id = f"v-{uuid.uuid4().hex}"

    def body() -> dict[str, Any]:
        v1 = RemitFlowPersistence(url, workflow_version="v1")
        v1.save_state(flow_id, "prepare", {"id": flow_id, "n": 1})
        v1.save_state(flow_id, "charge", {"id": flow_id, "n": 2})
        v2 = RemitFlowPersistence(url, workflow_version="v2")
        accepting = RemitFlowPersistence(url, workflow_version="v2", accepts=["v1"])
        return {
            "load_state": _refusal(lambda: v2.load_state(flow_id)),
            "checkpoints": _refusal(lambda: v2.checkpoints(flow_id)),
            "accepted": [c.state["n"] for c in accepting.checkpoints(flow_id)],
            "own": [c.state["n"] for c in v1.checkpoints(flow_id)],
        }

    out = run(body)
    assert out.ok, out.error_text()
    assert out.value["load_state"]["class"] == "VersionMismatch", out.value
    refused = out.value["checkpoints"]
    assert refused is not None and refused["class"] == "VersionMismatch", out.value
    assert refused["run_id"] == flow_id and refused["checkpoint_id"], refused
    assert out.value["accepted"] == [2, 1]
    assert out.value["own"] == [2, 1]


def test_a_dict_saved_directly_for_a_model_state_flow_is_refused_writing_nothing(
    url: str, world: Path
) -> None:
    """P4: `save_state` (and `save_pending_feedback`) called directly with a dict for a
    flow whose state is a model, outside its kickoff, cannot be checked against that model
    (Remit records its name, never imports it): it is refused with `CheckpointInvalid`,
    nothing is written, and the flow still restarts. Before, `{"amount": -5}` (the model
    says `ge=0`) was committed as the head, the flow's model dropped from it, and the next
    `kickoff(inputs={"id": X})` failed for good with `VersionMismatch`. A model instance
    saved directly is still validated and kept."""
    done = run(lambda: kickoff(order_flow(url, world), inputs={"id": f"o-{uuid.uuid4().hex}"}))
    assert done.ok, done.summary()
    flow_id = done.value["id"]

    def direct() -> dict[str, Any]:
        from crewai.flow.async_feedback.types import PendingFeedbackContext

        persistence = RemitFlowPersistence(url)
        before = [c.checkpoint_id for c in persistence.checkpoints(flow_id)]
        bad = {"id": flow_id, "amount": -5, "note": "", "receipt": None, "shipped": True}
        context = PendingFeedbackContext(
            flow_id=flow_id,
            flow_class="OrderFlow",
            method_name="ship",
            method_output=None,
            message="Ship it?",
        )
        out = {
            "save_state": _refusal(lambda: persistence.save_state(flow_id, "ship", bad)),
            "pending": _refusal(lambda: persistence.save_pending_feedback(flow_id, context, bad)),
            "same": [c.checkpoint_id for c in persistence.checkpoints(flow_id)] == before,
            "state": persistence.load_state(flow_id),
        }
        cls = order_flow(url, world)
        model = cls().state
        kept = type(model).model_validate({**bad, "amount": 7})
        persistence.save_state(flow_id, "ship", kept)
        out["kept"] = persistence.load_state(flow_id)["amount"]
        return out

    out = run(direct)
    assert out.ok, out.error_text()
    for call in ("save_state", "pending"):
        refused = out.value[call]
        assert refused is not None and refused["class"] == "CheckpointInvalid", out.value
        assert refused["run_id"] == flow_id, refused
        assert "model" in refused["message"], refused
    assert out.value["same"] is True
    assert out.value["state"]["amount"] == 100
    assert out.value["kept"] == 7

    again = run(lambda: kickoff(order_flow(url, world), inputs={"id": flow_id}))
    assert again.ok, again.summary()
    assert again.value["state"]["amount"] == 7
    assert entered(world) == {"prepare": 1, "adjust": 1, "charge": 1, "ship": 1}
    assert applied(world) == {"charge": 1}


def test_a_step_that_changes_the_working_directory_keeps_its_flow_on_its_store(
    tmp_path: Path, world: Path
) -> None:
    """P1, L1: a flow on a relative SQLite URL (`sqlite:///orders.db`, as the README's
    example) whose step changes the process's working directory (a tool that works in a
    folder of its own), or that is kicked off from another directory than the one its
    persistence was made in, goes on saving to the file the persistence was made for. Before,
    the next save looked its run up by the file the relative path named in the new
    directory: it found none, claimed the flow again against its own claim, and the flow
    failed with `ResumeConflict` after its first step, its claim left held (renewed for as
    long as the process lived). Now the flow completes, a restart by id in another process
    runs nothing, and nothing is made in the other directories."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()

    def flow_class() -> type[Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel

        from remit_core.conformance.world import Journal, WorldDB

        journal = Journal(WorldDB(world))

        class Count(BaseModel):
            n: int = 0

        @persist(RemitFlowPersistence("sqlite:///orders.db"))
        class MovingFlow(Flow[Count]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def first(self) -> None:
                journal.record("enter", "first")
                self.state.n += 1
                os.chdir(elsewhere)

            @listen(first)
            def second(self) -> None:
                journal.record("enter", "second")
                self.state.n += 1

        return MovingFlow

    def first_run() -> dict[str, Any]:
        os.chdir(home)
        cls = flow_class()  # (the persistence is made here: its file is home's)
        os.chdir(tmp_path)
        return kickoff(cls)

    done = run(first_run)
    assert done.ok, done.error_text()
    assert done.value["state"]["n"] == 2
    flow_id = done.value["id"]
    assert sorted(p.name for p in elsewhere.iterdir()) == []
    assert not (tmp_path / "orders.db").exists()

    def restart() -> dict[str, Any]:
        os.chdir(home)
        return kickoff(flow_class(), inputs={"id": flow_id})

    again = run(restart)
    assert again.ok, again.error_text()
    assert again.value["state"]["n"] == 2
    assert entered(world) == {"first": 1, "second": 1}
    stored = RemitFlowPersistence(f"sqlite:///{home / 'orders.db'}")
    assert [c.method for c in stored.checkpoints(flow_id)] == ["second", "first"]
