"""`Remit`: the contract's policy driven over one store. What every shim calls.

It seals and verifies every payload, plans commits and forks with
`remit_core.policy`, takes leased claims with a heartbeat, and hits the
failpoints. Payloads stay bytes here: shims own their framework's encoding.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import itertools
import json
import math
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, NamedTuple, NoReturn, cast

from remit_core import codec, failpoints, policy
from remit_core.errors import (
    CorruptRecord,
    Fenced,
    ForkWithoutIntent,
    HeadMoved,
    ResumeConflict,
    StoreUnavailable,
    UnknownRecord,
)
from remit_core.records import (
    MAIN_BRANCH,
    BlobRecord,
    BranchRecord,
    CheckpointRecord,
    Claim,
    FenceRef,
    InterruptRecord,
    InterruptStatus,
    WriteMode,
    WriteRecord,
)
from remit_core.stores import Store, open_store
from remit_core.stores.base import display_url

DEFAULT_LEASE = 30.0
#: The plan of a run's first checkpoint, tried before any other.
_FIRST_ON_MAIN = policy.CommitPlan(MAIN_BRANCH, None, 1)
#: How many checkpoints of main a `Remit` remembers to skip planning a commit after them.
_SEEN_MAX = 1024


class _CommitAsk(NamedTuple):
    """What `Remit.commit` was asked to store (its checks passed)."""

    run_id: str
    checkpoint_id: str
    parent_id: str | None
    state: bytes
    ns: str
    metadata: Mapping[str, Any] | None
    fork_token: str | None
    schema_version: int
    workflow_version: str
    blobs: Mapping[str, bytes] | None
    writes: Sequence[WriteRecord]
    fence: FenceRef | None
    plan: policy.CommitPlan | None
    allow_new_root: bool


def _ckpt_identity(ns: str, checkpoint_id: str) -> str:
    return f"ckpt\x00{ns}\x00{checkpoint_id}"


def _write_identity(ns: str, checkpoint_id: str, task_id: str, idx: int) -> str:
    return f"write\x00{ns}\x00{checkpoint_id}\x00{task_id}\x00{idx}"


def _with_state(r: CheckpointRecord, state: bytes) -> CheckpointRecord:
    """`r` with other state bytes and a metadata dict of its own: a store may hand
    out one record more than once (`dataclasses.replace` costs twice as much)."""
    return CheckpointRecord(
        r.run_id,
        r.checkpoint_id,
        r.branch,
        r.parent_id,
        state,
        r.ns,
        r.seq,
        dict(r.metadata) if r.metadata else {},
        r.schema_version,
        r.workflow_version,
        r.created_at,
    )


def _write_with_value(w: WriteRecord, value: bytes) -> WriteRecord:
    """`w` with other value bytes (see `_with_state`)."""
    return WriteRecord(
        w.run_id, w.checkpoint_id, w.task_id, w.idx, w.channel, value, w.ns, w.task_path
    )


def _plain_metadata(metadata: Mapping[str, Any] | None) -> Any:
    """Metadata as stored, for comparing (key order aside)."""
    return json.loads(codec.dumps(dict(metadata or {}), exact=False))


def _checkpoint_differs(
    stored: CheckpointRecord,
    parent_id: str | None,
    state: bytes,
    metadata: Mapping[str, Any] | None,
    schema_version: int,
    workflow_version: str,
) -> str | None:
    """What of a commit differs from the checkpoint stored under its id, or None."""
    if stored.parent_id != parent_id:
        return f"parent ({stored.parent_id!r})"
    if stored.state != state:
        return "state"
    if (stored.schema_version, stored.workflow_version) != (schema_version, workflow_version):
        return "version"
    if _plain_metadata(stored.metadata) != _plain_metadata(metadata):
        return "metadata"
    return None


def _branch_fits(
    stored: CheckpointRecord,
    branch: BranchRecord | None,
    parent_id: str | None,
    fork_token: str | None,
    plan: policy.CommitPlan | None,
) -> bool:
    """Whether a commit would have put `stored` on its branch: a fork's first checkpoint
    only under its own token, a fork's later one under its token or none."""
    if plan is not None:
        return stored.branch == (plan.branch if plan.fork is None else plan.fork.branch)
    if branch is None or branch.fork_token is None:
        return True
    if fork_token is not None:
        return branch.fork_token == fork_token
    return branch.base_id != parent_id


def checked_id(name: str, value: object, *, empty: bool = False) -> str:
    """`value` if it is a str an id can be (not empty unless `empty`, no NUL), else a
    `TypeError`/`ValueError` naming it: every engine stores ids as text, and only
    a refusal before the store is asked reads the same on all of them."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__} {value!r:.60}")
    if not value and not empty:
        raise ValueError(f"{name} must not be empty")
    if "\x00" in value:
        raise ValueError(f"{name} must not contain a NUL character: {value!r:.60}")
    if not value.isascii() and not _encodable(value):
        raise ValueError(
            f"{name} must be valid Unicode text (it holds a lone surrogate, which no "
            f"engine can store): {value!r:.60}"
        )
    return value


def _encodable(text: str) -> bool:
    """Whether `text` has a UTF-8 form (no lone surrogate)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def check_fence_run(fence: FenceRef | None, run_id: str) -> None:
    """`Fenced` unless `fence` is None or a claim's on `run_id`: a claim guards the
    writes of its own run only (a fence of another run would pass for any run's)."""
    _check_fence_type(fence)
    if fence is not None and fence.run_id != run_id:
        raise Fenced(
            f"write to run {run_id!r} carries a fence of run {fence.run_id!r}: a claim "
            "fences writes to its own run only",
            run_id=run_id,
            scope=fence.scope,
        )


def _check_fence_type(fence: object) -> None:
    """A `TypeError` naming `fence` unless it is None or a claim's fence (a `FenceRef`,
    or the `Claim` it is made of): a handle passed for its fence broke in the store."""
    if fence is not None and not isinstance(fence, (FenceRef, Claim)):
        hint = " (pass the handle's .fence)" if isinstance(fence, ClaimHandle) else ""
        raise TypeError(f"fence must be a FenceRef{hint}, got {type(fence).__name__}")


def _check_ns(ns: object, *, every: bool = False) -> None:
    """`ns` is a namespace (a str, "" the root one), or None where the call may mean
    every namespace (`every`)."""
    if ns is not None or not every:
        checked_id("ns", ns, empty=True)


def _check_bytes(name: str, value: object) -> None:
    """A `TypeError` naming `value` unless it is a payload (bytes-like): the core
    seals payloads as they are; encoding them is the shim's business."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} must be bytes, got {type(value).__name__}")


def _checked_count(name: str, value: object, *, low: int = 0, high: int | None = None) -> int:
    """`value` if it is an int (not a bool) from `low` up to `high`, else the
    `TypeError`/`ValueError` naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r:.60}")
    if value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")
    return value


def _collected(items: Iterable[Any]) -> Sequence[Any]:
    """`items` as a sequence: an iterator or generator is read once here, where a call
    that checks its items and then stores them would find it spent the second time
    (and store nothing, without a word)."""
    return items if type(items) is list or type(items) is tuple else tuple(items)


#: Above the largest int every engine stores in a schema version or a write's idx
#: (a PostgreSQL `integer`).
_INT_LIMIT = 2**31
#: The largest count every engine takes (a 64-bit int).
_COUNT_LIMIT = 2**63 - 1
_WRITE_MODES = frozenset({"first", "overwrite", "expect_absent"})
_INTERRUPT_STATUSES = frozenset({"pending", "consumed"})
#: The (status, value is None) pairs a stored interrupt can have.
_INTERRUPT_SHAPES = frozenset({("pending", True), ("consumed", False)})


