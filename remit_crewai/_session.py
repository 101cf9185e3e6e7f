"""Which flow this process drives, and in which kickoff: sessions and execution context.

A `Session` is one process's hold on one flow id while it drives it: the
claim (with its heartbeat), the head it continues from and the ledger. The
`Registry` keeps them per process, keyed by store URL and flow id, so every
persistence instance on one store shares them, and a forked child starts with
none. A `from_pending` resumer's session is also kept in its own context
(`current_resumers`): if its lease lapses and another resumer's session takes
the registry's place, the late resumer still finds its own, whose claim then
refuses it. `Execution` is what the EXECUTION_START hook learned about a
kickoff, for the persistence calls CrewAI makes later in the same context.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from pydantic import BaseModel

from remit_core.core import ClaimHandle
from remit_core.records import FenceRef, InterruptRecord
from remit_core.stores.sqlite import sqlite_path
from remit_crewai._ledger import Ledger, Replay

#: URL options that tune a connection or its pool, not which database it reaches.
_TUNING = frozenset(
    {
        "busy_timeout",
        "synchronous",
        "min_size",
        "max_size",
        "idle_txn_timeout_ms",
        "connect_timeout",
        "application_name",
        "sslmode",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "health_check_interval",
        "max_connections",
        "retry_on_timeout",
        "client_name",
    }
)
_PORTS = {"postgresql": 5432, "redis": 6379, "rediss": 6379}


def store_identity(url: str) -> str:
    """The database `url` reaches, as one string for all the spellings certain to reach it:
    a SQLite file by its real path, a server without its default port (and Redis database
    0), options that only tune the connection left out. Sessions are kept by it, so that
    persistences on two spellings of one store take turns as one. Anything unclear (a
    URL that does not parse, another host name for one address) stays a store apart."""
    try:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "sqlite":
            path = sqlite_path(url)
            return url if path == ":memory:" else f"sqlite:{os.path.realpath(path)}"
        scheme = "postgresql" if scheme == "postgres" else scheme
        if scheme not in _PORTS:
            return url
        options = sorted(
            (k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in _TUNING
        )
        where = parts.path
        if scheme != "postgresql":
            db = dict(options).pop("db", None) or unquote(where.strip("/")) or "0"
            options, where = [(k, v) for k, v in options if k != "db"], f"/{db}"
        user = "" if parts.username is None else unquote(parts.username)
        host = (parts.hostname or "").lower()
        port = parts.port or (_PORTS[scheme] if host else None)
        return f"{scheme}://{user}@{host}:{port}{where}?{options}"
    except ValueError:
        return url


def pinned_url(url: str) -> str:
    """`url` with a relative SQLite path made absolute against the working directory now.

    The store opens its file lazily (and again in a forked child), and sessions are
    kept by the file's real path: resolved later, a relative path would name another
    file once the process (or a step of a flow) changed its working directory, and the
    flow's own saves would find neither its session nor its store."""
    if urlsplit(url).scheme.lower() != "sqlite":
        return url
    path = sqlite_path(url)
    if path == ":memory:" or os.path.isabs(path):
        return url
    query = urlsplit(url).query
    return f"sqlite:///{os.path.abspath(path)}" + (f"?{query}" if query else "")


#: The order in which kickoffs and resumes began in this process (`Execution.begun`,
#: `Session.begun`): CrewAI starts no execution for a resume, which runs in the context
#: of the kickoff current where it is called.
_began = itertools.count()

#: The fork token `kickoff(restore_from_state_id=...)` forks under (see `fork_token`).
current_fork_token: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "remit_crewai_fork_token", default=None
)


@contextlib.contextmanager
def fork_token(token: str) -> Iterator[None]:
    """Let `kickoff(restore_from_state_id=S)` inside the block fork S under `token`.

    The fork's flow id follows from S and the token, so presenting the same
    token again (from any process) continues the same fork instead of making
    a second one. Without a token such a kickoff is refused (`ForkWithoutIntent`).
    """
    if not isinstance(token, str):
        raise TypeError(f"a fork token must be a str, got {type(token).__name__}")
    if not token:
        raise ValueError("a fork token must be a non-empty string")
    reset = current_fork_token.set(token)
    try:
        yield
    finally:
        current_fork_token.reset(reset)


