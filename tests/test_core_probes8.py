"""Probes of the core and its engines, round 8: what one engine did that another did not.

Ids with a lone surrogate in a step write or a blob key are refused naming the
field on every engine (the fast checks let them through to the engine, which
stored one or raised an encoder's error). A fork commit refused for its metadata
leaves no branch behind. Stored metadata that is not a mapping, and a Redis step
write whose header was altered, read as `CorruptRecord` naming the run and the
checkpoint; a claim taken by `claim_at_head` whose head fails to decode in the
store is given up. URL options an engine cannot honour are refused at once,
naming them, as a `ValueError` on every engine. A zombie's fenced fork commit
leaves no branch, however late it was stopped: the branch is made under the fence.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from conftest import PG_URL, REDIS_URL

from remit_core import (
    MAIN_BRANCH,
    CorruptRecord,
    Remit,
    ResumeConflict,
    WriteRecord,
    failpoints,
    open_store,
)

# -- helpers ---------------------------------------------------------------------


def _snapshot(remit: Remit, run_id: str) -> tuple[Any, ...]:
    """Everything a run holds, read back from the store."""
    s = remit.store
    return (
        [(c.checkpoint_id, c.branch) for c in s.list_checkpoints(run_id, None)],
        [(b.branch, b.head_id, b.fork_token) for b in s.list_branches(run_id, None)],
        s.get_writes(run_id, "", "c1"),
        s.get_writes(run_id, "", "c2"),
        s.get_blobs(run_id, "", ["k"]),
    )


def _set_metadata(remit: Remit, run_id: str, checkpoint_id: str, text: str) -> None:
    """Replace a stored checkpoint's metadata by the JSON `text`, as a bad writer would."""
    store: Any = remit.store
    if store.url.startswith("redis"):
        from remit_core.stores.redis import run_prefix

        client, key = store._client(), run_prefix(run_id) + "ck"
        field = f"{checkpoint_id}\x00"
        header, _, state = client.hget(key, field).partition(b"\n")
        fields = json.loads(header)
        fields[5] = json.loads(text)  # (checkpoint, branch, parent, ns, seq, metadata, ...)
        client.hset(key, field, json.dumps(fields).encode() + b"\n" + state)
        return
    with store._txn() as txn:
        txn.execute(
            "UPDATE remit_checkpoints SET metadata = ? WHERE run_id = ? AND checkpoint_id = ?",
            (text, run_id, checkpoint_id),
        )


# -- ids no engine can store ------------------------------------------------------

Call = Callable[[Remit, str], Any]


def _write(run_id: str, checkpoint_id: str = "c1", **fields: Any) -> WriteRecord:
    base: dict[str, Any] = {"task_id": "t", "idx": 0, "channel": "ch", "value": b"v"}
    return WriteRecord(run_id, checkpoint_id, **{**base, **fields})


SURROGATES: dict[str, tuple[Call, str]] = {
    "write task_id": (lambda r, run: r.put_writes([_write(run, task_id="t\ud800")]), "task_id"),
    "write channel": (lambda r, run: r.put_writes([_write(run, channel="c\udc00")]), "channel"),
    "write task_path": (
        lambda r, run: r.put_writes([_write(run, task_path="p\udfff")]),
        "task_path",
    ),
    "write ns": (lambda r, run: r.put_writes([_write(run, ns="n\ud800")]), "ns"),
    "commit blob key": (
        lambda r, run: r.commit(
            run_id=run, checkpoint_id="c2", parent_id="c1", state=b"s", blobs={"k\ud800": b"v"}
        ),
        "blob key",
    ),
    "commit write": (
        lambda r, run: r.commit(
            run_id=run,
            checkpoint_id="c2",
            parent_id="c1",
            state=b"s",
            writes=[_write(run, "c2", task_id="t\ud800")],
        ),
        "task_id",
    ),
}


@pytest.mark.parametrize("name", list(SURROGATES))
def test_a_lone_surrogate_in_a_write_or_blob_key_is_refused_alike_naming_the_field(
    store_url: str, run_id: str, name: str
) -> None:
    """SQLite and PostgreSQL raised the encoder's `UnicodeEncodeError` (naming no
    field); Redis stored a surrogate channel and task path, which the SQL engines
    cannot hold."""
    call, field = SURROGATES[name]
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    before = _snapshot(remit, run_id)
    with pytest.raises(ValueError, match=rf"^{field} must be valid Unicode text"):
        call(remit, run_id)
    assert _snapshot(remit, run_id) == before


