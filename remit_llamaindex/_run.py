"""One live run in this process: commits every tick, parks while waiting, gates events.

A session drives one branch of one Remit run. While it holds the run's claim
(leased, fenced) every tick the control loop reduces is committed as a
checkpoint whose parent is the previous one (a compare-and-set of the branch
head), with the tick itself as the checkpoint's journal write. When the run
goes idle (waiting for an event) or ends, the claim is released: the run is
*parked* and any process may resume it. Ticks a parked session reduces
without work to do (a restore's session start, idle checks) stay in memory;
anything else takes the claim back first, and fails if another process has
moved the branch on meanwhile. A cancel or the workflow timeout reaching a
parked run stops this process's copy of it and writes nothing: the run stays
parked for whoever resumes it.

Events from outside pass the gate (`deliver`): an event that resolves a
waiter consumes that waiter's Remit interrupt, once across all processes,
before the control loop sees it; an event for a waiter that was already
resolved is refused with `ResumeConflict`. The classic human in the loop has
no waiter: a step returns an `InputRequiredEvent` (an *ask*, opened as an
interrupt with the step's result) and another step takes the
`HumanResponseEvent`. An answer consumes the oldest open ask the same way; an
answer when every ask was answered already is refused. An event no waiter waits
for and no step takes is refused too: the framework would drop it, so an answer
sent before its waiter exists would be acknowledged and lost. A parked copy
whose event is refused because it lost the run (another resumer holds it,
consumed the interrupt or moved the run on) stops through its own control loop:
its handler and event stream end with that `ResumeConflict`, and it stores
nothing. A parked copy also looks at its run's stored head at the pace a claim is
renewed (`watch_parked`): once the run moved on elsewhere (another process, thread
or runtime), it stops the same way instead of waiting for ever.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError
from workflows.errors import WorkflowCancelledByUser
from workflows.events import Event
from workflows.runtime.control_loop import replay_ticks_stream
from workflows.runtime.types.internal_state import BrokerState, InProgressState
from workflows.runtime.types.plugin import ExternalRunAdapter, as_v2_runtime_compatibility_shim
from workflows.runtime.types.results import StepWorkerFailed, StepWorkerResult
from workflows.runtime.types.step_id import StepId
from workflows.runtime.types.ticks import (
    TickAddEvent,
    TickCancelRun,
    TickSessionStart,
    TickStepResult,
    TickTimeout,
    WorkflowTick,
)
from workflows.workflow import Workflow

from remit_core import codec, failpoints
from remit_core.core import ClaimHandle, Remit, checked_id
from remit_core.effects import SharedScope, StepScope
from remit_core.errors import (
    CheckpointInvalid,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    RemitError,
    ResumeConflict,
)
from remit_core.policy import CommitPlan
from remit_core.records import MAIN_BRANCH, FenceRef, WriteRecord
from remit_core.schema import StateSchema
from remit_llamaindex import _shared_effects
from remit_llamaindex import _snapshot as snap
from remit_llamaindex._state import RemitStateStore
from remit_llamaindex._storable import check_event_storable, unstorable, unstorable_event

if TYPE_CHECKING:
    from workflows.context.serializers import JsonSerializer

logger = logging.getLogger("remit_llamaindex")

JOURNAL_TASK = "journal"
#: Seconds a due waiter timeout waits for an accepted event to be reduced first.
_RECHECK = 0.05
#: Seconds an event for a parked run waits for the claim its parking process still holds.
_PARKING = 5.0


def new_checkpoint_id() -> str:
    """Time-ordered and unique: Remit lists checkpoints newest first by id."""
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}"


def public_run_id(run_id: str, branch: str) -> str:
    """The run id LlamaIndex sees: the Remit run id, plus the branch for a fork."""
    return run_id if branch == MAIN_BRANCH else f"{run_id}@{branch}"


def split_run_id(key: str) -> tuple[str, str]:
    """Inverse of `public_run_id` (a `key` that is no id is refused, naming `run_id`)."""
    run_id, sep, branch = checked_id("run_id", key).rpartition("@")
    if sep and branch.startswith("fork-"):
        return run_id, branch
    return key, MAIN_BRANCH


def checked_new_run_id(run_id: str) -> str:
    """`run_id` if a new run can be stored under it as given, else a `ValueError`.

    "<run>@fork-..." is how a fork's run is addressed (`public_run_id`): a new run
    under such an id would be stored as another run, and looked up as a branch of
    that run, which it is not."""
    base, branch = split_run_id(run_id)
    if branch != MAIN_BRANCH:
        raise ValueError(
            f"run id {run_id!r} reads as branch {branch!r} of run {base!r} (a fork's run is "
            'addressed as "<run>@fork-..."); nothing was stored: start the run under an '
            "id whose last '@' is not followed by 'fork-'"
        )
    return run_id


async def _one(tick: WorkflowTick) -> AsyncIterator[WorkflowTick]:
    yield tick


def check_is_event(event: object) -> None:
    """Refuse with `TypeError` anything delivered to a run that is not an `Event`."""
    if not isinstance(event, Event):
        raise TypeError(
            f"a delivered event must be a workflows Event, not {type(event).__name__}; "
            "the event was not delivered"
        )


def check_event_model(event: Event, outcome: str, *, qualified: bool, **ids: Any) -> None:
    """Re-validate an event from outside against its own model (catches `model_construct`
    and a field assigned after construction): `CheckpointInvalid` naming the field
    (with the event's type if `qualified`); `outcome` says what came of the event."""
    try:
        type(event).model_validate(event.model_dump())
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
        name = type(event).__name__
        raise CheckpointInvalid(
            f"{name} does not satisfy its model at {field}: {first.get('msg')}; {outcome}",
            field=f"{name}.{field}" if qualified else field,
            **ids,
        ) from exc


def validated_event(event: Event, serializer: JsonSerializer, **ids: Any) -> None:
    """Refuse a delivered event that fails its own model (`check_event_model`) or that
    the store would give back as another value (`unstorable_event`). Anything but an
    `Event` is refused with `TypeError`."""
    check_is_event(event)
    outcome = "the event was not delivered"
    check_event_model(event, outcome, qualified=False, **ids)
    check_event_storable(event, serializer, outcome, qualified=False, **ids)


def check_awaited(state: BrokerState, event: Event, step: StepId | None, **ids: Any) -> None:
    """Refuse with `ResumeConflict` an event from outside that the run would drop
    (`snap.takes`): accepted and then lost, it would tell its sender that the run has
    the value while the run goes on to ask for it again."""
    if snap.takes(state, event, step):
        return
    waits = sorted({_awaited(w) for w in snap.waiters(state) if w.pending})
    if waits:
        now = f"it waits for {', '.join(waits)}"
    elif snap.is_idle(state):
        now = "it waits for no event"
    else:
        now = (
            "a step is still in flight; if the run's process died, continue the run with "
            "RemitRuntime.recover first"
        )
    raise ResumeConflict(
        f"no waiter of the run waits for this {type(event).__name__} and no step takes it, so "
        f"the run would drop it ({now}); the event was not delivered: send it once the "
        "run waits for it",
        **ids,
    )


def _awaited(waiter: snap.Waiter) -> str:
    """What `waiter` waits for: its event type, and the `requirements` an event of that
    type must meet (else a refusal of one that misses them reads "no waiter waits for
    Reply ... it waits for Reply")."""
    name = waiter.event_type.rpartition(".")[2]
    if not waiter.requirements:
        return name
    wanted = ", ".join(f"{k}={v!r}" for k, v in sorted(waiter.requirements.items()))
    return f"{name} with {wanted}"


def _stops_process(tick: WorkflowTick) -> bool:
    """A cancel or the workflow timeout: what stops this process's copy of a run.

    For a parked run it means "stop here, resume later" (the framework's documented
    pause is `ctx.to_dict()` then `cancel_run()`), so it ends the copy and writes
    nothing; for a run with work in flight it ends the run as the framework does."""
    return isinstance(tick, (TickCancelRun, TickTimeout))


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
        asks: Mapping[str, dict[str, Any]] | None = None,
        resent: Mapping[str, Any] | None = None,
        effects: Mapping[str, Any] | None = None,
        deadlines: Mapping[str, float] | None = None,
        forked: bool = False,
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
        # Events from outside that answer no interrupt (nothing of them is stored before
        # they reach the control loop), by identity, until their tick is committed: the
        # delivery is acknowledged only then (`deliver`).
        self.storing: dict[int, asyncio.Future[None]] = {}
        # Open asks (interrupt id -> prompt) in journal order, as of the mirror, and
        # the ask each delivered answer (by event identity) consumed until it is reduced.
        self.asks: dict[str, dict[str, Any]] = dict(asks or {})
        self.answering: dict[int, str] = {}
        # Sends a step in flight at the crash had delivered (step key -> attempt, send
        # indexes), until its re-run starts; then by the re-run's invocation id.
        self.resends = _delivered_sends(self, init_state, resent or {})
        self.repeated: dict[str, tuple[str, int, frozenset[int]]] = {}
        # The effect calls of the work items the run holds, by step key; `forked`: the
        # head is the base of this session's fork, whose calls the fork shares.
        self.effects = _shared_effects.restored(
            effects or {}, init_state, self.step_key, forked=forked
        )
        # The step execution that started this run, for a child (`_child.StepExecution`).
        self.parent: str | None = None
        self.claim: ClaimHandle | None = None
        # Seconds a claim held elsewhere is waited for before `ResumeConflict`.
        self.claim_patience = 0.0
        # Whether the run is given its start event in this session (`run_workflow`): the
        # session-start tick before it is committed with the start event's tick, not on
        # its own. Stored on its own, a run whose process died before the next commit
        # would be found again not running, without its start event: a child run
        # started again after the crash would wait for ever, a recovered run would
        # start over under another id.
        self.starting = False
        self.opened: set[str] = set()
        # Alive-time deadlines of the pending waiters that have a timeout (by interrupt
        # id), and the ones of the restored state that this copy re-arms: monotonic
        # due time and the tick that times the waiter out (`due_timeout`).
        self.deadlines: dict[str, float] = dict(deadlines or {})
        now = time.monotonic()
        self.rearmed = {
            i: (now + left, tick)
            for i, (left, tick) in snap.rearmed_timeouts(init_state, self.deadlines).items()
        }
        self.done = False
        # The refusal of an event that this copy lost the run with (`stop_lost`).
        self.lost: ResumeConflict | None = None
        self.inner: ExternalRunAdapter | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        # Held from a commit's write until this copy names its checkpoint and has opened
        # its interrupts (`_commit`): the store shows a checkpoint as its write lands, and
        # a snapshot (`handle`) taken by whoever saw it there must name it.
        self._settling = threading.RLock()
        # The checkpoint a commit of this copy is writing, until this copy names it.
        self.landing: str | None = None
        self.store: RemitStateStore[Any] = RemitStateStore(
            state,
            schema=schema,
            serializer=serializer,
            ids=lambda: {"run_id": self.run_id, "checkpoint_id": self.head_id},
            handle=self.handle,
            after_write=self._after_state_write,
        )

    # -- identity --------------------------------------------------------------
    def handle(self) -> dict[str, Any]:
        """What `ctx.to_dict()` stores for the state: where the run lives in Remit; once
        the run has ended, with the live state too (`snap.carried_handle`).

        A commit in flight is waited for (`_settling`): once its checkpoint is in the
        store (`rt.status` reads "waiting" at a pause), a snapshot naming the one before
        would restore as a fork of the run."""
        with self._settling:
            return self._handle()

    def _handle(self) -> dict[str, Any]:
        handle = {
            "store_type": snap.HANDLE_TYPE,
            "run_id": self.run_id,
            "branch": self.branch,
            "checkpoint_id": self.head_id,
        }
        if self.mirror.is_running or self.head_id is None:
            return handle
        return snap.carried_handle(handle, self.store.payload(self.serializer))

    @property
    def fence(self) -> FenceRef | None:
        return None if self.claim is None else self.claim.fence

    def step_key(self, step_name: str, work_item_id: str | None) -> str:
        """Deterministic per work item: a re-run step finds its effects in the ledger."""
        key = f"{step_name}:{work_item_id}"
        return key if self.branch == MAIN_BRANCH else f"{self.branch}/{key}"

    def effect_scope(self, step_name: str, work_item_id: str | None) -> StepScope:
        """The scope of a step execution's effects, keyed per work item (a re-run finds
        its effects in the ledger) and counted, so that a fork shares them (P3)."""
        key = self.step_key(step_name, work_item_id)
        calls = self.effects.setdefault(
            key, _shared_effects.WorkItemEffects(step_name, work_item_id or "")
        )
        return SharedScope(
            self.remit, self.run_id, key, self.fence, counts=calls.counts, shared=calls.shared
        )

    def rerun_sends(
        self, step_name: str, work_item_id: str | None, invocation_id: str | None, attempt: int
    ) -> frozenset[int]:
        """The send indexes a recovered re-run of a step must not deliver again (P1).

        The framework keys each `ctx.send_event` by (invocation, send index) and drops a
        repeat, but a recovery dispatches the step in flight under a new invocation: its
        sends would reach steps that already completed on them. The first dispatch of
        that work item and attempt after the restore skips the indexes delivered before.
        """
        key = self.step_key(step_name, work_item_id)
        found = self.resends.get(key)
        if invocation_id is None or found is None or found[0] != attempt:
            return frozenset()
        del self.resends[key]
        self.repeated[invocation_id] = (key, *found)
        return found[1]

    def skips_send(self, tick: WorkflowTick) -> bool:
        """Whether `tick` repeats a send a step made before the crash (`rerun_sends`)."""
        emission = getattr(tick, "emission", None)
        if emission is None or emission.invocation_id not in self.repeated:
            return False
        return emission.index in self.repeated[emission.invocation_id][2]

    def _resent(self) -> dict[str, list[Any]]:
        """What `resends` a recovery of the current checkpoint must still know: the
        delivered sends of each re-run (or re-run to come) that is still in flight."""
        found: dict[str, list[Any]] = {}
        for ip in _in_flight(self.mirror):
            key = self.step_key(ip.shared_state.step_name, ip.work_item_id)
            repeated = self.repeated.get(ip.invocation_id or "")
            if repeated is not None:
                found[repeated[0]] = [repeated[1], sorted(repeated[2])]
            elif key in self.resends:
                attempt, indexes = self.resends[key]
                found[key] = [attempt, sorted(indexes)]
        return found

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

    async def _take_claim_patiently(self) -> None:
        """`take_claim`, retried while another holder has the claim, for up to
        `claim_patience` seconds (a dead holder's lease runs out meanwhile). A run that
        moved on elsewhere is refused as lost (`_lost_run`), not as a fork: this copy
        asked for no fork, it lost the run (a waiter's timeout firing in a parked copy
        whose run was answered or cancelled elsewhere)."""
        deadline = time.monotonic() + self.claim_patience
        while True:
            try:
                await asyncio.to_thread(self.take_claim)
            except ResumeConflict:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)
            except ForkWithoutIntent as exc:  # (a parked copy: the run moved on elsewhere)
                raise await self._lost_run("nothing ran here and nothing was stored") from exc
            else:
                self.claim_patience = 0.0
                return

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
        stored = self.storing.pop(id(tick.event), None) if isinstance(tick, TickAddEvent) else None
        try:
            await self._on_tick(tick)
        except Exception as exc:
            if stored is not None and not stored.done():
                stored.set_exception(exc)
            raise
        except BaseException:
            if stored is not None:
                stored.cancel()
            raise
        if stored is not None and not stored.done():
            stored.set_result(None)

    async def _on_tick(self, tick: WorkflowTick) -> None:
        if self.lost is not None:
            raise self.lost
        async with self.lock():
            seq = self.mirror.journal_seq
            before = self.mirror
            replay = await replay_ticks_stream(self.mirror, _one(tick), run_id=self.key)
            self.mirror = replay.state
            self._track_asks(tick, before)
            self.deadlines.update(snap.waiter_deadlines(before, self.mirror, tick))
            self.ticks.append(tick)
            self.unsaved.append((seq, tick))
            failure = _remit_failure(tick)
            if isinstance(failure, Fenced):  # (an effect's write, paused past the lease)
                raise self._taken_over(
                    failure, ": the step's effect record was not stored"
                ) from failure
            if failure is not None:
                raise failure
            if self.starting and isinstance(tick, TickSessionStart):
                self.starting = False
                return  # committed with the start event's tick (`starting`)
            status = snap.status_of(self.mirror, replay.exit_command)
            if self.claim is None and _stops_process(tick) and snap.is_idle(before):
                return  # the stored run stays parked: any process may resume it
            if status in snap.TERMINAL:
                self.asks.clear()
            if self.claim is None:
                if status == snap.WAITING:
                    return
                await self._take_claim_patiently()
            try:
                await asyncio.to_thread(self._commit, status, replay.exit_command)
            except _Unstorable as exc:
                found = exc.found or unstorable(await self.store.get_state(), self.serializer)
                await asyncio.to_thread(self._commit_failed, exc.__cause__, found, exc.what)
            if isinstance(tick, TickStepResult):
                failpoints.hit("step.after")
            if status in snap.TERMINAL or (status == snap.WAITING and not self.expected):
                await asyncio.to_thread(self.release_claim)

    def _track_asks(self, tick: WorkflowTick, before: BrokerState) -> None:
        """Open the asks a step result put on their way out; close the one an answer
        consumed once the answer is reduced (the journal then holds it)."""
        if isinstance(tick, TickAddEvent):
            self.expected.discard(id(tick.event))
            answered = self.answering.pop(id(tick.event), None)
            if answered is not None:
                self.asks.pop(answered, None)
        elif isinstance(tick, TickStepResult):
            for ask in snap.new_asks(before, self.mirror):
                self.asks.setdefault(ask.interrupt_id, ask.prompt())

    def _metadata(self, status: str, exit_command: object | None) -> dict[str, Any]:
        """The checkpoint's metadata. A run that has ended runs and waits for nothing
        more, whatever was in flight when it was cancelled or timed out."""
        last = self.unsaved[-1][1] if self.unsaved else None
        ended = status in snap.TERMINAL
        waiting = [w.interrupt_id for w in snap.waiters(self.mirror) if w.pending]
        meta: dict[str, Any] = {
            "source": "llamaindex",
            "status": status,
            "tick": getattr(last, "type", "update_state"),
            "next": [] if ended else snap.busy_steps(self.mirror),
            "waiting": [] if ended else [*waiting, *self.asks],
            "asks": dict(self.asks),
            "deadlines": self._deadlines(waiting),
            "resent": self._resent(),
            "effects": self._effects(),
            "journal_seq": self.mirror.journal_seq,
        }
        if isinstance(last, TickStepResult):
            meta["step"] = str(last.step_id)
        if self.parent is not None:
            meta["parent"] = self.parent
        result = getattr(exit_command, "result", None)
        if status == snap.COMPLETED and result is not None:
            meta["result"] = self.serializer.serialize(result)
        error = getattr(exit_command, "exception", None)
        if error is not None:
            meta["error"] = f"{type(error).__name__}: {error}"
        return meta

    def _deadlines(self, waiting: list[str]) -> dict[str, float]:
        """The deadlines a restore of the current checkpoint re-arms (pending waiters')."""
        self.deadlines = {i: d for i, d in self.deadlines.items() if i in waiting}
        return dict(self.deadlines)

    def due_timeout(self) -> tuple[float | None, WorkflowTick | None]:
        """The tick of a re-armed waiter timeout that is due, or the seconds until the
        next one (None, None: none left). An event accepted for the run and not yet
        reduced goes first: the waiter it answers must not time out under it."""
        if not self.rearmed:
            return None, None
        pending = {w.interrupt_id for w in snap.waiters(self.mirror) if w.pending}
        for interrupt_id in [i for i in self.rearmed if i not in pending]:
            del self.rearmed[interrupt_id]
        if not self.rearmed:
            return None, None
        interrupt_id, (due, tick) = min(self.rearmed.items(), key=lambda kv: kv[1][0])
        left = due - time.monotonic()
        if left > 0 or self.expected or self.injections:
            return max(left, _RECHECK), None
        del self.rearmed[interrupt_id]
        return None, tick

    def _effects(self) -> dict[str, Any]:
        """What a fork of the current checkpoint shares: the effect calls of the work
        items the run still holds (the others are forgotten)."""
        live = _shared_effects.live_items(self.mirror)
        self.effects = {k: e for k, e in self.effects.items() if e.item in live}
        return {k: e.to_json() for k, e in self.effects.items() if e.counts or e.shared}

    def _commit(self, status: str, exit_command: object | None = None) -> None:
        """Commit the mirrored state as the branch's next checkpoint (blocking)."""
        assert self.claim is not None
        fence = self.claim.fence
        checkpoint_id = new_checkpoint_id()
        try:
            self.store.check_live()
        except CheckpointInvalid as exc:
            raise _Unstorable((exc.field or "<state>", exc.message)) from exc
        carried = _unstorable_carried(self.unsaved, self.serializer)
        if carried is not None:
            raise _Unstorable(carried, what="event value")
        try:
            metadata = self._metadata(status, exit_command)
            payload = self.store.payload(self.serializer)
            body = snap.encode(self.mirror, payload, self.serializer, metadata)
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
        except (TypeError, ValueError) as exc:  # the framework's serializer refused a value
            raise _Unstorable() from exc
        plan = self._plan(fence)
        with self._settling:
            self.landing = checkpoint_id
            try:
                self.remit.commit(
                    run_id=self.run_id,
                    checkpoint_id=checkpoint_id,
                    parent_id=self.head_id,
                    state=body,
                    metadata=metadata,
                    fork_token=self.fork_token,
                    schema_version=self.schema_version,
                    workflow_version=self.workflow_version,
                    writes=writes,
                    fence=fence,
                    plan=plan,
                )
                self.head_id = checkpoint_id  # (named before `landing` is cleared)
            except Fenced as exc:  # (paused between its plan and its write)
                raise self._taken_over(exc, ": this checkpoint was not stored") from exc
            finally:
                self.landing = None
            self.unsaved.clear()
            self._open_interrupts(fence)

    def parking_at(self, head_id: str) -> bool:
        """Whether this copy is parking the run at `head_id`: its commit of that checkpoint
        is landing or has landed, and the claim it committed under is not released yet
        (the store shows the pause meanwhile)."""
        if self.done or self.lost is not None:
            return False
        return self.landing == head_id or (self.head_id == head_id and self.claim is not None)

    def _plan(self, fence: FenceRef) -> CommitPlan:
        """Where the next checkpoint goes: after this session's head, on its branch.

        If the head moved, a holder whose claim was taken over learns that (`Fenced`),
        not that its write would fork the run."""
        try:
            plan = self.remit.plan(self.run_id, self.head_id, fork_token=self.fork_token)
        except ForkWithoutIntent:
            self._check_fence(fence)
            raise
        if plan.branch != self.branch or plan.fork is not None:
            self._check_fence(fence)
            raise HeadMoved(
                f"branch {self.branch!r} of run {self.run_id!r} no longer has head "
                f"{self.head_id!r}",
                run_id=self.run_id,
                checkpoint_id=self.head_id,
            )
        return plan

    def _check_fence(self, fence: FenceRef) -> None:
        """Raise `Fenced` unless `fence` is still the branch claim's current one."""
        current = self.remit.store.get_claim(self.run_id, self.branch)
        if current is not None and (current.fence, current.holder) == (fence.fence, fence.holder):
            return
        raise self._taken_over()

    def _taken_over(self, refused: Fenced | None = None, what: str = "") -> Fenced:
        """The refusal of a write this copy made under a claim that ran out and that
        another resumer took over (L2), saying so: the store's own refusal names only
        fence numbers. `what`: what was not stored; `refused`: the store's refusal."""
        detail = "" if refused is None else f" (the store: {refused.message})"
        return Fenced(
            f"this process's claim on run {self.run_id!r} ran out and another resumer took "
            f"the run over; its writes are refused and its copy of the run stops{what}"
            f"{detail}",
            run_id=self.run_id,
            checkpoint_id=self.head_id,
        )

    def _commit_failed(
        self,
        cause: BaseException | None,
        found: tuple[str, str] | None,
        what: str = "state value",
    ) -> None:
        """A tick the framework's serializer cannot store ends the run: commit it as failed,
        with the state of its last checkpoint, and raise `CheckpointInvalid`.

        Left as it was, the run would look "running" and every recovery would redo the
        step and fail the same way."""
        assert self.claim is not None
        field, reason = found if found is not None else (None, f"{cause}"[:300])
        where = f"{what} at {field}" if field is not None else "an event or result"
        error = CheckpointInvalid(
            f"the run cannot be checkpointed: {where} cannot be stored ({reason}); it was "
            "stopped and committed as failed with the state of its last checkpoint",
            field=field,
            run_id=self.run_id,
            checkpoint_id=self.head_id,
        )
        if self.head_id is not None:
            fence = self.claim.fence
            record = self.remit.checkpoint(self.run_id, self.head_id)
            assert record is not None
            ctx = snap.decode(record.state, run_id=self.run_id, checkpoint_id=self.head_id)
            checkpoint_id = new_checkpoint_id()
            metadata: dict[str, Any] = {
                "source": "llamaindex",
                "status": snap.FAILED,
                "tick": "unstorable",
                "next": [],
                "waiting": [],
                "journal_seq": record.metadata.get("journal_seq"),
                "error": f"{type(error).__name__}: {error}",
            }
            if self.parent is not None:
                metadata["parent"] = self.parent
            plan = self._plan(fence)
            with self._settling:  # (as in `_commit`)
                self.remit.commit(
                    run_id=self.run_id,
                    checkpoint_id=checkpoint_id,
                    parent_id=self.head_id,
                    state=snap.body({**ctx, "is_running": False}, {}, metadata),
                    metadata=metadata,
                    fork_token=self.fork_token,
                    schema_version=self.schema_version,
                    workflow_version=self.workflow_version,
                    fence=fence,
                    plan=plan,
                )
                self.head_id = checkpoint_id
                self.unsaved.clear()
        self.release_claim()
        raise error from cause

    def _open_interrupts(self, fence: FenceRef | None) -> None:
        fresh = {
            w.interrupt_id: snap.waiter_prompt(w)
            for w in snap.waiters(self.mirror)
            if w.pending and w.interrupt_id not in self.opened
        }
        fresh.update((i, p) for i, p in self.asks.items() if i not in self.opened)
        if not fresh:
            return
        self.remit.open_interrupts(
            self.run_id,
            {i: codec.dumps(p) for i, p in fresh.items()},
            branch=self.branch,
            checkpoint_id=self.head_id,
            fence=fence,
        )
        self.opened.update(fresh)

    async def _after_state_write(self) -> None:
        """A state write while parked comes from outside the run: commit it at once.

        A write once the run has ended (its handler's context, as its `StopEvent`
        streams or after) is not the run's: committed, it would follow the ended head
        as a "running" one. It stays in the context, which carries it into the
        context's next run, as the framework's contexts do (`handle`). Once the run
        moved on elsewhere, the write is refused with `ResumeConflict`, and this copy
        stops at once (`_stop_moved`), as the watcher would stop it later."""
        if self.claim is not None or self.done or not self.mirror.is_running:
            return
        async with self.lock():
            try:
                await asyncio.to_thread(self.take_claim)
            except ForkWithoutIntent as exc:
                # The run moved on elsewhere: this copy lost it, as a refused event does.
                ended = await self._lost_run("its state write was not stored")
                await self._stop_moved(ended)
                raise ResumeConflict(
                    "the run moved on elsewhere (another process, thread or RemitRuntime "
                    "answered, continued or cancelled it) since this copy of it parked; the "
                    "state write was not stored, and this copy stopped",
                    run_id=self.key,
                    checkpoint_id=self.head_id,
                ) from exc
            try:
                await asyncio.to_thread(self._commit, snap.status_of(self.mirror, None))
            finally:
                await asyncio.to_thread(self.release_claim)

    # -- the gate ----------------------------------------------------------------
    async def deliver(self, tick: WorkflowTick) -> None:
        """Deliver an event from outside, consuming the interrupt it resolves (P5)."""
        async with self.lock():
            targets: dict[str, dict[str, Any]] = {}
            value = b""
            if isinstance(tick, TickAddEvent):
                targets = await self._resolved_by(tick)
                value = self.serializer.serialize(tick.event).encode()
            took = self.claim is None
            try:
                if took:
                    await self._claim_to_deliver(targets)
                try:
                    await asyncio.to_thread(self._consume, targets, value)
                except Fenced as exc:  # (paused while it held the claim to deliver)
                    if took:
                        await asyncio.to_thread(self.release_claim)
                    raise self._taken_over(exc, ": the event was not delivered") from exc
                except BaseException:
                    if took:
                        await asyncio.to_thread(self.release_claim)
                    raise
            except ResumeConflict as exc:
                if took:  # this parked copy lost the run to another resumer
                    await self.stop_lost(exc)
                raise
            assert self.inner is not None
            stored: asyncio.Future[None] | None = None
            if isinstance(tick, TickAddEvent):
                self.expected.add(id(tick.event))
                for interrupt_id in targets.keys() & self.asks.keys():
                    self.answering[id(tick.event)] = interrupt_id
                if not targets:
                    stored = asyncio.get_running_loop().create_future()
                    self.storing[id(tick.event)] = stored
            await self.inner.send_event(tick)
        if stored is not None:
            await self._until_stored(tick, stored)

    async def _until_stored(self, tick: WorkflowTick, stored: asyncio.Future[None]) -> None:
        """Wait until the tick of a delivered event that answers no interrupt is committed.

        An answer to a waiter or an ask is stored (its interrupt consumed) before the
        control loop sees it, and a recovery delivers it. Any other event (one a step
        takes: a fan-in's next input) is stored only with its tick: acknowledged before
        that, it was lost with a process that died right after the delivery returned,
        and the run waited for ever for an event its sender was told was delivered. A
        copy that stops first (lost to another resumer, cancelled, ended) stores nothing
        more: the delivery is refused with `ResumeConflict`."""
        stopped = ResumeConflict(
            "this copy of the run stopped before the event was stored; the event was not delivered",
            run_id=self.key,
            checkpoint_id=self.head_id,
        )
        try:
            while not stored.done():
                if self.lost is not None:
                    raise self.lost
                if self.done:
                    raise stopped
                await asyncio.wait({stored}, timeout=_RECHECK)
        finally:
            if not stored.done():  # (given up: nobody is told of its outcome later)
                self.storing.pop(id(getattr(tick, "event", None)), None)
        if stored.cancelled():
            raise stopped
        stored.result()

    async def _claim_to_deliver(self, targets: Mapping[str, Any]) -> None:
        """Take the claim of a parked run to deliver an event to it, or `ResumeConflict`
        (naming the interrupt if another resumer consumed it).

        The process that parked the run releases its claim just after committing the
        parked head, which others can read meanwhile: a claim found held is tried again
        once it is released, for a little while (`_PARKING`). A claim that is not
        released (another resumer's, live or not) is refused as before, and so is the
        run once another resumer has moved its head on (`ResumeConflict`)."""
        deadline = time.monotonic() + _PARKING
        try:
            while True:
                try:
                    await asyncio.to_thread(self.take_claim)
                    return
                except ResumeConflict:
                    if not await self._claim_released(deadline):
                        raise
        except ForkWithoutIntent as exc:
            await asyncio.to_thread(self._refuse_consumed, targets)
            raise ResumeConflict(
                "another resumer moved the run on since this copy of it was "
                "restored; the event was not delivered",
                run_id=self.run_id,
                checkpoint_id=self.head_id,
            ) from exc

    async def _claim_released(self, deadline: float) -> bool:
        """Wait until the claim held on the run is released or its lease has run out
        (True: a holder that died after parking the run, or while delivering to it,
        releases nothing, and its lease is what frees the run, L1) or `deadline` passes
        (False); `ForkWithoutIntent` as soon as the head moves on: another resumer has
        the run, and taking its claim (its lease may have run out under load) would
        only fence it."""
        while time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            branch = await asyncio.to_thread(self.remit.branch, self.run_id, branch=self.branch)
            if branch is None or branch.head_id != self.head_id:
                raise ForkWithoutIntent(
                    f"run {self.run_id!r} moved on from {self.head_id!r} elsewhere",
                    run_id=self.run_id,
                    checkpoint_id=self.head_id,
                )
            claim = await asyncio.to_thread(self.remit.store.get_claim, self.run_id, self.branch)
            if claim is None or not claim.holder or claim.expires_at <= self.remit.clock():
                return True
        return False

    async def watch_parked(self, pace: float) -> None:
        """While this copy is parked, look at the stored head every `pace` seconds: once
        it moved on elsewhere (another process, thread or runtime answered, continued or
        cancelled the run), this copy can take no answer, and waiting it would wait for
        ever. It stops then, running and storing nothing: as a cancel stops it if the run
        was cancelled, else with `ResumeConflict` (`stop_lost`)."""
        while not self.done and self.lost is None:
            await asyncio.sleep(pace)
            seen = self.head_id
            if self.claim is not None or seen is None or self.inner is None:
                continue
            try:
                moved = await asyncio.to_thread(self._moved_on, seen)
            except Exception:  # (a store hiccup: look again at the next beat)
                logger.debug("run %s: reading its head failed", self.key, exc_info=True)
                continue
            if moved is None:
                continue
            async with self.lock():
                if self.done or self.lost is not None or self.claim is not None:
                    continue
                if self.head_id != seen:
                    continue  # (this copy moved the run on itself meanwhile)
                await self._stop_moved(self._moved_refusal(seen, *moved, "nothing ran here"))
                return

    def _moved_refusal(
        self, seen: str | None, head: str | None, status: str, what: str
    ) -> ResumeConflict | WorkflowCancelledByUser:
        """What a parked copy whose run moved on from `seen` to `head` (`status`) elsewhere
        ends with: `WorkflowCancelledByUser` if the run was cancelled, else
        `ResumeConflict` saying so; `what` says what came of this copy's own work."""
        if status == snap.CANCELLED:
            return WorkflowCancelledByUser()
        return ResumeConflict(
            f"the run moved on elsewhere (its head is {head!r}, {status}): another process, "
            "thread or RemitRuntime answered or continued it, so this parked copy of it can "
            f"take no answer and stopped; {what}. Read the outcome with RemitRuntime.status "
            "or RemitRuntime.result",
            run_id=self.key,
            checkpoint_id=seen,
        )

    async def _lost_run(self, what: str) -> ResumeConflict | WorkflowCancelledByUser:
        """The refusal of this parked copy's write (`what` says what was not stored) once
        `take_claim` found the run moved on elsewhere (`_moved_refusal`)."""
        seen = self.head_id
        moved = None if seen is None else await asyncio.to_thread(self._moved_on, seen)
        head, status = moved if moved is not None else (None, "unknown")
        return self._moved_refusal(seen, head, status, what)

    async def _stop_moved(self, refusal: ResumeConflict | WorkflowCancelledByUser) -> None:
        """Stop this parked copy of a run that moved on elsewhere, running and storing
        nothing: as a cancel stops it if the run was cancelled, else with `refusal`."""
        if self.inner is None:
            return
        if isinstance(refusal, WorkflowCancelledByUser):
            await self.inner.cancel()  # (a parked copy's cancel writes nothing)
        else:
            await self.stop_lost(refusal)

    def _moved_on(self, seen: str) -> tuple[str | None, str] | None:
        """The stored head and its status if the branch moved on from `seen`, else None."""
        branch = self.remit.branch(self.run_id, branch=self.branch)
        head = None if branch is None else branch.head_id
        if head == seen:
            return None
        try:
            record = None if head is None else self.remit.checkpoint(self.run_id, head)
        except RemitError:  # (moved on all the same; its head does not verify)
            return head, "unreadable"
        status = "gone" if record is None else str(record.metadata.get("status", snap.RUNNING))
        return head, status

    async def stop_lost(self, refusal: ResumeConflict) -> None:
        """Stop this copy of the run, which lost it to another resumer, through its own
        control loop: its next tick raises `refusal` (`on_tick`), so the handler ends
        with it and nothing is stored; the stored run is the winner's."""
        self.lost = refusal
        assert self.inner is not None
        await self.inner.send_event(TickCancelRun())

    def inject(self, event: Event, ask: str | None = None) -> None:
        """Queue an accepted resume value whose delivery a crash interrupted."""
        self.expected.add(id(event))
        if ask is not None:
            self.answering[id(event)] = ask
        self.injections.append(TickAddEvent(event=event))

    def _refuse_consumed(self, targets: Mapping[str, Any]) -> None:
        """A resumer that lost the race for an interrupt gets `ResumeConflict`."""
        for interrupt_id in targets:
            record = self.remit.interrupt(self.run_id, interrupt_id, branch=self.branch)
            if record is not None and record.status == "consumed":
                raise ResumeConflict(
                    "interrupt was already consumed by another resumer; the value was not "
                    "delivered",
                    run_id=self.run_id,
                    interrupt_id=interrupt_id,
                )

    async def _resolved_by(self, tick: TickAddEvent) -> dict[str, dict[str, Any]]:
        """The interrupts `tick` resolves (id -> prompt): the pending waiters it answers,
        else for an answer the oldest open ask. Refuses a response to a resolved waiter,
        an answer when every ask was answered, any event once the run has ended, and
        an event the run would drop (`check_awaited`)."""
        ids = {"run_id": self.run_id, "checkpoint_id": self.head_id}
        validated_event(tick.event, self.serializer, **ids)
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
            return {w.interrupt_id: snap.waiter_prompt(w) for w in hit}
        # An answer that no step takes (a `HumanResponseEvent` where the step that takes
        # answers takes a subclass of it, say) answers no ask: the framework drops it, so
        # consuming the ask with it would leave the run waiting for an answer that every
        # later one is refused as (`check_awaited` refuses it below).
        routed = snap.takes(self.mirror, tick.event, tick.step_id)
        answer = snap.is_answer(tick.event) and routed
        if answer:
            taken = set(self.answering.values())
            for interrupt_id, prompt in self.asks.items():
                if interrupt_id not in taken:
                    return {interrupt_id: prompt}
        for record in await asyncio.to_thread(
            self.remit.interrupts, self.run_id, branch=self.branch
        ):
            if record.status != "consumed":
                continue
            prompt = codec.loads(record.prompt) if record.prompt else {}
            if snap.answered_earlier(
                self.mirror, record.interrupt_id, prompt, tick.event, tick.step_id
            ):
                continue
            if prompt.get("kind") == "ask" and answer:
                raise ResumeConflict(
                    "every input this run asked for was answered already; the value was "
                    "not delivered",
                    interrupt_id=record.interrupt_id,
                    **ids,
                )
            # An event a step takes goes to that step: a consumed waiter still held
            # would have been matched above (`stale`), so this one's step has completed
            # and the framework gives the event to no waiter of it (a `Reply` after
            # a waiter of a step that takes subclasses of its type was answered).
            if not routed and snap.would_answer(prompt, tick.event, self.mirror):
                raise ResumeConflict(
                    "interrupt was already consumed; the value was not delivered",
                    interrupt_id=record.interrupt_id,
                    **ids,
                )
        if not self.mirror.is_running and self.ticks:
            raise ResumeConflict("the run has ended; the event was not delivered", **ids)
        check_awaited(self.mirror, tick.event, tick.step_id, **ids)
        return {}

    def _consume(self, targets: Mapping[str, dict[str, Any]], value: bytes) -> None:
        """Consume every interrupt the event resolves, or none of them (P5).

        An event may resolve several waiters (one without requirements, one whose
        requirements it meets). Each is checked before any is consumed: consumed one by
        one, a refusal at the second would leave the first consumed with a value its
        sender was told was not delivered, and a recovery would deliver it after all.
        (The run's claim is held here, so no other resumer consumes in between.)"""
        found = {
            interrupt_id: self.remit.interrupt(self.run_id, interrupt_id, branch=self.branch)
            for interrupt_id in targets
        }
        for interrupt_id, record in found.items():
            if record is not None and record.status == "consumed":
                raise ResumeConflict(
                    "interrupt was already consumed; the value was not delivered, and no "
                    "other interrupt it would answer was consumed with it",
                    run_id=self.run_id,
                    interrupt_id=interrupt_id,
                    checkpoint_id=self.head_id,
                )
        for interrupt_id, prompt in targets.items():
            if found[interrupt_id] is None:
                self.remit.open_interrupts(
                    self.run_id,
                    {interrupt_id: codec.dumps(prompt)},
                    branch=self.branch,
                    checkpoint_id=self.head_id,
                    fence=self.fence,
                )
            self.remit.consume(
                self.run_id, interrupt_id, value, branch=self.branch, fence=self.fence
            )
            self.opened.add(interrupt_id)

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


