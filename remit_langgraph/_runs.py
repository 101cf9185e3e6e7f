"""Where RemitSaver meets LangGraph's run loop: claims, resume values, forks, schemas, effects.

LangGraph's checkpointer interface has no event for "a run starts with this
input" or "the run has ended", and a resume value reaches the saver only as a
background write that races the node reading it. What it does have: the run
loop calls `get_tuple` from its `__enter__`, before any node runs, and the
graph that runs is the frame above. At that call the saver (`Runs.start`):

- takes the thread's claim (leased, heartbeat; `ResumeConflict` if another
  resumer holds it) and releases it on the loop's exit stack, after the loop's
  last background write;
- refuses a continuation from a non-head checkpoint without a fork token
  (`ForkWithoutIntent`), and turns a fork token seen before into its branch;
- consumes the interrupt(s) a `Command(resume=...)` answers, after checking
  the value against the interrupt's `response_schema`: the value is durable
  before any node runs, with the writes LangGraph makes of the command's
  `update` and `goto` (in the consume's transaction), and a consumed
  interrupt refuses a second value;
- re-delivers values consumed by a resumer that died before its node finished;
- learns the graph's state schema (P4) and the types its serializer may store.

The run then lives in a context variable, which LangGraph copies into every
background write and every node: writes carry the claim's fence (L2), a
node's output is checked against the schema as the node returns it, and
`remit_core.effect` finds its step scope (P2) through `effect_scope`. A graph
not run by a LangGraph loop (a direct saver call, `update_state`) gets plain
storage with schema checks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import copy
import dataclasses
import datetime
import functools
import threading
import typing
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple, get_args, get_origin

from langchain_core.runnables import RunnableConfig
from langgraph._internal._constants import (
    CONF,
    CONFIG_KEY_CHECKPOINTER,
    CONFIG_KEY_RESUME_MAP,
    CONFIG_KEY_RUNTIME,
    CONFIG_KEY_SEND,
    ERROR,
    NS_END,
    NULL_TASK_ID,
    TASKS,
)
from langgraph._internal._serde import build_serde_allowlist
from langgraph._internal._typing import MISSING
from langgraph.channels.base import BaseChannel
from langgraph.channels.untracked_value import UntrackedValue
from langgraph.checkpoint.base import (
    WRITES_IDX_MAP,
    BaseCheckpointSaver,
    CheckpointTuple,
    get_serializable_checkpoint_metadata,
)
from langgraph.checkpoint.base.id import uuid6
from langgraph.checkpoint.serde.types import INTERRUPT, RESUME
from langgraph.config import get_config
from langgraph.errors import EmptyInputError, InvalidUpdateError, is_invalid_resume
from langgraph.func import entrypoint
from langgraph.pregel import Pregel
from langgraph.pregel._algo import sanitize_untracked_values_in_send
from langgraph.pregel._io import map_command
from langgraph.pregel._loop import AsyncPregelLoop, PregelLoop, SyncPregelLoop
from langgraph.types import Command, Interrupt, Send
from pydantic_core import PydanticSerializationError, to_jsonable_python

from remit_core import Remit, codec, policy
from remit_core.core import ClaimHandle
from remit_core.effects import SharedScope, StepScope, register_scope_resolver
from remit_core.errors import (
    CheckpointInvalid,
    Fenced,
    ForkWithoutIntent,
    RemitError,
    ResumeConflict,
    StoreUnavailable,
    UnknownRecord,
)
from remit_core.records import (
    MAIN_BRANCH,
    BranchRecord,
    CheckpointRecord,
    FenceRef,
    InterruptRecord,
    WriteRecord,
)
from remit_core.schema import StateSchema
from remit_core.stores.base import display_url
from remit_langgraph._records import THREAD_LIVES, checked_conf, restamped, thread_id
from remit_langgraph._schema import DeltaChannel, StateCheck, plain_record_types
from remit_langgraph._serde import StrictSerializer
from remit_langgraph._shared_effects import CALLS, Made, TaskCalls

if TYPE_CHECKING:
    from langgraph.types import PregelExecutableTask

    from remit_langgraph.saver import RemitSaver

#: How many frames above a saver call are searched for the graph that made it.
_GRAPH_FRAME_DEPTH = 4
#: How many graphs' checks are remembered by their channels (then forgotten at once).
_GRAPHS_KEPT = 256
#: How many checkpoints a read of those newer than a head takes at a time.
_PAGE = 16


def above_saver(frame: FrameType | None) -> FrameType | None:
    """The first frame at or above `frame` that is not a checkpoint saver's method:
    a subclass's override that calls `super()` is looked through."""
    while frame is not None and isinstance(frame.f_locals.get("self"), BaseCheckpointSaver):
        frame = frame.f_back
    return frame


def _graph_at(frame: FrameType | None) -> Pregel[Any, Any, Any, Any] | None:
    """The graph whose method is `frame` or one of the few frames above it."""
    for _ in range(_GRAPH_FRAME_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Pregel):
            return candidate
        frame = frame.f_back
    return None


@dataclass
class Run:
    """One LangGraph run (`invoke`/`stream`) on one thread, as this process drives it."""

    remit: Remit
    thread: str
    branch: str
    claim: ClaimHandle
    check: StateCheck | None
    committed: set[str] = field(default_factory=set)
    failed: RemitError | None = None
    #: The node outputs refused by the state schema, by task id (`_check_send`): the
    #: run then stores nothing more, unless a retry of the task gets its output taken.
    refused: dict[str, RemitError] = field(default_factory=dict)
    #: The tasks whose outputs are checked as their node hands them over: their
    #: writes, when stored, need no second check.
    sends_checked: set[str] = field(default_factory=set)
    #: A recovery gives consumed values back by interrupt id (`Runs._redeliver`).
    resume_spent: bool = False
    inflight: int = 0
    _settled: threading.Condition = field(default_factory=threading.Condition)
    #: The run loop (weakly: the loop's exit stack holds this run).
    loop: weakref.ref[PregelLoop] | None = None
    #: The loops of its subgraphs, by their namespace (see `task_identity`).
    nested: dict[str, weakref.ref[PregelLoop]] = field(default_factory=dict)
    #: The state checks of its subgraphs, by their namespace: a subgraph's
    #: checkpoints and node writes hold to the subgraph's own schema (P4).
    checks: dict[str, StateCheck | None] = field(default_factory=dict)
    #: The effect calls of its top-level tasks, by task id (`_shared_effects`).
    calls: dict[str, TaskCalls] = field(default_factory=dict)
    #: The calls earlier branches made for the tasks of its first step, by "step/place".
    shared: dict[str, Made] = field(default_factory=dict)
    #: The checkpoint it started at if a task had paused there: a functional-API
    #: task first run there now runs after the pause was answered (`effect_scope`).
    past_pause: str | None = None
    #: The thread's life (see `life`), read at the first effect.
    _life: str | None = None
    #: The effect scope of each task attempt that called an effect, by the attempt's
    #: execution info and the scope's step key: see `_attempt_scope`.
    attempts: collections.OrderedDict[tuple[Any, str], StepScope] = field(
        default_factory=collections.OrderedDict
    )
    _attempts_lock: threading.Lock = field(default_factory=threading.Lock)

    def is_last_put(self, frame: FrameType | None, metadata: Any, ns: str) -> bool:
        """Whether a put called from `frame` is the last write of this run: the
        exit-mode save of a finished run, which LangGraph makes with the loop's
        own metadata and follows with no write (no pending writes are left).
        Its commit may then give the claim up, saving the release's round trip."""
        loop = None if self.loop is None else self.loop()
        return (
            ns == ""
            and loop is not None
            and frame is not None
            and frame.f_locals.get("self") is loop
            and getattr(loop, "durability", None) == "exit"
            and getattr(loop, "status", None) == "done"
            and metadata is getattr(loop, "checkpoint_metadata", None)
            and getattr(loop, "checkpoint_pending_writes", None) == []
        )

    def task_identity(self, parent_ns: str, part: str) -> str:
        """A namespace part `name:task_id` as the task's place in its run: the name,
        step and path of the task of the loop at `parent_ns`. A task id comes from its
        checkpoint's id, and in "exit" durability a replay makes new checkpoint ids;
        the step and path are the same on every replay. `part` itself if unknown."""
        ref = self.loop if parent_ns == "" else self.nested.get(parent_ns)
        loop = None if ref is None else ref()
        name, _, task_id = part.partition(":")
        task = None if loop is None else loop.tasks.get(task_id)
        if task is None:
            return part
        meta = task.config.get("metadata") or {}
        return f"{name}@{meta.get('langgraph_step')}@{meta.get('langgraph_path')}"

    def life(self) -> str:
        """The part of its effects' keys that tells this life of the thread from the
        ones `delete_thread` ended: "" if it was never deleted (the keys are as they
        always were), else the newest deletion's mark. The same on every replay,
        recovery and takeover; a thread id used again gets keys no earlier life had."""
        if self._life is None:
            lives = self.remit.writes(THREAD_LIVES, self.thread)
            self._life = max((f"~{w.task_id}" for w in lives), default="")
        return self._life

    @property
    def fence(self) -> FenceRef:
        return self.claim.fence

    def writing(self) -> _Writing:
        return _Writing(self)

    def fail(self, error: RemitError) -> RemitError:
        """Remember the first refusal: the run's later writes are refused with it."""
        if self.failed is None:
            self.failed = error
        return error

    def unrefused(
        self, writes: Sequence[tuple[str, Any]], ns: str, task_id: str = ""
    ) -> list[tuple[str, Any]]:
        """`writes` without the error record of an output this run refused: LangGraph
        records a failed node's error, and this one would be the trace of a write
        that was never stored (the node runs again when the run is continued).

        Except for a top-level task (namespace `ns` "") that was answered before it
        returned the refused output: the answer led to it, so the task's answers (its
        resume write) are not stored, and its error is, which opens its question again
        (`Runs.after_failed`): the resumer was told the value was refused, and the next
        answer is taken (P4, P5). So too for a top-level task that failed with the
        refusal of a task of its subgraph (`task_id` is not the refused task's): the
        subgraph's node took the answer its parent task asked for."""
        refused = [id(e) for e in self.refused.values()]
        if not any(ch == ERROR and id(v) in refused for ch, v in writes):
            return list(writes)
        answered = any(ch == RESUME for ch, _ in writes)
        if ns == "" and (answered or (task_id != "" and task_id not in self.refused)):
            return [(ch, v) for ch, v in writes if ch != RESUME]
        # (A subgraph's node whose output was refused after an answer keeps the answers
        # it had before: the refused one is asked again through its parent task.)
        return [
            (ch, v)
            for ch, v in writes
            if not (ch == ERROR and id(v) in refused) and not (answered and ch == RESUME)
        ]

    def drives(self, loop: PregelLoop) -> bool:
        """Whether `loop` is this run's loop, or the loop of one of its subgraphs."""
        return (self.loop is not None and self.loop() is loop) or any(
            ref() is loop for ref in list(self.nested.values())
        )

    def settle(self, timeout: float = 5.0) -> None:
        """Wait for this run's writes in flight, then `ensure_live`."""
        with self._settled:
            self._settled.wait_for(lambda: self.inflight == 0, timeout=timeout)
        self.ensure_live()

    def lapsed(self) -> bool:
        """Whether the claim is known lost. Its lease running out unrenewed means this
        process was paused past it (a zombie) or cut off from the store: then the
        store is asked (one read) before anything more runs, since the heartbeat may
        not have beaten since, and a refused write still in flight tells nothing yet
        (L2). A live lease costs a clock read."""
        handle = self.claim
        if handle.lost or handle.given_up or handle.claim.expires_at > self.remit.clock():
            return handle.lost
        held = handle.claim
        if not policy.fence_is_current(
            self.remit.store.get_claim(held.run_id, held.scope), held.fence, held.holder
        ):
            handle.lost = True
        return handle.lost

    def ensure_live(self) -> None:
        """Raise if a write was refused, or the claim was taken over (L2)."""
        if self.failed is None and self.lapsed():
            self.fail(
                Fenced(
                    "another resumer took this run over after its lease ran out; this "
                    "process stops here",
                    run_id=self.thread,
                )
            )
        if self.failed is not None:
            raise self.failed


