"""The narrow interface every engine implements: atomic primitives and reads.

Each mutating method is one transaction on its engine (SQLite `BEGIN
IMMEDIATE`, one PostgreSQL transaction, one Redis Lua script). Stores hold no
policy: they do the compare-and-set, insert-if-absent and fence check that a
method names, and raise the matching `RemitError` when it does not hold.
Deciding *which* primitive to call lives in `remit_core.policy`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from remit_core.errors import Fenced, UnknownRecord, VersionMismatch
from remit_core.records import (
    BlobRecord,
    BranchRecord,
    CheckpointRecord,
    Claim,
    EffectRecord,
    FenceRef,
    InterruptRecord,
    InterruptStatus,
    WriteMode,
    WriteRecord,
)

#: Migration steps are numbered from 1; a store records each applied number.
#: A step may change one engine only (2 to 5: SQLite's one-statement commits; 6:
#: PostgreSQL's order of ids); 7 records the claim an effect's intent is written under.
SCHEMA_VERSION = 7


def url_options(url: str) -> dict[str, str]:
    """The query options of a store URL; an option given twice is a `ValueError`
    naming it (which one was meant is unclear)."""
    options: dict[str, str] = {}
    for name, value in parse_qsl(urlsplit(url).query, keep_blank_values=True):
        if name in options:
            raise ValueError(f"store URL option {name!r} is given twice in {display_url(url)!r}")
        options[name] = value
    return options


def display_url(url: str) -> str:
    """`url` fit to show in an error: with no password (in the address or, as libpq
    takes one, a `password=` option)."""
    parts = urlsplit(url)
    if parts.password is None and "password=" not in parts.query.lower():
        return url  # (as given: a round trip through urlunsplit rewrites sqlite:////abs)
    if parts.password is not None:
        netloc = parts.netloc.rpartition("@")
        user = netloc[0].partition(":")[0]
        parts = parts._replace(netloc=f"{user}:***@{netloc[2]}")
    if "password=" in parts.query.lower():
        query = "&".join(
            f"{k}=***" if k.strip().lower() == "password" else f"{k}{eq}{v}"
            for k, eq, v in (item.partition("=") for item in parts.query.split("&"))
        )
        parts = parts._replace(query=query)
    return urlunsplit(parts)


def newer_schema(applied: Iterable[int], where: str) -> VersionMismatch | None:
    """The refusal of a store that a newer Remit set up (a migration this one lacks)."""
    newest = max(applied, default=0)
    if newest <= SCHEMA_VERSION:
        return None
    return VersionMismatch(
        f"{where} has schema {newest}, set up by a newer Remit; this one knows up to "
        f"{SCHEMA_VERSION}: upgrade remit"
    )


def effect_deleted(run_id: str, effect_key: str) -> UnknownRecord:
    """The refusal of an effect write whose ledger entry was gone when it was read
    back (the run was deleted meanwhile, unfenced): nothing was recorded."""
    return UnknownRecord(
        "the effect's ledger entry was deleted meanwhile (the run was deleted); "
        "nothing was recorded",
        run_id=run_id,
        effect_key=effect_key,
    )


def head_gone(run_id: str, checkpoint_id: str | None) -> UnknownRecord:
    """The refusal of `move_head` to a checkpoint that is not stored (deleted
    meanwhile, e.g. by a prune that read the branches before the move)."""
    return UnknownRecord(
        "the branch's new head checkpoint does not exist (deleted meanwhile); "
        "the head was not moved",
        run_id=run_id,
        checkpoint_id=checkpoint_id,
    )


def stale_fence(fence: FenceRef, current: int | None, holder: str | None = None) -> Fenced:
    """The refusal of a write whose claim is no longer (`current`, `holder`)."""
    if current is None:
        now = "the claim is gone or changed"
    elif current != fence.fence:
        now = f"the claim's current fence is {current}"
    elif holder == "":
        now = "the claim was released"
    else:
        now = f"the claim is now held by {holder!r}"
    return Fenced(
        f"write carries fence {fence.fence} of holder {fence.holder!r} but {now}",
        run_id=fence.run_id,
        scope=fence.scope,
    )


class Store(ABC):
    """Atomic primitives over one engine. Thread-safe; safe to share in a process."""

    url: str

    # -- lifecycle -----------------------------------------------------------
    @abstractmethod
    def setup(self) -> None:
        """Create or migrate the schema; idempotent, safe from many processes at once."""

    @abstractmethod
    def applied_migrations(self) -> list[int]:
        """Numbers of the migration steps recorded in the store, ascending."""

    @abstractmethod
    def close(self) -> None:
        """Release connections; the store may not be used afterwards."""

    # -- checkpoints and branches -------------------------------------------
    @abstractmethod
    def commit_checkpoint(
        self,
        record: CheckpointRecord,
        *,
        expected_head: str | None,
        blobs: Sequence[BlobRecord] = (),
        writes: Sequence[WriteRecord] = (),
        fence: FenceRef | None = None,
        release: Claim | None = None,
    ) -> None:
        """Append `record` and move its branch head to it, atomically.

        Holds only if the branch head is `expected_head` (None: the branch does
        not exist yet, and is created), and `fence` (if given) is its claim's
        current fence and holder. `blobs` are inserted if absent and `writes` with
        mode "overwrite", in the same transaction. `release` is a claim given up
        once the commit holds (as `release_claim`; in the same transaction where
        the engine allows). Raises `HeadMoved`, `Fenced`.
        """

    @abstractmethod
    def get_checkpoint(self, run_id: str, ns: str, checkpoint_id: str) -> CheckpointRecord | None:
        """One checkpoint, or None."""

    @abstractmethod
    def list_checkpoints(
        self,
        run_id: str | None,
        ns: str | None = None,
        *,
        before_id: str | None = None,
        limit: int | None = None,
    ) -> list[CheckpointRecord]:
        """Checkpoints newest first (by checkpoint id); `run_id`/`ns` None: all."""

    @abstractmethod
    def get_branch(self, run_id: str, ns: str, branch: str) -> BranchRecord | None:
        """One branch, or None."""

    def get_head(self, run_id: str, ns: str, branch: str) -> CheckpointRecord | None:
        """The head checkpoint of a branch, or None (an engine may read it in one step)."""
        b = self.get_branch(run_id, ns, branch)
        if b is None or b.head_id is None:
            return None
        return self.get_checkpoint(run_id, ns, b.head_id)

    @abstractmethod
    def list_branches(self, run_id: str, ns: str | None = None) -> list[BranchRecord]:
        """Every branch of a run (of one namespace, if given)."""

    @abstractmethod
    def create_branch(self, branch: BranchRecord, *, fence: FenceRef | None = None) -> BranchRecord:
        """Insert a fork branch keyed by its fork token, if absent.

        Returns the branch now stored for `(run_id, ns, fork_token)`: the new
        one, or the one an earlier call with the same token created (P3). With
        `fence`, `Fenced` unless that claim is still current, checked in the same
        transaction as the insert (L2: a holder taken over makes no branch).
        """

    def move_head(
        self,
        run_id: str,
        ns: str,
        branch: str,
        *,
        expected_head: str | None,
        new_head: str | None,
        new_seq: int,
    ) -> None:
        """Set a branch's head to `new_head` if it is still `expected_head` (else `HeadMoved`).

        Only deletion uses it, to move a head back before its checkpoint is
        removed; commits move heads forward with `commit_checkpoint`. A `new_head`
        that is not stored (a concurrent delete removed it) is refused with
        `UnknownRecord`, in the same transaction, so no head names a lost checkpoint.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot move a branch head")

    @abstractmethod
    def get_blobs(self, run_id: str, ns: str, keys: Sequence[str]) -> dict[str, bytes]:
        """The stored blobs among `keys`."""

    # -- step writes ---------------------------------------------------------
    @abstractmethod
    def put_writes(
        self, writes: Sequence[WriteRecord], *, mode: WriteMode, fence: FenceRef | None = None
    ) -> None:
        """Store step writes keyed by (run, ns, checkpoint, task, idx), atomically.

        mode "first": a key already present keeps its value; "overwrite":
        replace; "expect_absent": raise `WriteConflict` and write nothing if
        any key is present (an expected-sequence append).
        """

    @abstractmethod
    def get_writes(
        self, run_id: str, ns: str, checkpoint_id: str, *, after_idx: int | None = None
    ) -> list[WriteRecord]:
        """Writes of one checkpoint, ordered by (task_id, idx)."""

    def get_checkpoint_and_writes(
        self, run_id: str, ns: str, checkpoint_id: str
    ) -> tuple[CheckpointRecord | None, list[WriteRecord]]:
        """One checkpoint and its writes (as `get_writes`); (None, []) if it is absent.

        Engines where a round trip costs may read both in one.
        """
        record = self.get_checkpoint(run_id, ns, checkpoint_id)
        if record is None:
            return None, []
        return record, self.get_writes(run_id, ns, checkpoint_id)

    # -- interrupts ----------------------------------------------------------
    @abstractmethod
    def open_interrupts(
        self, records: Sequence[InterruptRecord], *, fence: FenceRef | None = None
    ) -> None:
        """Insert pending interrupts if absent (re-opening never resets a consumed one)."""

    @abstractmethod
    def consume_interrupt(
        self,
        run_id: str,
        branch: str,
        interrupt_id: str,
        value: bytes,
        *,
        consumer: str,
        now: float,
        fence: FenceRef | None = None,
        writes: Sequence[WriteRecord] = (),
    ) -> InterruptRecord:
        """Move a pending interrupt to consumed with `value`, once, and store
        `writes` (mode "first") in the same transaction: both or neither.

        Raises `ResumeConflict` if it is already consumed (neither the value nor
        the writes are stored), `UnknownRecord` if it does not exist, `Fenced` on
        a stale fence.
        """

    @abstractmethod
    def get_interrupt(self, run_id: str, branch: str, interrupt_id: str) -> InterruptRecord | None:
        """One interrupt, or None."""

    @abstractmethod
    def list_interrupts(
        self,
        run_id: str,
        branch: str | None = None,
        *,
        checkpoint_id: str | None = None,
        status: InterruptStatus | None = None,
    ) -> list[InterruptRecord]:
        """Interrupts of a run (of one branch, raised at one checkpoint, in one
        status: each if given), oldest first."""

    # -- claims --------------------------------------------------------------
    @abstractmethod
    def acquire_claim(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float
    ) -> Claim:
        """Take the claim on (run, scope) if free, expired, or already `holder`'s.

        A new holder gets a fence one above the last one ever issued for the
        scope. Raises `ResumeConflict` while another holder's lease is live.
        An engine may return before the take is durable: a take lost in a crash
        of the engine can hand its fence number out again, but never to the same
        holder, and fenced writes check both.
        """

    def acquire_claim_at_head(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float, ns: str = ""
    ) -> tuple[Claim, CheckpointRecord | None, list[WriteRecord]]:
        """`acquire_claim`, then the head of branch `scope` in `ns` as of the claim,
        and the head's writes (as `get_writes`).

        Engines where a round trip costs may do it all in one.
        """
        claim = self.acquire_claim(run_id, scope, holder, now=now, lease=lease)
        head = self.get_head(run_id, ns, scope)
        if head is None:
            return claim, None, []
        return claim, head, self.get_writes(run_id, ns, head.checkpoint_id)

    @abstractmethod
    def renew_claim(self, claim: Claim, *, now: float, lease: float) -> Claim:
        """Extend a claim's lease; `Fenced` if it was taken over or released."""

    @abstractmethod
    def release_claim(self, claim: Claim) -> None:
        """Give a claim up (a no-op if it was already taken over); the fence is kept,
        and writes under it are refused from then on."""

    @abstractmethod
    def get_claim(self, run_id: str, scope: str) -> Claim | None:
        """The claim row (holder "" when released), or None if never claimed."""

    # -- effect ledger -------------------------------------------------------
    @abstractmethod
    def begin_effect(
        self,
        run_id: str,
        effect_key: str,
        idempotency_key: str,
        *,
        now: float,
        fence: FenceRef | None = None,
    ) -> tuple[EffectRecord, bool]:
        """Record intent if the effect has no entry. Returns (entry, created)."""

    @abstractmethod
    def adopt_effect(
        self,
        run_id: str,
        effect_key: str,
        *,
        held: FenceRef | None,
        fence: FenceRef | None = None,
    ) -> tuple[EffectRecord, bool]:
        """Move an intent recorded under `held` to the caller's claim (`fence`), as a
        compare-and-set: only while it is still an intent recorded under `held`.
        Returns (entry, adopted). A caller about to reconcile or re-apply an intent in
        doubt adopts it first; another caller that decided on the same intent then
        finds it moved (to a claim that is held: in flight) and waits instead of
        applying it too. `UnknownRecord` if the entry is gone (the run was deleted)."""

    @abstractmethod
    def finish_effect(
        self,
        run_id: str,
        effect_key: str,
        outcome: bytes,
        *,
        now: float,
        fence: FenceRef | None = None,
    ) -> EffectRecord:
        """Move intent to done with `outcome`; an entry already done is returned unchanged."""

    @abstractmethod
    def get_effect(self, run_id: str, effect_key: str) -> EffectRecord | None:
        """One ledger entry, or None."""

    # -- whole runs ----------------------------------------------------------
    @abstractmethod
    def delete_run(self, run_id: str) -> None:
        """Delete every record of a run."""

    @abstractmethod
    def delete_checkpoints(self, run_id: str, ns: str, checkpoint_ids: Sequence[str]) -> int:
        """Delete checkpoints and their writes; refuses (skips) any branch head or fork base.

        Returns how many checkpoints were deleted.
        """

    @abstractmethod
    def copy_run(self, source_run_id: str, target_run_id: str) -> None:
        """Copy checkpoints, branches, blobs, writes, interrupts and the effect ledger of
        a run under a new id (a pending interrupt stays answerable in the copy, and a
        replayed effect of the shared past returns its recorded outcome). Claims are
        not copied: the copy is free."""
