"""`RemitFlowPersistence`: CrewAI's `FlowPersistence` interface on Remit.

    @persist(RemitFlowPersistence("postgresql://..."))
    class OrderFlow(Flow[OrderState]): ...

Every save is a checkpoint committed by compare-and-set of the flow's branch
head, under the flow's leased claim (its fence), after the state validated
against its model or declared schema. A pause opens an interrupt; resuming
claims the flow before any listener runs and consumes the interrupt once.
The checkpoint body carries the completion ledger (`remit_crewai._ledger`),
which the interception hooks (`remit_crewai._hooks`) hand back to a
restarted flow so that it replays what already completed (`remit_crewai._replay`)
and runs only the rest. What a state may hold is `remit_crewai._storable`'s call.

While a process drives a flow it holds a `Session` for it (`remit_crewai._session`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import enum
import functools
import os
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from crewai.flow.async_feedback.types import PendingFeedbackContext
from crewai.flow.human_feedback import HumanFeedbackResult
from crewai.flow.persistence.base import FlowPersistence
from crewai.flow.runtime import FlowState, _condition_satisfied
from crewai.flow.types import FlowMethodName, PendingListenerKey
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_serializer,
    field_validator,
)
from typing_extensions import Self

from remit_core import codec, policy
from remit_core.core import DEFAULT_LEASE, MIN_LEASE, ClaimHandle, Remit, checked_id
from remit_core.errors import (
    CheckpointInvalid,
    CorruptRecord,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
)
from remit_core.records import MAIN_BRANCH, BranchRecord, CheckpointRecord, InterruptRecord
from remit_core.schema import StateSchema, field_path
from remit_core.stores import check_url, open_store
from remit_crewai._ledger import (
    ASK_CHECKPOINT,
    Body,
    Ledger,
    Replay,
    accepted,
    decode,
    encode,
    flow_id_of,
    locate,
)
from remit_crewai._session import (
    Execution,
    Session,
    add_resumer,
    current_execution,
    current_from_pending,
    late_resume,
    occurrence_of,
    paused,
    pausing,
    pinned_url,
    resumer_of,
    sessions,
    store_identity,
)
from remit_crewai._storable import inexact, same, type_name

if TYPE_CHECKING:
    from crewai.flow.flow import Flow


_cores: dict[tuple[str, float, int], Remit] = {}
_cores_lock = threading.Lock()


#: JSON Schema keywords that constrain a state as a whole, not key by key (see
#: `RemitFlowPersistence._check_given`).
_WHOLE_STATE_RULES = frozenset(
    {
        "required",
        "minProperties",
        "dependentRequired",
        "dependencies",
        "dependentSchemas",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
    }
)


def _check_inputs(
    given: dict[str, Any], schema: Mapping[str, Any] | None, ids: Mapping[str, Any]
) -> None:
    """Inputs of a dict-state kickoff, each key as a save checks it: plain data, and its
    part of `schema` (rules on the state as a whole wait for the saves)."""
    _check_plain_dict(given, ids)
    if schema is not None:
        partial = {k: v for k, v in schema.items() if k not in _WHOLE_STATE_RULES}
        StateSchema(partial).validate(given, **ids)


def _check_plain_dict(state: dict[str, Any], ids: Mapping[str, Any]) -> None:
    """`CheckpointInvalid` naming the first key of a dict state that is not a str (a state's
    keys are its field names: a checkpoint holding another would fail to decode, and the
    flow would no longer load), or the first value the codec would not read back as
    what it is."""
    for key in state:
        if type(key) is not str:
            raise CheckpointInvalid(
                f"state key {key!r} ({type_name(type(key))}) is not a str: a state's keys "
                "are its field names (CrewAI's own backend would store it as "
                f"{str(key)!r}); nothing was written",
                field=str(key),
                **ids,
            )
    found = inexact(state)
    if found is not None:
        path, kind = found
        raise CheckpointInvalid(
            f"state field {path} holds a {type_name(kind)}, which Remit cannot read "
            "back as one (reading runs no code and imports no names): store plain data "
            f"({_PLAIN_TYPES})",
            field=path,
            **ids,
        )


@functools.lru_cache(maxsize=256)
def _schema_of(state_type: type[BaseModel]) -> StateSchema:
    return StateSchema(state_type)


#: What a dict state may hold, for the message that refuses anything else.
_PLAIN_TYPES = (
    "dict, list, tuple, set, frozenset, str, int, float, bool, None, bytes, datetime, date, "
    "time, timedelta, UUID, Decimal"
)


#: The JSON Schemas a flow's checkpoints record, so that every persistence checks them.
_SCHEMAS = ("state_schema", "feedback_schema")


def _interrupt_method(interrupt_id: str) -> str:
    return interrupt_id.rsplit("#", 1)[0]


@dataclass(frozen=True)
class SavedCheckpoint:
    """One checkpoint of a flow, for time travel: fork from its id."""

    checkpoint_id: str
    method: str
    kind: str
    completed: tuple[str, ...]
    state: dict[str, Any]


class RemitFlowPersistence(FlowPersistence):
    """CrewAI flow persistence that keeps the Resume Contract, on SQLite, PostgreSQL or Redis.

    `url`: the Remit store (`sqlite:///remit.db`, `postgresql://...`,
    `redis://...`). `lease`: seconds a crashed process keeps a flow claimed.
    `workflow_version`: recorded on every checkpoint; a flow written by a
    version outside {`workflow_version`, *`accepts`} is refused. The flow class
    (`module.Qualname`) is recorded too: another class continuing the flow is refused
    unless `accepts` names the one that wrote it (a class renamed since). `state_schema`
    (JSON Schema) validates dict states; a model state validates against its
    model. `feedback_schema` (JSON Schema) validates human feedback before it
    is consumed. Both are recorded with the flow's checkpoints, and a persistence
    made without them checks the recorded ones. All fields are plain data; the
    store connects on first use. A setting assigned later is checked as where the
    persistence is made, and a `url` assigned later is the store it writes to from then
    on. Dumped (as CrewAI serializes a flow's persistence), `url` is the store it
    reaches: a relative SQLite path is dumped made absolute.
    """

    # (Assignments are checked: an unchecked lease or url would fail later, mid-run.)
    model_config = ConfigDict(validate_assignment=True)

    persistence_type: str = Field(default="RemitFlowPersistence")
    url: str = Field(default="sqlite:///remit.db")
    lease: float = Field(default=DEFAULT_LEASE, ge=MIN_LEASE, allow_inf_nan=False)
    workflow_version: str = ""
    accepts: list[str] = Field(default_factory=list)
    state_schema: dict[str, Any] | None = None
    feedback_schema: dict[str, Any] | None = None
    #: `url` with a relative SQLite path made absolute where the persistence is made
    #: (`pinned_url`), and the database it reaches (`store_identity`).
    _store_url: str = PrivateAttr(default="")
    _identity: str = PrivateAttr(default="")

    def __init__(self, url: str | None = None, /, **data: Any) -> None:
        if url is not None:
            data["url"] = url
        super().__init__(**data)

    @field_validator("url")
    @classmethod
    def _known_engine(cls, url: str) -> str:
        return check_url(url)

    @field_validator("state_schema", "feedback_schema")
    @classmethod
    def _json_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        # Refused where it is made: recorded with the flow's checkpoints, a schema that is
        # not one would fail every later save or resume of the flow, after its steps ran.
        if schema is not None:
            StateSchema(schema)
        return schema

    @field_serializer("url")
    def _reached_url(self, url: str) -> str:
        # A relative SQLite path dumped as it was given would be resolved again where the
        # dump is read back (another process, another directory): another file.
        return self._store_url or url

    def model_post_init(self, context: Any, /) -> None:
        # (The CrewAI hooks are registered when `remit_crewai` is imported: see `__init__`.)
        self._pin()

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "url":  # (pinned where it is made: see `_pin`)
            self._pin()

    def _pin(self) -> None:
        """Resolve `url` to the store it reaches (`pinned_url`, `store_identity`), now: the
        store this persistence writes to from then on."""
        self._store_url = pinned_url(self.url)
        self._identity = store_identity(self._store_url)

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Self:
        """A copy of this persistence; `update` is checked as the settings of a new one are
        (pydantic's copy checks nothing), and a copy given another `url` writes to that
        store: pydantic's would keep writing to this one's, which it pinned when made."""
        copied = super().model_copy(update=update, deep=deep)
        if not update:
            return copied
        fresh = type(self)(**{name: getattr(copied, name) for name in type(self).model_fields})
        if fresh.url == self.url:  # (the same relative path: the same file as this one's)
            fresh._store_url, fresh._identity = self._store_url, self._identity
        return fresh

    # -- connection ----------------------------------------------------------
    @property
    def remit(self) -> Remit:
        """This process's `Remit` on `url` (connects on first use, again in a forked child)."""
        key = (self._store_url, self.lease, os.getpid())
        with _cores_lock:
            core = _cores.get(key)
            if core is None:
                core = _cores[key] = Remit(open_store(self._store_url), lease=self.lease)
        return core

    @property
    def _where(self) -> str:
        """The database `url` reaches, however it is spelt (`store_identity`): this
        process's sessions are kept by it."""
        return self._identity

    def init_db(self) -> None:
        """Create or migrate the store's schema (idempotent). CrewAI never calls this itself."""
        self.remit.store.setup()

    # -- FlowPersistence -------------------------------------------------------
    def save_state(
        self, flow_uuid: str, method_name: str, state_data: dict[str, Any] | BaseModel
    ) -> None:
        """Commit the state after `method_name` completed, validated and fenced.

        Raises `CheckpointInvalid` (nothing written, the head stays), `HeadMoved`
        or `Fenced` (another process drove the flow since this one read it).
        """
        checked_id("method name", method_name)
        with self._writing(flow_uuid) as session, session.lock:
            plain = self._plain_state(session, state_data)
            occurrence = occurrence_of(session.flow_id, method_name)
            if session.turn_over and occurrence is None:
                # CrewAI saves a conversational turn's reply into the state after the turn's
                # run ended: no method completes (the one that replied already did; a step
                # still running knows its occurrence).
                self._commit(session, plain, method_name, "step", session.ledger, session.output)
                return
            if method_name == ASK_CHECKPOINT:
                kind, ledger = "ask", session.ledger
            elif session.pending is not None and method_name == _interrupt_method(
                session.pending.interrupt_id
            ):
                # The feedback method completes when its feedback is consumed.
                kind, ledger = "feedback", session.ledger
            else:
                kind, ledger = "step", session.ledger.completing(method_name, occurrence)
                # (Keyed by occurrence: runs of one method at once each record their own.)
                ran = (method_name, occurrence)
                if ran in session.routes:
                    ledger = ledger.routing(method_name, session.routes.pop(ran))
                if ran in session.answered:
                    ledger = ledger.noting(session.answered.pop(ran))
            output, before = None, None
            if kind == "step":
                output = _output_of(session, method_name)
            elif kind == "feedback":
                output = _resumed_output(session)
            else:
                before = self._before_this_ask(session)
            self._commit(session, plain, method_name, kind, ledger, output, before=before)
            if kind == "step":
                session.end_occurrence(method_name, occurrence)

    def load_state(self, flow_uuid: str) -> dict[str, Any] | None:
        """The flow's head state, as it was saved; inside a kickoff, the restart or fork
        it begins (under the flow id, which CrewAI continues the flow as).

        `kickoff(inputs={"id": X})` continues X under its claim (`ResumeConflict`
        if another process drives it). `kickoff(restore_from_state_id=S)` is a
        fork and needs `fork_token` (`ForkWithoutIntent` otherwise).
        """
        ex = current_execution.get()
        if ex is not None and not ex.stepping:
            if ex.restart == flow_uuid:
                if ex.refusal is not None:
                    raise ex.refusal
                session = sessions.get(self._where, flow_uuid)
                if session is not None:
                    return {**session.state, "id": flow_uuid} if session.head else None
            else:
                return self._hydrate_fork(flow_uuid, ex)
        run_id, branch = locate(flow_uuid)
        _, body = self._read_head(run_id, branch)
        return None if body is None else _as_saved(flow_uuid, body.state)

    def save_pending_feedback(
        self,
        flow_uuid: str,
        context: PendingFeedbackContext,
        state_data: dict[str, Any] | BaseModel,
    ) -> None:
        """Commit the paused state, open its interrupt, and give the claim up."""
        if not isinstance(context, PendingFeedbackContext):
            raise TypeError(
                f"context must be a PendingFeedbackContext, got {type(context).__name__}"
            )
        method = checked_id("method name (context.method_name)", context.method_name)
        # JSON as CrewAI makes it (a str Enum output is its str), as its own backend.
        prompt = _stored_context(context, method)
        with self._writing(flow_uuid, release=True) as session, session.lock:
            plain = self._plain_state(session, state_data)
            flow = _flow_of(session)
            ledger = session.ledger
            if flow is not None:
                ledger = ledger.pausing(*_joins_of(flow, session, method))
                if _conversational(flow):  # (a later turn may ask it again: `Ledger.asked`)
                    ledger = ledger.asking(method)
            # The checkpoint keeps the prompt too: if this process dies before the
            # interrupt is open, `load_pending_feedback` opens it (`_unopened_pause`).
            record = self._commit(session, plain, method, "pause", ledger, prompt=prompt)
            if flow is not None:
                pausing(flow, True)  # what is still running of its run drives nothing now
                _left_by_run(flow, session)
            interrupt_id = f"{method}#{session.ledger.occurrence(method)}"
            self.remit.open_interrupts(
                session.run_id,
                {interrupt_id: prompt},
                branch=session.branch,
                checkpoint_id=record.checkpoint_id,
                fence=session.fence,
            )

    def load_pending_feedback(
        self, flow_uuid: str
    ) -> tuple[dict[str, Any], PendingFeedbackContext] | None:
        """The paused flow's state and the context of the feedback it waits for, or None.

        Inside `from_pending`, it claims the flow for its resume first: of k
        concurrent `from_pending(...).resume(...)` calls exactly one gets past
        it, the rest get `ResumeConflict`, and feedback that was already
        consumed raises `ResumeConflict`, never runs twice. Called by anything
        else (a server listing what waits for feedback, or checking before
        `from_pending`) it is a read, as CrewAI's own backend's: it claims
        nothing, gives the same answer again, and None once the feedback was
        consumed (the claim is taken where a resume starts).
        """
        if not current_from_pending.get():
            return self._read_pending(flow_uuid)
        current_from_pending.set(False)  # (only CrewAI's first call in it claims)
        return self._claim_pending(flow_uuid)

    def _read_pending(self, flow_uuid: str) -> tuple[dict[str, Any], PendingFeedbackContext] | None:
        """`load_pending_feedback` without a claim: the pause pending at the head, if any."""
        run_id, branch = locate(flow_uuid)
        record, body = self._read_head(run_id, branch)
        if record is None or body is None:
            return None
        # Only the open ones: a loop's consumed feedback grows with its rounds.
        pending = [
            (i.interrupt_id, self._as_paused(run_id, record.checkpoint_id, i).prompt)
            for i in self.remit.interrupts(run_id, branch=branch, status="pending")
        ]
        if not pending:
            unopened = self._paused_head(run_id, record.checkpoint_id)
            if (
                unopened is not None
                and self.remit.interrupt(run_id, unopened[1], branch=branch) is None
            ):
                pending = [(unopened[1], unopened[2])]
        if not pending:
            return None
        interrupt_id, prompt = pending[-1]
        context = _pause_context(
            prompt, flow_uuid, run_id=run_id, interrupt_id=interrupt_id, head=record.checkpoint_id
        )
        return _as_saved(flow_uuid, body.state), context

    def _claim_pending(
        self, flow_uuid: str
    ) -> tuple[dict[str, Any], PendingFeedbackContext] | None:
        """Claim the paused flow for its resume: one resumer wins, the rest get `ResumeConflict`.

        The claim is taken before anything is read. Feedback that was already
        consumed raises `ResumeConflict`, never runs twice.
        """
        run_id, branch = locate(flow_uuid)
        session = self._open(flow_uuid, heartbeat=False)
        try:
            # Only the open ones: a loop's consumed feedback grows with its rounds.
            pending = self.remit.interrupts(run_id, branch=branch, status="pending")
            if not pending:
                pending = self._unopened_pause(session)
            if not pending:
                consumed = self._last_consumed(session)
                if consumed is not None:
                    raise ResumeConflict(
                        "the feedback this flow waited for was already given; nothing is "
                        "pending, and a second value is not stored",
                        run_id=run_id,
                        interrupt_id=consumed.interrupt_id,
                    )
                session.handle.release()
                return None
            session.pending = self._as_paused(run_id, session.head, pending[-1])
            context = _pause_context(
                session.pending.prompt,
                flow_uuid,
                run_id=run_id,
                interrupt_id=session.pending.interrupt_id,
                head=session.head,
            )
        except BaseException:
            session.handle.release()
            raise
        sessions.add(session)
        add_resumer(session)
        return {**session.state, "id": flow_uuid}, context

    def _unopened_pause(self, session: Session) -> list[InterruptRecord]:
        """The interrupt of the pause the head records (through edits made on it), opened
        now if the process that saved the pause died (or lost the store) before opening
        it; none if the head is no pause or its interrupt exists (pending or consumed)."""
        paused = self._paused_head(session.run_id, session.head)
        if paused is None:
            return []
        checkpoint_id, interrupt_id, prompt = paused
        if self.remit.interrupt(session.run_id, interrupt_id, branch=session.branch) is not None:
            return []
        self.remit.open_interrupts(
            session.run_id,
            {interrupt_id: prompt},
            branch=session.branch,
            checkpoint_id=checkpoint_id,
            fence=session.fence,
        )
        opened = self.remit.interrupt(session.run_id, interrupt_id, branch=session.branch)
        return [] if opened is None else [opened]

    def _as_paused(
        self, run_id: str, head: str | None, pending: InterruptRecord
    ) -> InterruptRecord:
        """`pending` with the context of the pause the head `head` records, when that pause
        is `pending`'s: a paused flow kicked off again runs its feedback method again and
        pauses at the same interrupt with a context made anew (the method's output, its
        time), which CrewAI's own backend keeps in place of the first one; the interrupt
        keeps the context it was opened with."""
        paused = self._paused_head(run_id, head)
        if paused is None or paused[1] != pending.interrupt_id or paused[2] == pending.prompt:
            return pending
        return dataclasses.replace(pending, prompt=paused[2])

    def _paused_head(self, run_id: str, checkpoint_id: str | None) -> tuple[str, str, bytes] | None:
        """The pause the head `checkpoint_id` records (through edits made on it): its
        checkpoint, its interrupt id and its prompt; None if the head is no pause."""
        while checkpoint_id is not None:
            record = self.remit.checkpoint(run_id, checkpoint_id)
            if record is None:
                return None
            body = decode(record.state, run_id=run_id, checkpoint_id=checkpoint_id)
            if body.kind != "edit":
                break
            if body.edited is not None:  # (the pause itself may have been pruned since)
                if body.edited["kind"] != "pause" or body.prompt is None:
                    return None
                method = body.edited["method"]
                occurrence = f"{method}#{body.ledger.occurrence(method)}"
                return body.edited["checkpoint"], occurrence, body.prompt
            checkpoint_id = record.parent_id
        if checkpoint_id is None or body.kind != "pause" or body.prompt is None:
            return None
        return checkpoint_id, f"{body.method}#{body.ledger.occurrence(body.method)}", body.prompt

    def clear_pending_feedback(self, flow_uuid: str) -> None:
        """Nothing to do: the interrupt stays pending until the resumed run consumes it.

        CrewAI calls this before any listener runs. Deleting the pause here
        would lose it if the resumer died next; instead the resumer's claim
        keeps others out, and its lease lets another resume once it is dead.
        A flow id that is not one raises as in `load_pending_feedback`.
        """
        locate(flow_uuid)

    # -- beyond CrewAI's interface -----------------------------------------------
    def fork(
        self, flow_id: str, *, fork_token: str | None, checkpoint_id: str | None = None
    ) -> str:
        """The flow id that continues `flow_id` from `checkpoint_id` (default: its head).

        Continuing from a checkpoint that is not a head needs `fork_token`
        (`ForkWithoutIntent` otherwise); the same token always gives the same
        forked id. The fork of a paused checkpoint (or of an edit made while the
        flow was paused) waits for its own feedback. Run it with
        `kickoff(inputs={"id": forked})` or `from_pending(forked)`.
        """
        run_id, branch = locate(flow_id)
        remit = self.remit
        if checkpoint_id is None:
            checkpoint_id = self._fork_base(flow_id, fork_token)
        base = remit.checkpoint(run_id, checkpoint_id)
        if base is None:
            raise UnknownRecord("no such checkpoint", run_id=run_id, checkpoint_id=checkpoint_id)
        policy.check_workflow_version(base, self._accepted())
        if fork_token is None:
            return flow_id_of(run_id, remit.plan(run_id, checkpoint_id).branch)
        created = remit.fork(run_id, checkpoint_id, fork_token)
        paused_at, body = base, decode(base.state, run_id=run_id, checkpoint_id=checkpoint_id)
        while body.kind == "edit" and body.edited is None and paused_at.parent_id is not None:
            # An edit of a paused flow leaves it paused: the fork waits for that feedback too.
            parent = remit.checkpoint(run_id, paused_at.parent_id)
            if parent is None:
                break
            paused_at = parent
            body = decode(parent.state, run_id=run_id, checkpoint_id=parent.checkpoint_id)
        method = body.method if body.kind == "pause" else None
        if body.kind == "edit" and body.edited is not None and body.edited["kind"] == "pause":
            method = body.edited["method"]  # (the pause itself may have been pruned since)
        if method is not None:
            interrupt_id = f"{method}#{body.ledger.occurrence(method)}"
            paused = remit.interrupt(run_id, interrupt_id, branch=paused_at.branch)
            if paused is not None:
                remit.open_interrupts(
                    run_id,
                    {interrupt_id: paused.prompt},
                    branch=created.branch,
                    checkpoint_id=checkpoint_id,
                )
        return flow_id_of(run_id, created.branch)

    def _fork_base(self, flow_id: str, fork_token: str | None) -> str:
        """Where a fork of `flow_id` that names no checkpoint starts: where its token's
        fork started, if the token made one (the same token continues the same fork,
        however far `flow_id` has moved on since, P3), else at `flow_id`'s head."""
        run_id, branch = locate(flow_id)
        current = self.remit.branch(run_id, branch=branch)
        if current is None or current.head_id is None:
            raise UnknownRecord("flow has no checkpoint to fork from", run_id=run_id)
        made = None if fork_token is None else self.remit.fork_branch(run_id, fork_token)
        if made is None or made.base_id is None:
            return current.head_id
        if not self._on_line(run_id, current, made.base_id):
            raise ForkWithoutIntent(
                f"fork token {fork_token!r} already made fork {flow_id_of(run_id, made.branch)!r} "
                f"from checkpoint {made.base_id!r}, which is not on the line of {flow_id!r}: "
                "use a new token to fork this flow",
                run_id=run_id,
                checkpoint_id=made.base_id,
            )
        return made.base_id

    def _on_line(self, run_id: str, line: BranchRecord, checkpoint_id: str) -> bool:
        """Whether checkpoint `checkpoint_id` is on the line of branch `line`: one of the
        branch's own up to its head, or on the line of the branch it was forked from, up to
        its base. Read from the branches, not by walking the checkpoints between: a prune
        may have deleted those (it keeps every fork base and head)."""
        wanted = self.remit.checkpoint(run_id, checkpoint_id)
        current: BranchRecord | None = line
        bound, seen = line.head_seq, set()
        while wanted is not None and current is not None and current.branch not in seen:
            seen.add(current.branch)
            if wanted.branch == current.branch:
                return wanted.seq <= bound
            base = (
                None if current.base_id is None else self.remit.checkpoint(run_id, current.base_id)
            )
            if base is None:
                return False
            bound, current = base.seq, self.remit.branch(run_id, branch=base.branch)
        return False

    def checkpoints(self, flow_id: str) -> list[SavedCheckpoint]:
        """The flow's checkpoints, newest first, along its line back to the start.

        Each is checked as `load_state` checks the head: one written by a workflow
        version this persistence does not accept raises `VersionMismatch` naming it, and
        one that fails to verify or decode `CorruptRecord` naming it (P4). Checkpoints
        of the run's other branches are not read.
        """
        run_id, branch = locate(flow_id)
        current = self.remit.branch(run_id, branch=branch)
        out: list[SavedCheckpoint] = []
        cursor = None if current is None else current.head_id
        while cursor is not None:
            # Only the line's own records are read and verified: a corrupt checkpoint of
            # another branch (a fork) is that branch's error, not this line's.
            record = self.remit.checkpoint(run_id, cursor)
            if record is None:
                break
            policy.check_workflow_version(record, self._accepted())
            body = decode(record.state, run_id=run_id, checkpoint_id=cursor)
            out.append(
                SavedCheckpoint(cursor, body.method, body.kind, body.ledger.completed, body.state)
            )
            cursor = record.parent_id
        return out

    def edit_state(
        self,
        flow_id: str,
        changes: Mapping[str, Any],
        *,
        state_type: type[BaseModel] | None = None,
    ) -> None:
        """An operator's edit: merge `changes` into the head state and commit it.

        Validated like any save (against `state_type` for a model state);
        nothing is written if it fails, or if `changes` name another `id`. The edit
        completes no method and runs no workflow code: it keeps the workflow version of
        the checkpoint it edits, whatever this persistence's. A flow whose state is a
        model needs `state_type` (`TypeError` without it): Remit records the model's
        name, never imports it. A flow with no checkpoint is `UnknownRecord`: an edit
        never makes a flow. While a kickoff or resume holds the flow, in this process or
        another, the edit is `ResumeConflict`: the run's next save would overwrite it.
        """
        if not isinstance(changes, Mapping):
            raise TypeError(
                f"changes must be a mapping of field to value, got {type(changes).__name__}; "
                "nothing was written"
            )
        if "id" in changes and changes["id"] != flow_id:
            raise CheckpointInvalid(
                f"an edit cannot change the id of flow {flow_id!r} (to {changes['id']!r}): "
                "the flow is stored under its id; fork it to continue it under another; "
                "nothing was written",
                field="id",
                run_id=locate(flow_id)[0],
            )
        if state_type is not None and not (
            isinstance(state_type, type) and issubclass(state_type, BaseModel)
        ):
            raise TypeError(
                "state_type must be the flow's state model (a pydantic model class), got "
                f"{state_type!r:.80}; nothing was written"
            )
        with self._writing(flow_id, alone=True) as session, session.lock:
            if session.head is None:
                raise UnknownRecord(
                    "flow has no checkpoint to edit; nothing was written", run_id=session.run_id
                )
            head = self.remit.checkpoint(session.run_id, session.head)
            if state_type is not None:
                session.state_type = _with_id(state_type)
            elif session.state_type is None:
                model = None if head is None else head.metadata.get("model")
                if model is not None:
                    raise TypeError(
                        f"flow {flow_id!r} keeps a {model} state: pass "
                        "edit_state(..., state_type=<that model>) so that the edit is "
                        "validated as a save is; nothing was written"
                    )
            if session.state_type is not None:
                _check_fields(session.state_type, changes, flow_id)
            state = session.state
            if session.state_type is not None:
                state = _by_field_name(session.state_type, state)
            merged = {**state, **changes, "id": flow_id}
            plain = self._plain_state(session, merged)
            if session.state_type is not None:
                _check_kept(session.state_type, state, plain, flow_id)
            # A finished flow's restart still returns what its last step returned. The edit
            # runs no workflow code: it keeps the version that wrote the flow, which an
            # operator's persistence made without one would otherwise lock out (P4).
            version = self.workflow_version if head is None else head.workflow_version
            edited, prompt, first = _edited_pause(head)
            self._commit(
                session,
                plain,
                "",
                "edit",
                session.ledger,
                session.output,
                prompt=prompt,
                edited=edited,
                first=first,
                version=version,
            )

    # -- sessions ------------------------------------------------------------
    def _accepted(self) -> set[str] | None:
        return {self.workflow_version, *self.accepts} if self.workflow_version else None

    def _read_head(self, run_id: str, branch: str) -> tuple[CheckpointRecord | None, Body | None]:
        record = self.remit.head(run_id, branch=branch)
        if record is None:
            return None, None
        policy.check_workflow_version(record, self._accepted())
        return record, decode(record.state, run_id=run_id, checkpoint_id=record.checkpoint_id)

    def _open(self, flow_id: str, *, heartbeat: bool) -> Session:
        """Claim `flow_id` (`ResumeConflict` while another holder's lease lives); read its head."""
        run_id, branch = locate(flow_id)
        handle = self.remit.claim(run_id, branch, lease=self.lease, heartbeat=heartbeat)
        try:
            if branch != MAIN_BRANCH and self.remit.branch(run_id, branch=branch) is None:
                raise UnknownRecord(
                    f"run has no fork {branch!r}: make it with RemitFlowPersistence.fork",
                    run_id=run_id,
                )
            record, body = self._read_head(run_id, branch)
        except BaseException:
            handle.release()
            raise
        return Session(
            store_url=self._where,
            flow_id=flow_id,
            run_id=run_id,
            branch=branch,
            handle=handle,
            head=None if record is None else record.checkpoint_id,
            ledger=Ledger() if body is None else body.ledger,
            state={} if body is None else body.state,
            beating=heartbeat,
            output=None if body is None else body.output,
            schemas={}
            if record is None
            else {
                k: record.metadata[k] for k in _SCHEMAS if isinstance(record.metadata.get(k), dict)
            },
            flow_class=None if record is None else _text(record.metadata.get("flow")),
            model=None if record is None else _text(record.metadata.get("model")),
            initial_keys=None if record is None else _keys(record.metadata.get("initial_keys")),
        )

    @contextlib.contextmanager
    def _writing(
        self, flow_id: str, *, release: bool = False, alone: bool = False
    ) -> Iterator[Session]:
        """The session a save of `flow_id` goes through (`release`: given up after it).

        Inside the kickoff that drives `flow_id`, that kickoff's session, which
        lives until the run ends or pauses. Any other save (an operator's edit, a
        flow persisted per method, a save for another flow made inside a step)
        claims, writes and releases, taking turns with this process's other such
        saves of `flow_id`, so that parallel steps do not refuse each other.
        `alone`: never through a running session (an edit that a running step's
        next save would overwrite is refused, as from another process).
        """
        session = None if alone else self._driving(flow_id)
        if session is not None:
            try:
                yield session
            finally:
                if release:
                    self._release(session)
            return
        # A save left running by a run that gave the flow up follows the head it left:
        # a resume's (its session's last head), else a kickoff's (`Execution.left`).
        late = None if alone else late_resume(self._where, flow_id)
        ex = None if alone or late is not None else current_execution.get()
        left = ex is not None and flow_id in ex.left
        with sessions.turn(self._where, flow_id):
            session = self._open(flow_id, heartbeat=False)
            try:
                if late is not None:
                    self._refuse_if_moved_on(session, late.head)
                elif ex is not None and left:
                    self._refuse_if_moved_on(session, ex.left[flow_id])
                yield session
                # (its run's next late save follows it)
                if late is not None:
                    late.head = session.head
                elif ex is not None and left:
                    ex.left[flow_id] = session.head
            finally:
                self._release(session)

    @staticmethod
    def _refuse_if_moved_on(session: Session, left: str | None) -> None:
        """`Fenced` for a save still running in a thread of a run that gave its flow up
        (cancelled, ended or paused at head `left`) when another run or resume has written
        the flow since: its state is older than the head, which it would overwrite."""
        if session.head != left:
            raise Fenced(
                "this save belongs to a run of the flow that already gave it up (cancelled, "
                "ended or paused), and another run or resume has written the flow since: "
                "the save is refused and nothing was written",
                run_id=session.run_id,
                scope=session.branch,
            )

    def _driving(self, flow_id: str) -> Session | None:
        """This process's session driving `flow_id`; opened if the kickoff running in this
        context drives `flow_id` and has none (a pause gave it up); else None."""
        with sessions.lock:
            ex = current_execution.get()
            session = self._session_of(flow_id, None)
            if session is not None and self._gave_up(ex, flow_id, session):
                # A resume in this process took the flow: a save left running by the run
                # that gave it up claims for itself, so it is refused as from another process.
                return None
            if session is not None:
                self._activate(session)
                return session
            if ex is None or ex.over:
                return None  # no kickoff, or one that ended (a save left in its thread)
            flow = ex.flow()
            if flow is None or flow.flow_id != flow_id or not self._stores_for(flow):
                return None  # (a method persisted to another store saves outside the run)
            if paused(flow):
                return None  # a step that completes after its run paused saves for itself
            _refuse_new_id(flow, flow_id)
            session = self._open(flow_id, heartbeat=True)
            session.owner = ex.flow
            sessions.add(session)
            return session

    def _gave_up(self, ex: Execution | None, flow_id: str, session: Session) -> bool:
        """Whether the run this context belongs to gave `flow_id` up (a resume, or else
        kickoff `ex`, that ended, was cancelled or paused) and `session` is another run's:
        that of a resume made in this process since, whose state and ledger the old
        run's state must not enter.

        A resume run in the context of the kickoff that paused (CrewAI starts no new
        execution for it) finds its own session as this context's `from_pending`'s; a
        save left running by the paused run began before, in a context without it."""
        if late_resume(self._where, flow_id) is not None:
            return True  # (its own session was released: `session` is another's)
        flow = None if ex is None else ex.flow()
        if ex is None or flow is None or flow.flow_id != flow_id:
            return False
        if not (ex.over or flow_id in ex.left or paused(flow)):
            return False
        if session.owner is not None and session.owner() is flow:
            return False
        return session is not resumer_of(self._where, flow_id)

    def _stores_for(self, flow: Flow[Any]) -> bool:
        """Whether this persistence writes to the store of `flow`'s own persistence, whose
        run the hooks drive (any instance on its URL shares its sessions)."""
        own = flow.persistence
        return isinstance(own, RemitFlowPersistence) and own._where == self._where

    def _session_of(self, flow_id: str, flow: Flow[Any] | None) -> Session | None:
        """This process's session for `flow_id` that `flow` runs under (None: the flow
        of the kickoff running in this context, if any), or None if it has none yet.

        The flow's own session first; else the one a `from_pending` in this
        context opened, even if another resumer's session has since replaced it
        in the registry (its claim then refuses it); else the registry's.
        """
        if flow is None:
            ex = current_execution.get()
            flow = None if ex is None else ex.flow()
        registered = sessions.get(self._where, flow_id)
        if (
            registered is not None
            and flow is not None
            and registered.owner is not None
            and registered.owner() is flow
        ):
            return registered
        return resumer_of(self._where, flow_id) or registered

    def _activate(self, session: Session) -> None:
        """Start the heartbeat of a claim taken without one (by `load_pending_feedback`),
        or raise `Fenced` if it lapsed and another resumer took the flow over."""
        with session.lock:
            if session.beating:
                return
            try:
                claim = self.remit.store.renew_claim(
                    session.handle.claim, now=self.remit.clock(), lease=self.lease
                )
            except Fenced as exc:
                raise Fenced(
                    f"this resumer's claim on the flow lapsed (lease {self.lease:g} s) and "
                    "another resumer took the flow over before this resume began: it is "
                    "refused and runs nothing",
                    run_id=session.run_id,
                    scope=session.branch,
                ) from exc
            session.handle = ClaimHandle(self.remit, claim, self.lease, heartbeat=True)
            session.beating = True

    @staticmethod
    def _release(session: Session) -> None:
        session.closed = True
        sessions.discard(session)
        session.handle.release()

    def _schema(self, session: Session, name: str) -> dict[str, Any] | None:
        """This persistence's `state_schema` or `feedback_schema`, else the one the flow's
        head recorded: a resume or edit through a persistence made without the flow's
        schemas still checks what the flow's own saves check (P4)."""
        own: dict[str, Any] | None = getattr(self, name)
        return own if own is not None else session.schemas.get(name)

    def _plain_state(self, session: Session, state_data: Any) -> dict[str, Any]:
        """The state as plain data the codec stores exactly, or `CheckpointInvalid`."""
        ids = {"run_id": session.run_id, "checkpoint_id": session.head}
        try:
            return self._checked_state(session, _snapshot(state_data), ids)
        except RecursionError:
            raise CheckpointInvalid(
                "state is nested too deeply to store (checking it goes past Python's "
                "recursion limit)",
                field="<root>",
                **ids,
            ) from None

    def _checked_state(
        self, session: Session, state_data: Any, ids: dict[str, Any]
    ) -> dict[str, Any]:
        if isinstance(state_data, BaseModel):
            session.state_type = type(state_data)  # recorded with the commit (see `edit_state`)
        elif session.state_type is None and isinstance(state_data, dict):
            session.state_type = self._model_for_dict(session, ids)
        model = session.state_type
        if model is not None and isinstance(state_data, (BaseModel, dict)):
            if isinstance(state_data, dict):
                state_data = _as_model(model, state_data)
            plain = self._dump_model(_schema_of(model).validate(state_data, **ids), ids)
        elif isinstance(state_data, dict):
            plain = dict(state_data)
            _check_plain_dict(plain, ids)
        else:
            raise CheckpointInvalid(
                f"state must be a dict or a pydantic model, not {type(state_data).__name__}",
                field="<root>",
                **ids,
            )
        schema = self._schema(session, "state_schema")
        if schema is not None:
            StateSchema(schema).validate(plain, **ids)
        return plain

    @staticmethod
    def _model_for_dict(session: Session, ids: Mapping[str, Any]) -> type[BaseModel] | None:
        """The model a dict saved for a flow is checked against: its flow's state model
        (CrewAI hands a model state over as a dict for a pause or an `ask()`), None for a
        dict state. `CheckpointInvalid` for a dict saved outside the flow's run (a direct
        `save_state`) when the head was saved as a model: Remit records the model's name
        and never imports it, so it could not check the dict, and a state its model
        refuses would fail every restart of the flow (P4)."""
        flow = _flow_of(session)
        if flow is not None:
            return type(flow.state) if isinstance(flow.state, BaseModel) else None
        if session.model is None:
            return None
        raise CheckpointInvalid(
            f"flow {session.flow_id!r} keeps a {session.model} state, and a dict saved "
            "outside its run cannot be checked against that model (Remit records its name, "
            "never imports it): save an instance of the model, or use "
            "edit_state(..., state_type=<the model>); nothing was written",
            field="<root>",
            **ids,
        )

    @staticmethod
    def _dump_model(state: BaseModel, ids: Mapping[str, Any]) -> dict[str, Any]:
        """The state as data its model reads back as the same values, types included (CrewAI
        restores a state with its model's `model_validate`): its Python-mode fields when the
        codec stores them exactly, else its JSON form (a str Enum in an `Any` field would
        come back a str), else its Python-mode fields with those the codec does not store
        exactly in their JSON form (an Enum field beside a Decimal in an `Any` field, or
        beside bytes that are not UTF-8); keyed by field name, else by alias (a model that
        reads a field by its alias only would drop it by name). Computed fields are left
        out: the model computes them, and one that forbids extra fields would refuse them.
        Otherwise the state is refused, naming the field that does not read back (one a
        validator would change on the way back, such as a value a step assigned without
        `validate_assignment` that a validator normalises: a restart would go on with
        another value than the run had)."""
        model = type(state)
        plain = state.model_dump(mode="python", round_trip=True)
        found = inexact(plain)
        if found is None and not _renamed(model) and _reads_back(model, plain):
            return _types_kept(state, plain, ids)  # stored exactly, keyed as the model reads it
        as_declared = _numbers_as_declared(state, plain)
        if as_declared is not None:
            return RemitFlowPersistence._dump_model(as_declared, ids)
        modes = ("python", "json") if found is None else ("json", "mixed")
        why, first_back = "it reads back as another value", None
        for by_alias in (False, True):
            for mode in modes:
                # (PydanticSerializationError and ValidationError are ValueErrors.)
                try:
                    if mode == "mixed":
                        stored = _mixed_dump(state, by_alias=by_alias)
                    else:
                        stored = state.model_dump(mode=mode, round_trip=True, by_alias=by_alias)
                    back = model.model_validate(stored).model_dump(mode="python", round_trip=True)
                except (TypeError, ValueError) as exc:
                    why = f"it has no form that reads back ({exc})"
                    continue
                if same(plain, back):  # (`plain` first: its zones must be fixed)
                    return _types_kept(state, stored, ids)
                # (The mixed form changes the fewest fields: the one it changes is the culprit.)
                first_back = back if first_back is None or mode == "mixed" else first_back
        if found is None:
            path = _first_change(plain, first_back)
            raise CheckpointInvalid(
                f"state field {path} does not survive storage: its model reads it back as "
                "another value by field name and by alias (a validator that changes the "
                "value, which a step assigned without validate_assignment, or a field read "
                "by another name than it is written by?); nothing was written",
                field=path,
                **ids,
            )
        if first_back is not None:
            changed = _first_change(plain, first_back)
            found = inexact(plain.get(changed), changed) or (changed, type(plain.get(changed)))
        path, kind = found
        raise CheckpointInvalid(
            f"state field {path} holds a {type_name(kind)}, which does not survive storage: "
            f"Remit stores a model's plain values only when they read back as they are, "
            f"and {why}",
            field=path,
            **ids,
        )

    def _commit(
        self,
        session: Session,
        plain: dict[str, Any],
        method: str,
        kind: str,
        ledger: Ledger,
        output: bytes | None = None,
        *,
        prompt: bytes | None = None,
        before: dict[str, Any] | None = None,
        edited: dict[str, str] | None = None,
        first: str | None = None,
        version: str | None = None,
    ) -> CheckpointRecord:
        """Commit `plain` as the session's new head, fenced, stamped with workflow `version`
        (default: that of the flow's own persistence when it writes to this store, else
        this persistence's: a method `@persist`ed to this store by a persistence of no
        version saves into its flow's run, whose own deployment must still accept it)."""
        remit = self.remit
        for name in _SCHEMAS:
            schema = self._schema(session, name)
            if schema is not None:
                session.schemas[name] = schema
        flow = _flow_of(session)
        if flow is not None:
            session.flow_class = _class_name(flow)
            if isinstance(flow.state, dict):
                session.initial_keys = _initial_keys(flow)
            own = flow.persistence
            if version is None and isinstance(own, RemitFlowPersistence) and self._stores_for(flow):
                version = own.workflow_version
        if kind in ("pause", "feedback") and session.branch != MAIN_BRANCH:
            occurrence = f"{method}#{ledger.occurrence(method)}"
            ran = self._first_ran(session, session.head, occurrence)
            first = None if ran[1] == session.branch else ran[1]
        try:
            plan = policy.plan_continue(
                session.run_id,
                session.branch,
                remit.branch(session.run_id, branch=session.branch),
                session.head,
            )
        except HeadMoved as exc:
            claim = remit.store.get_claim(session.run_id, session.branch)
            if not policy.fence_is_current(claim, session.fence.fence, session.fence.holder):
                raise Fenced(
                    "this process's claim on the flow was taken over after its lease lapsed; "
                    "its writes are refused",
                    run_id=session.run_id,
                    scope=session.branch,
                ) from exc
            raise
        record = remit.commit(
            run_id=session.run_id,
            checkpoint_id=f"{plan.seq:012d}-{uuid.uuid4().hex[:12]}",
            parent_id=session.head,
            state=encode(Body(plain, method, kind, ledger, output, prompt, before, edited, first)),
            metadata={
                "flow_id": session.flow_id,
                "method": method,
                "kind": kind,
                **({} if session.state_type is None else {"model": _name(session.state_type)}),
                **({} if session.flow_class is None else {"flow": session.flow_class}),
                **(
                    {}
                    if session.initial_keys is None
                    else {"initial_keys": list(session.initial_keys)}
                ),
                **session.schemas,
            },
            workflow_version=self.workflow_version if version is None else version,
            fence=session.fence,
            plan=plan,
        )
        session.head, session.ledger, session.state = record.checkpoint_id, ledger, plain
        session.output = output
        return record

    # -- called by the interception hooks ------------------------------------------
    def _has_run(self, flow_id: str) -> bool:
        """Whether `flow_id` has a checkpoint: a kickoff of it continues it."""
        run_id, branch = locate(flow_id)
        current = self.remit.branch(run_id, branch=branch)
        return current is not None and current.head_id is not None

    def _begin_restart(self, ex: Execution, flow: Flow[Any], flow_id: str) -> None:
        """`kickoff(inputs={"id": flow_id})`: claim it and hand its ledger to `flow`."""
        ex.restart = flow_id
        try:
            with sessions.lock:
                session = self._open(flow_id, heartbeat=True)
                session.owner = ex.flow
                sessions.add(session)
            if session.head is not None:
                ex.carried = None  # (the flow's ledger is its past, not what CrewAI was told)
            elif ex.carried:
                # `reload(execution_data)` (or a CrewAI checkpoint) told the instance these
                # methods completed, and CrewAI skips them: recorded with the first save, a
                # restart skips them too (P1, P2; unrecorded, it would run them again).
                session.ledger = Ledger(completed=tuple(ex.carried), counts=dict(ex.carried))
            self._check_flow_class(session, flow)
            self._restore_into(flow, session)
            if isinstance(flow.state, BaseModel):
                self._check_model_restart(session, flow.state, ex.inputs or {})
        except Exception as exc:  # raised again by load_state: CrewAI swallows hook errors
            ex.refusal = exc

    def _restored_continues(
        self,
        flow: Flow[Any],
        done: Mapping[str, int],
        fork_token: str | None,
        inputs: Mapping[str, Any],
    ) -> str:
        """The flow id that a kickoff of `flow`, restored from a CrewAI checkpoint
        (`kickoff(from_checkpoint=...)`) of a flow this store has checkpoints of, continues.
        `done`: per method, how often it had completed at that checkpoint; `inputs`: the
        kickoff's, checked as a fork's before the fork is made.

        A checkpoint whose methods completed as often as at the flow's head continues the
        flow. Any other continues an older state: without `fork_token` it is refused
        (`ForkWithoutIntent`), since under the flow's id it would run again what completed
        after it (P1, P3); with one it is the token's fork from the oldest checkpoint of
        the flow's line where the same methods had completed as often (the one saved as
        CrewAI wrote its checkpoint; the same token gives the same fork). Refused before
        anything is claimed or made."""
        flow_id = flow.flow_id
        run_id, branch = locate(flow_id)
        head, body = self._read_head(run_id, branch)
        assert head is not None and body is not None, "only a flow with a head is continued"
        if fork_token is None:
            if _done(body.ledger) == done:
                return flow_id
            raise ForkWithoutIntent(
                f"the CrewAI checkpoint restored into flow {flow_id!r} is not its head in Remit "
                f"(completed there: {dict(done)}; at the head: {_done(body.ledger)}): "
                "continuing from it would run again what completed after it. Continue the "
                f"flow from its head with kickoff(inputs={{'id': {flow_id!r}}}), or fork from "
                "the checkpoint: Flow.fork(config) (a new flow id), or the kickoff inside "
                "`with remit_crewai.fork_token(token):`",
                run_id=run_id,
                checkpoint_id=head.checkpoint_id,
            )
        self._check_class_of(flow, _text(head.metadata.get("flow")), flow_id, head.checkpoint_id)
        base: CheckpointRecord | None = None
        cursor: str | None = head.checkpoint_id
        while cursor is not None:
            record = self.remit.checkpoint(run_id, cursor)
            if record is None:
                break
            ledger = decode(record.state, run_id=run_id, checkpoint_id=cursor).ledger
            if _done(ledger) == done:
                base = record
            elif base is not None or sum(ledger.counts.values()) < sum(done.values()):
                break  # (completions only grow along a line)
            cursor = record.parent_id
        if base is None:
            raise ForkWithoutIntent(
                f"no checkpoint of flow {flow_id!r} has the methods completed that the CrewAI "
                f"checkpoint restored into it has ({dict(done)}): fork from one of "
                "store.checkpoints(flow_id) with store.fork(flow_id, fork_token=..., "
                "checkpoint_id=...)",
                run_id=run_id,
                checkpoint_id=head.checkpoint_id,
            )
        if self.remit.fork_branch(run_id, fork_token) is None:
            self._check_fork_inputs(flow, inputs, base, flow_id)
        return self.fork(flow_id, fork_token=fork_token, checkpoint_id=base.checkpoint_id)

    def _check_flow_class(self, session: Session, flow: Flow[Any]) -> None:
        """`VersionMismatch` naming both classes if the flow class that wrote the flow's
        head is not `flow`'s and not listed in `accepts` (a class renamed since): another
        class would skip its own methods that share a name with the writer's, or answer
        the writer's pause with its own. Raised before anything runs or is written."""
        self._check_class_of(flow, session.flow_class, session.flow_id, session.head)

    def _check_class_of(
        self, flow: Flow[Any], saved: str | None, flow_id: str, head: str | None
    ) -> None:
        """`VersionMismatch` if flow class `saved` wrote `flow_id` (its head checkpoint
        `head`) and `flow`'s class may not continue it (`_check_flow_class`)."""
        mine = _class_name(flow)
        if saved is None or saved in self.accepts or _same_class(saved, flow):
            return
        raise VersionMismatch(
            f"flow {flow_id!r} was written by flow class {saved}, not {mine}: "
            "nothing was run or written; continue it with the class that wrote it, or, if "
            f"{mine} is that class renamed, list {saved!r} in its persistence's accepts=",
            run_id=locate(flow_id)[0],
            checkpoint_id=head,
        )

    def _check_model_restart(
        self, session: Session, state: BaseModel, inputs: Mapping[str, Any]
    ) -> None:
        """Before CrewAI restores a model state and merges the kickoff's inputs into it:
        `VersionMismatch` if the flow's model refuses the stored state (a flow class
        renamed or reshaped since it saved; it names the model that saved it and the
        field), `CheckpointInvalid` naming the field of an input the model refuses
        (CrewAI would raise a bare `ValueError`). Nothing runs and nothing is written
        either way. A stored field the model no longer declares is the model's to keep
        or drop (its `extra` setting), as in CrewAI's own restore: a model that lost a
        field on purpose restarts the flows saved before."""
        if session.head is None:
            self._check_new_inputs(state, inputs, run_id=session.run_id)
            return
        self._check_model_state(
            state, inputs, session.state, flow_id=session.flow_id, head=session.head
        )

    def _check_model_state(
        self,
        state: BaseModel,
        inputs: Mapping[str, Any],
        saved: Mapping[str, Any],
        *,
        flow_id: str,
        head: str,
    ) -> None:
        """`_check_model_restart` of the state `saved` at checkpoint `head` of `flow_id`."""
        run_id = locate(flow_id)[0]
        model, ids = type(state), {"run_id": run_id, "checkpoint_id": head}
        base = {**saved, "id": flow_id}
        try:
            _schema_of(model).validate(_as_model(model, base), **ids)
            field, why = None, ""
        except CheckpointInvalid as exc:
            field, why = exc.field, f"does not read its field {exc.field!r}"
        if field is not None:
            record = self.remit.checkpoint(run_id, head)
            saved_by = None if record is None else record.metadata.get("model")
            raise VersionMismatch(
                f"the flow's state was saved by {saved_by or 'a dict state'}, and "
                f"{_name(model)} {why}: restart the flow with the class that saved it; "
                "nothing was run or written",
                field=field,
                **ids,
            )
        given = {k: v for k, v in inputs.items() if k != "id"}
        if given:
            _schema_of(model).validate(_as_model(model, {**base, **given}), **ids)

    @staticmethod
    def _check_new_inputs(state: BaseModel, inputs: Mapping[str, Any], *, run_id: str) -> None:
        """The inputs of a new flow's kickoff merged into its initial model `state`, as
        CrewAI merges them: `CheckpointInvalid` naming the field the model refuses (CrewAI
        would raise a bare `ValueError`), before anything runs or is written."""
        given = {k: v for k, v in inputs.items() if k != "id"}
        if given:
            model = type(state)
            merged = {**state.model_dump(round_trip=True), **given, "id": run_id}
            _schema_of(model).validate(_as_model(model, merged), run_id=run_id)

    def _hydrate_fork(self, source_id: str, ex: Execution) -> dict[str, Any] | None:
        """`kickoff(restore_from_state_id=source_id)`: a fork, under the active fork token."""
        run_id, branch = locate(source_id)
        self._unname_new_flow(ex, run_id)
        if ex.fork_token is None or ex.restart is not None or ex.inputs is None:
            current = self.remit.branch(run_id, branch=branch)
            named = (
                ""
                if ex.fork_token is None or ex.restart is None
                else (
                    f" (inputs['id'], or handle_turn's session_id, names flow {ex.restart!r} "
                    "here: a fork's id is its own, made from the flow it forks and the token)"
                )
            )
            raise ForkWithoutIntent(
                "restore_from_state_id continues another flow's state under a new id, which "
                "is a fork: run the kickoff inside `with remit_crewai.fork_token(token):` and "
                f"without inputs['id']{named}, or use RemitFlowPersistence.fork",
                run_id=run_id,
                checkpoint_id=None if current is None else current.head_id,
            )
        flow = ex.flow()
        assert flow is not None, "the kickoff that forks holds its flow"
        # Refused before the fork is made: a refused fork makes no branch, spends no token.
        head = self.remit.head(run_id, branch=branch)
        if head is not None:
            saved = _text(head.metadata.get("flow"))
            self._check_class_of(flow, saved, source_id, head.checkpoint_id)
            if self.remit.fork_branch(run_id, ex.fork_token) is None:
                self._check_fork_inputs(flow, ex.inputs, head, source_id)
        forked = self.fork(source_id, fork_token=ex.fork_token)
        self._begin_restart(ex, flow, forked)
        if ex.refusal is not None:
            raise ex.refusal
        # CrewAI names the hydrated run from inputs["id"], which it reads right after this call.
        ex.inputs["id"] = forked
        if flow._completed_methods:
            flow._is_execution_resuming = True
        session = sessions.get(self._where, forked)
        assert session is not None
        return {**session.state, "id": forked}

    def _unname_new_flow(self, ex: Execution, run_id: str) -> None:
        """A fork of run `run_id` whose kickoff (`ex`, under a fork token) has an
        `inputs["id"]` that is its flow instance's own id: CrewAI's `handle_turn`
        (`stream_turn`, `chat`) passes it when no `session_id` is given, so a turn that
        forks a conversation (`handle_turn(message, restore_from_state_id=S)`) names no
        other flow, as long as that id is new or the token's fork of `run_id` (`chat`'s
        next turn, on the instance the first one forked). It forks as a kickoff without
        `inputs["id"]` does: the claim taken on that id is given back, and the token's
        fork goes on."""
        flow = ex.flow()
        if ex.fork_token is None or ex.restart is None or flow is None:
            return
        if ex.restart != flow.flow_id or ex.refusal is not None:
            return
        session = sessions.get(self._where, ex.restart)
        if session is None or not self._owns(session, flow):
            return
        if session.head is not None:
            made = self.remit.fork_branch(run_id, ex.fork_token)
            if made is None or (session.run_id, session.branch) != (run_id, made.branch):
                return
        self._release(session)
        ex.restart = None

    def _check_fork_inputs(
        self, flow: Flow[Any], inputs: Mapping[str, Any], head: CheckpointRecord, source_id: str
    ) -> None:
        """The inputs of a fork that starts at `head` of `source_id`, before the fork is
        made: refused once its branch exists, a fork would keep its token at this head
        (a retry after the source moved on would fork from here). A model state: the
        head's state with the inputs, as a restart checks them; a dict state: each input
        as a new flow's (`_check_given`)."""
        policy.check_workflow_version(head, self._accepted())  # (refused first, as by `fork`)
        ids = {"run_id": head.run_id, "checkpoint_id": head.checkpoint_id}
        if isinstance(flow.state, BaseModel):
            body = decode(head.state, **ids)
            self._check_model_state(
                flow.state, inputs, body.state, flow_id=source_id, head=head.checkpoint_id
            )
            return
        given = {k: v for k, v in inputs.items() if k != "id"}
        if given:
            recorded = head.metadata.get("state_schema")
            schema = self.state_schema or (recorded if isinstance(recorded, dict) else None)
            _check_inputs(given, schema, ids)

    def _ready_to_resume(self, flow: Flow[Any], feedback: Any) -> None:
        """Before `flow.resume(feedback)` runs anything: `TypeError` naming feedback that is
        not a str (the claim given back, the pause still pending), and the claim again for
        a resume retried on the instance whose earlier resume failed before consuming its
        feedback (and gave its claim back), so that the retry consumes the pause once.

        A resume whose `from_pending` claim is still held (in this context, or one the
        flow took over from another thread) goes on under that claim; a second resume
        while one runs under it gets `ResumeConflict` (P5: one resumer consumes the pause).
        """
        held = self._session_of(flow.flow_id, flow)
        held = None if held is None or held.closed else held
        if held is not None:
            with held.lock:
                if held.resuming:
                    raise ResumeConflict(
                        "a resume of this flow is already running under its claim; this one "
                        "ran nothing",
                        run_id=held.run_id,
                        interrupt_id=None if held.pending is None else held.pending.interrupt_id,
                    )
                held.resuming = isinstance(feedback, str)
        if not isinstance(feedback, str):
            if held is not None and self._owns(held, flow):
                self._release(held)
            raise TypeError(
                f"feedback must be a str, got {type(feedback).__name__}: nothing was resumed, "
                "the flow still waits for its feedback"
            )
        pausing(flow, False)
        if held is not None:
            _rejoin(flow, held)
            return
        loaded = self._claim_pending(flow.flow_id)
        if loaded is None:
            raise ResumeConflict(
                "this flow waits for no feedback any more; nothing was resumed",
                run_id=locate(flow.flow_id)[0],
            )
        session = resumer_of(self._where, flow.flow_id)
        try:
            _check_same_pause(flow, loaded[1], session)
            flow._initialize_state(loaded[0])
        except BaseException:
            if session is not None:
                self._release(session)
            raise
        if session is not None:
            session.resuming = True
            _rejoin(flow, session)

    def _restore_into(self, flow: Flow[Any], session: Session) -> None:
        """Give a restarted flow its past: completed methods and accepted feedback.

        Feedback consumed after the head was written (its resumer died before
        the next save) still counts; a method whose feedback is still pending
        runs again, so that it pauses again.
        """
        ledger = session.ledger
        for i in sorted(
            (
                i
                for i in [*self._given_at_base(session), *self._given_since_head(session)]
                if i.status == "consumed" and i.value is not None
            ),
            key=lambda i: i.consumed_at or 0.0,
        ):
            assert i.value is not None
            ledger = ledger.accepting(
                accepted(i.value, run_id=session.run_id, interrupt_id=i.interrupt_id)
            )
        session.ledger, session.replay = ledger, Replay.of(ledger)
        session.keys_from = self._paused_on(session)
        before = self._state_before_asks(session)
        if before is not None:
            session.state = before
        if session.head is not None and isinstance(flow.state, dict):
            # (Nothing saved before the asking step: it starts from the initial state.)
            known = None if before == {} else session.initial_keys
            session.state = {**_added_since(flow, session.state, known), **session.state}
        waiting = {
            _interrupt_method(i.interrupt_id)
            for i in self.remit.interrupts(session.run_id, branch=session.branch, status="pending")
        }
        _forget_last_run(flow)
        if _new_turn(flow):
            # A conversational turn runs the flow's graph again on its saved state (CrewAI
            # clears what the last turn ran): nothing is replayed, and each method's
            # occurrences, the keys of its effects, go on from the ledger's. A restart
            # without a message continues this turn (`Replay.of`).
            session.ledger = ledger.new_turn(waiting)
            session.replay = None
            flow._completed_methods = set()
        else:
            flow._completed_methods = {m for m in ledger.completed if m not in waiting}
        history = _history(ledger)
        flow.human_feedback_history = history
        flow.last_human_feedback = history[-1] if history else None

    def _state_before_asks(self, session: Session) -> dict[str, Any] | None:
        """The state a restart continues with when the head is the checkpoint CrewAI takes
        as a step calls `ask()` (None if it is not): the state of the checkpoint before it
        (empty if none). That checkpoint holds what the step had changed before asking,
        and the restart runs the step again from its start: from that state it would
        change it twice (P1, P6: recovery ends where an uninterrupted run ends). A read
        outside a kickoff still returns the state as it was saved."""
        checkpoint_id, asked = session.head, False
        while checkpoint_id is not None:
            record = self.remit.checkpoint(session.run_id, checkpoint_id)
            if record is None:
                break
            body = decode(record.state, run_id=session.run_id, checkpoint_id=checkpoint_id)
            if body.kind != "ask":
                return body.state if asked else None
            if body.before is not None:
                return body.before
            # (Written before asks kept it: the checkpoints before it hold it.)
            asked, checkpoint_id = True, record.parent_id
        return {} if asked else None

    def _before_this_ask(self, session: Session) -> dict[str, Any]:
        """The state the step that asks now started from (`Body.before`): that of the asks
        before it in this step, else the head's (empty if nothing was saved yet). Kept in
        the ask's checkpoint, as the checkpoints before it may be pruned meanwhile."""
        if session.head is None:
            return {}
        before = self._state_before_asks(session)
        return session.state if before is None else before

    def _given_since_head(self, session: Session) -> list[InterruptRecord]:
        """The feedback consumed on the flow's line after its head was written: at most that
        of the pause the head ends (the pause, its feedback method's completion, edits made
        on them), whose resumer consumed it and died before its next save. Every save after
        a consume holds that feedback in its ledger, and a later consume needs a later
        pause: so a restart reads one interrupt, however many rounds the loop has had."""
        occurrence = self._head_pause(session)
        if occurrence is None:
            return []
        given = self.remit.interrupt(session.run_id, occurrence, branch=session.branch)
        return [] if given is None else [given]

    def _head_pause(self, session: Session) -> str | None:
        """The interrupt id of the pause the head ends, through its feedback method's
        completion and edits made on them; None if the head ends no pause."""
        checkpoint_id = session.head
        while checkpoint_id is not None:
            record = self.remit.checkpoint(session.run_id, checkpoint_id)
            if record is None:
                return None
            body = decode(record.state, run_id=session.run_id, checkpoint_id=checkpoint_id)
            if body.kind in ("pause", "feedback"):
                return f"{body.method}#{body.ledger.occurrence(body.method)}"
            if body.kind != "edit":
                return None
            if body.edited is not None:  # (the pause itself may have been pruned since)
                method = body.edited["method"]
                return f"{method}#{body.ledger.occurrence(method)}"
            checkpoint_id = record.parent_id
        return None

    def _last_consumed(self, session: Session) -> InterruptRecord | None:
        """The newest feedback consumed on the flow's branch, or None if none was: that of
        the pause the head ends, else the newest of its ledger's feedback that a consumed
        interrupt of this branch holds (feedback given at once has none)."""
        candidates = [self._head_pause(session)]
        candidates += [f["interrupt"] for f in reversed(session.ledger.feedback)]
        for interrupt_id in dict.fromkeys(c for c in candidates if c is not None):
            found = self.remit.interrupt(session.run_id, interrupt_id, branch=session.branch)
            if found is not None and found.status == "consumed":
                return found
        return None

    def _given_at_base(self, session: Session) -> list[InterruptRecord]:
        """The feedback a fork's head was given, consumed on the line it was forked from.

        CrewAI saves a feedback method's completion before the next step consumes
        the feedback, so that checkpoint (and an edit made on it) holds no feedback
        in its ledger: a restart of the main line reads it on its own branch
        (`_given_since_head`), and a fork made there must find it where it was consumed."""
        for record, body in self._fork_line(session):
            if body.kind == "feedback":
                occurrence = f"{body.method}#{body.ledger.occurrence(body.method)}"
                given = self.remit.interrupt(session.run_id, occurrence, branch=record.branch)
                return [] if given is None else [given]
            if body.kind != "edit":
                break
        return []

    def _paused_on(self, session: Session) -> dict[str, str]:
        """Where the occurrence a fork's head paused at ran first (`Session.keys_from`).

        A restart runs a paused feedback method again so that it pauses again;
        on a fork made from the pause, the effects that occurrence applied
        before the fork are the shared prefix's, met again under their keys and
        not applied a second time (P3)."""
        if session.branch == MAIN_BRANCH:
            return {}
        paused, first = self._first_ran(session, session.head, None)
        return {} if paused is None or first == session.branch else {paused: first}

    def _first_ran(
        self, session: Session, checkpoint_id: str | None, paused: str | None
    ) -> tuple[str | None, str]:
        """The occurrence the pause (or its feedback, through edits) at `checkpoint_id` of
        the session's line is, if it is `paused` (any, if None), and the branch it first
        ran on: walked back through the pauses of that occurrence, or read where a
        checkpoint keeps it (`Body.first`; the ones before may have been pruned)."""
        first = session.branch
        while checkpoint_id is not None:
            record = self.remit.checkpoint(session.run_id, checkpoint_id)
            if record is None:
                break
            body = decode(record.state, run_id=session.run_id, checkpoint_id=checkpoint_id)
            method = body.method
            if body.kind == "edit":
                if body.edited is None:
                    checkpoint_id = record.parent_id
                    continue
                method = body.edited["method"]
            elif body.kind not in ("pause", "feedback"):
                break
            occurrence = f"{method}#{body.ledger.occurrence(method)}"
            if paused not in (None, occurrence):
                break
            paused = occurrence
            if body.first is not None:
                return paused, body.first
            if body.kind != "edit":
                first = record.branch
            checkpoint_id = record.parent_id
        return paused, first

    def _fork_line(self, session: Session) -> Iterator[tuple[CheckpointRecord, Body]]:
        """The checkpoints of a fork's line from its head back (none for the main line);
        an edit made on a pause or feedback leads straight to it (`Body.edited`)."""
        checkpoint_id = None if session.branch == MAIN_BRANCH else session.head
        while checkpoint_id is not None:
            record = self.remit.checkpoint(session.run_id, checkpoint_id)
            if record is None:
                return
            body = decode(record.state, run_id=session.run_id, checkpoint_id=checkpoint_id)
            yield record, body
            checkpoint_id = record.parent_id if body.edited is None else body.edited["checkpoint"]

    def _step_session(self, flow: Flow[Any]) -> Session:
        """The session a step of `flow` runs under: its own, a resumer's it adopts, or new."""
        self._refuse_if_paused(flow)
        with sessions.lock:
            session = self._session_of(flow.flow_id, flow)
            if session is None:
                session = self._open(flow.flow_id, heartbeat=True)
                session.owner = weakref.ref(flow)
                if session.head is None:
                    session.ledger = _carried_ledger(flow)
                sessions.add(session)
            elif not self._owns(session, flow):
                raise ResumeConflict(
                    "another flow instance in this process is driving this flow",
                    run_id=session.run_id,
                )
        self._activate(session)
        if isinstance(flow.state, BaseModel):
            session.state_type = type(flow.state)
        return session

    def _take_leftovers(self, flow: Flow[Any]) -> tuple[frozenset[str], frozenset[str]] | None:
        """What the resume of `flow` runs beside its first listeners (`Session.leftovers`),
        once; None if nothing (or `flow` is not being resumed)."""
        session = self._session_of(flow.flow_id, flow)
        if session is None or session.closed:
            return None
        with session.lock:
            leftovers, session.leftovers = session.leftovers, None
        return leftovers

    @staticmethod
    def _refuse_if_paused(flow: Flow[Any]) -> None:
        """`ResumeConflict` for a step of `flow` that starts after its run paused: it runs
        nothing here (the resume runs it) and claims nothing (the flow stays free)."""
        if paused(flow):
            raise ResumeConflict(
                "this flow paused for feedback before this step started: the step runs "
                "nothing here (the flow's resume runs it), and the flow stays free to resume",
                run_id=locate(flow.flow_id)[0],
            )

    def _owns(self, session: Session, flow: Flow[Any]) -> bool:
        """Whether `flow` drives `session`; a resumed flow adopts the session of its resume."""
        if session.owner is not None:
            return session.owner() is flow
        feedback = flow.last_human_feedback
        resuming = session.pending is not None and (
            resumer_of(self._where, session.flow_id) is session
            or (
                feedback is not None
                and feedback.method_name == _interrupt_method(session.pending.interrupt_id)
            )
        )
        if resuming:
            session.owner = weakref.ref(flow)
        return resuming

    def _accept(self, session: Session, flow: Flow[Any]) -> None:
        """Consume the pending interrupt with the feedback the resumed flow now holds."""
        with session.lock:
            pending, feedback = session.pending, flow.last_human_feedback
            if pending is None or feedback is None:
                return
            method = _interrupt_method(pending.interrupt_id)
            if feedback.method_name != method:
                return
            ids = {"run_id": session.run_id, "interrupt_id": pending.interrupt_id}
            schema = self._schema(session, "feedback_schema")
            if schema is not None:
                StateSchema(schema).validate(feedback.feedback, **ids)
            prompt = codec.loads(pending.prompt) if pending.prompt is not None else {}
            value = _feedback_entry(
                pending.interrupt_id, feedback, prompt.get("method_output"), prompt.get("metadata")
            )
            # Stored as CrewAI's own JSON would store it (a str Enum as its str, as the
            # pause context above); the ledger holds what a restart reads back.
            stored = codec.dumps(value, exact=False)
            self.remit.consume(
                session.run_id,
                pending.interrupt_id,
                stored,
                branch=session.branch,
                fence=session.fence,
            )
            session.pending = None
            session.ledger = session.ledger.accepting(codec.loads(stored))
            session.end_occurrence(method)

    def _took_route(self, flow: Flow[Any], method: str, outcome: Any) -> None:
        """Router `method` of `flow` returned `outcome`: its route, recorded by the save
        that completes it (`Ledger.routes`), as CrewAI names routes."""
        session = self._session_of(flow.flow_id, flow)
        if session is None:
            return
        if isinstance(outcome, enum.Enum):
            outcome = outcome.value
        occurrence = occurrence_of(session.flow_id, method)
        with session.lock:
            session.routes[method, occurrence] = None if outcome is None else str(outcome)

    def _answered_at_once(self, flow: Flow[Any], method: str, output: Any = None) -> None:
        """Feedback method `method` of `flow` got its answer from its provider at once
        (no pause): recorded by the save that completes it, so that a restart gives
        the flow its `last_human_feedback` back, as for feedback given to a pause.
        `output`: what the method's step returned (its feedback, without `emit=`;
        else the flow's last feedback is the step's, as no other step ran since)."""
        feedback = output if isinstance(output, HumanFeedbackResult) else flow.last_human_feedback
        if feedback is None or feedback.method_name != method:
            return
        session = self._session_of(flow.flow_id, flow)
        if session is None:
            return
        occurrence = occurrence_of(session.flow_id, method)
        with session.lock:
            # The occurrence the step ran as: runs of `method` at once each have their own.
            n = session.ledger.occurrence(method) if occurrence is None else occurrence
            key = f"{method}#{n}"
            if any(f["interrupt"] == key for f in session.ledger.feedback):
                return  # the answer to a pause, recorded as it was consumed
            value = _feedback_entry(
                key, feedback, _as_json(feedback.output), _as_json(feedback.metadata)
            )
            # As CrewAI's own JSON stores it (see `_accept`).
            session.answered[method, occurrence] = codec.loads(codec.dumps(value, exact=False))

    def _meet(self, flow: Flow[Any], method: str) -> tuple[bool, str | None] | None:
        """A restart of `flow` meets completed `method`: whether this replays an occurrence
        that completed, and the route it took (`Replay.meet`); None if not restarted here."""
        session = self._session_of(flow.flow_id, flow)
        if session is None or session.replay is None:
            return None
        with session.lock:
            return session.replay.meet(method)

    def _restart_output(self, flow: Flow[Any]) -> Any:
        """What a restart of `flow` that ran nothing returns: the output its head's step
        recorded, as the kickoff that ran that step returned it (None if not recorded)."""
        session = self._session_of(flow.flow_id, flow)
        if session is None or session.replay is None or session.output is None:
            return None
        if flow.method_outputs:
            return None  # something ran: CrewAI returns what ran last
        return codec.loads(session.output)

    def _finish(self, flow: Flow[Any], *, completed: bool, flow_id: str | None = None) -> None:
        """The run of `flow` ended (or failed): consume what it still owes and release it.

        `flow_id`: the id its kickoff claimed, when that differs from the flow's own (a
        kickoff that failed before CrewAI gave the flow the id of `inputs["id"]`). Such a
        kickoff owns only the session it opened (`_begin_restart`): one refused at its
        claim leaves alone the session of a `from_pending` of this context that holds the
        flow, which would otherwise pass for its own and be released, letting another
        resumer take the pause from the one that claimed it (P5, L1)."""
        session = self._session_of(flow_id or flow.flow_id, flow)
        if session is None:
            return
        if flow_id is not None and (session.owner is None or session.owner() is not flow):
            return
        if not self._owns(session, flow):
            return
        try:
            if completed and session.pending is not None:
                self._accept(session, flow)
            elif completed and session.replay is not None:
                self._keep_inputs(session, flow)
            # CrewAI saves a conversational turn's reply after the run ended, before its
            # kickoff returns: under this claim (`_end_turn`), else a turn another process
            # took meanwhile would be overwritten by this turn's older state, its messages
            # lost.
            session.turn_over = completed and _new_turn(flow)
        finally:
            _left_by_run(flow, session)
            if not session.turn_over:
                self._release(session)

    def _end_turn(self, flow: Flow[Any]) -> None:
        """The kickoff of a conversational turn of `flow` returned: release the claim its
        run kept for CrewAI's save of the reply (`_finish`)."""
        session = self._session_of(flow.flow_id, flow)
        if session is not None and session.turn_over and self._owns(session, flow):
            self._release(session)

    def _check_inputs(self, session: Session, flow: Flow[Any], ex: Execution) -> None:
        """Before the first step of `kickoff(inputs={"id": X, **more})` runs: the state CrewAI
        made by merging `more` into X's head must be valid as a save is (`CheckpointInvalid`
        naming the field, nothing run). An input is an external update of the state (P4):
        no step may act on, and apply effects with, a state no save would accept."""
        given = set(ex.inputs or ()) - {"id"}
        if not given:
            return  # no inputs but the id: the state is the head's, which validated
        if session.head is None:
            if isinstance(flow.state, dict):  # (CrewAI validates a model state's inputs)
                ids = {"run_id": session.run_id, "checkpoint_id": None}
                self._check_given(
                    session, {k: flow.state[k] for k in given if k in flow.state}, ids
                )
            return
        if ex.restart != session.flow_id:
            return
        with session.lock:
            self._plain_state(session, flow.state)

    def _check_given(self, session: Session, given: dict[str, Any], ids: dict[str, Any]) -> None:
        """The inputs of a new dict-state flow's kickoff, before its first step: each key
        as a save checks it (plain data; its part of `state_schema`). Rules on the
        state as a whole (`required`, ...) wait for the saves: a step may set the rest."""
        _check_inputs(given, self._schema(session, "state_schema"), ids)

    def _keep_inputs(self, session: Session, flow: Flow[Any]) -> None:
        """A restart that ended with a state its head does not hold: the inputs of
        `kickoff(inputs={"id": X, **more})`, which CrewAI merges into the restored state,
        and no step saved after (a finished flow runs none). Committed as an edit, so
        that the flow id loads the state the kickoff ended with, as with CrewAI's own
        backend (which runs every step again and saves each)."""
        ex = current_execution.get()
        if ex is None or ex.flow() is not flow or not set(ex.inputs or ()) - {"id"}:
            return  # no inputs but the id: the state is what the steps saved
        with session.lock:
            plain = self._plain_state(session, flow.state)
            # (A fork's head still holds the id of the flow it was forked from.)
            ended, kept = (
                {k: v for k, v in s.items() if k != "id"} for s in (plain, session.state)
            )
            if ended.keys() == kept.keys() and all(same(ended[k], kept[k]) for k in ended):
                return
            self._commit(session, plain, "", "edit", session.ledger, session.output)


def _carried_ledger(flow: Flow[Any]) -> Ledger:
    """The ledger a flow with no checkpoint starts from: empty, or, for a flow CrewAI
    restored from one of its own checkpoints under a new id (`Flow.fork`), the methods
    that checkpoint says completed, as often as it counted them. CrewAI skips them in
    this run; unrecorded, a restart of the flow would run them (and apply their effects)
    again."""
    ex = current_execution.get()
    if ex is None or ex.flow() is not flow or not ex.carried:
        return Ledger()
    return Ledger(completed=tuple(ex.carried), counts=dict(ex.carried))


def _done(ledger: Ledger) -> dict[str, int]:
    """Per method, how often it completed as of `ledger` (as a CrewAI checkpoint counts)."""
    return {**{m: 1 for m in ledger.completed}, **{m: n for m, n in ledger.counts.items() if n > 0}}


def _left_by_run(flow: Flow[Any], session: Session) -> None:
    """Note the head at which the kickoff running `flow` in this context gives the flow
    up, for the saves still running in its threads (`Execution.left`)."""
    ex = current_execution.get()
    if ex is not None and ex.flow() is flow:
        ex.left[session.flow_id] = session.head


def _edited_pause(
    head: CheckpointRecord | None,
) -> tuple[dict[str, str] | None, bytes | None, str | None]:
    """What an edit made on `head` keeps of the pause or feedback `head` ends (through
    earlier edits): which one it is, the pause's prompt and the branch its occurrence
    first ran on (`Body.edited`, `Body.first`). A prune may delete that checkpoint once
    the edit is the head, and a resume or restart still needs them."""
    if head is None:
        return None, None, None
    body = decode(head.state, run_id=head.run_id, checkpoint_id=head.checkpoint_id)
    if body.kind == "edit":
        return body.edited, body.prompt, body.first
    if body.kind not in ("pause", "feedback"):
        return None, None, None
    edited = {"kind": body.kind, "method": body.method, "checkpoint": head.checkpoint_id}
    first = body.first
    if first is None and head.branch != MAIN_BRANCH:
        first = head.branch  # (the fork's own: where the edit's line ran it)
    return edited, body.prompt if body.kind == "pause" else None, first


def _as_saved(flow_id: str, state: dict[str, Any]) -> dict[str, Any]:
    """A state read back by `flow_id` outside a kickoff: as it was saved, "id" or none
    and all (CrewAI's own backend returns it so), except on a fork, whose head until
    its first save of its own holds the id of the line it was forked from: there the
    fork's id."""
    run_id, branch = locate(flow_id)
    saved = state.get("id")
    forked_from = isinstance(saved, str) and (saved == run_id or saved.startswith(f"{run_id}@"))
    if branch != MAIN_BRANCH and forked_from:
        return {**state, "id": flow_id}
    return dict(state)


def _refuse_new_id(flow: Flow[Any], flow_id: str) -> None:
    """`CheckpointInvalid` naming `id` for a save of `flow` under `flow_id` while `flow`
    drives its run under another id (a step changed the state's id, then paused): CrewAI
    would go on saving it under the new id, a copy of the flow made silently. The id is
    put back, so that the run ends as the flow it is."""
    driving = sessions.owned_by(flow)
    if driving is None or driving.flow_id == flow_id:
        return
    flow._stamp_state_id(driving.flow_id)
    raise CheckpointInvalid(
        f"the flow's id was changed to {flow_id!r} while it ran: a flow keeps its id "
        "(CrewAI would go on saving it under the new one, a copy of this flow); nothing "
        "was saved. To continue a flow under another id, fork it",
        field="id",
        run_id=driving.run_id,
    )


def _pause_context(
    prompt: bytes | None, flow_id: str, *, run_id: str, interrupt_id: str, head: str | None
) -> PendingFeedbackContext:
    """The context of the pause at interrupt `interrupt_id`, as CrewAI reads it, or
    `CorruptRecord` naming the run, the interrupt and the head checkpoint if its stored
    form is not what Remit writes there: CrewAI's context of a pause at that interrupt's
    method (a context of another method would make the resume answer that method)."""
    try:
        if prompt is None:
            raise TypeError("the pause holds no context")
        context = _read_context(codec.loads(prompt), _interrupt_method(interrupt_id))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CorruptRecord(
            f"the pause's stored context is not one a CrewAI flow paused with ({exc})",
            run_id=run_id,
            interrupt_id=interrupt_id,
            checkpoint_id=head,
        ) from exc
    context.flow_id = flow_id
    return context


def _read_context(data: Any, method: str) -> PendingFeedbackContext:
    """CrewAI's context of a pause at `method` from its stored form `data`, or the
    `TypeError` / `ValueError` saying why `data` is not one."""
    if type(data) is not dict:
        raise TypeError(f"a pause's context is a dict, not {type(data).__name__}")
    for key in ("flow_id", "flow_class", "method_name"):
        if type(data.get(key)) is not str:
            raise TypeError(f"{key} holds a str, not {type(data.get(key)).__name__}")
    if data["method_name"] != method:
        raise ValueError(f"it is the context of a pause at {data['method_name']!r}")
    emit = data.get("emit")
    if emit is not None and (type(emit) is not list or not all(type(e) is str for e in emit)):
        raise TypeError("emit holds a list of str or None")
    return PendingFeedbackContext.from_dict(data)


def _stored_context(context: PendingFeedbackContext, method: str) -> bytes:
    """The stored form of `context` (JSON as CrewAI makes it, as its own backend stores
    it: an `emit` tuple becomes the list it reads back), or `TypeError` naming what the
    pause's reader would refuse as not a context CrewAI paused with: a context stored
    so could never be loaded or resumed, so it is refused before anything is written."""
    if not isinstance(context.requested_at, datetime.datetime):
        raise TypeError(
            "context.requested_at must be a datetime, got "
            f"{type(context.requested_at).__name__}; nothing was written"
        )
    data = context.to_dict()
    if type(data["emit"]) is tuple:
        data["emit"] = list(data["emit"])
    prompt = codec.dumps(data, exact=False)
    try:
        _read_context(codec.loads(prompt), method)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise TypeError(
            f"context cannot be stored as a pause CrewAI resumes: its {exc}; nothing was written"
        ) from exc
    return prompt


def _check_same_pause(
    flow: Flow[Any], claimed: PendingFeedbackContext, session: Session | None
) -> None:
    """`ResumeConflict` (the claim given back) if the pause a resume claimed is not the one
    `flow` was loaded for: that one was resumed by another resumer since, and the flow
    paused again; feedback meant for the first must not answer the second (P5)."""
    loaded = flow.pending_feedback
    if loaded is None or (loaded.method_name, loaded.requested_at) == (
        claimed.method_name,
        claimed.requested_at,
    ):
        return
    raise ResumeConflict(
        f"the feedback this flow was loaded for ({loaded.method_name!r}) was already given "
        f"by another resumer, and the flow now waits at {claimed.method_name!r}: nothing "
        "was resumed; load the flow again with from_pending to answer that",
        run_id=locate(flow.flow_id)[0],
        interrupt_id=None
        if session is None or session.pending is None
        else session.pending.interrupt_id,
    )


def _feedback_entry(
    interrupt: str, feedback: HumanFeedbackResult, output: Any, metadata: Any
) -> dict[str, Any]:
    """The ledger's record of accepted feedback (`Ledger.feedback`): what a restart
    rebuilds `last_human_feedback` from. `output` and `metadata` are JSON data."""
    return {
        "interrupt": interrupt,
        "method": feedback.method_name,
        "feedback": feedback.feedback,
        "outcome": feedback.outcome,
        "timestamp": feedback.timestamp,
        "output": output,
        "metadata": metadata or {},
    }


def _flow_of(session: Session) -> Flow[Any] | None:
    """The flow instance that drives `session`: its owner, else the kickoff's in this context."""
    flow = None if session.owner is None else session.owner()
    if flow is None:
        ex = current_execution.get()
        flow = None if ex is None else ex.flow()
    return flow if flow is not None and flow.flow_id == session.flow_id else None


def _joins_of(
    flow: Flow[Any], session: Session, paused: str
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...], dict[str, int]]:
    """Where CrewAI's joins of `flow` stand as `paused` pauses (`Ledger.joins`, `fired`,
    `running`). An `or_` listener still running has not completed: not fired yet."""
    running = {
        m: session.ledger.occurrence(m) for m, n in session.running.items() if n and m != paused
    }
    joins = {str(k): tuple(sorted(seen)) for k, seen in list(flow._pending_events.items()) if seen}
    with flow._or_listeners_lock:
        fired = tuple(sorted(str(m) for m in flow._fired_or_listeners if m not in running))
    return joins, fired, running


def _forget_last_run(flow: Flow[Any]) -> None:
    """Clear what CrewAI kept of an earlier run of the instance `flow` about to restart, as
    a new instance has it: CrewAI clears it only for a kickoff without an id, and a restart
    has one. Else an `or_` listener that failed in that run still counts as fired and
    never runs again (nor what follows it), a join sees triggers of that run, and the
    calls that run made count against `max_method_calls` (P1). The ledger is the past."""
    flow._pending_events.clear()
    flow._clear_or_listeners()
    flow._method_call_counts.clear()


def _new_turn(flow: Flow[Any]) -> bool:
    """Whether `flow` is kicked off for a turn of a conversational flow (`handle_turn`,
    `stream_turn`, `chat`): a new user message, which CrewAI answers with a new run of the
    flow's graph.
    Replayed as a restart, the turn would run nothing: no reply, and the message lost."""
    turn = getattr(flow, "_should_apply_pending_kickoff_context", None)
    return callable(turn) and bool(turn())


def _conversational(flow: Flow[Any]) -> bool:
    """Whether `flow` is a conversational flow (`conversational = True`), whose turns
    each run its graph anew."""
    enabled = getattr(flow, "_is_conversational_enabled", None)
    return callable(enabled) and bool(enabled())


def _leaves(condition: Any) -> set[str]:
    """The triggers a CrewAI listen condition (a name, or `{"and"|"or": [...]}`) names."""
    if isinstance(condition, str):
        return {condition}
    if isinstance(condition, dict):
        return {t for branch in [*condition.values()][0] for t in _leaves(branch)}
    return set()


def _history(ledger: Ledger) -> list[HumanFeedbackResult]:
    """The feedback the run accepted, as CrewAI keeps it (`human_feedback_history`)."""
    return [
        HumanFeedbackResult(
            output=f["output"],
            feedback=f["feedback"],
            outcome=f["outcome"],
            timestamp=f["timestamp"],
            method_name=f["method"],
            metadata=f["metadata"],
        )
        for f in ledger.feedback
    ]


def _rejoin(flow: Flow[Any], session: Session) -> None:
    """Give a resumed flow what it had when it paused, before its listeners run (a restart
    gets it from `_restore_into`): its joins, so that a join waiting on the paused method
    fires and an `or_` listener that ran does not run again, and the feedback it was given
    before (the resume adds its own). A method that was running beside the pause and
    completed after it was saved counts as it would have in the paused process; the
    resume runs its listeners, and runs again the methods running beside the pause that
    never completed (`Session.leftovers`): they are in the pause's frontier (P1)."""
    ledger = session.ledger
    late = ledger.completed_since_pause()
    unfinished = ledger.unfinished_at_pause()
    session.leftovers = (frozenset(unfinished), frozenset(late)) if unfinished | late else None
    joins = {k: set(seen) for k, seen in ledger.joins.items()}
    fired = set(ledger.fired)
    for name, _, condition in flow._listener_methods():
        if name in late | unfinished and isinstance(condition, dict) and "or" in condition:
            fired.add(str(name))  # (one the resume runs again is not fired a second time)
        seen = joins.get(str(name), set()) | (late & _leaves(condition))
        # A join still waiting; one these would complete fired in the paused process.
        if seen and isinstance(condition, dict) and not _condition_satisfied(condition, seen):
            joins[str(name)] = seen
    for key, seen in joins.items():
        flow._pending_events[PendingListenerKey(key)] = seen
    with flow._or_listeners_lock:
        flow._fired_or_listeners.update(FlowMethodName(m) for m in fired)
    flow.human_feedback_history = _history(ledger)


def _output_of(session: Session, method: str) -> bytes | None:
    """What `method` of the session's flow returned last, encoded, if the codec stores
    it exactly (a flow's output may be any object; one it cannot store is not kept)."""
    flow = None if session.owner is None else session.owner()
    entries = list(getattr(flow, "_method_outputs", ()))  # a copy: other steps append
    for entry in reversed(entries):
        if isinstance(entry, dict) and entry.get("method") == method:
            try:
                return codec.dumps(entry.get("output"))
            except (TypeError, ValueError, RecursionError):
                return None
    return None


def _resumed_output(session: Session) -> bytes | None:
    """What the feedback method a resume completes returns, encoded: CrewAI adds it to the
    flow's outputs only after this method's save. With `emit=` it is the method's output
    as the pause context holds it (what `from_pending` gave the flow); without, the
    feedback result, an object that is not kept."""
    pending = session.pending
    context = None if pending is None or pending.prompt is None else codec.loads(pending.prompt)
    if not isinstance(context, dict) or not context.get("emit"):
        return None
    return codec.dumps(context.get("method_output"))


def _as_json(value: Any) -> Any:
    """`value` as CrewAI keeps a feedback method's output in its pause context: plain
    data as it is, a model as its JSON data, anything else as its text."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    try:
        return codec.loads(codec.dumps(value, exact=False))
    except TypeError:
        return str(value)


def _as_model(model: type[BaseModel], data: Mapping[str, Any]) -> BaseModel | dict[str, Any]:
    """A model state handed over as a dict (CrewAI's `model_dump()` for a pause or an
    `ask()`, an edit merged into the head) as `model`: read by field name or alias, its
    computed fields dropped. The dict itself if it does not validate, so that the
    schema's validation names the field."""
    fields = {k: v for k, v in data.items() if k not in model.model_computed_fields}
    try:
        return model.model_validate(fields, by_name=True)
    except (ValidationError, TypeError):
        return fields


@functools.lru_cache(maxsize=256)
def _renamed(model: type[BaseModel]) -> bool:
    """Whether a field of `model`, or of a model, dataclass or TypedDict nested in it, is
    read or written by another name than its own (a nested model that reads a field by
    its alias only would refuse, or drop, the field stored by name)."""
    return _aliased(model.__pydantic_core_schema__)


def _aliased(node: Any, name: str | None = None) -> bool:
    """Whether pydantic core schema `node` (a field named `name`, or what holds fields)
    gives a field an alias other than its name."""
    if isinstance(node, (list, tuple)):
        return any(_aliased(item) for item in node)
    if not isinstance(node, Mapping):
        return False
    own = node.get("name", name)
    if any(node.get(k) not in (None, own) for k in ("validation_alias", "serialization_alias")):
        return True
    return any(
        any(_aliased(f, str(n)) for n, f in value.items())
        if key == "fields" and isinstance(value, Mapping)
        else _aliased(value)
        for key, value in node.items()
    )


def _by_field_name(model: type[BaseModel], state: Mapping[str, Any]) -> dict[str, Any]:
    """A stored state of `model` keyed by field name (`_dump_model` keys it by alias when
    the model reads a field by its alias only), so that an edit by field name replaces
    the stored value instead of losing to it."""
    names = {
        f.serialization_alias: name
        for name, f in model.model_fields.items()
        if f.serialization_alias is not None and f.serialization_alias != name
    }
    return {names.get(k, k): v for k, v in state.items()}


def _snapshot(value: Any) -> Any:
    """`value` with each dict, list, set and tuple in it (a model's fields and extra fields
    too) copied, so that checking and encoding it reads what it held at the save.

    CrewAI saves an async step's completion in a thread while the event loop runs the
    step's siblings on the same state: read live, a dict a sibling adds a key to
    meanwhile fails the save ("dictionary changed size during iteration") and with it
    the flow. Each container is copied in one C call, which no other thread interrupts;
    only exact built-in types are copied (a subclass stays as it is, to be refused by
    type), so what is checked is what is stored."""
    kind = type(value)
    if kind is dict:
        return {key: _snapshot(item) for key, item in value.copy().items()}
    if kind is list:
        return [_snapshot(item) for item in value.copy()]
    if kind is tuple:
        return tuple(_snapshot(item) for item in value)
    if kind is set:
        return value.copy()
    if isinstance(value, BaseModel):
        copied = value.model_copy()  # a new `__dict__` (and extra dict), in C calls
        for name, item in copied.__dict__.items():
            copied.__dict__[name] = _snapshot(item)
        extra = copied.__pydantic_extra__
        if extra:
            for name, item in extra.items():
                extra[name] = _snapshot(item)
        return copied
    return value


def _mixed_dump(state: BaseModel, *, by_alias: bool) -> dict[str, Any]:
    """`state`'s Python-mode fields, each one the codec would not store exactly (`inexact`)
    in its JSON form instead (`ValueError` if that has none); its extra fields too, which
    the dump holds beside the declared ones."""
    stored = state.model_dump(mode="python", round_trip=True, by_alias=by_alias)
    for name in [*type(state).model_fields, *(state.model_extra or {})]:
        one = state.model_dump(mode="python", round_trip=True, by_alias=by_alias, include={name})
        if inexact(one) is not None:
            stored.update(
                state.model_dump(mode="json", round_trip=True, by_alias=by_alias, include={name})
            )
    return stored


def _types_kept(state: BaseModel, stored: dict[str, Any], ids: Mapping[str, Any]) -> dict[str, Any]:
    """`stored`, the form of `state` to store, if its model reads every model (or
    dataclass) `state` holds back as that same type; else `CheckpointInvalid` naming the
    first field that would come back as another type. The stored form records no types
    (reading imports no names), so a field that takes several models (a union without a
    discriminator, `Any`, a base class given a subclass) reads back whichever its data
    fits first: after a restart the flow would go on with another state than its own."""
    if not _holds_models(state, top=True):
        return stored
    try:
        back: Any = type(state).model_validate(stored)
    except (TypeError, ValueError):
        return stored  # (what does not read back at all is refused by the model's own check)
    found = _retyped(state, back, "")
    if found is None:
        return stored
    path, kind, other = found
    raise CheckpointInvalid(
        f"state field {path} holds a {type_name(kind)}, which its model reads back as "
        f"{'a ' + type_name(other) if other is not type(None) else 'None'}: Remit stores a "
        "model's values without their types (reading imports no names), so a field that "
        "takes several types (a union without a discriminator, Any, a base class given a "
        "subclass) must tell them apart by its data; give the models a Literal field to "
        "discriminate them, or declare the field's exact type; nothing was written",
        field=path,
        **ids,
    )


def _is_record(value: Any) -> bool:
    """Whether `value` is a pydantic model or a dataclass instance."""
    return isinstance(value, BaseModel) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def _parts(value: Any) -> Iterator[tuple[Any, Any]]:
    """The (key, item) pairs `value` holds: a model's or dataclass's fields (a model's
    extra fields too, which its model reads back as it reads an `Any` field), a dict's
    items, a list's or tuple's items by index."""
    if isinstance(value, BaseModel):
        yield from ((n, getattr(value, n, None)) for n in type(value).model_fields)
        yield from (value.model_extra or {}).items()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        yield from ((f.name, getattr(value, f.name, None)) for f in dataclasses.fields(value))
    elif isinstance(value, dict):
        yield from value.items()
    elif isinstance(value, (list, tuple)):
        yield from enumerate(value)


def _holds_models(value: Any, *, top: bool = False) -> bool:
    """Whether `value` holds a model or dataclass below its top."""
    if not top and _is_record(value):
        return True
    return any(_holds_models(item) for _, item in _parts(value))


def _retyped(value: Any, back: Any, path: str) -> tuple[str, type, type] | None:
    """The path, type and type read back of the first model or dataclass in `value` that
    `back` (its reading from storage) holds as another type, or None."""
    if _is_record(value) and type(back) is not type(value):
        return path or "<root>", type(value), type(back)
    held = dict(_parts(back))
    for key, item in _parts(value):
        if key not in held:
            continue
        if isinstance(value, (list, tuple)):
            where = f"{path}[{key}]"
        else:
            where = f"{path}.{key}" if path else str(key)
        found = _retyped(item, held[key], where)
        if found is not None:
            return found
    return None


def _reads_back(model: type[BaseModel], plain: Mapping[str, Any]) -> bool:
    """Whether `model` reads `plain` (a state's Python-mode fields) back as the same values:
    CrewAI restores a state with the model's `model_validate`, whose validators may change
    what a step assigned unvalidated."""
    try:
        back = model.model_validate(plain).model_dump(mode="python", round_trip=True)
    except (TypeError, ValueError):
        return False
    return same(dict(plain), back)


def _numbers_as_declared(state: BaseModel, plain: Mapping[str, Any]) -> BaseModel | None:
    """`state` as its model reads it back, if that changes only ints a step assigned
    without `validate_assignment` to float or Decimal fields, each into that same number
    (as `validate_assignment` or CrewAI's own restore would), and keeps the type of every
    model it holds; else None. Stored so, the state is what a restart continues with."""
    try:
        back = type(state).model_validate(dict(plain), by_name=True)
        read = back.model_dump(mode="python", round_trip=True)
    except (TypeError, ValueError):
        return None
    if same(dict(plain), read) or not same(dict(plain), read, widened=True):
        return None
    return back if _retyped(state, back, "") is None else None


def _first_change(plain: Mapping[str, Any], back: Mapping[str, Any] | None) -> str:
    """The first field of `plain` that `back` (its model's reading of it) lost or changed."""
    for key, value in plain.items():
        if back is None or key not in back or not same(value, back[key]):
            return str(key)
    return "<root>"


def _class_name(flow: Flow[Any]) -> str:
    """The flow class of `flow` as its checkpoints record it: `module.Qualname`, and for a
    flow built from a declaration (an instance of CrewAI's own class, as every declared
    flow is) its declared name too (`crewai.flow.flow.Flow:Orders`): else any declared
    flow would continue any other's, skipping its own methods that share a name."""
    cls = type(flow)
    name = f"{cls.__module__}.{cls.__qualname__}"
    return f"{name}:{flow._definition.name}" if _declared(cls) else name


def _declared(cls: type) -> bool:
    """Whether `cls` is CrewAI's own flow class (a flow built from a declaration)."""
    return cls.__module__.split(".")[0] == "crewai"


def _same_class(saved: str, flow: Flow[Any]) -> bool:
    """Whether `saved` (`_class_name`) names the flow class of `flow`, under whichever
    module name: one process may run the flow's file as `__main__` and another import it
    as a module (a recovery script), or a package may be imported by another path. The
    class name decides (a declared flow's name with it); a class of another name is
    another flow. A declared flow saved before its name was recorded is not checked."""
    cls = type(flow)
    short = cls.__qualname__
    if _declared(cls):
        if saved == f"{cls.__module__}.{short}":
            return True
        short = f"{short}:{flow._definition.name}"
    return saved == short or saved.endswith(f".{short}")


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _keys(value: Any) -> tuple[str, ...] | None:
    """A list of str recorded with a checkpoint, as a tuple; None if it is not one."""
    if isinstance(value, list) and all(isinstance(k, str) for k in value):
        return tuple(value)
    return None


def _initial_keys(flow: Flow[Any]) -> tuple[str, ...]:
    """The keys of `flow`'s `initial_state` dict (none if its class declares none)."""
    initial = getattr(flow, "initial_state", None)
    return tuple(sorted(str(k) for k in initial if k != "id")) if isinstance(initial, dict) else ()


def _added_since(
    flow: Flow[Any], state: Mapping[str, Any], known: tuple[str, ...] | None
) -> dict[str, Any]:
    """The defaults `flow` continues its saved dict `state` with: the keys of its class's
    `initial_state` dict that the class did not declare (`known`, recorded with the
    checkpoint) when `state` was saved, added since by a later deployment, each with its
    default, as a new flow starts with it. CrewAI clears a dict state before it restores
    one, so such a key would be missing, where a model state gets the default of a field
    added since. A known key that `state` lacks was deleted by a step: it stays deleted,
    as in an uninterrupted run (P6). `known` None (a checkpoint saved before the keys
    were recorded): every key of `initial_state` that `state` lacks."""
    initial = getattr(flow, "initial_state", None)
    if not isinstance(initial, dict):
        return {}
    return {
        k: copy.deepcopy(v)
        for k, v in initial.items()
        if k != "id" and k not in state and k not in (known or ())
    }


def _name(model: type[BaseModel]) -> str:
    """The user's model a state type is (CrewAI wraps it in a class of its own)."""
    own = next(
        (
            c
            for c in model.__mro__
            if issubclass(c, BaseModel)
            and c is not BaseModel
            and c.__module__.split(".")[0] != "crewai"
        ),
        model,
    )
    return f"{own.__module__}.{own.__qualname__}"


def _lost(model: type[BaseModel], state: Mapping[str, Any], plain: Mapping[str, Any]) -> str | None:
    """The first key of a stored `state` that `plain`, its reading by `model`, dropped (a
    model other than the one that saved it, which ignores the keys it does not know)."""
    kept = _by_field_name(model, plain)
    lost = sorted(str(k) for k in _by_field_name(model, state) if k not in kept)
    return lost[0] if lost else None


def _check_kept(
    model: type[BaseModel], state: Mapping[str, Any], plain: Mapping[str, Any], flow_id: str
) -> None:
    """`CheckpointInvalid` for an edit whose model `model` would drop a field the flow's
    stored `state` holds (a model other than the flow's passed as `state_type`): the
    edit would lose it."""
    lost = _lost(model, state, plain)
    if lost is not None:
        raise CheckpointInvalid(
            f"{model.__name__} has no field {lost!r}, which the flow's state holds: the "
            "edit would drop it (is state_type the flow's state model?); nothing was written",
            field=lost,
            run_id=flow_id,
        )


def _refused_state(
    flow_class: type[Any], session: Session, error: BaseException
) -> VersionMismatch | None:
    """`VersionMismatch` naming the model that saved the paused flow of `session` and the
    field, if `error` is CrewAI's refusal of that state by `flow_class`'s state model as
    `from_pending` loads it (a bare `ValueError`, its cause pydantic's `ValidationError`):
    the model was reshaped since the pause (a type narrowed, a field it now forbids). A
    restart by id of the same flow is refused so (`_check_model_restart`); None for any
    other error."""
    cause = error.__cause__
    if not isinstance(error, ValueError) or not isinstance(cause, ValidationError):
        return None
    errors = cause.errors()
    field = field_path(tuple(errors[0].get("loc", ())) if errors else ())
    return VersionMismatch(
        f"the paused flow's state was saved by {session.model or 'a dict state'}, and the "
        f"state model of {flow_class.__name__} does not read its field {field!r}: resume it "
        "with the class that saved it; nothing was resumed, and the flow still waits for "
        "its feedback",
        field=field,
        run_id=session.run_id,
        checkpoint_id=session.head,
    )


@functools.lru_cache(maxsize=256)
def _with_id(model: type[BaseModel]) -> type[BaseModel]:
    """`model` as CrewAI runs a flow on it: with the `id` field of CrewAI's `FlowState`
    if it has none (an edit validated against the user's model alone would drop the
    flow's id, or be refused by a model that forbids extra fields), named as `model`."""
    if "id" in model.model_fields:
        return model
    named = {"__module__": model.__module__, "__qualname__": model.__qualname__}
    return type(model.__name__, (FlowState, model), named)


def _check_fields(model: type[BaseModel], changes: Mapping[str, Any], flow_id: str) -> None:
    """`CheckpointInvalid` for an edit naming a field `model` does not have (a model
    that ignores unknown fields would drop it, and the edit would change nothing)."""
    if model.model_config.get("extra") == "allow":
        return
    known = {"id", *model.model_fields}
    known |= {f.alias for f in model.model_fields.values() if f.alias}
    unknown = sorted(str(k) for k in changes if k not in known)
    if unknown:
        raise CheckpointInvalid(
            f"{model.__name__} has no field {unknown[0]!r}; the edit was not written",
            field=unknown[0],
            run_id=flow_id,
        )
