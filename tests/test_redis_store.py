"""The Redis engine: SQL's semantics exactly, and what is Redis's own business.

A Hypothesis state machine runs random primitive sequences against the Redis
store and the SQLite store (the `SqlStore` reference) side by side and
requires the same answers and the same errors, step by step. The other tests
cover what only Redis has: scripts reloaded after `SCRIPT FLUSH`, an
unreachable server, the per-run key layout and its hash tag, and a pool that
a forked child must not share.
"""

from __future__ import annotations

import os
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from redis import Redis
from redis.crc import key_slot

from remit_core.errors import CorruptRecord, RemitError, StoreUnavailable
from remit_core.records import (
    BlobRecord,
    BranchRecord,
    CheckpointRecord,
    Claim,
    FenceRef,
    InterruptRecord,
    WriteRecord,
)
from remit_core.stores.base import Store
from remit_core.stores.redis import (
    MIGRATIONS,
    RUN_KEYS,
    RUNS_KEY,
    RedisStore,
    run_keys,
    run_prefix,
)
from remit_core.stores.sqlite import SQLiteStore

REDIS_URL = os.environ.get("REMIT_TEST_REDIS", "redis://127.0.0.1:6379/0")

# -- fixtures --------------------------------------------------------------------


@pytest.fixture
def redis_store() -> Iterator[RedisStore]:
    store = RedisStore(REDIS_URL)
    store.setup()
    yield store
    store.close()


@pytest.fixture
def run_id(redis_store: RedisStore) -> Iterator[str]:
    """A fresh run, deleted afterwards: listings over every run read the shared server."""
    run = f"run-{uuid.uuid4().hex}"
    yield run
    redis_store.delete_run(run)


@pytest.fixture
def raw() -> Redis:
    return Redis.from_url(REDIS_URL)


def ckpt(run_id: str, cid: str, parent: str | None = None, ns: str = "") -> CheckpointRecord:
    return CheckpointRecord(run_id, cid, "main", parent, b"state\x00\n" + cid.encode(), ns=ns)


def outcome(call: Callable[[], Any]) -> Any:
    """A call's result, or its error's class and message: what two engines must agree on."""
    try:
        return ("ok", call())
    except RemitError as exc:
        return ("error", type(exc).__name__, str(exc))


# -- the same semantics as the SQL reference -------------------------------------

#: Ids that probe the escaping and the byte order of composite fields and members.
IDS = ["c1", "c2", "c2\x00z", "c2\x01", "é{%}"]
NSS = ["", "s\x00"]
BRANCHES = ["main", "b"]
TASKS = ["t1", "t2"]


