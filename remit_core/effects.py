"""The effect API (P2): intent before, outcome after, a deterministic key always.

    @effect(reconcile=payments.lookup)        # or idempotent=True
    def charge(amount, *, idempotency_key):   # the key is passed if asked for
        return payments.charge(amount, key=idempotency_key)

Inside a step that a shim runs under `step_scope(...)`, each call of `charge`
is one ledger entry keyed by (step key, effect name, occurrence). A replayed
step gets the recorded outcome back without applying again. The protocol is
written once as a generator (`_protocol`) and driven by a blocking or an
asyncio driver, so sync and async effects share one implementation.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast

from remit_core import codec, failpoints, policy
from remit_core.core import check_fence_run, checked_id, effect_calls
from remit_core.errors import (
    CorruptRecord,
    EffectInDoubt,
    EffectInFlight,
    RemitError,
    StoreUnavailable,
)
from remit_core.records import EffectRecord, FenceRef

if TYPE_CHECKING:
    from remit_core.core import Remit

F = TypeVar("F", bound=Callable[..., Any])

#: How long a caller waits for another caller's effect in flight (its intent recorded
#: under a claim still held) to be recorded before it gives up with `EffectInFlight`.
IN_FLIGHT_WAIT = 5.0


class _NotApplied:
    def __repr__(self) -> str:
        return "NOT_APPLIED"


#: What a `reconcile` hook returns when the effect did not happen at its target.
NOT_APPLIED: Any = _NotApplied()


@dataclass
class StepScope:
    """The step an effect runs in: where its ledger entries go and under which fence."""

    remit: Remit
    run_id: str
    step_key: str
    fence: FenceRef | None = None
    _occurrences: dict[str, int] = field(default_factory=dict)
    #: Calls of one step may come from several threads (`asyncio.to_thread` copies the
    #: step's context, and so its scope): each must get an occurrence of its own.
    _lock: threading.Lock = field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )
    #: The process the step runs in. A process it forks starts from the step's count
    #: as it stood, so each child would number its calls as the others do (and as the
    #: step goes on to): they get no occurrences.
    _pid: int = field(default_factory=os.getpid, init=False, repr=False, compare=False)

    def next_key(self, name: str) -> str:
        """The key of the step's next call of effect `name`."""
        if os.getpid() != self._pid:
            raise RemitError(
                f"effect {name!r} was called in a process forked from its step: each such "
                "process would number its calls as the others do, and one call would get "
                "another's recorded outcome instead of being applied; give such calls a "
                "key= of their own (from what makes each call distinct)"
            )
        with self._lock:
            return self._next_key(name)

    def _next_key(self, name: str) -> str:
        n = self._occurrences.get(name, 0)
        self._occurrences[name] = n + 1
        return f"{self.step_key}/{name}#{n}"


@dataclass
class SharedScope(StepScope):
    """The scope of a step that runs again from its top on a branch that shares what
    it did before (a fork of a checkpoint it was running or waiting at): its first
    calls of each effect, as many as earlier branches made (`shared`: their step key
    and their calls by effect name), are keyed as those branches keyed them, so their
    recorded outcomes come back (P2, P3); later calls get its own keys. Every call is
    counted in `counts`, for the branches that will share this step's calls."""

    counts: dict[str, int] = field(default_factory=dict)
    shared: list[tuple[str, dict[str, int]]] = field(default_factory=list)

    def _next_key(self, name: str) -> str:
        own = super()._next_key(name)
        n = self._occurrences[name] - 1
        self.counts[name] = max(self.counts.get(name, 0), n + 1)
        for step_key, made in self.shared:
            if n < made.get(name, 0):
                return f"{step_key}/{name}#{n}"
        return own


_scope: contextvars.ContextVar[StepScope | None] = contextvars.ContextVar(
    "remit_step_scope", default=None
)
_current_key: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "remit_idempotency_key", default=None
)


def step_scope(
    remit: Remit, run_id: str, step_key: str, *, fence: FenceRef | None = None
) -> contextlib.AbstractContextManager[StepScope]:
    """Run a step's body with effects recorded under `step_key` (deterministic per step)."""
    return scoped(StepScope(remit, run_id, step_key, fence))


