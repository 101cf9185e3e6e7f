"""The primitives in SQL, shared by the SQLite and PostgreSQL engines.

Statements are written once with `?` placeholders and portable SQL
(`ON CONFLICT`, `RETURNING`); an engine supplies its transaction (SQLite:
`BEGIN IMMEDIATE`; PostgreSQL: a pooled connection's transaction), its
placeholder, and the row-lock suffix that keeps a fence check valid until
commit (`FOR SHARE` on PostgreSQL, nothing under SQLite's database lock).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, Protocol

from remit_core import codec, failpoints
from remit_core.errors import (
    CorruptRecord,
    Fenced,
    HeadMoved,
    ResumeConflict,
    UnknownRecord,
    WriteConflict,
)
from remit_core.records import (
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
from remit_core.stores.base import (
    Store,
    display_url,
    effect_deleted,
    head_gone,
    newer_schema,
    stale_fence,
)

#: Numbered migration steps; each is a list of statements, applied once, in order.
MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE IF NOT EXISTS remit_checkpoints (
            run_id TEXT NOT NULL, ns TEXT NOT NULL, checkpoint_id TEXT NOT NULL,
            branch TEXT NOT NULL, parent_id TEXT, seq BIGINT NOT NULL,
            state {blob} NOT NULL, metadata TEXT NOT NULL, schema_version INTEGER NOT NULL,
            workflow_version TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (run_id, ns, checkpoint_id))""",
        """CREATE TABLE IF NOT EXISTS remit_branches (
            run_id TEXT NOT NULL, ns TEXT NOT NULL, branch TEXT NOT NULL, head_id TEXT,
            head_seq BIGINT NOT NULL, base_id TEXT, fork_token TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (run_id, ns, branch), UNIQUE (run_id, ns, fork_token))""",
        """CREATE TABLE IF NOT EXISTS remit_blobs (
            run_id TEXT NOT NULL, ns TEXT NOT NULL, key TEXT NOT NULL, value {blob} NOT NULL,
            PRIMARY KEY (run_id, ns, key))""",
        """CREATE TABLE IF NOT EXISTS remit_writes (
            run_id TEXT NOT NULL, ns TEXT NOT NULL, checkpoint_id TEXT NOT NULL,
            task_id TEXT NOT NULL, idx INTEGER NOT NULL, channel TEXT NOT NULL,
            value {blob} NOT NULL, task_path TEXT NOT NULL,
            PRIMARY KEY (run_id, ns, checkpoint_id, task_id, idx))""",
        """CREATE TABLE IF NOT EXISTS remit_interrupts (
            run_id TEXT NOT NULL, branch TEXT NOT NULL, interrupt_id TEXT NOT NULL,
            checkpoint_id TEXT, status TEXT NOT NULL, prompt {blob}, value {blob},
            consumed_by TEXT, created_at DOUBLE PRECISION NOT NULL,
            consumed_at DOUBLE PRECISION, PRIMARY KEY (run_id, branch, interrupt_id))""",
        """CREATE TABLE IF NOT EXISTS remit_claims (
            run_id TEXT NOT NULL, scope TEXT NOT NULL, holder TEXT NOT NULL,
            fence BIGINT NOT NULL, expires_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (run_id, scope))""",
        """CREATE TABLE IF NOT EXISTS remit_effects (
            run_id TEXT NOT NULL, effect_key TEXT NOT NULL, idempotency_key TEXT NOT NULL,
            status TEXT NOT NULL, outcome {blob}, created_at DOUBLE PRECISION NOT NULL,
            done_at DOUBLE PRECISION, PRIMARY KEY (run_id, effect_key))""",
    ],
    # Engine-specific only: SQLite's one-statement commit (`stores.sqlite`), the
    # same with a few blobs, and both again with fences that carry their holder
    # (the other engines check the holder in code); 6, PostgreSQL's id order.
    2: [],
    3: [],
    4: [],
    5: [],
    6: [],
    # An effect's intent records the claim of the caller that wrote it (in flight
    # while that claim is held; `policy.intent_in_flight`): `effect_claim_columns`.
    7: [],
}


def effect_claim_columns(if_not_exists: str = "") -> list[str]:
    """Migration 7's statements; `if_not_exists` where the engine has that clause."""
    return [
        f"ALTER TABLE remit_effects ADD COLUMN {if_not_exists}{column}"
        for column in ("claim_scope TEXT", "claim_fence BIGINT", "claim_holder TEXT")
    ]


_CKPT_COLS = (
    "run_id, checkpoint_id, branch, parent_id, state, ns, seq, metadata, "
    "schema_version, workflow_version, created_at"
)


def int_option(
    options: dict[str, str], name: str, default: int, url: str, *, minimum: int = 0
) -> int:
    """The integer URL option `name` (removed from `options`), or `default`; a
    `ValueError` naming it if it is not an integer of at least `minimum`."""
    raw = options.pop(name, None)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"store URL option {name}={raw!r} is not an integer ({display_url(url)!r})"
        ) from None
    if value < minimum:
        raise ValueError(
            f"store URL option {name}={value} is below {minimum} ({display_url(url)!r})"
        )
    return value