def _checked_write(w: WriteRecord) -> None:
    """A step write's ids and value are what every engine stores alike (see `checked_id`)."""
    if (
        type(w) is WriteRecord
        and type(w.run_id) is str
        and type(w.checkpoint_id) is str
        and type(w.task_id) is str
        and type(w.channel) is str
        and type(w.ns) is str
        and type(w.task_path) is str
        and type(w.idx) is int
        and type(w.value) is bytes
        and w.run_id != ""
        and w.checkpoint_id != ""
        and -_INT_LIMIT <= w.idx < _INT_LIMIT
        and "\x00"
        not in (ids := f"{w.run_id}{w.checkpoint_id}{w.task_id}{w.channel}{w.ns}{w.task_path}")
        and (ids.isascii() or _encodable(ids))
    ):
        return  # the common case, in one test
    if not isinstance(w, WriteRecord):
        raise TypeError(f"a step write must be a WriteRecord, got {type(w).__name__}")
    checked_id("run_id", w.run_id)
    checked_id("checkpoint_id", w.checkpoint_id)
    checked_id("task_id", w.task_id, empty=True)
    checked_id("channel", w.channel, empty=True)
    checked_id("ns", w.ns, empty=True)
    checked_id("task_path", w.task_path, empty=True)
    _checked_count("write idx", w.idx, low=-_INT_LIMIT, high=_INT_LIMIT - 1)
    _check_bytes("write value", w.value)


def _plain_ids(
    run_id: object,
    checkpoint_id: object,
    ns: object,
    workflow_version: object,
    parent_id: object,
    fork_token: object,
) -> bool:
    """Whether a commit's ids all pass `checked_id` (the common case, in one test)."""
    joined = f"{run_id}{checkpoint_id}{ns}{workflow_version}{parent_id}{fork_token}"
    return (
        type(run_id) is str
        and type(checkpoint_id) is str
        and type(ns) is str
        and type(workflow_version) is str
        and (parent_id is None or type(parent_id) is str)
        and (fork_token is None or (type(fork_token) is str and fork_token != ""))
        and run_id != ""
        and checkpoint_id != ""
        and parent_id != ""
        and "\x00" not in joined
        and (joined.isascii() or _encodable(joined))
    )


#: The shortest lease a claim may have, in seconds. A claim is renewed every third of
#: its lease; one shorter than a store's round trip under load would lapse while its
#: holder runs, and let another resumer take the run (no mutual exclusion).
MIN_LEASE = 0.1


def checked_lease(lease: float) -> float:
    """`lease` as seconds if it is a finite number of at least `MIN_LEASE`, else
    `ValueError`: a claim with no lease left would let every resumer take it."""
    if isinstance(lease, bool) or not isinstance(lease, (int, float)):
        raise TypeError(f"lease must be a number of seconds, got {type(lease).__name__}")
    try:
        seconds = float(lease)
    except OverflowError:  # an int too large for a float
        seconds = math.inf
    if not (math.isfinite(seconds) and seconds >= MIN_LEASE):
        raise ValueError(
            f"lease must be a finite number of seconds of at least {MIN_LEASE}, got {lease!r:.40}"
        )
    return seconds


#: How early (a share of the lease) a heartbeat may renew a claim, to share a wake-up:
#: a quarter of its period of a third of the lease.
_EARLY = 1 / 12


class _LeaseKeeper:
    """One thread per process renews the lease of every heartbeat claim, each
    every `lease / 3`, instead of one thread per claim: starting a thread costs
    more than taking the claim. A forked child starts with no renewals (its
    parent's claims are not its own) and a thread of its own on first use.

    `add` appends to an inbox without the lock and wakes the thread only when
    the new claim is due before the thread's next wake-up. A wake-up also renews
    the claims due within the next quarter of their period (a little early), so
    a process taking many claims wakes a few times per period, not once per
    claim; a claim released meanwhile is dropped without a round trip.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._wake = threading.Condition(threading.Lock())
        self._inbox: collections.deque[tuple[float, ClaimHandle]] = collections.deque()
        self._due: list[tuple[float, int, ClaimHandle]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        # When the thread next looks at the inbox; +inf while it is between looks.
        self._wake_at = math.inf
        # Whether this wake-up takes claims that are due soon, not only those due now.
        self._batching = False
        self.wakeups = 0

    def add(self, handle: ClaimHandle) -> None:
        """Renew `handle` every `handle.lease / 3` seconds until it stops."""
        due = time.monotonic() + handle.lease / 3
        self._inbox.append((due, handle))
        # Read after the append: if the thread set its wake-up before draining
        # this entry, the wake-up is +inf (we notify) or early enough.
        if due < self._wake_at or self._thread is None:
            with self._wake:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="remit-leases", daemon=True
                    )
                    self._thread.start()
                self._wake.notify()

    def _next(self) -> ClaimHandle:
        with self._wake:
            while True:
                self._wake_at = math.inf
                inbox, due = self._inbox, self._due
                while inbox:
                    at, handle = inbox.popleft()
                    heapq.heappush(due, (at, next(self._order), handle))
                now = time.monotonic()
                if due:
                    at, _, handle = due[0]
                    if at <= now or (self._batching and at - handle.lease * _EARLY <= now):
                        self._batching = True
                        return heapq.heappop(due)[2]
                self._batching = False
                delay = due[0][0] - now if due else math.inf
                self._wake_at = now + delay
                self._wake.wait(None if delay == math.inf else delay)
                self.wakeups += 1

    def _run(self) -> None:
        while True:
            handle = self._next()
            if handle._renew():
                self._inbox.append((time.monotonic() + handle.lease / 3, handle))


_keeper = _LeaseKeeper()
os.register_at_fork(after_in_child=_keeper._reset)
#: How many forks deep this process is; a forked child needs a resumer identity of its own.
_forks = 0


#: This process's own mark, in each call's holder under an explicit `Remit(holder=)`.
_process_mark = uuid.uuid4().hex[:8]


def _count_fork() -> None:
    global _forks, _process_mark
    _forks += 1
    _process_mark = uuid.uuid4().hex[:8]


os.register_at_fork(after_in_child=_count_fork)
_holder_serial = itertools.count(1)


#: How long a claim given up while effects of it are still running in this process
#: is kept for them at most (`_EffectsInProgress`): past it, it is released anyway.
HELD_FOR_EFFECTS = 120.0


class _EffectsInProgress:
    """The effect calls running in this process, per claim they run under (its fence).

    A claim given up while one is still running (a step that raised while a sibling
    of `asyncio.gather` was applying one, a cancel that cannot stop a blocking call
    run in a thread) is kept, renewed, until the last ends, then released: until
    then its intent is in flight to every other process, not in doubt (an intent is
    in flight while the claim it was recorded under is held). Without that another
    process could ask the target before the call landed, be told "not applied", and
    apply it again. A claim of the same scope taken in this process meanwhile takes
    it over at once (its own effect calls wait for the running one, by their turn).
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[FenceRef, int] = {}
        self._held: dict[FenceRef, ClaimHandle] = {}

    def enter(self, fence: FenceRef) -> None:
        with self._lock:
            self._counts[fence] = self._counts.get(fence, 0) + 1

    def leave(self, fence: FenceRef) -> None:
        with self._lock:
            left = self._counts[fence] - 1
            if left:
                self._counts[fence] = left
                return
            del self._counts[fence]
            handle = self._held.pop(fence, None)
        if handle is not None:
            with contextlib.suppress(Exception):  # (if it fails, the lease runs out: L1)
                handle.release()

    def busy(self, fence: FenceRef) -> bool:
        """Whether effect calls under the claim of `fence` run here."""
        with self._lock:
            return bool(self._counts.get(fence))

    def keep(self, handle: ClaimHandle) -> bool:
        """Whether `handle`'s claim has effect calls running here: then it is kept for
        them (released when the last ends) and the caller does not release it."""
        fence = handle.fence
        with self._lock:
            if not self._counts.get(fence):
                self._held.pop(fence, None)
                return False
            self._held[fence] = handle
            return True

    def kept(self, run_id: str, scope: str, store: Store) -> ClaimHandle | None:
        """The claim on (`run_id`, `scope`) of `store` kept here for its effects, if any."""
        with self._lock:
            for fence, handle in self._held.items():
                if (fence.run_id, fence.scope) == (run_id, scope) and handle._store is store:
                    return handle
        return None


