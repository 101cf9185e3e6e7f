"""`RemitWorkflowStore`: the workflow server's `AbstractWorkflowStore` on Remit.

    from llama_agents.server import WorkflowServer
    server = WorkflowServer(workflow_store=RemitWorkflowStore("postgresql://..."))

Where the server's own stores fall short, this one keeps the contract:

- Ticks and events are expected-sequence appends: each process keeps the
  next sequence number of a run and writes exactly that slot; a slot another
  writer took is refused (`WriteConflict`), never retried as MAX+1.
- Every write of a run (ticks, events, handler status, state) is made under
  the run's leased claim and carries its fence: a second server cannot drive
  a run another live server holds (`ResumeConflict`), and a server whose
  lease was taken over has its writes refused (`Fenced`). The claim is
  released when the handler ends or goes idle. A server that read a run's
  journal to rebuild it (a restart's resume, an idle run's reload) waits out
  the lease of the holder it finds before its first write of the run: a server
  killed while it drove the run stops renewing, and its run is taken over once
  that lease runs out (a live holder renews, and is refused as above).
- Persistence errors stop the run. The server logs and swallows a failed
  tick append (`_PersistenceInternalRunAdapter.on_tick`); this store then
  cancels the run's task itself, and refuses every later write of that run
  in this process, so the run never runs on with a gap in its journal. The
  stored run stays as it was: "running", resumable from its last tick.
- A run waiting for an event stays alive. The framework keeps a run's
  in-memory state only while something references it, and while the run
  waits nothing does: a garbage collection would destroy it and the next
  event would be acknowledged and lost. The store holds the task of every
  run it appends ticks for, until the task ends.
- An `@effect` in a step the server runs is recorded in the run's effect
  ledger under the run's claim (its fence): keyed by the step execution's
  work item, which the server's replay of the journal gives back, so a step
  run again after a crash (on a new server) finds its effects recorded and
  does not apply them again (P2), while each work item (a second event, a
  loop's next round) gets keys of its own. A retry of the work item
  (`retry_policy`) shares them, as under `RemitRuntime`.
- State is validated on every write against the workflow's state model:
  an invalid value (even one built with `model_construct`) raises
  `CheckpointInvalid` naming the field in the step, and nothing is stored; so
  does a value the JSON serializer cannot store as it is. Each state write is
  a compare-and-set of the state's head, so a lost update raises `HeadMoved`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timezone
from typing import Any, TypeVar

from llama_agents.client.protocol.serializable_events import (  # type: ignore[import-untyped]
    EventEnvelopeWithMetadata,
)
from llama_agents.server._store.abstract_workflow_store import (
    AbstractWorkflowStore,
    HandlerQuery,
    PersistentHandler,
    StoredEvent,
    StoredTick,
    decode_persistent_handler,
    is_terminal_status,
)
from pydantic import BaseModel, ValidationError
from workflows.context.serializers import BaseSerializer, JsonSerializer, PickleSerializer
from workflows.context.state_store import (
    MODEL_T,
    DictState,
    StateRecord,
    StateStoreFacade,
    decode_state,
)
from workflows.plugins.basic import get_current_run_id
from workflows.runtime.types.results import StepWorkerState, StepWorkerStateContextVar

from remit_core import connect
from remit_core.core import DEFAULT_LEASE, ClaimHandle, Remit, checked_lease
from remit_core.effects import StepScope, register_scope_resolver
from remit_core.errors import CheckpointInvalid, RemitError, ResumeConflict
from remit_core.records import FenceRef, WriteRecord
from remit_core.schema import StateSchema
from remit_core.stores import check_url
from remit_llamaindex import _snapshot as snap
from remit_llamaindex._run import new_checkpoint_id
from remit_llamaindex._storable import checked_state

logger = logging.getLogger("remit_llamaindex.server")

NS = "llamaindex.server"
HANDLE_TYPE = "remit-server"
_SCOPE = "server"
_T = TypeVar("_T")
#: Seconds waited past a holder's lease before taking its run over.
_SETTLE = 0.1


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _matches(handler: PersistentHandler, query: HandlerQuery) -> bool:
    """The server's query semantics: every given filter must hold (an empty list matches none)."""
    checks = (
        (query.handler_id_in, handler.handler_id),
        (query.run_id_in, handler.run_id),
        (query.workflow_name_in, handler.workflow_name),
        (query.status_in, handler.status),
    )
    if any(values is not None and value not in values for values, value in checks):
        return False
    return query.is_idle is None or query.is_idle == (handler.idle_since is not None)


