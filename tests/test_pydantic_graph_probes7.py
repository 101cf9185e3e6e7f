"""Outside probes of `RemitStatePersistence`, round 7: a task cancelled around a node.

pydantic-graph drives a node with `load_next` (or `snapshot_node_if_new`), then
`record_run` around the body, then `snapshot_node` / `snapshot_end`. A task can be
cancelled (a shutdown, `asyncio.wait_for`) as any of these calls begins, or while
its store work runs in a worker thread. A call that began runs to its end, and what
it took is then given back: another resumer continues at once (not after the
lease), and never finds the run held for good by an instance no one drives. On
SQLite, PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import End, GraphRunContext
from pydantic_graph.persistence import EndSnapshot
from test_pydantic_graph_persistence import World
from test_pydantic_graph_probes3 import CARTS, Cart, Fill, carts, finish, history, shape

from remit_core import failpoints

#: Long enough that a claim left behind fails the other resumer's call.
LONG = 30.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


async def cancelled(call: Awaitable[Any]) -> None:
    """Await `call` in a task asked to stop just before it: the stop lands at the call's
    first await."""

    async def cut() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await call

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(cut())


def test_a_node_loaded_then_cancelled_before_it_runs_is_given_back(
    store_url: str, run_id: str, world: World
) -> None:
    """Cancelled as `record_run` begins, after `load_next` handed the node out: the body
    does not run, and the node is free at once, for this instance and another."""

    async def go() -> None:
        await CARTS.initialize(Fill(), carts(store_url, run_id, lease=LONG), state=Cart())
        p = carts(store_url, run_id, lease=LONG)
        loaded = await p.load_next()
        assert loaded is not None

        async def body() -> None:
            async with p.record_run(loaded.id):
                raise AssertionError("a cancelled record_run runs no body")

        await cancelled(body())
        assert world.entered() == {}
        assert await p.load_next() is not None  # not stuck as "loaded, not yet run"
        p.release()
        assert await finish(carts(store_url, run_id, lease=LONG), world) == "shipped 100"

    asyncio.run(go())
    assert world.entered() == {"fill": 1, "ship": 1, "ship.after_effect": 1, "close": 1}


@pytest.mark.parametrize("at", ["Ship", "Close"])
def test_a_next_snapshot_cancelled_as_it_begins_is_stored_and_the_run_given_back(
    store_url: str, run_id: str, world: World, at: str
) -> None:
    """A node run as GraphRun.next runs it, then cancelled as `snapshot_node` (after
    Ship) or `snapshot_end` (after Close) begins: the call runs to its end, so the node
    is done and does not run again; another instance goes on at once."""

    async def go() -> None:
        p = carts(store_url, run_id, lease=LONG)
        async with CARTS.iter(Fill(), state=Cart(), deps=world, persistence=p) as run:
            async for node in run:
                if type(node).__name__ == at:
                    break
        loaded = await p.load_next()
        assert loaded is not None and type(loaded.node).__name__ == at
        async with p.record_run(loaded.id):
            then = await loaded.node.run(GraphRunContext(state=loaded.state, deps=world))
        if isinstance(then, End):
            await cancelled(p.snapshot_end(loaded.state, then))
            assert await carts(store_url, run_id, lease=LONG).load_next() is None
        else:
            await cancelled(p.snapshot_node(loaded.state, then))
            assert await finish(carts(store_url, run_id, lease=LONG), world) == "shipped 100"

    asyncio.run(go())
    line = history(store_url, run_id)
    assert isinstance(line[-1], EndSnapshot) and line[-1].result.data == "shipped 100"
    assert shape(line) == [
        ("Fill", "success"),
        ("Ship", "success"),
        ("Close", "success"),
        ("End", "end"),
    ]
    assert world.entered() == {"fill": 1, "ship": 1, "ship.after_effect": 1, "close": 1}
    assert world.sink.counts() == {"ship": 1}


def test_a_task_cancelled_while_its_node_is_being_claimed_does_not_hold_the_run(
    store_url: str, run_id: str, world: World
) -> None:
    """Cancelled while `record_run`'s store work is in its worker thread, taking the
    node's claim: the claim (kept alive by its heartbeat while the process lives) is
    given back once that work is done, so another instance runs the node; before,
    the run stayed `running` and held for as long as the process lived."""
    lease = 1.0

    async def go() -> None:
        await CARTS.initialize(Fill(), carts(store_url, run_id, lease=lease), state=Cart())
        p = carts(store_url, run_id, lease=lease)
        # The 1st claim is load_next's; the 2nd, record_run's, is slowed in the store.
        failpoints.arm("claim.in_acquire", "sleep:0.6@2")
        try:
            driver = asyncio.create_task(finish(p, world))
            await asyncio.sleep(0.3)
            driver.cancel()
            with pytest.raises(asyncio.CancelledError):
                await driver
        finally:
            failpoints.disarm("claim.in_acquire")
        assert world.entered() == {}
        await asyncio.sleep(lease + 0.5)  # a claim left behind would be renewed meanwhile
        assert await finish(carts(store_url, run_id, lease=lease), world) == "shipped 100"

    asyncio.run(go())
    assert world.entered() == {"fill": 1, "ship": 1, "ship.after_effect": 1, "close": 1}


# -- load_all on a fork of a fork ---------------------------------------------------------------


def test_a_fork_of_a_fork_shows_the_first_forks_base_as_that_fork_ran_it(
    store_url: str, run_id: str, world: World
) -> None:
    """Main stops before Ship; a first fork runs Ship (its base) and stops before Close; a
    second fork is made from that fork's Close. On the second fork's line, Ship is the
    node the first fork ran (`success`), not main's untouched pause (`created`)."""

    async def go() -> list[tuple[str, str]]:
        p = carts(store_url, run_id, lease=LONG)
        async with CARTS.iter(Fill(), state=Cart(), deps=world, persistence=p) as run:
            async for node in run:
                if type(node).__name__ == "Ship":
                    break
        *_, ship = await p.load_all()
        first = await p.fork(ship.id, "first")
        async with CARTS.iter_from_persistence(first, deps=world) as run:
            async for node in run:
                if type(node).__name__ == "Close":
                    break
        *_, close = await first.load_all()
        second = await first.fork(close.id, "second")
        assert shape(await carts(store_url, run_id, lease=LONG).load_all()) == [
            ("Fill", "success"),
            ("Ship", "created"),
        ]
        return shape(await second.load_all())

    assert asyncio.run(go()) == [("Fill", "success"), ("Ship", "success"), ("Close", "created")]
