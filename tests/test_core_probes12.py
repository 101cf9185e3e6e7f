"""Probes of the core and its engines, round 12: a store's life, and a server that
goes away.

A `Remit` had no way to be closed: its claims stayed held until their leases ran out
(another resumer got `ResumeConflict` for 30 s after the holder was done), and its
connections stayed open. A store set up by a newer Remit was refused without naming
which store. A Redis server that dies mid-call and comes back, SQLite files that
cannot be a store, and eight processes committing to one SQLite file held already.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import PG_URL, REDIS_URL

from remit_core import (
    Remit,
    ResumeConflict,
    StoreUnavailable,
    VersionMismatch,
)
from remit_core.stores.redis import RedisStore

# -- closing a Remit --------------------------------------------------------------


def _private_url(store_url: str, tmp_path: Path, name: str) -> str:
    """A URL of `store_url`'s engine that no other test's `Remit` shares (its own pool),
    whose connections carry `name`."""
    if store_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path}/{name}.db"
    if store_url.startswith("postgresql"):
        return f"{PG_URL}?application_name={name}"
    return f"{REDIS_URL}?client_name={name}"


def _connections(url: str, name: str) -> int:
    """How many connections named `name` the server of `url` holds."""
    if url.startswith("postgresql"):
        with psycopg.connect(PG_URL, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).fetchone()
            assert row is not None
            return int(row[0])
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        return sum(1 for c in client.client_list() if c.get("name") == name)
    finally:
        client.close()


def test_closing_a_remit_gives_up_its_claims_and_later_use_names_its_store(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """There was no `close()`: a holder done with a run kept it claimed until the lease
    ran out, and its connections open until the process ended."""
    name = f"remit-close-{uuid.uuid4().hex[:8]}"
    url = _private_url(store_url, tmp_path, name)
    with Remit(url) as remit:
        remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
        remit.open_interrupts(run_id, {"i1": None}, checkpoint_id="c1")
        held = remit.claim(run_id)
        at_head, head, _ = remit.claim_at_head(run_id, "other-scope")
        assert head is None
        other = Remit(url)  # a second user of the same store, open past the first
        kept = other.claim(run_id, "kept")
        assert not remit.closed
    assert remit.closed and held.released and at_head.released
    # The claims are free at once (the lease is 30 s), the other Remit's is not.
    taker = Remit(url)
    taker.claim(run_id).release()
    taker.claim(run_id, "other-scope").release()
    with pytest.raises(ResumeConflict):
        taker.claim(run_id, "kept")
    # The other Remit still works over the shared store.
    assert other.head(run_id).checkpoint_id == "c1"  # type: ignore[union-attr]
    kept.release()
    # A closed Remit refuses every call by name, and a second close is a no-op.
    calls: dict[str, Any] = {
        "head": lambda: remit.head(run_id),
        "commit": lambda: remit.commit(
            run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s"
        ),
        "consume": lambda: remit.consume(run_id, "i1", b"yes"),
        "claim": lambda: remit.claim(run_id),
        "store": lambda: remit.store.get_claim(run_id, "main"),
    }
    for call in calls.values():
        with pytest.raises(StoreUnavailable, match="this Remit over .* is closed") as err:
            call()
        assert url.split("?")[0] in str(err.value)
    remit.close()
    assert [i.status for i in other.interrupts(run_id)] == ["pending"]
    # Once its last user closes, the store's connections are closed; a new Remit of
    # the URL opens them again.
    taker.close()
    other.close()
    if url.startswith("sqlite"):
        from remit_core.stores import open_store

        assert open_store(url)._conn is None  # type: ignore[attr-defined]
    else:
        deadline = time.monotonic() + 30  # (the server notices a closed connection soon)
        while _connections(url, name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _connections(url, name) == 0
    with Remit(url) as again:
        assert again.head(run_id).checkpoint_id == "c1"  # type: ignore[union-attr]


def test_a_closed_remit_over_a_store_passed_in_leaves_the_store_open_and_hides_passwords(
    run_id: str,
) -> None:
    """A store passed in is the caller's to close; the error names the store without
    the password of its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisStore(f"redis://alice:s3cret@127.0.0.1:{port}/0")
    remit = Remit(store)
    remit.close()
    with pytest.raises(StoreUnavailable) as err:
        remit.head(run_id)
    assert f"redis://alice:***@127.0.0.1:{port}/0" in str(err.value)
    assert "s3cret" not in str(err.value)
    with pytest.raises(StoreUnavailable, match="Connection refused|connecting"):
        store.get_claim(run_id, "main")  # the store itself is still usable (and down)