_effects_in_progress = _EffectsInProgress()
os.register_at_fork(after_in_child=_effects_in_progress._reset)


def effect_calls(fence: FenceRef | None) -> contextlib.AbstractContextManager[None]:
    """While an effect call runs under the claim of `fence` (`effects.run_effect`):
    that claim, given up meanwhile, is kept until the call ends."""
    if fence is None:
        return contextlib.nullcontext()
    return _effect_call(fence)


@contextlib.contextmanager
def _effect_call(fence: FenceRef) -> Iterator[None]:
    _effects_in_progress.enter(fence)
    try:
        yield
    finally:
        _effects_in_progress.leave(fence)


class ClaimHandle:
    """A held claim; renews its lease in the background until released.

    `fence` is what writes under the claim present. If a renewal finds the
    claim taken over, `lost` becomes true and later fenced writes fail.
    """

    def __init__(self, remit: Remit, claim: Claim, lease: float, heartbeat: bool) -> None:
        self._remit = remit
        self.claim = claim
        self._fence: FenceRef | None = None
        self.lease = lease
        self.lost = False
        self._stopped = False
        self._released = False
        self._release_soon = False
        self._kept_since: float | None = None  # given up, kept for its effects since
        self._renewing = threading.Lock()
        self._forks = _forks
        remit._track(self)
        if heartbeat:
            _keeper.add(self)

    @property
    def fence(self) -> FenceRef:
        # A renewal keeps the fence; only a new claim (a new handle) changes it.
        ref = self._fence
        if ref is None:
            ref = self._fence = FenceRef.of(self.claim)
        return ref

    @property
    def _store(self) -> Store:
        return self._remit.store

    def _renew(self) -> bool:
        """One heartbeat; whether to keep renewing."""
        kept = self._kept_since is not None and (
            time.monotonic() - self._kept_since < HELD_FOR_EFFECTS
        )
        with self._renewing:
            if self._stopped:
                return False
            if not self._release_soon or kept:
                try:
                    self.claim = self._remit.store.renew_claim(
                        self.claim, now=self._remit.clock(), lease=self.lease
                    )
                except Fenced:
                    self.lost = True
                    return False
                except Exception:  # a passing store error: try again next beat
                    return True
                return True
        with contextlib.suppress(Exception):  # (if it fails, the lease runs out: L1)
            self.release(force=self._kept_since is not None)
        return not self._stopped  # (kept for effect calls still running: renewed)

    @property
    def released(self) -> bool:
        """Whether the claim was given up (released, or with a commit) or lost."""
        return self._released or self.lost

    @property
    def given_up(self) -> bool:
        """Whether this holder gave the claim up (released, or with a commit): its
        work under the claim is over. A claim taken over is lost, not given up."""
        return self._released

    def release(self, *, force: bool = False) -> None:
        """Stop renewing and give the claim up (no-op if it was taken over or
        given up already: a second call makes no round trip). While effect calls
        of it still run in this process, it is kept for them, renewed, and
        released when the last ends (`_EffectsInProgress`), unless `force`."""
        if not force and not self.released and _effects_in_progress.keep(self):
            if self._kept_since is None:
                self._kept_since = time.monotonic()
            self._release_soon = True  # (the lease keeper's fallback, past HELD_FOR_EFFECTS)
            return
        with self._renewing:  # waits for a renewal in flight
            self._stopped = True
            if self.released:
                return
            self._released = True
        try:
            self._remit.store.release_claim(self.claim)
        except BaseException:
            self._released = False  # not given up: a later call may try again
            raise

    def release_soon(self) -> None:
        """Have the lease keeper release the claim at its next beat instead of renewing
        it. Takes no lock and makes no round trip: safe in a finalizer, which runs
        wherever the garbage collector does."""
        self._release_soon = True

    def _given_up(self) -> None:
        """The claim was given up with a commit: stop renewing, release no more."""
        self._stopped = self._released = True

    def abandon(self) -> None:
        """Stop renewing without releasing: the lease lapses as if the holder died."""
        self._stopped = True

    def __enter__(self) -> ClaimHandle:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class _ClosedStore:
    """What a closed `Remit` calls its store: every use raises `StoreUnavailable`
    naming the store, where the closed store would have reopened or hung."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __getattr__(self, name: str) -> NoReturn:
        raise StoreUnavailable(
            f"this Remit over {display_url(self.url)} is closed; open a new one to "
            "use the store again"
        )


#: How many open `Remit`s opened each shared store by its URL (see `Remit.close`).
_store_users: dict[Store, int] = {}
_store_users_lock = threading.Lock()


def _use_store(store: Store) -> None:
    with _store_users_lock:
        _store_users[store] = _store_users.get(store, 0) + 1


def _unuse_store(store: Store) -> bool:
    """Count one user of `store` fewer (a `Remit` closed or collected); whether it
    was the last."""
    with _store_users_lock:
        users = _store_users.pop(store, 1) - 1
        if users:
            _store_users[store] = users
    return not users


class Remit:
    """The Resume Contract over one store.

    `Remit("sqlite:///remit.db")` or `Remit(store)`. `lease` is the claim
    lease in seconds; `clock` returns UTC epoch seconds (injectable for tests).
    `close()` (or a `with` block) gives up this instance's claims and, once no
    other open `Remit` of the process opened it by URL, closes the store.
    """

    def __init__(
        self,
        store: Store | str,
        *,
        lease: float = DEFAULT_LEASE,
        clock: Callable[[], float] = time.time,
        holder: str | None = None,
    ) -> None:
        self.lease = checked_lease(lease)
        if holder is not None:
            checked_id("holder", holder)
        self.store = open_store(store) if isinstance(store, str) else store
        # A store opened by URL is shared by every `Remit` of that URL; one collected
        # unclosed counts as closed, but leaves the store open.
        self._unuse: weakref.finalize[[Store], Remit] | None = None
        if isinstance(store, str):
            _use_store(self.store)
            self._unuse = weakref.finalize(self, _unuse_store, self.store)
        self._closed = False
        self._handles: weakref.WeakSet[ClaimHandle] = weakref.WeakSet()
        self.clock = clock
        self._holder = holder
        self._holder_forks = -1
        self._holder_auto = ""
        self._holder_lock = threading.Lock()
        self._main_seqs: dict[tuple[str, str, str], int] = {}
        # The last record sealed or verified here, and its payload: a store that
        # hands the same (immutable) record back needs no second check.
        self._opened: tuple[CheckpointRecord | None, bytes] = (None, b"")

    # -- lifecycle -------------------------------------------------------------
    def _track(self, handle: ClaimHandle) -> None:
        """Remember a claim taken through this instance, for `close` to give up."""
        with self._holder_lock:
            self._handles.add(handle)

    def close(self) -> None:
        """Give up the claims this instance took (in this process) and still holds,
        then close the store if this instance opened it by URL and no other open
        `Remit` did. Idempotent. Afterwards every call raises `StoreUnavailable`
        naming the store's URL. A claim the store cannot release now (the store is
        down) is no longer renewed: its lease runs out as if its holder had died (L1).
        """
        with self._holder_lock:
            if self._closed:
                return
            self._closed = True
            handles = [h for h in self._handles if h._forks == _forks]
        for handle in handles:
            try:
                handle.release(force=True)
            except Exception:
                handle.abandon()
        store, self.store = self.store, cast(Store, _ClosedStore(self.store.url))
        # A store passed in is the caller's to close.
        if self._unuse is not None and self._unuse():
            store.close()

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

    def __enter__(self) -> Remit:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def holder(self) -> str:
        """This process's resumer identity (fresh in a forked child)."""
        if self._holder is not None:
            return self._holder
        if self._holder_forks != _forks:
            # Threads asking at once must all get the one identity: a claim taken
            # under one and renewed under another would conflict with itself.
            with self._holder_lock:
                if self._holder_forks != _forks:
                    pid = os.getpid()
                    self._holder_auto = f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:8]}"
                    self._holder_forks = _forks
        return self._holder_auto

    def _caller(self) -> str:
        """The holder of one claim or consume: this call's alone. An explicit
        `holder` may be shared by processes (one name for a service, or a `Remit`
        made before a fork), whose serials run alike: without this process's mark,
        a second process would get the first's live claim back as its own ("keep")
        and two resumers would run the run at once (P5)."""
        serial = next(_holder_serial)
        if self._holder is None:
            return f"{self.holder}/{serial}"
        return f"{self._holder}/{_process_mark}.{serial}"

    # -- checkpoints -----------------------------------------------------------
    def plan(
        self,
        run_id: str,
        parent_id: str | None,
        *,
        ns: str = "",
        fork_token: str | None = None,
        allow_new_root: bool = False,
    ) -> policy.CommitPlan:
        """Where a checkpoint with this parent would go (raises `ForkWithoutIntent`)."""
        checked_id("run_id", run_id)
        _check_ns(ns)
        if parent_id is not None:
            checked_id("parent_id", parent_id)
        branches = self.store.list_branches(run_id, ns)
        return policy.plan_commit(
            run_id,
            ns,
            parent_id,
            branches,
            fork_token=fork_token,
            now=self.clock(),
            allow_new_root=allow_new_root,
        )

    def commit(
        self,
        *,
        run_id: str,
        checkpoint_id: str,
        parent_id: str | None,
        state: bytes,
        ns: str = "",
        metadata: Mapping[str, Any] | None = None,
        fork_token: str | None = None,
        schema_version: int = 1,
        workflow_version: str = "",
        blobs: Mapping[str, bytes] | None = None,
        writes: Sequence[WriteRecord] = (),
        fence: FenceRef | None = None,
        plan: policy.CommitPlan | None = None,
        allow_new_root: bool = False,
        release: ClaimHandle | None = None,
    ) -> CheckpointRecord:
        """Commit a checkpoint after `parent_id`: a compare-and-set of its branch head.

        Raises `ForkWithoutIntent` if `parent_id` is not a head and no
        `fork_token` is given, `HeadMoved` if another writer won the race,
        `Fenced` if `fence` is stale or of another run. Nothing is written when it raises.
        `allow_new_root`: see `policy.plan_commit`. `release`: a claim to give
        up with the commit, for a writer whose last write this is (its later
        `release()` is then free).
        """
        if not (
            _plain_ids(run_id, checkpoint_id, ns, workflow_version, parent_id, fork_token)
            and type(state) is bytes
            and type(schema_version) is int
            and 0 <= schema_version < _INT_LIMIT
        ):
            checked_id("run_id", run_id)  # each raises, naming what is wrong
            checked_id("checkpoint_id", checkpoint_id)
            checked_id("ns", ns, empty=True)
            checked_id("workflow_version", workflow_version, empty=True)
            if parent_id is not None:
                checked_id("parent_id", parent_id)
            if fork_token is not None:
                checked_id("fork_token", fork_token)
            _check_bytes("state", state)
            _checked_count("schema_version", schema_version, high=_INT_LIMIT - 1)
        if blobs is not None and not isinstance(blobs, Mapping):
            raise TypeError(
                f"blobs must map each blob key to its bytes, got {type(blobs).__name__}"
            )
        if metadata is not None and not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a mapping, got {type(metadata).__name__}")
        if release is not None and not isinstance(release, ClaimHandle):
            raise TypeError(f"release must be a ClaimHandle, got {type(release).__name__}")
        if plan is not None and not isinstance(plan, policy.CommitPlan):
            raise TypeError(f"plan must be a CommitPlan, got {type(plan).__name__}")
        if blobs and not (
            all(type(k) is str and type(v) is bytes for k, v in blobs.items())
            and "\x00" not in (keys := "".join(blobs))
            and (keys.isascii() or _encodable(keys))
        ):
            for key, value in blobs.items():
                checked_id("blob key", key, empty=True)
                _check_bytes("blob value", value)
        writes = _collected(writes)
        for w in writes:
            _checked_write(w)
        check_fence_run(fence, run_id)  # (its writes may be other runs': they ride with it)
        ask = _CommitAsk(
            run_id, checkpoint_id, parent_id, state, ns, metadata, fork_token,
            schema_version, workflow_version, blobs, writes, fence, plan, allow_new_root,
        )  # fmt: skip
        if release is not None and _effects_in_progress.busy(release.fence):
            # Effect calls of the claim still run here: it is not given up with the
            # commit but after it, by `release()`, which keeps it for them.
            stored = self._commit_giving_up(ask, None)
            release.release()
            return stored
        return self._commit_giving_up(ask, release)

    def _commit_giving_up(self, ask: _CommitAsk, release: ClaimHandle | None) -> CheckpointRecord:
        """`commit` of a checked `ask`, giving up `release` with it."""
        try:
            return self._commit(ask, release)
        except (ForkWithoutIntent, HeadMoved, Fenced) as exc:
            # A retry of a commit that landed (its reply was lost) finds its parent
            # no longer a head, or (`release`) the claim it gave up released: the
            # same checkpoint stored is its answer.
            if isinstance(exc, Fenced) and not self._released_by_itself(release):
                raise
            stored = self._landed(exc, ask)
            if release is not None:
                with contextlib.suppress(StoreUnavailable):
                    self.store.release_claim(release.claim)
                release._given_up()
            return stored

    def _released_by_itself(self, release: ClaimHandle | None) -> bool:
        """Whether the claim a commit gave up (`release`) is released at its own fence:
        no one took it since, so a `Fenced` retry may be a commit of its own that landed.
        A claim taken over since (a higher fence) means a zombie's commit: refused, even
        if the new holder stored a checkpoint like it (L2)."""
        if release is None:
            return False
        held = release.claim
        current = self.store.get_claim(held.run_id, held.scope)
        return current is not None and current.fence == held.fence and current.holder == ""

    def _commit(self, ask: _CommitAsk, release: ClaimHandle | None) -> CheckpointRecord:
        run_id, ns, parent_id, fork_token = ask.run_id, ask.ns, ask.parent_id, ask.fork_token
        plan, state = ask.plan, ask.state
        guess = None
        if plan is None and fork_token is None and parent_id is None:
            # A first checkpoint usually starts a new run: try to create main
            # straight away; if main exists, plan from the branches.
            guess = _FIRST_ON_MAIN
        elif plan is None and fork_token is None and parent_id is not None:
            # The parent was main's head when this process last saw it: try the
            # compare-and-set straight away; if it lost, plan from the branches.
            seq = self._main_seqs.get((run_id, ns, parent_id))
            if seq is not None:
                guess = policy.CommitPlan(MAIN_BRANCH, parent_id, seq + 1)
        plan = (
            plan
            or guess
            or self.plan(
                run_id, parent_id, ns=ns, fork_token=fork_token, allow_new_root=ask.allow_new_root
            )
        )
        if plan.fork is not None:
            # The store encodes the metadata with the checkpoint; refused there, it
            # would leave this branch behind: encode it before creating anything.
            codec.dumps(dict(ask.metadata or {}), exact=False)
            # The branch is made before the commit's fenced write: fenced too, a
            # holder whose claim was taken over leaves none behind (L2).
            failpoints.hit("fork.before_create")
            created = self.store.create_branch(plan.fork, fence=ask.fence)
            if created.head_id != parent_id:
                raise HeadMoved(
                    f"fork token {fork_token!r} already continued past {parent_id!r}",
                    run_id=run_id,
                    checkpoint_id=parent_id,
                )
            plan = dataclasses.replace(plan, branch=created.branch)
        now = self.clock()
        record = CheckpointRecord(
            run_id=run_id,
            checkpoint_id=ask.checkpoint_id,
            branch=plan.branch,
            parent_id=parent_id,
            state=codec.seal(state, _ckpt_identity(ns, ask.checkpoint_id)),
            ns=ns,
            seq=plan.seq,
            metadata=dict(ask.metadata or {}),
            schema_version=ask.schema_version,
            workflow_version=ask.workflow_version,
            created_at=now,
        )
        sealed_blobs = (
            [
                BlobRecord(run_id, k, codec.seal(v, f"blob\x00{ns}\x00{k}"), ns)
                for k, v in ask.blobs.items()
            ]
            if ask.blobs
            else ()
        )
        sealed_writes = [self._seal_write(w) for w in ask.writes] if ask.writes else ()
        failpoints.hit("checkpoint.before_commit")
        while True:
            try:
                self.store.commit_checkpoint(
                    record,
                    expected_head=plan.expected_head,
                    blobs=sealed_blobs,
                    writes=sealed_writes,
                    fence=ask.fence,
                    release=None if release is None else release.claim,
                )
                break
            except HeadMoved:
                if guess is None:
                    raise
                guess = None
                plan = self.plan(run_id, parent_id, ns=ns, allow_new_root=ask.allow_new_root)
                record = dataclasses.replace(record, branch=plan.branch, seq=plan.seq)
        if release is not None:
            release._given_up()
        self._seen(record, parent_id)
        opened = _with_state(record, state)
        self._opened = (record, state)
        failpoints.hit("checkpoint.after_commit")
        return opened

    def _landed(
        self, exc: ForkWithoutIntent | HeadMoved | Fenced, ask: _CommitAsk
    ) -> CheckpointRecord:
        """The stored checkpoint `checkpoint_id` if it is this commit's, verified; else
        re-raise `exc` (naming the stored checkpoint and what differs if there is one;
        `Fenced` as it was: the claim is what refused the write)."""
        run_id, checkpoint_id, ns, blobs = ask.run_id, ask.checkpoint_id, ask.ns, ask.blobs
        found = self.store.get_checkpoint(run_id, ns, checkpoint_id)
        if found is None:
            raise exc
        stored = self._open_ckpt(found)
        differs = _checkpoint_differs(
            stored, ask.parent_id, ask.state, ask.metadata, ask.schema_version, ask.workflow_version
        )
        if differs is None:
            branch = next(
                (b for b in self.store.list_branches(run_id, ns) if b.branch == stored.branch),
                None,
            )
            if not _branch_fits(stored, branch, ask.parent_id, ask.fork_token, ask.plan):
                differs = f"branch ({stored.branch!r})"
        if differs is None and blobs:
            kept = self.blobs(run_id, list(blobs), ns=ns)
            differs = next((f"blob {k!r}" for k, v in blobs.items() if kept.get(k) != v), None)
        if differs is None and ask.writes:
            differs = self._writes_differ(ask.writes)
        if differs is not None and isinstance(exc, Fenced):
            raise exc
        if differs is not None:
            raise type(exc)(
                f"checkpoint {checkpoint_id!r} is already stored with another {differs}; "
                "a checkpoint id names one checkpoint",
                **{**exc.ids, "checkpoint_id": checkpoint_id},
            ) from exc
        return stored

    def _writes_differ(self, writes: Sequence[WriteRecord]) -> str | None:
        """The first of `writes` whose slot holds something else, named; None if all hold them."""
        held: dict[tuple[str, str, str], dict[tuple[str, int], WriteRecord]] = {}
        for w in writes:
            where = (w.run_id, w.ns, w.checkpoint_id)
            if where not in held:
                held[where] = {
                    (s.task_id, s.idx): s for s in self.writes(w.run_id, w.checkpoint_id, ns=w.ns)
                }
            s = held[where].get((w.task_id, w.idx))
            if s is None or (s.channel, s.value, s.task_path) != (w.channel, w.value, w.task_path):
                if not any(
                    s is not None
                    and (o.run_id, o.ns, o.checkpoint_id, o.task_id, o.idx)
                    == (w.run_id, w.ns, w.checkpoint_id, w.task_id, w.idx)
                    and (s.channel, s.value, s.task_path) == (o.channel, o.value, o.task_path)
                    for o in writes
                ):  # (of two writes of one slot, the store keeps one)
                    return f"write {w.task_id}#{w.idx} of {w.checkpoint_id!r}"
        return None

    def _seen(self, record: CheckpointRecord, parent_id: str | None = None) -> None:
        """Remember a checkpoint of main and its seq, for the next commit after it
        (and forget its parent, which it replaced as head)."""
        if record.branch != MAIN_BRANCH:
            return
        seqs = self._main_seqs
        if parent_id is not None:
            seqs.pop((record.run_id, record.ns, parent_id), None)
        if len(seqs) >= _SEEN_MAX:
            with contextlib.suppress(KeyError, RuntimeError, StopIteration):
                del seqs[next(iter(seqs))]
        seqs[record.run_id, record.ns, record.checkpoint_id] = record.seq

    def _open_ckpt(self, record: CheckpointRecord) -> CheckpointRecord:
        sealed, verified = self._opened
        if record is sealed:
            return _with_state(record, verified)
        body = codec.unseal(
            record.state,
            _ckpt_identity(record.ns, record.checkpoint_id),
            run_id=record.run_id,
            checkpoint_id=record.checkpoint_id,
        )
        self._seen(record)
        self._opened = (record, body)
        return _with_state(record, body)

    def checkpoint(
        self, run_id: str, checkpoint_id: str, *, ns: str = ""
    ) -> CheckpointRecord | None:
        """One checkpoint, verified; None if absent. `CorruptRecord` if it fails to verify."""
        checked_id("run_id", run_id)
        checked_id("checkpoint_id", checkpoint_id)
        _check_ns(ns)
        record = self.store.get_checkpoint(run_id, ns, checkpoint_id)
        return None if record is None else self._open_ckpt(record)

    def checkpoint_and_writes(
        self, run_id: str, checkpoint_id: str, *, ns: str = ""
    ) -> tuple[CheckpointRecord | None, list[WriteRecord]]:
        """`checkpoint` and `writes` of it, read together (one round trip where the
        engine allows); (None, []) if the checkpoint is absent."""
        checked_id("run_id", run_id)
        checked_id("checkpoint_id", checkpoint_id)
        _check_ns(ns)
        record, found = self.store.get_checkpoint_and_writes(run_id, ns, checkpoint_id)
        if record is None:
            return None, []
        return self._open_ckpt(record), [self._open_write(w) for w in found]

    def branch(
        self, run_id: str, *, ns: str = "", branch: str = MAIN_BRANCH
    ) -> BranchRecord | None:
        """One branch of a run, or None."""
        checked_id("run_id", run_id)
        _check_ns(ns)
        checked_id("branch", branch)
        return self.store.get_branch(run_id, ns, branch)

    def branches(self, run_id: str, *, ns: str | None = None) -> list[BranchRecord]:
        """Every branch of a run (of one namespace, if `ns` is given)."""
        checked_id("run_id", run_id)
        _check_ns(ns, every=True)
        return self.store.list_branches(run_id, ns)

    def head(
        self, run_id: str, *, ns: str = "", branch: str = MAIN_BRANCH
    ) -> CheckpointRecord | None:
        """The head checkpoint of a branch, verified; None if the branch has none."""
        checked_id("run_id", run_id)
        _check_ns(ns)
        checked_id("branch", branch)
        record = self.store.get_head(run_id, ns, branch)
        return None if record is None else self._open_ckpt(record)

    def fork_branch(self, run_id: str, fork_token: str, *, ns: str = "") -> BranchRecord | None:
        """The branch a fork token made, if any."""
        checked_id("run_id", run_id)
        checked_id("fork_token", fork_token)
        _check_ns(ns)
        for b in self.store.list_branches(run_id, ns):
            if b.fork_token == fork_token:
                return b
        return None

    def history(
        self,
        run_id: str | None,
        *,
        ns: str | None = None,
        before_id: str | None = None,
        limit: int | None = None,
        verify: bool = True,
    ) -> list[CheckpointRecord]:
        """Checkpoints newest first; each verified unless `verify` is false."""
        if run_id is not None:
            checked_id("run_id", run_id)
        _check_ns(ns, every=True)
        if before_id is not None:
            checked_id("before_id", before_id, empty=True)
        if limit is not None:
            # Past what an engine counts in (a 64-bit int) every limit means "all".
            limit = min(_checked_count("limit", limit), _COUNT_LIMIT)
        records = self.store.list_checkpoints(run_id, ns, before_id=before_id, limit=limit)
        return [self._open_ckpt(r) for r in records] if verify else records

    def blobs(self, run_id: str, keys: Sequence[str], *, ns: str = "") -> dict[str, bytes]:
        """The stored blobs among `keys`, verified."""
        checked_id("run_id", run_id)
        _check_ns(ns)
        if isinstance(keys, str):
            raise TypeError("keys must be a collection of blob keys, not one str")
        keys = _collected(keys)
        for key in keys:
            checked_id("blob key", key, empty=True)
        found = self.store.get_blobs(run_id, ns, keys)
        return {
            k: codec.unseal(v, f"blob\x00{ns}\x00{k}", run_id=run_id, blob=k)
            for k, v in found.items()
        }

    # -- step writes ---------------------------------------------------------
    def _seal_write(self, w: WriteRecord) -> WriteRecord:
        identity = _write_identity(w.ns, w.checkpoint_id, w.task_id, w.idx)
        return _write_with_value(w, codec.seal(w.value, identity))

    def put_writes(
        self,
        writes: Sequence[WriteRecord],
        *,
        mode: WriteMode = "first",
        fence: FenceRef | None = None,
    ) -> None:
        """Store step writes atomically (see `Store.put_writes` for `mode`).

        A `fence` guards the writes of its claim's run; writes of other runs may
        ride with them in the same call (as with a commit), never on their own.
        """
        if mode not in _WRITE_MODES:
            raise ValueError(f"mode must be one of {sorted(_WRITE_MODES)}, got {mode!r}")
        writes = _collected(writes)
        for w in writes:
            _checked_write(w)
        _check_fence_type(fence)
        if fence is not None and writes and all(w.run_id != fence.run_id for w in writes):
            # A claim guards its own run's writes; other runs' writes may ride
            # with them in one atomic call, as with a commit, but never alone.
            check_fence_run(fence, writes[0].run_id)
        failpoints.hit("writes.before")
        try:
            self.store.put_writes([self._seal_write(w) for w in writes], mode=mode, fence=fence)
        except StoreUnavailable as lost:
            if mode != "expect_absent":
                raise  # (the same call again stores them, or finds them stored)
            self._landed_writes(writes, lost)
        failpoints.hit("writes.after")

    def _landed_writes(self, writes: Sequence[WriteRecord], lost: StoreUnavailable) -> None:
        """Return if an "expect_absent" put that failed in flight landed all the same.

        Its retry would find the slots taken by itself (`WriteConflict`). One read,
        on a fresh connection, tells: every slot holding what this call wrote, the
        put is acknowledged; else, or unreadable, the failure stands.
        """
        try:
            differs = self._writes_differ(writes)
        except StoreUnavailable:
            raise lost from lost.__cause__
        if differs is not None:
            raise lost

    def writes(
        self, run_id: str, checkpoint_id: str, *, ns: str = "", after_idx: int | None = None
    ) -> list[WriteRecord]:
        """Step writes of one checkpoint, verified, ordered by (task_id, idx)."""
        checked_id("run_id", run_id)
        checked_id("checkpoint_id", checkpoint_id)
        _check_ns(ns)
        if after_idx is not None:
            # No write's idx is past `_INT_LIMIT - 1`: any later one means "none".
            after_idx = min(_checked_count("after_idx", after_idx, low=-_INT_LIMIT), _INT_LIMIT)
        found = self.store.get_writes(run_id, ns, checkpoint_id, after_idx=after_idx)
        return [self._open_write(w) for w in found]

    def _open_write(self, w: WriteRecord) -> WriteRecord:
        identity = _write_identity(w.ns, w.checkpoint_id, w.task_id, w.idx)
        body = codec.unseal(w.value, identity, run_id=w.run_id, checkpoint_id=w.checkpoint_id)
        return _write_with_value(w, body)

    # -- interrupts ----------------------------------------------------------
    def open_interrupts(
        self,
        run_id: str,
        interrupts: Mapping[str, bytes | None],
        *,
        branch: str = MAIN_BRANCH,
        checkpoint_id: str | None = None,
        fence: FenceRef | None = None,
    ) -> None:
        """Record pending interrupts (id -> prompt bytes); existing ones are left as they are."""
        checked_id("run_id", run_id)
        checked_id("branch", branch)
        if checkpoint_id is not None:
            checked_id("checkpoint_id", checkpoint_id)
        if not isinstance(interrupts, Mapping):
            raise TypeError("interrupts must map each interrupt id to its prompt bytes or None")
        for iid, prompt in interrupts.items():
            checked_id("interrupt_id", iid)
            if prompt is not None:
                _check_bytes("prompt", prompt)
        check_fence_run(fence, run_id)
        now = self.clock()
        records = [
            InterruptRecord(
                run_id=run_id,
                branch=branch,
                interrupt_id=iid,
                checkpoint_id=checkpoint_id,
                prompt=None if p is None else codec.seal(p, f"prompt\x00{branch}\x00{iid}"),
                created_at=now,
            )
            for iid, p in interrupts.items()
        ]
        self.store.open_interrupts(records, fence=fence)

    def consume(
        self,
        run_id: str,
        interrupt_id: str,
        value: bytes,
        *,
        branch: str = MAIN_BRANCH,
        fence: FenceRef | None = None,
        writes: Sequence[WriteRecord] = (),
    ) -> InterruptRecord:
        """Consume a pending interrupt with `value`, once across all resumers (P5).

        `writes` (step writes of this run, kept where their slots are taken, as
        `put_writes` mode "first") are stored in the consume's own transaction:
        what a resume brings beside its value (a command's update, where it goes)
        is never lost to a resumer that dies after the value was taken.

        Raises `ResumeConflict` if it was already consumed (nothing stored). The
        record names this call as its consumer (`consumed_by`: the instance's
        holder and a serial): a consume whose reply was lost is asked after on a
        fresh connection, and answered as landed if it did.
        """
        checked_id("run_id", run_id)
        checked_id("interrupt_id", interrupt_id)
        checked_id("branch", branch)
        _check_bytes("value", value)
        check_fence_run(fence, run_id)
        writes = _collected(writes)
        for w in writes:
            _checked_write(w)
            if w.run_id != run_id:
                raise ValueError(
                    f"a consume stores writes of its own run only: run_id {run_id!r}, "
                    f"a write's {w.run_id!r}"
                )
        failpoints.hit("interrupt.before_consume")
        pending = self.store.get_interrupt(run_id, branch, interrupt_id)
        if pending is not None and pending.status != "consumed":
            # A prompt that fails to verify, or a record altered in the store, is refused
            # before the value is stored: after, the value would be consumed by a resumer
            # told that its resume failed.
            self._open_interrupt(pending)
        consumer = self._caller()
        try:
            record = self.store.consume_interrupt(
                run_id,
                branch,
                interrupt_id,
                codec.seal(value, f"value\x00{branch}\x00{interrupt_id}"),
                consumer=consumer,
                now=self.clock(),
                fence=fence,
                writes=[self._seal_write(w) for w in writes],
            )
        except StoreUnavailable as lost:
            record = self._landed_consume(run_id, branch, interrupt_id, consumer, lost)
        failpoints.hit("interrupt.after_consume")
        return self._open_interrupt(record)

    def _landed_consume(
        self,
        run_id: str,
        branch: str,
        interrupt_id: str,
        consumer: str,
        lost: StoreUnavailable,
    ) -> InterruptRecord:
        """The record of a consume that failed in flight, if it landed all the same.

        A connection lost after the store committed but before its reply arrived
        leaves the interrupt consumed by this call: the value is the run's, and
        raising would tell its resumer otherwise (asked again, it would get
        `ResumeConflict`). One read, on a fresh connection, tells: consumed by
        this call, it is acknowledged; pending, or unreadable, the failure stands
        and a retry can consume it.
        """
        try:
            again = self.store.get_interrupt(run_id, branch, interrupt_id)
        except StoreUnavailable:
            raise lost from lost.__cause__
        if again is None or again.status != "consumed" or again.consumed_by != consumer:
            raise lost
        return again

    def _open_interrupt(self, r: InterruptRecord) -> InterruptRecord:
        ids = {"run_id": r.run_id, "checkpoint_id": r.checkpoint_id, "interrupt_id": r.interrupt_id}
        if (r.status, r.value is None) not in _INTERRUPT_SHAPES:
            # Altered in the store: read as it stands, a consumed interrupt could take a
            # second value, or a resume go on with no value (P4, P5).
            has = "without" if r.value is None else "with"
            raise CorruptRecord(
                f"stored interrupt has status {r.status!r} {has} a resume value", **ids
            )
        prompt = value = None
        if r.prompt is not None:
            prompt = codec.unseal(r.prompt, f"prompt\x00{r.branch}\x00{r.interrupt_id}", **ids)
        if r.value is not None:
            value = codec.unseal(r.value, f"value\x00{r.branch}\x00{r.interrupt_id}", **ids)
        return dataclasses.replace(r, prompt=prompt, value=value)

    def interrupt(
        self, run_id: str, interrupt_id: str, *, branch: str = MAIN_BRANCH
    ) -> InterruptRecord | None:
        """One interrupt, its prompt and value verified; None if absent."""
        checked_id("run_id", run_id)
        checked_id("interrupt_id", interrupt_id)
        checked_id("branch", branch)
        r = self.store.get_interrupt(run_id, branch, interrupt_id)
        return None if r is None else self._open_interrupt(r)

    def interrupts(
        self,
        run_id: str,
        *,
        branch: str | None = None,
        checkpoint_id: str | None = None,
        status: InterruptStatus | None = None,
    ) -> list[InterruptRecord]:
        """Interrupts of a run, oldest first, verified: of one branch, raised at one
        checkpoint, in one status ("pending" or "consumed"), each if given. The store
        selects them, so a read of one checkpoint's or of the open ones costs what
        they are, not the rounds the run had."""
        checked_id("run_id", run_id)
        if branch is not None:
            checked_id("branch", branch)
        if checkpoint_id is not None:
            checked_id("checkpoint_id", checkpoint_id)
        if status is not None and (type(status) is not str or status not in _INTERRUPT_STATUSES):
            raise ValueError(f"status must be 'pending' or 'consumed', not {status!r}")
        rows = self.store.list_interrupts(
            run_id, branch, checkpoint_id=checkpoint_id, status=status
        )
        return [self._open_interrupt(r) for r in rows]

    # -- claims ------------------------------------------------------------
    def claim(
        self,
        run_id: str,
        scope: str = MAIN_BRANCH,
        *,
        lease: float | None = None,
        heartbeat: bool = True,
        holder: str | None = None,
    ) -> ClaimHandle:
        """Take the exclusive, leased claim on a run's scope, or raise `ResumeConflict`.

        Each call is its own holder (threads of one process exclude each other)
        unless `holder` is given: a caller that presents the holder of a live
        claim gets that claim back, same fence.
        """
        checked_id("run_id", run_id)
        checked_id("scope", scope)
        if holder is not None:
            checked_id("holder", holder, empty=True)
        lease = self.lease if lease is None else checked_lease(lease)
        holder = holder or self._caller()
        try:
            try:
                claim = self.store.acquire_claim(
                    run_id, scope, holder, now=self.clock(), lease=lease
                )
            except ResumeConflict:
                if not self._take_kept(run_id, scope):
                    raise
                claim = self.store.acquire_claim(
                    run_id, scope, holder, now=self.clock(), lease=lease
                )
        except StoreUnavailable as lost:
            claim = self._landed_claim(run_id, scope, holder, lost)
        failpoints.hit("claim.after_acquire")
        return ClaimHandle(self, claim, lease, heartbeat)

    def _take_kept(self, run_id: str, scope: str) -> bool:
        """Release a claim of this process on (`run_id`, `scope`) that was given up and
        is only kept for effect calls still running: a new claim here takes over."""
        kept = _effects_in_progress.kept(run_id, scope, self.store)
        if kept is None:
            return False
        kept.release(force=True)
        return True

    def _landed_claim(self, run_id: str, scope: str, holder: str, lost: StoreUnavailable) -> Claim:
        """The claim of a take that failed in flight, if it landed all the same.

        A take whose reply was lost leaves the run claimed by this call's holder, a
        holder no one else has: raising would leave its caller's retry (a new holder)
        in `ResumeConflict` with itself until the lease ran out. One read, on a fresh
        connection, tells: held by this holder, the claim is this call's; else, or
        unreadable, the failure stands.
        """
        try:
            taken = self.store.get_claim(run_id, scope)
        except StoreUnavailable:
            raise lost from lost.__cause__
        if taken is None or taken.holder != holder:
            raise lost
        return taken

    def claim_at_head(
        self,
        run_id: str,
        branch: str = MAIN_BRANCH,
        *,
        ns: str = "",
        lease: float | None = None,
        heartbeat: bool = True,
    ) -> tuple[ClaimHandle, CheckpointRecord | None, list[WriteRecord]]:
        """`claim(run_id, branch)`, the branch's head as of the claim and the head's
        writes, verified (one round trip where the engine allows). The claim is
        released if the head or a write fails to verify."""
        checked_id("run_id", run_id)
        checked_id("branch", branch)
        _check_ns(ns)
        lease = self.lease if lease is None else checked_lease(lease)
        holder = self._caller()
        try:
            try:
                claim, record, writes = self.store.acquire_claim_at_head(
                    run_id, branch, holder, now=self.clock(), lease=lease, ns=ns
                )
            except ResumeConflict:
                if not self._take_kept(run_id, branch):
                    raise
                claim, record, writes = self.store.acquire_claim_at_head(
                    run_id, branch, holder, now=self.clock(), lease=lease, ns=ns
                )
        except ResumeConflict:
            raise
        except Exception:
            # The take may have held and the store then failed to decode the head or
            # its writes (metadata, a record's header): give the claim up, or nobody
            # could resume the run until its lease ran out.
            with contextlib.suppress(Exception):
                taken = self.store.get_claim(run_id, branch)
                if taken is not None and taken.holder == holder:
                    self.store.release_claim(taken)
            raise
        failpoints.hit("claim.after_acquire")
        handle = ClaimHandle(self, claim, lease, heartbeat)
        try:
            if record is None:
                return handle, None, []
            return handle, self._open_ckpt(record), [self._open_write(w) for w in writes]
        except BaseException:
            handle.release()
            raise

    # -- forks ---------------------------------------------------------------
    def fork(
        self, run_id: str, base_id: str | None, fork_token: str, *, ns: str = ""
    ) -> BranchRecord:
        """The one branch `fork_token` names, created from `base_id` if it is new (P3).

        The same token from any process returns the same branch. A token
        already used for another base is refused with `ForkWithoutIntent`.
        `base_id` None makes a branch that starts empty (in a namespace that had
        no checkpoint yet at the point a run forked from).
        """
        checked_id("run_id", run_id)
        checked_id("fork_token", fork_token)
        checked_id("ns", ns, empty=True)
        if base_id is not None:
            checked_id("base_id", base_id)
            if self.store.get_checkpoint(run_id, ns, base_id) is None:
                raise UnknownRecord(
                    "fork base does not exist", run_id=run_id, checkpoint_id=base_id
                )
        branch = BranchRecord(
            run_id=run_id,
            branch=policy.fork_branch_name(fork_token),
            head_id=base_id,
            ns=ns,
            head_seq=0,
            base_id=base_id,
            fork_token=fork_token,
            created_at=self.clock(),
        )
        created = self.store.create_branch(branch)
        if created.base_id != base_id:
            raise ForkWithoutIntent(
                f"fork token {fork_token!r} was already used to fork from "
                f"{created.base_id!r}; use a new token",
                run_id=run_id,
                checkpoint_id=base_id,
            )
        return created

    # -- whole runs ----------------------------------------------------------
    def delete_run(self, run_id: str) -> None:
        self.store.delete_run(checked_id("run_id", run_id))

    def delete_checkpoints(self, run_id: str, ns: str, checkpoint_ids: Sequence[str]) -> int:
        """Delete checkpoints (and their writes), heads included: a deleted head first
        moves back to `policy.head_after_delete`. Fork bases are kept. Returns the count."""
        checked_id("run_id", run_id)
        _check_ns(ns)
        if isinstance(checkpoint_ids, str):
            raise TypeError("checkpoint_ids must be a collection of ids, not one str")
        checkpoint_ids = [checked_id("checkpoint_id", c) for c in checkpoint_ids]
        branches = self.store.list_branches(run_id, ns)
        # A fork base is kept: no head moves back for it (nor past it).
        doomed = set(checkpoint_ids) - {b.base_id for b in branches if b.base_id is not None}
        records = self.store.list_checkpoints(run_id, ns)
        failpoints.hit("delete.before_move")
        for b in branches:
            if b.head_id in doomed:
                new_head = policy.head_after_delete(b, records, doomed)
                self.store.move_head(
                    run_id,
                    ns,
                    b.branch,
                    expected_head=b.head_id,
                    new_head=None if new_head is None else new_head.checkpoint_id,
                    new_seq=0 if new_head is None else new_head.seq,
                )
        return self.store.delete_checkpoints(run_id, ns, sorted(doomed))

    def copy_run(self, source_run_id: str, target_run_id: str) -> None:
        """Copy a run's records (checkpoints, branches, channel values, step writes,
        interrupts, effect ledger; not its claim) to `target_run_id`, as the source
        is at one instant, while its commits go on. Records the target has already
        are kept, not overwritten: give it an unused id."""
        checked_id("source_run_id", source_run_id)
        self.store.copy_run(source_run_id, checked_id("target_run_id", target_run_id))

    def prune(self, run_ids: Iterable[str], *, keep_last: int = 1) -> int:
        """Delete old checkpoints, never a branch head, a fork base, or the newest
        `keep_last` of any branch. Returns how many were deleted."""
        if isinstance(run_ids, str):
            raise TypeError("run_ids must be a collection of run ids, not one str")
        _checked_count("keep_last", keep_last, low=1)
        deleted = 0
        for run_id in run_ids:
            records = self.store.list_checkpoints(checked_id("run_id", run_id), None)
            failpoints.hit("prune.after_list")
            for ns in sorted({r.ns for r in records}):
                in_ns = [r for r in records if r.ns == ns]
                branches = self.store.list_branches(run_id, ns)
                in_ns += self._kept_since(run_id, ns, in_ns, branches, keep_last)
                doomed = policy.prunable(in_ns, branches, keep_last=keep_last)
                deleted += self.store.delete_checkpoints(run_id, ns, doomed)
        return deleted

    def _kept_since(
        self,
        run_id: str,
        ns: str,
        records: Sequence[CheckpointRecord],
        branches: Sequence[BranchRecord],
        keep_last: int,
    ) -> list[CheckpointRecord]:
        """The checkpoints among the newest `keep_last` of a branch's line that were
        committed after `records` were listed (the branches, read after, have heads
        the list lacks): without them the line's walk would stop at the new head and
        count the older ones it should keep as prunable."""
        known = {r.checkpoint_id for r in records}
        extra: list[CheckpointRecord] = []
        for b in branches:
            cursor, n = b.head_id, 0
            while cursor is not None and n < keep_last and cursor not in known:
                record = self.store.get_checkpoint(run_id, ns, cursor)
                if record is None:
                    break
                known.add(cursor)
                extra.append(record)
                cursor, n = record.parent_id, n + 1
        return extra