def test_a_fork_commit_refused_for_its_metadata_leaves_no_branch(
    store_url: str, run_id: str
) -> None:
    """The metadata is encoded by the store with the checkpoint; a fork's branch was
    created before that and stayed when the encoding failed."""
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1")
    remit.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"2")
    before = _snapshot(remit, run_id)
    with pytest.raises(TypeError, match="builtins.object"):
        remit.commit(
            run_id=run_id,
            checkpoint_id="f1",
            parent_id="c1",
            state=b"f",
            fork_token="second-opinion",
            metadata={"by": object()},
        )
    assert _snapshot(remit, run_id) == before
    assert remit.fork_branch(run_id, "second-opinion") is None
    # The token is still free: the same fork with plain metadata makes its one branch.
    fork = remit.commit(
        run_id=run_id,
        checkpoint_id="f1",
        parent_id="c1",
        state=b"f",
        fork_token="second-opinion",
        metadata={"by": "bob"},
    )
    made = remit.fork_branch(run_id, "second-opinion")
    assert made is not None and (made.branch, made.head_id) == (fork.branch, "f1")


# -- corrupt records ---------------------------------------------------------------


@pytest.mark.parametrize("text", ["5", "[1, 2]", '"x"', "null", "[]"])
def test_stored_metadata_that_is_not_a_mapping_is_corrupt_record_naming_the_checkpoint(
    store_url: str, run_id: str, text: str
) -> None:
    """A commit stores a mapping; read back as anything else it raised the `TypeError`
    or `ValueError` of `dict()` (or read as {} for null and [])."""
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1", metadata={"a": 1})
    _set_metadata(remit, run_id, "c1", text)
    reader = Remit(store_url)  # (nothing remembered from the commit)
    for read in (
        lambda: reader.head(run_id),
        lambda: reader.checkpoint(run_id, "c1"),
        lambda: reader.history(run_id),
    ):
        with pytest.raises(CorruptRecord, match="not a mapping") as err:
            read()
        assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c1")


def test_a_claim_at_head_whose_head_fails_to_decode_in_the_store_is_given_up(
    store_url: str, run_id: str
) -> None:
    """The store takes the claim and reads the head in one go; when the head's metadata
    (or on Redis its header) fails to decode there, the claim was left held, with no
    heartbeat, and no resumer could take the run until its lease ran out."""
    remit = Remit(store_url, lease=600.0)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1", metadata={"a": 1})
    _set_metadata(remit, run_id, "c1", "7")
    with pytest.raises(CorruptRecord) as err:
        remit.claim_at_head(run_id)
    assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c1")
    after = remit.store.get_claim(run_id, MAIN_BRANCH)
    assert after is not None and after.holder == ""
    other = Remit(store_url).claim(run_id, heartbeat=False)  # another resumer, at once
    assert other.claim.fence == after.fence + 1
    other.release()


@pytest.mark.parametrize(
    "header",
    [
        b'["", "c1", "t", "0", "ch", ""]',  # idx as text: passes the value's checksum
        b'["", "c1", "t", null, "ch", ""]',
        b'["", "c1"]',
        b"[]",
    ],
)
def test_a_redis_step_write_whose_header_was_altered_is_corrupt_record(
    run_id: str, header: bytes
) -> None:
    """A header of the wrong shape raised `ValueError` (unpacking) or `TypeError`
    (`after_idx`), and an idx stored as text came back as a str."""
    from remit_core.stores.redis import _join, run_prefix

    remit = Remit(REDIS_URL)
    store: Any = remit.store
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"1")
    remit.put_writes([_write(run_id)])
    key, field = run_prefix(run_id) + "wr", _join("", "c1", "t", "0")
    raw = store._client().hget(key, field)
    store._client().hset(key, field, header + b"\n" + raw.partition(b"\n")[2])
    try:
        for read in (
            lambda: remit.writes(run_id, "c1"),
            lambda: remit.writes(run_id, "c1", after_idx=-1),
            lambda: remit.checkpoint_and_writes(run_id, "c1"),
        ):
            with pytest.raises(CorruptRecord) as err:
                read()
            assert (err.value.run_id, err.value.checkpoint_id) == (run_id, "c1")
    finally:
        remit.delete_run(run_id)


# -- URL options ---------------------------------------------------------------------


def test_a_postgres_url_option_libpq_does_not_know_is_refused_at_once_naming_it() -> None:
    """SQLite and Redis refuse an unknown option with `ValueError` when the store is
    made; PostgreSQL answered `StoreUnavailable` ("cannot reach") at first use."""
    from remit_core.stores.postgres import PostgresStore

    with pytest.raises(ValueError, match='"bogus"'):
        PostgresStore(f"{PG_URL}?bogus=1")
    with pytest.raises(ValueError, match='"aplication_name"'):
        open_store(f"{PG_URL}?aplication_name=remit")
    # libpq's own options still pass through.
    remit = Remit(f"{PG_URL}?application_name=remit-probe&connect_timeout=5")
    assert remit.history(f"run-{uuid.uuid4().hex}") == []