class _Writing:
    """Counts a write in flight for `Run.settle`; a write refused by the fence fails the run."""

    def __init__(self, run: Run) -> None:
        self.run = run

    def __enter__(self) -> None:
        with self.run._settled:
            self.run.inflight += 1

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        with self.run._settled:
            self.run.inflight -= 1
            self.run._settled.notify_all()
        if isinstance(exc, Fenced):
            # Taken over (L2). LangGraph raises a background write's error only when
            # the run ends: stop at the next step or effect instead of running on.
            # A run stopped with a reason of its own (`delete_for_runs`) says why.
            first = self.run.fail(exc) if self.run.failed is None else self.run.failed
            if first is not exc and isinstance(first, Fenced):
                raise first from exc


class LoopCall(NamedTuple):
    """A call from LangGraph's run loop: the loop, and the state check of its graph."""

    loop: PregelLoop
    check: StateCheck | None


_current: contextvars.ContextVar[Run | None] = contextvars.ContextVar(
    "remit_langgraph_run", default=None
)


def current_run() -> Run | None:
    """The run of this context, unless it has ended. LangGraph's async loop unwinds
    its exit stack in a task of its own, which leaves the caller's context pointing
    at the finished run; a run that gave its claim up owns no later write."""
    run = _current.get()
    return None if run is None or run.claim._released else run  # (`given_up`, inline)


@contextlib.contextmanager
def as_run(run: Run) -> Iterator[None]:
    """`run` is this context's while the block lasts (`Runs.of_loop`)."""
    token = _current.set(run)
    try:
        yield
    finally:
        _current.reset(token)


@contextlib.contextmanager
def beside_run(thread: str) -> Iterator[None]:
    """For a saver call of LangGraph's `update_state` (the caller checks that): if
    it edits `thread` beside the run this context has open on it, not from one of
    the run's nodes, the run is not this context's while the call lasts.

    A `stream` generator runs in its consumer's context, so the code that reads
    the stream sees the run as its own: an edit made there would be stored as
    the run's write, under its claim. Made beside the run, it is an edit of a
    thread in flight, refused (`ResumeConflict`) and stored nowhere (P5)."""
    run = current_run()
    if run is None or run.thread != thread:
        yield
        return
    try:
        node_thread = (get_config().get("configurable") or {}).get("thread_id")
    except RuntimeError:  # (outside any node)
        node_thread = None
    if str(node_thread) == thread:  # (a node's edit of its own thread is its run's write)
        yield
        return
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def _is_resume_map(resume: Any) -> bool:
    return (
        isinstance(resume, dict)
        and bool(resume)
        and all(isinstance(k, str) and len(k) == 32 for k in resume)
        and all(c in "0123456789abcdef" for k in resume for c in k)
    )


def _check_command(command: Command, specs: Mapping[str, Any], thread: str) -> None:
    """Raise, before anything is claimed or stored, what LangGraph raises only as it
    maps a command to writes and applies them, after the run started (its resume
    value consumed, its claim held until the loop is garbage-collected): a resume
    dict with a key that is no str (LangGraph tests each key as an interrupt id,
    until one is a str that is not: `{1: "a"}` raises `TypeError`),
    `graph=Command.PARENT` at the top (`InvalidUpdateError`), a `goto` that is no
    node name or `Send` (`TypeError`), an empty `Command()` (`EmptyInputError`,
    which LangGraph means to raise), and an update its keys' channels refuse
    whatever the state (two values for a plain key: `CheckpointInvalid`; LangGraph
    stores such an update, and every later run of the thread fails applying it)."""
    if isinstance(command.resume, dict):
        for key in command.resume:
            if not isinstance(key, str):
                raise TypeError(
                    "a resume value that is a dict needs str keys: LangGraph tests them "
                    f"as interrupt ids, and {key!r} is a {type(key).__name__}; the value "
                    "was not stored (wrap it, e.g. Command(resume={'value': ...}))"
                )
            if not _is_resume_map({key: None}):
                break  # LangGraph reads the dict as one plain value
    for _ in map_command(command):
        pass
    if command.resume is None and not command.update and not command.goto:
        # (LangGraph means to raise this, and fails with an UnboundLocalError instead.)
        raise EmptyInputError("Received empty Command input")
    grouped: dict[str, list[Any]] = {}
    for key, value in command._update_as_tuples() if command.update else ():
        grouped.setdefault(key, []).append(value)
    for key, values in grouped.items():
        spec = specs.get(key)
        if not isinstance(spec, BaseChannel):
            continue
        try:
            spec.copy().update(values)  # (an empty copy: only what no state changes fails)
        except InvalidUpdateError as exc:
            raise CheckpointInvalid(
                f"the command's update cannot be applied to {key!r} ({exc}); nothing was stored",
                field=key,
                run_id=thread,
            ) from exc
        except Exception:  # noqa: BLE001, S112 (a reducer that needs the real state: checked later)
            continue


def _channels_at(
    specs: Mapping[str, Any],
    values: Mapping[str, Any],
    earlier: Sequence[tuple[str, Any]],
    writes: Sequence[tuple[str, Any]],
) -> dict[str, BaseChannel]:
    """The graph's channels as a checkpoint's `values` and its `earlier` updates make
    them: what a command's update or new input (`writes`) is applied to. The keys
    written hold copies: a reducer may change its first argument in place."""
    written = {key for key, _ in (*earlier, *writes)}
    channels = {
        key: spec.from_checkpoint(
            copy.deepcopy(values.get(key, MISSING)) if key in written else values.get(key, MISSING)
        )
        for key, spec in specs.items()
        if isinstance(spec, BaseChannel)
    }
    for key, value in earlier:
        if key in channels:
            with contextlib.suppress(Exception):  # (refused when it was made)
                channels[key].update([value])
    return channels


def _prompts(raised: Sequence[Interrupt]) -> dict[str, bytes]:
    """The records' prompts of interrupts `raised`, by id."""
    return {
        i.id: codec.dumps({"response_schema": _json_or_none(i.response_schema)}) for i in raised
    }


def _again_id(interrupt_id: str, n: int) -> str:
    """The record of the `n`th answer to a question after its node refused one."""
    return f"{interrupt_id}#again{n}"


def _is_send_path(task_path: str) -> bool:
    """Whether a stored task path is a `Send` branch's (`~__pregel_push, <index>, ...`),
    not a task another task called (`~__pregel_push, ~__pregel_pull, ...`)."""
    head, _, rest = task_path.partition(", ")
    return head == "~__pregel_push" and rest.partition(", ")[0].isdigit()


def _interrupts_in(value: Any) -> list[Interrupt]:
    if isinstance(value, Interrupt):
        return [value]
    if isinstance(value, (list, tuple)):
        return [i for i in value if isinstance(i, Interrupt)]
    return []