def _ckpt_params(r: CheckpointRecord) -> list[Any]:
    """A checkpoint row's values, in `_CKPT_COLS` order."""
    return [
        r.run_id, r.checkpoint_id, r.branch, r.parent_id, r.state, r.ns, r.seq,
        codec.dumps(r.metadata, exact=False).decode(), r.schema_version, r.workflow_version,
        r.created_at,
    ]  # fmt: skip


def _flat(records: Sequence[Any], names: Sequence[str]) -> list[Any]:
    """The named fields of each record in turn: the parameters of a multi-row VALUES."""
    return [getattr(rec, name) for rec in records for name in names]


_CKPT_COLS_OF_C = ", ".join("c." + col for col in _CKPT_COLS.split(", "))
_BRANCH_COLS = "run_id, branch, head_id, ns, head_seq, base_id, fork_token, created_at"
_INTR_COLS = (
    "run_id, branch, interrupt_id, checkpoint_id, status, prompt, value, consumed_by, "
    "created_at, consumed_at"
)
#: The head checkpoint of a branch; parameters: run, ns, run, ns, branch. A key
#: lookup by the head id read first: as a join, the planner may scan every
#: checkpoint of the run for it.
_SELECT_HEAD = (
    f"SELECT {_CKPT_COLS_OF_C} FROM remit_checkpoints c "
    "WHERE c.run_id = ? AND c.ns = ? AND c.checkpoint_id = (SELECT b.head_id "
    "FROM remit_branches b WHERE b.run_id = ? AND b.ns = ? AND b.branch = ?)"
)
#: The writes of checkpoint `{c}`, joined to it: a row per write, or one with
#: NULLs (see `_ckpt_and_writes`).
_JOIN_WRITES = (
    " LEFT JOIN remit_writes w ON w.run_id = {c}.run_id AND w.ns = {c}.ns "
    "AND w.checkpoint_id = {c}.checkpoint_id"
)
_WRITE_OF_W = "w.task_id, w.idx, w.channel, w.value, w.task_path"
#: A checkpoint and its writes in one statement (one snapshot); parameters: run,
#: ns, checkpoint id.
_CKPT_AND_WRITES = (
    f"SELECT {_CKPT_COLS_OF_C}, {_WRITE_OF_W} FROM remit_checkpoints c"
    + _JOIN_WRITES.format(c="c")
    + " WHERE c.run_id = ? AND c.ns = ? AND c.checkpoint_id = ? ORDER BY w.task_id, w.idx"
)
#: Take a claim if it is free, expired, or the holder's own (same fence then);
#: parameters: run, scope, holder, expires_at, now, now. `{row}` is the one row
#: to insert. `_ACQUIRE_CLAIM` returns the claim's row.
_TAKE_CLAIM_OF = (
    "INSERT INTO remit_claims (run_id, scope, holder, fence, expires_at) "
    "{row} ON CONFLICT (run_id, scope) DO UPDATE SET "
    "fence = CASE WHEN remit_claims.holder = excluded.holder "
    "AND remit_claims.expires_at > ? THEN remit_claims.fence "
    "ELSE remit_claims.fence + 1 END, "
    "holder = excluded.holder, expires_at = excluded.expires_at "
    "WHERE remit_claims.holder = excluded.holder OR remit_claims.holder = '' "
    "OR remit_claims.expires_at <= ?"
)
_CLAIM_RETURNING = " RETURNING holder, fence, expires_at"
_TAKE_CLAIM = _TAKE_CLAIM_OF.format(row="VALUES (?, ?, ?, 1, ?)")
_ACQUIRE_CLAIM = _TAKE_CLAIM + _CLAIM_RETURNING
_CLAIM_ROW = "SELECT holder, fence, expires_at FROM remit_claims WHERE run_id = ? AND scope = ?"
_EFFECT_COLS = (
    "run_id, effect_key, idempotency_key, status, outcome, created_at, done_at, "
    "claim_scope, claim_fence, claim_holder"
)
#: The columns of the claim an effect's intent was recorded under.
_EFFECT_CLAIM = ("claim_scope", "claim_fence", "claim_holder")
_WRITE_COLS = "run_id, checkpoint_id, task_id, idx, channel, value, ns, task_path"
#: What a write to a taken slot does, by mode ("expect_absent" refuses it in code).
_WRITE_CONFLICTS = {
    "first": "DO NOTHING",
    "overwrite": "DO UPDATE SET channel = excluded.channel, value = excluded.value, "
    "task_path = excluded.task_path",
}
#: A run's tables, its claims first: deleting a claim row waits for every fenced write
#: in flight (each holds its claim row `FOR SHARE` to its commit) and refuses the later
#: ones, so a run's delete leaves no checkpoint such a write commits meanwhile, and
#: takes its locks in the order those writes do (no deadlock).
_RUN_TABLES = (
    "remit_claims",
    "remit_checkpoints",
    "remit_branches",
    "remit_blobs",
    "remit_writes",
    "remit_interrupts",
    "remit_effects",
)