class RedisMatchesSql(RuleBasedStateMachine):
    """Every primitive on Redis answers as on SQLite, after any sequence of primitives."""

    sql: SQLiteStore
    redis: RedisStore

    def __init__(self) -> None:
        super().__init__()
        tag = uuid.uuid4().hex
        self.runs = [f"run-{tag}-a", f"{{run}}-{tag}-b"]
        self.clock = 1000.0

    def teardown(self) -> None:
        for run in self.runs:
            self.redis.delete_run(run)

    def both(self, call: Callable[[Store], Any]) -> Any:
        self.clock += 0.25
        expected, got = outcome(lambda: call(self.sql)), outcome(lambda: call(self.redis))
        assert got == expected
        return got

    def fence(self, run: str, choice: int) -> FenceRef | None:
        """No fence, the claim's current fence, or a stale one."""
        claim = self.sql.get_claim(run, "main")
        if choice == 0 or claim is None:
            return None
        return FenceRef(run, "main", claim.fence - (choice - 1), claim.holder)

    # -- writes ----------------------------------------------------------------
    @rule(
        run=st.sampled_from([0, 1]),
        ns=st.sampled_from(NSS),
        branch=st.sampled_from([*BRANCHES, "f1"]),
        cid=st.sampled_from(IDS),
        expect=st.sampled_from(["none", "head", "other"]),
        blob_keys=st.lists(st.sampled_from(["k1", "k2"]), max_size=2),
        write_slots=st.lists(st.tuples(st.sampled_from(TASKS), st.integers(-1, 1)), max_size=2),
        fence=st.integers(0, 2),
    )
    def commit(
        self,
        run: int,
        ns: str,
        branch: str,
        cid: str,
        expect: str,
        blob_keys: list[str],
        write_slots: list[tuple[str, int]],
        fence: int,
    ) -> None:
        run_id = self.runs[run]
        current = self.sql.get_branch(run_id, ns, branch)
        expected = {
            "none": None,
            "head": current.head_id if current else None,
            "other": "c1",
        }[expect]
        record = CheckpointRecord(
            run_id,
            cid,
            branch,
            expected,
            f"state {self.clock}".encode() + b"\x00\xff\n",
            ns=ns,
            seq=int(self.clock),
            metadata={"step": self.clock, "tags": ("a", 1), "raw": b"\x00"},
            schema_version=2,
            workflow_version="wf",
            created_at=self.clock,
        )
        blobs = [BlobRecord(run_id, k, f"{k}@{self.clock}".encode(), ns) for k in blob_keys]
        writes = [
            WriteRecord(run_id, cid, t, i, f"ch{i}", f"{self.clock}".encode(), ns, f"p/{t}")
            for t, i in write_slots
        ]
        self.both(
            lambda s: s.commit_checkpoint(
                record,
                expected_head=expected,
                blobs=blobs,
                writes=writes,
                fence=self.fence(run_id, fence),
            )
        )

    @rule(
        run=st.sampled_from([0, 1]),
        ns=st.sampled_from(NSS),
        mode=st.sampled_from(["first", "overwrite", "expect_absent"]),
        slots=st.lists(
            st.tuples(st.sampled_from(IDS[:3]), st.sampled_from(TASKS), st.integers(-1, 1)),
            min_size=0,
            max_size=3,
        ),
        fence=st.integers(0, 2),
    )
    def put_writes(
        self, run: int, ns: str, mode: Any, slots: list[tuple[str, str, int]], fence: int
    ) -> None:
        run_id = self.runs[run]
        writes = [
            WriteRecord(run_id, c, t, i, f"ch{i}", f"v{self.clock}".encode(), ns, "")
            for c, t, i in slots
        ]
        self.both(lambda s: s.put_writes(writes, mode=mode, fence=self.fence(run_id, fence)))

    @rule(
        run=st.sampled_from([0, 1]),
        ns=st.sampled_from(NSS),
        name=st.sampled_from(["f1", "b"]),
        head=st.sampled_from([None, *IDS[:3]]),
        base=st.sampled_from([None, *IDS[:3]]),
        token=st.sampled_from([None, "tok1", "tok2"]),
    )
    def create_branch(
        self, run: int, ns: str, name: str, head: str | None, base: str | None, token: str | None
    ) -> None:
        b = BranchRecord(self.runs[run], name, head, ns, 0, base, token, self.clock)
        self.both(lambda s: s.create_branch(b))

    @rule(
        run=st.sampled_from([0, 1]),
        ns=st.sampled_from(NSS),
        branch=st.sampled_from([*BRANCHES, "f1"]),
        expect=st.sampled_from(["none", "head", "other"]),
        new=st.sampled_from([None, *IDS]),
    )
    def move_head(self, run: int, ns: str, branch: str, expect: str, new: str | None) -> None:
        run_id = self.runs[run]
        current = self.sql.get_branch(run_id, ns, branch)
        expected = {"none": None, "head": current.head_id if current else None, "other": "c1"}
        self.both(
            lambda s: s.move_head(
                run_id, ns, branch, expected_head=expected[expect], new_head=new, new_seq=7
            )
        )

    @rule(
        run=st.sampled_from([0, 1]),
        ns=st.sampled_from(NSS),
        ids=st.lists(st.sampled_from(IDS), max_size=4),
    )
    def delete_checkpoints(self, run: int, ns: str, ids: list[str]) -> None:
        self.both(lambda s: s.delete_checkpoints(self.runs[run], ns, ids))

    @rule(source=st.sampled_from([0, 1]))
    def copy_run(self, source: int) -> None:
        self.both(lambda s: s.copy_run(self.runs[source], self.runs[1 - source]))

    @rule(run=st.sampled_from([0, 1]))
    def delete_run(self, run: int) -> None:
        self.both(lambda s: s.delete_run(self.runs[run]))

    # -- interrupts, claims, effects ---------------------------------------------
    @rule(
        run=st.sampled_from([0, 1]),
        items=st.lists(
            st.tuples(st.sampled_from(BRANCHES), st.sampled_from(["i1", "i2"])), max_size=3
        ),
        fence=st.integers(0, 2),
    )
    def open_interrupts(self, run: int, items: list[tuple[str, str]], fence: int) -> None:
        run_id = self.runs[run]
        records = [
            InterruptRecord(
                run_id, b, i, None if i == "i2" else "c1", prompt=b"?" if b == "b" else None,
                created_at=self.clock,
            )
            for b, i in items
        ]  # fmt: skip
        self.both(lambda s: s.open_interrupts(records, fence=self.fence(run_id, fence)))

    @rule(
        run=st.sampled_from([0, 1]),
        branch=st.sampled_from(BRANCHES),
        iid=st.sampled_from(["i1", "i2", "i3"]),
        fence=st.integers(0, 2),
    )
    def consume(self, run: int, branch: str, iid: str, fence: int) -> None:
        run_id = self.runs[run]
        value = f"value {self.clock}".encode()
        self.both(
            lambda s: s.consume_interrupt(
                run_id, branch, iid, value, consumer="me", now=self.clock,
                fence=self.fence(run_id, fence),
            )
        )  # fmt: skip

    @rule(
        run=st.sampled_from([0, 1]),
        scope=st.sampled_from(["main", "other"]),
        holder=st.sampled_from(["A", "B"]),
        lease=st.sampled_from([0.0, 0.5, 5.0]),
    )
    def acquire(self, run: int, scope: str, holder: str, lease: float) -> None:
        now = self.clock
        self.both(lambda s: s.acquire_claim(self.runs[run], scope, holder, now=now, lease=lease))

    @rule(run=st.sampled_from([0, 1]), holder=st.sampled_from(["A", "B"]), release=st.booleans())
    def renew_or_release(self, run: int, holder: str, release: bool) -> None:
        claim = self.sql.get_claim(self.runs[run], "main")
        if claim is None:
            return
        claim = Claim(claim.run_id, claim.scope, holder, claim.fence, claim.expires_at)
        now = self.clock
        if release:
            self.both(lambda s: s.release_claim(claim))
        else:
            self.both(lambda s: s.renew_claim(claim, now=now, lease=1.0))

    @rule(
        run=st.sampled_from([0, 1]),
        key=st.sampled_from(["e1", "e2"]),
        finish=st.booleans(),
        fence=st.integers(0, 2),
    )
    def effect(self, run: int, key: str, finish: bool, fence: int) -> None:
        run_id, now = self.runs[run], self.clock
        if finish:
            outcome_bytes = f"out {now}".encode()
            self.both(
                lambda s: s.finish_effect(
                    run_id, key, outcome_bytes, now=now, fence=self.fence(run_id, fence)
                )
            )
        else:
            self.both(
                lambda s: s.begin_effect(
                    run_id, key, f"idem-{key}", now=now, fence=self.fence(run_id, fence)
                )
            )

    # -- reads -----------------------------------------------------------------
    @rule(
        run=st.sampled_from([0, 1]),
        ns=st.sampled_from([None, *NSS]),
        before=st.sampled_from([None, *IDS, "c", "c2\x00", "c10", "zz"]),
        limit=st.sampled_from([None, 0, 1, 3]),
    )
    def list_checkpoints(self, run: int, ns: str | None, before: str | None, limit: int | None):
        if ns is None:
            # Ties (one id in several namespaces) have no SQL order: compare ids only.
            self.both(
                lambda s: [
                    c.checkpoint_id
                    for c in s.list_checkpoints(self.runs[run], None, before_id=before, limit=limit)
                ]
            )
        else:
            self.both(
                lambda s: s.list_checkpoints(self.runs[run], ns, before_id=before, limit=limit)
            )

    @rule(
        run=st.sampled_from([0, 1]),
        ns=st.sampled_from(NSS),
        cid=st.sampled_from(IDS),
        after=st.sampled_from([None, -1, 0]),
    )
    def read_writes(self, run: int, ns: str, cid: str, after: int | None) -> None:
        self.both(lambda s: s.get_writes(self.runs[run], ns, cid, after_idx=after))

    @rule(run=st.sampled_from([0, 1]), ns=st.sampled_from(NSS), cid=st.sampled_from(IDS))
    def read_one(self, run: int, ns: str, cid: str) -> None:
        run_id = self.runs[run]
        self.both(lambda s: s.get_checkpoint(run_id, ns, cid))
        self.both(lambda s: [s.get_branch(run_id, ns, b) for b in [*BRANCHES, "f1"]])
        self.both(lambda s: [s.get_head(run_id, ns, b) for b in [*BRANCHES, "f1"]])
        self.both(lambda s: s.get_blobs(run_id, ns, ["k1", "k2", "k3"]))
        self.both(lambda s: [s.get_interrupt(run_id, b, "i1") for b in BRANCHES])
        self.both(lambda s: [s.get_claim(run_id, scope) for scope in ("main", "other")])
        self.both(lambda s: [s.get_effect(run_id, e) for e in ("e1", "e2")])

    @invariant()
    def listings_agree(self) -> None:
        for run in self.runs:
            self.listings_of(run)

    def listings_of(self, run: str) -> None:
        self.both(
            lambda s: sorted(s.list_checkpoints(run, None), key=lambda c: (c.checkpoint_id, c.ns))
        )
        self.both(lambda s: s.list_branches(run))
        self.both(lambda s: s.list_branches(run, "s\x00"))
        self.both(
            lambda s: sorted(
                s.list_interrupts(run), key=lambda i: (i.created_at, i.interrupt_id, i.branch)
            )
        )
        self.both(lambda s: s.list_interrupts(run, "b"))


