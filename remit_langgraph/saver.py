"""`RemitSaver`: LangGraph's `BaseCheckpointSaver` over `remit_core`, sync and async.

Storage and policy live in the core; this module translates LangGraph's
checkpoints, channel values and writes into Remit records (`_records`) and
back. The async methods run the same sync code in a worker thread, so the
logic exists once and the event loop never waits on the store. The contract
hooks that need LangGraph's run loop (claims, resume values, forks, state
schema, effect scopes) are in `_runs`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import contextvars
import copy
import dataclasses
import random
import sys
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any, NamedTuple

from langchain_core.runnables import RunnableConfig
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    ChannelVersions,
    Checkpoint,
    CheckpointMetadata,
    CheckpointTuple,
    get_serializable_checkpoint_metadata,
    writes_sort_key,
)
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.serde.base import SerializerProtocol
from langgraph.checkpoint.serde.types import INTERRUPT

from remit_core import Remit, codec, connect, policy
from remit_core.core import checked_lease
from remit_core.errors import (
    CorruptRecord,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    RemitError,
    ResumeConflict,
    UnknownRecord,
)
from remit_core.records import MAIN_BRANCH, BranchRecord, CheckpointRecord, WriteRecord
from remit_langgraph import _records as rec
from remit_langgraph._options import (
    checked_allowlist,
    checked_serde,
    checked_state_schema,
    checked_store,
    checked_versions,
)
from remit_langgraph._runs import (
    LoopCall,
    Run,
    Runs,
    above_saver,
    as_run,
    beside_run,
    calls_at_pause,
    current_run,
)
from remit_langgraph._schema import StateCheck
from remit_langgraph._serde import GuardedSerializer, StrictSerializer
from remit_langgraph._shared_effects import CALLS


def _conf(config: RunnableConfig | None) -> dict[str, Any]:
    """The config's `configurable` keys, its ids checked (`rec.checked_conf`)."""
    return rec.checked_conf(dict((config or {}).get("configurable") or {}))


def _ns(config: RunnableConfig | None) -> str:
    ns = _conf(config).get("checkpoint_ns")
    if ns is None:
        return ""
    if not isinstance(ns, str):
        raise RemitError(f"config's configurable.checkpoint_ns must be a string, got {ns!r}")
    return ns


def _thread(config: RunnableConfig) -> str:
    return rec.thread_id(_conf(config).get("thread_id"))