class Cursor(Protocol):
    """What `_sql` needs of an engine's cursor."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Txn(Protocol):
    """What `_sql` needs of an engine's transaction: `?`-placeholder statements."""

    def execute(self, sql: str, params: Sequence[Any] = ..., /) -> Cursor: ...


def _ckpt(row: Sequence[Any]) -> CheckpointRecord:
    try:
        metadata = codec.loads(row[7].encode())
    except (ValueError, AttributeError) as exc:  # not JSON, or not text at all
        raise CorruptRecord(
            f"stored checkpoint metadata does not decode: {exc}",
            run_id=row[0],
            checkpoint_id=row[1],
        ) from exc
    if type(metadata) is not dict:  # (a commit stores a dict; anything else was altered)
        raise CorruptRecord(
            f"stored checkpoint metadata is not a mapping but a {type(metadata).__name__}",
            run_id=row[0],
            checkpoint_id=row[1],
        )
    return CheckpointRecord(
        run_id=row[0],
        checkpoint_id=row[1],
        branch=row[2],
        parent_id=row[3],
        state=bytes(row[4]),
        ns=row[5],
        seq=int(row[6]),
        metadata=metadata,
        schema_version=int(row[8]),
        workflow_version=row[9],
        created_at=float(row[10]),
    )


def _branch(row: Sequence[Any]) -> BranchRecord:
    try:
        return BranchRecord(
            run_id=row[0],
            branch=row[1],
            head_id=row[2],
            ns=row[3],
            head_seq=int(row[4]),
            base_id=row[5],
            fork_token=row[6],
            created_at=float(row[7]),
        )
    except (ValueError, TypeError) as exc:  # (a column SQLite let hold other text)
        raise CorruptRecord(
            f"stored branch {row[1]!r} does not decode: {exc}", run_id=row[0]
        ) from exc


def _interrupt(row: Sequence[Any]) -> InterruptRecord:
    try:
        return InterruptRecord(
            run_id=row[0],
            branch=row[1],
            interrupt_id=row[2],
            checkpoint_id=row[3],
            status=row[4],
            prompt=None if row[5] is None else bytes(row[5]),
            value=None if row[6] is None else bytes(row[6]),
            consumed_by=row[7],
            created_at=float(row[8]),
            consumed_at=None if row[9] is None else float(row[9]),
        )
    except (ValueError, TypeError) as exc:  # (a column SQLite let hold other text)
        raise CorruptRecord(
            f"stored interrupt does not decode: {exc}", run_id=row[0], interrupt_id=row[2]
        ) from exc


def _effect(row: Sequence[Any]) -> EffectRecord:
    try:
        return EffectRecord(
            run_id=row[0],
            effect_key=row[1],
            idempotency_key=row[2],
            status=row[3],
            outcome=None if row[4] is None else bytes(row[4]),
            created_at=float(row[5]),
            done_at=None if row[6] is None else float(row[6]),
            claim=None if row[7] is None else FenceRef(row[0], row[7], int(row[8]), row[9]),
        )
    except (ValueError, TypeError) as exc:  # (a column SQLite let hold other text)
        raise CorruptRecord(
            f"stored effect entry does not decode: {exc}", run_id=row[0], effect_key=row[1]
        ) from exc


def _entry_read_back(txn: Txn, run_id: str, effect_key: str) -> EffectRecord:
    """An effect's entry, read in the transaction that wrote it (`effect_deleted` if gone)."""
    row = txn.execute(
        f"SELECT {_EFFECT_COLS} FROM remit_effects WHERE run_id = ? AND effect_key = ?",
        (run_id, effect_key),
    ).fetchone()
    if row is None:
        raise effect_deleted(run_id, effect_key)
    return _effect(row)


def _claim_columns(fence: FenceRef | None) -> tuple[str | None, int | None, str | None]:
    """The claim an effect's intent is recorded under, as its three columns."""
    return (None, None, None) if fence is None else (fence.scope, fence.fence, fence.holder)


def _claim_of(run_id: str, scope: str, row: Sequence[Any] | None) -> Claim:
    """The claim `_ACQUIRE_CLAIM` returned (holder, fence, expires_at), or `ResumeConflict`."""
    if row is None or row[0] is None:
        raise ResumeConflict(
            "another holder has this run's claim (a run in progress, or one whose process "
            "died before its lease ran out); retry when that run ends or the lease runs out",
            run_id=run_id,
            scope=scope,
        )
    return Claim(run_id, scope, row[0], int(row[1]), float(row[2]))


