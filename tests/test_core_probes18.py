"""Probes of the core and its engines, round 18: deletes, copies and reads of a run
while other clients continue it.

- A delete of a branch head moves the head back to an older checkpoint it read
  before; a prune that deleted that checkpoint meanwhile left the head naming a
  checkpoint that is gone (the run's state lost). The move now refuses a new head
  that is not stored, in its transaction, on every engine.
- Two copies of one run to the same target at once (PostgreSQL): the second one's
  snapshot did not see the first's rows and failed with a serialization error.
- `Remit.interrupts(status=...)` with an unhashable value.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest
from conftest import PG_URL
from store_cuts import wait_blocked_by
from test_store import chain

from remit_core import MAIN_BRANCH, Remit, failpoints
from remit_core.errors import HeadMoved, UnknownRecord
from remit_core.stores import open_store
from remit_core.stores.base import Store
from remit_core.stores.postgres import PostgresStore


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def _head_is_stored(store: Store, run_id: str, branch: str = MAIN_BRANCH) -> tuple[bool, Any]:
    b = store.get_branch(run_id, "", branch)
    assert b is not None
    if b.head_id is None:
        return True, None
    return store.get_checkpoint(run_id, "", b.head_id) is not None, b.head_id


def _stopped_child(
    body: Callable[[], int], backend_of: PostgresStore | None = None
) -> tuple[int, int | None]:
    """Fork a child running `body` (its return is the exit code); wait until it
    stops at its armed failpoint. Returns its pid and, if `backend_of` is given, the
    PostgreSQL backend pid of the connection that store's next transaction uses."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            if backend_of is not None:
                with backend_of._read() as txn:
                    backend = txn.execute("SELECT pg_backend_pid()").fetchone()[0]
            else:
                backend = 0
            os.write(write_end, str(backend).encode())
            code = body()
        except BaseException:
            code = 98
        finally:
            os._exit(code)
    os.close(write_end)
    backend = int(os.read(read_end, 64))
    os.close(read_end)
    _, status = os.waitpid(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status
    return pid, (backend if backend_of is not None else None)


def _finish(pid: int) -> int:
    os.kill(pid, signal.SIGCONT)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), status
    return os.WEXITSTATUS(status)


# -- a head moved back onto a checkpoint a prune deletes ------------------------


def test_store_move_head_to_a_checkpoint_not_stored_is_refused(store_url: str, run_id: str) -> None:
    store = open_store(store_url)
    chain(store, run_id, 2)
    with pytest.raises(UnknownRecord) as caught:
        store.move_head(run_id, "", MAIN_BRANCH, expected_head="c02", new_head="gone", new_seq=1)
    assert caught.value.checkpoint_id == "gone"
    assert store.get_branch(run_id, "", MAIN_BRANCH).head_id == "c02"
    # A head that moved is still `HeadMoved` first; a stored new head still moves.
    with pytest.raises(HeadMoved):
        store.move_head(run_id, "", MAIN_BRANCH, expected_head="c01", new_head="gone", new_seq=1)
    store.move_head(run_id, "", MAIN_BRANCH, expected_head="c02", new_head="c01", new_seq=1)
    assert store.get_branch(run_id, "", MAIN_BRANCH).head_id == "c01"
    store.move_head(run_id, "", MAIN_BRANCH, expected_head="c01", new_head=None, new_seq=0)
    assert store.get_branch(run_id, "", MAIN_BRANCH).head_id is None


def test_delete_of_a_head_while_a_prune_deletes_its_predecessor_keeps_a_stored_head(
    store_url: str, run_id: str
) -> None:
    """`delete_checkpoints([head])` reads the run, then (stopped here) a prune deletes
    the older checkpoints, then the delete moves the head back onto one of them.
    Before: the head named a deleted checkpoint and the run's state was gone. Now the
    move is refused (`UnknownRecord`), the head and its checkpoint stay."""
    store = open_store(store_url)
    chain(store, run_id, 3)

    def deleter() -> int:
        remit = Remit(open_store(store_url))
        failpoints.arm("delete.before_move", "stop")
        outcome = _outcome(lambda: remit.delete_checkpoints(run_id, "", ["c03"]))
        return {"ok": 0, "UnknownRecord": 3}.get(outcome, 4)

    pid, _ = _stopped_child(deleter)
    try:
        pruned = Remit(store).prune([run_id], keep_last=1)
    finally:
        code = _finish(pid)
    assert pruned == 2
    stored, head = _head_is_stored(store, run_id)
    assert stored, f"main's head {head!r} names a deleted checkpoint"
    assert (head, code) == ("c03", 3)


