"""Round 25 of the core's probes: a claim taken the moment its last holder gives it up.

A holder's last commit moves the head and releases the claim in one transaction.
A take that arrives while that transaction is in flight waits for it, then takes
the claim; the head it starts from must be that commit's. Before: PostgreSQL's
take read the head in its statement's snapshot, from before the commit it had
waited for, so the new holder ran the finished step again from the old head (seen
in the matrix's K8-DEAD-WINNER cell: a recovery entered `notify` a second time and
was refused only at its commit).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest
from conftest import PG_URL
from store_cuts import wait_blocked_by
from test_store import chain, ckpt

from remit_core import MAIN_BRANCH, ResumeConflict, Store, open_store
from remit_core.records import Claim, FenceRef

LEASE = 60.0


def take(store: Store, run_id: str, holder: str) -> tuple[Claim, str | None]:
    claim, head, _ = store.acquire_claim_at_head(
        run_id, MAIN_BRANCH, holder, now=time.time(), lease=LEASE
    )
    return claim, None if head is None else head.checkpoint_id


def test_a_take_that_waited_for_the_releasing_commit_starts_from_it(run_id: str) -> None:
    """The releasing commit is held open (the store's commit, statement by statement,
    in one transaction) until the take is seen waiting on it, then committed."""
    store = open_store(PG_URL)
    chain(store, run_id, 2)
    first = store.acquire_claim(run_id, MAIN_BRANCH, "first", now=time.time(), lease=LEASE)
    taken: list[Any] = []
    with psycopg.connect(PG_URL) as last:
        backend = last.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        last.execute(
            "INSERT INTO remit_checkpoints SELECT run_id, ns, 'c03', branch, 'c02', 3, state, "
            "metadata, schema_version, workflow_version, created_at + 1 FROM remit_checkpoints "
            "WHERE run_id = %s AND ns = '' AND checkpoint_id = 'c02'",
            (run_id,),
        )
        last.execute(
            "UPDATE remit_branches SET head_id = 'c03', head_seq = 3 "
            "WHERE run_id = %s AND ns = '' AND branch = %s AND head_id = 'c02'",
            (run_id, MAIN_BRANCH),
        )
        released = last.execute(
            "UPDATE remit_claims SET holder = '', expires_at = 0 "
            "WHERE run_id = %s AND scope = %s AND fence = %s AND holder = 'first'",
            (run_id, MAIN_BRANCH, first.fence),
        )
        assert released.rowcount == 1
        second = threading.Thread(target=lambda: taken.append(take(store, run_id, "second")))
        second.start()
        wait_blocked_by(backend, second)
        assert second.is_alive(), taken  # it waited for the commit in flight
        last.commit()
        second.join()
    ((claim, head),) = taken
    assert (claim.holder, claim.fence) == ("second", first.fence + 1)
    assert head == "c03"


def keep_taking(
    store: Store, run_id: str, holder: str, fence: int, taken: list[tuple[Claim, str | None]]
) -> None:
    """Take at the head as `holder` until the take is a new claim (past `fence`): a
    holder that names the claim already gets it back at its fence meanwhile."""
    while not taken or taken[-1][0].fence == fence:
        try:
            taken.append(take(store, run_id, holder))
        except ResumeConflict:
            pass


@pytest.mark.parametrize("taker", ["taker", "holder"])
@pytest.mark.parametrize("rounds", [40])
def test_whoever_takes_a_released_claim_starts_from_the_releasing_commit(
    store_url: str, run_id: str, rounds: int, taker: str
) -> None:
    """Each round "holder" commits and gives the claim up in one call while another
    thread keeps taking the run at its head, as another holder or as "holder"
    itself: the take that gets a new claim starts from that commit. One that got
    the claim back at its fence came before the release (SQL: before the commit
    too; Redis releases after its commit, so either head)."""
    store = open_store(store_url)
    chain(store, run_id, 1)
    head = "c01"
    for i in range(2, rounds + 2):
        claim = store.acquire_claim(run_id, MAIN_BRANCH, "holder", now=time.time(), lease=LEASE)
        taken: list[tuple[Claim, str | None]] = []
        thread = threading.Thread(
            target=keep_taking, args=(store, run_id, taker, claim.fence, taken)
        )
        thread.start()
        cid = f"c{i:02d}"
        store.commit_checkpoint(
            ckpt(run_id, cid, head, seq=i),
            expected_head=head,
            fence=FenceRef.of(claim),
            release=claim,
        )
        thread.join()
        *before, (won, seen) = taken
        assert won.fence == claim.fence + 1
        assert seen == cid, f"round {i}: the take started from {seen}, the head is {cid}"
        assert {s for _, s in before} <= {head, cid}
        store.release_claim(won)
        head = cid
