"""One live run in this process: commits every tick, parks while waiting, gates events.

A session drives one branch of one Remit run. While it holds the run's claim
(leased, fenced) every tick the control loop reduces is committed as a
checkpoint whose parent is the previous one (a compare-and-set of the branch
head), with the tick itself as the checkpoint's journal write. When the run
goes idle (waiting for an event) or ends, the claim is released: the run is
*parked* and any process may resume it. Ticks a parked session reduces
without work to do (a restore's session start, idle checks) stay in memory;
anything else takes the claim back first, and fails if another process has
moved the branch on meanwhile.

Events from outside pass the gate (`deliver`): an event that resolves a
waiter consumes that waiter's Remit interrupt, once across all processes,
before the control loop sees it; an event for a waiter that was already
resolved is refused with `ResumeConflict`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from workflows.events import Event
from workflows.runtime.control_loop import replay_ticks_stream
from workflows.runtime.types.internal_state import BrokerState
from workflows.runtime.types.plugin import ExternalRunAdapter, as_v2_runtime_compatibility_shim
from workflows.runtime.types.results import StepWorkerFailed
from workflows.runtime.types.ticks import TickAddEvent, TickStepResult, WorkflowTick
from workflows.workflow import Workflow

from remit_core import codec, failpoints
from remit_core.core import ClaimHandle, Remit
from remit_core.errors import (
    CheckpointInvalid,
    ForkWithoutIntent,
    HeadMoved,
    RemitError,
    ResumeConflict,
)
from remit_core.records import MAIN_BRANCH, FenceRef, WriteRecord
from remit_core.schema import StateSchema
from remit_llamaindex import _snapshot as snap
from remit_llamaindex._state import RemitStateStore

if TYPE_CHECKING:
    from workflows.context.serializers import JsonSerializer

logger = logging.getLogger("remit_llamaindex")

JOURNAL_TASK = "journal"


def new_checkpoint_id() -> str:
    """Time-ordered and unique: Remit lists checkpoints newest first by id."""
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"


def public_run_id(run_id: str, branch: str) -> str:
    """The run id LlamaIndex sees: the Remit run id, plus the branch for a fork."""
    return run_id if branch == MAIN_BRANCH else f"{run_id}@{branch}"


def split_run_id(key: str) -> tuple[str, str]:
    """Inverse of `public_run_id`."""
    run_id, sep, branch = key.rpartition("@")
    if sep and branch.startswith("fork-"):
        return run_id, branch
    return key, MAIN_BRANCH


async def _one(tick: WorkflowTick) -> AsyncIterator[WorkflowTick]:
    yield tick


def _validated_event(event: Event, **ids: Any) -> None:
    """Re-validate a delivered event against its own model (catches `model_construct`)."""
    try:
        type(event).model_validate(event.model_dump())
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
        raise CheckpointInvalid(
            f"{type(event).__name__} does not satisfy its model at {field}: "
            f"{first.get('msg')}; the event was not delivered",
            field=field,
            **ids,
        ) from exc


def _remit_failure(tick: WorkflowTick) -> RemitError | None:
    """A contract refusal raised inside a step: it stops the run, nothing is committed."""
    if isinstance(tick, TickStepResult):
        for result in tick.result:
            if isinstance(result, StepWorkerFailed) and isinstance(result.exception, RemitError):
                return result.exception
    return None


class Session:
    """The live state of one (run, branch) driven by this process."""

    def __init__(
        self,
        *,
        remit: Remit,
        workflow: Workflow,
        serializer: JsonSerializer,
        run_id: str,
        branch: str,
        fork_token: str | None,
        head_id: str | None,
        init_state: BrokerState,
        state: BaseModel,
        schema: StateSchema | None,
        schema_version: int,
        workflow_version: str,
    ) -> None:
        self.remit = remit
        self.workflow = workflow
        self.serializer = serializer
        self.run_id = run_id
        self.branch = branch
        self.fork_token = fork_token
        self.key = public_run_id(run_id, branch)
        self.inner_id = f"{self.key}~{uuid.uuid4().hex[:8]}"
        self.head_id = head_id
        self.schema_version = schema_version
        self.workflow_version = workflow_version
        self.init_state = init_state
        self.mirror = init_state.deepcopy()
        self.ticks: list[WorkflowTick] = []
        self.unsaved: list[tuple[int, WorkflowTick]] = []
        self.injections: deque[TickAddEvent] = deque()
        self.expected: set[int] = set()
        self.claim: ClaimHandle | None = None
        self.opened: set[str] = set()
        self.done = False
        self.inner: ExternalRunAdapter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self.store: RemitStateStore[Any] = RemitStateStore(
            state,
            schema=schema,
            ids=lambda: {"run_id": self.run_id, "checkpoint_id": self.head_id},
            handle=self.handle,
            after_write=self._after_state_write,
        )

    # -- identity --------------------------------------------------------------
    def handle(self) -> dict[str, Any]:
        """What `ctx.to_dict()` stores for the state: where the run lives in Remit."""
        return {
            "store_type": snap.HANDLE_TYPE,
            "run_id": self.run_id,
            "branch": self.branch,
            "checkpoint_id": self.head_id,
        }

    @property
    def fence(self) -> FenceRef | None:
        return None if self.claim is None else self.claim.fence

    def step_key(self, step_name: str, work_item_id: str | None) -> str:
        """Deterministic per work item: a re-run step finds its effects in the ledger."""
        key = f"{step_name}:{work_item_id}"
        return key if self.branch == MAIN_BRANCH else f"{self.branch}/{key}"

    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # -- claim -----------------------------------------------------------------
    def take_claim(self) -> None:
        """Claim the branch and check nobody moved it since this session's head (blocking)."""
        handle = self.remit.claim(self.run_id, self.branch)
        try:
            branch = self.remit.branch(self.run_id, branch=self.branch)
            current = None if branch is None else branch.head_id
            if current != self.head_id:
                raise ForkWithoutIntent(
                    f"run {self.run_id!r} moved on to checkpoint {current!r} elsewhere; "
                    f"continuing from {self.head_id!r} would fork it: restore the run again, "
                    "or pass a fork token",
                    run_id=self.run_id,
                    checkpoint_id=self.head_id,
                )
        except BaseException:
            handle.release()
            raise
        self.claim = handle

    def release_claim(self) -> None:
        claim, self.claim = self.claim, None
        if claim is not None:
            try:
                claim.release()
            except RemitError:
                logger.warning("releasing the claim on run %s failed", self.run_id, exc_info=True)

    # -- ticks -----------------------------------------------------------------
    async def on_tick(self, tick: WorkflowTick) -> None:
        """Mirror the control loop's reduction of `tick`, and commit it if claimed."""
        async with self.lock():
            seq = self.mirror.journal_seq
            replay = await replay_ticks_stream(self.mirror, _one(tick), run_id=self.key)
            self.mirror = replay.state
            if isinstance(tick, TickAddEvent):
                self.expected.discard(id(tick.event))
            self.ticks.append(tick)
            self.unsaved.append((seq, tick))
            failure = _remit_failure(tick)
            if failure is not None:
                raise failure
            status = snap.status_of(self.mirror, replay.exit_command)
            if self.claim is None:
                if status == snap.WAITING:
                    return
                await asyncio.to_thread(self.take_claim)
            await asyncio.to_thread(self._commit, status, replay.exit_command)
            if isinstance(tick, TickStepResult):
                failpoints.hit("step.after")
            if status in snap.TERMINAL or (status == snap.WAITING and not self.expected):
                await asyncio.to_thread(self.release_claim)

    def _metadata(self, status: str, exit_command: object | None) -> dict[str, Any]:
        last = self.unsaved[-1][1] if self.unsaved else None
        meta: dict[str, Any] = {
            "source": "llamaindex",
            "status": status,
            "tick": getattr(last, "type", "update_state"),
            "next": snap.busy_steps(self.mirror),
            "waiting": [w.interrupt_id for w in snap.waiters(self.mirror) if w.pending],
            "journal_seq": self.mirror.journal_seq,
        }
        if isinstance(last, TickStepResult):
            meta["step"] = str(last.step_id)
        result = getattr(exit_command, "result", None)
        if status == snap.COMPLETED and result is not None:
            meta["result"] = self.serializer.serialize(result)
        error = getattr(exit_command, "exception", None)
        if error is not None:
            meta["error"] = f"{type(error).__name__}: {error}"
        return meta

    def _commit(self, status: str, exit_command: object | None = None) -> None:
        """Commit the mirrored state as the branch's next checkpoint (blocking)."""
        assert self.claim is not None
        fence = self.claim.fence
        body = snap.encode(self.mirror, self.store.payload(self.serializer), self.serializer)
        checkpoint_id = new_checkpoint_id()
        writes = [
            WriteRecord(
                run_id=self.run_id,
                checkpoint_id=checkpoint_id,
                task_id=JOURNAL_TASK,
                idx=seq,
                channel=tick.type,
                value=self.serializer.serialize(tick).encode(),
            )
            for seq, tick in self.unsaved
        ]
        plan = self.remit.plan(self.run_id, self.head_id, fork_token=self.fork_token)
        if plan.branch != self.branch or plan.fork is not None:
            raise HeadMoved(
                f"branch {self.branch!r} of run {self.run_id!r} no longer has head "
                f"{self.head_id!r}",
                run_id=self.run_id,
                checkpoint_id=self.head_id,
            )
        self.remit.commit(
            run_id=self.run_id,
            checkpoint_id=checkpoint_id,
            parent_id=self.head_id,
            state=body,
            metadata=self._metadata(status, exit_command),
            fork_token=self.fork_token,
            schema_version=self.schema_version,
            workflow_version=self.workflow_version,
            writes=writes,
            fence=fence,
            plan=plan,
        )
        self.head_id = checkpoint_id
        self.unsaved.clear()
        self._open_interrupts(fence)

    def _open_interrupts(self, fence: FenceRef | None) -> None:
        fresh = [
            w for w in snap.waiters(self.mirror) if w.pending and w.interrupt_id not in self.opened
        ]
        if not fresh:
            return
        self.remit.open_interrupts(
            self.run_id,
            {w.interrupt_id: codec.dumps(_prompt(w)) for w in fresh},
            branch=self.branch,
            checkpoint_id=self.head_id,
            fence=fence,
        )
        self.opened.update(w.interrupt_id for w in fresh)

    async def _after_state_write(self) -> None:
        """A state write while parked comes from outside the run: commit it at once."""
        if self.claim is not None or self.done:
            return
        async with self.lock():
            await asyncio.to_thread(self.take_claim)
            try:
                await asyncio.to_thread(self._commit, snap.status_of(self.mirror, None))
            finally:
                await asyncio.to_thread(self.release_claim)

    # -- the gate ----------------------------------------------------------------
    async def deliver(self, tick: WorkflowTick) -> None:
        """Deliver an event from outside, consuming the interrupt it resolves (P5)."""
        async with self.lock():
            newly: list[snap.Waiter] = []
            value = b""
            if isinstance(tick, TickAddEvent):
                newly = await self._resolved_by(tick)
                value = self.serializer.serialize(tick.event).encode()
            took = self.claim is None
            if took:
                try:
                    await asyncio.to_thread(self.take_claim)
                except ForkWithoutIntent:
                    await asyncio.to_thread(self._refuse_consumed, newly)
                    raise
            try:
                await asyncio.to_thread(self._consume, newly, value)
            except BaseException:
                if took:
                    await asyncio.to_thread(self.release_claim)
                raise
            assert self.inner is not None
            if isinstance(tick, TickAddEvent):
                self.expected.add(id(tick.event))
            await self.inner.send_event(tick)

    def inject(self, event: Event) -> None:
        """Queue an accepted resume value whose delivery a crash interrupted."""
        self.expected.add(id(event))
        self.injections.append(TickAddEvent(event=event))

    def _refuse_consumed(self, waiters: list[snap.Waiter]) -> None:
        """A resumer that lost the race for a waiter gets `ResumeConflict`, not a fork error."""
        for w in waiters:
            record = self.remit.interrupt(self.run_id, w.interrupt_id, branch=self.branch)
            if record is not None and record.status == "consumed":
                raise ResumeConflict(
                    "interrupt was already consumed by another resumer; the value was not "
                    "delivered",
                    run_id=self.run_id,
                    interrupt_id=w.interrupt_id,
                )

    async def _resolved_by(self, tick: TickAddEvent) -> list[snap.Waiter]:
        """The pending waiters `tick` resolves; refuses a response to a resolved waiter."""
        ids = {"run_id": self.run_id, "checkpoint_id": self.head_id}
        _validated_event(tick.event, **ids)
        before = {w.interrupt_id: w for w in snap.waiters(self.mirror)}
        after = snap.waiters(
            (await replay_ticks_stream(self.mirror, _one(tick), run_id=self.key)).state
        )
        hit = [w for w in after if w.resolved_event is tick.event]
        stale = [w for w in hit if not before[w.interrupt_id].pending]
        if stale:
            raise ResumeConflict(
                "this waiter was already resolved; the second response was not delivered",
                interrupt_id=stale[0].interrupt_id,
                **ids,
            )
        if hit:
            return hit
        types = snap.event_types(tick.event)
        for record in await asyncio.to_thread(
            self.remit.interrupts, self.run_id, branch=self.branch
        ):
            prompt = codec.loads(record.prompt) if record.prompt else {}
            if record.status == "consumed" and prompt.get("event_type") in types:
                raise ResumeConflict(
                    "interrupt was already consumed; the value was not delivered",
                    interrupt_id=record.interrupt_id,
                    **ids,
                )
        if not self.mirror.is_running and self.ticks:
            raise ResumeConflict("the run has ended; the event was not delivered", **ids)
        return []

    def _consume(self, waiters: list[snap.Waiter], value: bytes) -> None:
        for w in waiters:
            existing = self.remit.interrupt(self.run_id, w.interrupt_id, branch=self.branch)
            if existing is None:
                self.remit.open_interrupts(
                    self.run_id,
                    {w.interrupt_id: codec.dumps(_prompt(w))},
                    branch=self.branch,
                    checkpoint_id=self.head_id,
                    fence=self.fence,
                )
            self.remit.consume(
                self.run_id, w.interrupt_id, value, branch=self.branch, fence=self.fence
            )
            self.opened.add(w.interrupt_id)

    # -- lifecycle ------------------------------------------------------------------
    def abort(self) -> None:
        """Stop this process's copy of the run without writing anything."""
        shim = None if self.inner is None else as_v2_runtime_compatibility_shim(self.inner)
        if shim is not None:
            shim.abort()

    def close(self) -> None:
        """The run's task ended in this process: give the claim up."""
        self.done = True
        self.release_claim()


def _prompt(w: snap.Waiter) -> dict[str, Any]:
    return {"step": w.step, "waiter_id": w.waiter_id, "event_type": w.event_type}