class Runs:
    """The run-loop side of one `RemitSaver` (shared by its `with_allowlist` clones)."""

    def __init__(self, saver: RemitSaver, state_schema: Any) -> None:
        self.saver = saver
        self.remit = saver.remit
        self.declared = None if state_schema is None else StateCheck.of(state_schema)
        #: id(a graph's channels) -> (those channels, the graph's check). A run loop
        #: carries its graph's channels (`loop.specs`), so a run start finds the
        #: check without looking for the graph in the caller's frames.
        self._checks: dict[int, tuple[Any, StateCheck | None]] = {}
        self._lock = threading.Lock()
        #: The runs this process has open, by id: see `owner`. Each change and copy
        #: is one dict operation, atomic without a lock: a dropped loop's finalizer
        #: (`attach`) changes it wherever the garbage collector runs, lock held or not.
        self._open: dict[int, Run] = {}
        #: The claims of dropped loops' runs (`_dropped`), released at the next run
        #: start here, if the lease keeper has not released them first.
        self._dropped: collections.deque[ClaimHandle] = collections.deque()

    def serving(self, saver: RemitSaver) -> Runs:
        """These runs as seen by `saver`, a `with_allowlist` clone: the same open runs,
        claims and checks, values encoded and decoded with the clone's serializer."""
        view = copy.copy(self)
        view.saver = saver
        return view

    # -- finding LangGraph in the call stack -------------------------------------------
    def calling_loop(self, frame: FrameType | None) -> LoopCall | None:
        """The top-level run loop that called the saver from its `__enter__`, if any,
        with the state check of the graph it runs. A subclass's override that calls
        `super()` is looked through."""
        frame = above_saver(frame)
        loop = None if frame is None else frame.f_locals.get("self")
        if not isinstance(loop, PregelLoop) or frame is None:
            self.learn(frame)
            return None
        if frame.f_code.co_name not in ("__enter__", "__aenter__"):
            return None
        if loop.is_nested:
            self._nest(loop, frame)
            return None
        return LoopCall(loop, self._loop_check(loop, frame))

    def replaying(self, frame: FrameType | None) -> None:
        """Note the subgraph loop whose `__enter__` is the frame above `frame`, if it is
        one: on a fork's first run (a replay), LangGraph's `ReplayState` has each
        subgraph restore where it stood before the fork's base with `list`, not
        `get_tuple`."""
        enter = None if frame is None else frame.f_back
        loop = None if enter is None else enter.f_locals.get("self")
        if (
            enter is not None
            and isinstance(loop, PregelLoop)
            and loop.is_nested
            and enter.f_code.co_name in ("__enter__", "__aenter__")
        ):
            self._nest(loop, enter)

    def _nest(self, loop: PregelLoop, frame: FrameType) -> None:
        """Note a subgraph's loop (its `__enter__` is `frame`) in the run it is part of."""
        conf = loop.config.get("configurable") or {}
        run = current_run()
        if run is None or run.thread != str(conf.get("thread_id")):
            run = self.of_task(conf)  # (another run's mark: `of_task`)
        if run is None:
            return
        # Its tasks name effects' steps; its own schema holds of its checkpoints and
        # of its nodes' outputs (P4).
        ns = str((loop.config.get("configurable") or {}).get("checkpoint_ns", ""))
        run.nested[ns] = weakref.ref(loop)
        check = run.checks[ns] = self._loop_check(loop, frame)
        _check_outputs(loop, run, check)

    def _loop_check(self, loop: PregelLoop, frame: FrameType) -> StateCheck | None:
        """The state check of the graph `loop` runs (its `__enter__` is `frame`)."""
        known = self._known(loop.specs)
        check = known[1] if known is not None else self._check_of(_graph_at(frame.f_back))
        if check is not None and check is self.declared:
            check = copy.copy(check)  # (bound to this loop's channels: a subgraph's differ)
        if check is not None:
            check.with_channels(loop.specs)
        return check

    def learn(self, frame: FrameType | None) -> tuple[bool, StateCheck | None]:
        """Find the graph a few frames up; note its state check and its serializable
        types. Returns whether there is one, and its check."""
        graph = _graph_at(frame)
        return graph is not None, self._check_of(graph)

    def _check_of(self, graph: Pregel[Any, Any, Any, Any] | None) -> StateCheck | None:
        if graph is None:
            return self.declared
        channels = graph.channels
        known = self._known(channels)
        if known is None:
            known = (channels, self._study(graph))
            with self._lock:
                if len(self._checks) >= _GRAPHS_KEPT:
                    self._checks.clear()
                self._checks[id(channels)] = known
        return known[1]

    def _known(self, channels: Any) -> tuple[Any, StateCheck | None] | None:
        known = self._checks.get(id(channels))
        return known if known is not None and known[0] is channels else None

    def _study(self, graph: Pregel[Any, Any, Any, Any]) -> StateCheck | None:
        builder = getattr(graph, "builder", None)
        state_type = getattr(builder, "state_schema", None)
        check = self.declared or (
            None
            if state_type is None
            else StateCheck.of(
                state_type, [t for t in _schema_types(graph, builder) if t is not None]
            )
        )
        channels = getattr(builder, "channels", None) or graph.channels
        if check is not None:
            check.with_channels(channels)
            if check is self.declared:
                # Each graph's own copy, bound to its channels: a subgraph's run beside
                # its parent's must not rebind the check the parent's run holds.
                check = copy.copy(check)
        if isinstance(self.saver.serde, StrictSerializer):
            schemas = _schema_types(graph, builder)
            self.saver.serde.allow(build_serde_allowlist(schemas=schemas, channels=channels))
            self.saver.serde.allow(plain_record_types(schemas))
        return check

    def active(self, thread: str) -> Run | None:
        """The run this context belongs to, if it is on `thread`."""
        run = current_run()
        return run if run is not None and run.thread == thread else None

    # A run's mark is a context variable, and a `stream` generator runs in its
    # consumer's context: code that reads two runs' streams in turn (in one thread,
    # or one asyncio task) sees the mark of the run that started or ended last. What
    # LangGraph hands over names the run without it: the loop that calls the saver,
    # the config of the task that calls an effect. (Looked up only when the mark
    # names no run of the thread: the common case costs nothing.)

    def of_loop(self, frame: FrameType | None, thread: str) -> Run | None:
        """The open run on `thread` whose loop, or a subgraph loop of it, is the
        `self` of `frame` (a saver call's caller)."""
        loop = None if frame is None else frame.f_locals.get("self")
        if not isinstance(loop, PregelLoop):
            return None
        for run in list(self._open.values()):
            if run.thread != thread or run.claim._released:
                continue
            if run.drives(loop):
                return run
        return None

    def asking(self, marked: Run, frame: FrameType | None) -> Run:
        """The run whose loop asks for a version (`frame` is the saver's caller), when
        the context's mark names `marked`: two runs read in turn share one mark, and a
        run whose write was refused, or whose claim was taken over, must not stop the
        other. `marked` if no open run's loop is found a few frames up."""
        for _ in range(_GRAPH_FRAME_DEPTH):
            if frame is None:
                break
            loop = frame.f_locals.get("self")
            if isinstance(loop, PregelLoop):
                for run in list(self._open.values()):
                    if run.drives(loop):
                        return run
                break
            frame = frame.f_back
        return marked

    def of_task(self, conf: Mapping[str, Any]) -> Run | None:
        """The open run a task of `conf` (its config's "configurable") is part of: the
        run on its thread whose loop runs its top-level task."""
        thread = str(conf.get("thread_id"))
        top = str(conf.get("checkpoint_ns", "")).split("|", 1)[0].partition(":")[2]
        for run in list(self._open.values()):
            loop = None if run.loop is None else run.loop()
            if run.thread == thread and loop is not None and top in loop.tasks:
                return None if run.claim._released else run
        return None

    def open_on(self, thread: str, branch: str) -> list[Run]:
        """The runs this process has open on `thread`'s `branch`."""
        return [r for r in list(self._open.values()) if (r.thread, r.branch) == (thread, branch)]

    def owner(self, thread: str, checkpoint_id: str) -> Run | None:
        """The run a task write to `checkpoint_id` belongs to. LangGraph submits the
        writes of tasks it ran in its thread pool from a callback outside their
        context: the run is then the open one that continues that checkpoint, or whose
        loop stands on it (in "async" durability the checkpoint's own commit may still
        be in flight: without its run, the write would go unfenced and without the
        task's effect calls, which a later run of the task would then apply again)."""
        run = self.active(thread)
        if run is not None:
            return run
        for r in list(self._open.values()):
            if r.thread != thread or r.claim._released:
                continue
            if checkpoint_id in r.committed:
                return r
            loop = None if r.loop is None else r.loop()
            if loop is not None and loop.checkpoint["id"] == checkpoint_id:
                return r
        return None

    # -- run start ---------------------------------------------------------------
    def start(
        self, call: LoopCall, config: RunnableConfig
    ) -> tuple[Run | None, CheckpointTuple | None]:
        """Open a run for `call.loop`: claim, fork rule, resume values. Returns (run, tuple)."""
        self._release_dropped()
        loop = call.loop
        conf = checked_conf(dict(config.get("configurable") or {}))
        thread = thread_id(conf.get("thread_id"))
        if isinstance(loop.input, Command):
            _check_command(loop.input, loop.specs, thread)
        token = conf.get("fork_token")
        checkpoint_id = conf.get("checkpoint_id")
        writes = None
        if not checkpoint_id and not token:
            # The common start: main's head and its writes, read with the claim (one
            # round trip). A head read before the claim could be one that a racing
            # resumer, claiming first, has moved past and released since.
            branch = MAIN_BRANCH
            handle, record, writes = self.remit.claim_at_head(
                thread, branch, lease=self.saver.lease
            )
            if record is None and loop.input is None:
                handle.release()
                return None, None  # nothing to run; LangGraph reports the empty input
        else:
            resume = isinstance(loop.input, Command) and loop.input.resume is not None
            record, branch = self._where(thread, checkpoint_id, token, resume=resume)
            if record is None and loop.input is None:
                return None, None  # nothing to run; LangGraph reports the empty input
            if checkpoint_id and record is not None and record.branch == branch:
                # A branch's head (named by its id, or a token seen before) is continued
                # as without a checkpoint_id. Left addressed, LangGraph would time-travel
                # there: re-run the head's finished tasks and start a fork checkpoint,
                # moving the steps (and so the effect keys) of what runs next.
                loop._addressed = False
            if record is not None and record.branch == branch:
                handle, record, writes = self._claim_head(
                    thread, branch, record, by_id=bool(checkpoint_id and not token), resume=resume
                )
            else:
                handle = self.remit.claim(thread, branch, lease=self.saver.lease)
        run = Run(self.remit, thread, branch, handle, call.check, loop=weakref.ref(loop))
        owed = None
        pairs: Sequence[tuple[str, Any]] = ()
        try:
            if call.check is not None:
                # Input and a command's update are checked before anything is stored
                # or runs: a refused command leaves its interrupt pending, and no node
                # sees refused input (in "exit" durability nothing else would stop it).
                given = loop.input
                if isinstance(given, Command) and given.update:
                    pairs = given._update_as_tuples()
                elif isinstance(given, Mapping):
                    pairs = list(given.items())
                if pairs and not call.check.holds(pairs):
                    call.check.writes(
                        pairs,
                        run_id=thread,
                        checkpoint_id=None if record is None else record.checkpoint_id,
                    )
            if record is None and isinstance(loop.input, Command) and loop.input.resume is not None:
                # No checkpoint asked anything: the value would answer nothing.
                raise UnknownRecord(
                    "nothing to resume: the thread has no checkpoint; the resume value was "
                    "not stored (start the run with its input)",
                    run_id=thread,
                )
            found = None
            if record is None and call.check is not None and pairs:
                # A new thread's input to a reducer key, by the value it makes of the
                # key's empty one, before the input checkpoint is stored (P4).
                call.check.totals_on({}, pairs, run_id=thread, checkpoint_id=None)
                call.check.fits_on({}, pairs, run_id=thread, checkpoint_id=None)
                if call.check.checks_whole:
                    call.check.after(_channels_at(loop.specs, {}, (), pairs), pairs, run_id=thread)
            if record is not None:
                run.committed.add(record.checkpoint_id)
                if writes is None:
                    writes = self.remit.writes(thread, record.checkpoint_id)
                if isinstance(loop.input, Command) and loop.input.resume is not None:
                    # The head is read (its version accepted, its values decoded and
                    # migrated) before its interrupt is consumed: a head this saver
                    # refuses refuses the value too, with nothing stored (P4, P5).
                    found = self._read_head(call, record, writes)
                if call.check is not None and pairs:
                    # A command's update to a reducer key (or new input to one) is
                    # checked by the value it makes of the head's (the head's earlier
                    # updates first), before its resume value is consumed or anything
                    # is stored (P4, P5): one out of the key's bounds, or one its
                    # reducer refuses there (the removal of a message the chat lacks).
                    if found is None:
                        found = self._read_head(call, record, writes)
                    values = found.checkpoint["channel_values"]
                    earlier = [
                        (c, v) for t, c, v in found.pending_writes or () if t == NULL_TASK_ID
                    ]
                    ids = {"run_id": thread, "checkpoint_id": record.checkpoint_id}
                    call.check.totals_on(values, pairs, earlier, **ids)
                    call.check.fits_on(values, pairs, earlier, **ids)
                    if call.check.checks_whole:  # (a model's validators, on the whole state)
                        call.check.after(
                            _channels_at(loop.specs, values, earlier, pairs), pairs, **ids
                        )
                owed = self._settle_resume(
                    loop, run, record, writes, () if found is None else found.pending_writes or ()
                )
                edited = record.metadata.get("source") == "update"
                if (branch != MAIN_BRANCH or edited) and (
                    loop.input is None or isinstance(loop.input, Command)
                ):
                    # The tasks pending at `record` (at its parent's, for an edit) run
                    # again: at its next step, or on a new fork at the one after (its
                    # fork checkpoint takes a step).
                    step = record.metadata.get("step", -1) + (1 if record.branch == branch else 2)
                    made = self._made_at(thread, record, writes)
                    run.shared = {f"{step}/{place}": calls for place, calls in made.items()}
                if record.branch != branch and (
                    not checkpoint_id or record.metadata.get("source") in ("update", "fork")
                ):
                    record, writes = self._fork_point(loop, run, record, writes, token)
                    found = None
            if record is not None and any(w.channel == INTERRUPT for w in writes or ()):
                run.past_pause = record.checkpoint_id
            if found is None and record is not None:
                found = self._read_head(call, record, writes)
            if found is not None and run.resume_spent and found.pending_writes:
                found = found._replace(
                    pending_writes=[
                        w for w in found.pending_writes if (w[0], w[1]) != (NULL_TASK_ID, RESUME)
                    ]
                )
            if owed is not None and found is not None:
                # As if LangGraph's own resume write had been stored with the head.
                found = found._replace(
                    pending_writes=[*(found.pending_writes or ()), (NULL_TASK_ID, RESUME, owed)]
                )
        except BaseException:
            handle.release()
            raise
        return run, found

    def _read_head(
        self, call: LoopCall, record: CheckpointRecord, writes: list[WriteRecord] | None
    ) -> CheckpointTuple:
        """The tuple of the checkpoint a run starts from."""
        if call.check is not None and self.saver.serde.validates_models:
            # The messages of a chat, just rebuilt, need no second check (`loaded`).
            with self.saver.serde.noting() as noted:
                found = self.saver._tuple(record, writes)
            call.check.loaded(found.checkpoint["channel_values"], noted)
            return found
        return self.saver._tuple(record, writes)

    def _release_dropped(self) -> None:
        """Release the claims of dropped loops' runs (see `attach`)."""
        while True:
            try:
                claim = self._dropped.popleft()
            except IndexError:
                return
            with contextlib.suppress(Exception):  # (if it fails, the lease runs out: L1)
                claim.release()

    def _where(
        self, thread: str, checkpoint_id: str | None, token: str | None, *, resume: bool = False
    ) -> tuple[CheckpointRecord | None, str]:
        """The checkpoint a run continues from and the branch it writes to (`resume`: the
        run brings a resume value)."""
        if not checkpoint_id and not token:
            return self.remit.head(thread), MAIN_BRANCH
        branches = self.remit.branches(thread, ns="")
        forked = next((b for b in branches if token and b.fork_token == token), None)
        if not checkpoint_id:
            if forked is None:  # a token without a checkpoint names a branch: none has it
                raise UnknownRecord(
                    f"no branch of this thread was made with fork token {token!r}; to make "
                    "one, pass it with the checkpoint_id to fork from",
                    run_id=thread,
                )
            return self.remit.head(thread, branch=forked.branch), forked.branch
        record = self.remit.checkpoint(thread, checkpoint_id)
        if record is None:
            raise UnknownRecord("no such checkpoint", run_id=thread, checkpoint_id=checkpoint_id)
        if forked is not None and checkpoint_id in (forked.base_id, forked.head_id):
            # The same token again: that branch, at its head (P3).
            return self.remit.head(thread, branch=forked.branch), forked.branch
        if token is None:
            heads = sorted(
                (b for b in branches if b.head_id == checkpoint_id),
                key=lambda b: b.fork_token is not None,
            )
            if heads:
                return record, heads[0].branch
            if resume:
                raise self._moved_past(thread, record)
            raise ForkWithoutIntent(
                "continuing from a checkpoint that is not the head of its branch is a fork; "
                'pass config["configurable"]["fork_token"] to create one named branch',
                run_id=thread,
                checkpoint_id=checkpoint_id,
            )
        if forked is not None:
            raise ForkWithoutIntent(
                f"fork token {token!r} already forked from {forked.base_id!r}; use a new token",
                run_id=thread,
                checkpoint_id=checkpoint_id,
            )
        # A base this saver cannot read (another workflow version, a state it cannot
        # migrate, values that fail to verify) is refused before its branch is made:
        # the refused run stores nothing, and the token stays free (P3, P4).
        self.saver._tuple(record)
        return record, self.fork(thread, checkpoint_id, token)

    def _claim_head(
        self, thread: str, branch: str, read: CheckpointRecord, *, by_id: bool, resume: bool
    ) -> tuple[ClaimHandle, CheckpointRecord, list[WriteRecord]]:
        """The claim of `branch` and its head, read with it: a head read before the claim
        could be one that a racing resumer, claiming first, has moved past and released
        since. A branch named by its token goes on from where it stands now; a head
        named by its id (`by_id`) that moved is refused, as if named after the move."""
        handle, head, writes = self.remit.claim_at_head(thread, branch, lease=self.saver.lease)
        if head is not None and head.checkpoint_id == read.checkpoint_id:
            return handle, head, writes
        if head is not None and not by_id:
            return handle, head, writes
        handle.release()
        if resume:
            raise self._moved_past(thread, read)
        raise ResumeConflict(
            "another run moved this branch on (or removed its head) while this one "
            "started; nothing ran (read the thread's state again)",
            run_id=thread,
            checkpoint_id=read.checkpoint_id,
        )

    def _moved_past(self, thread: str, record: CheckpointRecord) -> ResumeConflict:
        """The refusal of a resume value addressed to a checkpoint its branch has moved
        past (a config read while paused, used again): its pause was answered, or the
        run went on. A resume value makes no fork (a fork asks its questions again)."""
        answered = [
            i.interrupt_id
            for i in self.remit.interrupts(
                thread, branch=record.branch, checkpoint_id=record.checkpoint_id, status="consumed"
            )
        ]
        what = "its interrupt was already consumed" if answered else "the run has moved past it"
        return ResumeConflict(
            f"this checkpoint is no longer the head of its branch: {what}; the value was "
            "not stored (read the thread's state again for what it asks now)",
            run_id=thread,
            checkpoint_id=record.checkpoint_id,
            interrupt_id=answered[0] if answered else None,
        )

    def fork(self, thread: str, checkpoint_id: str, token: str) -> str:
        """A token with an explicit checkpoint is the intent to fork, from a head too:
        one named branch, the same one from any process (P3). Returns its name."""
        existing = self.remit.fork_branch(thread, token)
        if existing is not None and checkpoint_id in (existing.base_id, existing.head_id):
            return existing.branch
        if existing is not None:
            at = self.remit.checkpoint(thread, checkpoint_id)
            if at is not None and at.branch == existing.branch:
                # An edit read the fork's head, and another edit moved it since: its
                # commit is refused as a lost race (`HeadMoved`), not as a second fork.
                return existing.branch
        return self.remit.fork(thread, checkpoint_id, token).branch

    def fork_in(self, thread: str, ns: str, token: str) -> BranchRecord | None:
        """The branch `token` has in subgraph namespace `ns`, made on first use when
        the token forked the thread: a subgraph with a namespace of its own
        (`checkpointer=True`) keeps its line across the parent's runs, and a fork
        of the parent must not continue (or answer) the other branch's line. The
        new branch starts where `ns` stood on the base's branch when the base was
        written (`_stood`), or empty. None: not a fork of this thread,
        or `ns` names a task (`name:task_id`), whose line no other branch shares:
        the fork's own tasks have ids of its own checkpoints, so their lines are
        their namespaces' main lines, found with or without the token."""
        if NS_END in ns:
            return None
        forked = self.remit.fork_branch(thread, token, ns=ns)
        if forked is not None:
            return forked
        top = self.remit.fork_branch(thread, token)
        if top is None or top.base_id is None:
            return None
        # A namespace first used by the fork gets its empty branch too: main's first
        # use of it later must not continue the fork's line.
        return self.remit.fork(thread, self._stood(thread, ns, top), token, ns=ns)

    def _stood(self, thread: str, ns: str, fork: BranchRecord) -> str | None:
        """The checkpoint of namespace `ns` that the line of `fork`'s base branch stood
        at when the base was written; None: empty. Checkpoint ids are time-ordered,
        and each top-level branch keeps its line of `ns` on the branch of that name
        (a fork's starts where its own base branch's stood): another branch's newer
        checkpoints of `ns` are not its past."""
        line = self.remit.history(thread, ns=ns, verify=False)
        lines = {b.branch: b for b in self.remit.branches(thread, ns=ns)}
        before = fork.base_id
        while before is not None:
            base = self.remit.checkpoint(thread, before)
            if base is None:
                return None
            own = lines.get(base.branch)
            if own is not None:
                mine = (r.checkpoint_id for r in line if r.branch == own.branch)
                return next((c for c in mine if c < before), own.base_id)
            if base.branch == MAIN_BRANCH:
                return None
            before = next(
                (b.base_id for b in self.remit.branches(thread, ns="") if b.branch == base.branch),
                None,
            )
        return None

    def _fork_point(
        self,
        loop: PregelLoop,
        run: Run,
        base: CheckpointRecord,
        writes: Sequence[WriteRecord],
        token: str | None,
    ) -> tuple[CheckpointRecord, list[WriteRecord]]:
        """Commit a fork's first checkpoint, a copy of its `base` (created now, as
        LangGraph's own fork checkpoints are), and return it with its writes.

        LangGraph starts a branch with a checkpoint of its own (source "fork") only
        when it time-travels from a checkpoint the thread has moved past; from a
        head made by `update_state`, or on a fork token alone, it would continue
        the base in place, and store this branch's task writes and interrupts on a
        checkpoint another branch continues from. The copy carries the base's input
        writes, but not its resume value (a fork asks again, L3).
        """
        step = base.metadata.get("step", -1) + 1
        checkpoint_id = str(uuid6(clock_seq=step))
        copied = [
            replace(w, checkpoint_id=checkpoint_id)
            for w in writes
            if w.task_id == NULL_TASK_ID and w.channel != RESUME
        ]
        metadata = get_serializable_checkpoint_metadata(
            loop.config,
            {"source": "fork", "step": step, "parents": {}},
        )
        index = self.saver._run_index_entry(run.thread, metadata.get("run_id"))
        record = self.remit.commit(
            run_id=run.thread,
            checkpoint_id=checkpoint_id,
            parent_id=base.checkpoint_id,
            state=restamped(
                base.state,
                datetime.datetime.now(datetime.timezone.utc).isoformat(),
                run_id=run.thread,
                checkpoint_id=base.checkpoint_id,
            ),
            metadata=metadata,
            fork_token=token,
            schema_version=base.schema_version,
            workflow_version=self.saver.workflow_version,
            writes=[*copied, *(() if index is None else (index,))],
            fence=run.fence,
        )
        if index is not None:
            self.saver._indexed_now(run.thread, metadata.get("run_id"))
        run.committed.add(checkpoint_id)
        return record, copied

    def _made_at(
        self, thread: str, record: CheckpointRecord, writes: Sequence[WriteRecord]
    ) -> dict[str, Made]:
        """The effect calls the tasks pending at `record` made there, by place (with
        the ones they shared); a fork's first checkpoint, or an edit's, has its
        parent's too (its tasks run again after it)."""
        made: dict[str, Made] = {}
        if record.metadata.get("source") in ("fork", "update") and record.parent_id:
            base, base_writes = self.remit.checkpoint_and_writes(thread, record.parent_id)
            if base is not None:
                made = self._made_at(thread, base, base_writes)
        if self._ran_through(thread, record, writes):
            return made
        for w in writes:
            if w.channel == CALLS:
                calls = TaskCalls.read(w)
                made[calls.place] = calls.made()
        return made

    def _ran_through(
        self, thread: str, record: CheckpointRecord, writes: Sequence[WriteRecord]
    ) -> bool:
        """Whether the step after `record` ran to its end on `record`'s branch: none of
        its tasks paused or failed there, and the loop committed the next checkpoint.
        Its tasks' calls then came after `record`, not before it: a fork of `record`
        (time travel, or an edit of it) runs that step as its own, and its effects
        apply under the fork's keys, as every later step's do."""
        if not any(w.channel == CALLS for w in writes):
            return False
        if any(w.channel in (INTERRUPT, ERROR) for w in writes):
            return False
        return any(
            later.parent_id == record.checkpoint_id
            and later.branch == record.branch
            and later.ns == record.ns
            and later.metadata.get("source") == "loop"
            for later in self._newer_than(thread, record.checkpoint_id)
        )

    def _settle_resume(
        self,
        loop: PregelLoop,
        run: Run,
        record: CheckpointRecord,
        writes: Sequence[WriteRecord],
        prior: Sequence[tuple[str, str, Any]] = (),
    ) -> Any:
        """Consume what a `Command(resume=...)` answers; re-deliver what a dead resumer
        took. `writes` are the checkpoint's, `prior` the pending writes LangGraph reads
        with it. Returns a value still owed to the pause `update_state` moved past (see
        `_pause`), or None."""
        resume = loop.input.resume if isinstance(loop.input, Command) else None
        # A command without a resume value (`Command(update=...)`, `goto=`) runs the
        # paused tasks again as `invoke(None, config)` does: it owes them the same values.
        recovering = (loop.input is None or isinstance(loop.input, Command)) and (
            record.branch == run.branch
        )
        if resume is None and not recovering:
            return None  # new input: no interrupt to settle
        if resume is not None and record.branch != run.branch:
            raise self._fork_not_asking(run, record)
        here = self._pause(run, record)
        if resume is not None:
            here = self._record_asked(run, record, writes, here)
        if resume is not None and not here and record.metadata.get("source") == "fork":
            raise ResumeConflict(
                'the head is a copy of a checkpoint (update_state(..., as_node="__copy__"), '
                "or a fork's first checkpoint): it asks nothing until it runs; continue it "
                "with invoke(None, config), which asks the copied pause's questions again, "
                "then resume. The value was not stored",
                run_id=run.thread,
                checkpoint_id=record.checkpoint_id,
            )
        if resume is not None:
            here = self._still_raised(run, here)
            edited = any(i.checkpoint_id != record.checkpoint_id for i in here)
            if not edited and _is_resume_map(resume):
                edited = not self._asked_in_edited_subgraphs(run, record).isdisjoint(resume)
            elif not edited:
                self._refuse_later_question_of_edited_subgraph(run, record, here)
            gone = self._asked_by_absent_nodes(loop, run, record, writes, here)
            replaced = self._replaced_senders(loop, run, record, writes)
            # Values a resumer that died consumed for the pause's other questions are
            # owed to their tasks, which run again beside the one answered now: they go
            # with the new answers, by id (otherwise those tasks asked again, and every
            # answer to them was refused as consumed: the thread was stuck).
            given_back = {} if edited else self._owed(run, writes, here)
            self._refuse_replaced_owed(run, given_back, replaced)
            answered = self._consume(
                run,
                here,
                resume,
                edited=edited,
                gone=gone,
                replaced=replaced,
                failed=self._failed(run, writes),
                asked_again=self._asked_again(run, here, writes),
                riding=self._command_writes(loop, run, record, prior, edited=edited),
            )
            command = loop.input
            given_back = {iid: v for iid, v in given_back.items() if iid not in answered}
            if isinstance(command, Command) and ((command.goto and not edited) or given_back):
                # LangGraph hands a plain value to the first task of the step that asks,
                # which may be a `Send` of the goto: by id it reaches only the question
                # it was consumed for (the others ask theirs). A map is by id already.
                loop.input = dataclasses.replace(command, resume={**given_back, **answered})
            return None
        # (A fork re-asks: it never takes the values its base's branch consumed, L3.)
        if any(i.checkpoint_id != record.checkpoint_id for i in here):
            return self._owed_across_update(run, writes, here)
        replaced = self._replaced_senders(loop, run, record, writes)
        self._refuse_replaced_owed(
            run, {i.interrupt_id: None for i in here if i.status == "consumed"}, replaced
        )
        self._redeliver(loop, run, writes, here)
        # What the ledger owes goes back by interrupt id; LangGraph's own resume write
        # is spent (its node took it, or takes it again by id): kept, it would answer
        # the node's next question with the previous answer.
        run.resume_spent = True
        return None

    def _refuse_replaced_owed(
        self, run: Run, owed: Mapping[str, Any], replaced: Mapping[str, int]
    ) -> None:
        """Refuse a command whose goto replaces the `Send` branch that a value a dead
        resumer consumed (`owed`, by interrupt id) is owed to."""
        lost = [iid for iid in owed if iid in replaced]
        if lost:
            raise ResumeConflict(
                "this interrupt's value was consumed by a resumer that stopped before its "
                f"Send branch (index {replaced[lost[0]]}) finished, and this command's goto "
                "replaces that branch: LangGraph would hand the value to the branch now at "
                "its index, another question, or to none. Nothing was stored; continue with "
                "invoke(None, config), or give the goto the pending branch's Send at the "
                "same index first",
                run_id=run.thread,
                interrupt_id=lost[0],
            )

    def _command_writes(
        self,
        loop: PregelLoop,
        run: Run,
        record: CheckpointRecord,
        prior: Sequence[tuple[str, str, Any]],
        *,
        edited: bool,
    ) -> list[WriteRecord]:
        """The writes LangGraph stores on `record` for a resume command's `update` and
        `goto`, as its loop will (`put_writes` of the null task: after the head's own
        null writes, the special channels last, untracked values left out), to be
        stored with the consume. LangGraph stores them itself only after the value is
        consumed, in the background (in "exit" durability at the run's end): a resumer
        that died between the two left the value taken without them, and the run
        continued with it on the old state and route (P5, P6). LangGraph's own later
        write of the same slots keeps these. Empty for a command with neither."""
        command = loop.input
        if not isinstance(command, Command) or not (command.update or command.goto):
            return []
        # LangGraph hands a map (by interrupt id) to the tasks, not to the null task;
        # a plain value with a goto becomes one (`_settle_resume`).
        by_id = _is_resume_map(command.resume) or (bool(command.goto) and not edited)
        made = [(c, v) for tid, c, v in map_command(command) if tid == NULL_TASK_ID]
        made = [(c, v) for c, v in made if not (c == RESUME and by_id)]
        if all(c in WRITES_IDX_MAP for c, _ in made):
            return []  # (stored as LangGraph stores them: overwriting, not with the value)
        if any(isinstance(loop.specs.get(c), DeltaChannel) for c, _ in made):
            # (LangGraph gives a delta key's messages their ids as it stores them, and in
            # "exit" durability files its writes apart: left to LangGraph, as before.)
            return []
        made.sort(key=lambda w: w[0] in WRITES_IDX_MAP)
        earlier = [(c, v) for t, c, v in prior if t == NULL_TASK_ID and c not in WRITES_IDX_MAP]
        if any(isinstance(spec, UntrackedValue) for spec in loop.specs.values()):
            specs: Any = loop.specs  # (its channels' types are what the check reads)
            made = [
                (c, sanitize_untracked_values_in_send(v, specs))
                if c == TASKS and isinstance(v, Send)
                else (c, v)
                for c, v in made
                if not isinstance(loop.specs.get(c), UntrackedValue)
            ]
            earlier = [
                (c, v) for c, v in earlier if not isinstance(loop.specs.get(c), UntrackedValue)
            ]
        records = self.saver._write_records(
            run.thread, "", record.checkpoint_id, NULL_TASK_ID, "", [*earlier, *made]
        )
        return records[len(earlier) :]

    def _record_asked(
        self,
        run: Run,
        record: CheckpointRecord,
        writes: Sequence[WriteRecord],
        here: list[InterruptRecord],
    ) -> list[InterruptRecord]:
        """`here` with the questions `record`'s tasks asked that have no record yet,
        opened now: a task's interrupt write and its record (`after_writes`) are two
        store calls, and a process killed between them left a pause whose question
        nothing could answer (P5). Opening is idempotent and the consume stays the gate."""
        raised = [
            i
            for w in writes
            if w.channel == INTERRUPT and w.ns == ""
            for i in _interrupts_in(self.saver._decode(w.value, run_id=run.thread))
        ]
        known = {i.interrupt_id for i in here}
        missing = [i for i in raised if i.id not in known]
        if not missing:
            return here
        self.remit.open_interrupts(
            run.thread,
            _prompts(missing),
            branch=record.branch,
            checkpoint_id=record.checkpoint_id,
            fence=run.fence,
        )
        return self._pause(run, record)

    def _fork_not_asking(self, run: Run, base: CheckpointRecord) -> ResumeConflict:
        """The refusal of a resume value for a fork that stands at its `base`, with no
        checkpoint of its own: its questions are the ones it asks when it runs (L3),
        and the base's belong to the branch it was forked from."""
        fork = next(b for b in self.remit.branches(run.thread, ns="") if b.branch == run.branch)
        if fork.head_seq > 0:
            what = (
                f"the checkpoints of the fork made with fork token {fork.fork_token!r} were "
                "deleted (delete_for_runs): it is back at its base"
            )
        else:
            what = f"the fork made with fork token {fork.fork_token!r} has not run yet"
        return ResumeConflict(
            f"{what}, checkpoint {base.checkpoint_id!r} of another branch, and asks nothing "
            "until it runs; continue it with invoke(None, config) (it asks its questions "
            "again), then resume it. The value was not stored",
            run_id=run.thread,
            checkpoint_id=base.checkpoint_id,
        )

    def _pause(self, run: Run, record: CheckpointRecord) -> list[InterruptRecord]:
        """The interrupts a resume at `record` answers: its own, or, when `record` was
        made by `update_state` (edits while paused run no node), those of the pause
        it edited. LangGraph re-runs the interrupted node from the edited state, and
        its `interrupt()` takes the value. A fork made by such an edit asks its
        base's question again, as its own (L3)."""
        at: CheckpointRecord | None = record
        while at is not None:
            raised = self.remit.interrupts(
                run.thread, branch=record.branch, checkpoint_id=at.checkpoint_id
            )
            if raised:
                asked = at is record or self._still_asked(run.thread, record, at)
                return raised if asked else []
            if at.branch != record.branch:
                return self._ask_again(run, record.branch, at)
            if at.metadata.get("source") != "update" or at.parent_id is None:
                return []
            at = self.remit.checkpoint(run.thread, at.parent_id)
        return []

    def _still_raised(self, run: Run, here: Sequence[InterruptRecord]) -> list[InterruptRecord]:
        """`here` without the pending interrupts that their checkpoint's tasks no longer
        raise: a subgraph task run again after an edit of its namespace asks under a
        new interrupt id, and its new interrupt write replaces the old one (LangGraph
        drops a value by the old id). Values go to what the thread asks now (P5)."""
        raised: dict[str | None, set[str] | None] = {}
        for i in here:
            if i.status != "pending" or i.checkpoint_id in raised or i.checkpoint_id is None:
                continue
            ids: set[str] = set()
            asking = False
            for w in self.remit.writes(run.thread, i.checkpoint_id):
                if w.channel == INTERRUPT:
                    asking = True
                    value = self.saver._decode(w.value, run_id=run.thread)
                    ids.update(item.id for item in _interrupts_in(value))
            raised[i.checkpoint_id] = ids if asking else None
        return [
            i
            for i in here
            if i.status != "pending"
            or (asked := raised.get(i.checkpoint_id)) is None
            or i.interrupt_id in asked
        ]

    def _still_asked(self, thread: str, head: CheckpointRecord, paused: CheckpointRecord) -> bool:
        """Whether the nodes that asked at `paused` are still to run at `head`: an edit
        made as that node (`update_state(..., as_node=...)`), or as one after it,
        answers or skips the question, and LangGraph then drops a resume value. A
        `Send` branch runs again only while the head still holds the sends: an edit
        as a node (or as END) ends the step that held them."""
        pull = "~__pregel_pull, "
        paths = [
            w.task_path
            for w in self.remit.writes(thread, paused.checkpoint_id)
            if w.channel == INTERRUPT
        ]
        nodes = {p[len(pull) :] for p in paths if p.startswith(pull)}
        sent = [p for p in paths if _is_send_path(p)]
        if len(nodes) + len(sent) < len(paths):
            return True  # (a task called from another, as in `@entrypoint`: as it was asked)
        triggers = {f"branch:to:{n}" for n in nodes}
        before = self.saver._tuple(paused).checkpoint["channel_values"]
        if not triggers <= before.keys():
            return True  # scheduled some other way: as it was asked
        now = self.saver._tuple(head).checkpoint["channel_values"]
        return bool(triggers & now.keys()) or bool(sent and now.get(TASKS))

    def _ask_again(self, run: Run, branch: str, base: CheckpointRecord) -> list[InterruptRecord]:
        """The interrupts raised at a fork's `base`, opened anew on the fork's `branch`."""
        asked = {
            i.interrupt_id: i.prompt
            for i in self.remit.interrupts(
                run.thread, branch=base.branch, checkpoint_id=base.checkpoint_id
            )
        }
        if not asked:
            return []
        self.remit.open_interrupts(
            run.thread, asked, branch=branch, checkpoint_id=base.checkpoint_id, fence=run.fence
        )
        return self.remit.interrupts(run.thread, branch=branch, checkpoint_id=base.checkpoint_id)

    def _owed_across_update(
        self, run: Run, writes: Sequence[WriteRecord], here: Sequence[InterruptRecord]
    ) -> Any:
        """A value consumed at a pause that `update_state` moved past, by a resumer
        that died before its resume write reached the head: owed again (P5 recovery)."""
        if any(w.task_id == NULL_TASK_ID and w.channel == RESUME for w in writes):
            return None  # LangGraph's own write carries it
        consumed = [i for i in here if i.status == "consumed" and i.value is not None]
        if len(consumed) != 1 or any(i.status == "pending" for i in here):
            return None
        value = consumed[0].value
        assert value is not None
        return self.saver._decode(value, run_id=run.thread)

    def _asked_in_edited_subgraphs(self, run: Run, record: CheckpointRecord) -> set[str]:
        """The interrupts of the pause at `record` that were asked in a subgraph at a
        checkpoint `update_state` has since edited (an edit of the subgraph's
        namespace, `get_state(config, subgraphs=True)`'s task config, leaves the top
        head as it was). LangGraph runs the subgraph's task again from the edit, under
        a new task id: it asks again under new interrupt ids, and drops a value by an
        old one. Only the edits on the run's line of a namespace count: a task's
        namespace (`name:task_id`) is its own line; one of its own (`checkpointer=True`)
        has a line per branch."""
        stale: set[str] = set()
        for writes in self._edited_subgraph_writes(run, record):
            for w in writes:
                if w.channel == INTERRUPT:
                    value = self.saver._decode(w.value, run_id=run.thread)
                    stale.update(item.id for item in _interrupts_in(value))
        return stale

    def _edited_subgraph_writes(
        self, run: Run, record: CheckpointRecord
    ) -> Iterator[list[WriteRecord]]:
        """The writes of each subgraph checkpoint that an `update_state` after `record`
        edited, on the run's line of its namespace (see `_asked_in_edited_subgraphs`)."""
        for edit in self._newer_than(run.thread, record.checkpoint_id):
            if (
                edit.ns == ""
                or edit.parent_id is None
                or edit.metadata.get("source") != "update"
                or (edit.branch != run.branch and NS_END not in edit.ns)
            ):
                continue
            yield list(self.remit.writes(run.thread, edit.parent_id, ns=edit.ns))

    def _newer_than(self, thread: str, checkpoint_id: str) -> Iterator[CheckpointRecord]:
        """The thread's checkpoints (every namespace) newer than `checkpoint_id`, newest
        first, read a page at a time: a resume reads what was written after its head,
        not the thread's whole history (whose cost would grow with every pause)."""
        before = None
        while True:
            page = self.remit.history(thread, before_id=before, limit=_PAGE, verify=False)
            for record in page:
                if record.checkpoint_id <= checkpoint_id:
                    return
                yield record
            if len(page) < _PAGE:
                return
            before = page[-1].checkpoint_id

    def _refuse_later_question_of_edited_subgraph(
        self, run: Run, record: CheckpointRecord, here: Sequence[InterruptRecord]
    ) -> None:
        """`ResumeConflict` for a plain value whose one pending interrupt is a later
        question of a subgraph task whose namespace `update_state` has since edited:
        LangGraph runs that task again from its first question, which the value would
        answer in place of the one the resumer was shown (P5)."""
        pending = [i.interrupt_id for i in here if i.status == "pending"]
        if len(pending) != 1:
            return
        for writes in self._edited_subgraph_writes(run, record):
            askers = {
                w.task_id
                for w in writes
                if w.channel == INTERRUPT
                and any(
                    item.id == pending[0]
                    for item in _interrupts_in(self.saver._decode(w.value, run_id=run.thread))
                )
            }
            if any(w.channel == RESUME and w.task_id in askers for w in writes):
                raise ResumeConflict(
                    "the subgraph that asked was edited (update_state of its namespace) "
                    "after its task had answers to its earlier interrupts: LangGraph runs "
                    "the task again from its first question, which this value would answer "
                    "instead of the one pending; continue with invoke(None, config), which "
                    "asks them again under new interrupt ids, then resume each in turn. "
                    "Nothing was stored",
                    run_id=run.thread,
                    interrupt_id=pending[0],
                )

    def _asked_by_absent_nodes(
        self,
        loop: PregelLoop,
        run: Run,
        record: CheckpointRecord,
        writes: Sequence[WriteRecord],
        here: Sequence[InterruptRecord],
    ) -> dict[str, str]:
        """The interrupts pending at the head `record` (`here`; its `writes`) that nodes
        the graph now running does not have (recompiled without them) asked, with each
        node's name: LangGraph has no task to give their values to, and drops them. An
        edited pause's were asked at the checkpoint the edit continues."""
        asked: dict[str, tuple[CheckpointRecord, Sequence[WriteRecord]]] = {
            record.checkpoint_id: (record, writes)
        }
        for i in here:
            if i.checkpoint_id is not None and i.checkpoint_id not in asked:
                at, at_writes = self.remit.checkpoint_and_writes(run.thread, i.checkpoint_id)
                if at is not None:
                    asked[i.checkpoint_id] = (at, at_writes)
        gone: dict[str, str] = {}
        for asked_at, asked_writes in asked.values():
            gone.update(self._absent_askers(loop, run, asked_at, asked_writes))
        return gone

    def _absent_askers(
        self,
        loop: PregelLoop,
        run: Run,
        record: CheckpointRecord,
        writes: Sequence[WriteRecord],
    ) -> dict[str, str]:
        """`_asked_by_absent_nodes` at one checkpoint, `record`. A `Send` branch's node
        is the one its packet names, in the checkpoint's pending sends."""
        pull = "~__pregel_pull, "
        sends: Sequence[Any] | None = None
        gone: dict[str, str] = {}
        for w in writes:
            if w.channel != INTERRUPT:
                continue
            node: Any
            if w.task_path.startswith(pull):
                node = w.task_path[len(pull) :]
            elif _is_send_path(w.task_path):
                if sends is None:
                    values = self.saver._tuple(record, list(writes)).checkpoint["channel_values"]
                    sends = values.get(TASKS) or ()
                index = int(w.task_path.split(", ")[1])
                node = getattr(sends[index], "node", None) if index < len(sends) else None
            else:
                continue
            if not isinstance(node, str) or node in loop.nodes:
                continue
            for item in _interrupts_in(self.saver._decode(w.value, run_id=run.thread)):
                gone[item.id] = node
        return gone

    def _replaced_senders(
        self,
        loop: PregelLoop,
        run: Run,
        record: CheckpointRecord,
        writes: Sequence[WriteRecord],
    ) -> dict[str, int]:
        """The interrupts that `Send` branches asked at the head `record` (its `writes`)
        whose packets the command's `goto` replaces, with each branch's index: once the
        goto's `Send`s are written, they are the step's pending sends, and the branch
        at that index is another one (under the same task id, so the same interrupt
        id) or none, so the value would answer another question or be read by nothing.
        A goto that gives the same packet at the same index keeps the branch."""
        command = loop.input
        if not isinstance(command, Command) or not command.goto:
            return {}
        sent = [v for _, channel, v in map_command(command) if channel == TASKS]
        if not sent:
            return {}
        sends: Sequence[Any] | None = None
        replaced: dict[str, int] = {}
        for w in writes:
            if w.channel != INTERRUPT or not _is_send_path(w.task_path):
                continue
            if sends is None:
                values = self.saver._tuple(record, list(writes)).checkpoint["channel_values"]
                sends = values.get(TASKS) or ()
            index = int(w.task_path.split(", ")[1])
            if index < min(len(sent), len(sends)) and sent[index] == sends[index]:
                continue
            for item in _interrupts_in(self.saver._decode(w.value, run_id=run.thread)):
                replaced[item.id] = index
        return replaced

    def _consume(
        self,
        run: Run,
        here: Sequence[InterruptRecord],
        resume: Any,
        *,
        edited: bool = False,
        gone: Mapping[str, str] | None = None,
        replaced: Mapping[str, int] | None = None,
        failed: Sequence[str] = (),
        asked_again: Mapping[str, InterruptRecord] | None = None,
        riding: Sequence[WriteRecord] = (),
    ) -> dict[str, Any]:
        """Consume the interrupts of `here` that `resume` answers, and return the values
        by interrupt id (`edited`: they were
        asked before an `update_state` that the head is, or follows; `gone`: those
        asked by nodes the running graph lacks, by id, whose values nothing reads;
        `replaced`: those asked by `Send` branches the command's goto replaces;
        `failed`: the errors the head's tasks raised, if the last run failed;
        `asked_again`: the newest records of the questions asked again after their
        node refused an answer, by question id: a pending one takes the value;
        `riding`: writes stored with the first value, in its transaction)."""
        pending = {i.interrupt_id: i for i in here if i.status == "pending"}
        reasked = {iid: r for iid, r in (asked_again or {}).items() if r.status == "pending"}
        pending.update((i.interrupt_id, i) for i in here if i.interrupt_id in reasked)
        # An edit makes a checkpoint, and LangGraph gives the tasks it runs again new
        # ids: they ask under new interrupt ids, which a map by the old ones misses
        # (LangGraph drops the value and asks again).
        again = (
            "continue with invoke(None, config), which asks them again under new "
            "interrupt ids, then resume by those"
        )
        if edited and pending and _is_resume_map(resume):
            raise ResumeConflict(
                "the pause was edited (update_state) after its interrupts were asked, and "
                "its tasks ask again under new interrupt ids that this map does not name: "
                f"resume with a plain value if one is pending, or {again}. Nothing was stored",
                run_id=run.thread,
                interrupt_id=next(iter(resume)),
            )
        if isinstance(resume, dict) and not resume:
            # (LangGraph reads {} as a map that answers nothing: the node would ask again.)
            raise ResumeConflict(
                "an empty resume map answers no interrupt; pending: "
                f"{', '.join(sorted(pending)) or 'none'}. Nothing was stored",
                run_id=run.thread,
            )
        if _is_resume_map(resume):
            answers = dict(resume)
        elif len(pending) == 1:
            answers = {next(iter(pending)): resume}
            if edited and self._answered_before(run, next(iter(pending.values()))):
                raise ResumeConflict(
                    "the pause was edited (update_state) after its node had answers to its "
                    "earlier interrupts: LangGraph runs the node again from its first "
                    "question, which this value would answer instead of the one pending; "
                    f"{again}, in turn. Nothing was stored",
                    run_id=run.thread,
                    interrupt_id=next(iter(pending)),
                )
        elif here and not pending:
            after = (
                f", then the run failed ({'; '.join(failed)}): continue it with "
                "invoke(None, config), which runs the failed steps again with the consumed "
                "value"
                if failed
                else ""
            )
            raise ResumeConflict(
                f"no interrupt is pending at the head: it was already consumed{after}; the "
                "value was not stored",
                run_id=run.thread,
                interrupt_id=here[-1].interrupt_id,
            )
        elif not pending and failed:
            raise ResumeConflict(
                "the thread is not paused at an interrupt(): its last run failed "
                f"({'; '.join(failed)}); continue it with invoke(None, config), which runs "
                "the failed steps again. The value was not stored",
                run_id=run.thread,
            )
        elif not pending:
            raise ResumeConflict(
                "the thread is not paused at an interrupt(): it has finished, an "
                "update_state as the asking node answered it, or it paused before or after a "
                "node (interrupt_before/interrupt_after), which continues with "
                "invoke(None, config); the value was not stored",
                run_id=run.thread,
            )
        else:
            how = again if edited else "resume with Command(resume={interrupt_id: value, ...})"
            raise ResumeConflict(
                f"{len(pending)} interrupts are pending ({', '.join(sorted(pending))}); {how}",
                run_id=run.thread,
            )
        for iid in answers:
            if gone and iid in gone:
                raise ResumeConflict(
                    f"this interrupt was asked by node {gone[iid]!r}, which the graph that "
                    "runs does not have (it was compiled without it): LangGraph would end "
                    "the run with the value read by nothing. Nothing was stored; resume "
                    "with the graph that has the node (a saver's workflow_version tells "
                    "the two graphs apart)",
                    run_id=run.thread,
                    interrupt_id=iid,
                )
            if replaced and iid in replaced:
                raise ResumeConflict(
                    f"this interrupt was asked by the Send branch at index {replaced[iid]}, "
                    "which this command's goto replaces: LangGraph runs the goto's Send "
                    "packets in place of the step's pending ones, so the value would answer "
                    "another branch's question or be read by nothing. Nothing was stored; "
                    "resume without a Send in goto, or give the goto the pending branch's "
                    "Send at the same index first",
                    run_id=run.thread,
                    interrupt_id=iid,
                )
        known = {i.interrupt_id: i for i in here}
        for iid, value in answers.items():
            interrupt = (
                reasked.get(iid)
                or known.get(iid)
                or self.remit.interrupt(run.thread, iid, branch=run.branch)
            )
            policy.check_consumable(interrupt, run.thread, iid)
            if iid not in known:  # an earlier pause's (pending there only if never answered)
                raise ResumeConflict(
                    "this interrupt belongs to an earlier pause of the thread, not to its "
                    "head; the value was not stored",
                    run_id=run.thread,
                    interrupt_id=iid,
                )
            assert interrupt is not None
            if interrupt.prompt is not None:
                schema = codec.loads(interrupt.prompt).get("response_schema")
                if isinstance(schema, Mapping):
                    _check_answer(schema, value, run.thread, iid)
        # Every value is checked and encoded before the first is consumed: a map with
        # one refused value consumes none of its interrupts.
        packed = {
            iid: self.saver._dump(value, "resume", run_id=run.thread, interrupt_id=iid)
            for iid, value in answers.items()
        }
        for iid, value in packed.items():
            target = reasked[iid].interrupt_id if iid in reasked else iid
            self.remit.consume(
                run.thread, target, value, branch=run.branch, fence=run.fence, writes=riding
            )
            riding = ()
        return answers

    def _failed(self, run: Run, writes: Sequence[WriteRecord]) -> list[str]:
        """The errors the tasks of a checkpoint raised (its `writes`), each with its
        node where the task is one: the last run on it failed there."""
        failed = []
        for w in writes:
            if w.channel != ERROR:
                continue
            error = self.saver._decode(w.value, run_id=run.thread)
            head, _, node = w.task_path.partition(", ")
            failed.append(
                f"node {node!r}: {error}" if head == "~__pregel_pull" and node else str(error)
            )
        return failed

    def _answered_before(self, run: Run, interrupt: InterruptRecord) -> bool:
        """Whether `interrupt` is a later question of the task that asked it: the task
        had answers (its own resume write on the checkpoint it asked at), and this is
        not its first question (whose id is that of the task's namespace)."""
        writes = self.remit.writes(run.thread, interrupt.checkpoint_id or "")
        asker = next(
            (
                w.task_id
                for w in writes
                if w.channel == INTERRUPT
                and any(
                    i.id == interrupt.interrupt_id
                    for i in _interrupts_in(self.saver._decode(w.value, run_id=run.thread))
                )
            ),
            None,
        )
        if asker is None or not any(w.channel == RESUME and w.task_id == asker for w in writes):
            return False
        loop = None if run.loop is None else run.loop()
        names = () if loop is None else loop.nodes
        first = {Interrupt.from_ns(None, f"{name}:{asker}").id for name in names}
        return interrupt.interrupt_id not in first

    def _redeliver(
        self,
        loop: PregelLoop,
        run: Run,
        writes: Sequence[WriteRecord],
        here: Sequence[InterruptRecord],
    ) -> None:
        """Give consumed values back to the tasks that did not finish with them (P5 recovery)."""
        owed = self._owed(run, writes, here)
        if owed:
            loop.config["configurable"][CONFIG_KEY_RESUME_MAP] = owed

    def _owed(
        self, run: Run, writes: Sequence[WriteRecord], here: Sequence[InterruptRecord]
    ) -> dict[str, Any]:
        """The consumed values of `here` whose tasks did not finish with them (a
        resumer died), by interrupt id."""
        consumed = [i for i in here if i.status == "consumed" and i.value is not None]
        if not consumed:
            return {}
        finished = {
            w.task_id for w in writes if w.channel not in (INTERRUPT, RESUME, "__error__", CALLS)
        }
        raised_by: dict[str, str] = {}
        for w in writes:
            if w.channel == INTERRUPT:
                value = self.saver._decode(w.value, run_id=run.thread)
                for item in _interrupts_in(value):
                    raised_by[item.id] = w.task_id
        # An answered interrupt that its task no longer raises was taken: the task
        # holds the value in its own resume write and went on to its next question.
        owed = {
            i.interrupt_id: self.saver._decode(i.value, run_id=run.thread)
            for i in consumed
            if i.value is not None
            and (i.interrupt_id in raised_by or not raised_by)
            and raised_by.get(i.interrupt_id) not in finished
        }
        # A value the asking node refused is not given back: the newest answer after
        # it is, and with none yet the node asks again.
        for iid, latest in self._asked_again(run, here, writes).items():
            if iid not in owed:
                continue
            if latest.value is None:
                del owed[iid]
            else:
                owed[iid] = self.saver._decode(latest.value, run_id=run.thread)
        return owed

    # -- run end -----------------------------------------------------------------
    def attach(self, loop: PregelLoop, run: Run) -> None:
        """Bind `run` to this context and release it when the loop exits (or is dropped)."""
        token = _current.set(run)
        release = run.claim.release  # a second call is a no-op
        _check_outputs(loop, run, run.check)
        opened = self._open
        opened[id(run)] = run
        # A loop whose __enter__ fails never unwinds its stack: when it is dropped, the
        # run is forgotten and its claim released by the next run start here or by the
        # lease keeper (`_dropped`). A finalizer runs wherever the garbage collector
        # does, maybe in a thread holding a lock: it takes none, makes no round trip.
        dropped = weakref.finalize(loop, _dropped, opened, id(run), self._dropped, run.claim)

        def reset() -> None:
            dropped.detach()
            opened.pop(id(run), None)
            try:
                _current.reset(token)
            except ValueError:  # exited from another context
                _current.set(None)

        if isinstance(loop, AsyncPregelLoop):

            async def afinish() -> None:
                reset()
                if run.claim.released:  # given up with the run's last commit
                    release()
                else:
                    await asyncio.to_thread(release)

            loop.stack.push_async_callback(afinish)
        elif isinstance(loop, SyncPregelLoop):

            def sync_finish() -> None:
                reset()
                release()

            loop.stack.callback(sync_finish)

    # -- the writes a run makes ------------------------------------------------------
    def before_put(
        self,
        thread: str,
        ns: str,
        checkpoint_id: str,
        values: Mapping[str, Any],
        changed: Any,
        caller: StateCheck | None,
    ) -> Run | None:
        """Check a checkpoint about to be committed; returns the run it belongs to.

        `caller` is the check of the graph that called the saver outside a run
        (`update_state`), found by `learn`.
        """
        run = self.active(thread)
        ids = {"run_id": thread, "checkpoint_id": checkpoint_id}
        # LangGraph chains its puts: a put after a refused one fails with it. A
        # put after a refused task write carries the refused value, and fails here.
        # A run's schema is its graph's, a subgraph's for the subgraph's namespace.
        # An edit's is the graph that edits: a subgraph's, for its namespace (LangGraph
        # hands `update_state` of a subgraph's task config to the subgraph itself).
        check = caller if run is None else run.check if ns == "" else run.checks.get(ns)
        if check is not None:
            try:
                check.values(values, keys=changed, **ids)
            except RemitError as exc:
                if run is not None:
                    run.fail(exc)
                raise
        return run

    def before_writes(
        self,
        thread: str,
        ns: str,
        checkpoint_id: str,
        task_id: str,
        writes: Sequence[tuple[str, Any]],
    ) -> Run | None:
        """Check a task's writes; refuse them if the run already failed or consume a resume."""
        run = self.owner(thread, checkpoint_id)
        ids = {"run_id": thread, "checkpoint_id": checkpoint_id}
        if run is not None and run.failed is not None and checkpoint_id not in run.committed:
            raise run.failed
        if run is None:
            check = self.declared if ns == "" else None
        else:  # (a subgraph's writes hold to its own schema)
            check = run.check if ns == "" else run.checks.get(ns)
        if check is not None and (run is None or task_id not in run.sends_checked):
            try:
                ref = None if run is None else run.loop if ns == "" else run.nested.get(ns)
                loop = None if ref is None else ref()
                channels = None if loop is None else loop.channels
                check.writes(writes, channels, **ids)
                check.after(channels, writes, **ids)
            except RemitError as exc:
                if run is not None:
                    run.fail(exc)
                raise
        if ns == "" and task_id == NULL_TASK_ID and run is None:
            for channel, value in writes:
                if channel == RESUME:
                    self._consume_direct(thread, checkpoint_id, value)
        return run

    def _consume_direct(self, thread: str, checkpoint_id: str, value: Any) -> None:
        """A resume write that no run loop announced: consume the interrupt it answers now."""
        record = self.remit.checkpoint(thread, checkpoint_id)
        branch = record.branch if record is not None else MAIN_BRANCH
        pending = self.remit.interrupts(
            thread, branch=branch, checkpoint_id=checkpoint_id, status="pending"
        )
        if not pending:
            raise ResumeConflict(
                "no interrupt is pending on this checkpoint; the resume value was not stored",
                run_id=thread,
                checkpoint_id=checkpoint_id,
            )
        packed = self.saver._dump(value, "resume", run_id=thread)
        self.remit.consume(thread, pending[0].interrupt_id, packed, branch=branch)

    def after_writes(
        self,
        run: Run | None,
        thread: str,
        ns: str,
        checkpoint_id: str,
        writes: Sequence[tuple[str, Any]],
    ) -> None:
        """Record the interrupts a task raised at the top level, as pending (P5)."""
        if ns != "":
            return
        raised = [
            i for channel, value in writes if channel == INTERRUPT for i in _interrupts_in(value)
        ]
        if not raised:
            return
        if run is not None:
            branch = run.branch
        else:
            record = self.remit.checkpoint(thread, checkpoint_id)
            branch = record.branch if record is not None else MAIN_BRANCH
        self.remit.open_interrupts(
            thread,
            _prompts(raised),
            branch=branch,
            checkpoint_id=checkpoint_id,
            fence=None if run is None else run.fence,
        )

    def after_failed(
        self,
        run: Run | None,
        ns: str,
        checkpoint_id: str,
        task_id: str,
        writes: Sequence[tuple[str, Any]],
    ) -> None:
        """Open the question of top-level task `task_id` anew if its node refused the
        answer it was given (its writes are an error LangGraph marks so):
        `interrupt(..., response_schema=T)` validates a value by `T` itself (a model's
        own validators), which the JSON Schema checked before the consume cannot
        express. LangGraph stores nothing of such an answer and takes the next one;
        here the consumed record stays consumed, and the next answer consumes a record
        of its own (`_again_id`), once (P5). The same holds for an answered task whose
        output the state schema refused (`Run.unrefused`)."""
        if run is None or ns != "":
            return
        # (A subgraph's task whose output was refused fails its parent task with the
        # same error: the question the parent task asked for it opens again too.)
        refused = {id(e) for e in run.refused.values()}
        if not any(
            channel == ERROR
            and isinstance(value, BaseException)
            and (is_invalid_resume(value) or id(value) in refused)
            for channel, value in writes
        ):
            return
        asked = [
            item.id
            for w in self.remit.writes(run.thread, checkpoint_id)
            if w.channel == INTERRUPT and w.task_id == task_id and w.ns == ""
            for item in _interrupts_in(self.saver._decode(w.value, run_id=run.thread))
        ]
        for iid in asked:
            first = self.remit.interrupt(run.thread, iid, branch=run.branch)
            if first is None or first.status != "consumed":
                continue
            n, latest = self._answered_again(run, iid)
            if latest is not None and latest.status == "pending":
                continue
            self.remit.open_interrupts(
                run.thread,
                {_again_id(iid, n + 1): first.prompt},
                branch=run.branch,
                fence=run.fence,
            )

    def _answered_again(self, run: Run, iid: str) -> tuple[int, InterruptRecord | None]:
        """How often question `iid` was asked again after a refused answer, and the
        newest record of it (None if never)."""
        n, latest = 0, None
        while (
            again := self.remit.interrupt(run.thread, _again_id(iid, n + 1), branch=run.branch)
        ) is not None:
            n, latest = n + 1, again
        return n, latest

    def _asked_again(
        self, run: Run, here: Sequence[InterruptRecord], writes: Sequence[WriteRecord]
    ) -> dict[str, InterruptRecord]:
        """The newest record of each consumed question of `here` whose asking task
        failed on the checkpoint (`writes`) and that was asked again after its answer
        was refused, by the question's id."""
        failed = {w.task_id for w in writes if w.channel == ERROR}
        if not failed:
            return {}
        asked_by = {
            item.id: w.task_id
            for w in writes
            if w.channel == INTERRUPT and w.ns == ""
            for item in _interrupts_in(self.saver._decode(w.value, run_id=run.thread))
        }
        again = {}
        for i in here:
            if i.status == "consumed" and asked_by.get(i.interrupt_id) in failed:
                _, latest = self._answered_again(run, i.interrupt_id)
                if latest is not None:
                    again[i.interrupt_id] = latest
        return again

    def upgrade(self, record: CheckpointRecord, values: dict[str, Any]) -> dict[str, Any]:
        check = self.declared
        if check is None or record.schema_version == check.version:
            return values
        return check.upgrade(
            values, record.schema_version, run_id=record.run_id, checkpoint_id=record.checkpoint_id
        )


