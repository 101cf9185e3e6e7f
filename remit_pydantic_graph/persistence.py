"""`RemitStatePersistence`: pydantic-graph 1.x's `BaseStatePersistence` on Remit.

One instance drives one run (and one line of its history: a fork token binds
it to the branch that token made). Every snapshot is one Remit checkpoint
keyed by its snapshot id; its status (`created` -> `pending` -> `running` ->
`success` / `error`) is an append-only log of fenced step writes on that
checkpoint, one log per branch. In pydantic-graph's terms the contract reads:

- P1 / L1: `load_next` takes the run's leased claim and hands out the head
  node, also one whose process died (`pending` / `running` under an expired
  lease), with the same snapshot id. `success` is committed in the
  transaction that appends the next snapshot; a cancelled node is given back.
- P2: a node's body runs under `remit_core.step_scope` keyed by its snapshot
  id, so `remit_core.effect` functions inside it apply once.
- P3: starting a new node on a run that already has a head, or running a
  snapshot that is not the head, is a fork and needs `fork_token`.
- P4: every snapshot round-trips through the graph's own type adapter before
  it is written; stored bytes are verified and version-checked on read.
- P5: `resume(node)` delivers a human's answer to a paused run, once.

Store calls are blocking; every async method runs them in a worker thread.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from time import perf_counter
from typing import TYPE_CHECKING, Annotated, Any

import anyio.to_thread
import pydantic
from pydantic_core import PydanticSerializationError
from pydantic_graph import BaseNode, End
from pydantic_graph.exceptions import GraphNodeStatusError
from pydantic_graph.persistence import (
    BaseStatePersistence,
    EndSnapshot,
    NodeSnapshot,
    RunEndT,
    Snapshot,
    SnapshotStatus,
    StateT,
)

from remit_core import codec, policy
from remit_core.core import DEFAULT_LEASE, ClaimHandle, Remit
from remit_core.effects import step_scope
from remit_core.errors import (
    CheckpointInvalid,
    ForkWithoutIntent,
    HeadMoved,
    RemitError,
    ResumeConflict,
    UnknownRecord,
    VersionMismatch,
)
from remit_core.records import MAIN_BRANCH, BranchRecord, CheckpointRecord, FenceRef, WriteRecord

if TYPE_CHECKING:
    from pydantic_graph.graph import Graph

__all__ = ["RemitStatePersistence"]

_NOT_STARTED = ("created", "pending")


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


_UNEXPECTED = re.compile(
    r"Expected `([^`]+)`[^\[]*\[field_name='([^']*)', input_value=(.*?), input_type=(\w+)\]"
)


def _serialization_problem(text: str) -> tuple[str, str]:
    """(field, what was wrong) from pydantic's serializer warnings, skipping union tries."""
    found = [m for m in _UNEXPECTED.finditer(text) if m.group(2) != "node"]
    if not found:
        return "<root>", text.replace("\n", " ")[:300]
    expected, field, value, kind = found[0].groups()
    return field, f"expected {expected}, got {kind} {value}"


