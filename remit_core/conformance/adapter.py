"""The probe adapter interface: what a framework shim implements for `remit conformance`.

A shim ships `remit_<fw>/probe.py` with a module attribute `adapter`, an
instance of `ProbeAdapter`, registered under the entry point group
`remit.probe_adapters`. The adapter builds the contract's probe workflow in
its framework, once on the framework's own durable backend ("vanilla") and
once on Remit, and exposes the session operations the harness drives from
forked worker processes.

The probe workflow (CONTRACT.md), the same in every framework:

    prepare -> approve (interrupt: waits for a resume value) -> charge (effect
    "charge") -> notify (effect "notify") -> end

State: `ProbeState`, starting from `initial_state()`. Step bodies:

- prepare: `env.enter("prepare")`; amount = 100 (or -5 when
  `env.variant.invalid_step_write`); log += ["prepare"].
- approve: wait for the resume value (twice when `env.variant.multi_interrupt`,
  approved_by = "<v1>+<v2>"). Only once the value(s) arrived:
  `env.enter("approve")`, then `env.point("resume.after_accept")` (or where
  the backend acknowledges the resume value, if later); approved_by = value;
  log += ["approve"].
- charge: `env.enter("charge")`, `env.point("charge.before_effect")`,
  `env.effect("charge")`, `env.point("charge.after_effect")`; charged = True;
  log += ["charge"]. The adapter calls `env.point("charge.after_step")` where
  its framework records that charge completed (the step's outputs reached
  the backend), before the next checkpoint.
- notify: `env.enter("notify")`, `env.point("notify.before_effect")`,
  `env.effect("notify")`; log += ["notify"].

Every operation runs in a forked worker: open a `ProbeSession` per worker
with `ProbeAdapter.session(target, env)`. A failed operation raises; the
harness records the exception chain's class names and messages (so a
framework error wrapping a `RemitError` is still recognised). Nothing in an
adapter decides whether a cell passes.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from annotated_types import Ge, MinLen
from typing_extensions import TypedDict  # pydantic validates it on Python < 3.12

from remit_core.conformance.world import (
    EffectSink,
    Journal,
    WorldDB,
    current_resumer,
    current_run,
)
from remit_core.effects import arun_effect, run_effect
from remit_core.stores.sqlite import sqlite_path

#: The probe's steps, in order.
STEPS = ("prepare", "approve", "charge", "notify")
#: The probe's effects (one per step of the same name).
EFFECTS = ("charge", "notify")
#: Named crash points the probe reaches; the harness arms them per worker.
POINTS = frozenset(
    {
        "charge.before_effect",
        "charge.after_effect",
        "charge.after_step",
        "resume.after_accept",
        "notify.before_effect",
    }
)
#: What an armed point does: SIGKILL or SIGSTOP the worker process itself.
PointAction = Literal["kill", "stop"]

#: A valid resume value: a non-empty string (INVALID-RESUME-VALUE sends 12345).
ResumeValue = Annotated[str, MinLen(1)]


class ProbeState(TypedDict):
    """The probe's state schema: a Remit target validates every write against it."""

    order_id: str
    amount: Annotated[int, Ge(0)]
    approved_by: str | None
    charged: bool
    log: list[str]


def initial_state() -> ProbeState:
    """The input every probe run starts from (the same for every run, so states compare)."""
    return {"order_id": "order-1", "amount": 0, "approved_by": None, "charged": False, "log": []}


class NotApplicable(Exception):
    """Raised by an operation the framework cannot express at all; the cell reads N/A.

    The message is the reason shown in the matrix. Never raise it for a
    scenario the framework can express but gets wrong.
    """


# -- targets ---------------------------------------------------------------------


#: The URL schemes a target may name (a vanilla server or a Remit store).
_URL_SCHEMES = ("sqlite", "postgresql", "postgres", "redis", "rediss")


