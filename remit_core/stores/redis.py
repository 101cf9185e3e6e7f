"""Redis engine (redis-py, one Lua script per read-then-write primitive).

`redis://[user:password@]host:port/db` or `rediss://...`; query options go to
redis-py's connection pool (`socket_timeout`, `max_connections`, ...). No
command is retried by the client: a script whose answer was lost may have run,
so the caller sees `StoreUnavailable` and decides (the core's primitives are
safe to re-ask: a repeated commit answers `HeadMoved`, a claim by the same
holder returns its claim).

Key layout. Every key of a run carries the run as a hash tag,
`remit:{<run>}:<kind>`, so one run lives in one cluster slot; `{`, `}`, `%`
in a run id are percent-escaped (an empty run id is `%`). The kinds are fixed
(`RUN_KEYS`); ids inside a run are hash fields and sorted-set members, joined
by NUL (a NUL or \\x01 inside an id is escaped so that byte order is kept):

    ck  hash   cid NUL ns -> checkpoint (tagged-JSON header, newline, state bytes)
    ix  zset   score 0, two members per checkpoint: "x" cid NUL ns (by id over
               all namespaces) and "n" ns NUL cid (by id within a namespace)
    br  hash   ns NUL branch NUL col -> h head_id, q head_seq, b base_id (both
               escaped), t fork_token, c created_at (a NULL column has no field)
    bt  hash   ns NUL fork_token -> ns NUL branch
    bl  hash   ns NUL key -> blob bytes
    wr  hash   ns NUL cid NUL task NUL idx -> step write (JSON header, newline, value)
    wx  zset   the same members, score 0: one checkpoint's writes by range
    in  hash   branch NUL interrupt NUL col -> s status, k checkpoint_id, p prompt,
               v value, u consumed_by, c created_at, t consumed_at
    cl  hash   scope NUL col -> h holder, f fence, e expires_at
    ef  hash   effect NUL col -> k idempotency_key, s status, o outcome,
               c created_at, d done_at

Two keys are global: `remit:runs` (escaped ids of the runs that have a
branch, which every run with a checkpoint has: the listing over every run)
and `remit:migrations` (applied layout versions). The scripts that add a
branch or remove a run (commit, create_branch, copy_run, delete_run) touch
`remit:runs` too, and copy_run spans two runs: those are atomic on one Redis
server, not across cluster slots.

Failpoints: a script is the atomic step, so the `*.in_*` points of the SQL
engines (hit inside the transaction, before it commits) are hit just before
the script is sent: a crash there leaves nothing written, as in SQL.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import urlsplit

from redis import Redis
from redis.connection import ConnectionPool
from redis.exceptions import NoScriptError, RedisError

from remit_core import codec, failpoints
from remit_core.errors import (
    CorruptRecord,
    Fenced,
    HeadMoved,
    ResumeConflict,
    StoreUnavailable,
    UnknownRecord,
    WriteConflict,
)
from remit_core.records import (
    BlobRecord,
    BranchRecord,
    CheckpointRecord,
    Claim,
    EffectRecord,
    EffectStatus,
    FenceRef,
    InterruptRecord,
    InterruptStatus,
    WriteMode,
    WriteRecord,
)
from remit_core.stores import _redis_lua as lua
from remit_core.stores.base import (
    Store,
    display_url,
    effect_deleted,
    head_gone,
    newer_schema,
    stale_fence,
    url_options,
)

#: Numbered layout versions recorded by `setup()`. Keys are created on first
#: write, so version 1 creates nothing; a later version would convert keys here.
MIGRATIONS: dict[int, str] = {
    1: "per-run keys remit:{run}:<kind>, see the module docstring",
    2: "no change here (SQLite's one-statement commit)",
    3: "no change here (SQLite's one-statement commit with blobs)",
    4: "no change to keys (fences carry their holder; the scripts check it)",
    5: "no change here (SQLite's one-statement commit that releases its claim)",
    6: "no change here (PostgreSQL orders ids by their characters, as Redis does)",
    7: "no change to keys (an effect's intent keeps its caller's claim in field w)",
}

#: Every per-run key kind, in the order the copy and delete scripts expect.
RUN_KEYS = ("ck", "ix", "br", "bt", "bl", "wr", "wx", "in", "cl", "ef")
RUNS_KEY = "remit:runs"
MIGRATIONS_KEY = "remit:migrations"

#: redis-py options the store sets itself (replies as bytes, text as UTF-8).
_OWN_OPTIONS = frozenset({"decode_responses", "encoding", "encoding_errors"})
#: redis-py options that make it send a command again after a timeout or a dropped
#: connection: a script whose reply was lost would run twice (see `_no_resend`).
_RESEND_OPTIONS = ("retry_on_timeout", "retry_on_error")
#: The values of a flag that redis-py reads as false (or unset).
_FALSE = frozenset({"", "0", "F", "FALSE", "N", "NO"})

_SEP = "\x00"
_TAG_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})
_UNESCAPE = re.compile(b"\x01([\x01\x02])")


def run_prefix(run_id: str) -> str:
    """`remit:{<run>}:`, the start of every key of a run (one hash tag, one slot)."""
    return "remit:{" + (run_id.translate(_TAG_ESCAPES) or "%") + "}:"


def run_keys(run_id: str) -> list[str]:
    """Every key a run may own, in `RUN_KEYS` order."""
    prefix = run_prefix(run_id)
    return [prefix + kind for kind in RUN_KEYS]


def _esc(s: str) -> str:
    """An id made safe to join with NUL, keeping byte order (NUL -> 01 01, 01 -> 01 02)."""
    if "\x00" in s or "\x01" in s:
        return s.replace("\x01", "\x01\x02").replace("\x00", "\x01\x01")
    return s


def _unesc(b: bytes) -> str:
    if b"\x01" not in b:
        return b.decode()
    return _UNESCAPE.sub(lambda m: b"\x00" if m.group(1) == b"\x01" else b"\x01", b).decode()


def _join(*parts: str) -> str:
    return _SEP.join(_esc(p) for p in parts)


def _split(member: bytes) -> list[str]:
    return [_unesc(p) for p in member.split(b"\x00")]


def _opt(value: str | bytes | None) -> str | bytes:
    """An optional script argument: "" for NULL, "=" + value otherwise."""
    if value is None:
        return ""
    return b"=" + value if isinstance(value, bytes) else "=" + value


def _opt_id(value: str | None) -> str:
    """An optional id argument, escaped."""
    return "" if value is None else "=" + _esc(value)


def _pack(header: list[Any], payload: bytes) -> bytes:
    """A record: its fields as tagged JSON (one line: JSON escapes newlines), then its
    bytes. Metadata is informational: a subclass in it is stored as its base type."""
    return codec.dumps(header, exact=False) + b"\n" + payload


def _unpack(raw: bytes, **ids: Any) -> tuple[list[Any], bytes]:
    head, newline, payload = raw.partition(b"\n")
    try:
        header = codec.loads(head)
    except ValueError:
        header = None
    if not newline or not isinstance(header, list):
        raise CorruptRecord("stored Redis record has a malformed header", **ids)
    return header, payload


def _is_write_header(header: list[Any]) -> bool:
    """Whether a step write's header is (ns, checkpoint id, task id, idx, channel, task path)."""
    return (
        len(header) == 6
        and type(header[3]) is int
        and all(type(header[i]) is str for i in (0, 1, 2, 4, 5))
    )