def _checked_poll_interval(poll_interval: object) -> float:
    """`poll_interval` as seconds, or `TypeError`/`ValueError` naming it: the server's
    event streams (`subscribe_events`) wait that long between reads of a run's events,
    so 0 or less reads the store in a busy loop, and a value that is not a number
    fails only inside the first stream."""
    if isinstance(poll_interval, bool) or not isinstance(poll_interval, (int, float)):
        raise TypeError(
            f"poll_interval must be a number of seconds, not {type(poll_interval).__name__}"
        )
    try:
        seconds = float(poll_interval)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(
            f"poll_interval must be a finite number of seconds above 0, got {poll_interval!r:.40}"
        )
    return seconds


def _checked_sequence(name: str, value: object) -> int:
    """`value` as an int (None as 0), or a `TypeError` naming the argument (a bool or
    a float would be taken as a position, a str compared as text)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r:.40}")
    return value


class RemitWorkflowStore(AbstractWorkflowStore):
    """Handlers, ticks, events and state of a workflow server, in a Remit store.

    `url`: sqlite:///file.db, postgresql://... or redis://...; `lease`: seconds
    a server holds a run without renewing; `namespace`: keeps the handler
    index of several deployments on one store apart; `poll_interval`: seconds an
    event stream of the server waits between reads of a run's new events.
    """

    def __init__(
        self,
        url: str = "sqlite:///remit.db",
        *,
        lease: float = DEFAULT_LEASE,
        namespace: str = "default",
        poll_interval: float = 0.2,
    ) -> None:
        super().__init__()
        # (A mistyped URL or lease is refused here, not at the server's first write.)
        self.url = check_url(url)
        self.lease = checked_lease(lease)
        self.poll_interval = _checked_poll_interval(poll_interval)
        self._index = f"llamaindex-server:{namespace}"
        self._remit: Remit | None = None
        self._remit_pid = -1
        self._lock = threading.Lock()
        self._claim_lock = threading.Lock()
        self._claims: dict[str, ClaimHandle] = {}
        self._next: dict[tuple[str, str], int] = {}
        self._stopped: dict[str, RemitError] = {}
        self._runs: dict[str, asyncio.Task[Any]] = {}
        # Runs whose journal this server read to rebuild them, not yet claimed since.
        self._rebuilt: set[str] = set()
        _stores.add(self)

    @property
    def remit(self) -> Remit:
        if self._remit is None or self._remit_pid != os.getpid():
            self._remit = connect(self.url, lease=self.lease)
            self._remit_pid = os.getpid()
        return self._remit

    # -- claims and stopping ------------------------------------------------------------
    def _fence(self, run_id: str) -> FenceRef:
        """The fence of this server's claim on `run_id`, taking the claim if needed (blocking).

        The server writes a run from several threads at once (a reloaded run's handler
        status and its first tick race); the claim is taken once, under a lock, so that
        the second writer shares it instead of losing to its own server.
        """
        with self._claim_lock:
            stopped = self._stopped.get(run_id)
            if stopped is not None:
                raise stopped
            claim = self._claims.get(run_id)
            if claim is None or claim.lost:
                claim = self.remit.claim(run_id, _SCOPE)
                self._claims[run_id] = claim
            return claim.fence

    def _holds(self, run_id: str) -> bool:
        """Whether this server holds the claim on `run_id` (as far as it knows)."""
        with self._claim_lock:
            claim = self._claims.get(run_id)
            return claim is not None and not claim.lost

    def _release(self, run_id: str) -> None:
        with self._claim_lock:
            claim = self._claims.pop(run_id, None)
        if claim is not None:
            claim.release()

    async def _outwait_holder(self, run_id: str) -> None:
        """Before the first write of a run this server rebuilt from its journal, take
        its claim, waiting once for the lease of the holder found to run out: that
        holder is most often a server that died driving the run (L1). A holder that
        renews meanwhile is alive, and the write is refused (`ResumeConflict`)."""
        if run_id not in self._rebuilt:
            return
        try:
            await asyncio.to_thread(self._fence, run_id)
        except ResumeConflict:
            held = await asyncio.to_thread(self.remit.store.get_claim, run_id, _SCOPE)
            if held is not None:
                left = held.expires_at - self.remit.clock()
                await asyncio.sleep(max(0.0, left) + _SETTLE)
            await asyncio.to_thread(self._fence, run_id)
        self._rebuilt.discard(run_id)

    async def _guarded(self, run_id: str, fn: Callable[[], _T]) -> _T:
        """Run a blocking write of `run_id`; a refusal stops the run in this process."""
        try:
            await self._outwait_holder(run_id)
            return await asyncio.to_thread(fn)
        except RemitError as exc:
            if run_id not in self._stopped:
                self._stopped[run_id] = exc
                logger.error("persistence of run %s failed; stopping the run", run_id)
            raise

    # -- handlers -------------------------------------------------------------------------
    def _handlers(self) -> list[PersistentHandler]:
        found = []
        for w in self.remit.writes(self._index, "handlers", ns=NS):
            if w.channel != "handler":
                continue
            found.append(decode_persistent_handler(json.loads(w.value), self.result_decoder))
        return found

    async def query(self, query: HandlerQuery) -> list[PersistentHandler]:
        handlers = await asyncio.to_thread(self._handlers)
        return [h for h in handlers if _matches(h, query)]

    def _put_handler(
        self, handler: PersistentHandler, channel: str, fence: FenceRef | None
    ) -> None:
        value = json.dumps(handler.model_dump(mode="json")).encode()
        writes = [WriteRecord(self._index, "handlers", handler.handler_id, 0, channel, value, NS)]
        if fence is not None:
            # The run's own copy carries the fence; the index entry rides with it,
            # so a server that lost the run cannot change its status in the index.
            writes.append(WriteRecord(fence.run_id, "handler", "handler", 0, channel, value, NS))
        self.remit.put_writes(writes, mode="overwrite", fence=fence)

    async def update(self, handler: PersistentHandler) -> None:
        """Write a handler record; one with a run is fenced by the run's claim."""
        run_id = handler.run_id
        if run_id is None:
            await asyncio.to_thread(self._put_handler, handler, "handler", None)
            return

        def write() -> None:
            self._put_handler(handler, "handler", self._fence(run_id))
            if is_terminal_status(handler.status) or handler.idle_since is not None:
                self._release(run_id)

        await self._guarded(run_id, write)

    async def delete(self, query: HandlerQuery) -> int:
        """Delete the handlers `query` matches; as in the server's own durable stores, a
        query with no filter at all deletes nothing (it is not "delete everything")."""
        filters = (query.handler_id_in, query.run_id_in, query.workflow_name_in, query.status_in)
        if all(f is None for f in filters) and query.is_idle is None:
            return 0
        doomed = await self.query(query)

        def tombstone() -> None:
            for h in doomed:
                self._put_handler(h, "deleted", None)

        await asyncio.to_thread(tombstone)
        return len(doomed)

    # -- ticks and events: expected-sequence appends --------------------------------------
    def _append(self, run_id: str, kind: str, body: dict[str, Any]) -> int:
        with self._lock:
            key = (run_id, kind)
            if key not in self._next:
                stored = self.remit.writes(run_id, kind, ns=NS)
                self._next[key] = max((w.idx for w in stored), default=-1) + 1
            seq = self._next[key]
            value = json.dumps({"t": _now().isoformat(), **body}).encode()
            self.remit.put_writes(
                [WriteRecord(run_id, kind, kind, seq, kind, value, NS)],
                mode="expect_absent",
                fence=self._fence(run_id),
            )
            self._next[key] = seq + 1
            return seq

    def _read(self, run_id: str, kind: str, after: int | None) -> list[tuple[int, dict[str, Any]]]:
        return [
            (w.idx, json.loads(w.value))
            for w in self.remit.writes(run_id, kind, ns=NS, after_idx=after)
        ]

    async def append_tick(self, run_id: str, tick_data: dict[str, Any]) -> None:
        """Append the next tick; on refusal the run's task is cancelled (see module doc)."""
        task = asyncio.current_task()
        if task is not None:
            self._keep(run_id, task)
        try:
            await self._guarded(run_id, lambda: self._append(run_id, "ticks", {"tick": tick_data}))
        except RemitError:
            if task is not None:
                task.cancel()
            raise

    def _keep(self, run_id: str, task: asyncio.Task[Any]) -> None:
        """Hold the run's task (its control loop) until it ends (see module doc)."""
        if self._runs.get(run_id) is task:
            return
        self._runs[run_id] = task

        def forget(done: asyncio.Task[Any]) -> None:
            if self._runs.get(run_id) is done:
                del self._runs[run_id]

        task.add_done_callback(forget)

    def _replay(self, run_id: str) -> list[tuple[int, dict[str, Any]]]:
        """Read the journal; this process's next appends follow what it read."""
        with self._lock:
            rows = self._read(run_id, "ticks", None)
            events = self.remit.writes(run_id, "events", ns=NS)
            self._next[(run_id, "ticks")] = max((seq for seq, _ in rows), default=-1) + 1
            self._next[(run_id, "events")] = max((w.idx for w in events), default=-1) + 1
            self._rebuilt.add(run_id)
        return rows

    async def get_ticks(self, run_id: str) -> list[StoredTick]:
        """The run's journal. A server reads it to rebuild the run; appends then expect
        the slot after the last tick read (a writer that did not read it keeps its own
        expectation, and is refused if another writer took that slot)."""
        rows = await asyncio.to_thread(self._replay, run_id)
        return [
            StoredTick(
                run_id=run_id,
                sequence=seq,
                timestamp=datetime.fromisoformat(body["t"]),
                tick_data=body["tick"],
            )
            for seq, body in rows
        ]

    async def append_event(self, run_id: str, event: EventEnvelopeWithMetadata) -> None:
        body = {"event": event.model_dump(mode="json")}
        await self._guarded(run_id, lambda: self._append(run_id, "events", body))

    async def query_events(
        self, run_id: str, after_sequence: int | None = None, limit: int | None = None
    ) -> list[StoredEvent]:
        """The run's events after `after_sequence`, at most `limit` of them (None: all).
        A `limit` below 0 is refused (`ValueError`): the server's own stores answer it
        three ways (all events, all but the last ones, an error)."""
        _checked_sequence("after_sequence", after_sequence)
        if _checked_sequence("limit", limit) < 0:
            raise ValueError(f"limit must be None or at least 0, got {limit!r}")
        rows = await asyncio.to_thread(self._read, run_id, "events", after_sequence)
        events = [
            StoredEvent(
                run_id=run_id,
                sequence=seq,
                timestamp=datetime.fromisoformat(body["t"]),
                event=EventEnvelopeWithMetadata.model_validate(body["event"]),
            )
            for seq, body in rows
        ]
        return events if limit is None else events[:limit]

    # -- state ------------------------------------------------------------------------------
    def _build_state_store(
        self,
        run_id: str,
        namespace: tuple[str, ...],
        state_type: type[Any] | None,
        serializer: BaseSerializer | None,
    ) -> StateStoreFacade[Any]:
        storage = _RemitStateStorage(self, run_id, namespace)
        facade: _RemitStateFacade[Any] = _RemitStateFacade(storage, state_type, serializer)
        storage.facade = facade
        return facade


