"""The contract's decisions, as plain functions over plain records (no I/O).

Stores perform the atomic step a decision names; the model checker
(`spec/`) explores exactly these functions. Every function here is total and
deterministic: same records in, same decision out.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from remit_core.errors import ForkWithoutIntent, HeadMoved, ResumeConflict, VersionMismatch
from remit_core.records import (
    MAIN_BRANCH,
    BranchRecord,
    CheckpointRecord,
    Claim,
    EffectRecord,
    FenceRef,
    InterruptRecord,
)

# -- commits and forks (P1, P3) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class CommitPlan:
    """Where a new checkpoint goes: compare-and-set `branch` from `expected_head`.

    `fork` is a branch to create (keyed by its token) before the commit.
    """

    branch: str
    expected_head: str | None
    seq: int
    fork: BranchRecord | None = None


def fork_branch_name(fork_token: str) -> str:
    """The deterministic branch name a fork token yields, the same in every process."""
    return "fork-" + hashlib.blake2b(fork_token.encode(), digest_size=8).hexdigest()


def plan_commit(
    run_id: str,
    ns: str,
    parent_id: str | None,
    branches: Sequence[BranchRecord],
    *,
    fork_token: str | None,
    now: float,
    allow_new_root: bool = False,
) -> CommitPlan:
    """Decide how a checkpoint whose parent is `parent_id` may be committed.

    Continuing a branch head is a plain compare-and-set. Continuing anything
    else is a fork: refused with `ForkWithoutIntent` unless a fork token is
    given, in which case it goes to the one branch that token names.
    With `allow_new_root`, a checkpoint without a parent on a run that already
    has a main line becomes that line's new head (compare-and-set of the
    current head): it continues from no checkpoint, so it is not a fork.
    """
    by_token = {b.fork_token: b for b in branches if b.fork_token is not None}
    if fork_token is not None and fork_token in by_token:
        fork = by_token[fork_token]
        if fork.head_id == parent_id:
            return CommitPlan(fork.branch, parent_id, fork.head_seq + 1)
        if fork.base_id == parent_id:
            raise HeadMoved(
                f"fork token {fork_token!r} already made branch {fork.branch!r}, now at "
                f"{fork.head_id!r}; read that branch instead of forking again",
                run_id=run_id,
                checkpoint_id=parent_id,
            )
    if parent_id is None:
        main = next((b for b in branches if b.branch == MAIN_BRANCH), None)
        if main is None:
            return CommitPlan(MAIN_BRANCH, None, 1)
        if allow_new_root:
            return CommitPlan(MAIN_BRANCH, main.head_id, main.head_seq + 1)
    else:
        heads = [b for b in branches if b.head_id == parent_id and b.fork_token is None]
        if fork_token is None:
            # A fork branch's own head. One still at its base holds no checkpoint of
            # its own: continuing that base is a fork of the line it came from, and
            # another token's branch is never continued under this one.
            heads += [
                b
                for b in branches
                if b.head_id == parent_id and b.fork_token is not None and b.head_id != b.base_id
            ]
        if heads:
            return CommitPlan(heads[0].branch, parent_id, heads[0].head_seq + 1)
    if fork_token is None:
        raise ForkWithoutIntent(
            "continuing from a checkpoint that is not the head of its branch is a fork; "
            "pass a fork token to create one named branch",
            run_id=run_id,
            checkpoint_id=parent_id,
        )
    branch = BranchRecord(
        run_id=run_id,
        branch=fork_branch_name(fork_token),
        head_id=parent_id,
        ns=ns,
        head_seq=0,
        base_id=parent_id,
        fork_token=fork_token,
        created_at=now,
    )
    return CommitPlan(branch.branch, parent_id, 1, fork=branch)


def branch_of(
    checkpoint: CheckpointRecord, branches: Sequence[BranchRecord]
) -> BranchRecord | None:
    """The branch a checkpoint was committed on."""
    for b in branches:
        if b.branch == checkpoint.branch and b.ns == checkpoint.ns:
            return b
    return None


def is_head(checkpoint_id: str, branches: Iterable[BranchRecord]) -> bool:
    """Whether continuing from `checkpoint_id` needs no fork."""
    return any(b.head_id == checkpoint_id for b in branches)


def plan_continue(
    run_id: str, branch: str, current: BranchRecord | None, parent_id: str | None
) -> CommitPlan:
    """Continue the named `branch` from `parent_id`: a plain compare-and-set of its head.

    For a writer that knows which line it extends (unlike `plan_commit`, which
    infers the branch from the parent). A head that moved on since the writer
    read it raises `HeadMoved` instead of committing over the newer checkpoint.
    Only the main line may start from nothing; a fork branch starts at its base.
    """
    if current is None:
        if parent_id is None and branch == MAIN_BRANCH:
            return CommitPlan(MAIN_BRANCH, None, 1)
        from remit_core.errors import UnknownRecord

        raise UnknownRecord(f"run has no branch {branch!r}", run_id=run_id)
    if current.head_id != parent_id:
        raise HeadMoved(
            f"branch {branch!r} moved on to {current.head_id!r} after this writer read "
            f"{parent_id!r}; another writer is driving it",
            run_id=run_id,
            checkpoint_id=parent_id,
        )
    return CommitPlan(branch, parent_id, current.head_seq + 1)


# -- claims and consume-once (P5, L1, L2) ------------------------------------

ClaimDecision = Literal["grant_new", "keep", "conflict"]


def decide_claim(current: Claim | None, holder: str, now: float) -> ClaimDecision:
    """Who may take the claim on a scope: the same rule every engine enforces atomically.

    Free (never claimed, released, or lease expired): granted with the next
    fence. Held by `holder` with a live lease: kept, same fence. Otherwise:
    conflict.
    """
    if current is None or current.holder == "" or current.expires_at <= now:
        return "grant_new"
    if current.holder == holder:
        return "keep"
    return "conflict"


def fence_is_current(current: Claim | None, fence: int, holder: str) -> bool:
    """A write under (`fence`, `holder`) may commit only while the claim is still
    that: not taken over, not released. The holder tells apart two claims that
    got one fence number where an engine lost a take it had not flushed."""
    return current is not None and current.fence == fence and current.holder == holder


def check_consumable(interrupt: InterruptRecord | None, run_id: str, interrupt_id: str) -> None:
    """Raise unless `interrupt` is pending (a consumed one never takes a second value)."""
    if interrupt is None:
        from remit_core.errors import UnknownRecord

        raise UnknownRecord("no such interrupt", run_id=run_id, interrupt_id=interrupt_id)
    if interrupt.status != "pending":
        raise ResumeConflict(
            "interrupt was already consumed; the value was not stored",
            run_id=run_id,
            interrupt_id=interrupt_id,
        )


# -- the effect ledger (P2) --------------------------------------------------

EffectAction = Literal["apply", "return_recorded", "reconcile", "reapply", "in_doubt"]


def effect_action(
    entry: EffectRecord | None, *, has_reconcile: bool, idempotent: bool
) -> EffectAction:
    """What replaying an effect means, given its ledger entry.

    No entry: apply it (after recording intent). Done: return the recorded
    outcome. Intent without outcome (in doubt): ask `reconcile` if there is
    one, else re-apply with the same idempotency key if it was declared
    idempotent, else refuse with `EffectInDoubt`. Never apply blindly twice.
    """
    if entry is None:
        return "apply"
    if entry.status == "done":
        return "return_recorded"
    if has_reconcile:
        return "reconcile"
    if idempotent:
        return "reapply"
    return "in_doubt"


def intent_in_flight(
    entry: EffectRecord, live: Claim | None, own: FenceRef | None, *, now: float
) -> bool:
    """Whether an intent without an outcome is another caller's effect in flight
    rather than one in doubt: its caller may be applying it this moment.

    It is while the claim it was recorded under is still held by that holder, at
    that fence, unexpired (`live`: that claim's scope now), and is not the
    asker's own. Asking `reconcile` then, or applying it again, races the caller
    (an effect with a key of the user's is one effect across a run's branches,
    each with a claim of its own). An intent whose claim was given up, lapsed or
    taken over is in doubt, as before (its holder is gone, or fenced: L1, L2).
    So is one found by an asker whose own claim on that scope was taken over: it
    waits for nobody, and its next fenced write is refused (L2).
    """
    held = entry.claim
    if entry.status != "intent" or held is None or held == own:
        return False
    if own is not None and own.scope == held.scope:
        if not fence_is_current(live, own.fence, own.holder):
            return False
    return fence_is_current(live, held.fence, held.holder) and (
        live is not None and live.expires_at > now
    )


def idempotency_key(run_id: str, effect_key: str) -> str:
    """The deterministic key handed to an effect: the same on every replay and takeover."""
    h = hashlib.blake2b(digest_size=16, person=b"remit-effect")
    h.update(run_id.encode())
    h.update(b"\x00")
    h.update(effect_key.encode())
    return h.hexdigest()


# -- versions (P4) -----------------------------------------------------------


def check_workflow_version(record: CheckpointRecord, accepted: Iterable[str] | None) -> None:
    """Refuse a checkpoint written by a workflow version the reader does not accept."""
    if accepted is None:
        return
    accepted = set(accepted)
    if record.workflow_version not in accepted:
        raise VersionMismatch(
            f"checkpoint was written by workflow version {record.workflow_version!r}; this "
            f"reader accepts {sorted(accepted)!r}",
            run_id=record.run_id,
            checkpoint_id=record.checkpoint_id,
        )


# -- retention ---------------------------------------------------------------


def head_after_delete(
    branch: BranchRecord, checkpoints: Sequence[CheckpointRecord], doomed: Iterable[str]
) -> CheckpointRecord | None:
    """Where a branch's head goes when checkpoints `doomed` (its head among them) are deleted.

    The head's nearest surviving ancestor, else the branch's newest surviving
    checkpoint, else None (the branch has nothing left).
    """
    gone = set(doomed)
    by_id = {c.checkpoint_id: c for c in checkpoints}
    cursor = by_id.get(branch.head_id) if branch.head_id is not None else None
    while cursor is not None:
        if cursor.checkpoint_id not in gone:
            return cursor
        cursor = by_id.get(cursor.parent_id) if cursor.parent_id is not None else None
    survivors = [
        c
        for c in checkpoints
        if c.branch == branch.branch and c.ns == branch.ns and c.checkpoint_id not in gone
    ]
    return max(survivors, key=lambda c: c.checkpoint_id, default=None)


def prunable(
    checkpoints: Sequence[CheckpointRecord],
    branches: Sequence[BranchRecord],
    *,
    keep_last: int = 1,
) -> list[str]:
    """Checkpoint ids that retention may delete: never a head, a fork base, or
    one of the newest `keep_last` on any branch's line of ancestry."""
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1: a branch head is never pruned")
    by_id: Mapping[str, CheckpointRecord] = {c.checkpoint_id: c for c in checkpoints}
    keep: set[str] = set()
    for b in branches:
        if b.base_id is not None:
            keep.add(b.base_id)
        cursor, n = b.head_id, 0
        while cursor is not None and n < keep_last:
            keep.add(cursor)
            record = by_id.get(cursor)
            cursor = record.parent_id if record is not None else None
            n += 1
    return [c.checkpoint_id for c in checkpoints if c.checkpoint_id not in keep]
