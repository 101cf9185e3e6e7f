"""`RemitRuntime`: LlamaIndex Workflows runs that keep the Resume Contract.

Plugged where the framework takes a runtime, so workflow code is unchanged:

    rt = RemitRuntime("postgresql://...")
    wf = OrderFlow(runtime=rt)
    handler = wf.run(run_id="order-1", order_id="o-1")     # every tick committed
    ...                                                    # later, any process:
    handler = await rt.respond(wf, "order-1", HumanResponseEvent(response="ok"))

It decorates the framework's asyncio runtime: steps run as usual, while each
reduced tick becomes a Remit checkpoint under the run's leased, fenced claim
(`remit_llamaindex._run`). A context snapshot (`ctx.to_dict()`) of a Remit run
carries a handle to its checkpoint instead of the state values, so restoring
it continues the same run; restoring a checkpoint that is no longer the head
is a fork and needs a fork token (`context(..., fork_token=...)`). Running a
context of a run that has ended starts a new run, under its own id, with the
ended run's state (the framework's contexts carry state across runs so).

A workflow a step starts without a `run_id` is a child run named after that
step execution (`remit_llamaindex._child`): when the step runs again after a
crash, it finds the same child, which answers from the store if it had ended
and continues from its checkpoints if not, so its effects apply once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from workflows.context.context import Context
from workflows.context.serializers import BaseSerializer, JsonSerializer
from workflows.context.state_store import (
    DictState,
    StateStore,
    create_in_memory_payload,
    infer_state_type,
)
from workflows.context.state_store_integration import decode_seed_state
from workflows.errors import WorkflowCancelledByUser, WorkflowRuntimeError
from workflows.events import (
    Event,
    StartEvent,
    StopEvent,
    WorkflowCancelledEvent,
    WorkflowFailedEvent,
)
from workflows.handler import WorkflowHandler
from workflows.plugins.basic import BasicRuntime, get_current_run_id
from workflows.runtime.runtime_decorators import (
    BaseExternalRunAdapterDecorator,
    BaseInternalRunAdapterDecorator,
    BaseRuntimeDecorator,
)
from workflows.runtime.types.internal_state import BrokerState
from workflows.runtime.types.plugin import (
    ExternalRunAdapter,
    InternalRunAdapter,
    RegisteredWorkflow,
    Runtime,
    SnapshottableAdapter,
    V2RuntimeCompatibilityShim,
    WaitResult,
    WaitResultTick,
    as_v2_runtime_compatibility_shim,
)
from workflows.runtime.types.results import (
    RetryAttempt,
    SentEvent,
    StepWorkerOutput,
    StepWorkerState,
)
from workflows.runtime.types.step_function import StepWorkerFunction
from workflows.runtime.types.step_id import StepId
from workflows.runtime.types.ticks import TickAddEvent, WorkflowTick
from workflows.workflow import Workflow

from remit_core import codec, connect, failpoints, policy
from remit_core.core import DEFAULT_LEASE, Remit, checked_id, checked_lease
from remit_core.effects import scoped
from remit_core.errors import (
    CorruptRecord,
    ForkWithoutIntent,
    RemitError,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
)
from remit_core.records import MAIN_BRANCH, BranchRecord, CheckpointRecord
from remit_core.schema import StateSchema
from remit_core.stores import check_url
from remit_llamaindex import _child
from remit_llamaindex import _snapshot as snap
from remit_llamaindex._run import (
    _PARKING,
    Session,
    check_awaited,
    check_event_model,
    check_is_event,
    checked_new_run_id,
    new_checkpoint_id,
    public_run_id,
    split_run_id,
    validated_event,
)
from remit_llamaindex._state import RemitStateStore
from remit_llamaindex._storable import check_event_storable, checked_state, set_path

logger = logging.getLogger("remit_llamaindex")
_FIRST_ATTEMPT = RetryAttempt()


class PauseAnswered(ResumeConflict, ForkWithoutIntent):
    """A restored pause whose question another resumer answered meanwhile (P5).

    Two copies restored from one paused snapshot (`Context.from_dict` of the same
    `ctx.to_dict()`, or `RemitRuntime.context` at that pause's checkpoint) race to
    answer it: the first answer moves the run on, and a copy restored after that
    restores a checkpoint that is no longer its branch's head. It lost the race, it
    asked for no fork: a `ResumeConflict`, as every other losing resumer's refusal; and,
    for code that caught it as such before, still a `ForkWithoutIntent`. Nothing ran
    and nothing was stored. `exc.head_id` is the branch's head when it was refused."""

    def __init__(self, message: str, *, head_id: str | None = None, **ids: Any) -> None:
        super().__init__(message, **ids)
        self.head_id = head_id


@dataclass(frozen=True)
class RunCheckpoint:
    """One committed checkpoint of a run, as `RemitRuntime.checkpoints` lists it."""

    checkpoint_id: str
    parent_id: str | None
    branch: str
    status: str
    step: str | None
    next_steps: tuple[str, ...]
    waiting: tuple[str, ...]


class RemitRuntime(BaseRuntimeDecorator):
    """A LlamaIndex runtime whose runs persist in Remit and resume under the contract.

    `url`: a Remit store (sqlite:///file.db, postgresql://..., redis://...).
    `lease`: seconds a driving process holds a run without renewing.
    `workflow_version`: written on every checkpoint; a checkpoint written by
    any other version (not in `accept_versions`) is refused with `VersionMismatch`.
    `schema`: the state schema; by default the workflow's `Context[State]` model.
    """

    def __init__(
        self,
        url: str = "sqlite:///remit.db",
        *,
        lease: float = DEFAULT_LEASE,
        workflow_version: str = "",
        accept_versions: Iterable[str] = (),
        schema: StateSchema | None = None,
        decorated: Runtime | None = None,
    ) -> None:
        super().__init__(decorated if decorated is not None else BasicRuntime())
        # Refused here, not at the first run: a mistyped URL or lease, and versions that
        # no stored checkpoint could name (a str taken as its characters, or no str).
        self.url = check_url(url)
        self.lease = checked_lease(lease)
        self.workflow_version = workflow_version
        self.accepted_versions = _checked_versions(workflow_version, accept_versions)
        if schema is not None and not isinstance(schema, StateSchema):
            raise TypeError(
                "schema must be a remit_core StateSchema (e.g. StateSchema(MyState)) or None, "
                f"not {type(schema).__name__}"
            )
        self.schema = schema
        self._remit: Remit | None = None
        self._remit_pid = -1
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        _child.record_draws()

    @property
    def remit(self) -> Remit:
        """The `Remit` facade of this process (a forked child opens its own connections)."""
        if self._remit is None or self._remit_pid != os.getpid():
            self._remit = connect(self.url, lease=self.lease)
            self._remit_pid = os.getpid()
        return self._remit

    # -- the framework's runtime interface -------------------------------------------
    @contextlib.contextmanager
    def registering(self) -> Iterator[Runtime]:
        """Workflows made inside the block run on this runtime (`with rt.registering():`,
        the framework's other plug point). The framework's decorator base hands the block
        to the runtime it decorates, whose runs Remit would never see: not one would be
        stored, without a word."""
        with Runtime.registering(self) as runtime:
            yield runtime

    def register(self, workflow: Workflow) -> RegisteredWorkflow:
        registered = self._decorated.register(workflow)
        return RegisteredWorkflow(
            workflow=registered.workflow,
            workflow_run_fn=registered.workflow_run_fn,
            steps={name: self._scoped(fn) for name, fn in registered.steps.items()},
        )

    def _scoped(self, fn: StepWorkerFunction) -> StepWorkerFunction:
        """Run a step in its effect scope (`Session.effect_scope`): its `@effect` calls get
        deterministic keys, and a fork shares the calls made before its base."""

        async def step(
            state: StepWorkerState,
            step_name: str,
            event: Event,
            workflow: Workflow,
            bound_events: dict[str, Event] | None = None,
            retry: RetryAttempt = _FIRST_ATTEMPT,
        ) -> list[StepWorkerOutput]:
            session = self._sessions.get(get_current_run_id() or "")
            if session is None:
                return await fn(state, step_name, event, workflow, bound_events, retry)
            delivered = session.rerun_sends(
                step_name, state.work_item_id, state.invocation_id, retry.retry_number
            )
            scope = session.effect_scope(step_name, state.work_item_id)
            with scoped(scope), _child.step_execution(session.run_id, scope, retry.retry_number):
                failpoints.hit("step.before")
                output = await fn(state, step_name, event, workflow, bound_events, retry)
            # A send delivered before the crash is left out of the result too, or the
            # framework would hold it as undelivered and deliver it later.
            return [o for o in output if not (isinstance(o, SentEvent) and o.index in delivered)]

        return step

    def get_serializer(self, workflow: Workflow) -> JsonSerializer:
        return snap.require_json(self._decorated.get_serializer(workflow))

    def run_workflow(
        self,
        run_id: str,
        workflow: Workflow,
        init_state: BrokerState,
        start_event: StartEvent | None = None,
        serialized_state: dict[str, Any] | None = None,
        serializer: BaseSerializer | None = None,
    ) -> ExternalRunAdapter:
        json_ser = snap.require_json(serializer or self.get_serializer(workflow))
        if start_event is not None:
            # Refused before anything is stored: a value its own model refuses (set
            # after construction), or one a step re-run after a crash would see as
            # the other value the checkpoint gives back.
            outcome = "the run was not started and nothing was stored"
            check_event_model(start_event, outcome, qualified=True, run_id=run_id)
            check_event_storable(start_event, json_ser, outcome, qualified=True, run_id=run_id)
        if snap.is_handle(serialized_state):
            assert serialized_state is not None
            snap.check_handle(serialized_state)
        drawn = _child.was_drawn(run_id)
        execution = _child.current_execution()
        child = None
        found: Session | _child.EndedRun | None = None
        if start_event is None and snap.is_handle(serialized_state):
            assert serialized_state is not None
            found = self._restored(workflow, serialized_state, json_ser, snapshot=init_state)
        elif execution is not None and drawn:
            child = execution.next_child()
            found = self._child_session(
                workflow, child, init_state, serialized_state, json_ser, execution
            )
        elif execution is not None:
            found = self._named_child(workflow, run_id, execution, json_ser)
            child = None if found is None else run_id
        if found is None:
            found = self._fresh(workflow, run_id, init_state, serialized_state, json_ser)
        if isinstance(found, _child.EndedRun):
            return found
        session = found
        if child is not None and session.head_id is not None:
            start_event = None  # the stored run took its start event already
        if execution is not None and session.head_id is None:
            session.parent = execution.slot
        stored = session.head_id is not None
        parked = stored and (snap.is_idle(session.init_state) or not session.init_state.is_running)
        if start_event is not None or session.injections or not parked:
            try:
                session.take_claim()
            except ResumeConflict:
                if child is None:
                    raise
                # A child started again after a crash may find the dead process's claim
                # on it: its first tick takes the claim once that lease runs out.
                session.claim_patience = self.lease
        session.starting = start_event is not None and not session.init_state.is_running
        try:
            with self._lock:
                self._sessions[session.inner_id] = session
            with _child.outside_steps():
                inner = self._decorated.run_workflow(
                    session.inner_id,
                    workflow,
                    session.init_state,
                    start_event=start_event,
                    serializer=json_ser,
                )
        except BaseException:
            self._forget(session)
            raise
        session.inner = inner
        asyncio.get_running_loop().create_task(self._watch(session))
        return _External(inner, session)

    def _fresh(
        self,
        workflow: Workflow,
        run_id: str,
        init_state: BrokerState,
        serialized_state: dict[str, Any] | None,
        serializer: JsonSerializer,
    ) -> Session:
        """A new Remit run (a vanilla snapshot's state is imported, lineage unknown).

        A running context without a state (`ctx.to_dict(include_state=False)`) is
        refused: a Remit run's identity is its state's handle, so it would go on as an
        untracked copy of the run it was taken from (a second branch without a fork
        token, as many as it is restored; its effects again)."""
        run_id = checked_new_run_id(run_id)
        if init_state.is_running and not serialized_state:
            raise ForkWithoutIntent(
                "the context is of a running workflow but holds no state "
                "(ctx.to_dict(include_state=False)), and a Remit run is named by its "
                "state: continued, it would be an untracked copy of the run it was taken "
                "from. Nothing was stored: restore a snapshot taken with its state "
                "(ctx.to_dict()) or RemitRuntime.context(workflow, run_id); to continue it "
                "as a new run, give it a state first (snapshot['state'], or ctx.store)",
                run_id=run_id,
            )
        if self.remit.branch(run_id) is not None:
            raise ForkWithoutIntent(
                f"run {run_id!r} already exists; continue it from RemitRuntime.context(...) "
                "or start a run with a new id",
                run_id=run_id,
            )
        return self._new(workflow, run_id, init_state, serialized_state, serializer)

    def _new(
        self,
        workflow: Workflow,
        run_id: str,
        init_state: BrokerState,
        serialized_state: dict[str, Any] | None,
        serializer: JsonSerializer,
    ) -> Session:
        """The session of a run with no checkpoint yet. A context of a Remit run that
        is not running (it ended) carries its state into the new run, as the
        framework's contexts do across runs (`_carried_state`)."""
        if snap.is_handle(serialized_state):
            assert serialized_state is not None
            state = self._carried_state(workflow, run_id, serialized_state, serializer)
        elif serialized_state:
            state = self._seed(workflow, run_id, serialized_state, serializer)
        else:
            state = infer_state_type(workflow)()
        return self._session(
            workflow, serializer, run_id, MAIN_BRANCH, None, None, init_state, state
        )

    def _seed(
        self,
        workflow: Workflow,
        run_id: str,
        payload: dict[str, Any],
        serializer: JsonSerializer,
    ) -> BaseModel:
        """The state a context of the framework's own seeds a new run with (P4; nothing
        is stored yet). A workflow that declares its model gets the seed's values
        validated into that model (`CheckpointInvalid` naming the field): an untyped
        seed's values, or a typed seed's fields, which are never built as the class the
        payload names (a dict written by hand may name any class, whose validators would
        run on read)."""
        schema = self._schema(workflow)
        fields = snap.state_fields(payload)
        if schema is None or infer_state_type(workflow) is DictState:
            # A seed's fields are checked first: decoding it would raise pydantic's own
            # error, not one naming the field.
            if schema is not None and fields is not None:
                schema.validate(fields, run_id=run_id)
            return snap.seed_state(payload, serializer, run_id=run_id)
        values: Any = fields
        if values is None:
            seeded = snap.seed_state(payload, serializer, run_id=run_id)
            values = dict(seeded.items()) if isinstance(seeded, DictState) else seeded
        validated: BaseModel = schema.validate(values, run_id=run_id)
        return validated

    def _carried_state(
        self,
        workflow: Workflow,
        run_id: str,
        handle: dict[str, Any],
        serializer: JsonSerializer,
    ) -> BaseModel:
        """The state a run started with the context of an ended run begins with (its own
        run, under its own id; the ended run is only read): the context's live state
        the handle carries (`snap.carried_handle`), validated as a seed, else the
        state at the checkpoint it names. A context taken before the run's first
        checkpoint names none: the new run begins with a fresh state."""
        carried = snap.carried_state(handle)
        if carried is not None:
            return self._seed(workflow, run_id, carried, serializer)
        checkpoint_id = handle.get("checkpoint_id")
        if checkpoint_id is None:
            return infer_state_type(workflow)()
        record = self._checkpoint(handle["run_id"], checkpoint_id)
        ctx = snap.decode(record.state, run_id=record.run_id, checkpoint_id=record.checkpoint_id)
        return self._state(workflow, record, ctx, serializer)

    def _child_session(
        self,
        workflow: Workflow,
        run_id: str,
        init_state: BrokerState,
        serialized_state: dict[str, Any] | None,
        serializer: JsonSerializer,
        execution: _child.StepExecution,
    ) -> Session | _child.EndedRun:
        """A child run a step starts (`_child`): new the first time; when the step runs
        again after a crash, the stored run, ended (answered from the store) or not
        (continued from its head). A retry's child is the completed child of the step's
        latest earlier attempt that started this one (its effects are not applied again,
        P2), else a new run."""
        branch = self.remit.branch(run_id)
        if branch is None or branch.head_id is None:
            for earlier_id in execution.earlier_attempts(run_id):
                earlier = self.remit.branch(earlier_id)
                if earlier is None or earlier.head_id is None:
                    continue
                record = self._checkpoint(earlier_id, earlier.head_id)
                if record.metadata.get("status") == snap.COMPLETED:
                    return self._ended_run(workflow, record, serializer)
                break  # (it failed or did not end: the retry starts its own)
            return self._new(workflow, run_id, init_state, serialized_state, serializer)
        handle = {"run_id": run_id, "branch": MAIN_BRANCH, "checkpoint_id": branch.head_id}
        return self._restored(workflow, handle, serializer)

    def _named_child(
        self,
        workflow: Workflow,
        run_id: str,
        execution: _child.StepExecution,
        serializer: JsonSerializer,
    ) -> Session | _child.EndedRun | None:
        """The stored run a step started under the id its code gave, started again by
        the same step execution (re-run after a crash, or retried, or on a fork whose
        shared prefix started it): ended, it answers from the store; not ended, it
        continues from its head (P1, P2, P3). None when no run
        is stored under the id, or another one is (started by other code, or a second
        time by this execution): `_fresh` starts the one or refuses the other."""
        starter = execution.starter(run_id)
        if not execution.starts_again(run_id) or split_run_id(run_id)[1] != MAIN_BRANCH:
            return None
        branch = self.remit.branch(run_id)
        if branch is None or branch.head_id is None:
            return None
        record = self._checkpoint(run_id, branch.head_id)
        if record.metadata.get("parent") != starter:
            return None
        handle = {"run_id": run_id, "branch": MAIN_BRANCH, "checkpoint_id": branch.head_id}
        return self._restored(workflow, handle, serializer)

    def _ended_run(
        self, workflow: Workflow, record: CheckpointRecord, serializer: JsonSerializer
    ) -> _child.EndedRun:
        """The handle of a run that has ended: its stored result, error and state."""
        ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
        ctx = snap.decode(record.state, **ids)
        init = snap.broker_state(ctx, workflow, serializer, **ids)
        state = self._state(workflow, record, ctx, serializer)
        handle = {"store_type": snap.HANDLE_TYPE, "branch": record.branch, **ids}
        store: RemitStateStore[Any] = RemitStateStore(
            state,
            schema=self._schema(workflow),
            serializer=serializer,
            ids=lambda: ids,
            handle=lambda: snap.carried_handle(handle, store.payload(serializer)),
        )
        key = public_run_id(record.run_id, record.branch)
        status = record.metadata.get("status")
        if status == snap.COMPLETED:
            stop = snap.stop_event(record.metadata.get("result"), serializer, **ids)
            return _child.EndedRun(key, init, store, lambda: stop)
        error = str(record.metadata.get("error") or status)

        def raised() -> StopEvent:
            if status == snap.CANCELLED:
                raise WorkflowCancelledByUser()
            raise _child.RunFailed(
                f"the run had already failed when it was started again ({error})",
                error=error,
                **ids,
            )

        return _child.EndedRun(key, init, store, raised)

    def _answered_pause(
        self,
        run_id: str,
        base_id: str,
        branch: BranchRecord,
        snapshot: BrokerState | None = None,
    ) -> PauseAnswered | None:
        """The refusal of a restore of `base_id`, a pause of `branch` that is no longer its
        head, if a question it waited on was answered (its interrupt consumed): the
        restoring copy lost a race to answer it (P5), it did not ask for a fork. None for
        any other non-head checkpoint (time travel: a plain `ForkWithoutIntent`).

        A pause deleted since (`Remit.prune`, which keeps heads and fork bases only) is
        told by its questions, whose interrupts outlive the checkpoint: the ones raised
        at it, and the waiters the restored `snapshot` holds. A copy that lost the race
        is no less a loser for the pause's record being gone."""
        try:
            record = self.remit.checkpoint(run_id, base_id)
        except RemitError:  # (unreadable: refused as any other non-head restore)
            return None
        waiting: list[str]
        if record is None:
            raised = self.remit.interrupts(run_id, branch=branch.branch, checkpoint_id=base_id)
            held = () if snapshot is None else snap.waiters(snapshot)
            waiting = [i.interrupt_id for i in raised]
            waiting += [w.interrupt_id for w in held if w.pending]
        else:
            on_branch = (
                record.branch == branch.branch or base_id == branch.base_id  # (a fork's base)
            )
            if not on_branch or record.metadata.get("status") != snap.WAITING:
                return None
            waiting = [str(w) for w in record.metadata.get("waiting", ())]
        key = public_run_id(run_id, branch.branch)
        again = (
            "pass a fork token to answer it again on a branch of its own"
            if record is not None
            else "its checkpoint was deleted since (pruned), so no fork can start from it"
        )
        for waiter in waiting:
            found = self.remit.interrupt(run_id, waiter, branch=branch.branch)
            if found is not None and found.status == "consumed":
                return PauseAnswered(
                    f"the pause restored at checkpoint {base_id!r} of run {key!r} was "
                    f"answered already (its question {found.interrupt_id!r} was answered by "
                    f"another resumer, and the run moved on to {branch.head_id!r}); this "
                    "copy lost the race to answer it: nothing ran and nothing was stored. "
                    "Restore the run's head (RemitRuntime.context(workflow, run_id)) and read "
                    f"rt.status/rt.result; or {again}",
                    run_id=key,
                    checkpoint_id=base_id,
                    interrupt_id=found.interrupt_id,
                    head_id=branch.head_id,
                )
        return None

    def _restored(
        self,
        workflow: Workflow,
        handle: dict[str, Any],
        serializer: JsonSerializer,
        *,
        snapshot: BrokerState | None = None,
    ) -> Session | _child.EndedRun:
        """Continue the run a handle names; a non-head checkpoint needs its fork token (P3).

        A branch that has ended (a fork token presented again after its branch
        completed) answers with its stored outcome and runs nothing. `snapshot`: the
        state a restored context carries beside its handle (`Context.from_dict`)."""
        run_id, base_id = handle["run_id"], handle["checkpoint_id"]
        token = handle.get("fork_token")
        remit = self.remit
        if token is not None and remit.fork_branch(run_id, token) is None:
            self._check_fork_base(workflow, run_id, base_id, serializer)
        found = (
            remit.fork(run_id, base_id, token)
            if token is not None
            else remit.branch(run_id, branch=handle.get("branch", MAIN_BRANCH))
        )
        if found is None and remit.checkpoint(run_id, base_id) is None:
            raise UnknownRecord(
                "the context names a run this store does not hold (restored against "
                "another store?)",
                run_id=run_id,
                checkpoint_id=base_id,
            )
        if found is not None and token is None and found.head_id != base_id:
            answered = self._answered_pause(run_id, base_id, found, snapshot)
            if answered is not None:
                raise answered
        if found is None or (token is None and found.head_id != base_id):
            raise ForkWithoutIntent(
                f"checkpoint {base_id!r} is not the head of run {run_id!r}; restoring it "
                "again is a fork: pass a fork token to RemitRuntime.context(...)",
                run_id=run_id,
                checkpoint_id=base_id,
            )
        branch = found
        assert branch.head_id is not None
        record = self._checkpoint(run_id, branch.head_id)
        if record.metadata.get("status") in snap.TERMINAL:
            return self._ended_run(workflow, record, serializer)
        ids = {"run_id": run_id, "checkpoint_id": record.checkpoint_id}
        ctx, requirements, _ = snap.decode_body(record.state, **ids)
        init = snap.broker_state(ctx, workflow, serializer, **ids)
        snap.restore_requirements(init, requirements)
        state = self._state(workflow, record, ctx, serializer)
        session = self._session(
            workflow,
            serializer,
            run_id,
            branch.branch,
            branch.fork_token,
            record.checkpoint_id,
            init,
            state,
            asks=record.metadata.get("asks") or {},
            resent=record.metadata.get("resent") or {},
            effects=record.metadata.get("effects") or {},
            deadlines=record.metadata.get("deadlines") or {},
            forked=record.branch != branch.branch,
        )
        session.parent = record.metadata.get("parent")
        pending = {w.interrupt_id for w in snap.waiters(init) if w.pending}
        # Only a value accepted for what the head still waits on is read and decoded:
        # the answers of earlier rounds are in the journal already, and reading them
        # all would make each restore cost the run's whole history, and refuse a run
        # whose finished round was answered with a class since renamed.
        accepted = [
            asked
            for interrupt_id in pending | set(session.asks)
            if (asked := remit.interrupt(run_id, interrupt_id, branch=branch.branch)) is not None
            and asked.status == "consumed"
        ]
        for interrupt in sorted(accepted, key=lambda i: (i.created_at, i.interrupt_id)):
            assert interrupt.value is not None
            with snap.decoding(
                f"the value accepted for interrupt {interrupt.interrupt_id!r}", **ids
            ):
                value = serializer.deserialize(interrupt.value.decode())
            if interrupt.interrupt_id in pending:
                session.inject(value)
            elif interrupt.interrupt_id in session.asks:
                session.inject(value, ask=interrupt.interrupt_id)
        return session

    def _check_fork_base(
        self, workflow: Workflow, run_id: str, base_id: str, serializer: JsonSerializer
    ) -> None:
        """Read the base of a fork a token would make as the fork would read it, before
        the branch is made: a base that does not verify, was written by a version this
        runtime refuses, or holds work or state `workflow` cannot take raises as a
        restore of it does (`CorruptRecord`, `VersionMismatch`, `CheckpointInvalid`),
        and no branch is stored (made first, it would outlive the refusal: a branch
        stored for a restore that was refused). A base the store does not hold is left
        to the fork, which refuses it."""
        if self.remit.checkpoint(run_id, base_id) is None:
            return
        record = self._checkpoint(run_id, base_id)
        ids = {"run_id": run_id, "checkpoint_id": base_id}
        ctx = snap.decode(record.state, **ids)
        snap.broker_state(ctx, workflow, serializer, **ids)
        self._state(workflow, record, ctx, serializer)

    def _session(
        self,
        workflow: Workflow,
        serializer: JsonSerializer,
        run_id: str,
        branch: str,
        fork_token: str | None,
        head_id: str | None,
        init_state: BrokerState,
        state: BaseModel,
        asks: dict[str, dict[str, Any]] | None = None,
        resent: dict[str, Any] | None = None,
        effects: dict[str, Any] | None = None,
        deadlines: dict[str, float] | None = None,
        forked: bool = False,
    ) -> Session:
        schema = self._schema(workflow)
        return Session(
            remit=self.remit,
            workflow=workflow,
            serializer=serializer,
            run_id=run_id,
            branch=branch,
            fork_token=fork_token,
            head_id=head_id,
            init_state=init_state,
            state=state,
            schema=schema,
            schema_version=schema.version if schema is not None else 1,
            workflow_version=self.workflow_version,
            asks=asks,
            resent=resent,
            effects=effects,
            deadlines=deadlines,
            forked=forked,
        )

    async def _watch(self, session: Session) -> None:
        """Until the run's task ends here: while it is parked, look at its stored head at
        the pace a held claim is renewed (`Session.watch_parked`), so that a copy whose
        run moved on elsewhere stops instead of waiting for ever."""
        assert session.inner is not None
        parked = asyncio.get_running_loop().create_task(session.watch_parked(self.lease / 3))
        try:
            await session.inner.get_result()
        except BaseException:  # the run's own handler reports its outcome
            pass
        finally:
            parked.cancel()
            self._forget(session)

    def _forget(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.inner_id, None)
        session.close()

    def get_internal_adapter(self, workflow: Workflow) -> InternalRunAdapter:
        inner = self._decorated.get_internal_adapter(workflow)
        session = self._sessions.get(get_current_run_id() or "")
        if session is None:
            raise RemitError(f"no Remit run is active as {get_current_run_id()!r}")
        return _Internal(inner, session)

    def get_external_adapter(self, run_id: str) -> ExternalRunAdapter:
        session = self._live(run_id)
        return _External(self._decorated.get_external_adapter(session.inner_id), session)

    def _session_of(self, handler: WorkflowHandler) -> Session:
        """The live session `handler` drives: its own state store tells it apart from
        another restore of the same run in this process."""
        ctx = getattr(handler, "ctx", None)
        store = ctx.store if ctx is not None else None
        with self._lock:
            for s in self._sessions.values():
                if s.store is store and not s.done:
                    return s
        return self._live(handler.run_id)

    def _live(self, run_id: str) -> Session:
        """The newest live session of `run_id` in this process and event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            found = [
                s
                for s in self._sessions.values()
                if (s.key == run_id or s.inner_id == run_id) and not s.done and s.loop is loop
            ]
        if not found:
            raise UnknownRecord(
                "no live run with this id in this process; restore it with "
                "RemitRuntime.context(...) or RemitRuntime.respond(...)",
                run_id=run_id,
            )
        return found[-1]

    # -- reading runs -------------------------------------------------------------------
    def _schema(self, workflow: Workflow) -> StateSchema | None:
        if self.schema is not None:
            return self.schema
        state_type = infer_state_type(workflow)
        return None if state_type is DictState else StateSchema(state_type)

    def _checkpoint(self, run_id: str, checkpoint_id: str) -> CheckpointRecord:
        record = self.remit.checkpoint(run_id, checkpoint_id)
        if record is None:
            raise UnknownRecord("no such checkpoint", run_id=run_id, checkpoint_id=checkpoint_id)
        policy.check_workflow_version(record, self.accepted_versions)
        snap.check_metadata(record)
        return record

    def _head(self, run_id: str) -> CheckpointRecord:
        branch = self._branch(run_id)
        assert branch.head_id is not None
        return self._checkpoint(branch.run_id, branch.head_id)

    def _branch(self, run_id: str) -> BranchRecord:
        """The stored branch `run_id` names ("<run>@<branch>" for a fork), or `UnknownRecord`."""
        key_run, branch_name = split_run_id(run_id)
        branch = self.remit.branch(key_run, branch=branch_name)
        if branch is None or branch.head_id is None:
            raise UnknownRecord("no such run", run_id=key_run, branch=branch_name)
        return branch

    def _state(
        self,
        workflow: Workflow,
        record: CheckpointRecord,
        ctx: dict[str, Any],
        serializer: JsonSerializer,
    ) -> BaseModel:
        """The state model a checkpoint holds, migrated to the reader's schema version."""
        ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
        payload = ctx.get("state") or {}
        schema = self._schema(workflow)
        if schema is not None and record.schema_version != schema.version:
            fields = snap.state_fields(payload)
            if fields is None:
                raise CorruptRecord("checkpoint state has no typed fields to migrate", **ids)
            migrated = schema.upgrade(fields, record.schema_version, **ids)
            return schema.validate(migrated, **ids)
        if not payload:
            return infer_state_type(workflow)()
        fields = snap.state_fields(payload)
        if (
            schema is not None
            and fields is not None
            and infer_state_type(workflow) is not DictState
        ):
            # The workflow's own model, from the stored fields: the class the payload
            # names is never imported (reading a record runs no code of its choosing).
            _check_no_dropped_field(infer_state_type(workflow), fields, **ids)
            validated: BaseModel = schema.validate(fields, **ids)
            return validated
        with snap.decoding("the checkpoint's state", **ids):
            state = decode_seed_state(payload, serializer)
        return schema.validate(state, **ids) if schema is not None else state

    def context(
        self,
        workflow: Workflow,
        run_id: str,
        *,
        checkpoint_id: str | None = None,
        fork_token: str | None = None,
    ) -> Context[Any]:
        """A context at a run's head (or at `checkpoint_id`), ready for `workflow.run(ctx=...)`.

        Running it continues the run. A checkpoint that is not its branch's head
        is continued only with `fork_token` (one token, one branch, from any
        process); without one the run refuses with `ForkWithoutIntent` (`PauseAnswered`,
        also a `ResumeConflict`, for a pause whose question was answered since). A fork's
        run id ("<run>@fork-...") names its branch: a checkpoint given with it is
        continued on that branch (a new fork's head is its base, stored on the
        branch it was forked from), never on another.
        """
        _check_workflow(workflow)
        if fork_token is not None:
            checked_id("fork_token", fork_token)
        key_run, branch = split_run_id(run_id)
        if checkpoint_id is None:
            record = self._head(run_id)
        else:
            self._branch(run_id)  # a fork's branch the store does not hold is unknown
            record = self._checkpoint(key_run, checkpoint_id)
            if branch == MAIN_BRANCH:
                branch = record.branch
        ctx = snap.decode(record.state, run_id=record.run_id, checkpoint_id=record.checkpoint_id)
        handle = {
            "store_type": snap.HANDLE_TYPE,
            "run_id": record.run_id,
            "branch": branch,
            "checkpoint_id": record.checkpoint_id,
            "fork_token": fork_token,
        }
        ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
        with snap.decoding("the checkpoint's context", **ids):
            return Context.from_dict(
                workflow, {**ctx, "state": handle}, serializer=self.get_serializer(workflow)
            )

    def checkpoints(self, run_id: str) -> list[RunCheckpoint]:
        """Every checkpoint of a run on every branch, newest first (`UnknownRecord` for a
        run, or a fork's branch, the store does not hold, as the other reads).

        Each record is verified as the other reads verify it: one whose bytes or
        metadata were altered raises `CorruptRecord` naming the run and checkpoint,
        rather than being listed with a status its checkpoint does not hold."""
        key_run = self._branch(run_id).run_id
        records = self.remit.history(key_run, ns="")
        for record in records:
            snap.check_metadata(record)
        return [
            RunCheckpoint(
                checkpoint_id=r.checkpoint_id,
                parent_id=r.parent_id,
                branch=r.branch,
                status=r.metadata.get("status", ""),
                step=r.metadata.get("step"),
                next_steps=tuple(r.metadata.get("next", ())),
                waiting=tuple(r.metadata.get("waiting", ())),
            )
            for r in records
        ]

    def get_state(self, workflow: Workflow, run_id: str) -> BaseModel:
        """The state at a run's head (`run_id` may name a fork: "<run>@<branch>")."""
        _check_workflow(workflow)
        record = self._head(run_id)
        ctx = snap.decode(record.state, run_id=record.run_id, checkpoint_id=record.checkpoint_id)
        return self._state(workflow, record, ctx, self.get_serializer(workflow))

    def result(self, run_id: str) -> Any:
        """The result of a completed run (what awaiting its handler returned: a plain
        `StopEvent`'s `result`, or the event itself when a subclass of it ended the run).

        A run that ended without a result raises what awaiting its handler raised, as a
        child run started again does: `RunFailed` carrying the stored error as text for
        a failed run, `WorkflowCancelledByUser` for a cancelled one. A run that has not
        ended has no result yet: `UnknownRecord` naming its status."""
        record = self._head(run_id)
        ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
        status = record.metadata.get("status")
        if status == snap.CANCELLED:
            raise WorkflowCancelledByUser(
                f"run {public_run_id(record.run_id, record.branch)!r} was cancelled; it has "
                f"no result (checkpoint {record.checkpoint_id!r})"
            )
        if status == snap.FAILED:
            error = str(record.metadata.get("error") or status)
            raise _child.RunFailed(
                f"the run failed ({error}); it has no result", error=error, **ids
            )
        if status != snap.COMPLETED:
            raise UnknownRecord(
                f"run has not ended (status {status!r}): it has no result yet; "
                "RemitRuntime.status tells when it has",
                **ids,
            )
        stop = snap.stop_event(record.metadata.get("result"), snap.LoadedClassesSerializer(), **ids)
        return stop.result if type(stop) is StopEvent else stop

    def status(self, run_id: str) -> str:
        """The status its head records: running, waiting, completed, failed or cancelled."""
        return str(self._head(run_id).metadata.get("status", snap.RUNNING))

    # -- acting on runs -------------------------------------------------------------------
    def fork(self, run_id: str, checkpoint_id: str, fork_token: str) -> str:
        """The run id of the one branch `fork_token` makes from `checkpoint_id` (P3).

        The same token from any process names the same branch; continue it with
        `recover`, `respond` or `context` like any run.
        """
        key_run = self._branch(run_id).run_id  # (`UnknownRecord` for a branch not held)
        self._checkpoint(key_run, checkpoint_id)
        branch = self.remit.fork(key_run, checkpoint_id, fork_token)
        return public_run_id(key_run, branch.branch)

    def recover(self, workflow: Workflow, run_id: str) -> WorkflowHandler | None:
        """Continue a run after its process died; None if it waits for an event or ended.

        `ResumeConflict` when another resumer holds the run, or took it over
        between this call's read of the head and its claim.

        A resume value that was accepted (its interrupt consumed) but not yet
        delivered when the process died is delivered now, without asking again.
        """
        record = self._head(run_id)
        status = record.metadata.get("status")
        if status in snap.TERMINAL:
            return None
        if status == snap.WAITING:
            waiting = set(record.metadata.get("waiting", ()))
            if not any(
                (found := self.remit.interrupt(record.run_id, waiter, branch=record.branch))
                is not None
                and found.status == "consumed"
                for waiter in waiting
            ):
                return None
        try:
            # The context of the head read above, not of the head read again: one that
            # ended meanwhile would be run as a context of an ended run, i.e. started
            # over as a new run, its steps and effects again.
            ctx = self.context(workflow, run_id, checkpoint_id=record.checkpoint_id)
            return workflow.run(ctx=ctx)
        except ForkWithoutIntent as exc:
            # The head this recovery read moved on before its claim: another
            # resumer took the run over, and this one lost the race.
            raise ResumeConflict(
                "another resumer continued the run while this one recovered it; nothing ran",
                run_id=run_id,
            ) from exc

    async def send_event(
        self, handler: WorkflowHandler, event: Event, step: str | None = None
    ) -> None:
        """Deliver `event` to a live run, raising what the gate refuses.

        `handler.ctx.send_event` is fire-and-forget: a refused event is logged
        and not delivered, except when the handler's copy of the run lost it to
        another resumer: then the copy stops and the handler ends with that
        `ResumeConflict` (as it does here). This method raises the refusal instead:
        `ResumeConflict` when the waiter it answers was already resolved, when
        it is a `HumanResponseEvent` and every `InputRequiredEvent` the run
        returned was answered already, when no waiter of the run waits for it
        and no step takes it (the framework would drop it: send an answer once
        its waiter exists), or when another resumer holds the run or moved it
        on, or when the run has ended (as `respond` refuses it); `CheckpointInvalid`
        for an event that fails its own model; `TypeError` for anything but an `Event`.
        An event sent to a `step` goes to that step only: one the workflow has no such
        step for, or whose step does not take it, is refused (`ResumeConflict` naming
        the step, where `handler.ctx.send_event` raises the framework's check) before it
        could answer a waiter of another step.
        """
        check_is_event(event)
        if not isinstance(handler, WorkflowHandler):
            raise TypeError(
                f"handler must be the WorkflowHandler of a run, not {type(handler).__name__}; "
                "the event was not delivered"
            )
        if step is not None:
            _check_target(handler, step, event)
        try:
            session = self._session_of(handler)
        except UnknownRecord:
            ended = await asyncio.to_thread(self._ended_refusal, handler.run_id, event)
            if ended is not None:
                raise ended from None
            raise
        await session.deliver(
            TickAddEvent(event=event, step_id=StepId.root(step) if step else None)
        )

    async def respond(self, workflow: Workflow, run_id: str, event: Event) -> WorkflowHandler:
        """Resume a stored run with `event` (e.g. a `HumanResponseEvent`), in any process.

        The event's interrupt is claimed and consumed before any step runs;
        of k concurrent resumers one proceeds and the others get `ResumeConflict`,
        as does an event for a run that has ended, or one the stored run does not
        wait for and no step of it takes (nothing runs, nothing is stored). A run
        whose process died before it reached the step that waits for the event
        is continued with `recover` first; answer it once it waits.

        A run parked in this event loop by `workflow` itself (a server's other
        request) is answered through that copy, so its handler goes on too, as the
        returned one does. Otherwise the answer runs in a copy of its own, and the
        copies of the run parked in this event loop, which can no longer take an
        answer, end with `ResumeConflict` (they would wait for ever).
        """
        check_is_event(event)
        head = await asyncio.to_thread(self._head, run_id)
        parked = await self._settled_copy(run_id, head)
        if parked is not None and parked.workflow is workflow:
            await parked.deliver(TickAddEvent(event=event))
            inner = self._decorated.get_external_adapter(parked.inner_id)
            return WorkflowHandler(workflow, _External(inner, parked))
        ctx = await asyncio.to_thread(self.context, workflow, run_id)
        # (Not running: running it would start the workflow over. Ended with a step in
        # flight, e.g. cancelled: running it would only answer with its outcome.)
        if not ctx.is_running or await asyncio.to_thread(self.status, run_id) in snap.TERMINAL:
            raise await asyncio.to_thread(self._ended, run_id, event)
        await asyncio.to_thread(self._check_awaited, workflow, run_id, event)
        try:
            handler = workflow.run(ctx=ctx)
        except ForkWithoutIntent as exc:
            raise ResumeConflict(
                "another resumer continued the run while this one restored it; the event "
                "was not delivered",
                run_id=run_id,
            ) from exc
        session = self._session_of(handler)  # (this restore's own, not another's)
        try:
            await session.deliver(TickAddEvent(event=event))
        except BaseException:
            session.abort()
            session.close()
            raise
        taken = ResumeConflict(
            "another resumer in this process answered the run (RemitRuntime.respond); this "
            "copy of it can take no answer and stopped: await the handler respond returned",
            run_id=run_id,
            checkpoint_id=head.checkpoint_id,
        )
        loop = asyncio.get_running_loop()
        for stale in self._parked_copies(run_id):
            if stale is not session and stale.loop is loop and stale.head_id == head.checkpoint_id:
                await stale.stop_lost(taken)
        return handler

    def _check_awaited(self, workflow: Workflow, run_id: str, event: Event) -> None:
        """Refuse, before the stored run is restored (a run with a step in flight would
        start running it), an event that fails its model or that the run would drop:
        naming the interrupt it would have answered if that one was consumed already."""
        record = self._head(run_id)
        ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
        serializer = self.get_serializer(workflow)
        validated_event(event, serializer, **ids)
        ctx, requirements, _ = snap.decode_body(record.state, **ids)
        state = snap.broker_state(ctx, workflow, serializer, **ids)
        snap.restore_requirements(state, requirements)
        if snap.takes(state, event):
            return
        consumed = self._consumed_refusal(run_id, record, event, "", state)
        if consumed is not None:
            raise consumed
        check_awaited(state, event, None, **ids)

    def _ended(self, run_id: str, event: Event) -> ResumeConflict:
        """The refusal of an event for a run that has ended, naming the interrupt the
        event would have answered if there is one."""
        record = self._head(run_id)
        consumed = self._consumed_refusal(run_id, record, event, " and the run has ended")
        if consumed is not None:
            return consumed
        return ResumeConflict(
            f"the run has ended ({record.metadata.get('status')}); the event was not delivered",
            run_id=run_id,
            checkpoint_id=record.checkpoint_id,
        )

    def _ended_refusal(self, run_id: str, event: Event) -> ResumeConflict | None:
        """The refusal of `event` for a stored run that has ended (`_ended`), or None
        when the store holds no such run or it has not ended."""
        try:
            status = self.status(run_id)
        except UnknownRecord:
            return None
        return self._ended(run_id, event) if status in snap.TERMINAL else None

    def _consumed_refusal(
        self,
        run_id: str,
        record: CheckpointRecord,
        event: Event,
        why: str,
        state: BrokerState | None = None,
    ) -> ResumeConflict | None:
        """The refusal naming a consumed interrupt of the run's branch that `event`
        would have answered, if there is one (`why`: what else the message says). One
        of an earlier round of a run with work in `state` (`snap.answered_earlier`) is
        left to `check_awaited`, which says that a step is still in flight."""
        answered = self.remit.interrupts(record.run_id, branch=record.branch, status="consumed")
        for interrupt in answered:
            prompt = codec.loads(interrupt.prompt) if interrupt.prompt else {}
            if state is not None and snap.answered_earlier(
                state, interrupt.interrupt_id, prompt, event
            ):
                continue
            asked = prompt.get("kind") == "ask" and snap.is_answer(event)
            if asked or snap.would_answer(prompt, event, state):
                return ResumeConflict(
                    f"interrupt was already consumed{why}; the value was not delivered",
                    run_id=run_id,
                    interrupt_id=interrupt.interrupt_id,
                )
        return None

    async def cancel(self, run_id: str, *, timeout: float = 5.0) -> str:
        """End a stored run for good (status `cancelled`), parked or not: a later
        answer, restore or recovery gets its ended outcome and runs nothing.
        (`handler.cancel_run()` of a parked run only stops this process's copy.)
        A run this process drives (a step in flight) is stopped here as
        `handler.cancel_run()` stops it, waiting up to `timeout` seconds, and its
        control loop commits the cancelled end under the run's own claim; a run
        another live process drives is refused (`ResumeConflict`). Once the end is
        committed, the parked copies of the run live in this process are stopped
        too, writing nothing (their handlers end with `WorkflowCancelledByUser`
        instead of waiting for ever for an answer the run can no longer take); copies
        elsewhere stop so once they see the cancelled head (`Session.watch_parked`).
        Returns the head's checkpoint id; an ended run is left as it is."""
        session = self._driving(run_id)
        if session is not None:
            await self._stop(session, timeout)
        head = await asyncio.to_thread(self._cancel, run_id)
        for parked in self._parked_copies(run_id):
            await self._stop(parked, timeout)
        return head

    def _driving(self, run_id: str) -> Session | None:
        """The session of this process that holds `run_id`'s claim, if one does."""
        with self._lock:
            for s in self._sessions.values():
                if s.key == run_id and not s.done and s.claim is not None:
                    return s
        return None

    def _parked_copies(self, run_id: str) -> list[Session]:
        """The live copies of `run_id` in this process that hold no claim (parked)."""
        with self._lock:
            return [
                s
                for s in self._sessions.values()
                if s.key == run_id
                and not s.done
                and s.claim is None
                and s.inner is not None
                and s.loop is not None
                and not s.loop.is_closed()
            ]

    @staticmethod
    async def _stop(session: Session, timeout: float) -> None:
        """Cancel the live run of `session` on its own event loop; wait until it ended."""
        assert session.inner is not None and session.loop is not None
        stopping = asyncio.run_coroutine_threadsafe(session.inner.cancel(), session.loop)
        await asyncio.wrap_future(stopping)
        deadline = time.monotonic() + timeout
        while not session.done and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def _cancel(self, run_id: str) -> str:
        key_run, branch_name = split_run_id(run_id)
        # A run the store does not hold is refused before its claim is taken: a claim
        # taken for it would leave a claim row behind for a run that does not exist.
        self._branch(run_id)
        try:
            claim = self.remit.claim(key_run, branch_name)
        except ResumeConflict as exc:
            here = self._driving(run_id) is not None
            raise ResumeConflict(
                "the run did not stop on cancel: a step of it is still running in this "
                "process; the run was not ended"
                if here
                else "another live process drives the run (its claim is held and renewed); "
                "cancel it there, or once that process is gone and its lease has run out; "
                "the run was not ended",
                run_id=run_id,
            ) from exc
        with claim:
            record = self._head(run_id)
            if record.metadata.get("status") in snap.TERMINAL:
                return record.checkpoint_id
            ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
            ctx, _, _ = snap.decode_body(record.state, **ids)
            metadata = {
                **record.metadata,
                "status": snap.CANCELLED,
                "tick": "cancel",
                "next": [],
                "waiting": [],
            }
            branch = self.remit.branch(key_run, branch=branch_name)
            checkpoint_id = new_checkpoint_id()
            self.remit.commit(
                run_id=key_run,
                checkpoint_id=checkpoint_id,
                parent_id=record.checkpoint_id,
                state=snap.body({**ctx, "is_running": False}, {}, metadata),
                metadata=metadata,
                fork_token=None if branch is None else branch.fork_token,
                schema_version=record.schema_version,
                workflow_version=self.workflow_version,
                fence=claim.fence,
            )
        return checkpoint_id

    async def update_state(self, workflow: Workflow, run_id: str, values: Mapping[str, Any]) -> str:
        """Edit a stored run's state (validated; `CheckpointInvalid` commits nothing).

        Commits a new head with the same frontier and the edited state, under
        the run's claim. Returns the new checkpoint id; an edit that changes
        nothing (no values, or the values the state holds) commits nothing and
        returns the head's. A parked run whose handler
        is live in this process is edited through that handler's state store, so
        the handler goes on from the edited head (edited behind its back, the
        handler would hold a stale copy whose answers are refused).
        """
        _check_workflow(workflow)
        if not isinstance(values, Mapping):
            raise TypeError(
                "values must be a mapping of state field paths to values, not "
                f"{type(values).__name__}; nothing was written"
            )
        head = await asyncio.to_thread(self._head, run_id)
        session = await self._settled_copy(run_id, head)
        if self._driving(run_id) is not None:
            # (The core's refusal would say to retry once the lease runs out, which it
            # never does while this process renews it.)
            raise ResumeConflict(
                "a step of the run is running in this process, which holds the run: edit "
                "its state from a step (ctx.store), or once the run waits or has ended; "
                "nothing was written",
                run_id=run_id,
                checkpoint_id=head.checkpoint_id,
            )
        if session is None:
            return await asyncio.to_thread(self._update_state, workflow, run_id, dict(values))
        ids = {"run_id": head.run_id, "checkpoint_id": head.checkpoint_id}
        current = await session.store.get_state()
        edited = session.store.checked(_edited(current, values, **ids))
        if edited != current:  # (an edit that changes nothing commits nothing)
            await session.store.set_state(edited)
        assert session.head_id is not None
        return session.head_id

    async def _settled_copy(self, run_id: str, head: CheckpointRecord) -> Session | None:
        """`_parked_copy` at `head`, once a copy of this event loop that is parking the
        run there has parked (for up to `_PARKING` seconds): the store shows a pause as
        its commit lands, a moment before the copy that committed it releases its
        claim. Taken for a copy still running, that copy would be refused the edit, or
        lose the answer to a copy of its own and end with `ResumeConflict`."""
        head_id = head.checkpoint_id
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + _PARKING
        while head.metadata.get("status") == snap.WAITING and time.monotonic() < deadline:
            with self._lock:
                parking = any(
                    s.key == run_id and s.loop is loop and s.parking_at(head_id)
                    for s in self._sessions.values()
                )
            if not parking:
                break
            await asyncio.sleep(0.01)
        return self._parked_copy(run_id, head_id)

    def _parked_copy(self, run_id: str, head_id: str) -> Session | None:
        """The live copy, in this process and event loop, of `run_id` parked at `head_id`."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for s in self._sessions.values():
                parked = s.claim is None and not s.done and s.loop is loop
                if parked and s.key == run_id and s.head_id == head_id:
                    return s
        return None

    def _update_state(self, workflow: Workflow, run_id: str, values: dict[str, Any]) -> str:
        key_run, branch_name = split_run_id(run_id)
        remit = self.remit
        serializer = self.get_serializer(workflow)
        with remit.claim(key_run, branch_name) as claim:
            record = self._head(run_id)
            ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
            ctx, requirements, _ = snap.decode_body(record.state, **ids)
            stored = self._state(workflow, record, ctx, serializer)
            schema = self._schema(workflow)
            state = checked_state(_edited(stored, values, **ids), schema, serializer, **ids)
            payload = create_in_memory_payload(state, serializer).model_dump()
            if payload == create_in_memory_payload(stored, serializer).model_dump():
                # An edit that changes nothing commits nothing: a new head would grow the
                # history for nothing, and stop the run's parked copies elsewhere, which
                # take a moved head as the run answered or continued without them.
                return record.checkpoint_id
            metadata = {**record.metadata, "tick": "update_state"}
            body = snap.body({**ctx, "state": payload}, requirements, metadata)
            branch = remit.branch(key_run, branch=branch_name)
            checkpoint_id = new_checkpoint_id()
            remit.commit(
                run_id=key_run,
                checkpoint_id=checkpoint_id,
                parent_id=record.checkpoint_id,
                state=body,
                metadata=metadata,
                fork_token=None if branch is None else branch.fork_token,
                schema_version=schema.version if schema is not None else 1,
                workflow_version=self.workflow_version,
                fence=claim.fence,
            )
        return checkpoint_id


def _checked_versions(workflow_version: object, accept_versions: object) -> frozenset[str]:
    """The workflow versions a runtime reads: its own and `accept_versions`, or `TypeError`
    naming the argument. A checkpoint names its version as a str: a str given for the
    collection would be taken as its characters, and a version that is not a str matches
    no checkpoint, each refusing the runs it was meant to accept without a word."""
    if not isinstance(workflow_version, str):
        raise TypeError(f"workflow_version must be a str, not {type(workflow_version).__name__}")
    if isinstance(accept_versions, (str, bytes)) or not isinstance(accept_versions, Iterable):
        raise TypeError(
            "accept_versions must be a collection of str (e.g. ['v1', 'v2']), not "
            f"{type(accept_versions).__name__} {accept_versions!r:.60}"
        )
    versions = frozenset(accept_versions)
    odd = next((v for v in versions if not isinstance(v, str)), None)
    if odd is not None:
        raise TypeError(f"accept_versions must hold str only, not {type(odd).__name__} {odd!r:.60}")
    return versions | {workflow_version}


def _check_workflow(workflow: object) -> None:
    """Refuse with `TypeError` a `workflow` argument that is not a `Workflow`."""
    if not isinstance(workflow, Workflow):
        raise TypeError(f"workflow must be a Workflow, not {type(workflow).__name__}")


def _check_no_dropped_field(model: type[BaseModel], fields: Mapping[str, Any], **ids: Any) -> None:
    """Refuse with `VersionMismatch` naming it a stored state field that `model` does not
    declare (removed or renamed since the checkpoint was written): validated into the
    model, it would be dropped without a word, and the run's next checkpoint would
    store the state without it. A model that declares what to do with undeclared
    fields (`extra="allow"` keeps them, `extra="ignore"` drops them) is taken at its word."""
    if model.model_config.get("extra") is not None:
        return
    known = set(model.model_fields) | set(model.model_computed_fields)
    for info in model.model_fields.values():
        for alias in (info.alias, info.serialization_alias, info.validation_alias):
            if isinstance(alias, str):
                known.add(alias)
    dropped = next((key for key in fields if key not in known), None)
    if dropped is None:
        return
    raise VersionMismatch(
        f"the stored state has field {dropped!r}, which the workflow's state model "
        f"{model.__name__} does not declare (removed or renamed since the checkpoint was "
        "written): reading it would drop its value. Declare the field again, or give the "
        "runtime a StateSchema of a higher version with a migration that maps the stored "
        'fields (or set model_config extra="ignore" to drop such fields)',
        field=dropped,
        **ids,
    )


def _check_target(handler: WorkflowHandler, step: str, event: Event) -> None:
    """Refuse an event sent to a `step` the workflow does not have or that does not take
    it, as the framework checks a targeted send (`handler.ctx.send_event`). Without the
    check, the reducer would let the event answer a waiter of another step (consuming
    its interrupt) that the sender did not aim at."""
    try:
        handler._workflow._validate_valid_step_message(step, event)
    except WorkflowRuntimeError as exc:
        raise ResumeConflict(
            f"{exc}: an event sent to a step goes to that step only, so the run would not "
            "take it; the event was not delivered",
            run_id=handler.run_id,
        ) from exc


def _edited(state: BaseModel, values: Mapping[str, Any], **ids: Any) -> BaseModel:
    """`state` with `values` set by path (`set_path`: `CheckpointInvalid` naming a path
    the state has no field for, or a value its model refuses on assignment)."""
    for path, value in values.items():
        state = set_path(state, path, value, "the edit was not written", **ids)
    return state


class _Internal(BaseInternalRunAdapterDecorator):
    """The control loop's side: every reduced tick goes to the session."""

    def __init__(self, decorated: InternalRunAdapter, session: Session) -> None:
        super().__init__(decorated)
        self._session = session

    @property
    def run_id(self) -> str:
        return self._session.key

    async def on_tick(self, tick: WorkflowTick) -> None:
        await super().on_tick(tick)
        try:
            await self._session.on_tick(tick)
        except RemitError as exc:
            # The run stops here, not through a step's failure: tell the event stream,
            # as the framework does when a step fails, so that its readers end too.
            step = str(getattr(tick, "step_id", "") or "")
            await self.write_to_event_stream(WorkflowFailedEvent(step_name=step, exception=exc))
            raise
        except WorkflowCancelledByUser:
            # (A parked copy whose run was cancelled elsewhere: it ends as a cancel ends it.)
            await self.write_to_event_stream(WorkflowCancelledEvent())
            raise

    async def send_event(self, tick: WorkflowTick) -> None:
        if self._session.skips_send(tick):
            logger.debug("run %s: a send delivered before the crash is not repeated", self.run_id)
            return
        await super().send_event(tick)

    async def wait_receive(self, timeout_seconds: float | None = None) -> WaitResult:
        """The next tick: an accepted event a crash interrupted, a re-armed waiter
        timeout once it is due (`Session.due_timeout`), else the framework's."""
        if self._session.injections:
            return WaitResultTick(tick=self._session.injections.popleft())
        while True:
            left, due = self._session.due_timeout()
            if due is not None:
                return WaitResultTick(tick=due)
            if left is None or (timeout_seconds is not None and timeout_seconds <= left):
                return await super().wait_receive(timeout_seconds)
            result = await super().wait_receive(left)
            if isinstance(result, WaitResultTick):
                return result
            if timeout_seconds is not None:
                timeout_seconds -= left

    def get_state_store(self, namespace: tuple[str, ...] = ()) -> StateStore[Any] | None:
        return None if namespace else self._session.store


class _External(BaseExternalRunAdapterDecorator, SnapshottableAdapter, V2RuntimeCompatibilityShim):
    """The handler's side: events from outside pass the session's gate."""

    def __init__(self, decorated: ExternalRunAdapter, session: Session) -> None:
        super().__init__(decorated)
        self._session = session
        session.loop = asyncio.get_running_loop()

    @property
    def run_id(self) -> str:
        return self._session.key

    async def send_event(self, tick: WorkflowTick) -> None:
        """Deliver through the gate. The framework sends fire-and-forget (a task nobody
        awaits, or a cancel that ignores errors): a refusal is logged, not raised, or
        asyncio would report it again as a task exception never retrieved."""
        try:
            await self._session.deliver(tick)
        except RemitError:
            if self._session.lost is not None:
                return  # the handler ends with the refusal (`Session.stop_lost`)
            logger.error("event refused for run %s", self._session.key, exc_info=True)

    def get_state_store(self, namespace: tuple[str, ...] = ()) -> StateStore[Any] | None:
        return None if namespace else self._session.store

    @property
    def init_state(self) -> BrokerState:
        return self._session.init_state

    def replay(self) -> list[WorkflowTick]:
        return list(self._session.ticks)

    def _shim(self) -> V2RuntimeCompatibilityShim:
        shim = as_v2_runtime_compatibility_shim(self._decorated)
        assert shim is not None, "the decorated runtime must be the framework's asyncio runtime"
        return shim

    def get_result_or_none(self) -> Any:
        return self._shim().get_result_or_none()

    @property
    def is_running(self) -> bool:
        return self._shim().is_running

    def abort(self) -> None:
        self._shim().abort()


__all__ = ["RemitRuntime", "RunCheckpoint", "public_run_id"]