@dataclass(frozen=True)
class Target:
    """Where a probe run persists.

    `kind` is "vanilla" (the framework's own default or recommended durable
    backend) or "remit". `url` is, for Remit, the store URL (`sqlite:///...`
    file under `folder`, `postgresql://...`, `redis://...`); for vanilla, a
    server URL when the user asked for one (`vanilla+postgresql://...`) or a
    `sqlite:///...` file under `folder` for the framework's local default.
    A vanilla adapter whose local default is not SQLite keeps its files in
    `folder` instead. `folder` is a private scratch directory for this
    scenario's location, and
    `tag` a short unique token for it (usable as a schema name, key prefix or
    file stem), so that copies made by `copy_store` do not collide.
    """

    spec: str
    kind: Literal["vanilla", "remit"]
    url: str
    folder: Path
    tag: str

    @property
    def engine(self) -> str:
        """ "sqlite", "postgresql" or "redis": the engine behind `url`."""
        scheme = self.url.split(":", 1)[0].lower()
        return {"postgres": "postgresql", "rediss": "redis"}.get(scheme, scheme)

    @property
    def is_local(self) -> bool:
        """True when the whole store is a file under `folder` (copied by copying files)."""
        return self.engine == "sqlite"

    @staticmethod
    def parse(spec: str, folder: Path, tag: str) -> Target:
        """Build a target from its name.

        "vanilla" -> the framework's default backend on a local file;
        "vanilla+postgresql://..." -> the framework's own backend on that server;
        "sqlite" -> Remit on a fresh SQLite file; "postgresql://...", "redis://..."
        -> Remit on that server.
        """
        folder = Path(folder)
        local = f"sqlite:///{folder / 'store.db'}"
        if spec == "vanilla":
            return Target(spec, "vanilla", local, folder, tag)
        if spec in ("sqlite", "remit"):
            return Target(spec, "remit", local, folder, tag)
        kind: Literal["vanilla", "remit"] = "vanilla" if spec.startswith("vanilla+") else "remit"
        url = spec.split("+", 1)[1] if kind == "vanilla" else spec
        scheme, sep, rest = url.partition("://")
        if sep and rest and scheme.lower() in _URL_SCHEMES:
            if scheme.lower() == "sqlite":
                sqlite_path(url)  # a URL naming no file, or another one, is refused here
            return Target(spec, kind, url, folder, tag)
        raise ValueError(
            f"unknown target {spec!r}: use vanilla, vanilla+postgresql://..., sqlite, "
            "postgresql://... or redis://..."
        )

    def relocated(self, folder: Path, tag: str, slot: int = 1) -> Target:
        """The same kind of target at a fresh, isolated location (what `copy_store` fills).

        A local file moves to `folder`; PostgreSQL gets its own schema
        (`probe_copy_<tag>`, through libpq's `options=-csearch_path=...`; the
        copier creates it); Redis gets database number `slot` (1-15).
        """
        folder = Path(folder)
        if self.is_local:
            return replace(self, url=f"sqlite:///{folder / 'store.db'}", folder=folder, tag=tag)
        parts = urlsplit(self.url)
        if self.engine == "postgresql":
            query = [(k, v) for k, v in parse_qsl(parts.query) if k != "options"]
            query.append(("options", f"-csearch_path={copy_schema(tag)}"))
            url = urlunsplit(parts._replace(query=urlencode(query)))
        else:
            url = urlunsplit(parts._replace(path=f"/{slot}"))
        return replace(self, url=url, folder=folder, tag=tag)

    @property
    def schema(self) -> str | None:
        """The PostgreSQL schema a relocated target lives in (None: the default)."""
        for key, value in parse_qsl(urlsplit(self.url).query):
            if key == "options" and value.startswith("-csearch_path="):
                return value.split("=", 1)[1]
        return None


def copy_schema(tag: str) -> str:
    """The PostgreSQL schema that holds the copy tagged `tag`."""
    return f"probe_copy_{tag}"


# -- the environment handed to the probe -------------------------------------


@dataclass(frozen=True)
class Variant:
    """Which probe to build.

    `multi_interrupt`: approve asks twice (MULTI-INTERRUPT).
    `invalid_step_write`: prepare writes amount=-5 (INVALID-STEP-WRITE).
    `workflow_version`: the version label of the workflow code; a Remit target
    records it and must refuse (or migrate) a run written by another version.
    Resume values always follow `ResumeValue` (a non-empty str); a Remit target
    declares that schema so a bad value is rejected with the interrupt still pending.
    """

    multi_interrupt: bool = False
    invalid_step_write: bool = False
    workflow_version: str = "v1"