#: The fork token of the latest streaming kickoff of a flow instance called inside a
#: `fork_token` block, not run yet (id -> the instance, the token): see `streaming_under`.
_streaming: dict[int, tuple[weakref.ref[Any], str]] = {}


def streaming_under(flow: Any, token: str | None) -> None:
    """Note the fork token current where a streaming kickoff of `flow` (`stream = True`)
    was called. CrewAI runs such a flow only when the frames are read, in a thread or
    task of that place's context, which may be after the `fork_token` block the kickoff
    was called in (a web handler returns the stream): the run takes this token
    (`streamed_token`)."""
    key = id(flow)
    if token is None:
        _streaming.pop(key, None)
        return

    def forget(ref: weakref.ref[Any], key: int = key) -> None:
        if _streaming.get(key, (None,))[0] is ref:
            del _streaming[key]

    _streaming[key] = (weakref.ref(flow, forget), token)


def streamed_token(flow: Any) -> str | None:
    """The fork token the streaming kickoff of `flow` that now starts running was called
    under (`streaming_under`), taken: None for any other kickoff."""
    noted = _streaming.get(id(flow))
    if noted is None or noted[0]() is not flow:
        return None
    del _streaming[id(flow)]
    return noted[1]


@dataclass(eq=False)
class Execution:
    """One kickoff of a Remit-backed flow, as the interception hooks saw it begin.

    `restart`: the flow id `inputs["id"]` asks to continue; `refusal`: why it
    may not (raised by `load_state`, since CrewAI swallows errors of hooks);
    `stepping`: a step began, so later `load_state` calls are plain reads;
    `outer`: the kickoff this one runs inside (a flow awaited in another's
    step), current again when this one ends; `over`: it ended (a save still
    running in a worker thread of a cancelled kickoff drives nothing);
    `left`: per flow id, the head this kickoff left when it gave the flow up
    (ended or paused), which a save still running in its threads may only
    follow (`RemitFlowPersistence._writing`); `begun`: when it began, against the
    resumes of this context (`late_resume`); `carried`: per method, how often it
    completed before the checkpoint CrewAI restored a new flow from (`Flow.fork`, or
    `from_checkpoint` of a flow this store has no checkpoint of), which the flow's
    first save records as completed (`RemitFlowPersistence._step_session`).
    """

    flow: weakref.ref[Any]
    inputs: dict[str, Any] | None
    fork_token: str | None
    outer: Execution | None = None
    restart: str | None = None
    carried: dict[str, int] | None = None
    refusal: BaseException | None = None
    stepping: bool = False
    over: bool = False
    left: dict[str, str | None] = field(default_factory=dict)
    begun: int = field(default_factory=lambda: next(_began))


#: The kickoff now running in this context (set by the EXECUTION_START hook).
current_execution: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "remit_crewai_execution", default=None
)