# -- a server that goes away and comes back -------------------------------------------


class _RedisServer:
    """A redis-server of this test's own on a free port, appending every write to disk
    (a restart keeps the data)."""

    def __init__(self, directory: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.directory = directory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                str(self.directory),
            ],  # fmt: skip
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # (a stopped server dies without running again)
            self.process.wait(30)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[_RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server to start")
    server = _RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_a_redis_server_killed_mid_call_is_store_unavailable_and_the_claim_outlives_it(
    own_redis: _RedisServer, run_id: str
) -> None:
    """A call in flight when the server dies raises `StoreUnavailable` and writes
    nothing; calls while it is down do too; once it is back the next call works, and
    the claim taken before the outage is still held (its renewals resumed)."""
    lease = 9.0
    remit = Remit(own_redis.url, lease=lease)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    handle = remit.claim(run_id)
    taken = time.time()
    # The server stops with a commit on its way, then dies before reading it.
    own_redis.signal(signal.SIGSTOP)
    errors: list[BaseException] = []

    def commit_c2() -> None:
        try:
            remit.commit(
                run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s", fence=handle.fence
            )
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=commit_c2)
    thread.start()
    time.sleep(0.3)
    own_redis.kill()
    thread.join(30)
    assert not thread.is_alive()
    assert [type(e) for e in errors] == [StoreUnavailable]
    for call in (
        lambda: remit.head(run_id),
        lambda: remit.claim(run_id, "other"),
        lambda: remit.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s"),
    ):
        with pytest.raises(StoreUnavailable):
            call()
    # Down past the claim's first renewal (at a third of the lease).
    time.sleep(max(0.0, taken + lease / 3 + 1 - time.time()))
    own_redis.start()
    head = remit.head(run_id)
    assert head is not None and head.checkpoint_id == "c1"
    assert remit.checkpoint(run_id, "c2") is None
    # Past the lease the claim had before the outage: renewed, still this holder's.
    time.sleep(max(0.0, taken + lease + 1 - time.time()))
    assert not handle.lost
    with pytest.raises(ResumeConflict):
        Remit(own_redis.url).claim(run_id)
    remit.commit(
        run_id=run_id,
        checkpoint_id="c2",
        parent_id="c1",
        state=b"s",
        fence=handle.fence,
        release=handle,
    )
    assert [c.checkpoint_id for c in remit.history(run_id)] == ["c2", "c1"]
    remit.close()


# -- SQLite files ---------------------------------------------------------------------


def test_a_sqlite_store_set_up_by_a_newer_remit_is_refused_naming_its_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "newer.db"
    remit = Remit(f"sqlite:///{path}")
    with remit.store._txn() as txn:  # type: ignore[attr-defined]
        txn.execute("INSERT INTO remit_migrations (version, applied_at) VALUES (99, 0)")
    remit.close()
    from remit_core.stores.sqlite import SQLiteStore

    with pytest.raises(VersionMismatch, match="schema 99, set up by a newer Remit") as err:
        SQLiteStore(f"sqlite:///{path}").setup()
    assert str(path) in str(err.value)


def test_sqlite_files_that_cannot_be_a_store_are_store_unavailable_naming_them(
    tmp_path: Path,
) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all " * 200)
    folder = tmp_path / "a-folder"
    folder.mkdir()
    for path in (tmp_path / "missing" / "x.db", junk, folder):
        with pytest.raises(StoreUnavailable) as err:
            Remit(f"sqlite:///{path}")
        assert repr(str(path)) in str(err.value)
    assert junk.read_bytes() == b"not a database at all " * 200