def _dropped(
    opened: dict[int, Run], key: int, claims: collections.deque[ClaimHandle], claim: ClaimHandle
) -> None:
    """A dropped loop's run: forgotten, its claim released by the next run start or
    the lease keeper, whichever comes first (each step is atomic, and takes no lock)."""
    opened.pop(key, None)
    claims.append(claim)
    claim.release_soon()


def _schema_types(graph: Pregel[Any, Any, Any, Any], builder: Any) -> list[Any]:
    """The types a graph declares: its builder's schemas, or, for a graph with no
    builder (an `@entrypoint`), the type hints of the functions its nodes run: the
    entrypoint's input, return and saved types, which LangGraph stores as they are.
    (Its channels carry them too, but as strings under `from __future__ import
    annotations`; the hints resolve them, and `entrypoint.final[R, S]` is R and S.)"""
    if builder is not None:
        schemas = [builder.state_schema, builder.input_schema, builder.output_schema]
        return schemas + [node.input_schema for node in builder.nodes.values()]
    hints: list[Any] = []
    for node in graph.nodes.values():
        for fn in (getattr(node.bound, "func", None), getattr(node.bound, "afunc", None)):
            with contextlib.suppress(Exception):  # (an unresolvable hint names nothing)
                hints += typing.get_type_hints(fn).values()
    return [t for h in hints for t in (get_args(h) if get_origin(h) is entrypoint.final else [h])]