def _ckpt_and_writes(
    rows: Sequence[Sequence[Any]], at: int = 0
) -> tuple[CheckpointRecord | None, list[WriteRecord]]:
    """A checkpoint and its writes from the rows of a join: the checkpoint's
    columns from `at`, then a write's (task id, idx, channel, value, task path)
    or NULLs, one row per write."""
    if not rows or rows[0][at] is None:
        return None, []
    record = _ckpt(rows[0][at : at + 11])
    w = at + 11
    writes = [
        WriteRecord(
            record.run_id,
            record.checkpoint_id,
            r[w],
            int(r[w + 1]),
            r[w + 2],
            bytes(r[w + 3]),
            record.ns,
            r[w + 4],
        )
        for r in rows
        if r[w] is not None
    ]
    return record, writes


def _release_params(claim: Claim) -> tuple[str, str, int, str]:
    """The parameters of `SqlStore._release_sql`."""
    return (claim.run_id, claim.scope, claim.fence, claim.holder)


def _write(row: Sequence[Any]) -> WriteRecord:
    return WriteRecord(
        run_id=row[0],
        checkpoint_id=row[1],
        task_id=row[2],
        idx=int(row[3]),
        channel=row[4],
        value=bytes(row[5]),
        ns=row[6],
        task_path=row[7],
    )


