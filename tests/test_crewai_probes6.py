"""A model state comes back as it was saved: CrewAI flows on every engine.

Probes written from the contract (P4: a committed checkpoint satisfies the
flow's model and is never read back as a wrong state) against real CrewAI
flows in forked children, with the helpers of `test_crewai_flows`. CrewAI
restores a state with its model's `model_validate`, so a field the model reads
by its alias only, or a computed field of a model that forbids extra fields,
must be stored in the form the model reads back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from crewai_parts import Later
from test_crewai_flows import entered, run

from remit_core.conformance.world import Journal, WorldDB
from remit_crewai import RemitFlowPersistence


def alias_flow(url: str, world: Path) -> type[Any]:
    """prepare -> review (pauses) -> approve, with a model that reads `user_name` by its
    alias `userName` only and has a computed field."""
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field, computed_field

    journal = Journal(WorldDB(world))

    class Account(BaseModel):
        user_name: str = Field(default="", alias="userName")
        amount: int = 0
        approved_by: str | None = None

        @computed_field  # type: ignore[prop-decorator]
        @property
        def doubled(self) -> int:
            return self.amount * 2

    @persist(RemitFlowPersistence(url))
    class AccountFlow(Flow[Account]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            journal.record("enter", "prepare")
            self.state.user_name = "alice"
            self.state.amount = 21

        @listen(prepare)
        @human_feedback(message="Open it?", provider=Later())
        def review(self) -> str:
            journal.record("enter", "review")
            return "account"

        @listen(review)
        def approve(self) -> None:
            journal.record("enter", "approve")
            assert self.last_human_feedback is not None
            self.state.approved_by = self.last_human_feedback.feedback

    return AccountFlow


def test_a_model_state_read_by_alias_comes_back_as_saved(url: str, world: Path) -> None:
    """Paused, resumed in another process, kicked off again by id, edited by field name:
    each time the alias-only field keeps its value (nothing runs twice)."""

    def pause() -> dict[str, Any]:
        flow = alias_flow(url, world)(suppress_flow_events=True)
        out = flow.kickoff()
        return {"id": flow.flow_id, "out": type(out).__name__}

    paused = run(pause)
    assert paused.ok and paused.value["out"] == "HumanFeedbackPending", paused.summary()
    flow_id = paused.value["id"]

    def resume() -> dict[str, Any]:
        flow_class = alias_flow(url, world)
        flow = flow_class.from_pending(flow_id, flow_class.__flow_persistence_config__.persistence)
        loaded = flow.state.user_name
        flow.resume("bob")
        return {"loaded": loaded, "state": flow.state.model_dump()}

    resumed = run(resume)
    assert resumed.ok, resumed.summary()
    assert resumed.value["loaded"] == "alice"
    assert resumed.value["state"]["user_name"] == "alice"
    assert resumed.value["state"]["approved_by"] == "bob"

    def restart_and_edit() -> dict[str, Any]:
        flow_class = alias_flow(url, world)
        flow = flow_class(suppress_flow_events=True)
        flow.kickoff(inputs={"id": flow_id})
        again = flow.state.model_dump()
        store = flow_class.__flow_persistence_config__.persistence
        store.edit_state(flow_id, {"user_name": "carol"}, state_type=type(flow.state))
        edited = flow_class(suppress_flow_events=True)
        edited.kickoff(inputs={"id": flow_id})
        return {"again": again, "edited": edited.state.model_dump()}

    restarted = run(restart_and_edit)
    assert restarted.ok, restarted.summary()
    assert restarted.value["again"]["user_name"] == "alice"
    assert restarted.value["again"]["doubled"] == 42
    assert restarted.value["edited"]["user_name"] == "carol"
    assert restarted.value["edited"]["approved_by"] == "bob"
    assert entered(world) == {"prepare": 1, "review": 1, "approve": 1}


def test_a_restart_loads_a_model_with_computed_fields_that_forbids_extra_ones(
    url: str, world: Path
) -> None:
    """A step fails after the first one completed; the restart loads the stored state into
    the model (its computed field is not stored as a field the model would refuse) and
    runs only the failed step."""

    def build() -> type[Any]:
        from crewai.flow.flow import Flow, listen, start
        from crewai.flow.persistence import persist
        from pydantic import BaseModel, ConfigDict, computed_field

        journal = Journal(WorldDB(world))

        class Basket(BaseModel):
            model_config = ConfigDict(extra="forbid")
            items: int = 0

            @computed_field  # type: ignore[prop-decorator]
            @property
            def doubled(self) -> int:
                return self.items * 2

        @persist(RemitFlowPersistence(url))
        class BasketFlow(Flow[Basket]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def fill(self) -> None:
                journal.record("enter", "fill")
                self.state.items = 3

            @listen(fill)
            def pay(self) -> None:
                journal.record("enter", "pay")
                if dict(journal.entered())["pay"] == 1:
                    raise RuntimeError("the payment service is down")

        return BasketFlow

    def first() -> dict[str, Any]:
        flow = build()(suppress_flow_events=True)
        try:
            flow.kickoff()
        except RuntimeError:
            pass
        return {"id": flow.flow_id}

    started = run(first)
    assert started.ok, started.summary()

    def restart() -> dict[str, Any]:
        flow = build()(suppress_flow_events=True)
        flow.kickoff(inputs={"id": started.value["id"]})
        return flow.state.model_dump()

    done = run(restart)
    assert done.ok, done.summary()
    assert done.value["items"] == 3 and done.value["doubled"] == 6
    assert entered(world) == {"fill": 1, "pay": 2}


def test_a_model_field_that_reads_back_as_another_value_is_refused(url: str) -> None:
    """A field read by other names than the one it is written by (`AliasChoices`) would
    come back empty: the save is refused naming it, and nothing is written."""

    def body() -> dict[str, Any]:
        from crewai.flow.flow import Flow, start
        from crewai.flow.persistence import persist
        from pydantic import AliasChoices, BaseModel, Field

        class Ticket(BaseModel):
            title: str = Field(default="", validation_alias=AliasChoices("subject", "heading"))

        store = RemitFlowPersistence(url)

        @persist(store)
        class TicketFlow(Flow[Ticket]):  # type: ignore[misc]
            _skip_auto_memory = True

            @start()
            def write(self) -> None:
                self.state.title = "printer on fire"

        flow = TicketFlow(suppress_flow_events=True)
        try:
            flow.kickoff()
        except RuntimeError as exc:
            cause = exc.__cause__ or exc.__context__
            return {
                "error": type(cause).__name__,
                "field": getattr(cause, "field", None),
                "head": store.load_state(flow.flow_id),
            }
        return {"error": None}

    out = run(body)
    assert out.ok, out.summary()
    assert out.value == {"error": "CheckpointInvalid", "field": "title", "head": None}


def test_a_fork_of_a_pause_edited_in_place_waits_for_its_own_feedback(
    url: str, world: Path
) -> None:
    """P3, L3: an operator edits a paused flow, then forks it from that edit: `from_pending`
    takes the fork's own feedback (the edit included), and the original still waits for
    its own."""
    paused = run(
        lambda: {"id": alias_flow(url, world)(suppress_flow_events=True).kickoff().context.flow_id}
    )
    assert paused.ok, paused.summary()
    flow_id = paused.value["id"]

    def body() -> dict[str, Any]:
        flow_class = alias_flow(url, world)
        store = flow_class.__flow_persistence_config__.persistence
        state_type = type(flow_class(suppress_flow_events=True).state)
        store.edit_state(flow_id, {"amount": 5}, state_type=state_type)
        edit = store.checkpoints(flow_id)[0]
        forked = store.fork(flow_id, fork_token="edited", checkpoint_id=edit.checkpoint_id)
        fork = flow_class.from_pending(forked, store)
        fork.resume("bob")
        original = flow_class.from_pending(flow_id, store)
        original.resume("carol")
        return {
            "kind": edit.kind,
            "fork": fork.state.model_dump(),
            "original": original.state.model_dump(),
        }

    out = run(body)
    assert out.ok, out.summary()
    assert out.value["kind"] == "edit"
    assert out.value["fork"]["amount"] == 5 and out.value["fork"]["approved_by"] == "bob"
    assert out.value["original"]["amount"] == 5
    assert out.value["original"]["approved_by"] == "carol"
    assert entered(world) == {"prepare": 1, "review": 1, "approve": 2}