@contextlib.contextmanager
def scoped(scope: StepScope) -> Iterator[StepScope]:
    """Run a step's body with `scope` as its effects' scope (a `StepScope` subclass
    may key its effects its own way)."""
    token = _scope.set(scope)
    try:
        yield scope
    finally:
        _scope.reset(token)


def bind_step_scope(scope: StepScope | None) -> None:
    """Make `scope` the open step scope of the current context (None: no step is open).

    For a framework that announces step boundaries through callbacks (a hook
    before the step, another after it) rather than one block of code, so that
    a `with step_scope(...)` cannot span the step: the before-hook binds the
    step's scope, the after-hook binds None, both in the step's own context.
    """
    _scope.set(scope)


_resolvers: list[Callable[[], StepScope | None]] = []


def register_scope_resolver(resolver: Callable[[], StepScope | None]) -> None:
    """Let a shim name the step an effect runs in when no `step_scope` is open.

    A framework that runs step bodies itself (so the shim cannot wrap them)
    registers a resolver that reads the framework's own task context and
    returns the step's scope, or None when the call is not inside one of its
    steps. The scope found is kept for the rest of the current context, so
    effect occurrences within one step execution are numbered in order.
    """
    if resolver not in _resolvers:
        _resolvers.append(resolver)


def current_scope() -> StepScope | None:
    """The open step scope, else the one a registered resolver finds (then kept)."""
    scope = _scope.get()
    if scope is None:
        for resolver in _resolvers:
            scope = resolver()
            if scope is not None:
                _scope.set(scope)
                break
    return scope


def current_idempotency_key() -> str | None:
    """The idempotency key of the effect now being applied, if any."""
    return _current_key.get()


# -- the protocol, once ----------------------------------------------------------


@dataclass(frozen=True)
class _Get:
    pass


@dataclass(frozen=True)
class _Begin:
    pass


@dataclass(frozen=True)
class _Finish:
    outcome: Any


@dataclass(frozen=True)
class _Apply:
    #: The key the ledger entry holds: the one the effect was (or may have been)
    #: applied with, also in a run copied from another (whose id gave another key).
    idem: str
    #: An effect in doubt (reconciled as not applied, or re-applied): it has no
    #: fenced write of its own before it applies, as a first apply has its intent.
    #: The driver first re-reads its entry through that write (`_Call.recheck`): a
    #: holder whose claim was taken over is refused there (L2), and an entry another
    #: caller finished meanwhile comes back as `_Recorded` instead of an outcome.
    in_doubt: bool = False


@dataclass(frozen=True)
class _Recorded:
    """What an in-doubt `_Apply` answers when another caller recorded the outcome."""

    entry: EffectRecord


@dataclass(frozen=True)
class _Reconcile:
    idem: str


@dataclass(frozen=True)
class _Settle:
    """An intent without an outcome, told apart before anything is decided on it:
    another caller's in flight (waited for, bounded; `EffectInFlight` past that) or
    one in doubt. The driver answers the entry to decide on (done, or in doubt)."""

    entry: EffectRecord


@dataclass(frozen=True)
class _Adopt:
    """An intent in doubt, about to be reconciled or re-applied: moved to this
    caller's claim first, as a compare-and-set on the claim it was decided on. The
    driver answers (entry, adopted); not adopted, another caller moved it first (or
    finished it), and the entry is decided again: in flight, so waited for."""

    entry: EffectRecord


_Op = _Get | _Begin | _Finish | _Apply | _Reconcile | _Settle | _Adopt

#: How many times an effect's entry is decided before `EffectInFlight`: each round
#: past the first follows another caller's write to it (its intent, or its adoption).
_DECISIONS = 4


