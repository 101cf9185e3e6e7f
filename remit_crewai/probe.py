"""The conformance probe on CrewAI Flows: `SQLiteFlowPersistence` (vanilla) and Remit.

The probe is written the way CrewAI's docs write human-in-the-loop flows: a
`@human_feedback` method whose provider raises `HumanFeedbackPending` pauses
the flow; `Flow.from_pending(flow_id, persistence).resume(value)` resumes it
and the listener after it reads the value from `last_human_feedback`. A
restarted worker continues with `kickoff(inputs={"id": flow_id})`. Both
targets run the same flow class; only the `@persist` backend differs, and on
Remit a fork is `RemitFlowPersistence.fork` (vanilla: CrewAI's own
`restore_from_state_id`, which can only start from a flow's latest state).
"""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from collections.abc import Mapping
from typing import Any

from remit_core.conformance.adapter import (
    STEPS,
    CheckpointRef,
    NotApplicable,
    ProbeAdapter,
    ProbeEnv,
    ProbeSession,
    RunResult,
    Snapshot,
    Target,
    initial_state,
)
from remit_core.conformance.storage import (
    backup_sqlite,
    copy_remit_run,
    corrupt_remit_checkpoint,
    sqlite_path,
)
from remit_core.records import MAIN_BRANCH

#: Environment every probe process runs under: CrewAI must not reach the network.
QUIET_ENV = {
    "CREWAI_DISABLE_TELEMETRY": "true",
    "CREWAI_DISABLE_TRACKING": "true",
    "OTEL_SDK_DISABLED": "true",
    "CREWAI_TRACING_ENABLED": "false",
    "CREWAI_DISABLE_VERSION_CHECK": "true",
}


def _quiet() -> None:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def _probe_flow(env: ProbeEnv, persistence: Any) -> tuple[type[Any], type[Any]]:
    """The probe as a CrewAI flow class persisted by `persistence` (class-level `@persist`),
    and its state model."""
    from crewai.flow.async_feedback.types import HumanFeedbackPending
    from crewai.flow.flow import Flow, listen, start
    from crewai.flow.human_feedback import human_feedback
    from crewai.flow.persistence import persist
    from pydantic import BaseModel, Field

    class Pause:
        """A feedback provider for a reviewer who answers later: the flow pauses."""

        def request_feedback(self, context: Any, flow: Any) -> str:
            raise HumanFeedbackPending(context=context)

    class ProbeFlowState(BaseModel):
        """`ProbeState` as a flow state (no validate_assignment: steps assign freely)."""

        id: str = Field(default_factory=lambda: str(uuid.uuid4()))
        order_id: str = ""
        amount: int = Field(default=0, ge=0)
        approved_by: str | None = None
        charged: bool = False
        log: list[str] = Field(default_factory=list)

    multi = env.variant.multi_interrupt
    invalid = env.variant.invalid_step_write

    class ProbeFlow(Flow[ProbeFlowState]):  # type: ignore[misc]
        _skip_auto_memory = True

        @start()
        def prepare(self) -> None:
            env.enter("prepare")
            self.state.amount = -5 if invalid else 100
            self.state.log.append("prepare")

        @listen(prepare)
        @human_feedback(message="Approve this order?", provider=Pause())
        def review(self) -> dict[str, Any]:
            return {"order_id": self.state.order_id, "amount": self.state.amount}

        if multi:

            @listen(review)
            def note_first(self) -> None:
                self.state.approved_by = self.feedback()

            @listen(note_first)
            @human_feedback(message="Approve it once more?", provider=Pause())
            def review_again(self) -> dict[str, Any]:
                return {"order_id": self.state.order_id, "amount": self.state.amount}

        @listen("review_again" if multi else "review")
        def approve(self) -> None:
            value = self.feedback()
            env.enter("approve")
            env.point("resume.after_accept")
            self.state.approved_by = f"{self.state.approved_by}+{value}" if multi else value
            self.state.log.append("approve")

        @listen(approve)
        def charge(self) -> None:
            env.enter("charge")
            env.point("charge.before_effect")
            env.effect("charge")
            env.point("charge.after_effect")
            self.state.charged = True
            self.state.log.append("charge")

        @listen(charge)
        def notify(self) -> None:
            # charge's save_state returned before this listener started: its
            # completion reached the backend, and the next checkpoint is notify's.
            env.point("charge.after_step")
            env.enter("notify")
            env.point("notify.before_effect")
            env.effect("notify")
            self.state.log.append("notify")

        def feedback(self) -> str:
            """The reviewer's answer (restored by Remit after a restart)."""
            if self.last_human_feedback is None:
                raise RuntimeError("approve ran without a reviewer's answer")
            return self.last_human_feedback.feedback

    return persist(persistence)(ProbeFlow), ProbeFlowState  # type: ignore[return-value]