@dataclass(eq=False)
class Session:
    """This process's hold on one flow id while it drives it.

    `routes`: what routers of the flow returned in this process, per (method,
    occurrence), recorded in the ledger by the save that completes them;
    `answered`, the same for feedback a provider gave at once (no pause).
    `output`: what the head's step returned, encoded (`Body.output`). `replay`:
    a restart's walk through the past it continues. `closed`: the session was released. `pid`: the
    process it belongs to (a forked child inherits its context, not its claims).
    """

    store_url: str
    flow_id: str
    run_id: str
    branch: str
    handle: ClaimHandle
    head: str | None
    ledger: Ledger
    state: dict[str, Any]
    beating: bool
    output: bytes | None = None
    owner: weakref.ref[Any] | None = None
    #: The interrupt a `from_pending` resume consumes once its value is known.
    pending: InterruptRecord | None = None
    state_type: type[BaseModel] | None = None
    #: The model the head's state was saved as (`module.Qualname`), None for a dict state.
    model: str | None = None
    #: The flow class that wrote the head (`module.Qualname`), recorded with each commit.
    flow_class: str | None = None
    #: The keys of that class's `initial_state` dict (a dict state's defaults) as it wrote
    #: the head, recorded with each commit; None if not recorded (a model state).
    initial_keys: tuple[str, ...] | None = None
    routes: dict[tuple[str, int | None], str | None] = field(default_factory=dict)
    answered: dict[tuple[str, int | None], dict[str, Any]] = field(default_factory=dict)
    #: Occurrences of each method started in this process and not completed yet: two
    #: runs of one method at once (two routes to one listener) are two occurrences.
    running: dict[str, list[int]] = field(default_factory=dict)
    replay: Replay | None = None
    #: Occurrences (`method#n`) whose effects are keyed under the branch they first ran
    #: on: the pause a fork was made from, run again to pause again (`_paused_on`).
    keys_from: dict[str, str] = field(default_factory=dict)
    #: The JSON Schemas its checkpoints record (`state_schema`, `feedback_schema`).
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    closed: bool = False
    #: A `resume` of the flow runs under this session (a second one at once is refused).
    resuming: bool = False
    #: The conversational turn it drives ended: kept for CrewAI's save of the turn's reply,
    #: which comes after the run ended and completes no method, until the kickoff returns.
    turn_over: bool = False
    #: What the resume runs beside the paused method's listeners (`_resume`): the methods
    #: in flight when the flow paused that did not complete, and those that completed
    #: after the pause was saved, whose listeners never ran.
    leftovers: tuple[frozenset[str], frozenset[str]] | None = None
    pid: int = field(default_factory=os.getpid)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: When it was opened, against the kickoffs of its context (`late_resume`).
    begun: int = field(default_factory=lambda: next(_began))

    def start_occurrence(self, method: str) -> int:
        """The occurrence a run of `method` starting now is: the lowest that has not
        completed and is not running here."""
        with self.lock:
            running = self.running.setdefault(method, [])
            occurrence = self.ledger.free(method, running)
            running.append(occurrence)
            return occurrence

    def step_key(self, method: str, occurrence: int) -> str:
        """The effect scope of `occurrence` of `method`: branch, method, occurrence."""
        name = f"{method}#{occurrence}"
        key = f"{self.keys_from.get(name, self.branch)}/{name}"
        again = self.ledger.again(name)
        return key if again is None else f"{key}/asked-again-{again}"

    def end_occurrence(self, method: str, occurrence: int | None = None) -> None:
        """A run of `method` (`occurrence`, else its lowest running) completed (its
        completion is in the ledger now)."""
        with self.lock:
            running = self.running.get(method, [])
            if occurrence in running:
                running.remove(occurrence)
            elif running:
                running.remove(min(running))

    @property
    def fence(self) -> FenceRef:
        return self.handle.fence


#: The occurrence the step of each method begun in this context runs as, as (flow id,
#: method, occurrence), for the save that completes it (runs of one method at once may
#: complete out of order).
current_occurrences: contextvars.ContextVar[tuple[tuple[str, str, int], ...]] = (
    contextvars.ContextVar("remit_crewai_occurrences", default=())
)


def started_as(flow_id: str, method: str, occurrence: int) -> None:
    """Note that the step of `method` of `flow_id` begun in this context is `occurrence`."""
    kept = tuple(o for o in current_occurrences.get() if o[:2] != (flow_id, method))
    current_occurrences.set((*kept, (flow_id, method, occurrence)))


def occurrence_of(flow_id: str, method: str) -> int | None:
    """The occurrence the step of `method` of `flow_id` begun in this context runs as."""
    return next((n for f, m, n in current_occurrences.get() if (f, m) == (flow_id, method)), None)


#: Sessions `load_pending_feedback` opened in this context, newest last, for the resumes
#: that follow; released ones are dropped when the next is added.
current_resumers: contextvars.ContextVar[tuple[Session, ...]] = contextvars.ContextVar(
    "remit_crewai_resumers", default=()
)


#: Whether a `from_pending` runs in this context and has not loaded its pause yet: CrewAI's
#: `load_pending_feedback` call in it claims the flow for the resume; any other is a read.
current_from_pending: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "remit_crewai_from_pending", default=False
)