def _protocol(
    run_id: str, effect_key: str, *, has_reconcile: bool, idempotent: bool
) -> Generator[_Op, Any, Any]:
    """Yields the operations an effect needs; the driver sends back their results."""
    entry: EffectRecord | None = yield _Get()
    for _ in range(_DECISIONS):
        if entry is not None and entry.status == "intent":
            entry = yield _Settle(entry)
        action = policy.effect_action(entry, has_reconcile=has_reconcile, idempotent=idempotent)
        if action == "return_recorded":
            return entry
        if action == "apply":
            failpoints.hit("effect.before_intent")
            entry, created = yield _Begin()
            if not created:
                continue  # another resumer recorded intent first: decide again on its entry
            failpoints.hit("effect.after_intent")
            outcome = yield _Apply(entry.idempotency_key)
            failpoints.hit("effect.after_apply")
            return (yield _Finish(outcome))
        assert entry is not None
        if action in ("reconcile", "reapply"):
            entry, adopted = yield _Adopt(entry)
            if not adopted:
                continue  # another caller took it over (or finished it) first
        if action == "reconcile":
            outcome = yield _Reconcile(entry.idempotency_key)
            if outcome is NOT_APPLIED:
                outcome = yield _Apply(entry.idempotency_key, in_doubt=True)
                if isinstance(outcome, _Recorded):
                    return outcome.entry
                failpoints.hit("effect.after_apply")
            return (yield _Finish(outcome))
        if action == "reapply":
            outcome = yield _Apply(entry.idempotency_key, in_doubt=True)
            if isinstance(outcome, _Recorded):
                return outcome.entry
            failpoints.hit("effect.after_apply")
            return (yield _Finish(outcome))
        raise EffectInDoubt(
            "effect may have been applied but its outcome was never recorded; give it "
            "reconcile= (did key K happen?) or declare it idempotent=True",
            run_id=run_id,
            effect_key=effect_key,
        )
    raise EffectInFlight(
        f"effect {effect_key!r} was taken over by another caller each time it was "
        "decided here; nothing was applied here: run again once they have finished",
        run_id=run_id,
        effect_key=effect_key,
    )


def _next_wait(waits: Generator[float, None, EffectRecord | None]) -> float | EffectRecord | None:
    """The next pause of `_Call.settling`, or the entry it returns."""
    try:
        return next(waits)
    except StopIteration as stop:
        return cast("EffectRecord | None", stop.value)


def _outcome_of(entry: EffectRecord, scope: StepScope) -> Any:
    assert entry.outcome is not None
    ids = {"run_id": scope.run_id, "effect_key": entry.effect_key}
    body = codec.unseal(entry.outcome, f"effect\x00{entry.effect_key}", **ids)
    try:
        return codec.loads(body)
    except ValueError as exc:
        raise CorruptRecord(f"recorded effect outcome does not decode: {exc}", **ids) from exc


def _sealed(outcome: Any, effect_key: str) -> bytes:
    try:
        body = codec.dumps(outcome)
    except (TypeError, ValueError) as exc:
        raise RemitError(
            f"effect {effect_key} returned a value Remit cannot record ({exc}); the effect "
            "stays in doubt: return plain data",
            effect_key=effect_key,
        ) from exc
    return codec.seal(body, f"effect\x00{effect_key}")


