"""Probes of the core and its engines, round 13: a retry after a lost reply, and a
PostgreSQL server that ends the pool's idle connections.

A commit whose reply was lost (`StoreUnavailable`) may have landed; retrying it
found its parent no longer a head and raised `ForkWithoutIntent` (or `HeadMoved`)
instead of answering that it is stored. And each idle pooled PostgreSQL connection
that the server had ended failed one call before the pool replaced it.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from conftest import PG_URL

from remit_core import ForkWithoutIntent, HeadMoved, Remit
from remit_core.records import WriteRecord

# -- retrying a commit that landed -------------------------------------------------


def _commit_args(run_id: str, **changes: Any) -> dict[str, Any]:
    """A commit of "c2" after "c1", with metadata, blobs and writes."""
    args: dict[str, Any] = {
        "run_id": run_id,
        "checkpoint_id": "c2",
        "parent_id": "c1",
        "state": b"state-2",
        "metadata": {"step": 2, "by": ("node", 1), "score": float("nan")},
        "blobs": {"chan.v2": b"blob-2"},
        "writes": [WriteRecord(run_id, "c1", "task-a", 0, "chan", b"w-0")],
        "schema_version": 3,
        "workflow_version": "wf-1",
    }
    args.update(changes)
    return args


def test_retrying_a_commit_that_landed_returns_it_and_other_content_is_refused(
    store_url: str, run_id: str
) -> None:
    """The retry of a commit that landed raised `ForkWithoutIntent` (its parent was no
    longer a head): the caller could not tell its checkpoint was stored."""
    first, second = Remit(store_url), Remit(store_url)
    first.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"state-1")
    landed = first.commit(**_commit_args(run_id))
    # The same commit again, from this process and from another (its reply lost).
    for remit in (first, second, Remit(store_url)):
        again = remit.commit(**_commit_args(run_id))
        assert (again.checkpoint_id, again.branch, again.seq, again.state) == (
            "c2",
            "main",
            landed.seq,
            b"state-2",
        )
        assert again.created_at == landed.created_at  # the stored one, not a new one
    # Metadata read back in another key order is the same metadata.
    second.commit(
        **_commit_args(run_id, metadata={"score": float("nan"), "by": ("node", 1), "step": 2})
    )
    # A retry after the run moved on still finds it stored.
    second.commit(run_id=run_id, checkpoint_id="c3", parent_id="c2", state=b"state-3")
    assert second.commit(**_commit_args(run_id)).checkpoint_id == "c2"
    # Another content under the id is refused, naming the id and what differs.
    refused = {
        "state": _commit_args(run_id, state=b"other"),
        "metadata": _commit_args(run_id, metadata={"step": 3}),
        "version": _commit_args(run_id, schema_version=4),
        "blob 'chan.v2'": _commit_args(run_id, blobs={"chan.v2": b"other"}),
        "blob 'chan.v9'": _commit_args(run_id, blobs={"chan.v9": b"new"}),
        "write task-a#0": _commit_args(
            run_id, writes=[WriteRecord(run_id, "c1", "task-a", 0, "chan", b"other")]
        ),
        "write task-b#0": _commit_args(
            run_id, writes=[WriteRecord(run_id, "c1", "task-b", 0, "chan", b"w-0")]
        ),
    }
    for what, args in refused.items():
        with pytest.raises(ForkWithoutIntent, match=f"'c2' is already stored with another {what}"):
            first.commit(**args)
    # Another parent: c2's parent is c1, and c3 is a head (so the commit planned).
    with pytest.raises(HeadMoved, match=r"'c2' is already stored with another parent \('c1'\)"):
        second.commit(**_commit_args(run_id, parent_id="c3"))
    # Nothing of the refused commits was stored.
    assert [c.checkpoint_id for c in first.history(run_id)] == ["c3", "c2", "c1"]
    assert first.head(run_id).checkpoint_id == "c3"  # type: ignore[union-attr]
    assert first.blobs(run_id, ["chan.v2", "chan.v9"]) == {"chan.v2": b"blob-2"}
    assert [(w.task_id, w.value) for w in first.writes(run_id, "c1")] == [("task-a", b"w-0")]
    assert first.checkpoint(run_id, "c2").state == b"state-2"  # type: ignore[union-attr]


def test_retrying_a_fork_commit_that_landed_returns_it_and_keeps_its_branch(
    store_url: str, run_id: str
) -> None:
    """On a fork the retry raised `HeadMoved` ("fork token already made branch"); and a
    commit of the same checkpoint without the token, or under another, is no retry."""
    first, second = Remit(store_url), Remit(store_url)
    first.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    first.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s2")
    fork = {"run_id": run_id, "parent_id": "c1", "fork_token": "edit-1"}
    f1 = first.commit(checkpoint_id="f1", state=b"f1", **fork)
    assert f1.branch != "main"
    assert second.commit(checkpoint_id="f1", state=b"f1", **fork).branch == f1.branch
    # The fork's later checkpoint too, with the token or without it.
    more = {"run_id": run_id, "checkpoint_id": "f2", "parent_id": "f1", "state": b"f2"}
    f2 = first.commit(**more)
    assert f2.branch == f1.branch
    assert second.commit(**more).seq == f2.seq
    assert second.commit(**more, fork_token="edit-1").seq == f2.seq
    # The fork's first checkpoint was no plain commit after c1, nor another token's fork.
    with pytest.raises(ForkWithoutIntent, match="'f1' is already stored with another branch"):
        second.commit(run_id=run_id, checkpoint_id="f1", parent_id="c1", state=b"f1")
    with pytest.raises(HeadMoved, match="'f1' is already stored with another branch"):
        second.commit(checkpoint_id="f1", state=b"f1", **{**fork, "fork_token": "edit-2"})
    with pytest.raises(HeadMoved, match="'f1' is already stored with another state"):
        second.commit(checkpoint_id="f1", state=b"other", **fork)
    # Nothing more was stored: the fork holds its two checkpoints, main its own.
    assert {c.checkpoint_id: c.branch for c in first.history(run_id)} == {
        "f2": f1.branch,
        "f1": f1.branch,
        "c2": "main",
        "c1": "main",
    }
    assert first.head(run_id, branch=f1.branch).checkpoint_id == "f2"  # type: ignore[union-attr]
    assert first.head(run_id).checkpoint_id == "c2"  # type: ignore[union-attr]


def test_retrying_a_releasing_commit_that_landed_leaves_the_claim_released(
    store_url: str, run_id: str
) -> None:
    """A retry whose first attempt released its claim with the commit answers as the
    commit did: stored, and the claim free for another resumer at once."""
    remit = Remit(store_url)
    remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
    held = remit.claim(run_id)
    args = {"run_id": run_id, "checkpoint_id": "c2", "parent_id": "c1", "state": b"s2"}
    remit.commit(**args, fence=held.fence, release=held)
    held = remit.claim(run_id)  # (the retry of a release it has not seen)
    stored = remit.commit(**args, fence=held.fence, release=held)
    assert stored.checkpoint_id == "c2" and held.released
    Remit(store_url).claim(run_id).release()  # free: no ResumeConflict


# -- PostgreSQL connections the server ended ---------------------------------------


def _terminate(name: str) -> None:
    """End every backend whose application_name is `name`, and wait until they are gone."""
    with psycopg.connect(PG_URL, autocommit=True) as admin:
        query = "FROM pg_stat_activity WHERE application_name = %s"
        ended = admin.execute(f"SELECT pg_terminate_backend(pid) {query}", (name,)).fetchall()
        assert ended and all(row[0] for row in ended)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = admin.execute(f"SELECT count(*) {query}", (name,)).fetchone()
            if row is not None and row[0] == 0:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"backends of {name!r} still there after 30 s")
    time.sleep(1.0)  # (each backend's last bytes reach its socket as it exits)


def test_postgres_idle_connections_the_server_ended_are_replaced_before_use(
    run_id: str,
) -> None:
    """After a server restart each idle pooled connection failed one call with
    `StoreUnavailable` before the store worked again."""
    name = f"remit-ended-{uuid.uuid4().hex[:8]}"
    with Remit(f"{PG_URL}?application_name={name}&min_size=2") as remit:
        remit.commit(run_id=run_id, checkpoint_id="c1", parent_id=None, state=b"s1")
        _terminate(name)
        for _ in range(3):
            assert remit.head(run_id).checkpoint_id == "c1"  # type: ignore[union-attr]
        # Both connections in use at once, then ended again: still no call fails.
        with remit.claim(run_id):
            remit.commit(run_id=run_id, checkpoint_id="c2", parent_id="c1", state=b"s2")
        _terminate(name)
        remit.commit(run_id=run_id, checkpoint_id="c3", parent_id="c2", state=b"s3")
        assert [c.checkpoint_id for c in remit.history(run_id)] == ["c3", "c2", "c1"]
        remit.delete_run(run_id)