class RemitSaver(BaseCheckpointSaver[str]):
    """A LangGraph checkpointer that keeps the Resume Contract.

    `store` is a Remit store URL (`sqlite:///remit.db`, `postgresql://...`,
    `redis://...`) or a `remit_core.Remit`. See the package docstring for the
    options and the config keys it reads.
    """

    serde: StrictSerializer

    def __init__(
        self,
        store: str | Remit,
        *,
        state_schema: Any = None,
        allowlist: Iterable[tuple[str, ...] | type] = (),
        lease: float | None = None,
        workflow_version: str = "",
        accept_versions: Iterable[str] | None = None,
        serde: SerializerProtocol | None = None,
    ) -> None:
        # Every option is checked before the store opens (`_options`).
        checked_store(store)
        checked_serde(serde)
        checked_state_schema(state_schema)
        allowlist = checked_allowlist(allowlist)
        self.accept_versions = checked_versions(workflow_version, accept_versions)
        lease = None if lease is None else checked_lease(lease)
        super().__init__(
            serde=StrictSerializer(allowlist)
            if serde is None
            else GuardedSerializer(serde, allowlist)
        )
        self.remit = connect(store) if isinstance(store, str) else store
        self.lease = self.remit.lease if lease is None else lease
        self.workflow_version = workflow_version
        self._runs = Runs(self, state_schema)
        self._indexed: set[tuple[str, Any]] = set()
        self._blobs = rec.BlobCache()
        #: An edit's writes held for its commit (`_hold_edit_writes`), by the id of the
        #: `update_state` superstep frame that stores them and then commits: the frame
        #: (kept, so no later frame takes its id), where they go, the writes.
        self._held: dict[int, _Held] = {}
        self._held_lock = threading.Lock()

    @classmethod
    def from_conn_string(cls, url: str, **options: Any) -> _Opened:
        """`with RemitSaver.from_conn_string(url) as saver:` (or `async with`)."""
        return _Opened(cls(url, **options))

    # -- helpers ------------------------------------------------------------------
    def _dump(self, value: Any, field: str, **ids: Any) -> bytes:
        return rec.pack(self.serde.dumps_at(value, field, **ids))

    def _decode(self, raw: bytes, **ids: Any) -> Any:
        return rec.decode_value(self.serde, raw, **ids)

    def _tuple(
        self, record: CheckpointRecord, writes: list[WriteRecord] | None = None
    ) -> CheckpointTuple:
        """Rebuild a `CheckpointTuple` from a verified checkpoint record (and its
        writes, if they were read with it)."""
        ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
        policy.check_workflow_version(record, self.accept_versions)
        body = rec.decode_body(record.state, **ids)
        keys = {ch: rec.blob_key(ch, v) for ch, v in body["channel_versions"].items()}
        blobs = self._blobs.get(record.run_id, record.ns, keys.values())
        missing = [k for k in keys.values() if k not in blobs]
        if missing:
            try:
                stored = self.remit.blobs(record.run_id, missing, ns=record.ns)
            except CorruptRecord as exc:  # (checkpoints share a blob: name the one read)
                raise CorruptRecord(exc.message, **{**exc.ids, **ids}) from exc
            fetched: dict[str, bytes | None] = dict(stored)
            for k in missing:
                if k not in fetched and rec.is_own_version(k.split(":", 1)[0]):
                    fetched[k] = None  # an emptied channel's version: never a value
            self._blobs.put(record.run_id, record.ns, fetched)
            blobs.update(fetched)
        values = {
            ch: rec.decode_value(self.serde, raw, **ids)
            for ch, key in keys.items()
            if (raw := blobs.get(key)) is not None
        }
        for ch, raw in body["inline"].items():
            values[ch] = rec.decode_value(self.serde, raw, **ids)
        upgraded = self._runs.upgrade(record, values)
        if upgraded is not values:
            # Keys a migration added or changed get versions of their own, and those it
            # dropped lose theirs: LangGraph carries a key into the next checkpoint only
            # by its version, and this saver stores a value once per version, so the
            # first checkpoint of the new schema would lose an added key and keep the
            # old value of a changed one (stored as the new schema's).
            body = {
                **body,
                "channel_versions": rec.migrated_versions(
                    body["channel_versions"], values, upgraded, record
                ),
            }
            values = upgraded
        pending = self._writes(record, writes)
        parent = (
            rec.run_config(record.run_id, record.ns, record.parent_id) if record.parent_id else None
        )
        return CheckpointTuple(
            config=rec.run_config(record.run_id, record.ns, record.checkpoint_id),
            checkpoint=rec.build_checkpoint(record.checkpoint_id, body, values),
            metadata=dict(record.metadata),  # type: ignore[arg-type]
            parent_config=parent,
            pending_writes=pending,
        )

    def _writes(
        self, record: CheckpointRecord, stored: list[WriteRecord] | None = None
    ) -> list[tuple[str, str, Any]]:
        ids = {"run_id": record.run_id, "checkpoint_id": record.checkpoint_id}
        if stored is None:
            stored = self.remit.writes(record.run_id, record.checkpoint_id, ns=record.ns)
        stored.sort(key=lambda w: writes_sort_key(w.task_path, w.task_id, w.idx))
        return [
            (w.task_id, w.channel, rec.decode_value(self.serde, w.value, **ids))
            for w in stored
            if w.channel != CALLS
        ]

    # -- reads ------------------------------------------------------------------
    def get_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        """The checkpoint `config` names, else the head of its branch (main or its fork token's).

        Called by LangGraph's run loop at the start of a run, it also opens the
        run: claim, fork rule, resume values (see `_runs`).
        """
        frame = sys._getframe(1)
        call = self._runs.calling_loop(frame)
        if call is None:
            caller = above_saver(frame)
            if caller is not None and caller.f_code.co_name in _STATE_READS:
                self._branch_named(_conf(config))
            found = self._read_for(config, _snapshot_parent(caller))
            _note_read(caller, config, found)
            return found
        run, found = self._runs.start(call, config)
        if run is not None:
            self._runs.attach(call.loop, run)
        return found

    def read(self, config: RunnableConfig) -> CheckpointTuple | None:
        """`get_tuple` without the run-start hooks."""
        record, writes, line = self._record(config)
        if record is None:
            return None
        found = self._tuple(record, writes)
        if line is not None and line.ns:
            # A subgraph's line on a fork: the token stays in the config, so an edit
            # with it (`update_state`) goes to that line, at its base too.
            found.config["configurable"]["fork_token"] = line.fork_token
        return found

    def _read_for(
        self, config: RunnableConfig, parent: CheckpointTuple | None
    ) -> CheckpointTuple | None:
        """`read`, for a subgraph's state read while its `parent`'s snapshot is built
        (`get_state(config, subgraphs=True)`): LangGraph names the subgraph's thread
        and namespace only, and a parent read on a fork means the fork's line of a
        subgraph with a line of its own (`checkpointer=True`), as its token would."""
        conf = _conf(config)
        if parent is None or conf.get("fork_token") or conf.get("checkpoint_id") or not _ns(config):
            return self.read(config)
        thread, at = _thread(config), _conf(parent.config)
        if str(at.get("thread_id")) != thread or not at.get("checkpoint_id"):
            return self.read(config)
        ns = at.get("checkpoint_ns") or ""
        record = self.remit.checkpoint(thread, at["checkpoint_id"], ns=ns)
        if record is None or record.branch == MAIN_BRANCH:
            return self.read(config)
        token = next(
            (b.fork_token for b in self.remit.branches(thread, ns=ns) if b.branch == record.branch),
            None,
        )
        if token is None:
            return self.read(config)
        return self.read({**config, "configurable": {**conf, "fork_token": token}})

    def _record(
        self, config: RunnableConfig
    ) -> tuple[CheckpointRecord | None, list[WriteRecord] | None, BranchRecord | None]:
        """The checkpoint `config` names, its writes if they were read with it, and
        the branch of its fork token that it is on (else None)."""
        conf = _conf(config)
        thread, ns = _thread(config), _ns(config)
        checkpoint_id = conf.get("checkpoint_id")
        token = conf.get("fork_token")
        forked = None
        if token and ns == "":
            forked = self.remit.fork_branch(thread, token)
        elif token:
            forked = self._runs.fork_in(thread, ns, token)
        if forked is not None and (not checkpoint_id or checkpoint_id == forked.base_id):
            # A fork token names its branch: read its head, as a run with it continues there.
            return self.remit.head(thread, ns=ns, branch=forked.branch), None, forked
        if checkpoint_id:
            record, writes = self.remit.checkpoint_and_writes(thread, checkpoint_id, ns=ns)
            on = (
                forked if record is not None and forked and record.branch == forked.branch else None
            )
            return record, writes, on
        return self.remit.head(thread, ns=ns), None, None

    def list(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> Iterator[CheckpointTuple]:
        """Checkpoints newest first; `filter` matches metadata keys exactly.

        With a `fork_token` that names a branch, the fork's own line in
        `checkpoint_ns` (the graph's, "", if the config sets none): its
        checkpoints and those it continues from, not what the other branches
        wrote since (a subgraph with a line of its own, restored during a
        fork's first run, finds where its line stood at the fork's base).
        """
        conf = _conf(config)
        if before is not None and conf.get("checkpoint_ns") and current_run() is not None:
            self._runs.replaying(sys._getframe(1))  # (a subgraph's restore on a fork)
        thread = None if conf.get("thread_id") is None else rec.thread_id(conf["thread_id"])
        ns = None if conf.get("checkpoint_ns") is None else _ns(config)
        before_id = _conf(before).get("checkpoint_id")
        if thread is not None:
            self._branch_named(conf)
        if conf.get("fork_token") and conf.get("checkpoint_ns") is None:
            # A fork's line is one namespace's: without one, the graph's own (as
            # `get_state_history` reads it), not every branch's checkpoints of the thread.
            conf = {**conf, "checkpoint_ns": ""}
        line = self._fork_line(conf)
        named = conf.get("checkpoint_id")
        if line is not None:
            records = [r for r in line if before_id is None or r.checkpoint_id < before_id]
        elif named and thread is not None and ns is not None:
            # One checkpoint named (`get_state_history` of a config with its id): read
            # it, not a `limit`-long page of the newest, which would miss an older one.
            one = self.remit.checkpoint(thread, named, ns=ns)
            records = [] if one is None or (before_id and named >= before_id) else [one]
        else:
            records = self.remit.history(
                thread,
                ns=ns,
                before_id=before_id,
                limit=None if filter or thread is None or named else limit,
                verify=False,
            )
        if named:
            records = [r for r in records if r.checkpoint_id == named]
        count = 0
        for raw in records:
            if limit is not None and count >= limit:
                return
            if filter and any(raw.metadata.get(k) != v for k, v in filter.items()):
                continue
            try:
                record = self.remit.checkpoint(raw.run_id, raw.checkpoint_id, ns=raw.ns)
            except CorruptRecord:
                if thread is None and not rec.is_langgraph_body(codec.peek(raw.state)):
                    continue  # another shim's damaged run, in a listing of the whole store
                raise
            if record is None or not rec.is_langgraph_body(record.state):
                continue  # deleted while listing, or another shim's run
            count += 1
            yield self._tuple(record)

    def _branch_named(self, conf: Mapping[str, Any]) -> None:
        """Refuse a read whose fork token, without a checkpoint_id, names no branch of the
        thread: the branch it would name does not exist yet, and main's state shown in
        its place would read as the fork's (a run with the token is refused the same way)."""
        token = conf.get("fork_token")
        if not token or conf.get("checkpoint_id") or conf.get("thread_id") is None:
            return
        thread = rec.thread_id(conf["thread_id"])
        if self.remit.fork_branch(thread, token) is None:
            raise UnknownRecord(
                f"no branch of this thread was made with fork token {token!r} (yet); a token "
                "without a checkpoint_id names the branch its first use made: make it with "
                "the checkpoint_id to fork from (update_state or invoke), then read it",
                run_id=thread,
            )

    def _fork_line(self, conf: Mapping[str, Any]) -> builtins.list[CheckpointRecord] | None:
        """The checkpoints of the branch `conf`'s fork token names, in `conf`'s
        namespace, newest first back to the first: None if no such branch."""
        token, thread, ns = conf.get("fork_token"), conf.get("thread_id"), conf.get("checkpoint_ns")
        if not token or thread is None or ns is None:
            return None
        thread = str(thread)
        forked = (
            self.remit.fork_branch(thread, token)
            if ns == ""
            else self._runs.fork_in(thread, ns, token)
        )
        if forked is None:
            return None
        by_id = {r.checkpoint_id: r for r in self.remit.history(thread, ns=ns, verify=False)}
        line = []
        at = None if forked.head_id is None else by_id.get(forked.head_id)
        while at is not None:
            line.append(at)
            at = None if at.parent_id is None else by_id.get(at.parent_id)
        return line

    # -- writes -----------------------------------------------------------------
    def put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """Commit `checkpoint` after `config`'s checkpoint id (a compare-and-set of the head).

        Channel values are stored once per (channel, version) in `new_versions`;
        the changed state keys are checked against the state schema first.
        """
        # Inside a run the run's check applies; only a put outside one (`update_state`)
        # needs the calling graph found.
        frame = above_saver(sys._getframe(1))
        if _edit_step(frame):
            with beside_run(_thread(config)):
                return self._put_at(frame, config, checkpoint, metadata, new_versions)
        return self._put_at(frame, config, checkpoint, metadata, new_versions)

    def _put_at(
        self,
        frame: FrameType | None,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """`put`, called from `frame`."""
        run = self._runs.active(_thread(config))
        if run is None and (run := self._runs.of_loop(frame, _thread(config))) is not None:
            with as_run(run):  # (a run read in turn with another: `Runs.of_loop`)
                return self._put_at(frame, config, checkpoint, metadata, new_versions)
        by_graph, caller = (False, None) if run is not None else self._runs.learn(frame)
        last = run is not None and run.is_last_put(frame, metadata, _ns(config))
        held = self._take_edit_writes(frame, config) if run is None else ()
        if run is None:
            copied = self._copy_target(frame, config)
            if copied is not None and copied.get("done"):
                return copied["done"]
            config = config if copied is None else copied["config"]
        try:
            return self._put(
                config, checkpoint, metadata, new_versions, caller, last, by_graph, held
            )
        except ForkWithoutIntent as exc:
            if _read_as_head(frame, config) or _later_superstep(frame):
                raise _head_moved(config, later=_later_superstep(frame)) from exc
            raise

    def _copy_target(
        self, frame: FrameType | None, config: RunnableConfig
    ) -> dict[str, Any] | None:
        """Where the copy of `update_state(config, None, as_node="__copy__")` goes, if
        `frame` (a put's caller) is one and its config has a fork token: LangGraph puts
        the copy under the copied checkpoint's parent, by a config without the token.
        The token's first use forks there ({"config": ...}); again, it names the branch
        it made, and the copy is that branch at its head ({"done": its config}). None:
        not such a copy. Without a token a copy is a fork, refused with
        `ForkWithoutIntent`; so is a copy of a root (it has no parent to fork from)."""
        if (
            frame is None
            or frame.f_code.co_name not in _SUPERSTEP_FRAMES
            or frame.f_locals.get("as_node") != "__copy__"
        ):
            return None
        asked, conf = _conf(frame.f_locals.get("config")), _conf(config)
        token, parent = asked.get("fork_token"), conf.get("checkpoint_id")
        if conf.get("fork_token") or _ns(config):
            return None
        thread = _thread(config)
        saved = frame.f_locals.get("saved")
        copied_id = _conf(saved.config).get("checkpoint_id") if saved is not None else None
        if not token or not parent:
            # A copy of a root has no parent: stored as one, it would be main's new
            # head, dropping the line main stands on.
            how = (
                'pass config["configurable"]["fork_token"] to make one named branch'
                if parent
                else "the thread's first checkpoint has no parent to fork from: fork it "
                "with its checkpoint_id and a fork_token in update_state(config, values) "
                "or invoke(None, config)"
            )
            raise ForkWithoutIntent(
                'update_state(config, None, as_node="__copy__") stores a copy beside the '
                f"checkpoint it copies, which is a fork: {how}. Nothing was stored",
                run_id=thread,
                checkpoint_id=copied_id,
            )
        forked = self.remit.fork_branch(thread, token)
        if forked is None:
            return {"config": {**config, "configurable": {**conf, "fork_token": token}}}
        at = None if copied_id is None else self.remit.checkpoint(thread, copied_id)
        if forked.base_id != parent and (at is None or at.branch != forked.branch):
            raise ForkWithoutIntent(
                f"fork token {token!r} already forked from {forked.base_id!r}; a copy of "
                "another checkpoint needs a new token. Nothing was stored",
                run_id=thread,
                checkpoint_id=copied_id,
            )
        head = self.remit.head(thread, branch=forked.branch)
        if head is None:  # (a branch made from no checkpoint, holding none yet)
            return {"config": {**config, "configurable": {**conf, "fork_token": token}}}
        return {"done": rec.run_config(thread, "", head.checkpoint_id)}

    def _put(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
        caller: StateCheck | None,
        last: bool = False,
        by_graph: bool = False,
        held: Sequence[WriteRecord] = (),
    ) -> RunnableConfig:
        """`put`; `last`: the run's last write, whose commit gives its claim up;
        `by_graph`: an edit a graph makes outside a run (`update_state`); `held`: its
        writes on the checkpoint it continues, stored by this commit or not at all."""
        conf = _conf(config)
        thread, ns = _thread(config), _ns(config)
        checkpoint_id = checkpoint["id"]
        ids = {"run_id": thread, "checkpoint_id": checkpoint_id}
        values = checkpoint["channel_values"]
        run = self._runs.before_put(thread, ns, checkpoint_id, values, new_versions.keys(), caller)
        versions = checkpoint["channel_versions"]
        blobs: dict[str, bytes] = {}
        inline: dict[str, bytes] = {}
        for ch, value in values.items():
            if ch in new_versions:
                blobs[rec.blob_key(ch, new_versions[ch])] = self._dump(value, ch, **ids)
                continue
            # A channel no step wrote keeps its version, and a version this saver
            # made names one value: stored once, it is not written again (a blob
            # this process has not seen stored is sent, and kept if already there).
            version = versions.get(ch)
            if isinstance(version, str) and rec.is_own_version(version):
                key = rec.blob_key(ch, version)
                if not self._blobs.holds(thread, ns, key):
                    blobs[key] = self._dump(value, ch, **ids)
            else:  # a version of the caller's own may name several values: keep this one
                inline[ch] = self._dump(value, ch, **ids)
        token, parent = conf.get("fork_token"), conf.get("checkpoint_id")
        branch = None
        if run is None and token and parent and ns == "":
            # Outside a run (`update_state`), a token with a checkpoint forks as a run does.
            branch = self._runs.fork(thread, parent, token)
        elif token and ns != "":
            self._runs.fork_in(thread, ns, token)  # the fork's own line of the subgraph
        edit = None
        if by_graph and run is None:
            # A graph's edit from outside a run on this thread (`update_state`, of the
            # graph or of a subgraph's namespace; from a node of a run on another thread
            # too) takes the claim of the branch its run would hold: a run in flight on
            # it refuses the edit (`ResumeConflict`) instead of losing it, or being
            # refused by it, later. (A put of code that drives the saver itself has the
            # head's compare-and-set alone, as any checkpointer gives it.)
            if branch is None and parent and self.remit.checkpoint(thread, parent, ns=ns) is None:
                # (LangGraph reads such a config as a thread with no checkpoint, and
                # would store the edit as a root under a parent the thread lacks.)
                raise UnknownRecord(
                    f"update_state names checkpoint {parent!r}, which thread {thread!r} "
                    f"does not have{f' in namespace {ns!r}' if ns else ''} (a typo, a "
                    "deleted checkpoint, or another thread's id); nothing was stored",
                    run_id=thread,
                    checkpoint_id=parent,
                )
            if branch is None:
                branch = self._edited_branch(thread, ns, parent, token)
            try:
                edit = self.remit.claim(thread, branch, lease=self.lease, heartbeat=False)
            except ResumeConflict as exc:
                raise ResumeConflict(
                    "a run holds this thread (it is running, or its process died and its "
                    "lease has not run out); the edit was not stored: retry when it ends",
                    run_id=thread,
                    checkpoint_id=parent,
                ) from exc
        declared = self._runs.declared
        stored_meta = get_serializable_checkpoint_metadata(config, metadata)
        lg_run = stored_meta.get("run_id")
        index = self._run_index_entry(thread, lg_run)
        with _writing(run), edit or contextlib.nullcontext():
            self.remit.commit(
                run_id=thread,
                checkpoint_id=checkpoint_id,
                parent_id=parent,
                state=rec.encode_body(checkpoint, inline),
                ns=ns,
                metadata=stored_meta,
                fork_token=token,
                schema_version=declared.version if declared is not None else 1,
                workflow_version=self.workflow_version,
                blobs=blobs,
                # The run index's entry commits with the checkpoint: no round trip of its own.
                writes=(*held, *(() if index is None else (index,))),
                fence=run.fence if run is not None else None if edit is None else edit.fence,
                allow_new_root=True,
                release=run.claim if run is not None and last else edit,
            )
            if index is not None:
                self._indexed_now(thread, lg_run)
            if run is not None:
                run.committed.add(checkpoint_id)
        # Only versions this saver made are unique to one value; a caller reusing a
        # version keeps the first value stored, which the cache must not contradict.
        # A new version of a channel with no value (emptied) never gets a blob.
        self._blobs.put(thread, ns, rec.own_blobs(new_versions, blobs))
        return rec.run_config(thread, ns, checkpoint_id)

    def _edited_branch(self, thread: str, ns: str, parent: str | None, token: Any) -> str:
        """The top-level branch whose run an edit of checkpoint `parent` in namespace
        `ns` would race: the checkpoint's own branch at the top; in a subgraph's
        namespace, the fork its token names, else the branch of the top-level
        checkpoint the subgraph's checkpoint was written under."""
        if ns and token:
            forked = self.remit.fork_branch(thread, token)
            if forked is not None:
                return forked.branch
        at = None if parent is None else self.remit.checkpoint(thread, parent, ns=ns)
        if at is not None and ns:
            top = (at.metadata.get("parents") or {}).get("")
            at = None if not isinstance(top, str) else self.remit.checkpoint(thread, top)
        return MAIN_BRANCH if at is None else at.branch

    def put_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        """Store a task's writes on a checkpoint (special channels overwrite, others keep first)."""
        conf = _conf(config)
        thread, ns = _thread(config), _ns(config)
        checkpoint_id = conf["checkpoint_id"]
        if self._runs.active(thread) is not None:
            # (A run's writes skip the frame walk: only LangGraph's own caller is seen.)
            if _edit_step(sys._getframe(1)):
                with beside_run(thread):
                    return self.put_writes(config, writes, task_id, task_path)
        else:
            caller = above_saver(sys._getframe(1))
            if self._hold_edit_writes(_edit_superstep(caller), config, writes, task_id, task_path):
                return
            if _later_superstep(caller):
                # A later superstep of `bulk_update_state` stores its writes on the
                # checkpoint it continues before committing after it: if another write
                # moved the head since, its commit is refused, and these writes would
                # stay behind.
                self._still_head(thread, ns, checkpoint_id, config)
        run = self._runs.before_writes(thread, ns, checkpoint_id, task_id, writes)
        if run is not None and run.refused:
            writes = run.unrefused(writes, ns, task_id)
            if not writes:
                return
        records = self._write_records(thread, ns, checkpoint_id, task_id, task_path, writes)
        special = all(w.channel in WRITES_IDX_MAP for w in records)
        calls = None if run is None or ns != "" or not records else run.calls.get(task_id)
        # A pause is stored with its calls even if it made none (`calls_at_pause`).
        pause = ns == "" and any(w.channel == INTERRUPT for w in records)
        if run is not None and pause and calls is None:
            calls = calls_at_pause(run, task_id)
        with _writing(run):
            if run is not None and calls is not None and (calls.counts or pause):
                # The calls made before the task's first writes here (`_shared_effects`).
                self.remit.put_writes([calls.write(records[0])], mode="first", fence=run.fence)
            self.remit.put_writes(
                records,
                mode="overwrite" if special else "first",
                fence=None if run is None else run.fence,
            )
        self._runs.after_writes(run, thread, ns, checkpoint_id, writes)
        self._runs.after_failed(run, ns, checkpoint_id, task_id, writes)

    def _write_records(
        self,
        thread: str,
        ns: str,
        checkpoint_id: str,
        task_id: str,
        task_path: str,
        writes: Sequence[tuple[str, Any]],
    ) -> builtins.list[WriteRecord]:
        """A task's writes on a checkpoint as the store keeps them (special channels at
        their fixed slots), each value encoded."""
        ids = {"run_id": thread, "checkpoint_id": checkpoint_id}
        return [
            WriteRecord(
                run_id=thread,
                checkpoint_id=checkpoint_id,
                task_id=task_id,
                idx=WRITES_IDX_MAP.get(channel, idx),
                channel=channel,
                value=self._dump(value, channel, **ids),
                ns=ns,
                task_path=task_path,
            )
            for idx, (channel, value) in enumerate(writes)
        ]

    def _hold_edit_writes(
        self,
        superstep: FrameType | None,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str,
    ) -> bool:
        """Hold, for the commit that follows, the writes an `update_state` stores on the
        checkpoint it continues (LangGraph stores them first, for its `DeltaChannel`
        keys, then commits the edit's checkpoint): stored at once, a refused edit (an
        invalid value, a run in flight, a lost race) would leave them there, where
        they finish the task they name and every later read applies them. Checked
        and encoded now; False if there is no such edit (`superstep`: its frame that
        commits next, `_edit_superstep`)."""
        thread = _thread(config)
        if superstep is None or self._runs.active(thread) is not None:
            return False  # (an edit of a run's own thread from its node is the run's write)
        ns, checkpoint_id = _ns(config), _conf(config)["checkpoint_id"]
        if _later_superstep(superstep):
            self._still_head(thread, ns, checkpoint_id, config)
        # (The commit checks the values the writes make, as of the graph that edits.)
        records = self._write_records(thread, ns, checkpoint_id, task_id, task_path, writes)
        at = (thread, ns, checkpoint_id)
        with self._held_lock:
            held = self._held.pop(id(superstep), None)
            if held is not None and (held.frame is not superstep or held.at != at):
                held = None
            while len(self._held) >= _HELD_KEPT:  # (edits that failed before their commit)
                del self._held[next(iter(self._held))]
            self._held[id(superstep)] = _Held(
                superstep, at, [*(() if held is None else held.writes), *records]
            )
        return True

    def _take_edit_writes(
        self, caller: FrameType | None, config: RunnableConfig
    ) -> builtins.list[WriteRecord]:
        """The writes held for the commit `caller` (an `update_state` superstep) makes
        after `config`'s checkpoint (`_hold_edit_writes`); none for any other put."""
        if caller is None or not self._held:
            return []
        with self._held_lock:
            held = self._held.pop(id(caller), None)
        at = (_thread(config), _ns(config), _conf(config).get("checkpoint_id"))
        if held is None or held.frame is not caller or held.at != at:
            return []
        return held.writes

    def _still_head(self, thread: str, ns: str, checkpoint_id: str, config: RunnableConfig) -> None:
        """Raise `HeadMoved` unless `checkpoint_id` is the head of its branch."""
        record = self.remit.checkpoint(thread, checkpoint_id, ns=ns)
        head = None if record is None else self.remit.head(thread, ns=ns, branch=record.branch)
        if head is None or head.checkpoint_id != checkpoint_id:
            raise _head_moved(config, later=True)

    # -- whole threads ------------------------------------------------------------
    def delete_thread(self, thread_id: str) -> None:
        """Delete every record of a thread (checkpoints, writes, interrupts, effects).

        The thread id may be used again: the runs of its next life key their effects
        apart from this one's (its ledger is gone, and a target that dedupes by
        idempotency key would take a new call for an old one and drop it). The mark
        of the new life is stored first: a delete that fails midway leaves no life
        of the thread whose keys another had.
        """
        thread = rec.thread_id(thread_id)
        mark = WriteRecord(rec.THREAD_LIVES, thread, str(uuid6()), 0, "life", b"")
        self.remit.put_writes([mark], mode="first")
        self.remit.delete_run(thread)
        self._blobs.drop(thread)

    def delete_for_runs(self, run_ids: Sequence[str]) -> None:
        """Delete the checkpoints (and their writes) that LangGraph runs `run_ids` wrote.

        The threads a run wrote to come from the saver's run index (see `_index_runs`);
        a deleted branch head moves back to the newest checkpoint that remains.
        """
        if isinstance(run_ids, str):
            # (Taken as a collection, its characters would be the run ids: a rollback
            # that deletes nothing it was meant to, silently.)
            raise TypeError("run_ids must be a collection of LangGraph run ids, not one str")
        for lg_run in {str(r) for r in run_ids}:
            threads = {w.task_id for w in self.remit.writes(rec.RUN_INDEX, lg_run)}
            for thread in threads:
                doomed = self._written_by(thread, lg_run)
                if self._stop_runs_on(thread, lg_run, doomed):
                    # A commit of a stopped run may have landed before it stopped.
                    doomed = self._written_by(thread, lg_run)
                for ns, checkpoint_ids in doomed.items():
                    self.remit.delete_checkpoints(thread, ns, checkpoint_ids)
            self.remit.delete_checkpoints(rec.RUN_INDEX, "", [lg_run])

    def _written_by(self, thread: str, lg_run: str) -> dict[str, builtins.list[str]]:
        """The checkpoints of `thread` that LangGraph run `lg_run` wrote, by namespace."""
        doomed: dict[str, builtins.list[str]] = {}
        for r in self.remit.history(thread, verify=False):
            if r.metadata.get("run_id") == lg_run:
                doomed.setdefault(r.ns, []).append(r.checkpoint_id)
        return doomed

    def _written_by_run(self, thread: str, checkpoint_id: str, lg_run: str) -> bool:
        """Whether LangGraph run `lg_run` wrote checkpoint `checkpoint_id` of `thread`: a
        head that moved on after the run's checkpoints were listed (a commit of the run
        landing meanwhile, as in "async" durability) is still the run's."""
        record = self.remit.store.get_checkpoint(thread, "", checkpoint_id)
        return record is not None and record.metadata.get("run_id") == lg_run

    def _stop_runs_on(
        self, thread: str, lg_run: str, doomed: Mapping[str, builtins.list[str]]
    ) -> bool:
        """Stop the runs in flight that go on from a branch head about to be deleted
        (`lg_run` itself, or one started from its head): their claims are given up
        under them, so each later write of theirs, from any process, is `Fenced` and
        nothing more of them is stored after the delete. (Left running, the next
        write was refused as a fork, and a task's writes were stored on a deleted
        checkpoint.) Returns whether any was stopped."""
        heads = set(doomed.get("", ()))
        stopped = False
        for branch in self.remit.branches(thread, ns=""):
            if branch.head_id is None or not (
                branch.head_id in heads or self._written_by_run(thread, branch.head_id, lg_run)
            ):
                continue
            refusal = Fenced(
                f"delete_for_runs deleted the checkpoints of LangGraph run {lg_run!r} "
                f"while this run went on from them (branch {branch.branch!r}); it stops "
                "here, and nothing more of it was stored",
                run_id=thread,
                checkpoint_id=branch.head_id,
            )
            for run in self._runs.open_on(thread, branch.branch):
                run.fail(refusal)
            held = self.remit.store.get_claim(thread, branch.branch)
            if held is not None and held.holder:
                self.remit.store.release_claim(held)
                stopped = True
        return stopped

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        """Copy a thread's checkpoints, branches, channel values and writes to a new thread id.

        The target must be a thread id never used: a copy into a thread with records
        would mix two threads' lines, and one that `delete_thread` emptied had effects
        whose keys the copy would hand out again (its keys are its source's, under
        the target's id), which a target that dedupes by key answers with the old call.
        """
        source = rec.thread_id(source_thread_id, "source_thread_id")
        target = rec.thread_id(target_thread_id, "target_thread_id")
        # The target's claim is held from the check to the end of the copy: two copies
        # into one new id at once would both find it unused and both copy, mixing two
        # threads' lines and ledgers in it (and a run started on it meanwhile would
        # write among the copied records).
        try:
            guard = self.remit.claim(target, MAIN_BRANCH, lease=self.lease)
        except ResumeConflict as held:
            raise RemitError(
                f"copy_thread's target_thread_id {target!r} is in use (another copy_thread "
                "into it, or a run on it, is in flight); nothing was copied: copy to a "
                "thread id never used",
                run_id=target,
            ) from held
        with guard:
            self._copy_into_unused(source, target)

    def _copy_into_unused(self, source: str, target: str) -> None:
        """`copy_thread`'s work, under the target's claim.

        The copy's effects are keyed as in its source's life (the ledger it copies),
        so the source's life marks are copied first: a copy that dies midway has
        either no record but those marks (a copy again completes it) or its records
        keyed as the ledger they came with, never records whose keys miss it. The
        records themselves are copied in one transaction."""
        lives = [
            dataclasses.replace(w, checkpoint_id=target)
            for w in self.remit.writes(rec.THREAD_LIVES, source)
        ]
        marks = {(w.task_id, w.idx) for w in self.remit.writes(rec.THREAD_LIVES, target)}
        used = (
            self.remit.history(target, limit=1, verify=False)
            or self.remit.branches(target)
            or self.remit.interrupts(target)
            or (marks and marks != {(w.task_id, w.idx) for w in lives})
        )
        if used:
            raise RemitError(
                f"copy_thread's target_thread_id {target!r} was used before (it has records, "
                "or delete_thread ended a life of it, whose effect keys a copy would hand "
                "out again); nothing was copied: copy to a thread id never used",
                run_id=target,
            )
        if lives and not marks:
            self.remit.put_writes(lives, mode="first")
        # The run index names the target before its records land (and again after, for
        # runs the source committed meanwhile): a copy that dies after its records
        # leaves none that `delete_for_runs` cannot find.
        self._index_runs(target, self.remit.history(source, verify=False))
        self.remit.copy_run(source, target)
        self._index_runs(target, self.remit.history(target, verify=False))

    def _index_runs(self, thread: str, records: Iterable[CheckpointRecord]) -> None:
        """Note that the LangGraph runs that wrote `records` write to `thread` (each
        once per process), in one write.

        `delete_for_runs` names runs, not threads; this index (a Remit run of its
        own whose step writes map run -> thread) finds them without scanning the
        store. A put stores its entry with its checkpoint, in one commit.
        """
        entries = {
            (entry.checkpoint_id, entry.task_id): entry
            for r in records
            if (entry := self._run_index_entry(thread, r.metadata.get("run_id"))) is not None
        }
        if entries:
            self.remit.put_writes(list(entries.values()), mode="first")
            for lg_run, _ in entries:
                self._indexed_now(thread, lg_run)

    def _run_index_entry(self, thread: str, lg_run: Any) -> WriteRecord | None:
        """The index entry of (`thread`, `lg_run`), unless this process stored it already."""
        if not lg_run or (thread, lg_run) in self._indexed:
            return None
        return WriteRecord(rec.RUN_INDEX, str(lg_run), thread, 0, "thread", b"")

    def _indexed_now(self, thread: str, lg_run: Any) -> None:
        if len(self._indexed) > 10_000:
            self._indexed.clear()
        self._indexed.add((thread, lg_run))

    def prune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        """`keep_latest`: keep each branch's head (and fork bases); `delete`: drop the threads.

        Every thread id is checked before any thread is touched: one str (whose
        characters would be taken for thread ids), or a bad id among them, prunes
        nothing."""
        if isinstance(thread_ids, str):
            raise TypeError("thread_ids must be a collection of thread ids, not one str")
        if strategy not in ("keep_latest", "delete"):
            raise ValueError(f"unknown prune strategy {strategy!r}: use 'keep_latest' or 'delete'")
        for thread in [rec.thread_id(t) for t in thread_ids]:
            if strategy == "delete":
                self.delete_thread(thread)
            else:
                self._keep_latest(thread)

    def _keep_latest(self, thread: str) -> None:
        """Delete a thread's old checkpoints (and their writes): each branch's head and
        each fork base stays, in every namespace, with the ancestors a `DeltaChannel`
        value at a kept checkpoint is rebuilt from (back to its nearest snapshot:
        LangGraph replays their writes on read, and without them the key would read
        as empty, a wrong state). The core's `prune`, with those ancestors kept."""
        records = self.remit.history(thread, verify=False)
        for ns in sorted({r.ns for r in records}):
            in_ns = [r for r in records if r.ns == ns]
            branches = self.remit.branches(thread, ns=ns)
            in_ns += self._committed_since(thread, ns, in_ns, branches)
            doomed = set(policy.prunable(in_ns, branches, keep_last=1))
            if doomed:
                doomed -= self._edited_pauses(in_ns, branches)
            deltas = {
                ch for r in in_ns for ch in r.metadata.get("counters_since_delta_snapshot") or ()
            }
            if deltas and doomed:
                doomed -= self._delta_sources(in_ns, doomed, deltas)
            if doomed:
                self.remit.store.delete_checkpoints(thread, ns, sorted(doomed))

    def _committed_since(
        self,
        thread: str,
        ns: str,
        records: builtins.list[CheckpointRecord],
        branches: Sequence[BranchRecord],
    ) -> builtins.list[CheckpointRecord]:
        """The checkpoints a run on the thread committed after `records` were listed
        and before `branches` were (each branch's line from its head back to a listed
        one). Without them a head the list lacks keeps nothing under it: its parent,
        the head when listed, was deleted, and with it the writes a `DeltaChannel`
        key is rebuilt from (the key then read as empty, or short, a wrong state)."""
        known = {r.checkpoint_id for r in records}
        extra: builtins.list[CheckpointRecord] = []
        for branch in branches:
            cursor = branch.head_id
            while cursor is not None and cursor not in known:
                record = self.remit.store.get_checkpoint(thread, ns, cursor)
                if record is None:
                    break
                known.add(cursor)
                extra.append(record)
                cursor = record.parent_id
        return extra

    def _edited_pauses(
        self, records: builtins.list[CheckpointRecord], branches: Sequence[BranchRecord]
    ) -> set[str]:
        """The checkpoints under each branch head made by `update_state` back to the
        pause it edited (its nearest ancestor that is no edit, if its tasks asked there): a
        resume of the edited pause reads its questions, and which of them an edit of
        a subgraph replaced, from that checkpoint's writes (`Runs._pause`)."""
        by_id = {r.checkpoint_id: r for r in records}
        kept: set[str] = set()
        for branch in branches:
            at = None if branch.head_id is None else by_id.get(branch.head_id)
            chain: builtins.list[str] = []
            while at is not None and at.metadata.get("source") == "update" and at.parent_id:
                at = by_id.get(at.parent_id)
                if at is not None:
                    chain.append(at.checkpoint_id)
            if at is not None and chain and self._asks(at):
                kept.update(chain)
        return kept

    def _asks(self, record: CheckpointRecord) -> bool:
        """Whether the tasks of a checkpoint raised an interrupt there."""
        writes = self.remit.writes(record.run_id, record.checkpoint_id, ns=record.ns)
        return any(w.channel == INTERRUPT for w in writes)

    def _delta_sources(
        self, records: builtins.list[CheckpointRecord], doomed: set[str], deltas: set[str]
    ) -> set[str]:
        """The ancestors of the checkpoints kept (`records` not in `doomed`) that their
        `deltas` keys are rebuilt from: each back to the nearest one holding the key's
        value (a snapshot), as LangGraph's `get_delta_channel_history` walks them."""
        by_id = {r.checkpoint_id: r for r in records}
        held: dict[str, tuple[set[str], set[str]]] = {}

        def channels(record: CheckpointRecord) -> tuple[set[str], set[str]]:
            """(its channels with a version, those with a value stored) of a checkpoint."""
            if record.checkpoint_id not in held:
                opened = self.remit.checkpoint(record.run_id, record.checkpoint_id, ns=record.ns)
                checkpoint = None if opened is None else self._tuple(opened).checkpoint
                held[record.checkpoint_id] = (
                    (set(), set())
                    if checkpoint is None
                    else (set(checkpoint["channel_versions"]), set(checkpoint["channel_values"]))
                )
            return held[record.checkpoint_id]

        needed: set[str] = set()
        for record in records:
            if record.checkpoint_id in doomed:
                continue
            versioned, valued = channels(record)
            missing = (deltas & versioned) - valued
            at = record
            while missing and at.parent_id is not None and at.parent_id in by_id:
                at = by_id[at.parent_id]
                needed.add(at.checkpoint_id)
                missing -= channels(at)[1]
        return needed

    def get_next_version(self, current: str | None, channel: None = None) -> str:
        """`<counter>.<random>`: monotonic per channel, unique across branches (and values).

        LangGraph calls it between steps of a run (often: once per channel
        written): a run whose writes were refused, or whose claim was taken over,
        stops here instead of running on.
        """
        run = current_run()
        if run is not None and (run.failed is not None or run.lapsed()):
            self._runs.asking(run, sys._getframe(1)).ensure_live()  # (raises for `run`)
        if current is None:
            n = 1
        elif isinstance(current, str):
            n = int(current.split(".", 1)[0]) + 1
        else:
            n = int(current) + 1
        # 64 random bits as hex: formatting a float costs twice as much, and LangGraph
        # asks once per channel written.
        return f"{n:032}.{random.getrandbits(64):016x}"

    def with_allowlist(self, extra_allowlist: Any) -> RemitSaver:
        """A shallow clone whose serializer also allows `extra_allowlist`."""
        serde = self.serde.with_allowlist(extra_allowlist)
        if serde is self.serde:
            return self
        clone = copy.copy(self)
        clone.serde = serde
        clone._runs = self._runs.serving(clone)
        return clone

    # -- async twins: the same code in a worker thread --------------------------------
    async def aget_tuple(self, config: RunnableConfig) -> CheckpointTuple | None:
        frame = sys._getframe(1)
        call = self._runs.calling_loop(frame)
        if call is None:
            caller = above_saver(frame)
            if caller is not None and caller.f_code.co_name in _STATE_READS:
                await asyncio.to_thread(self._branch_named, _conf(config))
            found = await asyncio.to_thread(self._read_for, config, _snapshot_parent(caller))
            _note_read(caller, config, found)
            return found
        start = _Start(self._runs)
        try:
            run, found = await asyncio.to_thread(start, call, config)
        except asyncio.CancelledError:
            # The thread takes the claim all the same: it gives it back, or, if it has
            # already finished, this does (off the event loop).
            taken = start.abandon()
            if taken is not None:
                with contextlib.suppress(Exception):  # (if it fails, the lease runs out: L1)
                    await asyncio.to_thread(taken.claim.release)
            raise
        if run is not None:
            self._runs.attach(call.loop, run)
        return found

    async def alist(
        self,
        config: RunnableConfig | None,
        *,
        filter: dict[str, Any] | None = None,
        before: RunnableConfig | None = None,
        limit: int | None = None,
    ) -> AsyncIterator[CheckpointTuple]:
        if before is not None and _ns(config) and current_run() is not None:
            self._runs.replaying(sys._getframe(1))  # (a subgraph's restore on a fork)
        items = await asyncio.to_thread(
            lambda: list(self.list(config, filter=filter, before=before, limit=limit))
        )
        for item in items:
            yield item

    async def aput(
        self,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        frame = above_saver(sys._getframe(1))
        if _edit_step(frame):
            with beside_run(_thread(config)):
                return await self._aput_at(frame, config, checkpoint, metadata, new_versions)
        return await self._aput_at(frame, config, checkpoint, metadata, new_versions)

    async def _aput_at(
        self,
        frame: FrameType | None,
        config: RunnableConfig,
        checkpoint: Checkpoint,
        metadata: CheckpointMetadata,
        new_versions: ChannelVersions,
    ) -> RunnableConfig:
        """`aput`, called from `frame`."""
        run = self._runs.active(_thread(config))
        if run is None and (run := self._runs.of_loop(frame, _thread(config))) is not None:
            with as_run(run):  # (a run read in turn with another: `Runs.of_loop`)
                return await self._aput_at(frame, config, checkpoint, metadata, new_versions)
        by_graph, caller = (False, None) if run is not None else self._runs.learn(frame)
        last = run is not None and run.is_last_put(frame, metadata, _ns(config))
        held = self._take_edit_writes(frame, config) if run is None else ()
        if run is None:
            copied = await asyncio.to_thread(self._copy_target, frame, config)
            if copied is not None and copied.get("done"):
                return copied["done"]  # type: ignore[no-any-return]
            config = config if copied is None else copied["config"]
        try:
            return await asyncio.to_thread(
                self._put, config, checkpoint, metadata, new_versions, caller, last, by_graph, held
            )
        except ForkWithoutIntent as exc:
            if _read_as_head(frame, config) or _later_superstep(frame):
                raise _head_moved(config, later=_later_superstep(frame)) from exc
            raise

    async def aput_writes(
        self,
        config: RunnableConfig,
        writes: Sequence[tuple[str, Any]],
        task_id: str,
        task_path: str = "",
    ) -> None:
        thread, superstep = _thread(config), None
        if self._runs.active(thread) is not None:
            if _edit_step(sys._getframe(1)):
                with beside_run(thread):
                    return await self.aput_writes(config, writes, task_id, task_path)
        else:
            superstep = _edit_superstep(above_saver(sys._getframe(1)))
        if superstep is not None:
            held = await asyncio.to_thread(
                self._hold_edit_writes, superstep, config, writes, task_id, task_path
            )
            if held:
                return
        await asyncio.to_thread(self.put_writes, config, writes, task_id, task_path)

    async def adelete_thread(self, thread_id: str) -> None:
        await asyncio.to_thread(self.delete_thread, thread_id)

    async def adelete_for_runs(self, run_ids: Sequence[str]) -> None:
        await asyncio.to_thread(self.delete_for_runs, run_ids)

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        await asyncio.to_thread(self.copy_thread, source_thread_id, target_thread_id)

    async def aprune(self, thread_ids: Sequence[str], *, strategy: str = "keep_latest") -> None:
        await asyncio.to_thread(self.prune, thread_ids, strategy=strategy)


#: The head a saver call read last in this context, by the frame that called it:
#: (id of that frame, thread, namespace, checkpoint id), or None if its config
#: named a checkpoint. `update_state` reads the head, then commits after it.
_head_read: contextvars.ContextVar[tuple[int, str, str, str] | None] = contextvars.ContextVar(
    "remit_langgraph_head_read", default=None
)


def _note_read(
    caller: FrameType | None, config: RunnableConfig, found: CheckpointTuple | None
) -> None:
    """Remember what `caller` read: a head, if its config named no checkpoint."""
    read = None
    if found is not None and caller is not None and not _conf(config).get("checkpoint_id"):
        at = found.config["configurable"]
        read = (id(caller), at["thread_id"], at["checkpoint_ns"], at["checkpoint_id"])
    _head_read.set(read)


def _read_as_head(caller: FrameType | None, config: RunnableConfig) -> bool:
    """Whether the checkpoint a put continues is the head its caller read just
    before, by a config that named no checkpoint (`update_state(config, ...)`):
    a commit after it refused as a fork lost a race with another write."""
    conf = _conf(config)
    read = _head_read.get()
    return (
        read is not None
        and caller is not None
        and read == (id(caller), _thread(config), _ns(config), conf.get("checkpoint_id"))
    )


def _head_moved(config: RunnableConfig, *, later: bool = False) -> HeadMoved:
    if later:
        what = (
            "another write moved the thread's head between the supersteps of this "
            "bulk_update_state (a concurrent update_state or run): the supersteps before "
            "this one were stored, this one and those after it were not; read the state "
            "again and apply the rest"
        )
    else:
        what = (
            "another write moved the thread's head after this update read it (a concurrent "
            "update_state or run); the update was not stored: read the state again and retry"
        )
    return HeadMoved(what, run_id=_thread(config), checkpoint_id=_conf(config).get("checkpoint_id"))


#: The graph methods whose saver reads are a user's state reads.
_STATE_READS = ("get_state", "aget_state")


class _Held(NamedTuple):
    """An edit's writes held for its commit (`RemitSaver._hold_edit_writes`)."""

    frame: FrameType
    at: tuple[str, str, str]
    writes: builtins.list[WriteRecord]


#: How many edits' held writes are kept at most (only edits that fail between
#: storing their writes and their commit leave theirs).
_HELD_KEPT = 64

#: The frames of `bulk_update_state` that store an edit's writes before its commit.
_EDIT_WRITE_FRAMES = ("_store_or_fork_delta_writes", "_astore_or_fork_delta_writes")

#: The frames of `bulk_update_state` (and `update_state`) that call the saver.
_SUPERSTEP_FRAMES = (
    "perform_superstep",
    "aperform_superstep",
    "_store_or_fork_delta_writes",
    "_astore_or_fork_delta_writes",
)


def _edit_step(caller: FrameType | None) -> bool:
    """Whether `caller` (a saver call's caller) is LangGraph's `update_state` (or
    `bulk_update_state`) storing an edit."""
    return caller is not None and caller.f_code.co_name in _SUPERSTEP_FRAMES


def _edit_superstep(caller: FrameType | None) -> FrameType | None:
    """The superstep frame of `bulk_update_state` that commits next, if `caller` (a
    saver call's caller) stores that edit's writes before its commit."""
    if caller is None or caller.f_code.co_name not in _EDIT_WRITE_FRAMES:
        return None
    return caller.f_back


def _later_superstep(caller: FrameType | None) -> bool:
    """Whether `caller` (a saver call's caller) is a superstep of `bulk_update_state`
    after its first: it continues the checkpoint the one before it committed, the
    head then, so a commit after it refused as a fork lost a race with another write."""
    return (
        caller is not None
        and caller.f_code.co_name in _SUPERSTEP_FRAMES
        and caller.f_locals.get("is_first") is False
    )


def _snapshot_parent(caller: FrameType | None) -> CheckpointTuple | None:
    """The checkpoint a parent graph's state snapshot is built from, if `caller`
    (a saver call's caller) is a subgraph's state read for that snapshot
    (`get_state(config, subgraphs=True)`)."""
    if caller is None or caller.f_code.co_name not in ("get_state", "aget_state"):
        return None
    parent = caller.f_back
    if parent is None or parent.f_code.co_name not in (
        "_prepare_state_snapshot",
        "_aprepare_state_snapshot",
    ):
        return None
    saved = parent.f_locals.get("saved")
    return saved if isinstance(saved, CheckpointTuple) else None


class _Start:
    """A run start (`Runs.start`) in a worker thread, for an `aget_tuple` that may be
    cancelled while it runs: the thread takes the claim all the same, and whichever
    side learns last that nobody will run it gives it back. Neither side relies on an
    asyncio task or callback, which a closing event loop cancels or never runs (an
    `asyncio.run` whose main task timed out): the claim would stay held to its lease."""

    def __init__(self, runs: Runs) -> None:
        self._runs = runs
        self._lock = threading.Lock()
        self._abandoned = False
        self._taken: Run | None = None

    def __call__(
        self, call: LoopCall, config: RunnableConfig
    ) -> tuple[Run | None, CheckpointTuple | None]:
        run, found = self._runs.start(call, config)
        with self._lock:
            if not self._abandoned:
                self._taken = run
                return run, found
        if run is not None:  # (its caller was cancelled while it ran)
            with contextlib.suppress(Exception):  # (if it fails, the lease runs out: L1)
                run.claim.release()
        return run, found

    def abandon(self) -> Run | None:
        """Mark the start as unwanted; returns its run if the thread had already
        finished it (the caller must then give its claim back), else None."""
        with self._lock:
            self._abandoned = True
            taken, self._taken = self._taken, None
        return taken


def _writing(run: Run | None) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext() if run is None else run.writing()


class _Opened:
    """What `from_conn_string` returns: a sync and async context manager for one saver.
    Leaving it closes the saver's `Remit` (`Remit.close`): claims still held are given
    up, and a later use raises `StoreUnavailable` naming the store, as LangGraph's own
    savers fail once their connection is closed."""

    def __init__(self, saver: RemitSaver) -> None:
        self.saver = saver

    def __enter__(self) -> RemitSaver:
        return self.saver

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.saver.remit.close()

    async def __aenter__(self) -> RemitSaver:
        return self.saver

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.saver.remit.close)