# -- effects in served steps ----------------------------------------------------------------

#: The stores of this process, for the effect scope of a step one of them journals.
_stores: weakref.WeakSet[RemitWorkflowStore] = weakref.WeakSet()


def _step_key(state: StepWorkerState, run_id: str) -> str:
    """The key of a served step execution's effects: its work item, which the server's
    replay of the journal gives back to the step run again after a crash, and the
    scope it runs in (a nested workflow's work items are counted apart)."""
    if state.work_item_id is None:
        raise RemitError(
            f"step {state.step_name!r} runs without a work item id, so its effects would "
            "have no key that a re-run after a crash finds again; nothing was applied "
            "(a workflow state written by an older version of the framework)",
            run_id=run_id,
        )
    return "/".join((*state.scope_path, f"{state.step_name}:{state.work_item_id}"))


#: The effect scope of each served step execution that called an effect, by the id of
#: the framework's context of that execution (see `_served_scope`).
_served_scopes: dict[int, tuple[weakref.ref[Any], StepScope]] = {}
_served_scopes_lock = threading.Lock()


def _served_scope() -> StepScope | None:
    """The effect scope of a step a workflow server runs on a `RemitWorkflowStore`:
    the run's ledger, under the fence of the claim the store holds on the run (taken
    by the journal's first tick of the session, before any step runs). None outside
    such a step.

    One scope per step execution: the framework makes a context of its own for each
    (an attempt of a retried step, a step run again for its answer), and the calls a
    step makes in threads or tasks of its own (`asyncio.gather`, `asyncio.to_thread`),
    each in a copy of the step's context made before any effect was called, share it.
    A scope of their own each would number every call from 0, and each call after
    the first would get the first call's outcome instead of being applied (P2)."""
    run_id = get_current_run_id()
    worker = StepWorkerStateContextVar.get(None)
    if run_id is None or worker is None:
        return None
    with _served_scopes_lock:
        held = _served_scopes.get(id(worker))
    if held is not None and held[0]() is worker:
        return held[1]
    scope = _new_served_scope(run_id, worker)
    if scope is None:
        return None
    key = id(worker)

    def forget(_: Any) -> None:
        with _served_scopes_lock:
            if key in _served_scopes and _served_scopes[key][0]() is None:
                del _served_scopes[key]

    try:
        ref = weakref.ref(worker, forget)
    except TypeError:  # (a context that takes no weak reference: not shared)
        return scope
    with _served_scopes_lock:
        held = _served_scopes.get(key)
        if held is not None and held[0]() is worker:
            return held[1]  # (another thread of the same execution came first)
        _served_scopes[key] = (ref, scope)
    return scope