def test_redis_matches_the_sql_reference_on_random_sequences(redis_store: RedisStore) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sql = SQLiteStore(f"sqlite:///{tmp}/reference.db")
        sql.setup()
        RedisMatchesSql.sql, RedisMatchesSql.redis = sql, redis_store
        run_state_machine_as_test(
            RedisMatchesSql,
            settings=settings(
                max_examples=80,
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
        sql.close()


def on_both(redis_store: RedisStore, scenario: Callable[[Store, str], Any]) -> None:
    """Run `scenario` on SQLite and on Redis with fresh run ids; the traces must match."""
    with tempfile.TemporaryDirectory() as tmp:
        sql = SQLiteStore(f"sqlite:///{tmp}/reference.db")
        sql.setup()
        run_id = f"run-{uuid.uuid4().hex}"
        try:
            assert scenario(redis_store, run_id) == scenario(sql, run_id)
        finally:
            redis_store.delete_run(run_id)
            redis_store.delete_run(run_id + "-copy")
            sql.close()


def fork_scenario(s: Store, run_id: str) -> list[Any]:
    """Two checkpoints on main, a fork from the first that moves on, then pruning."""
    s.commit_checkpoint(ckpt(run_id, "c0"), expected_head=None)
    for parent, cid in [("c0", "c1"), ("c1", "c2")]:
        s.commit_checkpoint(ckpt(run_id, cid, parent), expected_head=parent)
    fork = BranchRecord(run_id, "f", "c1", "", 0, "c1", "tok", 5.0)
    trace: list[Any] = [s.create_branch(fork)]
    s.commit_checkpoint(
        CheckpointRecord(run_id, "c3", "f", "c1", b"s3", created_at=6.0), expected_head="c1"
    )
    trace.append(s.delete_checkpoints(run_id, "", ["c0", "c1", "c2", "c3", "c0"]))
    trace.append([c.checkpoint_id for c in s.list_checkpoints(run_id)])
    return trace


def test_redis_delete_checkpoints_keeps_heads_and_fork_bases_as_sql(
    redis_store: RedisStore,
) -> None:
    on_both(redis_store, fork_scenario)


def test_redis_copy_run_skips_taken_names_and_tokens_as_sql(redis_store: RedisStore) -> None:
    def scenario(s: Store, run_id: str) -> list[Any]:
        fork_scenario(s, run_id)
        target = run_id + "-copy"
        s.commit_checkpoint(ckpt(target, "t1"), expected_head=None)  # "main" is taken
        s.create_branch(BranchRecord(target, "g", "t1", "", 0, "t1", "tok", 9.0))  # so is "tok"
        s.put_writes([WriteRecord(run_id, "c3", "t", 0, "ch", b"w")], mode="first")
        s.put_writes([WriteRecord(target, "c3", "t", 0, "ch", b"mine")], mode="first")
        s.copy_run(run_id, target)
        return [
            s.list_branches(target),
            sorted(c.checkpoint_id for c in s.list_checkpoints(target)),
            s.get_writes(target, "", "c3"),
        ]

    on_both(redis_store, scenario)


def test_redis_commit_fills_a_branch_with_no_head_as_sql(redis_store: RedisStore) -> None:
    def scenario(s: Store, run_id: str) -> list[Any]:
        s.create_branch(BranchRecord(run_id, "b", None, "", 0, None, "tok", 3.0))
        s.commit_checkpoint(
            CheckpointRecord(run_id, "c1", "b", None, b"s", seq=4, created_at=8.0),
            expected_head=None,
        )
        again = outcome(
            lambda: s.commit_checkpoint(
                CheckpointRecord(run_id, "c2", "b", None, b"s", created_at=9.0), expected_head=None
            )
        )
        return [s.list_branches(run_id), again]

    on_both(redis_store, scenario)


# -- scripts -----------------------------------------------------------------------


def test_redis_scripts_reload_transparently_after_script_flush(
    redis_store: RedisStore, raw: Redis, run_id: str
) -> None:
    redis_store.commit_checkpoint(ckpt(run_id, " 1"), expected_head=None)
    sha = redis_store._scripts["COMMIT"].sha
    assert raw.script_exists(sha) == [True]
    raw.script_flush()
    assert raw.script_exists(sha) == [False]
    redis_store.commit_checkpoint(ckpt(run_id, " 2", " 1"), expected_head=" 1")
    assert raw.script_exists(sha) == [True]
    assert redis_store.get_branch(run_id, "", "main").head_id == " 2"  # type: ignore[union-attr]
    raw.script_flush()
    # The listing of every run goes through a pipeline, which loads scripts its own way.
    # Ids below "!" keep the shared server's other runs out of the answer.
    listed = redis_store.list_checkpoints(None, before_id=" 3")
    assert (run_id, " 2") in [(c.run_id, c.checkpoint_id) for c in listed]


def test_redis_each_primitive_is_one_command(redis_store: RedisStore, raw: Redis, run_id: str):
    """MONITOR the server: every primitive sends one command (its script runs server-side)."""
    s = redis_store
    claim = s.acquire_claim(run_id, "main", "h", now=1.0, lease=60.0)
    fence = FenceRef.of(claim)
    write = WriteRecord(run_id, "c1", "t", 0, "ch", b"w")
    primitives: dict[str, Callable[[], Any]] = {
        "commit": lambda: s.commit_checkpoint(
            ckpt(run_id, "c1"), expected_head=None, blobs=[BlobRecord(run_id, "k", b"v")],
            writes=[write], fence=fence,
        ),
        "get_head": lambda: s.get_head(run_id, "", "main"),
        "get_checkpoint": lambda: s.get_checkpoint(run_id, "", "c1"),
        "list_checkpoints": lambda: s.list_checkpoints(run_id, "", before_id="c9", limit=5),
        "put_writes": lambda: s.put_writes([write], mode="first", fence=fence),
        "get_writes": lambda: s.get_writes(run_id, "", "c1"),
        "open": lambda: s.open_interrupts([InterruptRecord(run_id, "main", "i", "c1")]),
        "consume": lambda: s.consume_interrupt(
            run_id, "main", "i", b"yes", consumer="me", now=2.0, fence=fence
        ),
        "claim": lambda: s.acquire_claim(run_id, "other", "h", now=1.0, lease=5.0),
        "renew": lambda: s.renew_claim(claim, now=2.0, lease=60.0),
        "begin_effect": lambda: s.begin_effect(run_id, "e", "k", now=2.0, fence=fence),
        "finish_effect": lambda: s.finish_effect(run_id, "e", b"ok", now=3.0, fence=fence),
        "fork": lambda: s.create_branch(BranchRecord(run_id, "f", "c1", "", 0, "c1", "tok")),
    }  # fmt: skip
    client = s._client()
    sent: dict[str, list[str]] = {}
    with raw.monitor() as monitor:
        for name, call in primitives.items():
            client.echo(f"start {name}")
            call()
            client.echo(f"end {name}")
        client.echo("done")
        current: list[str] | None = None
        port = None  # the store's connection: other clients use the server meanwhile
        while True:
            event = monitor.next_command()
            command = str(event["command"])
            if command.startswith("ECHO start "):
                port = event["client_port"]
            if event["client_type"] == "lua" or event["client_port"] != port:
                continue
            if command == "ECHO done":
                break
            if command.startswith("ECHO start "):
                current = sent.setdefault(command.split()[-1], [])
            elif command.startswith("ECHO end "):
                current = None
            elif current is not None:
                current.append(command.split()[0])
    assert {name: len(commands) for name, commands in sent.items()} == dict.fromkeys(primitives, 1)
    assert sent["commit"] == ["EVALSHA"] and sent["claim"] == ["EVALSHA"]


# -- connection --------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_redis_closed_port_is_store_unavailable(run_id: str) -> None:
    store = RedisStore(f"redis://127.0.0.1:{closed_port()}/0")
    calls: list[Callable[[], Any]] = [
        store.setup,
        lambda: store.get_checkpoint(run_id, "", "c1"),
        lambda: store.commit_checkpoint(ckpt(run_id, "c1"), expected_head=None),
        lambda: store.acquire_claim(run_id, "main", "h", now=1.0, lease=1.0),
        lambda: store.list_checkpoints(None),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable, match="Connection refused|connecting"):
            call()


def test_redis_bad_url_is_refused_like_other_engines() -> None:
    with pytest.raises(ValueError, match="bad Redis URL.*notaport"):
        RedisStore("redis://127.0.0.1:notaport/0")


@pytest.mark.parametrize("path", ["0", "x"])
def test_redis_database_named_twice_is_refused_naming_both(path: str) -> None:
    # The client would take the option and drop the path's database without a word.
    with pytest.raises(ValueError, match=f"names its database twice.*'{path}'.*db='3'"):
        RedisStore(f"redis://127.0.0.1:6379/{path}?db=3")
    assert RedisStore("redis://127.0.0.1:6379?db=3").url.endswith("?db=3")


def test_redis_forked_child_uses_its_own_connections(redis_store: RedisStore, run_id: str) -> None:
    """Parent and child hammer one store object at once; a shared socket would mix replies."""
    redis_store.commit_checkpoint(ckpt(run_id, "p0"), expected_head=None)
    parent_id = redis_store._client().client_id()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        status = 1
        try:
            os.close(read)
            child_id = redis_store._client().client_id()
            os.write(write, str(child_id).encode())
            for i in range(300):
                claim = redis_store.acquire_claim(run_id, f"s{i}", "child", now=1.0, lease=9.0)
                assert claim.fence == 1 and claim.holder == "child"
                got = redis_store.get_checkpoint(run_id, "", "p0")
                assert got is not None and got.checkpoint_id == "p0"
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    for i in range(300):
        redis_store.open_interrupts([InterruptRecord(run_id, "main", f"i{i}", None)])
        assert redis_store.get_interrupt(run_id, "main", f"i{i}") is not None
    _, code = os.waitpid(pid, 0)
    child_id = int(os.read(read, 64))
    os.close(read)
    assert os.waitstatus_to_exitcode(code) == 0
    assert child_id != parent_id
    assert redis_store._client().client_id() == parent_id
    assert len(redis_store.list_interrupts(run_id)) == 300
    assert redis_store.get_claim(run_id, "s299") is not None


# -- key layout --------------------------------------------------------------------


def test_redis_keys_of_a_run_share_its_hash_tag_and_one_slot(
    redis_store: RedisStore, raw: Redis, run_id: str
) -> None:
    s = redis_store
    s.commit_checkpoint(
        ckpt(run_id, "c1"),
        expected_head=None,
        blobs=[BlobRecord(run_id, "k", b"v")],
        writes=[WriteRecord(run_id, "c1", "t", 0, "ch", b"w")],
    )
    s.create_branch(BranchRecord(run_id, "fork", "c1", base_id="c1", fork_token="tok"))
    s.open_interrupts([InterruptRecord(run_id, "main", "i1", "c1")])
    claim = s.acquire_claim(run_id, "main", "h", now=1.0, lease=5.0)
    s.begin_effect(run_id, "e", "idem", now=1.0, fence=FenceRef.of(claim))
    found = sorted(k.decode() for k in raw.scan_iter(match=f"remit:{{{run_id}}}:*"))
    assert found == sorted(run_keys(run_id))
    assert {key_slot(k.encode()) for k in found} == {key_slot(f"{{{run_id}}}".encode())}
    assert raw.sismember(RUNS_KEY, run_id)
    s.delete_run(run_id)
    assert list(raw.scan_iter(match=f"remit:{{{run_id}}}:*")) == []
    assert not raw.sismember(RUNS_KEY, run_id)


@pytest.mark.parametrize("odd", ["", "{", "}", "a}b{c", "%7B", "%"])
def test_redis_run_ids_with_braces_keep_one_tag_and_stay_apart(
    redis_store: RedisStore, raw: Redis, odd: str
) -> None:
    tag = uuid.uuid4().hex
    runs = [odd, f"{odd}{tag}", f"{tag}{odd}"] if odd else [odd, tag]
    try:
        for run in runs:
            redis_store.commit_checkpoint(ckpt(run, f"c-{run}"), expected_head=None)
        for run in runs:
            assert [c.checkpoint_id for c in redis_store.list_checkpoints(run)] == [f"c-{run}"]
            prefix = run_prefix(run)
            assert prefix.count("{") == 1 and prefix.count("}") == 1
            slots = {key_slot(k) for k in raw.scan_iter(match=prefix + "*")}
            assert len(slots) == 1
        assert len({run_prefix(r) for r in runs}) == len(runs)
    finally:
        for run in runs:
            redis_store.delete_run(run)


def test_redis_listing_every_run_merges_runs_by_checkpoint_id(
    redis_store: RedisStore, run_id: str
) -> None:
    other = run_id + "-other"
    try:
        # Ids below "!" keep the shared server's other runs out of the answer.
        c1, c2, c3, c4 = (f" {run_id}-{i}" for i in range(1, 5))
        redis_store.commit_checkpoint(ckpt(run_id, c1), expected_head=None)
        redis_store.commit_checkpoint(ckpt(other, c3), expected_head=None)
        redis_store.commit_checkpoint(ckpt(run_id, c2, c1), expected_head=c1)
        listed = redis_store.list_checkpoints(None, before_id=c4)
        ours = [(c.run_id, c.checkpoint_id) for c in listed if c.run_id in (run_id, other)]
        assert ours == [(other, c3), (run_id, c2), (run_id, c1)]
        ids = [c.checkpoint_id for c in listed]
        assert ids == sorted(ids, reverse=True)
        top = redis_store.list_checkpoints(None, before_id=c4, limit=2)
        assert [(c.run_id, c.checkpoint_id) for c in top] == ours[:2]
    finally:
        redis_store.delete_run(other)


def test_redis_malformed_record_header_is_corrupt_record(
    redis_store: RedisStore, raw: Redis, run_id: str
) -> None:
    redis_store.commit_checkpoint(ckpt(run_id, "c1"), expected_head=None)
    key, field = run_prefix(run_id) + "ck", "c1\x00"
    state = raw.hget(key, field).partition(b"\n")[2]  # type: ignore[union-attr]
    raw.hset(key, field, b"not json\n" + state)
    try:
        with pytest.raises(CorruptRecord) as err:
            redis_store.get_checkpoint(run_id, "", "c1")
        assert err.value.run_id == run_id
        with pytest.raises(CorruptRecord):
            redis_store.list_checkpoints(run_id)
    finally:
        redis_store.delete_run(run_id)  # a corrupt run would break listings of every run


def test_redis_setup_records_each_migration_once(redis_store: RedisStore, raw: Redis) -> None:
    before = raw.hgetall("remit:migrations")
    redis_store.setup()
    assert raw.hgetall("remit:migrations") == before
    assert redis_store.applied_migrations() == sorted(MIGRATIONS)
    assert set(RUN_KEYS) == {k.rsplit(":", 1)[1] for k in run_keys("r")}


def test_redis_commit_holds_when_its_release_after_it_fails(
    redis_store: RedisStore, run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Redis gives a claim up with a commit in a call of its own, after the commit.
    claim = redis_store.acquire_claim(run_id, "main", "A", now=0.0, lease=60.0)

    def unreachable(_claim: Claim) -> None:
        raise StoreUnavailable("Redis store failed in release: connection lost")

    monkeypatch.setattr(redis_store, "release_claim", unreachable)
    redis_store.commit_checkpoint(
        ckpt(run_id, "c01"), expected_head=None, fence=FenceRef.of(claim), release=claim
    )
    head = redis_store.get_head(run_id, "", "main")
    assert head is not None and head.checkpoint_id == "c01"
    assert redis_store.get_claim(run_id, "main") == claim  # left to lapse with its lease