def test_postgres_move_head_waits_for_a_delete_of_its_new_head_and_is_refused(
    run_id: str,
) -> None:
    """Within PostgreSQL's READ COMMITTED: a delete stopped after it read which
    checkpoints heads pin, and a head moved onto one of its doomed checkpoints at
    that moment. The move waits for the delete and is refused; no head is left
    naming a deleted checkpoint."""
    store = PostgresStore(PG_URL)
    chain(store, run_id, 3)

    child = PostgresStore(PG_URL)

    def pruner() -> int:
        failpoints.arm("delete.in_delete", "stop")
        return 0 if child.delete_checkpoints(run_id, "", ["c02"]) == 1 else 5

    pid, backend = _stopped_child(pruner, backend_of=child)
    moved: list[str] = []
    mover = threading.Thread(
        target=lambda: moved.append(
            _outcome(
                lambda: store.move_head(
                    run_id, "", MAIN_BRANCH, expected_head="c03", new_head="c02", new_seq=2
                )
            )
        )
    )
    try:
        mover.start()
        assert backend is not None
        wait_blocked_by(backend, mover)
    finally:
        code = _finish(pid)
    mover.join()
    assert code == 0
    stored, head = _head_is_stored(store, run_id)
    assert stored, f"main's head {head!r} names a deleted checkpoint"
    assert (moved, head) == (["UnknownRecord"], "c03")


# -- two copies of one run to one target at once --------------------------------


def test_postgres_two_copies_to_one_target_at_once_both_succeed(run_id: str) -> None:
    """A copy stopped inside its transaction (its checkpoints inserted, not
    committed) and a second copy of the same run to the same target (a retried
    request): the second waits for the first. Before, its snapshot predated the
    first's rows and it failed (a serialization failure); SQLite and Redis copy
    the absent records and succeed. Now it does as they do."""
    store = PostgresStore(PG_URL)
    target = f"{run_id}-copy"
    chain(store, run_id, 2)
    Remit(store).open_interrupts(run_id, {"i1": None}, checkpoint_id="c02")
    child = PostgresStore(PG_URL)

    def copier() -> int:
        failpoints.arm("copy.in_copy", "stop")
        child.copy_run(run_id, target)
        return 0

    pid, backend = _stopped_child(copier, backend_of=child)
    copied: list[str] = []
    second = threading.Thread(
        target=lambda: copied.append(_outcome(lambda: Remit(store).copy_run(run_id, target)))
    )
    try:
        second.start()
        assert backend is not None
        wait_blocked_by(backend, second)
    finally:
        code = _finish(pid)
    second.join()
    assert (code, copied) == (0, ["ok"])
    assert [c.checkpoint_id for c in store.list_checkpoints(target)] == ["c02", "c01"]
    assert store.get_branch(target, "", MAIN_BRANCH).head_id == "c02"
    assert [i.interrupt_id for i in store.list_interrupts(target)] == ["i1"]


# -- a prune while the run commits -----------------------------------------------


def test_prune_while_the_run_commits_keeps_the_newest_keep_last_of_the_line(
    store_url: str, run_id: str
) -> None:
    """`prune(keep_last=2)` lists the checkpoints (c01..c03), then (stopped here) the
    run's holder commits c04, then the prune reads the branches: main's head c04 was
    not in its list, so the walk of the newest two stopped at it and c03 was deleted.
    Now the line is read on from the new head: c03 and c04 stay."""
    store = open_store(store_url)
    chain(store, run_id, 3)

    def pruner() -> int:
        failpoints.arm("prune.after_list", "stop")
        return Remit(open_store(store_url)).prune([run_id], keep_last=2)

    pid, _ = _stopped_child(pruner)
    try:
        holder = Remit(store)
        with holder.claim(run_id) as claim:
            holder.commit(
                run_id=run_id, checkpoint_id="c04", parent_id="c03", state=b"4",
                fence=claim.fence,
            )  # fmt: skip
    finally:
        pruned = _finish(pid)
    kept = sorted(c.checkpoint_id for c in store.list_checkpoints(run_id))
    assert (kept, pruned) == (["c03", "c04"], 2)