def _check_outputs(loop: PregelLoop, run: Run, check: StateCheck | None) -> None:
    """Check each node's output against the state schema of `loop`'s graph (`check`:
    the run's, or a subgraph's own) as the node hands it over.

    LangGraph applies a task's writes to its channels before (in "async"
    durability: while) the saver stores them, and in "exit" durability the
    saver never sees them: the next step would read the refused value, and a
    Pydantic state would fail there with LangGraph's own error. Checked in the
    node, a refused output fails its node as any node error does: `CheckpointInvalid`
    reaches the caller, nothing of the output is applied, the head stays where
    it was (P4). The loop is held weakly: its exit callbacks release the claim.
    """
    if check is None:
        return
    tick, held = type(loop).tick, weakref.ref(loop)
    checked, whole, refused = run.sends_checked, check.checks_whole, run.refused
    # The run's quick tests, as of its channels (inlined below: they run once per node).
    quick, fields = check.quick_tests()

    def checked_tick() -> bool:
        current = held()
        assert current is not None  # (a tick is a call on the loop)
        going = tick(current)
        if going:
            checkpoint_id = current.checkpoint["id"]
            for task in current.tasks.values():
                if not task.writes:  # (a task with writes is not run again)
                    conf = task.config[CONF]
                    conf[CONFIG_KEY_SEND] = functools.partial(
                        checked_send, conf[CONFIG_KEY_SEND], task.id, checkpoint_id
                    )
                    checked.add(task.id)
        return going

    def checked_send(
        send: Callable[[Sequence[tuple[str, Any]]], None],
        task_id: str,
        checkpoint_id: str,
        writes: Sequence[tuple[str, Any]],
    ) -> None:
        """What a task's writers hand its writes to: checked, then sent on. Most
        outputs hold as they stand (`StateCheck.quick_tests`); the rest get the full check."""
        writes = list(writes)
        full = whole or bool(refused)
        if not full:
            for ch, v in writes:
                test = quick.get(ch)
                if test is None:
                    if ch in fields:
                        full = True
                        break
                elif not test(v):
                    full = True
                    break
        if full:
            _check_send(run, check, held, task_id, writes, checkpoint_id)
        send(writes)

    match, amatch = type(loop).match_cached_writes, type(loop).amatch_cached_writes

    def checked_hits(tasks: Sequence[PregelExecutableTask]) -> Sequence[PregelExecutableTask]:
        """A cache hit hands a node's cached writes over without running the node, so
        not through `checked_send`: a cache filled by another graph, or keyed by a
        `key_func` that leaves out what the schema bounds, may hold an output this
        state refuses. Refused here, before LangGraph stores or applies it, it fails
        the run and no next step reads it."""
        current = held()
        assert current is not None  # (a match is a call on the loop)
        for task in tasks:
            try:
                _check_send(run, check, held, task.id, list(task.writes), current.checkpoint["id"])
            except RemitError:
                task.writes.clear()
                raise
        return tasks

    def checked_match() -> Sequence[PregelExecutableTask]:
        current = held()
        assert current is not None
        return checked_hits(match(current))

    async def checked_amatch() -> Sequence[PregelExecutableTask]:
        current = held()
        assert current is not None
        return checked_hits(await amatch(current))

    loop.tick = checked_tick  # type: ignore[method-assign]
    if loop.cache is not None:  # (without a cache, LangGraph matches nothing)
        loop.match_cached_writes = checked_match  # type: ignore[method-assign]
        loop.amatch_cached_writes = checked_amatch  # type: ignore[method-assign]