def _in_flight(state: BrokerState) -> list[InProgressState]:
    return [
        ip
        for _, broker in snap.walk_brokers(state)
        for worker in broker.workers.values()
        for ip in worker.in_progress
    ]


def _delivered_sends(
    session: Session, state: BrokerState, resent: Mapping[str, Any]
) -> dict[str, tuple[int, frozenset[int]]]:
    """Per step in flight in a restored state: its attempt and the indexes of its sends
    already delivered, by its last invocation (`received`) and by the ones before it
    (carried in the checkpoint's `resent`, for the same attempt)."""
    found: dict[str, tuple[int, frozenset[int]]] = {}
    for ip in _in_flight(state):
        if ip.work_item_id is None:
            continue
        key = session.step_key(ip.shared_state.step_name, ip.work_item_id)
        indexes = set(ip.received)
        carried = resent.get(key)
        if carried is not None and carried[0] == ip.attempts:
            indexes.update(carried[1])
        if indexes:
            found[key] = (ip.attempts, frozenset(indexes))
    return found


class _Unstorable(Exception):
    """Raised from a commit whose checkpoint cannot be stored: the serializer could not
    encode it, or its state fails the schema (the error is its cause; `found` names the
    field and the reason when known)."""

    def __init__(self, found: tuple[str, str] | None = None, what: str = "state value") -> None:
        super().__init__()
        self.found = found
        self.what = what


def _unstorable_carried(
    ticks: list[tuple[int, WorkflowTick]], serializer: JsonSerializer
) -> tuple[str, str] | None:
    """The first value an event of `ticks` carries (a step's returned or sent event, an
    added event) that the checkpoint would give back as another value: a step re-run
    after a crash would run on that other value (`unstorable_event`). (A `StopEvent`'s
    `result` is not one of its fields: it is stored as the framework encodes it.)"""
    for _, tick in ticks:
        events: list[Event] = []
        if isinstance(tick, TickAddEvent):
            events.append(tick.event)
        elif isinstance(tick, TickStepResult):
            events.extend(
                r.result
                for r in tick.result
                if isinstance(r, StepWorkerResult) and r.result is not None
            )
            events.extend(s.event for s in tick.sends)
        for event in events:
            found = unstorable_event(event, serializer)
            if found is not None:
                return f"{type(event).__name__}.{found[0]}", found[1]
    return None
