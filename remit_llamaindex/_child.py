"""Child runs: workflows started inside a step of a Remit run without a `run_id`.

The framework gives such a run a random id (`Context._workflow_run` draws one),
so a step re-run after a crash would start a second child, and every effect of
the child (keyed under its run) would apply again. Remit names the child after
the step execution that starts it instead:

    <parent run>/<parent step key>/workflow#N          N-th child of that execution
    <parent run>/<parent step key>/retry-K/workflow#N  ... of the step's K-th retry

The step key names the step and its work item, both kept by a checkpoint, so a
re-run of the same step execution names the same children. The runtime then looks
the id up: a child that ended answers at once with its stored result (`EndedRun`),
one that did not continues from its head. A retry is another execution: its child
is a new run, unless the same child of the step's latest earlier attempt that
started one completed, whose result it is given (its effects applied; a retry, like
a re-run, does not apply them again; a child that failed is started anew).

A `run_id` the user passes is kept as it is. Such a child records the step execution
that started it (`StepExecution.slot`, in its checkpoints' metadata), so that the same
step, re-run after a crash or retried, finds it as it finds a child it named, where
any other start under that id is refused as a run that exists already. Its starts are
counted with the step's effect calls too (`StepExecution.starter`): a step re-run on a
fork finds the child its shared prefix started under that id.
Children are counted with the step's effect calls (`StepExecution`): a step that
runs again on a fork from its top finds the children it started before the fork's
base as it finds those calls, under the ids of the branch that started them.

The random draw is told apart from a user's id by recording it: the
framework's draw function is wrapped once (`record_draws`) to note the id it
returns, and the runtime compares the id it is asked to run with that note.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import workflows.context.context as framework_context
from workflows.errors import WorkflowCancelledByUser
from workflows.events import Event, StopEvent
from workflows.runtime.types.internal_state import BrokerState
from workflows.runtime.types.plugin import (
    ExternalRunAdapter,
    SnapshottableAdapter,
    V2RuntimeCompatibilityShim,
)
from workflows.runtime.types.ticks import TickCancelRun, WorkflowTick

from remit_core.effects import StepScope
from remit_core.errors import RemitError, ResumeConflict
from remit_llamaindex._state import RemitStateStore


class RunFailed(RemitError):
    """A run that had already failed when it was started again: it raises its stored
    error, known only as text (`error`, "Type: message"): Remit never rebuilds an
    exception from stored data."""

    def __init__(self, message: str, *, error: str, **ids: Any) -> None:
        super().__init__(message, **ids)
        self.error = error


@dataclass
class StepExecution:
    """One execution of a step of a Remit run: the children it starts, numbered by the
    step's effect scope, so that they are counted with its effect calls. A step that
    runs again on a fork of a checkpoint it was running or waiting at (`SharedScope`)
    then finds the children it started before the fork's base under the ids of the
    branch that started them: those belong to the prefix the fork shares, and their
    effects are not applied again; its later children are the fork's own."""

    run_id: str
    scope: StepScope
    retry: int
    #: The ids the user gave to the children this execution started.
    named: set[str] = field(default_factory=set)

    @property
    def slot(self) -> str:
        """What a child names as the step execution that started it (its attempts alike)."""
        return f"{self.run_id}/{self.scope.step_key}"

    def next_child(self) -> str:
        attempt = f"retry-{self.retry}/" if self.retry else ""
        return f"{self.run_id}/{self.scope.next_key(f'{attempt}workflow')}"

    def earlier_attempts(self, child_id: str) -> list[str]:
        """The ids `child_id` (this execution's `next_child`) had in the step's earlier
        attempts, the latest first."""
        if not self.retry:
            return []
        head, _, n = child_id.rpartition(f"/retry-{self.retry}/workflow#")
        return [
            f"{head}/retry-{k}/workflow#{n}" if k else f"{head}/workflow#{n}"
            for k in range(self.retry - 1, -1, -1)
        ]

    def starter(self, run_id: str) -> str:
        """The step execution (`slot`) a stored run under the user's `run_id` must name as
        its starter to be this start's child: this execution's own, or, for a start that
        a step re-run on a fork makes as the branch it shares made it before the fork's
        base, that branch's (the child belongs to the shared prefix, as the step's
        earlier `@effect` calls do). Counted with the step's effect calls."""
        name = f"named-workflow:{run_id}"
        key = self.scope.next_key(name)
        return f"{self.run_id}/{key.rpartition(f'/{name}#')[0]}"

    def starts_again(self, run_id: str) -> bool:
        """Whether the user's `run_id` is started for the first time in this execution
        (a second start of one id in one execution is another run: refused)."""
        first = run_id not in self.named
        self.named.add(run_id)
        return first