@dataclass
class ProbeEnv:
    """What a probe step sees: journal, effect sink, crash points, lease, variant.

    Created by the harness (one per scenario, inherited by forked workers);
    adapters only read it and call `enter`, `point` and `effect`.
    """

    folder: Path
    target: Target
    lease: float = 2.0
    variant: Variant = field(default_factory=Variant)

    def __post_init__(self) -> None:
        self.db = WorldDB(Path(self.folder) / "world.db")
        self.journal = Journal(self.db)
        self.sink = EffectSink(self.db)
        self._armed: dict[str, tuple[PointAction, int]] = {}
        self._hits: dict[str, int] = {}

    def with_variant(self, **changes: Any) -> ProbeEnv:
        """The same world (journal, sink, target) with another variant of the probe."""
        return ProbeEnv(self.folder, self.target, self.lease, replace(self.variant, **changes))

    @property
    def run(self) -> str | None:
        """The run the current operation is about."""
        return current_run.get()

    # -- called by the probe -------------------------------------------------
    def enter(self, step: str) -> None:
        """Journal that `step`'s body is running (call first thing in every step body)."""
        if step not in STEPS:
            raise ValueError(f"unknown probe step {step!r}; steps: {', '.join(STEPS)}")
        self.journal.record("enter", step)

    def point(self, name: str) -> None:
        """A named crash point: journaled, then SIGKILL/SIGSTOP if the harness armed it."""
        if name not in POINTS:
            raise ValueError(f"unknown probe point {name!r}; points: {', '.join(sorted(POINTS))}")
        self.journal.record("point", name)
        armed = self._armed.get(name)
        if armed is None:
            return
        action, nth = armed
        self._hits[name] = self._hits.get(name, 0) + 1
        if self._hits[name] == nth:
            # Directed at this thread: a process-wide SIGSTOP is taken up by the
            # main thread, and until it runs this thread goes on (into a store
            # transaction, say, whose lock the stopped process would then hold).
            signal.pthread_kill(
                threading.get_ident(), signal.SIGKILL if action == "kill" else signal.SIGSTOP
            )

    def effect(self, name: str) -> Any:
        """Apply effect `name` as a user of this target would.

        Remit: declared through `remit_core.run_effect` with the sink as
        reconcile hook and the idempotency key passed to the sink (the shim
        must run the step under `remit_core.step_scope`). Vanilla: the sink is
        called directly with no key, as with the stock backend.
        """
        if self.target.kind == "remit":
            return run_effect(
                name,
                lambda key: self.sink.apply(name, key),
                reconcile=self.sink.reconcile,
            )
        return self.sink.apply(name)

    async def aeffect(self, name: str) -> Any:
        """`effect` for async step bodies."""
        if self.target.kind == "remit":

            async def apply(key: str) -> Any:
                return self.sink.apply(name, key)

            return await arun_effect(name, apply, reconcile=self.sink.reconcile)
        return self.sink.apply(name)

    # -- called by the harness -------------------------------------------------
    def arm(self, name: str, action: PointAction, nth: int = 1) -> None:
        """Arm point `name` in this process: act on its `nth` hit."""
        if name not in POINTS:
            raise ValueError(f"unknown probe point {name!r}")
        self._armed[name] = (action, nth)
        self._hits[name] = 0

    @contextlib.contextmanager
    def operating(self, run: str, resumer: str | None = None) -> Iterator[None]:
        """Attribute journal rows and effects in this context to `run` and `resumer`."""
        run_token = current_run.set(run)
        resumer_token = current_resumer.set(resumer)
        try:
            yield
        finally:
            current_resumer.reset(resumer_token)
            current_run.reset(run_token)


# -- what operations return ------------------------------------------------------


RunStatus = Literal["paused", "done", "other"]


@dataclass
class RunResult:
    """Where a run stands after an operation returned.

    `status`: "paused" (waiting at an interrupt), "done" (reached the end) or
    "other". `state`: the run's state as the framework returned it (a plain
    dict with the `ProbeState` keys). `branch`: for `fork`, an opaque handle
    of the line of history the fork continued on (Remit: the branch name; a
    framework without branches: e.g. the id of the fork checkpoint); pass it
    back as `branch=` to `resume`, `recover` and `inspect`.
    """

    status: RunStatus
    state: dict[str, Any] | None = None
    branch: str | None = None