def _field(loc: Iterable[int | str]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("node", "end"):  # the `kind` discriminator's tag
        parts = parts[1:]
    return ".".join(parts) or "<root>"


class RemitStatePersistence(BaseStatePersistence[StateT, RunEndT]):
    """State persistence for pydantic-graph 1.x runs, keeping the Resume Contract.

    `url` is a store URL (`sqlite:///remit.db`, `postgresql://...`,
    `redis://...`) or a `Remit`. `fork_token` allows this instance to fork
    (start a new node on a run that already has one, or run an old snapshot
    again); the same token from any process names the same branch.
    `workflow_version` is recorded on every snapshot; a run written by a
    version outside `accept_versions` (default: only this one) is refused.
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
        self.remit = url if isinstance(url, Remit) else Remit(url, lease=lease)
        self.run_id = run_id
        self.fork_token = fork_token
        self.lease = lease
        self.workflow_version = workflow_version
        self.accept_versions = frozenset(
            accept_versions if accept_versions is not None else (workflow_version,)
        )
        self.branch = MAIN_BRANCH
        if fork_token is not None:
            made = self.remit.fork_branch(run_id, fork_token)
            if made is not None:
                self.branch = made.branch
        self._adapter: pydantic.TypeAdapter[Snapshot[StateT, RunEndT]] | None = None
        self._edges: dict[str, tuple[frozenset[str], bool]] = {}
        self._instance = uuid.uuid4().hex[:8]
        self._claim: ClaimHandle | None = None
        self._started: _Head | None = None  # the node `record_run` marked running
        self._ran: tuple[_Head, float] | None = None

    # -- types (the graph's own adapters) ---------------------------------------
    def set_graph_types(self, graph: Graph[StateT, Any, RunEndT]) -> None:
        """Remember which node may follow which (for `resume`), then build the adapters."""
        self._edges = {
            node_id: (frozenset(d.next_node_edges), d.returns_base_node)
            for node_id, d in graph.node_defs.items()
        }
        super().set_graph_types(graph)

    def should_set_types(self) -> bool:
        return self._adapter is None

    def set_types(self, state_type: type[StateT], run_end_type: type[RunEndT]) -> None:
        """Build the snapshot adapter (called inside the graph's node-type context)."""
        snapshot = Snapshot[state_type, run_end_type]  # type: ignore[valid-type,misc]
        self._adapter = pydantic.TypeAdapter(Annotated[snapshot, pydantic.Discriminator("kind")])

    def _types(self) -> pydantic.TypeAdapter[Snapshot[StateT, RunEndT]]:
        if self._adapter is None:
            raise RemitError(
                "snapshot types are not set: call persistence.set_graph_types(graph) first "
                "(Graph.run, iter and iter_from_persistence do it)",
                run_id=self.run_id,
            )
        return self._adapter

    def _encode(self, snapshot: Snapshot[StateT, RunEndT]) -> bytes:
        """The snapshot's bytes, after a round trip through the graph's adapter (P4)."""
        adapter = self._types()
        if isinstance(snapshot, NodeSnapshot):  # status lives in the log, not in the bytes
            snapshot = dataclasses.replace(snapshot, status="created", start_ts=None, duration=None)
        ids = {"run_id": self.run_id, "checkpoint_id": snapshot.id}
        try:
            body = adapter.dump_json(snapshot, warnings="error")
        except PydanticSerializationError as exc:
            field, expected = _serialization_problem(str(exc))
            raise CheckpointInvalid(
                f"snapshot does not fit the graph's types at {field}: {expected}; "
                "nothing was written",
                field=field,
                **ids,
            ) from exc
        try:
            adapter.validate_json(body)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            path = _field(first.get("loc", ()))
            raise CheckpointInvalid(
                f"snapshot does not satisfy the graph's types at {path}: {first.get('msg')}; "
                "nothing was written",
                field=path,
                **ids,
            ) from exc
        return body

    # -- reads -------------------------------------------------------------------
    def _status_log(self, checkpoint_id: str) -> dict[str, list[WriteRecord]]:
        logs: dict[str, list[WriteRecord]] = {}
        for w in self.remit.writes(self.run_id, checkpoint_id):
            if w.task_id.startswith("status:"):
                logs.setdefault(w.task_id[len("status:") :], []).append(w)
        return logs

    def _read(self, checkpoint_id: str, base_id: str | None = None) -> _Stored:
        """One snapshot, verified, version-checked and decoded, with its status."""
        record = self.remit.checkpoint(self.run_id, checkpoint_id)
        if record is None:
            raise UnknownRecord(
                f"no snapshot {checkpoint_id!r} in this run",
                run_id=self.run_id,
                checkpoint_id=checkpoint_id,
            )
        policy.check_workflow_version(record, self.accept_versions)
        try:
            snapshot = self._types().validate_json(record.state)
        except pydantic.ValidationError as exc:
            raise VersionMismatch(
                f"stored snapshot does not fit this graph's types ({exc.errors()[0].get('msg')}); "
                "it was written by another version of the graph",
                run_id=self.run_id,
                checkpoint_id=checkpoint_id,
            ) from exc
        idx = -1
        if isinstance(snapshot, NodeSnapshot):
            snapshot.node.set_snapshot_id(snapshot.id)
            logs = self._status_log(checkpoint_id)
            # A branch's own log decides; a fork's base starts fresh on the fork.
            own = record.branch == self.branch or checkpoint_id == base_id
            log = logs.get(self.branch) or ([] if own else logs.get(record.branch, []))
            if log:
                last = max(log, key=lambda w: w.idx)
                entry = codec.loads(last.value)
                snapshot.status = entry["status"]
                snapshot.start_ts = entry["start_ts"]
                snapshot.duration = entry["duration"]
                idx = last.idx
        return _Stored(record, snapshot, idx)

    def _read_head(self) -> _Head | None:
        branch = self.remit.branch(self.run_id, branch=self.branch)
        if branch is None or branch.head_id is None:
            return None
        return _Head(branch, self._read(branch.head_id, branch.base_id))

    # -- claims --------------------------------------------------------------
    @property
    def _holder(self) -> str:
        return f"{self.remit.holder}/{self._instance}"

    def _acquire(self, *, heartbeat: bool) -> ClaimHandle:
        """Take (or keep) this instance's leased claim on its branch: `ResumeConflict` if held."""
        if self._claim is not None:
            self._claim.abandon()
        self._claim = self.remit.claim(
            self.run_id, self.branch, lease=self.lease, heartbeat=heartbeat, holder=self._holder
        )
        return self._claim

    def _drop(self) -> None:
        claim, self._claim, self._ran = self._claim, None, None
        if claim is not None:
            claim.release()

    def _fence(self) -> FenceRef:
        assert self._claim is not None, "a write needs the run's claim"
        return self._claim.fence

    def _switch(self, branch: str, *, heartbeat: bool) -> None:
        self._drop()
        self.branch = branch
        self._acquire(heartbeat=heartbeat)

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
        self, stored: _Stored, status: SnapshotStatus, *, duration: float | None = None
    ) -> None:
        write, entry = self._status_write(stored, status, duration)
        self.remit.put_writes([write], mode="expect_absent", fence=self._fence())
        snapshot = stored.snapshot
        assert isinstance(snapshot, NodeSnapshot)
        stored.status_idx = write.idx
        snapshot.status, snapshot.start_ts, snapshot.duration = status, entry["start_ts"], duration

    def _commit(
        self,
        snapshot: Snapshot[StateT, RunEndT],
        body: bytes,
        parent: _Head | None,
        *,
        writes: Iterable[WriteRecord] = (),
        **metadata: str,
    ) -> None:
        """Append `snapshot` after `parent` on this branch: a fenced compare-and-set."""
        plan = policy.CommitPlan(
            self.branch,
            None if parent is None else parent.top.id,
            1 if parent is None else parent.branch.head_seq + 1,
        )
        self.remit.commit(
            run_id=self.run_id,
            checkpoint_id=snapshot.id,
            parent_id=plan.expected_head,
            state=body,
            metadata={"kind": snapshot.kind, **metadata},
            workflow_version=self.workflow_version,
            writes=list(writes),
            fence=self._fence(),
            plan=plan,
        )

    def _refuse_fork(self, base_id: str, why: str) -> ForkWithoutIntent:
        return ForkWithoutIntent(
            f"{why}: that is a fork; pass fork_token= to RemitStatePersistence to make one "
            "named branch, resume(node) to answer a paused run, or iter_from_persistence() "
            "to continue it",
            run_id=self.run_id,
            checkpoint_id=base_id,
        )

    def _fork(self, base_id: str, *, heartbeat: bool, why: str) -> _Head:
        """Move to the branch `fork_token` names from `base_id` (P3); its head must be the base."""
        if self.fork_token is None:
            raise self._refuse_fork(base_id, why)
        made = self.remit.fork(self.run_id, base_id, self.fork_token)
        self._switch(made.branch, heartbeat=heartbeat)
        head = self._read_head()
        if head is None or head.top.id != base_id:
            raise HeadMoved(
                f"fork token {self.fork_token!r} already made branch {made.branch!r} from "
                f"{base_id!r}, now at {None if head is None else head.top.id!r}: continue that "
                "branch instead of forking again",
                run_id=self.run_id,
                checkpoint_id=base_id,
            )
        return head

    def _start_reason(self, head: _Head) -> str:
        return (
            f"the run already has a head on branch {self.branch!r} ({head.top.describe()}) "
            "and starting a new node there"
        )

    def _start(self, snapshot: Snapshot[StateT, RunEndT], *, keep_claim: bool) -> None:
        """A snapshot that does not follow a node this instance ran: a root, or a fork."""
        body = self._encode(snapshot)
        try:
            # Refuse from a read first: a refused writer never holds the claim.
            head = self._read_head()
            if head is not None and self.fork_token is None:
                raise self._refuse_fork(head.top.id, self._start_reason(head))
            self._acquire(heartbeat=False)
            head = self._read_head()
            if head is not None:
                head = self._fork(head.top.id, heartbeat=False, why=self._start_reason(head))
            self._commit(snapshot, body, head)
        except BaseException:
            self._drop()
            raise
        if not keep_claim:
            self._drop()

    def _advance(self, snapshot: Snapshot[StateT, RunEndT]) -> None:
        """The snapshot after the node this instance ran, with that node's `success` (P1)."""
        if self._ran is None:
            self._start(snapshot, keep_claim=False)
            return
        ran, duration = self._ran
        try:
            try:
                body = self._encode(snapshot)
            except CheckpointInvalid:
                self._set_status(ran.top, "error", duration=duration)
                raise
            done, _ = self._status_write(ran.top, "success", duration)
            self._commit(snapshot, body, ran, writes=[done])
        finally:
            self._drop()

    # -- the interface pydantic-graph calls ----------------------------------------
    async def snapshot_node(self, state: StateT, next_node: BaseNode[StateT, Any, RunEndT]) -> None:
        await anyio.to_thread.run_sync(self._advance, NodeSnapshot(state=state, node=next_node))

    async def snapshot_node_if_new(
        self, snapshot_id: str, state: StateT, next_node: BaseNode[StateT, Any, RunEndT]
    ) -> None:
        snapshot = NodeSnapshot(state=state, node=next_node)
        try:
            await anyio.to_thread.run_sync(self._snapshot_if_new, snapshot_id, snapshot)
        except BaseException:
            self._drop()  # cut short (cancelled): the node will not run now
            raise

    def _snapshot_if_new(self, snapshot_id: str, snapshot: NodeSnapshot[StateT, RunEndT]) -> None:
        if self.remit.checkpoint(self.run_id, snapshot_id) is None:
            self._start(snapshot, keep_claim=True)

    async def snapshot_end(self, state: StateT, end: End[RunEndT]) -> None:
        await anyio.to_thread.run_sync(self._advance, EndSnapshot(state=state, result=end))

    @asynccontextmanager
    async def record_run(self, snapshot_id: str) -> AsyncIterator[None]:
        """Run the head node under the claim and `step_scope` (effects keyed by its id)."""
        self._started = None
        try:
            head = await anyio.to_thread.run_sync(self._begin_run, snapshot_id)
        except BaseException:
            if self._started is not None:  # cancelled while the node was being marked running
                self._end_run(self._started, "created", None)
            raise
        claim = self._claim
        assert claim is not None
        start = perf_counter()
        try:
            with step_scope(self.remit, self.run_id, snapshot_id, fence=claim.fence):
                yield
        except Exception:
            await anyio.to_thread.run_sync(self._end_run, head, "error", perf_counter() - start)
            raise
        except BaseException:
            # Cancelled: give the node back now, on this thread; it has no result.
            self._end_run(head, "created", None)
            raise
        # Success is committed with the next snapshot; the lease lapses if none follows.
        self._ran = (head, perf_counter() - start)
        claim.abandon()

    def _run_reason(self, snapshot_id: str, head: _Head | None) -> str | None:
        if head is not None and head.top.id == snapshot_id:
            return None
        self._read(snapshot_id)  # LookupError (UnknownRecord) if it does not exist
        return (
            f"snapshot {snapshot_id!r} is not the head of branch {self.branch!r} (the head is "
            f"{'none' if head is None else head.top.id}) and running it again"
        )

    def _begin_run(self, snapshot_id: str) -> _Head:
        try:
            why = self._run_reason(snapshot_id, self._read_head())
            if why is not None and self.fork_token is None:
                raise self._refuse_fork(snapshot_id, why)
            self._acquire(heartbeat=True)
            head = self._read_head()
            why = self._run_reason(snapshot_id, head)
            if head is None or why is not None:
                head = self._fork(snapshot_id, heartbeat=True, why=why or "")
            if not head.top.is_node:
                raise GraphNodeStatusError(head.top.status)
            GraphNodeStatusError.check(head.top.status)
            self._set_status(head.top, "running")
            self._started = head
        except BaseException:
            self._drop()
            raise
        return head

    def _end_run(self, head: _Head, status: SnapshotStatus, duration: float | None) -> None:
        try:
            self._set_status(head.top, status, duration=duration)
        except RemitError:
            pass  # fenced out or store gone: the claim holder now decides this node
        finally:
            self._drop()

    async def load_next(self) -> NodeSnapshot[StateT, RunEndT] | None:
        try:
            return await anyio.to_thread.run_sync(self._load_next)
        except BaseException:
            self._drop()  # cut short (cancelled): the node stays free to load
            raise

    def _load_next(self) -> NodeSnapshot[StateT, RunEndT] | None:
        """Claim the head node: new, pending, or left running by a dead process (L1)."""
        self._types()
        self._acquire(heartbeat=False)
        try:
            head = self._read_head()
            if head is not None:
                head = self._settle_resume(head)
            if head is None or not head.top.is_node or head.top.status == "error":
                self._drop()
                return None
            self._set_status(head.top, "pending")
        except BaseException:
            self._drop()
            raise
        snapshot = head.top.snapshot
        assert isinstance(snapshot, NodeSnapshot)
        return snapshot

    async def load_all(self) -> list[Snapshot[StateT, RunEndT]]:
        return await anyio.to_thread.run_sync(self._load_all)

    def _load_all(self) -> list[Snapshot[StateT, RunEndT]]:
        """This branch's line of snapshots, oldest first (a fork includes its shared prefix)."""
        self._types()
        branch = self.remit.branch(self.run_id, branch=self.branch)
        out: list[Snapshot[StateT, RunEndT]] = []
        cursor = None if branch is None else branch.head_id
        while cursor is not None:
            stored = self._read(cursor, branch.base_id if branch is not None else None)
            out.append(stored.snapshot)
            cursor = stored.record.parent_id
        out.reverse()
        return out

    # -- the side API: resume values, state edits, forks ------------------------------
    async def resume(self, node: BaseNode[StateT, Any, RunEndT]) -> NodeSnapshot[StateT, RunEndT]:
        """Deliver the answer to a paused run as the node that follows the pause (P5).

        The run is paused when its head node has not started (the driver
        stopped before it, as in pydantic-graph's human-in-the-loop pattern).
        `node` must be a node the paused one may lead to; it is validated,
        then consumed once across all processes and committed as the new head,
        with the paused snapshot's state. Continue with
        `graph.iter_from_persistence(persistence)`. A second or late answer
        raises `ResumeConflict` and nothing is stored; an invalid one raises
        `CheckpointInvalid` and the run stays paused.
        """
        return await anyio.to_thread.run_sync(self._resume, node)

    def _resume(self, node: BaseNode[StateT, Any, RunEndT]) -> NodeSnapshot[StateT, RunEndT]:
        self._types()
        paused = self._paused_head()
        self._check_successor(paused.top, node)
        snapshot = NodeSnapshot(state=paused.top.snapshot.state, node=node)
        body = self._encode(snapshot)
        pause_id = paused.top.id
        self.remit.open_interrupts(
            self.run_id, {pause_id: None}, branch=self.branch, checkpoint_id=pause_id
        )
        # The one atomic step: of all resumers, exactly one gets past it. Losers never
        # take the run's claim, so they cannot get in the way of the winner's run.
        self.remit.consume(self.run_id, pause_id, body, branch=self.branch)
        if not self._acquire_patiently():
            return snapshot  # accepted; the claim's holder settles it in its load_next
        try:
            head = self._read_head()
            if head is not None and head.top.id == pause_id:
                self._commit(snapshot, body, head, via="resume", replaces=pause_id)
            elif self.remit.checkpoint(self.run_id, snapshot.id) is None:
                raise HeadMoved(
                    "the run moved on from its pause while the value was delivered; the value "
                    "was recorded with the pause and is not used",
                    run_id=self.run_id,
                    checkpoint_id=pause_id,
                )
        except BaseException:
            self._drop()
            raise
        return snapshot

    def _acquire_patiently(self) -> bool:
        """Take the claim, waiting out at most one lease of its current holder."""
        deadline = time.monotonic() + self.lease + 1.0
        while True:
            try:
                self._acquire(heartbeat=False)
                return True
            except ResumeConflict:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)

    def _paused_head(self) -> _Head:
        """The head if the run is paused: a node not started, not holding an answer, unclaimed."""
        head = self._read_head()
        if head is None:
            raise UnknownRecord("the run has no snapshots to resume", run_id=self.run_id)
        ids = {"run_id": self.run_id, "checkpoint_id": head.top.id}
        if not head.top.is_node:
            raise ResumeConflict("the run has ended; the value was not stored", **ids)
        if head.top.status not in _NOT_STARTED:
            raise ResumeConflict(
                f"the run is not paused: its head node is {head.top.status}; recover it with "
                "iter_from_persistence(). The value was not stored",
                **ids,
            )
        if head.top.record.metadata.get("via") == "resume":
            raise ResumeConflict(
                "the run was already resumed (its head holds an earlier answer); the value "
                "was not stored",
                **ids,
            )
        claim = self.remit.store.get_claim(self.run_id, self.branch)
        if policy.decide_claim(claim, self._holder, self.remit.clock()) == "conflict":
            raise ResumeConflict(
                "another process holds the run (it is loading or running the paused node); "
                "the value was not stored",
                **ids,
            )
        return head

    def _check_successor(self, paused: _Stored, node: BaseNode[StateT, Any, RunEndT]) -> None:
        pause = paused.snapshot.node
        assert isinstance(pause, BaseNode)
        edges = self._edges.get(pause.get_node_id())
        if edges is None or edges[1] or node.get_node_id() in edges[0]:
            return
        raise ResumeConflict(
            f"the run is paused at {pause.get_node_id()}, which does not lead to "
            f"{node.get_node_id()}: this value is not for this pause and was not stored",
            run_id=self.run_id,
            checkpoint_id=paused.id,
        )

    def _settle_resume(self, head: _Head) -> _Head:
        """Commit an answer that was consumed by a resumer that died before committing it."""
        if not head.top.is_node or head.top.status not in _NOT_STARTED:
            return head
        pause = self.remit.interrupt(self.run_id, head.top.id, branch=self.branch)
        if pause is None or pause.status != "consumed" or pause.value is None:
            return head
        snapshot = self._types().validate_json(pause.value)
        self._commit(snapshot, pause.value, head, via="resume", replaces=head.top.id)
        settled = self._read_head()
        assert settled is not None
        return settled

    async def paused(self) -> NodeSnapshot[StateT, RunEndT] | None:
        """The head snapshot if the run is paused and free to resume, else None."""
        return await anyio.to_thread.run_sync(self._paused)

    def _paused(self) -> NodeSnapshot[StateT, RunEndT] | None:
        self._types()
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

    async def update_state(self, state: StateT) -> NodeSnapshot[StateT, RunEndT]:
        """Replace the state of a paused run (an operator's edit), validated first (P4).

        Commits the paused node again with `state` as the new head; the old
        head stays in the history. `CheckpointInvalid` leaves the run as it was.
        """
        return await anyio.to_thread.run_sync(self._update_state, state)

    def _update_state(self, state: StateT) -> NodeSnapshot[StateT, RunEndT]:
        self._types()
        self._acquire(heartbeat=False)
        try:
            paused = self._paused_head()
            node = paused.top.snapshot.node
            assert isinstance(node, BaseNode)
            again = node.deep_copy()
            again.set_snapshot_id(f"{node.get_node_id()}:{uuid.uuid4().hex}")
            snapshot = NodeSnapshot(state=state, node=again)
            self._commit(
                snapshot, self._encode(snapshot), paused, via="update", replaces=paused.top.id
            )
        finally:
            self._drop()
        return snapshot

    async def fork(
        self, snapshot_id: str, fork_token: str
    ) -> RemitStatePersistence[StateT, RunEndT]:
        """A persistence on the branch `fork_token` makes from `snapshot_id` (P3).

        The same token, from any process, gives the same branch; a token used
        for another snapshot raises `ForkWithoutIntent`. The branch's head is
        the snapshot itself, to run again with `iter_from_persistence`.
        """
        await anyio.to_thread.run_sync(self.remit.fork, self.run_id, snapshot_id, fork_token)
        other: RemitStatePersistence[StateT, RunEndT] = RemitStatePersistence(
            self.remit,
            self.run_id,
            fork_token=fork_token,
            lease=self.lease,
            workflow_version=self.workflow_version,
            accept_versions=self.accept_versions,
        )
        other._adapter, other._edges = self._adapter, self._edges
        return other

    def release(self) -> None:
        """Give up this instance's claim (e.g. after `load_next` on a run you leave paused)."""
        self._drop()