def _new_served_scope(run_id: str, worker: Any) -> StepScope | None:
    """A new scope for the served step execution `worker` of run `run_id` (see
    `_served_scope`)."""
    found = [s for s in list(_stores) if run_id in s._runs]
    if not found:
        return None
    # Another server of this process that reloads the run waits for its claim: the
    # step is of the server that holds it.
    holders = found if len(found) == 1 else [s for s in found if s._holds(run_id)]
    if len(holders) != 1:
        raise RemitError(
            f"run {run_id!r} is journalled by {len(found)} workflow stores of this process "
            f"and {len(holders)} of them hold its claim, so its effects have no one ledger "
            "and fence; nothing was applied",
            run_id=run_id,
        )
    store = holders[0]
    key = _step_key(worker.state, run_id)
    return StepScope(store.remit, run_id, key, store._fence(run_id))


register_scope_resolver(_served_scope)


class _RemitStateFacade(StateStoreFacade[MODEL_T]):
    """The framework's state facade, checking a state before it is encoded: against the
    state model (`CheckpointInvalid` naming the field), then that the serializer stores
    it as it is (the framework would raise a bare `ValueError`, or turn a tuple into a
    list)."""

    @functools.cached_property
    def schema(self) -> StateSchema | None:
        return None if self.state_type is DictState else StateSchema(self.state_type)

    async def _write_state(self, state: BaseModel, storage: Any = None) -> None:
        serializer = self._serializer
        if isinstance(serializer, JsonSerializer) and not isinstance(serializer, PickleSerializer):
            state = checked_state(state, self.schema, serializer, run_id=self.run_id)
        elif self.schema is not None:
            state = self.schema.validate(state, run_id=self.run_id)
        await super()._write_state(state, storage)