def _columns(rows: dict[bytes, bytes]) -> dict[bytes, dict[str, bytes]]:
    """Group a hash of `member NUL col` fields by member."""
    grouped: dict[bytes, dict[str, bytes]] = {}
    for field, value in rows.items():
        grouped.setdefault(field[:-2], {})[chr(field[-1])] = value
    return grouped


def _str(value: bytes | None) -> str | None:
    return None if value is None else value.decode()


def _id(value: bytes | None) -> str | None:
    return None if value is None else _unesc(value)


def _float(value: bytes | None) -> float | None:
    return None if value is None else float(value)


def _fence_key(fence: FenceRef | None, prefix: str) -> str:
    """KEYS[1] of a fenced script: the fence's claims (any key of the run without one)."""
    return prefix + "cl" if fence is None else run_prefix(fence.run_id) + "cl"


def _fence_arg(fence: FenceRef | None) -> str:
    """ARGV[1] of a fenced script: "" or the fence number, ":", the escaped scope,
    NUL, the holder."""
    return "" if fence is None else f"{fence.fence}:{_esc(fence.scope)}{_SEP}{fence.holder}"


def _fence_of(run_id: str, arg: bytes) -> FenceRef:
    """The fence a `_fence_arg` was made of (a `ValueError` if it is not one)."""
    number, _, rest = arg.partition(b":")
    scope, sep, holder = rest.partition(b"\x00")
    if not sep:
        raise ValueError(f"not a claim: {arg[:60]!r}")
    return FenceRef(run_id, _unesc(scope), int(number), holder.decode())


def _raise_fenced(fence: FenceRef | None, reply: list[Any]) -> None:
    """Raise the `Fenced` of a fenced script's reply ("fenced", fence, holder)."""
    assert fence is not None
    current, holder = reply[1], reply[2]
    raise stale_fence(
        fence,
        None if current is None else int(current),
        None if holder is None else holder.decode(),
    )


_SCRIPTS = (
    "COMMIT",
    "PUT_WRITES",
    "LIST_CHECKPOINTS",
    "GET_WRITES",
    "GET_CHECKPOINT_AND_WRITES",
    "GET_HEAD",
    "MOVE_HEAD",
    "CREATE_BRANCH",
    "OPEN_INTERRUPTS",
    "CONSUME_INTERRUPT",
    "ACQUIRE_CLAIM",
    "UPDATE_CLAIM",
    "BEGIN_EFFECT",
    "ADOPT_EFFECT",
    "FINISH_EFFECT",
    "DELETE_CHECKPOINTS",
    "COPY_RUN",
    "DELETE_RUN",
)