class _Call:
    """One effect invocation: its scope, key, and the store operations of the protocol."""

    def __init__(self, scope: StepScope, effect_key: str) -> None:
        # Checked before any store call, so that every engine refuses them alike.
        checked_id("run_id", scope.run_id)
        checked_id("step key", scope.step_key, empty=True)
        checked_id("effect key", effect_key)
        check_fence_run(scope.fence, scope.run_id)
        self.scope = scope
        self.key = effect_key
        self.idem = policy.idempotency_key(scope.run_id, effect_key)

    @contextlib.contextmanager
    def applying(self, idem: str) -> Iterator[None]:
        """While the effect applies: its idempotency key is current, and effects it
        calls itself are keyed under its own key (a replay that returns its recorded
        outcome calls none of them, so they must not use up the step's occurrences)."""
        s = self.scope
        key = _current_key.set(idem)
        inner = _scope.set(StepScope(s.remit, s.run_id, self.key, s.fence))
        try:
            yield
        finally:
            _scope.reset(inner)
            _current_key.reset(key)

    def store_op(self, op: _Op) -> Any:
        s, store = self.scope, self.scope.remit.store
        if isinstance(op, _Get):
            return self._checked(store.get_effect(s.run_id, self.key))
        if isinstance(op, _Begin):
            now = s.remit.clock()
            try:
                entry, created = store.begin_effect(
                    s.run_id, self.key, self.idem, now=now, fence=s.fence
                )
            except StoreUnavailable as lost:
                entry, created = self._landed_intent(now, lost), True
            return self._checked(entry), created
        if isinstance(op, _Adopt):
            entry, adopted = store.adopt_effect(
                s.run_id, self.key, held=op.entry.claim, fence=s.fence
            )
            return self._checked(entry), adopted
        assert isinstance(op, _Finish)
        now = s.remit.clock()
        entry = store.finish_effect(
            s.run_id, self.key, _sealed(op.outcome, self.key), now=now, fence=s.fence
        )
        failpoints.hit("effect.after_outcome")
        return self._checked(entry)

    def _landed_intent(self, now: float, lost: StoreUnavailable) -> EffectRecord:
        """The intent of a `begin_effect` that failed in flight, if it landed all the same.

        Raising would leave the effect in doubt on every replay (`EffectInDoubt`
        without `reconcile` or `idempotent`), though it was never applied. One read,
        on a fresh connection, tells: an intent stamped with this call's time is this
        call's (the occurrence's turn, and the claim's fence, keep other callers out),
        and the effect applies; else, or unreadable, the failure stands.
        """
        try:
            entry = self.scope.remit.store.get_effect(self.scope.run_id, self.key)
        except StoreUnavailable:
            raise lost from lost.__cause__
        if entry is None or entry.status != "intent" or entry.created_at != now:
            raise lost
        return entry

    def may_be_in_flight(self, entry: EffectRecord) -> bool:
        """Whether `entry`, an intent, was recorded under a claim other than this
        call's (one store read tells whether that claim is still held)."""
        return entry.claim is not None and entry.claim != self.scope.fence

    def settling(self, entry: EffectRecord) -> Generator[float, None, EffectRecord | None]:
        """While `entry` is another caller's intent in flight: the seconds to sleep
        before looking again. Returns the entry to decide on: done (its outcome), or
        in doubt (its claim given up, lapsed or taken over), or None (deleted).
        `EffectInFlight` once `IN_FLIGHT_WAIT` has passed with the claim still held."""
        s, store = self.scope, self.scope.remit.store
        current: EffectRecord | None = entry
        # The wait is the caller's real time; the lease's, the store's (`Remit.clock`).
        deadline, pause = time.monotonic() + IN_FLIGHT_WAIT, 0.02
        while current is not None and current.status == "intent" and current.claim is not None:
            live = store.get_claim(s.run_id, current.claim.scope)
            if not policy.intent_in_flight(current, live, s.fence, now=s.remit.clock()):
                break
            now = time.monotonic()
            if now >= deadline:
                raise EffectInFlight(
                    f"effect {self.key!r} was recorded by a caller whose claim on scope "
                    f"{current.claim.scope!r} is still held, with no outcome yet: it may be "
                    f"applying it now. Nothing was applied here; run again once it has "
                    "finished (or its lease has lapsed)",
                    run_id=s.run_id,
                    effect_key=self.key,
                )
            yield min(pause, deadline - now)
            pause = min(pause * 2, 0.5)
            current = self._checked(store.get_effect(s.run_id, self.key))
        return current

    def recheck(self) -> _Recorded | None:
        """Before an effect in doubt applies: its entry again, through the fenced
        intent write (a no-op on an entry that exists); `Fenced` if the claim was
        taken over, `_Recorded` if the entry is done, else None (apply it)."""
        entry, _ = self.store_op(_Begin())
        return _Recorded(entry) if entry.status == "done" else None

    def _checked(self, entry: EffectRecord | None) -> EffectRecord | None:
        """`entry` if it is an intent without an outcome or a done one with its outcome:
        anything else was altered in the store, and deciding on it could apply the
        effect again or return no outcome (P4)."""
        if entry is None or (entry.status, entry.outcome is None) in _ENTRY_SHAPES:
            return entry
        has = "without" if entry.outcome is None else "with"
        raise CorruptRecord(
            f"stored effect entry has status {entry.status!r} {has} an outcome",
            run_id=self.scope.run_id,
            effect_key=self.key,
        )