class SqlStore(Store):
    """The primitives over a DB-API engine; subclasses provide `_txn` and `_read`."""

    #: Appended to the fence-check SELECT so the claim row stays locked to commit.
    _lock_suffix = ""
    #: Column type for byte payloads.
    _blob_type = "BLOB"
    #: Statements of this engine only, by migration number (run after the shared ones).
    _engine_migrations: dict[int, list[str]] = {}
    #: Takes a claim and returns its row (see `_TAKE_CLAIM_OF`).
    _acquire_sql = _ACQUIRE_CLAIM
    #: Gives a claim up; the fence stays, so the next claim gets a higher one.
    _release_sql = (
        "UPDATE remit_claims SET holder = '', expires_at = 0 "
        "WHERE run_id = ? AND scope = ? AND fence = ? AND holder = ?"
    )

    # -- engine hooks ------------------------------------------------------
    def _txn(self) -> contextlib.AbstractContextManager[Txn]:
        """A write transaction that commits on success and rolls back on error."""
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Txn]:
        """Where one read-only statement runs, a snapshot of its own (may be `_txn`)."""
        return self._txn()

    def _atomic(self) -> contextlib.AbstractContextManager[Txn]:
        """Where one write statement runs that is atomic by itself (may be `_txn`)."""
        return self._txn()

    def _lock_doomed(self, txn: Txn, run_id: str, ns: str, checkpoint_ids: Sequence[str]) -> None:
        """Before `delete_checkpoints` reads which checkpoints branches pin: lock the
        doomed rows, where a transaction does not hold the whole store, so that a
        fork made from one of them meanwhile (`_base_kept` waits for the lock) is
        in that read, or, made after, finds its base gone."""

    def _lock_branches(self, txn: Txn, run_id: str) -> None:
        """In `delete_run`, after its claims: lock the run's branch rows, where a
        transaction does not hold the whole store, so that a commit without a fence
        (its head's compare-and-set waits for the lock) is deleted whole or finds no
        head to move, never leaving a checkpoint of the deleted run."""

    def _snapshot_txn(self) -> contextlib.AbstractContextManager[Txn]:
        """A write transaction whose statements all read one snapshot (`copy_run`
        reads six tables while commits go on); `_txn` where every transaction does."""
        return self._txn()

    def _lease_write(self) -> contextlib.AbstractContextManager[Txn]:
        """Where a claim is taken, renewed or given up: one statement, as `_atomic`.

        An engine whose every client dies with its host (an embedded file) may
        commit these without waiting for the disk: a claim lost with the host
        has no holder left to act on it.
        """
        return self._atomic()

    # -- lifecycle -----------------------------------------------------------
    def _migrate(self, txn: Txn) -> None:
        txn.execute(
            "CREATE TABLE IF NOT EXISTS remit_migrations ("
            "version INTEGER PRIMARY KEY, applied_at DOUBLE PRECISION NOT NULL)"
        )
        done = {r[0] for r in txn.execute("SELECT version FROM remit_migrations").fetchall()}
        refusal = newer_schema(done, f"the store at {display_url(self.url)}")
        if refusal is not None:
            raise refusal
        for version in sorted(MIGRATIONS.keys() | self._engine_migrations.keys()):
            if version in done:
                continue
            for stmt in MIGRATIONS.get(version, []) + self._engine_migrations.get(version, []):
                txn.execute(stmt.format(blob=self._blob_type))
            txn.execute(
                "INSERT INTO remit_migrations (version, applied_at) VALUES (?, ?) "
                "ON CONFLICT (version) DO NOTHING",
                (version, _now()),
            )

    def applied_migrations(self) -> list[int]:
        with self._read() as txn:
            rows = txn.execute("SELECT version FROM remit_migrations ORDER BY version").fetchall()
        return [int(r[0]) for r in rows]

    # -- helpers -----------------------------------------------------------
    def _check_fence(self, txn: Txn, fence: FenceRef | None) -> None:
        if fence is None:
            return
        row = txn.execute(
            "SELECT fence, holder FROM remit_claims WHERE run_id = ? AND scope = ?"
            + self._lock_suffix,
            (fence.run_id, fence.scope),
        ).fetchone()
        if row is None or int(row[0]) != fence.fence or row[1] != fence.holder:
            raise stale_fence(fence, *((None, None) if row is None else (int(row[0]), row[1])))

    def _upsert_writes(self, txn: Txn, writes: Sequence[WriteRecord], mode: WriteMode) -> None:
        if not writes:
            return
        conflict = _WRITE_CONFLICTS.get(mode, "DO NOTHING")
        for w in writes:
            cur = txn.execute(
                f"INSERT INTO remit_writes ({_WRITE_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                f"ON CONFLICT (run_id, ns, checkpoint_id, task_id, idx) {conflict}",
                (
                    w.run_id,
                    w.checkpoint_id,
                    w.task_id,
                    w.idx,
                    w.channel,
                    w.value,
                    w.ns,
                    w.task_path,
                ),
            )
            if mode == "expect_absent" and cur.rowcount == 0:
                raise WriteConflict(
                    f"write slot {w.task_id}#{w.idx} is already taken",
                    run_id=w.run_id,
                    checkpoint_id=w.checkpoint_id,
                )

    # -- checkpoints ---------------------------------------------------------
    # `commit_checkpoint` is each engine's own: one statement on either.

    def get_checkpoint(self, run_id: str, ns: str, checkpoint_id: str) -> CheckpointRecord | None:
        with self._read() as txn:
            row = txn.execute(
                f"SELECT {_CKPT_COLS} FROM remit_checkpoints "
                "WHERE run_id = ? AND ns = ? AND checkpoint_id = ?",
                (run_id, ns, checkpoint_id),
            ).fetchone()
        return None if row is None else _ckpt(row)

    def get_checkpoint_and_writes(
        self, run_id: str, ns: str, checkpoint_id: str
    ) -> tuple[CheckpointRecord | None, list[WriteRecord]]:
        with self._read() as txn:
            rows = txn.execute(_CKPT_AND_WRITES, (run_id, ns, checkpoint_id)).fetchall()
        return _ckpt_and_writes(rows)

    def list_checkpoints(
        self,
        run_id: str | None,
        ns: str | None = None,
        *,
        before_id: str | None = None,
        limit: int | None = None,
    ) -> list[CheckpointRecord]:
        where, params = [], []
        for col, val in (("run_id", run_id), ("ns", ns)):
            if val is not None:
                where.append(f"{col} = ?")
                params.append(val)
        if before_id is not None:
            where.append("checkpoint_id < ?")
            params.append(before_id)
        sql = f"SELECT {_CKPT_COLS} FROM remit_checkpoints"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY checkpoint_id DESC"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        with self._read() as txn:
            rows = txn.execute(sql, params).fetchall()
        return [_ckpt(r) for r in rows]

    def get_branch(self, run_id: str, ns: str, branch: str) -> BranchRecord | None:
        with self._read() as txn:
            row = txn.execute(
                f"SELECT {_BRANCH_COLS} FROM remit_branches "
                "WHERE run_id = ? AND ns = ? AND branch = ?",
                (run_id, ns, branch),
            ).fetchone()
        return None if row is None else _branch(row)

    def get_head(self, run_id: str, ns: str, branch: str) -> CheckpointRecord | None:
        with self._read() as txn:
            row = txn.execute(_SELECT_HEAD, (run_id, ns, run_id, ns, branch)).fetchone()
        return None if row is None else _ckpt(row)

    def list_branches(self, run_id: str, ns: str | None = None) -> list[BranchRecord]:
        sql = f"SELECT {_BRANCH_COLS} FROM remit_branches WHERE run_id = ?"
        params: list[Any] = [run_id]
        if ns is not None:
            sql += " AND ns = ?"
            params.append(ns)
        with self._read() as txn:
            rows = txn.execute(sql + " ORDER BY created_at, branch", params).fetchall()
        return [_branch(r) for r in rows]

    def create_branch(self, branch: BranchRecord, *, fence: FenceRef | None = None) -> BranchRecord:
        b = branch
        with self._txn() as txn:
            self._check_fence(txn, fence)
            if b.base_id is not None and self._is_new(txn, b) and not self._base_kept(txn, b):
                raise UnknownRecord(
                    "fork base does not exist (deleted, or never committed)",
                    run_id=b.run_id,
                    checkpoint_id=b.base_id,
                )
            txn.execute(
                f"INSERT INTO remit_branches ({_BRANCH_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT DO NOTHING",
                (
                    b.run_id,
                    b.branch,
                    b.head_id,
                    b.ns,
                    b.head_seq,
                    b.base_id,
                    b.fork_token,
                    b.created_at,
                ),
            )
            failpoints.hit("fork.in_create")
            row = txn.execute(
                f"SELECT {_BRANCH_COLS} FROM remit_branches "
                "WHERE run_id = ? AND ns = ? AND fork_token = ?",
                (b.run_id, b.ns, b.fork_token),
            ).fetchone()
        if row is None:
            raise HeadMoved(
                f"branch name {b.branch!r} is taken by another fork token", run_id=b.run_id
            )
        return _branch(row)

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
        sql = (
            "UPDATE remit_branches SET head_id = ?, head_seq = ? "
            "WHERE run_id = ? AND ns = ? AND branch = ? AND "
        )
        params: list[Any] = [new_head, new_seq, run_id, ns, branch]
        if expected_head is None:
            sql += "head_id IS NULL"
        else:
            sql += "head_id = ?"
            params.append(expected_head)
        with self._txn() as txn:
            cur = txn.execute(sql, params)
            if cur.rowcount != 1:
                raise HeadMoved(
                    f"branch {branch!r} no longer has head {expected_head!r}",
                    run_id=run_id,
                    checkpoint_id=expected_head,
                )
            # The new head must be stored, and stay so to commit: locked against a
            # delete (`delete_checkpoints` holds its doomed rows while it reads which
            # ones heads pin), this waits for one in flight and sees its outcome.
            if new_head is not None and (
                txn.execute(
                    "SELECT 1 FROM remit_checkpoints WHERE run_id = ? AND ns = ? "
                    "AND checkpoint_id = ?" + self._lock_suffix,
                    (run_id, ns, new_head),
                ).fetchone()
                is None
            ):
                raise head_gone(run_id, new_head)

    def get_blobs(self, run_id: str, ns: str, keys: Sequence[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        marks = ", ".join("?" for _ in keys)
        with self._read() as txn:
            rows = txn.execute(
                f"SELECT key, value FROM remit_blobs WHERE run_id = ? AND ns = ? "
                f"AND key IN ({marks})",
                (run_id, ns, *keys),
            ).fetchall()
        return {r[0]: bytes(r[1]) for r in rows}

    # -- writes ------------------------------------------------------------
    def put_writes(
        self, writes: Sequence[WriteRecord], *, mode: WriteMode, fence: FenceRef | None = None
    ) -> None:
        with self._txn() as txn:
            self._check_fence(txn, fence)
            self._upsert_writes(txn, writes, mode)
            failpoints.hit("writes.in_txn")

    def get_writes(
        self, run_id: str, ns: str, checkpoint_id: str, *, after_idx: int | None = None
    ) -> list[WriteRecord]:
        sql = (
            f"SELECT {_WRITE_COLS} FROM remit_writes "
            "WHERE run_id = ? AND ns = ? AND checkpoint_id = ?"
        )
        params: list[Any] = [run_id, ns, checkpoint_id]
        if after_idx is not None:
            sql += " AND idx > ?"
            params.append(after_idx)
        with self._read() as txn:
            rows = txn.execute(sql + " ORDER BY task_id, idx", params).fetchall()
        return [_write(r) for r in rows]

    # -- interrupts ----------------------------------------------------------
    def open_interrupts(
        self, records: Sequence[InterruptRecord], *, fence: FenceRef | None = None
    ) -> None:
        with self._txn() as txn:
            self._check_fence(txn, fence)
            for i in records:
                txn.execute(
                    f"INSERT INTO remit_interrupts ({_INTR_COLS}) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (run_id, branch, interrupt_id) DO NOTHING",
                    (
                        i.run_id,
                        i.branch,
                        i.interrupt_id,
                        i.checkpoint_id,
                        "pending",
                        i.prompt,
                        None,
                        None,
                        i.created_at,
                        None,
                    ),
                )

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
        with self._txn() as txn:
            self._check_fence(txn, fence)
            row = txn.execute(
                "UPDATE remit_interrupts SET status = 'consumed', value = ?, consumed_by = ?, "
                "consumed_at = ? WHERE run_id = ? AND branch = ? AND interrupt_id = ? "
                f"AND status = 'pending' RETURNING {_INTR_COLS}",
                (value, consumer, now, run_id, branch, interrupt_id),
            ).fetchone()
            if row is None:
                exists = txn.execute(
                    "SELECT status FROM remit_interrupts "
                    "WHERE run_id = ? AND branch = ? AND interrupt_id = ?",
                    (run_id, branch, interrupt_id),
                ).fetchone()
                if exists is None:
                    raise UnknownRecord(
                        "no such interrupt", run_id=run_id, interrupt_id=interrupt_id
                    )
                raise ResumeConflict(
                    "interrupt was already consumed; the value was not stored",
                    run_id=run_id,
                    interrupt_id=interrupt_id,
                )
            self._upsert_writes(txn, writes, "first")
            failpoints.hit("interrupt.in_consume")
        return _interrupt(row)

    def get_interrupt(self, run_id: str, branch: str, interrupt_id: str) -> InterruptRecord | None:
        with self._read() as txn:
            row = txn.execute(
                f"SELECT {_INTR_COLS} FROM remit_interrupts "
                "WHERE run_id = ? AND branch = ? AND interrupt_id = ?",
                (run_id, branch, interrupt_id),
            ).fetchone()
        return None if row is None else _interrupt(row)

    def list_interrupts(
        self,
        run_id: str,
        branch: str | None = None,
        *,
        checkpoint_id: str | None = None,
        status: InterruptStatus | None = None,
    ) -> list[InterruptRecord]:
        sql = f"SELECT {_INTR_COLS} FROM remit_interrupts WHERE run_id = ?"
        params: list[Any] = [run_id]
        for column, wanted in (
            ("branch", branch),
            ("checkpoint_id", checkpoint_id),
            ("status", status),
        ):
            if wanted is not None:
                sql += f" AND {column} = ?"
                params.append(wanted)
        with self._read() as txn:
            rows = txn.execute(sql + " ORDER BY created_at, interrupt_id", params).fetchall()
        # Ties (one id on several branches at one instant) by branch, in character
        # order, as every engine orders ids (a column's collation may not be).
        return sorted(map(_interrupt, rows), key=lambda i: (i.created_at, i.interrupt_id, i.branch))

    # -- claims ------------------------------------------------------------
    def acquire_claim(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float
    ) -> Claim:
        failpoints.hit("claim.in_acquire")
        with self._lease_write() as txn:
            row = txn.execute(
                self._acquire_sql,
                (run_id, scope, holder, now + lease, now, now),
            ).fetchone()
        return _claim_of(run_id, scope, row)

    def renew_claim(self, claim: Claim, *, now: float, lease: float) -> Claim:
        # No RETURNING: SQLite keeps the write lock of a row-returning write until
        # the row is fetched, so a holder stopped (SIGSTOP) between the two, as a
        # heartbeat thread can be, would stall every writer. A plain UPDATE takes
        # and releases the lock within one call.
        expires_at = now + lease
        with self._lease_write() as txn:
            renewed = txn.execute(
                "UPDATE remit_claims SET expires_at = ? WHERE run_id = ? AND scope = ? "
                "AND fence = ? AND holder = ?",
                (expires_at, claim.run_id, claim.scope, claim.fence, claim.holder),
            ).rowcount
        if renewed != 1:
            raise Fenced("claim was taken over or released", run_id=claim.run_id, scope=claim.scope)
        return Claim(claim.run_id, claim.scope, claim.holder, claim.fence, expires_at)

    def release_claim(self, claim: Claim) -> None:
        with self._lease_write() as txn:
            txn.execute(self._release_sql, _release_params(claim))

    def get_claim(self, run_id: str, scope: str) -> Claim | None:
        with self._read() as txn:
            row = txn.execute(_CLAIM_ROW, (run_id, scope)).fetchone()
        return None if row is None else Claim(run_id, scope, row[0], int(row[1]), float(row[2]))

    # -- effects -----------------------------------------------------------
    def begin_effect(
        self,
        run_id: str,
        effect_key: str,
        idempotency_key: str,
        *,
        now: float,
        fence: FenceRef | None = None,
    ) -> tuple[EffectRecord, bool]:
        with self._txn() as txn:
            self._check_fence(txn, fence)
            cur = txn.execute(
                f"INSERT INTO remit_effects ({_EFFECT_COLS}) "
                "VALUES (?, ?, ?, 'intent', NULL, ?, NULL, ?, ?, ?) "
                "ON CONFLICT (run_id, effect_key) DO NOTHING",
                (run_id, effect_key, idempotency_key, now, *_claim_columns(fence)),
            )
            created = cur.rowcount == 1
            failpoints.hit("effect.in_intent")
            # (An entry there for the insert may be gone for this read, each statement
            # reading its own snapshot: a delete of the run, unfenced, came between.)
            entry = _entry_read_back(txn, run_id, effect_key)
        return entry, created

    def adopt_effect(
        self,
        run_id: str,
        effect_key: str,
        *,
        held: FenceRef | None,
        fence: FenceRef | None = None,
    ) -> tuple[EffectRecord, bool]:
        with self._txn() as txn:
            self._check_fence(txn, fence)
            was = _claim_columns(held)
            cur = txn.execute(
                "UPDATE remit_effects SET claim_scope = ?, claim_fence = ?, claim_holder = ? "
                "WHERE run_id = ? AND effect_key = ? AND status = 'intent' AND "
                + " AND ".join(
                    f"{column} IS NULL" if value is None else f"{column} = ?"
                    for column, value in zip(_EFFECT_CLAIM, was, strict=True)
                ),
                (
                    *_claim_columns(fence),
                    run_id,
                    effect_key,
                    *(value for value in was if value is not None),
                ),
            )
            adopted = cur.rowcount == 1
            entry = _entry_read_back(txn, run_id, effect_key)
        return entry, adopted

    def finish_effect(
        self,
        run_id: str,
        effect_key: str,
        outcome: bytes,
        *,
        now: float,
        fence: FenceRef | None = None,
    ) -> EffectRecord:
        with self._txn() as txn:
            self._check_fence(txn, fence)
            txn.execute(
                "UPDATE remit_effects SET status = 'done', outcome = ?, done_at = ? "
                "WHERE run_id = ? AND effect_key = ? AND status = 'intent'",
                (outcome, now, run_id, effect_key),
            )
            failpoints.hit("effect.in_outcome")
            row = txn.execute(
                f"SELECT {_EFFECT_COLS} FROM remit_effects WHERE run_id = ? AND effect_key = ?",
                (run_id, effect_key),
            ).fetchone()
        if row is None:
            raise UnknownRecord(
                "no intent recorded for effect", run_id=run_id, effect_key=effect_key
            )
        return _effect(row)

    def get_effect(self, run_id: str, effect_key: str) -> EffectRecord | None:
        with self._read() as txn:
            row = txn.execute(
                f"SELECT {_EFFECT_COLS} FROM remit_effects WHERE run_id = ? AND effect_key = ?",
                (run_id, effect_key),
            ).fetchone()
        return None if row is None else _effect(row)

    # -- whole runs ----------------------------------------------------------
    def _is_new(self, txn: Txn, b: BranchRecord) -> bool:
        """Whether neither `b`'s name nor its fork token is taken in its namespace."""
        return (
            txn.execute(
                "SELECT 1 FROM remit_branches WHERE run_id = ? AND ns = ? "
                "AND (branch = ? OR fork_token = ?)",
                (b.run_id, b.ns, b.branch, b.fork_token),
            ).fetchone()
            is None
        )

    def _base_kept(self, txn: Txn, b: BranchRecord) -> bool:
        """Whether a fork's base checkpoint exists, locked against its deletion (in
        `delete_checkpoints`) until the branch that pins it is committed."""
        return (
            txn.execute(
                "SELECT 1 FROM remit_checkpoints WHERE run_id = ? AND ns = ? AND checkpoint_id = ?"
                + self._lock_suffix,
                (b.run_id, b.ns, b.base_id),
            ).fetchone()
            is not None
        )

    def delete_run(self, run_id: str) -> None:
        with self._txn() as txn:
            for table in _RUN_TABLES:
                txn.execute(f"DELETE FROM {table} WHERE run_id = ?", (run_id,))
                if table == "remit_claims":
                    self._lock_branches(txn, run_id)
                elif table == "remit_checkpoints":
                    failpoints.hit("delete.in_delete")

    def delete_checkpoints(self, run_id: str, ns: str, checkpoint_ids: Sequence[str]) -> int:
        deleted = 0
        with self._txn() as txn:
            self._lock_doomed(txn, run_id, ns, checkpoint_ids)
            pinned = {
                v
                for row in txn.execute(
                    "SELECT head_id, base_id FROM remit_branches WHERE run_id = ? AND ns = ?",
                    (run_id, ns),
                ).fetchall()
                for v in row
                if v is not None
            }
            failpoints.hit("delete.in_delete")
            for cid in checkpoint_ids:
                if cid in pinned:
                    continue
                # Read the count before the next statement: an engine may reuse its cursor.
                deleted += max(
                    txn.execute(
                        "DELETE FROM remit_checkpoints WHERE run_id = ? AND ns = ? "
                        "AND checkpoint_id = ?",
                        (run_id, ns, cid),
                    ).rowcount,
                    0,
                )
                txn.execute(
                    "DELETE FROM remit_writes WHERE run_id = ? AND ns = ? AND checkpoint_id = ?",
                    (run_id, ns, cid),
                )
        return deleted

    def copy_run(self, source_run_id: str, target_run_id: str) -> None:
        copies = {
            "remit_checkpoints": _CKPT_COLS,
            "remit_branches": _BRANCH_COLS,
            "remit_blobs": "run_id, ns, key, value",
            "remit_writes": _WRITE_COLS,
            "remit_interrupts": _INTR_COLS,
            "remit_effects": _EFFECT_COLS,
        }
        with self._snapshot_txn() as txn:
            for table, cols in copies.items():
                rest = cols.split(", ", 1)[1]
                txn.execute(
                    f"INSERT INTO {table} ({cols}) SELECT ?, {rest} FROM {table} "
                    "WHERE run_id = ? ON CONFLICT DO NOTHING",
                    (target_run_id, source_run_id),
                )
                failpoints.hit("copy.in_copy")


def _now() -> float:
    return time.time()
