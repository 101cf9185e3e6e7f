"""`RemitStatePersistence`: pydantic-graph 1.x's `BaseStatePersistence` on Remit.

One instance drives one run (and one line of its history: a fork token binds
it to the branch that token made). Every snapshot is one Remit checkpoint
keyed by its snapshot id; its status (`created` -> `pending` -> `running` ->
`success` / `error`) is an append-only log of fenced step writes on that
checkpoint, one log per branch. In pydantic-graph's terms the contract reads:

- P1 / L1: `load_next` takes the run's leased claim and hands out the head
  node, also one whose process died (`pending` / `running` / `success` under
  an expired lease), with the same snapshot id. A node is done once the next
  snapshot is committed (its `success`, stored when `record_run` exits, is
  not enough); a cancelled node is given back.
- P2: a node's body runs under `remit_core.step_scope` keyed by its snapshot
  id (a node an operator's edit committed again: the edited node's; on a fork,
  also by the fork's branch), so `remit_core.effect` functions inside it apply once.
- P6: a node's next snapshot (a node or the `End`) that pydantic-graph gave a random id,
  or that has an id stored already, is named after the node it follows (also when a
  driver retries a step cut short): every recovery of one store stores it under one id,
  and keys its effects alike.
- P3: starting a new node on a run that already has a head, or running a
  snapshot that is not the head, is a fork and needs `fork_token`. A token
  that starts a run names that run's line; no node starts after an `End`.
  An instance with a token works on the line it names, whoever made it.
- P4: every snapshot round-trips through the graph's own type adapter before
  it is written (`_codec`); on read, stored bytes are verified and
  version-checked, and a stored node must be one of the graph's; a snapshot
  records its graph's nodes, and one of another graph (each has nodes the other
  lacks) is refused though its own node has a name this graph knows. A state is
  copied as the call storing it is made: a task still changing it is not read half way.
  An instance is set up for one graph: another (other node names, classes or types) is
  refused by `set_graph_types`.
- P5: `resume(node)` delivers a human's answer to a paused run, once, and
  gives the run back: any process may continue it. A driver that loaded the
  paused node as the answer came does not run it without the answer; an answer
  that comes while another process runs the paused node is refused. An answer
  is for one pause (`pause_id`, the paused snapshot's id): a retried answer is
  not taken by a later pause at the same node. An answer once taken is
  acknowledged, also to a resumer paused past its lease before it stored it
  (whoever took the run over stored it first).

An instance is one resumer: its claim is the instance's, whichever asyncio
task, event loop or thread makes each call, and instances exclude each other
through the store as processes do (a copy, `copy.copy` or `copy.deepcopy`, is
another instance of the same run, with a claim of its own). It makes one call
at a time: a call made while another is in progress (a node running included)
gets `ResumeConflict`.
Between two nodes it holds no claim: if another resumer runs its next node
meanwhile, it gets `ResumeConflict` as a racing resumer does.
Store calls are blocking; every async method runs them in a worker thread, to its
end also when the task is cancelled (the cancellation comes once they are done).
An instance made by URL while an event loop runs opens its store in a worker thread
too, at its first call (`_Opener`): a store's first open in a process (connecting,
creating its tables) would hold up every other task of the loop.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from time import perf_counter
from typing import Any, TypeVar
from urllib.parse import urlsplit

import anyio.to_thread
import pydantic
from pydantic_graph import BaseNode, End
from pydantic_graph.basenode import generate_snapshot_id
from pydantic_graph.exceptions import GraphNodeStatusError, GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import (
    BaseStatePersistence,
    EndSnapshot,
    NodeSnapshot,
    RunEndT,
    Snapshot,
    SnapshotStatus,
    StateT,
)
from pydantic_graph.persistence._utils import nodes_type_context

from remit_core import codec, policy
from remit_core.core import DEFAULT_LEASE, ClaimHandle, Remit, checked_id, checked_lease
from remit_core.effects import step_scope
from remit_core.errors import (
    CheckpointInvalid,
    CorruptRecord,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    RemitError,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
)
from remit_core.records import MAIN_BRANCH, BranchRecord, CheckpointRecord, FenceRef, WriteRecord
from remit_core.stores import check_url
from remit_core.stores.sqlite import sqlite_path
from remit_pydantic_graph._codec import (
    ForeignNode,
    NotASnapshot,
    SnapshotCodec,
    Unfit,
    Unreadable,
    foreign_node,
)

__all__ = ["EndNotRunnable", "RemitStatePersistence", "UnknownPause"]

#: A head node an answer may take the place of: one not started, or one that raised
#: (a pause run by mistake): nothing followed it.
_ANSWERABLE = ("created", "pending", "error")
#: Seconds a driver waits for the claim to run its own next node (`_begin_run`).
_OWN_NEXT_PATIENCE = 2.0
#: Seconds (at most half the lease) an answer or an edit waits for a claim another
#: resumer holds on the pause (`_paused_head`): one held for a moment (an edit, an
#: answer, a worker's poll) is given back by then; one held by a driver that loaded the
#: pause to run it is not.
_HELD_PATIENCE = 2.0
#: How often a resumer whose consumed answer's commit was fenced looks again (`_deliver`).
_DELIVER_TRIES = 3


class UnknownPause(ResumeConflict, UnknownRecord):
    """`resume()` or `update_state()` given a `pause_id` that names no snapshot of the run
    (a typo, another run's pause): no answer or edit can be for it. An `UnknownRecord`
    (a `LookupError`), so that a client does not take it for a pause answered by another
    resumer and drop its answer; and, for code that caught it as such before, still a
    `ResumeConflict`."""


class EndNotRunnable(GraphNodeStatusError):
    """`record_run` of the snapshot of a run's end: an end is not a node, it has
    nothing to run (pydantic-graph's own persistences assert a node snapshot)."""

    def __init__(self, snapshot_id: str) -> None:
        self.actual_status = "success"
        GraphRuntimeError.__init__(
            self, f"snapshot {snapshot_id!r} is the run's end, not a node: there is nothing to run"
        )


@dataclass
class _Stored:
    """A snapshot as the store holds it, with its status on the reading branch."""

    record: CheckpointRecord
    snapshot: Snapshot[Any, Any]
    status_idx: int

    @property
    def id(self) -> str:
        return self.record.checkpoint_id

    @property
    def is_node(self) -> bool:
        return isinstance(self.snapshot, NodeSnapshot)

    @property
    def status(self) -> SnapshotStatus:
        return self.snapshot.status if isinstance(self.snapshot, NodeSnapshot) else "success"

    def describe(self) -> str:
        return f"{self.id}, {self.status}" if self.is_node else f"{self.id}, the run's end"


@dataclass
class _Head:
    branch: BranchRecord
    top: _Stored


@dataclass
class _Resumer:
    """What an instance holds between its calls, whichever task or thread makes
    them: its claim, the node `load_next` handed out, the node it ran; and the
    snapshot it last made its branch's head or loaded (its driver's next node,
    kept when the claim is given back). `cut`: the node it ran whose end was being
    stored as its task was cancelled; the claim is given back, and a retried step
    stores that node's next one (`_snapshot_if_new`) until another claim is taken.
    `own_node`: the node object of that snapshot; `alias`: another id that object was
    given (by another run holding it) when its driver asked to run it, and the
    snapshot it runs as (`_snapshot_if_new`). `wrote`: the node status this instance
    wrote last, as (snapshot id, status log index)."""

    claim: ClaimHandle | None = None
    loaded: str | None = None
    ran: tuple[_Head, float] | None = None
    started: _Head | None = None
    own_head: str | None = None
    own_node: object = None
    alias: tuple[str, str] | None = None
    cut: tuple[_Head, float] | None = None
    wrote: tuple[str, int] | None = None


_T = TypeVar("_T")


async def _in_thread(call: Callable[..., _T], *args: Any) -> _T:
    """`call(*args)` in a worker thread, run to its end even if the task is cancelled.

    anyio keeps its own cancel scopes off a worker thread, not asyncio's
    `Task.cancel()`: the awaiting task would get `CancelledError` at once and clean
    up while the thread goes on, to take a claim (and heartbeat it) that no one
    gives back, or to mark a node running that no one runs. So the cancellation is
    let through only once the thread is done: the caller's cleanup then sees all it
    took and wrote.
    """
    work = asyncio.ensure_future(anyio.to_thread.run_sync(call, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():
            try:
                await asyncio.wait((work,))
            except asyncio.CancelledError:
                continue  # cancelled again: the first cancellation is raised below
        if not work.cancelled():
            work.exception()  # retrieved: the cancellation is what the caller gets
        raise


def _on_loop() -> bool:
    """Whether this thread is running an event loop (a store opened here would stall it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _pinned(url: str) -> str:
    """`url` as it names its store now (`ValueError` for one no engine takes): a relative
    SQLite path resolved against the working directory as the persistence is made, in the
    form the process's store cache knows it by, since the store opens later, maybe after
    an `os.chdir`."""
    if check_url(url).split(":", 1)[0].lower() != "sqlite":
        return url
    path = sqlite_path(url)
    if path == ":memory:" or os.path.isabs(path):
        return url
    return f"sqlite:///{os.path.abspath(path)}?{urlsplit(url).query}"


class _Opener:
    """The `Remit` of an instance and its copies and forks, opened at its first use.

    Opening a store the first time in a process connects to it and creates its tables
    (over 100 ms on a network engine). An instance made while an event loop runs opens
    it at its first call, in that call's worker thread, so the loop's other tasks go on
    meanwhile; concurrent first calls share one open (`open_store`'s lock)."""

    def __init__(self, url: str | Remit, lease: float) -> None:
        self._lock = threading.Lock()
        self.lease = lease
        self.url = url if isinstance(url, str) else ""
        self.opened: Remit | None = url if isinstance(url, Remit) else None

    def remit(self) -> Remit:
        remit = self.opened
        if remit is None:
            with self._lock:
                if self.opened is None:
                    self.opened = Remit(self.url, lease=self.lease)
                remit = self.opened
        return remit


def _check_versions(workflow_version: object, accept_versions: object) -> frozenset[str]:
    if not isinstance(workflow_version, str):
        raise TypeError(f"workflow_version must be a str, got {workflow_version!r}")
    if accept_versions is None:
        return frozenset((workflow_version,))
    if isinstance(accept_versions, (str, bytes)) or not isinstance(accept_versions, Iterable):
        raise TypeError(
            f"accept_versions must be a collection of str (e.g. {{'v1', 'v2'}}), "
            f"got {accept_versions!r}"
        )
    versions = frozenset(accept_versions)
    if not all(isinstance(v, str) for v in versions):
        raise TypeError(f"accept_versions must hold str only, got {sorted(map(repr, versions))}")
    # An instance reads what it writes: without its own version it would refuse the
    # next snapshot of every run it continues, right after writing it.
    return versions | {workflow_version}


def _generated(kind: str, snapshot_id: object) -> bool:
    """Whether `snapshot_id` has the form pydantic-graph gives a new node or End of
    `kind` (`generate_snapshot_id`), not one a user chose."""
    return (
        isinstance(snapshot_id, str)
        and re.fullmatch(rf"{re.escape(kind)}:[0-9a-f]{{32}}", snapshot_id) is not None
    )


def _as_called(state: _T) -> _T:
    """`state` as it is when a call is made: a copy, taken on the caller's thread before
    the call goes on in a worker thread (as `FullStatePersistence` copies it). A task the
    node left behind may go on changing the state on the event loop meanwhile; the worker
    would read it half changed, and refuse it as reading back as another. A state that
    cannot be copied (one holding a lock in a field excluded from dumps) is used as it is."""
    try:
        return copy.deepcopy(state)
    except Exception:  # not copyable: still storable, as its dump decides
        return state


def _checked_node(call: str, next_node: object) -> BaseNode[Any, Any, Any]:
    """`next_node` if it is a node: anything else would fail deep inside pydantic-graph's
    `NodeSnapshot` with an AttributeError that names neither the call nor the argument."""
    if isinstance(next_node, BaseNode):
        return next_node
    if isinstance(next_node, End) and call == "snapshot_node_if_new":
        # What `GraphRun.next` calls first with the node it was given, or, once the run has
        # ended, with its End (whose id the End's snapshot renamed: `_advance`).
        raise TypeError(
            f"run.next() takes a node to run, got {next_node!r}: a run ends when one of its "
            "nodes returns End, which is stored then (snapshot_node_if_new() got the End)"
        )
    hint = " (a run's End goes to snapshot_end)" if isinstance(next_node, End) else ""
    raise TypeError(
        f"{call}() takes next_node, a BaseNode instance of the graph{hint}; "
        f"got {type(next_node).__name__} {next_node!r}"
    )


def _checked_end(end: object) -> End[Any]:
    if isinstance(end, End):
        return end
    raise TypeError(
        f"snapshot_end() takes end, the End instance the run returned; "
        f"got {type(end).__name__} {end!r}"
    )


def _graph_difference(codec: SnapshotCodec[Any, Any], graph: Graph[Any, Any, Any]) -> str | None:
    """How `graph` differs from the graph `codec` was built for, in the user's words."""
    if codec.node_ids != frozenset(graph.node_defs):
        return "its nodes have other names"
    other = sorted(
        node_id
        for node_id, d in graph.node_defs.items()
        if node_id in codec.node_types and codec.node_types[node_id] != d.node
    )
    if other:
        return f"its {', '.join(other)} are other classes of the same names"
    state_type, run_end_type = graph.inferred_types
    if state_type != codec.state_type:
        return f"its state type is {state_type!r}, not {codec.state_type!r}"
    if run_end_type != codec.run_end_type:
        return f"its run-end type is {run_end_type!r}, not {codec.run_end_type!r}"
    return None


def _what_commit(snapshot: Snapshot[Any, Any], via: str | None) -> str:
    """What a commit of `snapshot` stores, in the user's words (for `_lapsed`)."""
    if via == "update":
        return f"the state edit (snapshot {snapshot.id!r})"
    if via == "resume":
        return f"the answer (snapshot {snapshot.id!r})"
    if isinstance(snapshot, NodeSnapshot):
        return f"the next node, {snapshot.node.get_node_id()} (snapshot {snapshot.id!r})"
    return f"the run's End (snapshot {snapshot.id!r})"


class RemitStatePersistence(BaseStatePersistence[StateT, RunEndT]):
    """State persistence for pydantic-graph 1.x runs, keeping the Resume Contract.

    `url` is a store URL (`sqlite:///remit.db`, `postgresql://...`,
    `redis://...`) or a `Remit`. `fork_token` allows this instance to fork
    (start a new node on a run that already has one, or run an old snapshot
    again); the same token from any process names the same branch, and a
    run started with a token is the line it names. `lease` (seconds, at
    least 0.1) is how long a dead resumer's claim blocks the run. `workflow_version`
    is recorded on every snapshot; a run written by another version is refused
    unless `accept_versions` lists it (this one is always accepted).
    Bad options raise `TypeError` / `ValueError` before the store is opened.
    The store opens as the instance is made, or, made while an event loop runs in
    this thread, at its first call, in that call's worker thread (a store that
    cannot be reached then raises `StoreUnavailable` from that call).
    """

    def __init__(
        self,
        url: str | Remit,
        run_id: str,
        *,
        fork_token: str | None = None,
        lease: float = DEFAULT_LEASE,
        workflow_version: str = "",
        accept_versions: Iterable[str] | None = None,
    ) -> None:
        if not isinstance(url, (str, Remit)):
            raise TypeError(f"url must be a store URL or a Remit, got {url!r}")
        checked_id("run_id", run_id)
        if fork_token is not None:
            checked_id("fork_token", fork_token)
        self.lease = checked_lease(lease)
        self.accept_versions = _check_versions(workflow_version, accept_versions)
        self._opener = _Opener(url if isinstance(url, Remit) else _pinned(url), self.lease)
        self.run_id = run_id
        self.fork_token = fork_token
        self.workflow_version = workflow_version
        self._branch = MAIN_BRANCH
        self._line: BranchRecord | None = None
        self._line_unread = fork_token is not None
        self._line_lock = threading.Lock()
        self._codec: SnapshotCodec[StateT, RunEndT] | None = None
        self._edges: dict[str, tuple[frozenset[str], bool]] = {}
        self._node_types: dict[str, type] = {}
        self._may_end: frozenset[str] = frozenset()
        self._instance = uuid.uuid4().hex[:8]
        self._resumer = _Resumer()
        self._busy = False
        self._busy_lock = threading.Lock()
        if not _on_loop():
            self._open()  # no loop waits on this thread: opened (or refused) here, as ever

    # -- the store, opened at first use --------------------------------------------
    def _open(self) -> Remit:
        """The instance's `Remit`, opened if it is not yet, and the line its fork token
        names read once it is (the constructor's work, put off to the first call when
        the instance was made on a running event loop: `_Opener`)."""
        remit = self._opener.remit()
        if self._line_unread:
            with self._line_lock:
                if self._line_unread and self.fork_token is not None:
                    line = remit.fork_branch(self.run_id, self.fork_token)
                    if line is not None:
                        self._line, self._branch = line, line.branch
                self._line_unread = False
        return remit

    @property
    def remit(self) -> Remit:
        """The `Remit` over the instance's store (opened here if no call has opened it)."""
        return self._open()

    @property
    def branch(self) -> str:
        """The branch of the run this instance works on (`main`, or its fork token's)."""
        self._open()
        return self._branch

    @branch.setter
    def branch(self, branch: str) -> None:
        self._branch = branch

    async def _off_loop(self, call: Callable[..., _T], *args: Any) -> _T:
        """`call(*args)` in a worker thread (`_in_thread`), the store opened there first."""
        return await _in_thread(self._opened, call, *args)

    def _opened(self, call: Callable[..., _T], *args: Any) -> _T:
        self._open()
        return call(*args)

    # -- types (the graph's own adapters) ---------------------------------------
    def set_graph_types(self, graph: Graph[StateT, Any, RunEndT]) -> None:
        """Remember which node may follow which (for `resume`), then build the adapters.
        A graph other than the one the instance's types were built for is refused."""
        if not isinstance(graph, Graph):
            kind = type(graph)
            name = f"{kind.__module__}.{kind.__qualname__}"
            if kind.__module__.startswith("pydantic_graph.") and kind.__name__ == "Graph":
                # The builder API (`GraphBuilder(...).build()`) has no persistence
                # interface: its runs would store nothing. Its repr is a whole diagram.
                raise TypeError(
                    f"set_graph_types() got {name}, a graph of pydantic-graph's builder "
                    "API (GraphBuilder), which has no persistence interface: its runs "
                    "cannot be stored or resumed. Build the graph from BaseNode classes "
                    "as a pydantic_graph.graph.Graph to persist its runs"
                )
            raise TypeError(
                "set_graph_types() takes the BaseNode graph (pydantic_graph.graph.Graph) "
                f"this run belongs to, got {name}"
            )
        self._check_same_graph(graph)
        self._edges = {
            node_id: (frozenset(d.next_node_edges), d.returns_base_node)
            for node_id, d in graph.node_defs.items()
        }
        self._may_end = frozenset(n for n, d in graph.node_defs.items() if d.end_edge is not None)
        self._node_types = {node_id: d.node for node_id, d in graph.node_defs.items()}
        super().set_graph_types(graph)

    def _check_same_graph(self, graph: Graph[StateT, Any, RunEndT]) -> None:
        """`ValueError` for a graph other than the one the instance's types were built for:
        other node names, other node classes of the same names (a graph built again by a
        factory, a module reloaded), or another state or run-end type. Its types are built
        once: they would read the stored run into the first graph's nodes, and this graph
        would run their code."""
        codec = self._codec
        if codec is None or not codec.node_ids:
            return
        differs = _graph_difference(codec, graph)
        if differs is not None:
            raise ValueError(
                f"set_graph_types() got graph {graph.name!r} "
                f"({', '.join(sorted(graph.node_defs))}), but this instance is set up for a "
                f"graph of {', '.join(sorted(codec.node_ids))}, and {differs}: one instance "
                "persists one run of one graph (create another instance for this graph)"
            )

    def should_set_types(self) -> bool:
        return self._codec is None

    def set_types(self, state_type: type[StateT], run_end_type: type[RunEndT]) -> None:
        """Build the snapshot codec (called inside the graph's node-type context).

        Called by hand, outside it, the node types are unknown: pydantic-graph's own
        words would then say to call `set_types()`, the very call that failed."""
        if nodes_type_context.get(None) is None:
            raise RuntimeError(
                "set_types() builds the snapshot types from the graph's nodes, which only "
                "set_graph_types(graph) knows: call persistence.set_graph_types(graph) "
                "instead (Graph.run, iter, initialize and iter_from_persistence do it)"
            )
        self._codec = SnapshotCodec(state_type, run_end_type, self._edges, self._node_types)

    def _types(self) -> SnapshotCodec[StateT, RunEndT]:
        if self._codec is None:
            raise RemitError(
                "snapshot types are not set: call persistence.set_graph_types(graph) first "
                "(Graph.run, iter and iter_from_persistence do it)",
                run_id=self.run_id,
            )
        return self._codec

    def _check_id(self, snapshot_id: object) -> None:
        """`CheckpointInvalid` at `id` for a snapshot id no engine stores (a node given
        one with `set_snapshot_id`): refused as the snapshot's other misfits are."""
        try:
            checked_id("snapshot id", snapshot_id)
        except (TypeError, ValueError) as exc:
            raise CheckpointInvalid(
                f"snapshot refused at id: {exc}; nothing was written",
                field="id",
                run_id=self.run_id,
            ) from exc

    def _encode(self, snapshot: Snapshot[StateT, RunEndT], edit_of: str | None = None) -> bytes:
        """The snapshot's bytes, if they read back as this snapshot (P4). `edit_of`: the
        pause an `update_state` edit is for, which a refusal names (the snapshot the edit
        would have stored has an id of its own, that the caller never saw)."""
        self._check_id(snapshot.id)
        if isinstance(snapshot, NodeSnapshot):  # status lives in the log, not in the bytes
            snapshot = dataclasses.replace(snapshot, status="created", start_ts=None, duration=None)
        try:
            return self._types().encode(snapshot)
        except Unfit as exc:
            what = "snapshot" if edit_of is None else f"the state edit of pause {edit_of!r}"
            raise CheckpointInvalid(
                f"{what} refused at {exc.field}: {exc.problem}{self._untyped(exc.field)}; "
                "nothing was written",
                field=exc.field,
                run_id=self.run_id,
                checkpoint_id=snapshot.id if edit_of is None else edit_of,
            ) from exc

    def _untyped(self, field: str) -> str:
        """Why the graph's state or run-end type is None, for a value refused as not None
        there: pydantic-graph takes them from the nodes' `BaseNode[State, Deps, RunEnd]`
        and makes them None where no node declares them (its in-memory runs never check)."""
        codec = self._types()
        if field == "state" and codec.state_type is None:
            which, name, where = "state", "state_type", "first"
        elif field == "result.data" and codec.run_end_type is None:
            which, name, where = "run-end", "run_end_type", "third"
        else:
            return ""
        return (
            f". The graph's {which} type is None: pydantic-graph takes it from the {where} "
            f"parameter of its nodes' BaseNode[State, Deps, RunEnd], and none of them declares "
            f"it. Declare it there, or pass Graph(..., {name}=...)"
        )

    # -- reads -------------------------------------------------------------------
    def _status_log(self, checkpoint_id: str) -> dict[str, list[WriteRecord]]:
        logs: dict[str, list[WriteRecord]] = {}
        for w in self.remit.writes(self.run_id, checkpoint_id):
            if w.task_id.startswith("status:"):
                logs.setdefault(w.task_id[len("status:") :], []).append(w)
        return logs

    def _read(
        self, checkpoint_id: str, base_id: str | None = None, line: str | None = None
    ) -> _Stored:
        """One snapshot, verified, version-checked and decoded, with its status on branch
        `line` (default: this instance's), whose fork's base is `base_id`."""
        line = self.branch if line is None else line
        record = self.remit.checkpoint(self.run_id, checkpoint_id)
        if record is None:
            raise UnknownRecord(
                f"no snapshot {checkpoint_id!r} in this run",
                run_id=self.run_id,
                checkpoint_id=checkpoint_id,
            )
        policy.check_workflow_version(record, self.accept_versions)
        self._check_graph(record)
        snapshot = self._decode(
            record.state,
            "stored snapshot",
            written_by=record.workflow_version,
            checkpoint_id=checkpoint_id,
        )
        idx = -1
        # The node (or the End: `EndSnapshot.node`) carries its snapshot's id, as the one
        # stored did; an End read back would otherwise make up a new one at each read.
        snapshot.node.set_snapshot_id(snapshot.id)
        if isinstance(snapshot, NodeSnapshot):
            logs = self._status_log(checkpoint_id)
            # A branch's own log decides; a fork's base starts fresh on the fork.
            own = record.branch == line or checkpoint_id == base_id
            log = logs.get(line) or ([] if own else logs.get(record.branch, []))
            if log:
                last = max(log, key=lambda w: w.idx)
                entry = codec.loads(last.value)
                snapshot.status = entry["status"]
                snapshot.start_ts = entry["start_ts"]
                snapshot.duration = entry["duration"]
                idx = last.idx
        return _Stored(record, snapshot, idx)

    def _decode(
        self, body: bytes, what: str, *, written_by: str, **ids: str
    ) -> Snapshot[StateT, RunEndT]:
        """Stored snapshot bytes read with this graph's types: `VersionMismatch` naming
        `what` and where it does not fit, if another graph or version wrote them;
        `CorruptRecord` if they are no snapshot at all (not JSON, a node with no name).
        Written under this instance's own workflow version (`written_by`), they must also
        read back whole: a stored field these types have not would be dropped."""
        try:
            snapshot = self._types().decode(body)
            if written_by == self.workflow_version:
                self._check_kept(body, snapshot, what, ids)
            return snapshot
        except NotASnapshot as exc:
            raise CorruptRecord(
                f"{what} is not a pydantic-graph snapshot: {exc.problem}. Another "
                "framework's run under this run id, or another program, wrote it: give this "
                "graph's run an id of its own",
                run_id=self.run_id,
                **ids,
            ) from exc
        except ForeignNode as exc:
            raise VersionMismatch(
                f"{what} is of node {exc.node_id!r}, which is not a node of this graph "
                f"({', '.join(sorted(exc.node_ids))}); it was written by another graph, "
                "or another version of this one",
                run_id=self.run_id,
                **ids,
            ) from exc
        except Unreadable as exc:
            raise VersionMismatch(
                f"{what} does not fit this graph's types: a validator of them raised "
                f"{exc.problem} as it was read; it was written by another version of the graph",
                run_id=self.run_id,
                **ids,
            ) from exc
        except pydantic.ValidationError as exc:
            error = exc.errors()[0]
            raise VersionMismatch(
                f"{what} does not fit this graph's types at "
                f"{self._types().where(error.get('loc', ()))} ({error.get('msg')}); it was "
                "written by another version of the graph",
                run_id=self.run_id,
                **ids,
            ) from exc

    def _check_kept(
        self, body: bytes, snapshot: Snapshot[StateT, RunEndT], what: str, ids: dict[str, str]
    ) -> None:
        """`VersionMismatch` naming a stored field this graph's types do not read (removed
        or renamed since, under the same workflow version): pydantic ignores it, and the
        run would go on without its value (an answer's `approver` read as its default).
        A reader that lists the writer's version in `accept_versions` vouches for the loss."""
        lost = self._types().dropped(body, snapshot)
        if lost is None:
            return
        raise VersionMismatch(
            f"{what} holds {lost}, which this graph's types do not read: a field removed or "
            f"renamed since it was written under the same workflow version "
            f"{self.workflow_version!r}, whose value reading it would drop. Nothing was "
            "written. To go on with such runs without that value, give this graph its own "
            "workflow_version and list the old one in accept_versions; else restore the field",
            run_id=self.run_id,
            **ids,
        )

    def _check_graph(self, record: CheckpointRecord) -> None:
        """`VersionMismatch` for a snapshot another graph wrote under this workflow version.

        A snapshot records the nodes of the graph that wrote it (`_commit`). Its own
        node may be one this graph also has (a `Start` of two graphs): read by node
        alone, this graph would run its own nodes on the other's run and leave a line
        neither reads. Two graphs each with nodes the other lacks are two graphs; one
        that only gained (or only dropped) nodes is read as a version of the other, as
        both run side by side while a new version is rolled out. A snapshot of a version
        the reader accepts as another (`accept_versions`) is the user's to vouch for, and
        one written before nodes were recorded is read."""
        wrote = record.metadata.get("nodes")
        ours = self._types().node_ids
        if record.workflow_version != self.workflow_version or not ours:
            return
        if not isinstance(wrote, list) or not all(isinstance(n, str) for n in wrote):
            return
        missing, extra = sorted(set(wrote) - ours), sorted(ours - set(wrote))
        if missing and extra:
            raise VersionMismatch(
                f"stored snapshot was written by another graph, of nodes "
                f"{', '.join(sorted(wrote))}, under the same workflow version "
                f"{self.workflow_version!r}: this graph has no {', '.join(missing)} and has "
                f"{', '.join(extra)}, which that graph has not. It is that graph's run (if "
                "this graph is a new version of it, give it its own workflow_version and "
                "list the old one in accept_versions)",
                run_id=self.run_id,
                checkpoint_id=record.checkpoint_id,
            )

    def _stored(self, checkpoint_id: str) -> bool:
        return self.remit.checkpoint(self.run_id, checkpoint_id) is not None

    def _read_head(self) -> _Head | None:
        branch = self.remit.branch(self.run_id, branch=self.branch)
        if branch is None or branch.head_id is None:
            return None
        return _Head(branch, self._read(branch.head_id, branch.base_id))

    # -- resumers and their claims -------------------------------------------------
    def _holder(self) -> str:
        """This instance's claim holder (its process's identity: fresh in a forked child)."""
        return f"{self.remit.holder}/{self._instance}"

    @contextmanager
    def _turn(self) -> Iterator[_Resumer]:
        """The instance's resumer, for one call at a time (from any task or thread)."""
        with self._busy_lock:
            if self._busy:
                raise ResumeConflict(
                    "this instance is in another call on its run (loading, running a node or "
                    "answering): an instance makes one call at a time",
                    run_id=self.run_id,
                )
            self._busy = True
        try:
            yield self._resumer
        finally:
            self._busy = False

    def _acquire(self, resumer: _Resumer, *, heartbeat: bool) -> ClaimHandle:
        """Take (or keep) the resumer's leased claim on its branch: `ResumeConflict` if held."""
        if resumer.claim is not None:
            resumer.claim.abandon()
        resumer.cut = None  # a new step: a node cut short is another resumer's to finish now
        resumer.claim = self.remit.claim(
            self.run_id, self.branch, lease=self.lease, heartbeat=heartbeat, holder=self._holder()
        )
        return resumer.claim

    def _drop(self, resumer: _Resumer) -> None:
        """Give the resumer's claim back and forget it: it holds nothing now."""
        claim = resumer.claim
        resumer.claim = resumer.loaded = resumer.ran = resumer.started = resumer.cut = None
        if claim is not None:
            claim.release()

    def _fence(self, resumer: _Resumer) -> FenceRef:
        assert resumer.claim is not None, "a write needs the run's claim"
        return resumer.claim.fence

    def _switch(self, resumer: _Resumer, branch: str, *, heartbeat: bool) -> None:
        if resumer.claim is not None:
            resumer.claim.release()
            resumer.claim = None
        self.branch = branch
        self._acquire(resumer, heartbeat=heartbeat)

    # -- writes --------------------------------------------------------------
    def _status_write(
        self, stored: _Stored, status: SnapshotStatus, duration: float | None
    ) -> tuple[WriteRecord, dict[str, Any]]:
        """The next entry of a node's status log on this branch, and the entry itself."""
        snapshot = stored.snapshot
        assert isinstance(snapshot, NodeSnapshot)
        start = datetime.now(timezone.utc) if status == "running" else snapshot.start_ts
        entry = {
            "status": status,
            "start_ts": None if status == "created" else start,
            "duration": duration,
        }
        write = WriteRecord(
            self.run_id,
            stored.id,
            f"status:{self.branch}",
            stored.status_idx + 1,
            status,
            codec.dumps(entry),
        )
        return write, entry

    def _set_status(
        self,
        resumer: _Resumer,
        stored: _Stored,
        status: SnapshotStatus,
        *,
        duration: float | None = None,
    ) -> None:
        write, entry = self._status_write(stored, status, duration)
        with self._lapsed(f"the {status!r} status of snapshot {stored.id!r}", stored.id):
            self.remit.put_writes([write], mode="expect_absent", fence=self._fence(resumer))
        snapshot = stored.snapshot
        assert isinstance(snapshot, NodeSnapshot)
        stored.status_idx = write.idx
        resumer.wrote = (stored.id, write.idx)
        snapshot.status, snapshot.start_ts, snapshot.duration = status, entry["start_ts"], duration

    @contextmanager
    def _lapsed(self, what: str, checkpoint_id: str | None) -> Iterator[None]:
        """`Fenced` that says what happened to a write under a claim that lapsed: the
        process was paused or slowed past its lease, and another resumer took the run
        over (L2). The store's own message speaks of fences and holders only."""
        try:
            yield
        except Fenced as exc:
            raise Fenced(
                f"this instance's claim on the run lapsed (its lease of {self.lease:g} s ran "
                "out while the process was paused or slowed) and another resumer took the run "
                f"over: {what} was not stored. The run goes on there; to go on from here, "
                "read it again (load_all(), paused()) or continue it with "
                "iter_from_persistence()",
                run_id=self.run_id,
                checkpoint_id=checkpoint_id,
                scope=self.branch,
            ) from exc

    def _commit(
        self,
        resumer: _Resumer,
        snapshot: Snapshot[StateT, RunEndT],
        body: bytes,
        parent: _Head | None,
        *,
        release: bool = False,
        **metadata: str | list[str],
    ) -> None:
        """Append `snapshot` after `parent` on this branch: a fenced compare-and-set.
        `release`: give the claim up in the same transaction."""
        claim = resumer.claim
        assert claim is not None, "a write needs the run's claim"
        plan = policy.CommitPlan(
            self.branch,
            None if parent is None else parent.top.id,
            1 if parent is None else parent.branch.head_seq + 1,
        )
        via = metadata.get("via")
        with self._lapsed(
            _what_commit(snapshot, via if isinstance(via, str) else None), plan.expected_head
        ):
            self.remit.commit(
                run_id=self.run_id,
                checkpoint_id=snapshot.id,
                parent_id=plan.expected_head,
                state=body,
                metadata={
                    "kind": snapshot.kind,
                    "nodes": sorted(self._types().node_ids),
                    **metadata,
                },
                workflow_version=self.workflow_version,
                fence=claim.fence,
                plan=plan,
                release=claim if release else None,
            )
        resumer.own_head = snapshot.id
        resumer.own_node = snapshot.node if isinstance(snapshot, NodeSnapshot) else None

    def _refuse_fork(self, base_id: str, why: str) -> ForkWithoutIntent:
        return ForkWithoutIntent(
            f"{why}: that is a fork; pass fork_token= to RemitStatePersistence to make one "
            "named branch, resume(node) to answer a paused run, or iter_from_persistence() "
            "to continue it",
            run_id=self.run_id,
            checkpoint_id=base_id,
        )

    def _fork(self, resumer: _Resumer, base_id: str, *, heartbeat: bool, why: str) -> _Head:
        """Move to the branch `fork_token` names from `base_id` (P3); its head must be the base."""
        if self.fork_token is None:
            raise self._refuse_fork(base_id, why)
        made = self._fork_branch(base_id, self.fork_token)
        self._line = made
        self._switch(resumer, made.branch, heartbeat=heartbeat)
        head = self._read_head()
        if head is None or head.top.id != base_id:
            raise self._fork_moved(made.branch, base_id, None if head is None else head.top.id)
        return head

    def _check_fork_unmoved(self, base_id: str) -> None:
        """`HeadMoved` if the fork token's branch from `base_id` has moved on already:
        refused from a read, with no claim taken, so that the process driving the fork
        (which holds no claim between its nodes) is not stopped by a late forker."""
        line = (
            None
            if self.fork_token is None
            else self.remit.fork_branch(self.run_id, self.fork_token)
        )
        if line is not None and line.base_id == base_id and line.head_id != base_id:
            raise self._fork_moved(line.branch, base_id, line.head_id)

    def _fork_moved(self, branch: str, base_id: str, now: str | None) -> HeadMoved:
        return HeadMoved(
            f"fork token {self.fork_token!r} already made branch {branch!r} from "
            f"{base_id!r}, now at {now!r}: continue that branch instead of forking again",
            run_id=self.run_id,
            checkpoint_id=base_id,
        )

    def _fork_branch(self, base_id: str, fork_token: str) -> BranchRecord:
        """The branch `fork_token` makes from `base_id`, or already made from it (P3)."""
        line = self.remit.fork_branch(self.run_id, fork_token)
        if line is not None and line.base_id != base_id:
            made = (
                "the line it started this run on"
                if line.base_id is None
                else f"made from snapshot {line.base_id!r}"
            )
            raise ForkWithoutIntent(
                f"fork token {fork_token!r} already names branch {line.branch!r}, {made}, so "
                f"it cannot also fork from {base_id!r}: use a new token",
                run_id=self.run_id,
                checkpoint_id=base_id,
            )
        return self.remit.fork(self.run_id, base_id, fork_token)

    def _start_reason(self, head: _Head) -> str:
        return (
            f"the run already has a head on branch {self.branch!r} ({head.top.describe()}) "
            "and starting a new node there"
        )

    def _token_line(self) -> BranchRecord | None:
        """The line `fork_token` names, made by any process (None: it names none yet).
        This instance is on that line from now on."""
        if self.fork_token is None:
            return None
        line = self.remit.fork_branch(self.run_id, self.fork_token)
        if line is not None:
            self._line, self.branch = line, line.branch
        return line

    def _follow_token(self, resumer: _Resumer | None) -> None:
        """Move onto the line `fork_token` names if another instance or process made it
        since this one last looked (P3: a token names one line, whoever made it), as a
        call begins. `resumer` None: a read, which moves only while no call is in progress."""
        if self.fork_token is None or self._line is not None:
            return
        line = self.remit.fork_branch(self.run_id, self.fork_token)
        if line is None or line.branch == self.branch:
            return
        with self._busy_lock:
            if resumer is None and self._busy:
                return
            self._line, self.branch = line, line.branch
        if resumer is not None:
            self._drop(resumer)  # a claim on the line it left

    def _start_base(self, resumer: _Resumer, line: BranchRecord | None) -> _Head | None:
        """The head a new node starts after (None: the line is empty), or the refusal (P3).

        Without a token only an empty line takes a new node. With one, a new node
        forks the run from its head node, or starts the fork its token made while
        that fork is still at its base. A line the token names that has moved on
        is continued with `iter_from_persistence`, never started again; and no
        node follows an `End`, so a line never has two."""
        head = self._read_head()
        if head is None:
            return None
        ids = {"run_id": self.run_id, "checkpoint_id": head.top.id}
        if self.fork_token is None:
            self._refuse_stale(resumer, head)
        if not head.top.is_node:
            # Neither a token nor iter_from_persistence() goes on after an End: say what does.
            whose = (
                f"the run has ended on branch {self.branch!r}"
                if line is None
                else f"fork token {self.fork_token!r} names branch {self.branch!r}, which has ended"
            )
            raise ForkWithoutIntent(
                f"{whose} ({head.top.id}): a node started after its End would run that line "
                "again and give it a second End. Read its result with load_all() (its last "
                "snapshot is the End); to go on from its final state (a graph that lives "
                "across runs), start the next run under a run_id of its own with that "
                "snapshot's state; to run one of its nodes again, fork that node's "
                "snapshot with a new token (await persistence.fork(snapshot_id, token)) and "
                "continue the fork with iter_from_persistence()",
                **ids,
            )
        if self.fork_token is None:
            raise self._refuse_fork(head.top.id, self._start_reason(head))
        if line is not None and head.top.id != line.base_id:
            raise ForkWithoutIntent(
                f"fork token {self.fork_token!r} names branch {self.branch!r}, which has run "
                f"past where it began (it is at {head.top.describe()}): starting a node on it "
                "again would run that line twice. Continue it with iter_from_persistence()",
                **ids,
            )
        return head

    def _refuse_stale(self, resumer: _Resumer, head: _Head) -> None:
        """`ResumeConflict` for a driver whose node another resumer moved the run on from
        (its lease ran out, its writes were fenced) and that now goes on with that node's
        result (a retried `run.next()`): it lost the run, as a racing resumer does; it is
        not forking it."""
        mine = resumer.own_head
        if mine is None or mine == head.top.id:
            return
        record: CheckpointRecord | None = head.top.record
        while record is not None and record.checkpoint_id != mine:
            parent = record.parent_id
            record = None if parent is None else self.remit.checkpoint(self.run_id, parent)
        if record is None:
            return  # not a node of this line: a fork, refused as such
        raise ResumeConflict(
            f"snapshot {mine!r} was this instance's node, but another resumer moved the run "
            f"on from it while this instance held no claim; branch {self.branch!r} is at "
            f"{head.top.describe()} now. Nothing was written",
            run_id=self.run_id,
            checkpoint_id=mine,
        )

    def _name_line(self) -> None:
        """Record that `fork_token` starts the run's line: presented again, from any
        process, the token names this line, not a new one (P3)."""
        assert self.fork_token is not None
        self.remit.store.create_branch(
            BranchRecord(
                run_id=self.run_id,
                branch=MAIN_BRANCH,
                head_id=None,
                fork_token=self.fork_token,
                created_at=self.remit.clock(),
            )
        )

    def _start(
        self, resumer: _Resumer, snapshot: Snapshot[StateT, RunEndT], *, keep_claim: bool
    ) -> None:
        """A snapshot that does not follow a node this resumer ran: a run's first, or a
        fork's (P3). A token that names no line yet names the one this starts."""
        body = self._encode(snapshot)
        try:
            # Refuse from a read first: a refused writer never holds the claim.
            line = self._token_line()
            head = self._start_base(resumer, line)
            if head is None or line is not None:
                self._acquire(resumer, heartbeat=False)
                branch = self.branch
                line = self._token_line()  # another process may have used the token meanwhile
                if self.branch != branch:
                    self._switch(resumer, self.branch, heartbeat=False)
                head = self._start_base(resumer, line)
                if head is None and line is None and self.fork_token is not None:
                    self._name_line()
            if head is not None and line is None:
                # A fork from the head, claimed on its own branch only, never on the line
                # it leaves, which that line's driver may be running meanwhile (L3).
                head = self._fork(
                    resumer, head.top.id, heartbeat=False, why=self._start_reason(head)
                )
            self._commit(resumer, snapshot, body, head, release=not keep_claim)
        except BaseException:
            self._drop(resumer)
            raise
        if not keep_claim:
            self._drop(resumer)

    def _advance(self, resumer: _Resumer, snapshot: Snapshot[StateT, RunEndT]) -> None:
        """The snapshot after the node this resumer ran: that node's completion (P1)."""
        if resumer.ran is None:
            self._start(resumer, snapshot, keep_claim=False)
            return
        ran, duration = resumer.ran
        try:
            try:
                self._check_id(snapshot.id)
                # pydantic-graph names a new node (or End) with a random id, and a node's
                # effects are keyed by its id. Named after the node it follows instead, it
                # gets the same id and effect keys in every recovery of one store (P6). An
                # id the user gave it (`set_snapshot_id`) is kept.
                follower = snapshot.node if isinstance(snapshot, NodeSnapshot) else snapshot.result
                kind = follower.get_node_id() if isinstance(follower, BaseNode) else "end"
                if _generated(kind, snapshot.id):
                    follower.set_snapshot_id(self._successor_id(ran, kind))
                    snapshot.id = follower.get_snapshot_id()
                if self._stored(snapshot.id):
                    # An id stored already (one the user gave it, given again: a node that
                    # returns itself) is a new snapshot, as with pydantic-graph's default
                    # persistence. It gets a new id, named after the node it follows, as a
                    # generated one is (P6).
                    node = snapshot.node
                    kind = node.get_node_id() if isinstance(node, BaseNode) else "end"
                    named = self._successor_id(ran, kind)
                    node.set_snapshot_id(
                        named if not self._stored(named) else generate_snapshot_id(kind)
                    )
                    snapshot.id = node.get_snapshot_id()
                body = self._encode(snapshot)
            except CheckpointInvalid:
                self._set_status(resumer, ran.top, "error", duration=duration)
                raise
            self._commit(resumer, snapshot, body, ran, release=True)
        finally:
            self._drop(resumer)

    def _successor_id(self, ran: _Head, kind: str) -> str:
        """The snapshot id of the node (`kind`, its node id, or "end") that follows `ran`
        on this branch: the same whichever process runs `ran` (a line has one snapshot
        after each node), in pydantic-graph's form (`{node_id}:{hex}`)."""
        name = "\x1f".join(("remit", self.run_id, self.branch, ran.top.id))
        return f"{kind}:{uuid.uuid5(uuid.NAMESPACE_URL, name).hex}"

    # -- the interface pydantic-graph calls ----------------------------------------
    async def snapshot_node(self, state: StateT, next_node: BaseNode[StateT, Any, RunEndT]) -> None:
        node = _checked_node("snapshot_node", next_node)
        snapshot = NodeSnapshot(state=_as_called(state), node=node)
        with self._turn() as resumer:
            await self._off_loop(self._advance, resumer, snapshot)

    async def snapshot_node_if_new(
        self, snapshot_id: str, state: StateT, next_node: BaseNode[StateT, Any, RunEndT]
    ) -> None:
        checked_id("snapshot_id", snapshot_id)
        node = _checked_node("snapshot_node_if_new", next_node)
        if snapshot_id != node.get_snapshot_id():
            raise ValueError(
                f"snapshot_node_if_new() got snapshot_id {snapshot_id!r}, but next_node's "
                f"snapshot id is {node.get_snapshot_id()!r}: pass next_node.get_snapshot_id()"
            )
        snapshot = NodeSnapshot(state=_as_called(state), node=node)
        with self._turn() as resumer:
            try:
                await self._off_loop(self._snapshot_if_new, resumer, snapshot_id, snapshot)
            except BaseException:
                self._drop(resumer)  # cut short (cancelled): the node will not run now
                raise

    def _snapshot_if_new(
        self, resumer: _Resumer, snapshot_id: str, snapshot: NodeSnapshot[StateT, RunEndT]
    ) -> None:
        if self._stored(snapshot_id):
            return
        if resumer.cut is not None and self._may_follow(resumer.cut[0], snapshot):
            self._after_cut(resumer, resumer.cut, snapshot)
            return
        if resumer.own_head is not None and snapshot.node is resumer.own_node:
            # The very node object this instance stored last, under another id: another
            # run holding the same object (a start node shared by concurrent runs, that
            # returns itself) gave it a new id as it ran it again (`_advance`). It is
            # still this run's stored node, not a new start: it runs as that snapshot.
            resumer.alias = (snapshot_id, resumer.own_head)
            return
        self._refuse_rebuilt(resumer, snapshot)
        self._start(resumer, snapshot, keep_claim=True)

    def _refuse_rebuilt(self, resumer: _Resumer, snapshot: NodeSnapshot[StateT, RunEndT]) -> None:
        """`ForkWithoutIntent` that says what happened, for a driver that hands `run.next()`
        a new node of its next node's class (rebuilt with `dataclasses.replace` to edit a
        frozen node): a new object has a new snapshot id, so it would be a new start in
        place of the stored node, which would never run (P1). From a read; nothing is
        taken or written. Other new starts are refused as such by `_start`."""
        stored, node = resumer.own_node, snapshot.node
        if (
            self.fork_token is not None
            or resumer.own_head is None
            or not isinstance(stored, BaseNode)
            or type(node) is not type(stored)
        ):
            return
        head = self._read_head()  # (only for a node of the stored next node's class)
        if (
            head is None
            or head.top.id != resumer.own_head
            or head.top.status not in ("created", "pending")
        ):
            return
        name = node.get_node_id()
        raise ForkWithoutIntent(
            f"run.next() got a new {name} node (snapshot id {snapshot.id!r}) in place of this "
            f"run's next node, the {name} stored as snapshot {head.top.id!r}: a node built "
            "anew (dataclasses.replace included) has a new snapshot id, so running it would "
            f"start the run over from it and leave the stored {name} never run. To edit the "
            "next node, change it in place, or give the new one the stored id first "
            f"(node.set_snapshot_id({head.top.id!r})); to run another line, pass fork_token=. "
            "Nothing was written",
            run_id=self.run_id,
            checkpoint_id=head.top.id,
        )

    def _may_follow(self, ran: _Head, snapshot: NodeSnapshot[StateT, RunEndT]) -> bool:
        """Whether `snapshot`'s node is one the node of `ran` may return (a new start is not)."""
        node = ran.top.snapshot.node if isinstance(ran.top.snapshot, NodeSnapshot) else None
        edges = None if node is None else self._edges.get(node.get_node_id())
        return edges is not None and (edges[1] or snapshot.node.get_node_id() in edges[0])

    def _after_cut(
        self, resumer: _Resumer, cut: tuple[_Head, float], snapshot: NodeSnapshot[StateT, RunEndT]
    ) -> None:
        """Store the next node of the node this resumer ran, whose task was cancelled as
        that node's end was being stored (`asyncio.timeout` around `run.next()`): the
        driver's retried step (pydantic-graph's `next()` then stores the node in hand with
        `snapshot_node_if_new`) goes on where the node left the run, as with pydantic-graph's
        own persistences; it is neither a fork nor a new start. The node is named after the
        one it follows, as every recovery names it, and the claim is kept for its
        `record_run`. `ResumeConflict` if another resumer took the node over since."""
        ran, duration = cut
        try:
            self._acquire(resumer, heartbeat=False)
            head = self._read_head()
            if (
                head is None
                or head.top.id != ran.top.id
                or head.top.status_idx != ran.top.status_idx
            ):
                raise ResumeConflict(
                    f"snapshot {ran.top.id!r} was this instance's node, and its task was "
                    "cancelled as its end was being stored; another resumer has taken it over "
                    f"since (branch {self.branch!r} is at "
                    f"{'nothing' if head is None else head.top.describe()}). Nothing was written",
                    run_id=self.run_id,
                    checkpoint_id=ran.top.id,
                )
            given = snapshot.id
            kind = snapshot.node.get_node_id()
            named = self._successor_id(ran, kind)
            if _generated(kind, given) and not self._stored(named):
                # Named after the node it follows, as `_advance` names it: the same id (and
                # effect keys) as any other recovery of this store gives it (P6). The
                # driver's `record_run` still asks for the id it gave: it runs as this one.
                snapshot.node.set_snapshot_id(named)
                snapshot.id = named
            try:
                body = self._encode(snapshot)
            except CheckpointInvalid:
                self._set_status(resumer, head.top, "error", duration=duration)
                raise
            self._commit(resumer, snapshot, body, head)
            if snapshot.id != given:
                resumer.alias = (given, snapshot.id)
        except BaseException:
            self._drop(resumer)
            raise

    async def snapshot_end(self, state: StateT, end: End[RunEndT]) -> None:
        snapshot = EndSnapshot(state=_as_called(state), result=_checked_end(end))
        with self._turn() as resumer:
            await self._off_loop(self._advance, resumer, snapshot)

    @asynccontextmanager
    async def record_run(self, snapshot_id: str) -> AsyncIterator[None]:
        """Run the head node under the claim and `step_scope` (effects keyed by its id, or
        by the id of the node an operator's edit committed again: `_effects_id`).

        `running` is stored as the body starts, `success` or `error` with the
        duration as it ends, as pydantic-graph documents. The node is done once
        the next snapshot is committed: until then, one whose process died is
        handed out again (P1).
        """
        checked_id("snapshot_id", snapshot_id)
        with self._turn() as resumer:
            resumer.started = None
            try:
                head, effects_id = await self._off_loop(self._begin_run, resumer, snapshot_id)
            except BaseException:
                if resumer.started is not None:  # cancelled while the node was being marked running
                    self._end_run(resumer, resumer.started, "created", None)
                raise
            claim = resumer.claim
            assert claim is not None
            # A node run on a fork is the fork's own work, also the one at the fork's base
            # (main may be running it still, or the fork may run it with another state):
            # its effects are keyed under the fork's branch.
            step = effects_id if self.branch == MAIN_BRANCH else f"{self.branch}/{effects_id}"
            start = perf_counter()
            try:
                with step_scope(self.remit, self.run_id, step, fence=claim.fence):
                    yield
            except Exception:
                duration = perf_counter() - start
                await self._off_loop(self._end_run, resumer, head, "error", duration)
                raise
            except BaseException:
                # Cancelled: give the node back now, on this thread; it has no result.
                self._end_run(resumer, head, "created", None)
                raise
            duration = perf_counter() - start
            try:
                await self._off_loop(self._finish_run, resumer, head, duration)
            except BaseException:
                ran = resumer.ran
                self._drop(resumer)  # no next snapshot may follow: let another resumer rerun it
                resumer.cut = ran  # ... unless this driver retries its step first (`_after_cut`)
                raise

    def _run_reason(self, resumer: _Resumer, snapshot_id: str, head: _Head | None) -> str | None:
        """None if `snapshot_id` is the head; else why running it would be a fork, or
        `ResumeConflict` if it was this resumer's next node and another resumer moved the
        run on from it while this one held no claim (between nodes, or a lease run out)."""
        if head is not None and head.top.id == snapshot_id:
            return None
        self._read(snapshot_id)  # LookupError (UnknownRecord) if it does not exist
        if snapshot_id == resumer.own_head:
            raise ResumeConflict(
                f"snapshot {snapshot_id!r} was this instance's next node, but another resumer "
                "moved the run on from it (ran it, or answered the pause) while this instance "
                f"held no claim; branch {self.branch!r} is at "
                f"{'nothing' if head is None else head.top.describe()} now. Nothing was run",
                run_id=self.run_id,
                checkpoint_id=snapshot_id,
            )
        return (
            f"snapshot {snapshot_id!r} is not the head of branch {self.branch!r} (the head is "
            f"{'none' if head is None else head.top.id}) and running it again"
        )

    def _begin_run(self, resumer: _Resumer, snapshot_id: str) -> tuple[_Head, str]:
        """Mark the head node running under the claim: the head, and the id its effects
        are keyed by."""
        alias, resumer.alias = resumer.alias, None
        if alias is not None and alias[0] == snapshot_id:
            snapshot_id = alias[1]
        if resumer.ran is not None and resumer.ran[0].top.id == snapshot_id:
            # The node this instance has just run, whose next snapshot is still to come: a
            # second record_run is refused as pydantic-graph's own persistences refuse it,
            # and the instance keeps the node (and its claim) for that snapshot.
            raise self._not_runnable(resumer.ran[0].top, ran_here=True)
        try:
            head = self._read_head()
            why = self._run_reason(resumer, snapshot_id, head)
            if why is not None and self.fork_token is None:
                raise self._refuse_fork(snapshot_id, why)
            if why is None:
                # This resumer's own next node: it holds no claim between its nodes, and a
                # racer may hold it a moment only to find the run moved on (a late forker,
                # a resumer seeing the pause answered). One that took the run over moves
                # it on, and this one then gets `ResumeConflict` (`_run_reason`).
                own_next = snapshot_id == resumer.own_head
                patience = _OWN_NEXT_PATIENCE if own_next else 0.0
                self._acquire_within(resumer, patience, heartbeat=True)
                head = self._read_head()
                why = self._run_reason(resumer, snapshot_id, head)
            if why is not None or head is None:
                # A fork: made from a read and claimed on its own branch, never on the line
                # it leaves, so that whoever runs that line meanwhile does not block it (L3).
                self._check_fork_unmoved(snapshot_id)
                head = self._fork(resumer, snapshot_id, heartbeat=True, why=why or "")
            resumer.loaded = None
            if not head.top.is_node:
                raise EndNotRunnable(head.top.id)
            if head.top.status not in ("created", "pending"):
                if head.top.id == resumer.own_head and resumer.wrote != (
                    head.top.id,
                    head.top.status_idx,
                ):
                    raise self._taken_over(head.top)
                raise self._not_runnable(head.top, ran_here=False)
            before = head.top.status
            self._set_status(resumer, head.top, "running")
            self._refuse_answered(resumer, head, before)
            resumer.started = head
            effects_id = self._effects_id(head.top)
        except BaseException:
            self._drop(resumer)
            raise
        return head, effects_id

    def _not_runnable(self, stored: _Stored, *, ran_here: bool) -> GraphNodeStatusError:
        """pydantic-graph's refusal of a node that is not `created` or `pending`, saying which
        snapshot of which run it is and how the run goes on: its own words name neither.
        `ran_here`: this instance ran the node, and its next snapshot is still to come."""
        status = stored.status
        if ran_here:
            why = (
                "this instance has just run it, and the snapshot that follows it is still to "
                "be stored (snapshot_node() or snapshot_end(), as GraphRun.next() does); a "
                "node runs once"
            )
        else:
            why = {
                "running": "it was started by a resumer whose claim has lapsed since (its "
                "process died, or was paused past its lease), so it never ended",
                "success": "it ran, and the resumer that ran it stopped before it stored the "
                "snapshot that follows it",
                "error": "it raised when it last ran",
            }.get(status, f"it is {status}")
            why += (
                ". Continue the run with iter_from_persistence(): its load_next() hands this "
                "node out again, and it runs again (its recorded effects are not applied "
                "again). Running a stored node through Graph.iter() or Graph.run() is for a "
                "node nobody has started"
            )
        refusal = GraphNodeStatusError(status)
        refusal.args = (
            f"{refusal.args[0]} Snapshot {stored.id!r} of run {self.run_id!r} is {status!r}: "
            f"{why}. Nothing was run",
        )
        return refusal

    def _taken_over(self, stored: _Stored) -> ResumeConflict:
        """`ResumeConflict` for a driver whose next node another resumer took over while
        the driver held no claim (between its nodes) and left unfinished: started and
        never ended (its process died), ran with no snapshot after it, or raised. The
        run went on without this driver, as when that resumer runs the node to its end:
        the node is handed out again by `load_next()`, so a driver that retries on
        `ResumeConflict` continues it; `GraphNodeStatusError`, a `GraphRuntimeError`,
        would read as a run with nothing left to restore."""
        return ResumeConflict(
            f"snapshot {stored.id!r} was this instance's next node, but another resumer "
            "took it over while this instance held no claim, and left it "
            f"{stored.status!r} (its process died or its claim lapsed before the node's "
            "next snapshot was stored, or the node raised). Nothing was run. Continue the "
            "run with iter_from_persistence(): its load_next() hands this node out again",
            run_id=self.run_id,
            checkpoint_id=stored.id,
        )

    def _effects_id(self, stored: _Stored) -> str:
        """The snapshot id a node's effects are keyed by: its own, or, for a node that an
        operator's edit (`update_state`) committed again, the id of the node edited. A
        node that raised after an effect, then was edited, applies that effect once (P2):
        the edit changes the state, not which node runs."""
        return self._pause_ids(stored.record)[0]

    def _pause_ids(self, record: CheckpointRecord) -> list[str]:
        """The ids of the node `record` stores, oldest first: the node as first stored,
        then each `update_state` edit of it, up to `record`. An edit keeps the ids before
        it (`pause_ids`), so they are known once `Remit.prune` deleted those snapshots;
        an edit stored without them (by an earlier Remit) is followed to its parents."""
        ids = [record.checkpoint_id]
        while record.metadata.get("via") == "update":
            kept = record.metadata.get("pause_ids")
            if isinstance(kept, list) and kept and all(isinstance(i, str) for i in kept):
                return [*kept, *ids]
            edited = (
                None
                if record.parent_id is None
                else self.remit.checkpoint(self.run_id, record.parent_id)
            )
            if edited is None:
                break
            record = edited
            ids.insert(0, record.checkpoint_id)
        return ids

    def _finish_run(self, resumer: _Resumer, head: _Head, duration: float) -> None:
        """Store `success`; keep the claim (no heartbeat) for the next snapshot's commit."""
        self._set_status(resumer, head.top, "success", duration=duration)
        resumer.ran = (head, duration)
        assert resumer.claim is not None
        resumer.claim.abandon()  # the lease lapses if no snapshot follows

    def _end_run(
        self, resumer: _Resumer, head: _Head, status: SnapshotStatus, duration: float | None
    ) -> None:
        try:
            self._set_status(resumer, head.top, status, duration=duration)
        except RemitError:
            pass  # fenced out or store gone: the claim holder now decides this node
        finally:
            self._drop(resumer)

    async def load_next(self) -> NodeSnapshot[StateT, RunEndT] | None:
        """The head node if it is free to run, marked `pending`; None if there is none,
        or if this caller already loaded it and has not run it yet (as pydantic-graph's
        own backends answer a second call)."""
        with self._turn() as resumer:
            try:
                return await self._off_loop(self._load_next, resumer)
            except BaseException:
                self._drop(resumer)  # cut short (cancelled): the node stays free to load
                raise

    def _load_next(self, resumer: _Resumer) -> NodeSnapshot[StateT, RunEndT] | None:
        """Claim the head node: new, pending, left by a dead process (L1), or one that
        raised (no snapshot followed it, so it runs again, its recorded effects not)."""
        self._types()
        self._follow_token(resumer)
        first = self._read_head()
        if first is None or not first.top.is_node:
            # No run on this line (an unknown run id), or it has ended (no node follows an
            # End): nothing to claim or write. A claim taken here would only turn racing
            # readers of an ended run away with `ResumeConflict`.
            return None
        self._acquire(resumer, heartbeat=False)
        try:
            head = self._read_head()
            if head is not None:
                head = self._settle_resume(resumer, head)
            if head is None or not head.top.is_node:
                self._drop(resumer)
                return None
            if head.top.id == resumer.loaded and head.top.status == "pending":
                return None  # handed out by this instance's last load_next; still its to run
            if head.top.status != "pending":
                # A node loaded again and again (workers polling a pause, each giving it
                # back) is marked once: every read of a snapshot reads its status log.
                self._set_status(resumer, head.top, "pending")
            resumer.loaded = resumer.own_head = head.top.id
            resumer.own_node = head.top.snapshot.node
            resumer.ran = None  # handed out to run (again): what ran before is not its result
        except BaseException:
            self._drop(resumer)
            raise
        snapshot = head.top.snapshot
        assert isinstance(snapshot, NodeSnapshot)
        return snapshot

    async def load_all(self) -> list[Snapshot[StateT, RunEndT]]:
        return await self._off_loop(self._load_all)

    def _load_all(self) -> list[Snapshot[StateT, RunEndT]]:
        """This branch's line of snapshots, oldest first (a fork includes its shared prefix).

        Each snapshot has its status on the branch whose line it is on here: a fork's
        own snapshots and its base the fork's, the snapshots before the base those of
        the branch the base was made on (a fork of a fork reaches its first fork's
        base through that fork, which ran it)."""
        self._types()
        self._follow_token(None)
        branch = self.remit.branch(self.run_id, branch=self.branch)
        out: list[Snapshot[StateT, RunEndT]] = []
        if branch is None:
            return out
        cursor, line, base_id = branch.head_id, branch.branch, branch.base_id
        while cursor is not None:
            try:
                stored = self._read(cursor, base_id, line)
            except UnknownRecord as exc:
                if out and exc.checkpoint_id == cursor:
                    break  # deleted by `Remit.prune`: the line as kept, oldest first
                raise
            out.append(stored.snapshot)
            if cursor == base_id:
                line = stored.record.branch
                made_on = self.remit.branch(self.run_id, branch=line)
                base_id = None if made_on is None else made_on.base_id
            cursor = stored.record.parent_id
        out.reverse()
        return out

    # -- the side API: resume values, state edits, forks ------------------------------
    async def resume(
        self, node: BaseNode[StateT, Any, RunEndT], *, pause_id: str | None = None
    ) -> NodeSnapshot[StateT, RunEndT]:
        """Deliver the answer to a paused run as the node that follows the pause (P5).

        The run is paused when its head node has not started (the driver
        stopped before it, as in pydantic-graph's human-in-the-loop pattern),
        or raised (a pause run by mistake). `node` must be a node the paused
        one may lead to (`ValueError` otherwise, nothing stored); it is validated,
        then consumed once across all processes and committed as the new head,
        with the paused snapshot's state, and the run is given back: continue
        it with `graph.iter_from_persistence(...)` in this or any process. A
        second or late answer raises `ResumeConflict` and nothing is stored; an
        invalid one raises `CheckpointInvalid` and the run stays paused.

        An answer is for one pause: `pause_id` (the paused snapshot's id, from
        `paused()`) names it, and the answer is refused unless the run is paused
        there (also after `update_state` edits), so a retried answer is not taken
        by a later pause at the same node. Without it, the answer is for the pause
        the run is at when it arrives. The same node object is one answer: sent
        again, it is refused. A node the run stored itself (the paused node, filled
        in) is no answer: `ValueError`, and the run stays paused.
        """
        self._check_answer(node)
        if pause_id is not None:
            checked_id("pause_id", pause_id)
        with self._turn() as resumer:
            return await self._off_loop(self._resume, resumer, node, pause_id)

    def _check_answer(self, node: object) -> None:
        """`TypeError` / `ValueError` for an answer that cannot be a node of this graph."""
        if isinstance(node, End):
            raise TypeError(
                "resume() takes the node that follows the pause, not End: a run ends by "
                "running its nodes"
            )
        if not isinstance(node, BaseNode):
            raise TypeError(
                f"resume() takes the node that follows the pause (a BaseNode of the graph), "
                f"got {type(node).__name__} {node!r}"
            )
        problem = foreign_node(node, self._edges, self._node_types) if self._edges else None
        if problem is not None:
            raise ValueError(f"resume() got a node of another graph: {problem}")

    def _resume(
        self, resumer: _Resumer, node: BaseNode[StateT, Any, RunEndT], pause_id: str | None
    ) -> NodeSnapshot[StateT, RunEndT]:
        try:
            return self._answer(resumer, node, pause_id)
        finally:
            self._drop(resumer)

    def _answer(
        self, resumer: _Resumer, node: BaseNode[StateT, Any, RunEndT], pause_id: str | None
    ) -> NodeSnapshot[StateT, RunEndT]:
        self._types()
        self._follow_token(resumer)
        while True:
            paused = self._paused_head(pause_id, patient_until=self._held_patience())
            self._check_successor(paused.top, node, pause_id)
            self._check_id(node.get_snapshot_id())
            taken = self.remit.checkpoint(self.run_id, node.get_snapshot_id())
            if taken is not None and self._on_line(taken):
                if taken.metadata.get("via") != "resume":
                    # No answer was taken: the node is one the run stored itself (the pause,
                    # filled in and sent back). A `ResumeConflict` would say the pause is answered.
                    which = "the pause itself" if taken.checkpoint_id == paused.top.id else "a node"
                    raise ValueError(
                        f"resume() got the node of snapshot {taken.checkpoint_id} ({which}), "
                        "which this run stored already: an answer is a new node that follows the "
                        "pause. Build one (dataclasses.replace(node, ...) makes a copy with a new "
                        "snapshot id); nothing was stored, and the run is still paused"
                    )
                raise ResumeConflict(
                    f"this answer (snapshot {taken.checkpoint_id}) was taken already: the same "
                    "node sent again is not a new answer. The value was not stored",
                    run_id=self.run_id,
                    checkpoint_id=paused.top.id,
                )
            if taken is not None:
                # Another line's answer (main's, given again to a fork of its pause): each
                # branch has its own pauses (L3), so here it is a new answer, with a new id.
                node.set_snapshot_id(generate_snapshot_id(node.get_node_id()))
            snapshot = NodeSnapshot(state=paused.top.snapshot.state, node=node)
            body = self._encode(snapshot)
            pause_id = paused.top.id
            # The pause's node rides with it (`_answered_pause_leads_to` reads it there).
            asked = paused.top.snapshot.node
            assert isinstance(asked, BaseNode)  # (a paused head is a node: `_paused_head`)
            self.remit.open_interrupts(
                self.run_id,
                {pause_id: asked.get_node_id().encode()},
                branch=self.branch,
                checkpoint_id=pause_id,
            )
            # The one atomic step: of all resumers, exactly one gets past it. Losers never
            # take the run's claim, so they cannot get in the way of the winner's run.
            self.remit.consume(self.run_id, pause_id, body, branch=self.branch)
            if self._deliver(resumer, snapshot, body, pause_id):
                return snapshot
            head = self._read_head()
            if head is not None and head.top.id != pause_id and self._is_pause(head.top, pause_id):
                # An operator's edit (`update_state`) came between the read and the consume:
                # the same question with another state. The value taken with the old state
                # is not used; it is answered again, at the edit, once (P5).
                continue
            if head is not None and self._answered_since(head.top.record, pause_id):
                raise ResumeConflict(
                    "another resumer's answer to this pause (given after an edit of it) was "
                    "taken first; this value was recorded with the pause before the edit and "
                    "is not used",
                    run_id=self.run_id,
                    checkpoint_id=pause_id,
                )
            raise HeadMoved(
                "the run moved on from its pause (another process ran the paused node) while "
                "the value was delivered; the value was recorded with the pause and is not used",
                run_id=self.run_id,
                checkpoint_id=pause_id,
            )

    def _deliver(
        self,
        resumer: _Resumer,
        snapshot: NodeSnapshot[StateT, RunEndT],
        body: bytes,
        pause_id: str,
    ) -> bool:
        """Store a consumed answer as the head (P5): True once it is stored, or left to the
        claim's holder, which stores it before it runs on; False if the run is no longer
        at the pause. A resumer whose claim was taken over before its commit (it was paused
        past its lease) looks again: the one that took the run over stored the answer
        first (`_settle_resume`), so it was taken, and is acknowledged, not refused."""
        for attempt in range(_DELIVER_TRIES):
            acquired = self._acquire_patiently(resumer)
            if self._stored(snapshot.id):
                return True  # settled already, by the claim's holder
            head = self._read_head()
            if head is None or head.top.id != pause_id or head.top.status not in _ANSWERABLE:
                return False
            if not acquired:
                # The claim's holder has not started the paused node: before it runs it,
                # it finds the answer and commits it (`_load_next`, `_begin_run`).
                return True
            try:
                # Committed and given back at once: the answer is the head now, so the
                # run is no longer paused and a second answer is refused (P5).
                self._commit(
                    resumer, snapshot, body, head, release=True, via="resume", replaces=pause_id
                )
            except (Fenced, HeadMoved):
                if attempt == _DELIVER_TRIES - 1:
                    raise
                continue
            return True
        return False  # (not reached: the last try returns or raises)

    def _on_line(self, record: CheckpointRecord) -> bool:
        """Whether `record` is on this instance's line: its branch's own, or a snapshot of
        the shared history up to its fork's base."""
        if record.branch == self.branch:
            return True
        line = self.remit.branch(self.run_id, branch=self.branch)
        cursor = None if line is None else line.base_id
        while cursor is not None:
            if cursor == record.checkpoint_id:
                return True
            parent = self.remit.checkpoint(self.run_id, cursor)
            cursor = None if parent is None else parent.parent_id
        return False

    def _acquire_within(self, resumer: _Resumer, seconds: float, *, heartbeat: bool) -> None:
        """`_acquire`, retried while another holder has the claim, for up to `seconds`."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                self._acquire(resumer, heartbeat=heartbeat)
                return
            except ResumeConflict:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _acquire_patiently(self, resumer: _Resumer) -> bool:
        """Take the claim, waiting out at most one lease of its current holder."""
        try:
            self._acquire_within(resumer, self.lease + 1.0, heartbeat=False)
        except ResumeConflict:
            return False
        return True

    def _paused_head(
        self, pause_id: str | None = None, what: str = "the answer", *, patient_until: float = 0.0
    ) -> _Head:
        """The head if the run is paused (at `pause_id`, if given, for `what`): a node not
        started, not holding an answer, unclaimed. A refusal says that `what` (the answer,
        the edit) was not stored. Until `patient_until` (`time.monotonic()`), a claim
        another resumer holds is waited out, and the run read again."""
        lost = "the value was not stored" if what == "the answer" else f"{what} was not stored"
        head = self._read_head()
        if head is None:
            raise UnknownRecord(
                f"the run has no snapshots (no run has this id); {lost}", run_id=self.run_id
            )
        ids = {"run_id": self.run_id, "checkpoint_id": head.top.id}
        if pause_id is not None and not self._is_pause(head.top, pause_id):
            if not self._stored(pause_id):  # (a refusal's read only)
                raise UnknownPause(
                    f"{what} is for pause {pause_id}, which is no snapshot of this run (it is "
                    f"at {head.top.describe()}): pass the id paused() gave for this run's "
                    f"pause; {lost}",
                    **ids,
                )
            raise ResumeConflict(
                f"{what} is for pause {pause_id}, but the run is at {head.top.describe()}: "
                f"that pause was answered already, or is one of another line of this run; "
                f"{lost}",
                **ids,
            )
        if not head.top.is_node:
            raise ResumeConflict(f"the run has ended; {lost}", **ids)
        if head.top.status not in _ANSWERABLE:
            raise ResumeConflict(
                f"the run is not paused: its head node is {head.top.status} (being run, or "
                "left by a process that died: iter_from_persistence() runs it again once that "
                f"process's lease has run out); {lost}",
                **ids,
            )
        if head.top.record.metadata.get("via") == "resume":
            raise ResumeConflict(
                f"the run was already resumed (its head holds an earlier answer); {lost}", **ids
            )
        claim = self.remit.store.get_claim(self.run_id, self.branch)
        now = self.remit.clock()
        if claim is not None and policy.decide_claim(claim, self._holder(), now) == "conflict":
            if time.monotonic() < patient_until:
                # Held for a moment (another resumer's edit or answer being stored, a
                # worker loading the pause to give it back): read again once it is given
                # back. A refusal now would tell an answer's sender that the pause was
                # taken while nobody answered it.
                time.sleep(0.05)
                return self._paused_head(pause_id, what, patient_until=patient_until)
            raise ResumeConflict(
                "another resumer holds the run: it is running the paused node, or it loaded "
                "it (load_next(), as iter_from_persistence() does) and holds it until it runs "
                "it, calls persistence.release(), or its lease runs out (in "
                f"{max(claim.expires_at - now, 0.0):.1f} s); {lost}",
                **ids,
            )
        return head

    def _held_patience(self) -> float:
        """Until when (`time.monotonic()`) an answer or an edit waits out a claim held."""
        return time.monotonic() + min(_HELD_PATIENCE, self.lease / 2)

    def _is_pause(self, stored: _Stored, pause_id: str) -> bool:
        """Whether `stored` is pause `pause_id`, or that pause after `update_state` edits:
        the same question, asked with another state."""
        return pause_id in self._pause_ids(stored.record)

    def _answered_since(self, record: CheckpointRecord, pause_id: str) -> bool:
        """Whether the line from pause `pause_id` to `record` holds an answer (`resume`)."""
        cursor: CheckpointRecord | None = record
        answered = False
        while cursor is not None and cursor.checkpoint_id != pause_id:
            answered = answered or cursor.metadata.get("via") == "resume"
            parent = cursor.parent_id
            cursor = None if parent is None else self.remit.checkpoint(self.run_id, parent)
        return answered and cursor is not None

    def _check_successor(
        self, paused: _Stored, node: BaseNode[StateT, Any, RunEndT], pause_id: str | None
    ) -> None:
        """`ValueError` for an answer the pause does not lead to; `ResumeConflict` if it
        most likely came late, for a pause answered already. An answer that names the
        pause (`pause_id`, checked to be the run's) is not late: it is a wrong answer."""
        pause = paused.snapshot.node
        assert isinstance(pause, BaseNode)
        edges = self._edges.get(pause.get_node_id())
        if edges is None or edges[1] or node.get_node_id() in edges[0]:
            return
        leads = sorted(edges[0]) + (["End"] if pause.get_node_id() in self._may_end else [])
        where = (
            f"the run is paused at {pause.get_node_id()} (snapshot {paused.id}), which leads "
            f"only to {' or '.join(leads) or 'End'}: nothing was stored"
        )
        if pause_id is None and self._answered_pause_leads_to(node):
            # A pause of this run that may lead to this answer was answered: it most likely
            # came late, after another resumer's answer moved the run on to a node it does
            # not follow.
            raise ResumeConflict(
                f"resume() got {node.get_node_id()}, but {where}; a pause of this run that "
                "leads to it was answered already",
                run_id=self.run_id,
                checkpoint_id=paused.id,
            )
        raise ValueError(
            f"resume() got {node.get_node_id()}, but {where}, and the run is still paused"
        )

    def _answered_pause_leads_to(self, node: BaseNode[StateT, Any, RunEndT]) -> bool:
        """Whether a pause of this line answered already may lead to `node` (a loop that
        pauses again at the same node has answered pauses that do not).

        One read of the line's answered pauses, each naming its node (an interrupt's
        prompt), whatever rounds the run has had: a snapshot is read only for a pause
        stored without its node's name. No read at all if no node leads to `node`."""
        name = node.get_node_id()
        leading = {n for n, (edges, any_node) in self._edges.items() if any_node or name in edges}
        if not leading:
            return False
        for pause in self.remit.interrupts(self.run_id, branch=self.branch, status="consumed"):
            if pause.prompt is not None:
                asked = pause.prompt.decode("utf-8", "replace")
            elif pause.checkpoint_id is not None:
                snapshot = self._read(pause.checkpoint_id).snapshot
                if not isinstance(snapshot, NodeSnapshot):
                    continue
                asked = snapshot.node.get_node_id()
            else:
                continue
            if asked in leading:
                return True
        return False

    def _refuse_answered(self, resumer: _Resumer, head: _Head, before: SnapshotStatus) -> None:
        """A paused node answered by `resume()` after this caller loaded it (and before
        it was marked running, which a later answer sees) must not run without the
        answer: commit the answer as the head and raise `ResumeConflict` (P5).
        `before`: the node's status before it was marked running."""
        if before not in _ANSWERABLE:
            return  # an interrupted run taken over: no answer waits on a started node
        pause = self.remit.interrupt(self.run_id, head.top.id, branch=self.branch)
        if pause is None or pause.status != "consumed" or pause.value is None:
            return
        self._set_status(resumer, head.top, before)  # it did not run
        self._settle_resume(resumer, head)
        raise ResumeConflict(
            "the paused node was answered with resume() while this process loaded it; the "
            "answer is the run's head now: continue with iter_from_persistence()",
            run_id=self.run_id,
            checkpoint_id=head.top.id,
        )

    def _settle_resume(self, resumer: _Resumer, head: _Head) -> _Head:
        """Commit an answer that was consumed by a resumer that died before committing it."""
        if not head.top.is_node or head.top.status not in _ANSWERABLE:
            return head
        pause = self.remit.interrupt(self.run_id, head.top.id, branch=self.branch)
        if pause is None or pause.status != "consumed" or pause.value is None:
            return head
        snapshot = self._decode(
            pause.value,
            "the answer taken at this pause (kept, not yet stored as the run's head)",
            written_by=head.top.record.workflow_version,
            checkpoint_id=head.top.id,
            interrupt_id=head.top.id,
        )
        self._commit(resumer, snapshot, pause.value, head, via="resume", replaces=head.top.id)
        settled = self._read_head()
        assert settled is not None
        return settled

    async def paused(self) -> NodeSnapshot[StateT, RunEndT] | None:
        """The head snapshot if the run is paused and free to resume, else None."""
        return await self._off_loop(self._paused)

    def _paused(self) -> NodeSnapshot[StateT, RunEndT] | None:
        self._types()
        self._follow_token(None)
        try:
            head = self._paused_head()
        except (ResumeConflict, UnknownRecord):
            return None
        pause = self.remit.interrupt(self.run_id, head.top.id, branch=self.branch)
        if pause is not None and pause.status == "consumed":
            return None
        snapshot = head.top.snapshot
        assert isinstance(snapshot, NodeSnapshot)
        return snapshot

    async def update_state(
        self, state: StateT, *, pause_id: str | None = None
    ) -> NodeSnapshot[StateT, RunEndT]:
        """Replace the state of a paused run (an operator's edit), validated first (P4).

        Commits the paused node again with `state` as the new head; the old
        head stays in the history. It is the same pause: an answer may still
        name it by the id it had before the edit (`resume(node, pause_id=...)`).
        `CheckpointInvalid` leaves the run as it was; a pause answered already
        raises `ResumeConflict` and keeps its answer.

        An edit is for one pause, as an answer is: `pause_id` (the id `paused()`
        gave, also before earlier edits) names it, and the edit is refused with
        `ResumeConflict` unless the run is still paused there. A state read at a
        pause is then never written over a later node after the pause was answered
        and the run moved on (a driver between two nodes holds no claim). Without
        it, the edit is for the node the run is at when it arrives.
        """
        if pause_id is not None:
            checked_id("pause_id", pause_id)
        with self._turn() as resumer:
            return await self._off_loop(self._update_state, resumer, _as_called(state), pause_id)

    def _update_state(
        self, resumer: _Resumer, state: StateT, pause_id: str | None
    ) -> NodeSnapshot[StateT, RunEndT]:
        self._types()
        self._follow_token(resumer)
        # Refuse from a read first: a refused edit never takes the claim.
        self._paused_head(pause_id, "the edit", patient_until=self._held_patience())
        self._acquire(resumer, heartbeat=False)
        try:
            paused = self._paused_head(pause_id, "the edit")
            if self._settle_resume(resumer, paused) is not paused:
                raise ResumeConflict(
                    "the pause was answered before this edit (the answer is the run's head "
                    "now); the state edit was not stored",
                    run_id=self.run_id,
                    checkpoint_id=paused.top.id,
                )
            node = paused.top.snapshot.node
            assert isinstance(node, BaseNode)
            again = node.deep_copy()
            again.set_snapshot_id(generate_snapshot_id(node.get_node_id()))
            snapshot = NodeSnapshot(state=state, node=again)
            body = self._encode(snapshot, edit_of=paused.top.id if pause_id is None else pause_id)
            self._commit(
                resumer,
                snapshot,
                body,
                paused,
                release=True,
                via="update",
                replaces=paused.top.id,
                # The pause's ids, kept with the edit: `Remit.prune` may delete the
                # snapshots edited, and the pause's effects and answers name them.
                pause_ids=self._pause_ids(paused.top.record),
            )
        finally:
            self._drop(resumer)
        return snapshot

    async def fork(
        self, snapshot_id: str, fork_token: str
    ) -> RemitStatePersistence[StateT, RunEndT]:
        """A persistence on the branch `fork_token` makes from `snapshot_id` (P3).

        The same token, from any process, gives the same branch; a token used
        for another snapshot raises `ForkWithoutIntent`. The branch's head is
        the snapshot itself, to run again with `iter_from_persistence`. A
        snapshot this reader cannot read (`CorruptRecord`, `VersionMismatch`)
        or an `End` (`ValueError`: nothing would run) is refused before the
        branch is made.
        """
        checked_id("snapshot_id", snapshot_id)
        checked_id("fork_token", fork_token)
        await self._off_loop(self._fork_readable, snapshot_id, fork_token)
        return self._sibling(fork_token)

    def _sibling(self, fork_token: str | None) -> RemitStatePersistence[StateT, RunEndT]:
        """Another resumer of this run, on the line `fork_token` names: the same store,
        options and graph types, and a claim of its own."""
        other: RemitStatePersistence[StateT, RunEndT] = RemitStatePersistence(
            self._opener.opened or self._opener.url,
            self.run_id,
            fork_token=fork_token,
            lease=self.lease,
            workflow_version=self.workflow_version,
            accept_versions=self.accept_versions,
        )
        other._codec, other._edges, other._may_end = self._codec, self._edges, self._may_end
        other._node_types = self._node_types
        return other

    def __copy__(self) -> RemitStatePersistence[StateT, RunEndT]:
        """A copy is another resumer of the same run (`_sibling`). Sharing this one's claim
        and loaded node, it would run the node this one runs, and break this one's writes."""
        return self._sibling(self.fork_token)

    def __deepcopy__(self, memo: dict[int, Any]) -> RemitStatePersistence[StateT, RunEndT]:
        """As `copy.copy`: the store's connections are shared, not copied."""
        return self._sibling(self.fork_token)

    def __reduce__(self) -> Any:
        raise TypeError(
            f"RemitStatePersistence (run {self.run_id!r}) cannot be pickled: it holds its "
            "store's connections and its claim. In another process, create one with the same "
            "url and run_id (and fork_token, lease, workflow_version)"
        )

    def _fork_readable(self, snapshot_id: str, fork_token: str) -> None:
        """Fork from `snapshot_id` only if this reader can read it (P4): a snapshot with
        altered bytes, of another workflow version or of another graph is refused before
        the branch is made, and the token stays unused. So is a run's `End`: no node
        follows it, so a branch from it could never run (`ValueError`)."""
        if not self._read(snapshot_id).is_node:
            raise ValueError(
                f"fork() got snapshot {snapshot_id!r}, the End of its line: no node follows "
                "an End, so a branch from it could never run. Fork the snapshot of the node "
                f"to run again instead; no branch was made and token {fork_token!r} is unused"
            )
        self._fork_branch(snapshot_id, fork_token)

    def release(self) -> None:
        """Give up the claim this instance holds (e.g. after `load_next` on a run you
        leave paused); `ResumeConflict` while another call of the instance is in progress."""
        with self._turn() as resumer:
            self._drop(resumer)