def _result(flow: Any, out: Any) -> RunResult:
    from crewai.flow.async_feedback.types import HumanFeedbackPending

    state = _probe_state(flow.state.model_dump())
    if isinstance(out, HumanFeedbackPending):
        return RunResult("paused", state)
    return RunResult("done" if state["log"][-1:] == ["notify"] else "other", state)


def _probe_state(stored: Mapping[str, Any]) -> dict[str, Any]:
    return {k: stored.get(k) for k in initial_state()}


def _next_steps(completed: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(s for s in STEPS if s not in completed)[:1]


class _Session(ProbeSession):
    def __init__(self, target: Target, env: ProbeEnv, persistence: Any) -> None:
        self.target, self.env, self.persistence = target, env, persistence
        self.flow_class, self.state_type = _probe_flow(env, persistence)

    def _flow_id(self, run: str, branch: str | None) -> str:
        raise NotImplementedError

    def start(self, run: str) -> RunResult:
        flow = self.flow_class(suppress_flow_events=True)
        return _result(flow, flow.kickoff(inputs={"id": run, **initial_state()}))

    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        flow = self.flow_class.from_pending(self._flow_id(run, branch), self.persistence)
        return _result(flow, flow.resume(value))

    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        flow = self.flow_class(suppress_flow_events=True)
        return _result(flow, flow.kickoff(inputs={"id": self._flow_id(run, branch)}))


class RemitSession(_Session):
    """The probe on `RemitFlowPersistence`; forks are branches of the run."""

    def __init__(self, target: Target, env: ProbeEnv) -> None:
        from remit_crewai import RemitFlowPersistence

        persistence = RemitFlowPersistence(
            url=target.url,
            lease=env.lease,
            workflow_version=env.variant.workflow_version,
            feedback_schema={"type": "string"},
        )
        super().__init__(target, env, persistence)

    def _flow_id(self, run: str, branch: str | None) -> str:
        from remit_crewai._ledger import flow_id_of

        return flow_id_of(run, branch or MAIN_BRANCH)

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        from remit_crewai._ledger import locate

        forked = self.persistence.fork(run, fork_token=token, checkpoint_id=checkpoint)
        result = self.recover(forked)
        result.branch = locate(forked)[1]
        return result

    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        self.persistence.edit_state(run, patch, state_type=self.state_type)

    def corrupt_head(self, run: str) -> str:
        current = self.persistence.remit.branch(run)
        assert current is not None and current.head_id is not None
        corrupt_remit_checkpoint(self.target, run, current.head_id)
        return current.head_id

    def inspect(self, run: str, *, branch: str | None = None) -> Snapshot:
        from remit_core import codec

        flow_id, remit = self._flow_id(run, branch), self.persistence.remit
        saved = self.persistence.checkpoints(flow_id)
        interrupts = remit.interrupts(run, branch=branch or MAIN_BRANCH)
        return Snapshot(
            state=_probe_state(saved[0].state) if saved else None,
            head=saved[0].checkpoint_id if saved else None,
            branches=len(remit.branches(run)),
            checkpoints=[CheckpointRef(c.checkpoint_id, _next_steps(c.completed)) for c in saved],
            pending_interrupts=sum(i.status == "pending" for i in interrupts),
            resume_values=[
                codec.loads(i.value)["feedback"] for i in interrupts if i.value is not None
            ],
        )

    def copy_store(self, run: str, dest: Target) -> None:
        copy_remit_run(self.target, dest, run)


class VanillaSession(_Session):
    """The probe on CrewAI's `SQLiteFlowPersistence`, used as its docs show."""

    def __init__(self, target: Target, env: ProbeEnv) -> None:
        from crewai.flow.persistence import SQLiteFlowPersistence

        self.path = sqlite_path(target.url)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(target, env, SQLiteFlowPersistence(str(self.path)))

    def _flow_id(self, run: str, branch: str | None) -> str:
        return branch or run

    def _rows(self, flow_id: str) -> list[tuple[int, str]]:
        with sqlite3.connect(self.path) as conn:
            return conn.execute(
                "SELECT id, state_json FROM flow_states WHERE flow_uuid = ? ORDER BY id DESC",
                (flow_id,),
            ).fetchall()

    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        rows = self._rows(run)
        if not rows or str(rows[0][0]) != checkpoint:
            raise NotApplicable(
                "CrewAI's @persist continues a flow only from its latest state "
                "(restore_from_state_id); an older state cannot be continued"
            )
        forked = f"{run}.fork.{uuid.uuid4().hex[:12]}"  # CrewAI mints a fresh id per fork
        flow = self.flow_class(suppress_flow_events=True)
        result = _result(flow, flow.kickoff(inputs={"id": forked}, restore_from_state_id=run))
        result.branch = forked
        return result

    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        stored = self.persistence.load_state(run) or {}
        self.persistence.save_state(run, "edit_state", {**stored, **patch})

    def corrupt_head(self, run: str) -> str:
        """The same alteration as on Remit's targets would be meaningless in JSON text:
        change one character of the order id in the newest stored state."""
        row_id, state_json = self._rows(run)[0]
        with sqlite3.connect(self.path) as conn:
            conn.execute(
                "UPDATE flow_states SET state_json = ? WHERE id = ?",
                (state_json.replace('"order-1"', '"order-2"'), row_id),
            )
        return str(row_id)

    def inspect(self, run: str, *, branch: str | None = None) -> Snapshot:
        flow_id = self._flow_id(run, branch)
        rows = self._rows(flow_id)
        with sqlite3.connect(self.path) as conn:
            forks = conn.execute(
                "SELECT COUNT(DISTINCT flow_uuid) FROM flow_states WHERE flow_uuid LIKE ?",
                (f"{run}.fork.%",),
            ).fetchone()[0]
            pending = conn.execute(
                "SELECT COUNT(*) FROM pending_feedback WHERE flow_uuid = ?", (flow_id,)
            ).fetchone()[0]
        states = [json.loads(s) for _, s in rows]
        return Snapshot(
            state=_probe_state(states[0]) if states else None,
            head=str(rows[0][0]) if rows else None,
            branches=(1 if rows else 0) + forks,
            checkpoints=[
                CheckpointRef(str(r[0]), _next_steps(tuple(s.get("log", ()))))
                for r, s in zip(rows, states, strict=True)
            ],
            pending_interrupts=int(pending),
            # The feedback string never reaches SQLiteFlowPersistence: nothing is stored.
            resume_values=[],
        )

    def copy_store(self, run: str, dest: Target) -> None:
        backup_sqlite(self.path, sqlite_path(dest.url))


class CrewAIProbe(ProbeAdapter):
    """CrewAI Flows: `SQLiteFlowPersistence` against `RemitFlowPersistence`."""

    framework = "crewai"

    def preload(self) -> None:
        """Import everything a worker needs, once: CrewAI, the hooks, the store engines
        (psycopg alone takes seconds when 16 workers import it at once), and the
        console tables CrewAI's log lines load."""
        _quiet()
        import importlib

        for module in ("crewai.flow.flow", "crewai.hooks.contexts", "remit_crewai._hooks"):
            importlib.import_module(module)
        for optional in (
            "remit_core.stores.postgres",
            "remit_core.stores.redis",
            "rich._emoji_codes",
            "rich._unicode_data.unicode17-0-0",
        ):
            try:
                importlib.import_module(optional)
            except ImportError:  # not installed (or another version): workers import it
                continue

    def describe(self, target: Target) -> str:
        if target.kind == "vanilla":
            return "CrewAI SQLiteFlowPersistence"
        return f"Remit ({target.engine})"

    def unsupported(self, target: Target) -> str | None:
        if target.kind == "vanilla" and not target.is_local:
            return "CrewAI ships only SQLiteFlowPersistence, a local file"
        return None

    def session(self, target: Target, env: ProbeEnv) -> ProbeSession:
        _quiet()
        if target.kind == "vanilla":
            return VanillaSession(target, env)
        return RemitSession(target, env)


adapter = CrewAIProbe()