def _check_send(
    run: Run,
    check: StateCheck,
    held: weakref.ref[PregelLoop],
    task_id: str,
    writes: list[tuple[str, Any]],
    checkpoint_id: str,
) -> None:
    """Check a task's output against its graph's state schema: `CheckpointInvalid`
    refuses it (and the run stores nothing more, unless a retry's output is taken)."""
    refused = run.refused
    ids = {"run_id": run.thread, "checkpoint_id": checkpoint_id}
    try:
        loop = held()
        channels = None if loop is None else loop.channels
        check.writes(writes, channels, **ids)
        if check.checks_whole:
            check.after(channels, writes, **ids)
        if loop is not None:
            # What the step's other finished tasks wrote is applied with this output.
            earlier = (
                w for t in loop.tasks.values() if t.id != task_id and t.writes for w in t.writes
            )
            check.totals(channels, writes, earlier, **ids)
    except RemitError as exc:
        refused[task_id] = exc
        raise
    if refused:
        refused.pop(task_id, None)  # (a retry's output was taken)


def _check_answer(schema: Mapping[str, Any], value: Any, thread: str, iid: str) -> None:
    """Check a resume value against its interrupt's `response_schema` (a JSON Schema),
    or raise `CheckpointInvalid` that says it is the answer, not the state, that the
    schema refuses, naming the field and the interrupt."""
    try:
        StateSchema(schema).validate(_json_form(value), run_id=thread, interrupt_id=iid)
    except CheckpointInvalid as error:
        where = error.field or "<root>"
        _, _, why = error.message.partition(f" at {where}: ")
        raise CheckpointInvalid(
            f"the resume value for interrupt {iid!r} does not satisfy the interrupt's "
            f"response_schema at {where}: {why or error.message}; the value was not "
            "stored and the interrupt is still pending",
            field=error.field,
            run_id=thread,
            interrupt_id=iid,
        ) from error