_execution: contextvars.ContextVar[StepExecution | None] = contextvars.ContextVar(
    "remit_llamaindex_step_execution", default=None
)
_drawn: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "remit_llamaindex_drawn_run_id", default=None
)


@contextlib.contextmanager
def step_execution(run_id: str, scope: StepScope, retry: int) -> Iterator[StepExecution]:
    """The step execution a step body runs in (children it starts are named after it)."""
    execution = StepExecution(run_id, scope, retry)
    token = _execution.set(execution)
    try:
        yield execution
    finally:
        _execution.reset(token)


@contextlib.contextmanager
def outside_steps() -> Iterator[None]:
    """No step execution: what a run's own tasks, created here, start from (a child's
    steps are not its parent's)."""
    token = _execution.set(None)
    try:
        yield
    finally:
        _execution.reset(token)


def record_draws() -> None:
    """Wrap the framework's run-id draw, once per process, to note each id it draws."""
    draw = framework_context.nanoid
    if getattr(draw, "_remit_records", False):
        return

    @functools.wraps(draw)
    def recorded(*args: Any, **kwargs: Any) -> str:
        run_id = draw(*args, **kwargs)
        _drawn.set(run_id)
        return run_id

    recorded._remit_records = True  # type: ignore[attr-defined]
    framework_context.nanoid = recorded


def was_drawn(run_id: str) -> bool:
    """Whether the framework drew `run_id` (the run was started without one); the
    note of the draw is used up."""
    drawn = _drawn.get()
    if drawn is None:
        return False
    _drawn.set(None)
    return drawn == run_id


def current_execution() -> StepExecution | None:
    """The execution of a step of a Remit run this code runs in, if it runs in one."""
    return _execution.get()


class EndedRun(ExternalRunAdapter, SnapshottableAdapter, V2RuntimeCompatibilityShim):
    """The handler's side of a run that had ended when it was started again: it answers
    with the stored result (or raises the stored error) at once, and runs nothing."""

    def __init__(
        self,
        run_id: str,
        init_state: BrokerState,
        store: RemitStateStore[Any],
        outcome: Callable[[], StopEvent],
    ) -> None:
        self._run_id = run_id
        self._init_state = init_state
        self._store = store
        self._outcome = outcome

    @property
    def run_id(self) -> str:
        return self._run_id

    async def send_event(self, tick: WorkflowTick) -> None:
        if isinstance(tick, TickCancelRun):
            return
        raise ResumeConflict("the run has ended; the event was not delivered", run_id=self._run_id)

    async def stream_published_events(self) -> AsyncGenerator[Event, None]:
        try:
            stop = self._outcome()
        except (RemitError, WorkflowCancelledByUser):
            return
        yield stop

    async def get_result(self) -> StopEvent:
        return self._outcome()

    def get_state_store(self, namespace: tuple[str, ...] = ()) -> RemitStateStore[Any] | None:
        return None if namespace else self._store

    @property
    def init_state(self) -> BrokerState:
        return self._init_state

    def replay(self) -> list[WorkflowTick]:
        return []

    def get_result_or_none(self) -> StopEvent | None:
        return self._outcome()

    @property
    def is_running(self) -> bool:
        return False

    def abort(self) -> None:
        return None