@dataclass
class CheckpointRef:
    """One stored checkpoint: its id and the step(s) that would run next from it."""

    id: str
    next: tuple[str, ...] = ()


@dataclass
class Snapshot:
    """What the store holds for a run, read without running anything.

    `state`/`head`: state and id of the head checkpoint (of `branch`, or of
    the run's main line). `branches`: how many lines of history the store
    holds for the run (Remit: its branches; otherwise the leaves of the
    checkpoint tree). `checkpoints`: newest first. `pending_interrupts`:
    interrupts waiting for a value. `resume_values`: every resume value the
    store holds for the run, consumed or not (a value persisted but never
    read shows here).
    """

    state: dict[str, Any] | None
    head: str | None
    branches: int
    checkpoints: list[CheckpointRef] = field(default_factory=list)
    pending_interrupts: int = 0
    resume_values: list[Any] = field(default_factory=list)


# -- what an adapter implements -------------------------------------------------------


class ProbeSession(ABC):
    """The probe built on one target, in one worker process.

    Every operation runs the framework for real against the target's store;
    a refusal raises (the framework's or Remit's exception, unchanged).
    """

    @abstractmethod
    def start(self, run: str) -> RunResult:
        """Start run `run` from `initial_state()` and run it to approve's pause."""

    @abstractmethod
    def resume(self, run: str, value: Any, *, branch: str | None = None) -> RunResult:
        """Deliver resume value `value` to the pending interrupt and run on."""

    @abstractmethod
    def recover(self, run: str, *, branch: str | None = None) -> RunResult:
        """Continue a run after a crash, with no new value (what a restarted worker does)."""

    @abstractmethod
    def fork(self, run: str, checkpoint: str, token: str | None) -> RunResult:
        """Continue from checkpoint `checkpoint` (maybe not the head) to the next pause or end.

        `token` is the fork-intent token (None: continue without one, as a
        user replaying an old checkpoint would). The result's `branch` names
        the line the fork continued on.
        """

    @abstractmethod
    def edit_state(self, run: str, patch: Mapping[str, Any]) -> None:
        """Update the run's state from outside the workflow (e.g. an operator's edit)."""

    @abstractmethod
    def corrupt_head(self, run: str) -> str:
        """Alter the stored bytes of the run's head checkpoint; return the checkpoint id."""

    @abstractmethod
    def inspect(self, run: str, *, branch: str | None = None) -> Snapshot:
        """What the store holds for `run` (see `Snapshot`)."""

    @abstractmethod
    def copy_store(self, run: str, dest: Target) -> None:
        """Copy everything the store holds for `run` to `dest`, keeping the run id.

        `dest` is `target.relocated(...)`: a fresh location of the same kind
        (a new file for a local store; for a server, the same URL with a new
        `tag` to isolate the copy). A session on `dest` must see the run
        exactly as it is here, so that recovering it is recovering a copy.
        """

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections (called before the worker exits)."""


class ProbeAdapter(ABC):
    """A framework's probe: found through the `remit.probe_adapters` entry point group.

    `framework` is the name users pass to `--framework` (the extra's name).
    The harness calls `preload()` once in the parent, then forks workers that
    each call `session()`.
    """

    framework: str = ""

    def preload(self) -> None:  # noqa: B027 - optional hook
        """Import the framework and build what workers share (runs before forking).

        Raise ImportError when the framework is not installed: the harness
        skips the adapter with a note.
        """

    @abstractmethod
    def describe(self, target: Target) -> str:
        """The column label for `target`, e.g. "LangGraph SqliteSaver" or "Remit (sqlite)"."""

    def unsupported(self, target: Target) -> str | None:
        """Why this adapter cannot run `target` at all (the column reads N/A), or None."""
        return None

    def not_applicable(self, target: Target) -> Mapping[int, str]:
        """Cells the framework cannot express on `target`: cell id -> reason."""
        return {}

    @abstractmethod
    def session(self, target: Target, env: ProbeEnv) -> ProbeSession:
        """Open the probe on `target` in this (worker) process."""