def _json_form(value: Any) -> Any:
    """What a JSON Schema sees of `value`: a model or dataclass as its JSON data
    (a resume may be an instance of the interrupt's `response_schema`)."""
    try:
        return to_jsonable_python(value, by_alias=True)
    except PydanticSerializationError:
        return value  # no JSON form: the schema check refuses it, naming the value


def _json_or_none(schema: Any) -> Any:
    """A response schema as plain JSON (LangGraph stores it as a JSON Schema dict)."""
    try:
        codec.dumps(schema)
    except TypeError:
        return None
    return schema


# -- effects (P2) -------------------------------------------------------------------


def effect_scope() -> StepScope | None:
    """The step scope of the LangGraph node now running under a Remit run, if any.

    The step key is the task's identity on its branch: namespace (the task's
    own id dropped, so a replay after a crash in "exit" durability keys the
    same), step number and task path. Registered with the core at import.
    """
    run = current_run() or _closed_under()
    try:
        config = get_config()
    except RuntimeError:
        return None
    conf = config.get("configurable") or {}
    if run is None or str(conf.get("thread_id")) != run.thread:
        runs = getattr(conf.get(CONFIG_KEY_CHECKPOINTER), "_runs", None)
        run = runs.of_task(conf) if isinstance(runs, Runs) else None  # (`Runs.of_loop`)
    if run is None:
        return None
    meta = config.get("metadata") or {}
    if "langgraph_step" not in meta or str(conf.get("thread_id")) != run.thread:
        return None
    if run.claim.given_up and run.remit.closed:
        raise StoreUnavailable(
            f"the saver over {display_url(run.remit.store.url)} was closed while this run "
            "was in flight (its claim was given up): its effect was not applied, and "
            "nothing more of it is stored; continue the thread with an open saver",
            run_id=run.thread,
        )
    if _on_event_loop():
        # An async node's effect: the commit in flight is not waited for here, which
        # would hold the event loop (every other run of the server) for it. The
        # effect's own intent write carries the fence, so a claim that commit finds
        # taken over or given up refuses the effect as well (L2).
        run.ensure_live()
    else:
        run.settle()
    parts = str(conf.get("checkpoint_ns", "")).split("|")
    # The node's own task: its step and path below; each enclosing task by its place.
    parts = [run.task_identity("|".join(parts[:i]), part) for i, part in enumerate(parts[:-1])] + [
        parts[-1].split(":", 1)[0]
    ]
    step = meta["langgraph_step"]
    task, path = "|".join(parts), meta.get("langgraph_path")
    step_key = f"{run.branch}{run.life()}/{task}/{step}/{path}"
    place = f"{task}/{path}"
    task_id = str(conf.get("checkpoint_ns", "")).partition(":")[2]
    if len(parts) > 1:
        call = _call_task(run, str(conf.get("checkpoint_ns", "")))
        if call is None:  # a subgraph's task: its calls are not shared with a fork
            return _attempt_scope(run, conf, StepScope(run.remit, run.thread, step_key, run.fence))
        # A functional-API task (`@task` called from a task of the graph's own loop):
        # its writes are the loop's, so it is shared with a fork as a node is. Its
        # calls are recorded for a fork only when it runs before the loop's checkpoint
        # paused: one first run after the answer belongs to the branch that answered
        # (a fork asks again), while one run again after it finds what it shared.
        task_id, place = call
        loop = None if run.loop is None else run.loop()
        if loop is None or loop.checkpoint["id"] == run.past_pause:
            shared = run.shared.get(f"{step}/{place}", [])
            return _attempt_scope(
                run, conf, SharedScope(run.remit, run.thread, step_key, run.fence, shared=shared)
            )
    calls = _task_calls(run, task_id, step, place, step_key)
    return _attempt_scope(
        run,
        conf,
        SharedScope(
            run.remit, run.thread, step_key, run.fence, counts=calls.counts, shared=calls.shared
        ),
    )