_READ_ONLY_CHILD = r"""
import json, os, sys
from remit_core import Remit, StoreUnavailable
from remit_core.stores.sqlite import SQLiteStore
path = sys.argv[1]
if os.getuid() == 0:  # (after the imports: the interpreter's files may be root's only)
    os.setgid(65534)
    os.setuid(65534)
out = []
try:
    Remit("sqlite:///" + path)
except StoreUnavailable as exc:
    out.append(str(exc))
try:
    Remit(SQLiteStore("sqlite:///" + path)).commit(
        run_id="r", checkpoint_id="c2", parent_id="c1", state=b"s")
except StoreUnavailable as exc:
    out.append(str(exc))
print(json.dumps(out))
"""


def test_a_read_only_sqlite_file_is_store_unavailable_naming_it_and_unchanged(
    tmp_path: Path,
) -> None:
    """Opened by a user who may not write it (as root: a child that drops to nobody,
    in a folder of its own that nobody can reach)."""
    if os.getuid() == 0:
        folder = Path(tempfile.mkdtemp(prefix="remit-ro-"))
        folder.chmod(0o755)
    else:
        folder = tmp_path / "ro"
        folder.mkdir()
    try:
        path = folder / "ro.db"
        with Remit(f"sqlite:///{path}") as remit:
            remit.commit(run_id="r", checkpoint_id="c1", parent_id=None, state=b"s")
        path.chmod(0o444)
        out = subprocess.run(
            [sys.executable, "-c", _READ_ONLY_CHILD, str(path)],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        messages = json.loads(out.stdout)
        assert len(messages) == 2
        for message in messages:
            assert repr(str(path)) in message and "readonly" in message
        path.chmod(0o644)
        with Remit(f"sqlite:///{path}") as remit:
            assert [c.checkpoint_id for c in remit.history("r")] == ["c1"]
    finally:
        if os.getuid() == 0:
            shutil.rmtree(folder, ignore_errors=True)


_COMMITTER = r"""
import json, sys, time
from remit_core import Remit, RemitError
i, url, start = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
while time.time() < start:
    time.sleep(0.001)
out = {"landed": [], "errors": []}
try:
    remit = Remit(url)
except RemitError as exc:
    print(json.dumps({"open": type(exc).__name__ + ": " + str(exc)}))
    sys.exit(0)
parent = None
for k in range(30):
    try:
        remit.commit(run_id=f"run{i}", checkpoint_id=f"c{k:02d}", parent_id=parent, state=b"s")
    except RemitError as exc:
        out["errors"].append(type(exc).__name__ + ": " + str(exc))
    else:
        out["landed"].append(f"c{k:02d}")
        parent = f"c{k:02d}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("busy_ms", [5, 30000])
def test_eight_processes_committing_to_one_new_sqlite_file_lose_no_commit(
    tmp_path: Path, busy_ms: int
) -> None:
    """Every commit either lands or raises `StoreUnavailable` naming the file: with a
    busy timeout too short to wait for the others, some are refused, none is lost."""
    path = tmp_path / "shared.db"
    url = f"sqlite:///{path}?busy_timeout={busy_ms}"
    start = time.time() + 3
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _COMMITTER, str(i), url, str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(8)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [err for _, err in results]
    with Remit(f"sqlite:///{path}") as remit:
        for i, (out, _) in enumerate(results):
            got = json.loads(out)
            errors = [got["open"]] if "open" in got else got["errors"]
            for error in errors:
                assert error.startswith("StoreUnavailable: ") and repr(str(path)) in error
            stored = [c.checkpoint_id for c in remit.history(f"run{i}")][::-1]
            assert stored == got.get("landed", [])
            if busy_ms == 30000:
                assert errors == [] and len(stored) == 30