#: The (status, outcome is None) pairs an effect's ledger entry can have.
_ENTRY_SHAPES = frozenset({("intent", True), ("done", False)})


def _wants_key(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "idempotency_key" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
    )


def _scope_or_fail(name: str) -> StepScope:
    scope = current_scope()
    if scope is None:
        raise RemitError(
            f"effect {name!r} was called outside a Remit step: run the workflow with a "
            "Remit backend so the effect can be recorded (a thread the step starts runs "
            "outside it unless started in the step's context, `contextvars.copy_context()"
            ".run`, as `asyncio.to_thread` does; give such calls a key= of their own)"
        )
    return scope


class _Handover:
    """A turn's lock taken by a thread for a task that may stop waiting for it: whichever
    of the two comes second gives the lock back (once), under a guard of its own."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._guard = threading.Lock()
        self._abandoned = self._taken = False

    def take(self) -> None:
        """In the thread: wait for the lock; keep it for the task, or give it back."""
        self._lock.acquire()
        with self._guard:
            if self._abandoned:
                self._lock.release()
            else:
                self._taken = True

    def abandon(self) -> None:
        """On the task's side, once it stops waiting: the lock is not its to hold."""
        with self._guard:
            self._abandoned = True
            if self._taken:
                self._lock.release()


class _Turns:
    """One effect occurrence applied by one caller of this process at a time.

    A second caller of the same occurrence (two threads or tasks running the
    same step) waits for the first to finish, then finds its recorded outcome:
    without this it would find the first's intent, in flight, and take it for
    one in doubt (a reconcile that answers "not yet" would apply it twice).
    Callers in other processes are kept apart by the run's claim and its fence.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[object, str, str], list[Any]] = {}  # key -> [lock, users]

    def _enter(self, key: tuple[object, str, str]) -> threading.Lock:
        with self._lock:
            entry = self._held.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
            lock: threading.Lock = entry[0]
            return lock

    def _leave(self, key: tuple[object, str, str]) -> None:
        with self._lock:
            entry = self._held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[key]

    @staticmethod
    def key(call: _Call) -> tuple[object, str, str]:
        store = call.scope.remit.store
        return (getattr(store, "url", None) or id(store), call.scope.run_id, call.key)

    @staticmethod
    def _check_not_held(call: _Call, key: tuple[object, str, str]) -> contextvars.Token[Any]:
        """Mark `key` held by this context, or refuse a call of an occurrence that this
        context is applying already (an effect whose body calls one of the same key):
        it would wait for its own turn forever."""
        held = _held_turns.get()
        if key in held:
            raise RemitError(
                f"effect {call.key!r} was called while an effect of the same key is being "
                "applied by this same call chain; give each effect a key of its own",
                run_id=call.scope.run_id,
                effect_key=call.key,
            )
        return _held_turns.set(held | {key})

    @contextlib.contextmanager
    def turn(self, call: _Call) -> Iterator[None]:
        key = self.key(call)
        mark = self._check_not_held(call, key)
        lock = self._enter(key)
        try:
            with lock:
                yield
        finally:
            self._leave(key)
            _held_turns.reset(mark)

    @contextlib.asynccontextmanager
    async def aturn(self, call: _Call) -> AsyncIterator[None]:
        key = self.key(call)
        mark = self._check_not_held(call, key)
        lock = self._enter(key)
        try:
            if not lock.acquire(blocking=False):  # held: wait off the event loop
                handover = _Handover(lock)
                waiting = asyncio.ensure_future(asyncio.to_thread(handover.take))
                try:
                    await asyncio.shield(waiting)
                except asyncio.CancelledError:
                    # The thread takes the lock all the same (a cancelled wait, or the
                    # loop shutting down, which cancels `waiting` too): give it back.
                    handover.abandon()
                    raise
            try:
                yield
            finally:
                lock.release()
        finally:
            self._leave(key)
            _held_turns.reset(mark)


_turns = _Turns()
#: The occurrences the current call chain is applying (its turns held).
_held_turns: contextvars.ContextVar[frozenset[tuple[object, str, str]]] = contextvars.ContextVar(
    "remit_held_turns", default=frozenset()
)


def run_effect(
    name: str,
    fn: Callable[[str], Any],
    *,
    key: str | None = None,
    reconcile: Callable[[str], Any] | None = None,
    idempotent: bool = False,
) -> Any:
    """Apply `fn(idempotency_key)` at most once per key across the life of the run."""
    _check_declared(name, fn, reconcile, idempotent)
    _check_sync(name, fn, reconcile)
    scope = _scope_or_fail(checked_id("effect name", name, empty=True))
    call = _Call(scope, key if key is not None else scope.next_key(name))
    with effect_calls(scope.fence), _turns.turn(call):
        return _drive(call, fn, reconcile, idempotent)


def _check_declared(name: str, fn: object, reconcile: object, idempotent: object) -> None:
    """A `TypeError` naming the argument before anything is recorded: a `fn` that
    cannot be called would leave an intent for an effect that never happened, in
    doubt on every replay; a `reconcile` that cannot be called would fail only in
    recovery, when an effect is in doubt; and an `idempotent` that is no bool (the
    string "no") would be taken as true, and an effect in doubt applied again."""
    if not callable(fn):
        raise TypeError(f"effect {name!r}: fn must be callable, got {type(fn).__name__}")
    if reconcile is not None and not callable(reconcile):
        raise TypeError(
            f"effect {name!r}: reconcile must be callable or None, got {type(reconcile).__name__}"
        )
    if type(idempotent) is not bool:
        raise TypeError(
            f"effect {name!r}: idempotent must be a bool, got {type(idempotent).__name__} "
            f"{idempotent!r:.40}"
        )


def _check_sync(name: str, fn: Callable[..., Any], reconcile: Callable[..., Any] | None) -> None:
    """A `TypeError` before anything is recorded if `run_effect` is given a coroutine
    function: it would record the intent, get a coroutine that never runs, and leave
    an effect that never happened in doubt on every replay."""
    for role, given in (("fn", fn), ("reconcile", reconcile)):
        if given is not None and inspect.iscoroutinefunction(given):
            raise TypeError(
                f"effect {name!r}: {role} is a coroutine function, which run_effect cannot "
                "await; use arun_effect (or @effect on an async def)"
            )


def _drive(
    call: _Call,
    fn: Callable[[str], Any],
    reconcile: Callable[[str], Any] | None,
    idempotent: bool,
) -> Any:
    scope = call.scope
    gen = _protocol(
        scope.run_id, call.key, has_reconcile=reconcile is not None, idempotent=idempotent
    )
    result: Any = None
    try:
        while True:
            op = gen.send(result)
            if isinstance(op, _Apply):
                result = call.recheck() if op.in_doubt else None
                if result is None:
                    with call.applying(op.idem):
                        result = fn(op.idem)
                    if inspect.isawaitable(result):
                        _refuse_awaitable(call, "fn", result)
            elif isinstance(op, _Reconcile):
                assert reconcile is not None
                result = reconcile(op.idem)
                if inspect.isawaitable(result):
                    _refuse_awaitable(call, "reconcile", result)
            elif isinstance(op, _Settle):
                result = op.entry
                if call.may_be_in_flight(result):
                    waits = call.settling(result)
                    while isinstance(result := _next_wait(waits), float):
                        time.sleep(result)
            else:
                result = call.store_op(op)
    except StopIteration as stop:
        return _outcome_of(stop.value, scope)


def _refuse_awaitable(call: _Call, role: str, result: Any) -> NoReturn:
    """Refuse what a blocking effect's `fn` or `reconcile` returned unawaited: a
    coroutine that never ran (closed here, so it never does)."""
    if inspect.iscoroutine(result):
        result.close()
    raise TypeError(
        f"effect {call.key!r}: {role} returned an awaitable, which run_effect cannot await "
        "(it did not run); use arun_effect (or @effect on an async def)"
        + (
            "; the effect's intent is recorded: a reconcile answering NOT_APPLIED, or "
            "idempotent=True, lets a replay apply it"
            if role == "fn"
            else ""
        )
    )


async def arun_effect(
    name: str,
    fn: Callable[[str], Awaitable[Any]],
    *,
    key: str | None = None,
    reconcile: Callable[[str], Any] | None = None,
    idempotent: bool = False,
) -> Any:
    """`run_effect` for coroutines; store calls run off the event loop. A plain function
    given for `fn` is called as it is (its outcome recorded, as a coroutine's)."""
    _check_declared(name, fn, reconcile, idempotent)
    scope = _scope_or_fail(checked_id("effect name", name, empty=True))
    call = _Call(scope, key if key is not None else scope.next_key(name))
    with effect_calls(scope.fence):
        async with _turns.aturn(call):
            return await _adrive(call, fn, reconcile, idempotent)


async def _adrive(
    call: _Call,
    fn: Callable[[str], Awaitable[Any]],
    reconcile: Callable[[str], Any] | None,
    idempotent: bool,
) -> Any:
    scope = call.scope
    gen = _protocol(
        scope.run_id, call.key, has_reconcile=reconcile is not None, idempotent=idempotent
    )
    result: Any = None
    try:
        while True:
            op = gen.send(result)
            if isinstance(op, _Apply):
                result = await asyncio.to_thread(call.recheck) if op.in_doubt else None
                if result is None:
                    with call.applying(op.idem):
                        # A plain function given for `fn` has applied already: its
                        # outcome is recorded, not lost to a failed `await`.
                        result = fn(op.idem)
                        if inspect.isawaitable(result):
                            result = await result
            elif isinstance(op, _Reconcile):
                assert reconcile is not None
                # A plain function's lookup (an HTTP call, say) runs off the event loop.
                if inspect.iscoroutinefunction(reconcile):
                    result = await reconcile(op.idem)
                else:
                    result = await asyncio.to_thread(reconcile, op.idem)
                if inspect.isawaitable(result):
                    result = await result
            elif isinstance(op, _Settle):
                result = op.entry
                if call.may_be_in_flight(result):
                    waits = call.settling(result)
                    while isinstance(result := await asyncio.to_thread(_next_wait, waits), float):
                        await asyncio.sleep(result)
            else:
                result = await asyncio.to_thread(call.store_op, op)
    except StopIteration as stop:
        return _outcome_of(stop.value, scope)


def effect(
    fn: F | None = None,
    *,
    name: str | None = None,
    key: Callable[..., str] | None = None,
    reconcile: Callable[[str], Any] | None = None,
    idempotent: bool = False,
) -> Any:
    """Declare a function an effect. Works on plain functions and coroutine functions.

    `key(*args, **kwargs)` may give a user key instead of the occurrence key.
    The function gets `idempotency_key=` if its signature accepts it.
    """

    if name is not None:
        checked_id("effect name", name, empty=True)
    if key is not None and not callable(key):
        raise TypeError(
            f"effect(key=) must be a callable that returns the key from the call's "
            f"arguments (key=lambda to: f'mail:{{to}}'), got {type(key).__name__}"
        )

    def deco(f: F) -> F:
        if not callable(f):
            raise TypeError(f"@effect applies to a function, got {type(f).__name__}")
        label = name or f.__qualname__
        _check_declared(label, f, reconcile, idempotent)
        if inspect.isgeneratorfunction(f) or inspect.isasyncgenfunction(f):
            # Its call returns a generator whose body has not run: the intent would be
            # recorded for an effect that never happened, left in doubt for good.
            raise TypeError(
                f"effect {label!r} is a generator function; an effect returns its outcome"
            )
        if not inspect.iscoroutinefunction(f):
            _check_sync(label, f, reconcile)
        pass_key = _wants_key(f)

        def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
            return {
                "name": label,
                "key": key(*args, **kwargs) if key is not None else None,
                "reconcile": reconcile,
                "idempotent": idempotent,
            }

        if inspect.iscoroutinefunction(f):

            @functools.wraps(f)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                async def apply(idem: str) -> Any:
                    return await f(
                        *args, **({"idempotency_key": idem} if pass_key else {}), **kwargs
                    )

                return await arun_effect(fn=apply, **bind(args, kwargs))

            return cast(F, awrapper)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            def apply(idem: str) -> Any:
                return f(*args, **({"idempotency_key": idem} if pass_key else {}), **kwargs)

            return run_effect(fn=apply, **bind(args, kwargs))

        return cast(F, wrapper)

    return deco(fn) if fn is not None else deco