#: How many task attempts' scopes a run keeps (`_attempt_scope`): far more than run at once.
_ATTEMPTS_KEPT = 256


def _attempt_scope(run: Run, conf: Mapping[str, Any], scope: StepScope) -> StepScope:
    """The scope of the task attempt whose config is `conf`: `scope`, unless a call of
    the same attempt found one first, in another context.

    A node may run its calls in threads or tasks of its own, each with a copy of the
    node's context made before any effect was called (LangGraph's `ToolNode` runs
    the tool calls of one message so, `asyncio.gather` runs coroutines so): each copy
    would find a scope of its own, count from 0, and every call would get the first
    call's key, and its recorded outcome instead of being applied (P2). The calls of
    one attempt share its `Runtime`'s execution info (task id, attempt number, first
    attempt's start: a value, so nothing of the run is held), and so one scope; a
    retry of the node is a new attempt, which numbers its calls from 0 again and gets
    the outcomes of the attempt before it."""
    info = getattr(conf.get(CONFIG_KEY_RUNTIME), "execution_info", None)
    if info is None:
        return scope
    key = (info, scope.step_key)
    try:
        hash(key)
    except TypeError:  # (a runtime of another kind: each context numbers its own calls)
        return scope
    with run._attempts_lock:
        held = run.attempts.get(key)
        if held is not None:
            run.attempts.move_to_end(key)
            return held
        run.attempts[key] = scope
        while len(run.attempts) > _ATTEMPTS_KEPT:
            run.attempts.popitem(last=False)
    return scope


def _on_event_loop() -> bool:
    """Whether this thread is running an asyncio event loop now."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _closed_under() -> Run | None:
    """The run of this context if its saver was closed while its loop runs on
    (`Remit.close` gave its claim up): `current_run` no longer names it, but a node
    of it that calls an effect gets `StoreUnavailable`, as its writes do, not the
    error of an effect called outside any run."""
    run = _current.get()
    loop = None if run is None or run.loop is None else run.loop()
    return run if run is not None and loop is not None and run.remit.closed else None


def _call_task(run: Run, ns: str) -> tuple[str, str] | None:
    """The id and place of the task of namespace `ns` if it is one of the run's own
    loop (a functional-API call, stored with the loop's checkpoint), else None."""
    loop = None if run.loop is None else run.loop()
    name, _, task_id = ns.rpartition("|")[2].partition(":")
    task = None if loop is None else loop.tasks.get(task_id)
    if task is None:
        return None
    meta = task.config.get("metadata") or {}
    return task_id, f"{name}/{meta.get('langgraph_path')}"


def _task_calls(run: Run, task_id: str, step: Any, place: str, step_key: str) -> TaskCalls:
    """The effect calls of the run's top-level task `task_id` (made at its first call)."""
    calls = run.calls.get(task_id)
    if calls is None:
        shared = run.shared.get(f"{step}/{place}", [])
        calls = run.calls.setdefault(task_id, TaskCalls(place, step_key, shared=shared))
    return calls


def calls_at_pause(run: Run, task_id: str) -> TaskCalls | None:
    """The effect calls of a top-level task of the run that stores its pause: its
    first writes on the checkpoint, though it writes again there once answered.
    Recorded even when it made none, so that a fork of the pause shares only the
    calls made before it, not those its answered run makes (`_shared_effects`)."""
    loop = None if run.loop is None else run.loop()
    task = None if loop is None else loop.tasks.get(task_id)
    if task is None:
        return run.calls.get(task_id)
    meta = task.config.get("metadata") or {}
    if "langgraph_step" not in meta:
        return run.calls.get(task_id)
    step, path = meta["langgraph_step"], meta.get("langgraph_path")
    place = f"{task.name}/{path}"
    step_key = f"{run.branch}{run.life()}/{task.name}/{step}/{path}"
    return _task_calls(run, task_id, step, place, step_key)


register_scope_resolver(effect_scope)