class _Keys:
    """KEYS of one script call: fixed keys first, more added on demand by 1-based index."""

    def __init__(self, *fixed: str) -> None:
        self.keys = list(fixed)
        self._index = {k: i + 1 for i, k in enumerate(fixed)}

    def index(self, key: str) -> int:
        i = self._index.get(key)
        if i is None:
            self.keys.append(key)
            i = self._index[key] = len(self.keys)
        return i


def _write_args(keys: _Keys, writes: Sequence[WriteRecord]) -> list[Any]:
    args: list[Any] = [len(writes)]
    for w in writes:
        prefix = run_prefix(w.run_id)
        header = [w.ns, w.checkpoint_id, w.task_id, w.idx, w.channel, w.task_path]
        args += [
            keys.index(prefix + "wr"),
            keys.index(prefix + "wx"),
            _join(w.ns, w.checkpoint_id, w.task_id, str(w.idx)),
            _pack(header, w.value),
        ]
    return args


def _parameters(cls: type) -> set[str]:
    """The named arguments of `cls` and its bases' `__init__`."""
    names: set[str] = set()
    for klass in cls.__mro__[:-1]:  # not object's
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= {
                p.name
                for p in inspect.signature(init).parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            }
    return names - {"self"}


def _no_resend(options: dict[str, str], url: str) -> None:
    """Refuse URL options that have redis-py re-send a command whose reply was lost.

    The script may have run: run again, a consume that landed answers that the
    interrupt was already consumed, and an effect's first intent reads as one left
    in doubt. Without a re-send the caller sees `StoreUnavailable` and re-asks
    through the core, which tells its own landed commit from another's.
    """
    for name in _RESEND_OPTIONS:
        value = options.get(name)
        if value is not None and value.strip().upper() not in _FALSE:
            raise ValueError(
                f"Redis URL option {name}={value!r} in {display_url(url)!r} would have "
                "redis-py send a script again after its reply was lost, and a script "
                "that had run would run twice (a consume that landed would answer "
                "ResumeConflict): leave it out; a lost reply raises StoreUnavailable"
            )


def _check_values(kwargs: dict[str, Any], url: str) -> None:
    """Refuse option values redis-py takes as they are and that fail only at the first
    command (a negative timeout, a client name Redis refuses), naming the option."""
    for name in ("socket_timeout", "socket_connect_timeout"):
        value = kwargs.get(name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"Redis URL option {name}={value!r} in {display_url(url)!r}: a timeout is a "
                "number of seconds above 0"
            )
    client_name = kwargs.get("client_name")
    if client_name and not all("!" <= c <= "~" for c in client_name):
        raise ValueError(
            f"Redis URL option client_name={client_name!r} in {display_url(url)!r}: Redis "
            "takes a client name of printable ASCII without spaces"
        )


def _writes_range(ns: str, checkpoint_id: str) -> list[str]:
    """The write index's min and max members of one checkpoint's writes."""
    base = _join(ns, checkpoint_id)
    return ["[" + base + _SEP, "(" + base + "\x01"]


def _writes_of(
    raws: Sequence[bytes | None], run_id: str, checkpoint_id: str, after_idx: int | None
) -> list[WriteRecord]:
    """Packed step writes (a write deleted meanwhile: None) as records, ordered by
    (task_id, idx)."""
    writes = []
    for raw in raws:
        if raw is None:
            continue
        header, value = _unpack(raw, run_id=run_id, checkpoint_id=checkpoint_id)
        if not _is_write_header(header):
            # (Its fields are under the value's checksum as its identity only: an
            # idx stored as "0" would pass it.)
            raise CorruptRecord(
                "stored Redis step write has a malformed header",
                run_id=run_id,
                checkpoint_id=checkpoint_id,
            )
        w_ns, cid, task_id, idx, channel, task_path = header
        if after_idx is None or idx > after_idx:
            writes.append(WriteRecord(run_id, cid, task_id, idx, channel, value, w_ns, task_path))
    return sorted(writes, key=lambda w: (w.task_id, w.idx))


