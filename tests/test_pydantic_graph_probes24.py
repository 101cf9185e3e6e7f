"""Outside probes of `RemitStatePersistence`, round 24: crash and stall timing; on SQLite,
PostgreSQL and Redis, in real forked processes.

A run (start, pause, answer, charge, end) was SIGKILLed, and SIGSTOPped past its lease then
continued, at each hit of every store call it makes in turn (node and End commits, status
writes as `record_run` enters and exits, `load_next`'s claim, the answer's consume, an
`update_state` edit, a fork's first writes), and recovered from another process; two to four
drivers also raced `iter_from_persistence` on one run id. Completed nodes never ran again,
every effect applied once, the recovered end state was an uninterrupted run's, no run stayed
blocked past its lease, and every write of a continued zombie was refused. One fault:

- Errors: a zombie's refused write (a driver, or an `update_state` edit, paused past its
  lease while another process took the run over) raised the store's `Fenced`, "write carries
  fence 2 of holder 'host:pid:…' but the claim's current fence is 7": it named no snapshot
  and did not say that the edit, or the node's next snapshot, was not stored, nor why.
  It is still `Fenced`, and now says that the instance's claim lapsed (with its lease),
  that another resumer took the run over, what was not stored (the state edit, the next
  node, the End, a status) with its snapshot, and how to go on.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph.persistence import EndSnapshot
from test_pydantic_graph_persistence import (
    GRAPH,
    LEASE,
    Answer,
    World,
    drive,
    persistence,
    to_pause,
)

from remit_core import failpoints
from remit_core.conformance.processes import fork, reap


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def ids(url: str, run_id: str) -> list[str]:
    return [s.id for s in asyncio.run(persistence(url, run_id).load_all())]


def stopped_then_continued(work: Any, meanwhile: Any) -> Any:
    """Run `work` in a child stopped at its armed point; past its lease, run `meanwhile`
    here; then continue the child. The child's outcome, and the run's ids before it went on."""
    zombie = fork(work)
    try:
        assert zombie.wait(60, stopped_counts=True).status == "stopped"
        zombie.outcome = None
        time.sleep(LEASE + 0.5)
        before = meanwhile()
        zombie.cont()
        return zombie.wait(60), before
    finally:
        reap([zombie])


def test_an_edit_paused_past_its_lease_is_refused_saying_it_was_not_stored(
    url: str, run_id: str, world: World
) -> None:
    """L2: an operator's `update_state` is stopped right before its commit, past its lease.
    Another process edits the pause, answers it and runs the run to its end with its edit.
    Continued, the first edit is refused (`Fenced`) saying its claim lapsed and the state
    edit was not stored; the run is as the other process left it."""
    asyncio.run(to_pause(url, run_id, world))
    pause = asyncio.run(persistence(url, run_id).paused())
    assert pause is not None

    def edit() -> Any:
        failpoints.arm("checkpoint.before_commit", "stop")
        asyncio.run(
            persistence(url, run_id).update_state({**pause.state, "amount": 5}, pause_id=pause.id)
        )

    def take_over() -> list[str]:
        async def go() -> Any:
            p = persistence(url, run_id)
            await p.update_state({**pause.state, "amount": 7}, pause_id=pause.id)
            await p.resume(Answer("ann"), pause_id=pause.id)
            return await drive(persistence(url, run_id), world)

        assert asyncio.run(go()) == "paid 7"
        return ids(url, run_id)

    late, before = stopped_then_continued(edit, take_over)
    assert late.raised("Fenced"), late.summary()
    message = late.message_of("Fenced") or ""
    assert "lapsed" in message and "the state edit" in message, message
    assert "was not stored" in message and f"{LEASE:g} s" in message, message
    assert ids(url, run_id) == before
    end = asyncio.run(persistence(url, run_id).load_all())[-1]
    assert isinstance(end, EndSnapshot) and end.state["amount"] == 7
    assert world.sink.counts() == {"charge": 1}


def test_a_driver_paused_past_its_lease_is_refused_naming_the_node_not_stored(
    url: str, run_id: str, world: World
) -> None:
    """L2 / P1 / P2: a driver is stopped as it stores the node after Pay (Pay ran, charged),
    past its lease. Another process takes the run over: Pay runs again, its charge is not
    applied again, the run ends. Continued, the driver's commit is refused (`Fenced`) naming
    the node it was storing and saying it was not stored; nothing is added to the run."""
    asyncio.run(to_pause(url, run_id, world))
    asyncio.run(persistence(url, run_id).resume(Answer("ann")))

    def run_on() -> Any:
        async def go() -> Any:
            async with GRAPH.iter_from_persistence(persistence(url, run_id), deps=world) as run:
                await run.next()  # Answer
                failpoints.arm("checkpoint.before_commit", "stop")
                await run.next()  # Pay, then the commit of Done's snapshot

        asyncio.run(go())

    def take_over() -> list[str]:
        assert asyncio.run(drive(persistence(url, run_id), world)) == "paid 100"
        return ids(url, run_id)

    late, before = stopped_then_continued(run_on, take_over)
    assert late.raised("Fenced"), late.summary()
    message = late.message_of("Fenced") or ""
    assert "lapsed" in message and "the next node, Done" in message, message
    assert "was not stored" in message, message
    assert ids(url, run_id) == before
    assert world.sink.counts() == {"charge": 1}
    assert world.entered()["pay"] == 2 and world.entered()["done"] == 1