class _RemitStateStorage:
    """One run's state (one namespace) as a line of Remit checkpoints: load the head,
    save a validated new head with the loaded one as parent (compare-and-set)."""

    def __init__(
        self,
        owner: RemitWorkflowStore,
        run_id: str,
        namespace: tuple[str, ...],
        parent: str | None = None,
        bound: bool = False,
    ) -> None:
        self._owner = owner
        self._run_id = run_id
        self._namespace = namespace
        self._ns = "llamaindex.state/" + "/".join(namespace)
        self._parent = parent
        self._bound = bound
        self.facade: _RemitStateFacade[Any] | None = None

    @property
    def run_id(self) -> str:
        return self._run_id

    def _head(self) -> tuple[str | None, str | None]:
        remit = self._owner.remit
        branch = remit.branch(self._run_id, ns=self._ns)
        if branch is None or branch.head_id is None:
            return None, None
        record = remit.checkpoint(self._run_id, branch.head_id, ns=self._ns)
        assert record is not None
        return branch.head_id, record.state.decode()

    async def load(self) -> StateRecord | None:
        head, data = await asyncio.to_thread(self._head)
        if self._bound:
            self._parent = head
        return None if data is None else StateRecord(data=data)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[_RemitStateStorage]:
        bound = _RemitStateStorage(self._owner, self._run_id, self._namespace, bound=True)
        bound.facade = self.facade
        yield bound

    def _validate(self, data: str) -> None:
        """Refuse a state record that does not satisfy the workflow's state model, naming
        the field: the stored fields are checked against the model before decoding."""
        assert self.facade is not None
        ids = {"run_id": self._run_id}
        schema = self.facade.schema
        fields = snap.state_fields({"state_data": data})
        if schema is not None and fields is not None:
            schema.validate(fields, **ids)
        try:
            state = decode_state(data, self.facade._serializer)
        except (ValidationError, ValueError) as exc:
            raise CheckpointInvalid(f"state does not decode as its model: {exc}", **ids) from exc
        if schema is not None and isinstance(state, BaseModel):
            schema.validate(state, **ids)

    async def save(self, record: StateRecord) -> None:
        data = record.data if isinstance(record.data, str) else json.dumps(record.data)
        self._validate(data)
        owner = self._owner

        def commit() -> None:
            parent = self._parent if self._bound else self._head()[0]
            checkpoint_id = new_checkpoint_id()
            owner.remit.commit(
                run_id=self._run_id,
                checkpoint_id=checkpoint_id,
                parent_id=parent,
                state=data.encode(),
                ns=self._ns,
                metadata={"source": "llamaindex-server", "state_type": record.state_type},
                fence=owner._fence(self._run_id),
            )
            self._parent = checkpoint_id

        await owner._guarded(self._run_id, commit)

    def to_handle(self) -> dict[str, Any]:
        return {"store_type": HANDLE_TYPE, "run_id": self._run_id}

    def parse_own_handle(self, payload: dict[str, Any]) -> tuple[str, str] | None:
        if payload.get("store_type") != HANDLE_TYPE:
            return None
        return (HANDLE_TYPE, str(payload["run_id"]))

    async def copy_from_handle(self, handle: tuple[str, str]) -> None:
        source = _RemitStateStorage(self._owner, handle[1], self._namespace)
        source.facade = self.facade
        found = await source.load()
        if found is not None:
            await self.save(found)


__all__ = ["RemitWorkflowStore"]