class RedisStore(Store):
    """A pooled Redis store; the pool is re-created in a forked child."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._pool, self._redis, self._pid = self._connect()
        # Registered once; each call passes the client of its process.
        self._scripts = {name: self._redis.register_script(getattr(lua, name)) for name in _SCRIPTS}

    # -- connection ----------------------------------------------------------
    def _connect(self) -> tuple[ConnectionPool, Redis, int]:
        """A pool and client for this process; nothing is sent until the first command."""
        options = url_options(self.url)
        own = sorted(set(options) & _OWN_OPTIONS)
        if own:
            raise ValueError(
                f"Redis URL option {own[0]!r} in {display_url(self.url)!r} is Remit's own: the "
                "store reads replies as bytes and ids as UTF-8; leave it out"
            )
        _no_resend(options, self.url)
        db = urlsplit(self.url).path.strip("/")
        if db and "db" in options:
            # redis-py would take the option and drop the path's database unsaid.
            raise ValueError(
                f"Redis URL {display_url(self.url)!r} names its database twice (path "
                f"{db!r} and option db={options['db']!r}): give one"
            )
        if db and not (db.isascii() and db.isdigit()):
            # redis-py would ignore it and use database 0.
            raise ValueError(
                f"Redis URL {display_url(self.url)!r} names database {db!r}, not a number"
            )
        try:
            pool = ConnectionPool.from_url(self.url, decode_responses=False)
        except ValueError as exc:
            raise ValueError(f"bad Redis URL {display_url(self.url)!r}: {exc}") from exc
        _check_values(pool.connection_kwargs, self.url)
        # redis-py hands an option it does not know to each new connection, which
        # would fail only at the first command.
        known = _parameters(type(pool)) | _parameters(pool.connection_class)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(
                f"unknown Redis URL option {unknown[0]!r} in {display_url(self.url)!r} (the "
                "options are the Redis client's connection and pool arguments, e.g. "
                "socket_timeout, max_connections)"
            )
        return pool, Redis(connection_pool=pool), os.getpid()

    def _client(self) -> Redis:
        """This process's client; a forked child builds its own pool on first use.

        No lock: a lock held by another thread at fork time would stay held in
        the child. Threads of a child that race here each build a pool and one
        is kept; `_pid` is assigned last, so a matching pid means a usable client.
        """
        if self._pid != os.getpid():
            self._pool, self._redis, self._pid = self._connect()
        return self._redis

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """EVALSHA one script; if the server lost it (SCRIPT FLUSH, restart), load it again.

        This is what `Script.__call__` does, without the per-call work that
        costs some microseconds, a sixth of a local round trip.
        """
        script = self._scripts[name]
        client = self._client()
        try:
            try:
                return client.evalsha(script.sha, len(keys), *keys, *args)
            except NoScriptError:
                script.sha = client.script_load(script.script)
                return client.evalsha(script.sha, len(keys), *keys, *args)
        except RedisError as exc:
            raise StoreUnavailable(f"Redis store failed in {name.lower()}: {exc}") from exc

    def _cmd(self, *args: Any) -> Any:
        """One plain command."""
        try:
            return self._client().execute_command(*args)  # type: ignore[no-untyped-call]
        except RedisError as exc:
            raise StoreUnavailable(f"Redis store failed in {args[0]}: {exc}") from exc

    def _fenced_run(
        self, name: str, fence: FenceRef | None, run_id: str, keys: _Keys, args: list[Any]
    ) -> list[Any]:
        """Run a fenced script (KEYS[1], ARGV[1] are its fence) and raise `Fenced`."""
        keys.keys[0] = _fence_key(fence, run_prefix(run_id))
        reply: list[Any] = self._run(name, keys.keys, [_fence_arg(fence), *args])
        if reply[0] == b"fenced":
            _raise_fenced(fence, reply)
        return reply

    # -- lifecycle -----------------------------------------------------------
    def setup(self) -> None:
        """Record the layout versions, and load the scripts so first calls need no reload."""
        now = repr(time.time())
        applied = self.applied_migrations()
        refusal = newer_schema(applied, f"the store at {display_url(self.url)}")
        if refusal is not None:
            raise refusal
        try:
            pipe = self._client().pipeline(transaction=True)
            for version in sorted(MIGRATIONS):
                pipe.hsetnx(MIGRATIONS_KEY, str(version), now)
            for script in self._scripts.values():
                pipe.script_load(script.script)
            pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"cannot set up Redis store: {exc}") from exc

    def applied_migrations(self) -> list[int]:
        return sorted(int(v) for v in self._cmd("HKEYS", MIGRATIONS_KEY))

    def close(self) -> None:
        if self._pid == os.getpid():
            self._pool.disconnect()

    # -- checkpoints and branches -------------------------------------------
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
        r = record
        prefix = run_prefix(r.run_id)
        keys = [
            _fence_key(fence, prefix), prefix + "ck", prefix + "ix", prefix + "br", RUNS_KEY
        ]  # fmt: skip
        header = [
            r.checkpoint_id, r.branch, r.parent_id, r.ns, r.seq, r.metadata,
            r.schema_version, r.workflow_version, r.created_at,
        ]  # fmt: skip
        args: list[Any] = [
            _fence_arg(fence),
            _opt_id(expected_head),
            _esc(r.ns),
            _esc(r.branch),
            _esc(r.checkpoint_id),
            r.seq,
            repr(r.created_at),
            _pack(header, r.state),
            _esc(r.run_id),
        ]
        if blobs or writes:
            extra = _Keys(*keys)
            args.append(len(blobs))
            for b in blobs:
                args += [extra.index(run_prefix(b.run_id) + "bl"), _join(b.ns, b.key), b.value]
            args += _write_args(extra, writes)
            keys = extra.keys
        failpoints.hit("checkpoint.in_commit")
        reply: list[Any] = self._run("COMMIT", keys, args)
        if reply[0] == b"fenced":
            _raise_fenced(fence, reply)
        if reply[0] == b"head":
            raise HeadMoved(
                f"branch {r.branch!r} no longer has head {expected_head!r}",
                run_id=r.run_id,
                checkpoint_id=r.checkpoint_id,
            )
        if reply[0] == b"dup":
            raise HeadMoved(
                "a checkpoint with this id already exists",
                run_id=r.run_id,
                checkpoint_id=r.checkpoint_id,
            )
        if release is not None:
            # After the commit, in a call of its own. The commit holds whatever
            # happens here: a release that fails leaves the claim to lapse with
            # its lease, as if its holder had died (L1).
            with contextlib.suppress(StoreUnavailable):
                self.release_claim(release)

    def _checkpoint(
        self, run_id: str, raw: bytes, checkpoint_id: str | None = None
    ) -> CheckpointRecord:
        header, state = _unpack(raw, run_id=run_id, checkpoint_id=checkpoint_id)
        try:
            cid, branch, parent, ns, seq, meta, schema_version, wf_version, created = header
            if type(meta) is not dict:  # (a commit stores a dict; anything else was altered)
                raise TypeError(f"its metadata is not a mapping but a {type(meta).__name__}")
            return CheckpointRecord(
                run_id=run_id,
                checkpoint_id=cid,
                branch=branch,
                parent_id=parent,
                state=state,
                ns=ns,
                seq=int(seq),
                metadata=meta,
                schema_version=int(schema_version),
                workflow_version=wf_version,
                created_at=float(created),
            )
        except (ValueError, TypeError, AttributeError) as exc:
            raise CorruptRecord(
                f"stored Redis checkpoint does not decode: {exc}",
                run_id=run_id,
                checkpoint_id=header[0] if header else None,
            ) from exc

    def get_checkpoint(self, run_id: str, ns: str, checkpoint_id: str) -> CheckpointRecord | None:
        raw = self._cmd("HGET", run_prefix(run_id) + "ck", _join(checkpoint_id, ns))
        return None if raw is None else self._checkpoint(run_id, raw, checkpoint_id)

    def list_checkpoints(
        self,
        run_id: str | None,
        ns: str | None = None,
        *,
        before_id: str | None = None,
        limit: int | None = None,
    ) -> list[CheckpointRecord]:
        count = -1 if limit is None or limit < 0 else int(limit)
        if ns is None:
            lo, hi = "[x", "(y" if before_id is None else "(x" + _esc(before_id)
        else:
            lo = "[n" + _esc(ns) + _SEP
            hi = "(n" + _esc(ns) + ("\x01" if before_id is None else _SEP + _esc(before_id))
        args: list[str | int] = [hi, lo, count]

        def keys(run: str) -> list[str]:
            prefix = run_prefix(run)
            return [prefix + "ck", prefix + "ix"]

        if run_id is not None:
            raws = self._run("LIST_CHECKPOINTS", keys(run_id), args)
            return [self._checkpoint(run_id, raw) for raw in raws if raw is not None]
        try:
            runs = [_unesc(r) for r in self._cmd("SMEMBERS", RUNS_KEY)]
        except UnicodeDecodeError as exc:
            raise CorruptRecord(f"the run index {RUNS_KEY!r} holds a non-UTF-8 member") from exc
        try:
            pipe = self._client().pipeline(transaction=False)
            for run in runs:
                self._scripts["LIST_CHECKPOINTS"](keys(run), args, client=pipe)
            replies = pipe.execute()
        except RedisError as exc:
            raise StoreUnavailable(f"Redis store failed listing checkpoints: {exc}") from exc
        records = [
            self._checkpoint(run, raw)
            for run, raws in zip(runs, replies, strict=True)
            for raw in raws
            if raw is not None
        ]
        records.sort(key=lambda c: c.checkpoint_id, reverse=True)
        return records if count < 0 else records[:count]

    @staticmethod
    def _branch(run_id: str, ns: str, branch: str, cols: dict[str, bytes]) -> BranchRecord:
        try:
            return BranchRecord(
                run_id=run_id,
                branch=branch,
                head_id=_id(cols.get("h")),
                ns=ns,
                head_seq=int(cols["q"]),
                base_id=_id(cols.get("b")),
                fork_token=_str(cols.get("t")),
                created_at=float(cols["c"]),
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise CorruptRecord(
                f"stored branch {branch!r} does not decode: {type(exc).__name__}: {exc}",
                run_id=run_id,
            ) from exc

    def get_branch(self, run_id: str, ns: str, branch: str) -> BranchRecord | None:
        member = _join(ns, branch)
        fields = [member + "\x00" + c for c in "hqbtc"]
        values = self._cmd("HMGET", run_prefix(run_id) + "br", *fields)
        if values[4] is None:
            return None
        cols = {c: v for c, v in zip("hqbtc", values, strict=True) if v is not None}
        return self._branch(run_id, ns, branch, cols)

    def get_head(self, run_id: str, ns: str, branch: str) -> CheckpointRecord | None:
        prefix = run_prefix(run_id)
        raw = self._run("GET_HEAD", [prefix + "br", prefix + "ck"], [_join(ns, branch), _esc(ns)])
        if raw is None:
            return None
        try:
            return self._checkpoint(run_id, raw)
        except CorruptRecord as exc:
            if exc.checkpoint_id is not None:
                raise
            known = self.get_branch(run_id, ns, branch)  # a header too broken to name it
            raise CorruptRecord(
                exc.message,
                run_id=run_id,
                checkpoint_id=None if known is None else known.head_id,
            ) from exc

    def list_branches(self, run_id: str, ns: str | None = None) -> list[BranchRecord]:
        rows = self._cmd("HGETALL", run_prefix(run_id) + "br")
        branches = []
        for member, cols in _columns(rows).items():
            b_ns, branch = _split(member)
            branches.append(self._branch(run_id, b_ns, branch, cols))
        if ns is not None:
            branches = [b for b in branches if b.ns == ns]
        return sorted(branches, key=lambda b: (b.created_at, b.branch))

    def create_branch(self, branch: BranchRecord, *, fence: FenceRef | None = None) -> BranchRecord:
        b = branch
        prefix = run_prefix(b.run_id)
        args = [
            _fence_arg(fence),
            _join(b.ns, b.branch),
            "" if b.fork_token is None else _join(b.ns, b.fork_token),
            _opt_id(b.head_id),
            b.head_seq,
            _opt_id(b.base_id),
            _opt(b.fork_token),
            repr(b.created_at),
            _esc(b.run_id),
            "" if b.base_id is None else _join(b.base_id, b.ns),
        ]
        failpoints.hit("fork.in_create")
        keys = [_fence_key(fence, prefix), prefix + "br", prefix + "bt", RUNS_KEY, prefix + "ck"]
        reply = self._run("CREATE_BRANCH", keys, args)
        if reply is not None and reply[0] == b"fenced":
            _raise_fenced(fence, reply)
        if reply is not None and reply[0] == b"nobase":
            raise UnknownRecord(
                "fork base does not exist (deleted, or never committed)",
                run_id=b.run_id,
                checkpoint_id=b.base_id,
            )
        if reply is None:
            raise HeadMoved(
                f"branch name {b.branch!r} is taken by another fork token", run_id=b.run_id
            )
        cols = {c: v for c, v in zip("hqbtc", reply[1:], strict=True) if v is not None}
        ns, name = _split(reply[0])
        return self._branch(b.run_id, ns, name, cols)

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
        args = [
            _join(ns, branch),
            _opt_id(expected_head),
            _opt_id(new_head),
            new_seq,
            "" if new_head is None else _join(new_head, ns),
        ]
        prefix = run_prefix(run_id)
        moved = self._run("MOVE_HEAD", [prefix + "br", prefix + "ck"], args)
        if moved == -1:
            raise head_gone(run_id, new_head)
        if not moved:
            raise HeadMoved(
                f"branch {branch!r} no longer has head {expected_head!r}",
                run_id=run_id,
                checkpoint_id=expected_head,
            )

    def get_blobs(self, run_id: str, ns: str, keys: Sequence[str]) -> dict[str, bytes]:
        if not keys:
            return {}
        values = self._cmd("HMGET", run_prefix(run_id) + "bl", *(_join(ns, k) for k in keys))
        return {k: v for k, v in zip(keys, values, strict=True) if v is not None}

    # -- step writes ---------------------------------------------------------
    def put_writes(
        self, writes: Sequence[WriteRecord], *, mode: WriteMode, fence: FenceRef | None = None
    ) -> None:
        keys = _Keys("")
        args: list[Any] = [mode, *_write_args(keys, writes)]
        failpoints.hit("writes.in_txn")
        run_id = writes[0].run_id if writes else ""
        reply = self._fenced_run("PUT_WRITES", fence, run_id, keys, args)
        if reply[0] == b"taken":
            w = writes[int(reply[1])]
            raise WriteConflict(
                f"write slot {w.task_id}#{w.idx} is already taken",
                run_id=w.run_id,
                checkpoint_id=w.checkpoint_id,
            )

    def get_writes(
        self, run_id: str, ns: str, checkpoint_id: str, *, after_idx: int | None = None
    ) -> list[WriteRecord]:
        prefix = run_prefix(run_id)
        raws = self._run(
            "GET_WRITES", [prefix + "wr", prefix + "wx"], _writes_range(ns, checkpoint_id)
        )
        return _writes_of(raws, run_id, checkpoint_id, after_idx)

    def get_checkpoint_and_writes(
        self, run_id: str, ns: str, checkpoint_id: str
    ) -> tuple[CheckpointRecord | None, list[WriteRecord]]:
        prefix = run_prefix(run_id)
        raws = self._run(
            "GET_CHECKPOINT_AND_WRITES",
            [prefix + "ck", prefix + "wr", prefix + "wx"],
            [_join(checkpoint_id, ns), *_writes_range(ns, checkpoint_id)],
        )
        if not raws:
            return None, []
        record = self._checkpoint(run_id, raws[0], checkpoint_id)
        return record, _writes_of(raws[1:], run_id, checkpoint_id, None)

    # -- interrupts ----------------------------------------------------------
    def open_interrupts(
        self, records: Sequence[InterruptRecord], *, fence: FenceRef | None = None
    ) -> None:
        keys = _Keys("")
        args: list[Any] = []
        for i in records:
            args += [
                keys.index(run_prefix(i.run_id) + "in"),
                _join(i.branch, i.interrupt_id),
                _opt(i.checkpoint_id),
                _opt(i.prompt),
                repr(i.created_at),
            ]
        run_id = records[0].run_id if records else ""
        self._fenced_run("OPEN_INTERRUPTS", fence, run_id, keys, args)

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
        keys = _Keys("", run_prefix(run_id) + "in")
        args = [_join(branch, interrupt_id), value, consumer, repr(now)]
        args += _write_args(keys, writes) if writes else []
        failpoints.hit("interrupt.in_consume")
        reply = self._fenced_run("CONSUME_INTERRUPT", fence, run_id, keys, args)
        if reply[0] == b"unknown":
            raise UnknownRecord("no such interrupt", run_id=run_id, interrupt_id=interrupt_id)
        if reply[0] == b"conflict":
            raise ResumeConflict(
                "interrupt was already consumed; the value was not stored",
                run_id=run_id,
                interrupt_id=interrupt_id,
            )
        checkpoint_id, prompt, created_at = reply[1]
        return InterruptRecord(
            run_id=run_id,
            branch=branch,
            interrupt_id=interrupt_id,
            checkpoint_id=_str(checkpoint_id),
            status="consumed",
            prompt=prompt,
            value=value,
            consumed_by=consumer,
            created_at=float(created_at),
            consumed_at=float(now),
        )

    @staticmethod
    def _interrupt(run_id: str, member: bytes, cols: dict[str, bytes]) -> InterruptRecord:
        branch, interrupt_id = _split(member)
        try:
            return InterruptRecord(
                run_id=run_id,
                branch=branch,
                interrupt_id=interrupt_id,
                checkpoint_id=_str(cols.get("k")),
                # As stored: another status is the core's to refuse (`CorruptRecord`).
                status=cast(InterruptStatus, cols["s"].decode(errors="replace")),
                prompt=cols.get("p"),
                value=cols.get("v"),
                consumed_by=_str(cols.get("u")),
                created_at=float(cols["c"]),
                consumed_at=_float(cols.get("t")),
            )
        except (KeyError, ValueError, UnicodeDecodeError) as exc:
            raise CorruptRecord(
                f"stored interrupt does not decode: {type(exc).__name__}: {exc}",
                run_id=run_id,
                interrupt_id=interrupt_id,
            ) from exc

    def get_interrupt(self, run_id: str, branch: str, interrupt_id: str) -> InterruptRecord | None:
        member = _join(branch, interrupt_id)
        values = self._cmd(
            "HMGET", run_prefix(run_id) + "in", *(member + "\x00" + c for c in "skpvuct")
        )
        if values[0] is None:
            return None
        cols = {c: v for c, v in zip("skpvuct", values, strict=True) if v is not None}
        return self._interrupt(run_id, member.encode(), cols)

    def list_interrupts(
        self,
        run_id: str,
        branch: str | None = None,
        *,
        checkpoint_id: str | None = None,
        status: InterruptStatus | None = None,
    ) -> list[InterruptRecord]:
        rows = self._cmd("HGETALL", run_prefix(run_id) + "in")
        found = [
            i
            for i in (self._interrupt(run_id, m, cols) for m, cols in _columns(rows).items())
            if (branch is None or i.branch == branch)
            and (checkpoint_id is None or i.checkpoint_id == checkpoint_id)
            and (status is None or i.status == status)
        ]
        return sorted(found, key=lambda i: (i.created_at, i.interrupt_id, i.branch))

    # -- claims --------------------------------------------------------------
    def acquire_claim(
        self, run_id: str, scope: str, holder: str, *, now: float, lease: float
    ) -> Claim:
        expires = float(now + lease)
        failpoints.hit("claim.in_acquire")
        args = [_join(scope), holder, repr(now), repr(expires)]
        reply = self._run("ACQUIRE_CLAIM", [run_prefix(run_id) + "cl"], args)
        if reply[0] == b"conflict":
            raise ResumeConflict(
                "another holder has this run's claim (a run in progress, or one whose process "
                "died before its lease ran out); retry when that run ends or the lease runs out",
                run_id=run_id,
                scope=scope,
            )
        return Claim(run_id, scope, holder, int(reply[1]), expires)

    def _update_claim(self, claim: Claim, expires: str) -> bool:
        args = [_join(claim.scope), claim.holder, str(claim.fence), expires]
        return bool(self._run("UPDATE_CLAIM", [run_prefix(claim.run_id) + "cl"], args))

    def renew_claim(self, claim: Claim, *, now: float, lease: float) -> Claim:
        expires = float(now + lease)
        if not self._update_claim(claim, repr(expires)):
            raise Fenced("claim was taken over or released", run_id=claim.run_id, scope=claim.scope)
        return Claim(claim.run_id, claim.scope, claim.holder, claim.fence, expires)

    def release_claim(self, claim: Claim) -> None:
        self._update_claim(claim, "")

    def get_claim(self, run_id: str, scope: str) -> Claim | None:
        member = _join(scope)
        holder, fence, expires = self._cmd(
            "HMGET", run_prefix(run_id) + "cl", *(member + "\x00" + c for c in "hfe")
        )
        if fence is None:
            return None
        return Claim(run_id, scope, holder.decode(), int(fence), float(expires))

    # -- effect ledger -------------------------------------------------------
    @staticmethod
    def _effect(run_id: str, effect_key: str, values: list[bytes | None]) -> EffectRecord:
        idem, status, outcome, created_at, done_at, claim = values
        try:
            if idem is None or status is None or created_at is None:
                raise ValueError("a field of the entry is missing")
            return EffectRecord(
                run_id=run_id,
                effect_key=effect_key,
                idempotency_key=idem.decode(),
                # As stored: the core refuses a status that is neither of the two.
                status=cast(EffectStatus, status.decode(errors="replace")),
                outcome=outcome,
                created_at=float(created_at),
                done_at=_float(done_at),
                claim=None if claim is None else _fence_of(run_id, claim),
            )
        except ValueError as exc:  # (UnicodeDecodeError included)
            raise CorruptRecord(
                f"stored effect entry does not decode: {exc}", run_id=run_id, effect_key=effect_key
            ) from exc

    def begin_effect(
        self,
        run_id: str,
        effect_key: str,
        idempotency_key: str,
        *,
        now: float,
        fence: FenceRef | None = None,
    ) -> tuple[EffectRecord, bool]:
        keys = _Keys("", run_prefix(run_id) + "ef")
        args = [_join(effect_key), idempotency_key, repr(now)]
        reply = self._fenced_run("BEGIN_EFFECT", fence, run_id, keys, args)
        return self._effect(run_id, effect_key, reply[2]), reply[1] == 1

    def adopt_effect(
        self,
        run_id: str,
        effect_key: str,
        *,
        held: FenceRef | None,
        fence: FenceRef | None = None,
    ) -> tuple[EffectRecord, bool]:
        keys = _Keys("", run_prefix(run_id) + "ef")
        args = [_join(effect_key), _fence_arg(held)]
        reply = self._fenced_run("ADOPT_EFFECT", fence, run_id, keys, args)
        if reply[2][1] is None:
            raise effect_deleted(run_id, effect_key)
        return self._effect(run_id, effect_key, reply[2]), reply[1] == 1

    def finish_effect(
        self,
        run_id: str,
        effect_key: str,
        outcome: bytes,
        *,
        now: float,
        fence: FenceRef | None = None,
    ) -> EffectRecord:
        keys = _Keys("", run_prefix(run_id) + "ef")
        failpoints.hit("effect.in_outcome")
        reply = self._fenced_run(
            "FINISH_EFFECT", fence, run_id, keys, [_join(effect_key), outcome, repr(now)]
        )
        if reply[1][1] is None:
            raise UnknownRecord(
                "no intent recorded for effect", run_id=run_id, effect_key=effect_key
            )
        return self._effect(run_id, effect_key, reply[1])

    def get_effect(self, run_id: str, effect_key: str) -> EffectRecord | None:
        member = _join(effect_key)
        values = self._cmd(
            "HMGET", run_prefix(run_id) + "ef", *(member + "\x00" + c for c in "ksocdw")
        )
        return None if values[1] is None else self._effect(run_id, effect_key, values)

    # -- whole runs ----------------------------------------------------------
    def delete_run(self, run_id: str) -> None:
        self._run("DELETE_RUN", [*run_keys(run_id), RUNS_KEY], [_esc(run_id)])

    def delete_checkpoints(self, run_id: str, ns: str, checkpoint_ids: Sequence[str]) -> int:
        prefix = run_prefix(run_id)
        args = [_esc(ns), *(_esc(cid) for cid in checkpoint_ids)]
        return int(
            self._run(
                "DELETE_CHECKPOINTS",
                [prefix + k for k in ("br", "ck", "ix", "wr", "wx")],
                args,
            )
        )

    def copy_run(self, source_run_id: str, target_run_id: str) -> None:
        keys = [*run_keys(source_run_id), *run_keys(target_run_id), RUNS_KEY]
        self._run("COPY_RUN", keys, [_esc(target_run_id)])