# -- Remit.interrupts -------------------------------------------------------------


@pytest.mark.parametrize("status", [["pending"], {"pending": 1}, {"pending"}])
def test_interrupts_with_an_unhashable_status_is_a_value_error_naming_it(
    store_url: str, run_id: str, status: Any
) -> None:
    remit = Remit(open_store(store_url))
    remit.open_interrupts(run_id, {"i1": None})
    with pytest.raises(ValueError, match="status must be 'pending' or 'consumed'"):
        remit.interrupts(run_id, status=status)
    assert [i.status for i in remit.interrupts(run_id)] == ["pending"]


def test_interrupts_of_several_branches_opened_at_one_instant_are_in_one_order(
    store_url: str, run_id: str
) -> None:
    """Interrupts of two branches with the same id, opened at the same clock reading
    (a fixed or coarse clock): every engine lists them by time, id, then branch,
    not in whatever order its scan met them."""
    remit = Remit(open_store(store_url), clock=lambda: 1000.0)
    for branch in ("z", "m", "B", "a"):
        remit.open_interrupts(run_id, {"i2": None, "i1": None}, branch=branch)
    listed = [(i.interrupt_id, i.branch) for i in remit.interrupts(run_id)]
    assert listed == [(i, b) for i in ("i1", "i2") for b in ("B", "a", "m", "z")]
    pending = [(i.interrupt_id, i.branch) for i in remit.interrupts(run_id, status="pending")]
    assert pending == listed


# -- an unfenced effect intent while its run is deleted ---------------------------


def test_postgres_effect_intent_while_its_run_is_deleted_is_unknown_record(run_id: str) -> None:
    """An unfenced intent of an effect already in the ledger (a replay), stopped
    between its insert-if-absent and its read of the entry; the run is deleted
    meanwhile (nothing locks the entry for the insert that did nothing). The read
    found no row and the caller got a `TypeError` from the decoding; now it is
    `UnknownRecord` naming the run and the effect."""
    store = PostgresStore(PG_URL)
    store.begin_effect(run_id, "charge", "idem-1", now=1.0)
    child = PostgresStore(PG_URL)

    def replayer() -> int:
        failpoints.arm("effect.in_intent", "stop")
        outcome = _outcome(lambda: child.begin_effect(run_id, "charge", "idem-1", now=2.0))
        return {"ok": 0, "UnknownRecord": 3, "TypeError": 4}.get(outcome, 5)

    pid, _ = _stopped_child(replayer, backend_of=child)
    try:
        store.delete_run(run_id)
    finally:
        code = _finish(pid)
    assert code == 3
    assert store.get_effect(run_id, "charge") is None


# -- an unfenced commit while its run is deleted ----------------------------------


def test_postgres_commit_while_its_run_is_deleted_leaves_no_checkpoint(run_id: str) -> None:
    """A delete of a run stopped after it deleted the run's checkpoints, and an
    unfenced commit of the next checkpoint at that moment. Before, the commit moved
    the head (the branch row was not yet deleted) and its checkpoint outlived the
    delete, a checkpoint of a run that no longer exists. Now the delete holds the
    run's branches from its start: the commit waits, then finds no head to move
    (`HeadMoved`), and nothing of the run is left."""
    store = PostgresStore(PG_URL)
    chain(store, run_id, 3)
    child = PostgresStore(PG_URL)

    def deleter() -> int:
        failpoints.arm("delete.in_delete", "stop")
        child.delete_run(run_id)
        return 0

    pid, backend = _stopped_child(deleter, backend_of=child)
    committed: list[str] = []
    commit = threading.Thread(
        target=lambda: committed.append(
            _outcome(
                lambda: Remit(store).commit(
                    run_id=run_id, checkpoint_id="c04", parent_id="c03", state=b"4"
                )
            )
        )
    )
    try:
        commit.start()
        assert backend is not None
        wait_blocked_by(backend, commit)
    finally:
        code = _finish(pid)
    commit.join()
    assert code == 0
    left = [c.checkpoint_id for c in store.list_checkpoints(run_id)]
    assert (left, store.list_branches(run_id), committed) == ([], [], ["HeadMoved"])