def add_resumer(session: Session) -> None:
    """Remember `session` as a resume's in this context."""
    kept = tuple(s for s in current_resumers.get() if not s.closed and s.pid == session.pid)
    current_resumers.set((*kept, session))


def resumer_of(store_url: str, flow_id: str) -> Session | None:
    """The newest open session a `from_pending` in this context made for `flow_id`."""
    here = (store_url, flow_id, os.getpid())
    for session in reversed(current_resumers.get()):
        if not session.closed and (session.store_url, session.flow_id, session.pid) == here:
            return session
    return None


def late_resume(store_url: str, flow_id: str) -> Session | None:
    """The session of the resume of `flow_id` that runs in this context, if it gave the
    flow up (paused, ended): a save made here now was left running by that resume, and
    may only follow the head it left (`head`). None if a resume made here still holds
    the flow (even an older one, whose claim then refuses it), if none was made here,
    or if the kickoff current here began after it."""
    if resumer_of(store_url, flow_id) is not None:
        return None
    ex = current_execution.get()
    here = (store_url, flow_id, os.getpid())
    for session in reversed(current_resumers.get()):
        if (session.store_url, session.flow_id, session.pid) == here:
            return None if ex is not None and session.begun < ex.begun else session
    return None


#: Flow instances whose run paused in this process (id -> the instance), not run since.
_paused: dict[int, weakref.ref[Any]] = {}


def pausing(flow: Any, paused: bool) -> None:
    """Note that the run of `flow` paused (True), or that it runs again (False): a step of
    a paused run that starts later (a sibling of the paused method, or one behind it)
    belongs to no run and must not claim the flow, which its resumer will drive."""
    key = id(flow)
    if not paused:
        ref = _paused.get(key)
        if ref is not None and ref() in (flow, None):
            del _paused[key]
        return

    def forget(ref: weakref.ref[Any], key: int = key) -> None:
        if _paused.get(key) is ref:
            del _paused[key]

    _paused[key] = weakref.ref(flow, forget)


def paused(flow: Any) -> bool:
    """Whether the run of `flow` paused in this process and has not run since."""
    ref = _paused.get(id(flow))
    return ref is not None and ref() is flow


class Registry:
    """Sessions of this process by (store, as `store_identity` names it; flow id), and
    the turns of saves made outside them (`turn`); a forked child starts with none."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._items: dict[tuple[str, str], Session] = {}
        #: Per (store URL, flow id): the lock of its turns, and how many hold or wait for it.
        self._turns: dict[tuple[str, str], tuple[threading.Lock, int]] = {}
        self._pid = os.getpid()

    def _here(self) -> dict[tuple[str, str], Session]:
        if self._pid != os.getpid():
            self._items, self._turns, self._pid = {}, {}, os.getpid()
        return self._items

    @contextlib.contextmanager
    def turn(self, store_url: str, flow_id: str) -> Iterator[None]:
        """This process's turn to claim `flow_id` for one save outside a session: such
        saves from several threads (parallel steps of a flow persisted per method)
        wait for each other instead of refusing each other's claim."""
        key = (store_url, flow_id)
        with self.lock:
            self._here()
            lock, holders = self._turns.get(key, (threading.Lock(), 0))
            self._turns[key] = (lock, holders + 1)
        try:
            with lock:
                yield
        finally:
            with self.lock:
                lock, holders = self._turns[key]
                if holders > 1:
                    self._turns[key] = (lock, holders - 1)
                else:
                    del self._turns[key]

    def get(self, store_url: str, flow_id: str) -> Session | None:
        with self.lock:
            return self._here().get((store_url, flow_id))

    def owned_by(self, flow: Any) -> Session | None:
        """The open session flow instance `flow` drives, under whichever flow id."""
        with self.lock:
            return next(
                (
                    s
                    for s in self._here().values()
                    if s.owner is not None and s.owner() is flow and not s.closed
                ),
                None,
            )

    def add(self, session: Session) -> None:
        with self.lock:
            self._here()[(session.store_url, session.flow_id)] = session

    def discard(self, session: Session) -> None:
        with self.lock:
            items = self._here()
            if items.get((session.store_url, session.flow_id)) is session:
                del items[(session.store_url, session.flow_id)]


sessions = Registry()