@pytest.mark.parametrize(
    ("url", "named"),
    [
        (f"{REDIS_URL}?decode_responses=true", "'decode_responses'"),
        (f"{REDIS_URL}?encoding=latin-1", "'encoding'"),
        (f"{REDIS_URL}?encoding_errors=replace", "'encoding_errors'"),
        ("redis://127.0.0.1:6379/zero", "database 'zero'"),
    ],
)
def test_redis_url_options_the_store_cannot_honour_are_refused_naming_them(
    url: str, named: str
) -> None:
    """With replies decoded or text encoded otherwise the store broke on its first
    read (`UnicodeDecodeError`, `TypeError`) or write; a database path that is not a
    number was ignored by redis-py, and the data went to database 0."""
    with pytest.raises(ValueError, match=named):
        open_store(url)


# -- a zombie's fork ----------------------------------------------------------------


@pytest.mark.parametrize("stopped", ["before its commit", "before its branch"])
def test_a_zombies_fenced_fork_commit_leaves_no_branch(
    store_url: str, run_id: str, stopped: str
) -> None:
    """A holder SIGSTOPped past its lease, whose claim another resumer took over,
    commits a fork when it continues: the commit is `Fenced`, and (L2) nothing of it
    is written. The fork's branch, made before the commit's fenced write, stayed, and
    bound the token to the zombie's base; then, stopped past its own checks just
    before the branch was made, it still made it: the fence was read, not held."""
    first = Remit(store_url)
    first.commit(run_id=run_id, checkpoint_id="c0", parent_id=None, state=b"0")
    first.commit(run_id=run_id, checkpoint_id="c1", parent_id="c0", state=b"1")
    report_r, report_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the zombie: never returns into pytest
        outcome = "no error"
        try:
            os.close(report_r)
            remit = Remit(store_url, lease=0.5)
            handle = remit.claim(run_id)
            if stopped == "before its commit":
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                failpoints.arm("fork.before_create", "stop")
            remit.commit(
                run_id=run_id,
                checkpoint_id="z1",
                parent_id="c0",
                state=b"z",
                fork_token="zombie",
                fence=handle.fence,
            )
        except BaseException as exc:
            outcome = type(exc).__name__
        finally:
            os.write(report_w, outcome.encode() + b"\n")
            os._exit(0)
    os.close(report_w)
    with os.fdopen(report_r) as report:
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        taker = Remit(store_url)
        deadline = time.monotonic() + 30
        while True:  # the zombie's lease runs out: one other resumer takes the run over
            try:
                handle = taker.claim(run_id, heartbeat=False)
                break
            except ResumeConflict:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        taker.commit(
            run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"2", fence=handle.fence
        )
        os.kill(pid, signal.SIGCONT)
        assert report.readline() == "Fenced\n"
    os.waitpid(pid, 0)
    assert [b.branch for b in taker.branches(run_id)] == [MAIN_BRANCH]
    assert taker.fork_branch(run_id, "zombie") is None
    assert taker.checkpoint(run_id, "z1") is None
    # The token is still free: the holder's own fork makes its one branch.
    fork = taker.commit(
        run_id=run_id,
        checkpoint_id="f1",
        parent_id="c0",
        state=b"f",
        fork_token="zombie",
        fence=handle.fence,
    )
    assert fork.branch == taker.fork_branch(run_id, "zombie").branch != MAIN_BRANCH  # type: ignore[union-attr]
    handle.release()


def test_an_id_too_long_for_a_postgres_index_is_a_value_error_and_stores_nothing() -> None:
    """An id past what a PostgreSQL index entry holds was StoreUnavailable ("store
    failed"), as if the server were down; it is bad input, and nothing is stored."""
    remit = Remit(PG_URL)
    run_id = f"run-{uuid.uuid4().hex}"
    long_id = os.urandom(1500).hex()  # (an index entry compresses repeated text)
    with pytest.raises(ValueError, match="too long") as err:
        remit.commit(run_id=run_id, checkpoint_id=long_id, parent_id=None, state=b"s")
    assert "remit_checkpoints" in str(err.value)
    assert remit.history(run_id) == []
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s")
    assert [r.checkpoint_id for r in remit.history(run_id)] == ["c1"]
