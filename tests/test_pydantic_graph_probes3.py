"""Outside probes of `RemitStatePersistence`, written from the contract and pydantic-graph's
public API, on SQLite, PostgreSQL and Redis.

The graph here has a pydantic model as its state (no `validate_assignment`, so a node
can leave it invalid) and runs straight to its End, as `graph.run` users write one:
crashes and racing resumers are met with `iter_from_persistence` alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import GRAPH, World, in_child

from remit_core import (
    CheckpointInvalid,
    ForkWithoutIntent,
    HeadMoved,
    ResumeConflict,
    UnknownRecord,
    arun_effect,
)
from remit_core.conformance.processes import Barrier, fork, reap
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


class Cart(BaseModel):
    amount: int = Field(default=0, ge=0)
    steps: list[str] = Field(default_factory=list)


Ctx = GraphRunContext[Cart, World]


@dataclass
class Fill(BaseNode[Cart, World, str]):
    async def run(self, ctx: Ctx) -> Ship:
        ctx.deps.enter("fill")
        ctx.state.amount = ctx.deps.amount  # no validate_assignment: -1 gets through here
        ctx.state.steps.append("fill")
        return Ship()


@dataclass
class Ship(BaseNode[Cart, World, str]):
    async def run(self, ctx: Ctx) -> Close:
        ctx.deps.enter("ship")
        sink = ctx.deps.sink

        async def apply(key: str) -> str:
            return sink.apply("ship", key)

        await arun_effect("ship", apply, reconcile=sink.reconcile)
        ctx.deps.enter("ship.after_effect")
        ctx.state.steps.append("ship")
        return Close()


@dataclass
class Close(BaseNode[Cart, World, str]):
    async def run(self, ctx: Ctx) -> End[str]:
        ctx.deps.enter("close")
        ctx.state.steps.append("close")
        return End(f"shipped {ctx.state.amount}")


CARTS = Graph(nodes=(Fill, Ship, Close), name="carts")


@dataclass
class Elsewhere(BaseNode[Cart, World, str]):
    """A node of no graph here."""

    async def run(self, ctx: Ctx) -> End[str]:
        return End("elsewhere")


def carts(url: str, run_id: str, **kw: Any) -> RemitStatePersistence[Cart, str]:
    p: RemitStatePersistence[Cart, str] = RemitStatePersistence(
        url, run_id, **{"lease": LEASE, **kw}
    )
    p.set_graph_types(CARTS)
    return p


async def finish(p: RemitStatePersistence[Cart, str], world: World) -> str:
    """Continue the stored run to its End, as pydantic-graph's docs do."""
    async with CARTS.iter_from_persistence(p, deps=world) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return run.result.output


def history(url: str, run_id: str) -> list[Any]:
    return asyncio.run(carts(url, run_id).load_all())


def shape(snapshots: list[Any]) -> list[tuple[str, str]]:
    """Each snapshot's node (or End) and status: what a second store must agree on."""
    return [
        (type(s.node).__name__, s.status) if isinstance(s, NodeSnapshot) else ("End", "end")
        for s in snapshots
    ]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- P1 / P6: SIGKILL mid-node, recovered with iter_from_persistence ---------------------------


@pytest.mark.parametrize("where", ["ship", "ship.after_effect"])
def test_a_run_killed_mid_node_reaches_the_same_end_as_an_uninterrupted_one(
    store_url: str, run_id: str, world: World, tmp_path: Path, where: str
) -> None:
    """P1/P6/P2: killed inside Ship (before or after its effect), then its first recovery
    killed inside Close, the run is finished by a third process with plain
    iter_from_persistence: Fill never runs again, the effect applied once, and the End,
    state and history equal those of a run that was never interrupted."""
    calm = World(tmp_path / "calm")
    calm.folder.mkdir()

    async def uninterrupted() -> tuple[str, Cart]:
        result = await CARTS.run(
            Fill(), state=Cart(), deps=calm, persistence=carts(store_url, "u" + run_id)
        )
        return result.output, result.state

    expected = asyncio.run(uninterrupted())

    def first() -> None:
        world.kill_at = where
        asyncio.run(
            CARTS.run(Fill(), state=Cart(), deps=world, persistence=carts(store_url, run_id))
        )

    def recovery(kill_at: str | None) -> Any:
        world.kill_at = kill_at
        return asyncio.run(finish(carts(store_url, run_id), world))

    assert in_child(first).status == "killed"
    time.sleep(LEASE + 0.2)
    assert in_child(lambda: recovery("close")).status == "killed"
    time.sleep(LEASE + 0.2)
    done = in_child(lambda: recovery(None))
    assert done.ok and done.value == expected[0], done.summary()

    line = history(store_url, run_id)
    assert isinstance(line[-1], EndSnapshot) and line[-1].state == expected[1]
    assert shape(line) == shape(history(store_url, "u" + run_id))
    assert world.entered()["fill"] == 1 and world.entered()["close"] == 2
    assert world.sink.counts() == calm.sink.counts() == {"ship": 1}


# -- P5 / L1 / L2: racing resumers, a dead one, a stale one ------------------------------------


def initialized(url: str, run_id: str) -> None:
    asyncio.run(CARTS.initialize(Fill(), carts(url, run_id), state=Cart()))


def test_threads_racing_to_continue_one_run_run_each_node_once(
    store_url: str, run_id: str, world: World
) -> None:
    """P5: eight threads, each with its own instance, continue one initialized run at once.
    Every node body runs once, the effect applies once, one thread returns the End, and
    every other got ResumeConflict (or, coming after the End, the GraphRuntimeError
    pydantic-graph raises for a run with nothing left to load)."""
    initialized(store_url, run_id)
    gate = threading.Barrier(8)
    outcomes: list[Any] = [None] * 8

    def resumer(i: int) -> None:
        gate.wait()
        try:
            outcomes[i] = asyncio.run(finish(carts(store_url, run_id), world))
        except BaseException as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=resumer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    finished = [o for o in outcomes if o == "shipped 100"]
    others = [o for o in outcomes if o != "shipped 100"]
    assert len(finished) == 1, outcomes  # the thread that ran Close
    assert all(isinstance(o, (ResumeConflict, GraphRuntimeError)) for o in others), outcomes
    assert world.entered() == {"fill": 1, "ship": 1, "ship.after_effect": 1, "close": 1}
    assert world.sink.counts() == {"ship": 1}
    assert sum(isinstance(s, EndSnapshot) for s in history(store_url, run_id)) == 1


def test_processes_racing_for_a_node_one_runs_it(store_url: str, run_id: str, world: World) -> None:
    """P5: four processes load the same initialized node at once; one gets it, the others
    get ResumeConflict from load_next, before any body runs."""
    initialized(store_url, run_id)
    barrier = Barrier(4)

    def loader() -> str | None:
        barrier.wait()

        async def go() -> str | None:
            snapshot = await carts(store_url, run_id).load_next()
            return None if snapshot is None else snapshot.id

        return asyncio.run(go())

    workers = [fork(loader, barrier=barrier) for _ in range(4)]
    try:
        barrier.release()
        outcomes = [w.wait(60) for w in workers]
    finally:
        reap(workers)
    winners = [o for o in outcomes if o.ok]
    assert len(winners) == 1 and winners[0].value is not None, [o.summary() for o in outcomes]
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok)
    (only,) = history(store_url, run_id)
    assert only.id == winners[0].value and only.status == "pending"
    assert world.entered() == {}


def test_a_stale_resumer_cannot_write_after_a_takeover(
    store_url: str, run_id: str, world: World
) -> None:
    """L1/L2: a resumer stopped (SIGSTOP) inside Ship's body past its lease is taken over;
    the new resumer finishes the run. Continued, the stale one writes nothing: its
    effect is not applied again and its next snapshot is refused."""
    initialized(store_url, run_id)

    def stale() -> Any:
        def freeze(node: str) -> None:
            if node == "ship":
                os.kill(os.getpid(), signal.SIGSTOP)

        world.on_enter = freeze
        return asyncio.run(finish(carts(store_url, run_id), world))

    zombie = fork(stale)
    try:
        assert zombie.wait(60, stopped_counts=True).status == "stopped"
        zombie.outcome = None
        time.sleep(LEASE + 0.2)
        assert asyncio.run(finish(carts(store_url, run_id), world)) == "shipped 100"
        before = shape(history(store_url, run_id))
        zombie.cont()
        late = zombie.wait(60)
    finally:
        reap([zombie])
    assert late.raised("RemitError"), late.summary()
    assert shape(history(store_url, run_id)) == before
    assert world.sink.counts() == {"ship": 1}
    assert world.entered()["fill"] == 1 and world.entered()["close"] == 1


# -- P4: a node leaves the model state invalid ---------------------------------------------------


def test_a_node_that_leaves_the_model_state_invalid_writes_nothing(
    store_url: str, run_id: str, tmp_path: Path
) -> None:
    """P4: a pydantic model state without validate_assignment takes amount=-1 from a node;
    the next snapshot is refused with CheckpointInvalid naming state.amount, the stored
    state is the one before the node, and the run can be continued once fixed."""
    world = World(tmp_path, amount=-1)

    async def go() -> None:
        with pytest.raises(CheckpointInvalid) as bad:
            await CARTS.run(Fill(), state=Cart(), deps=world, persistence=carts(store_url, run_id))
        assert bad.value.field == "state.amount" and run_id in str(bad.value)
        (fill,) = await carts(store_url, run_id).load_all()
        assert fill.status == "error" and fill.state == Cart()
        world.amount = 7
        assert await finish(carts(store_url, run_id), world) == "shipped 7"

    asyncio.run(go())
    assert world.sink.counts() == {"ship": 1}


# -- P3: continuing from an old snapshot ------------------------------------------------------


def test_two_processes_continuing_an_old_snapshot_with_one_token_make_one_branch(
    store_url: str, run_id: str, world: World
) -> None:
    """P3: after the run ended, two processes run its Ship snapshot again with the same
    fork token at once (graph.iter from the old node). One branch is made, Ship runs on
    it once (its effect keyed under the branch), and the main line is untouched. Without
    a token the same call is ForkWithoutIntent and makes no branch."""
    asyncio.run(CARTS.run(Fill(), state=Cart(), deps=world, persistence=carts(store_url, run_id)))
    main = history(store_url, run_id)
    ship = next(s for s in main if isinstance(getattr(s, "node", None), Ship))

    async def again(**kw: Any) -> str:
        p = carts(store_url, run_id, **kw)
        async with CARTS.iter(ship.node, state=ship.state, deps=world, persistence=p) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    with pytest.raises(ForkWithoutIntent):
        asyncio.run(again())
    barrier = Barrier(2)

    def forker() -> str:
        barrier.wait()
        return asyncio.run(again(fork_token="replay-ship"))

    workers = [fork(forker, barrier=barrier) for _ in range(2)]
    try:
        barrier.release()
        outcomes = [w.wait(60) for w in workers]
    finally:
        reap(workers)
    ran = [o for o in outcomes if o.ok]
    assert len(ran) == 1 and ran[0].value == "shipped 100", [o.summary() for o in outcomes]
    assert all(o.raised("RemitError") for o in outcomes if not o.ok)
    remit = carts(store_url, run_id).remit
    assert len(remit.branches(run_id)) == 2
    assert shape(history(store_url, run_id)) == shape(main)
    forked = asyncio.run(carts(store_url, run_id, fork_token="replay-ship").load_all())
    assert shape(forked)[-3:] == [("Ship", "success"), ("Close", "success"), ("End", "end")]
    assert world.entered()["fill"] == 1 and world.entered()["ship"] == 2
    assert world.sink.counts() == {"ship": 2}  # main's, and the fork's own


def test_a_late_forker_with_the_token_leaves_the_fork_to_its_driver(
    store_url: str, run_id: str, world: World
) -> None:
    """P3, liveness: a fork's driver holds no claim between its nodes. A second process
    forking with the same token after the fork moved on gets HeadMoved from a read (it
    takes no claim), and a racer that holds the claim for a moment, only to leave, does
    not stop the driver's next node: the driver waits it out and finishes the fork."""
    asyncio.run(CARTS.run(Fill(), state=Cart(), deps=world, persistence=carts(store_url, run_id)))
    ship = next(s for s in history(store_url, run_id) if isinstance(getattr(s, "node", None), Ship))

    async def go() -> str:
        driver = carts(store_url, run_id, fork_token="late")
        async with CARTS.iter(ship.node, state=ship.state, deps=world, persistence=driver) as run:
            assert isinstance(await run.__anext__(), Ship)  # (the start node, not run yet)
            assert isinstance(await run.__anext__(), Close)  # Ship ran; between nodes now
            branch = driver.branch
            store = driver.remit.store
            before = store.get_claim(run_id, branch)
            late = carts(store_url, run_id, fork_token="late")
            with pytest.raises(HeadMoved, match="continue that branch"):
                async with CARTS.iter(
                    ship.node, state=ship.state, deps=world, persistence=late
                ) as late_run:
                    async for _ in late_run:
                        pass
            assert store.get_claim(run_id, branch) == before  # refused from a read
            racer = driver.remit.claim(run_id, branch, heartbeat=False)
            threading.Timer(0.3, racer.release).start()
            async for _ in run:
                pass
        assert run.result is not None
        return run.result.output

    assert asyncio.run(go()) == "shipped 100"
    assert world.entered()["ship"] == 2 and world.entered()["close"] == 2


# -- the interface with bad input: typed errors naming the argument, nothing written -----------


def test_interface_methods_refuse_bad_input_by_name_and_write_nothing(
    store_url: str, run_id: str, world: World
) -> None:
    """Each method of BaseStatePersistence given what it cannot take raises a TypeError,
    ValueError or Remit error naming the argument (not an AttributeError from deep inside
    pydantic-graph), and the stored run is as it was: no snapshot, no status, no claim."""
    initialized(store_url, run_id)
    p = carts(store_url, run_id)
    (start,) = history(store_url, run_id)
    cart = Cart()
    refusals: list[tuple[Any, type[Exception], str]] = [
        (lambda: p.snapshot_node(cart, "Ship"), TypeError, "next_node"),
        (lambda: p.snapshot_node(cart, None), TypeError, "next_node"),
        (lambda: p.snapshot_node(cart, Ship), TypeError, "next_node"),
        (lambda: p.snapshot_node(cart, End("x")), TypeError, "snapshot_end"),
        (lambda: p.snapshot_node(cart, Elsewhere()), CheckpointInvalid, "Elsewhere"),
        (lambda: p.snapshot_node("cart", Ship()), CheckpointInvalid, "state"),
        (lambda: p.snapshot_node_if_new(start.id, cart, "Ship"), TypeError, "next_node"),
        (lambda: p.snapshot_node_if_new(7, cart, Ship()), TypeError, "snapshot_id"),
        (lambda: p.snapshot_node_if_new("Ship:other", cart, Ship()), ValueError, "snapshot_id"),
        (lambda: p.snapshot_end(cart, "done"), TypeError, "end"),
        (lambda: p.snapshot_end(cart, None), TypeError, "end"),
        (lambda: p.snapshot_end(cart, Ship()), TypeError, "end"),
    ]

    async def go() -> None:
        for call, error, named in refusals:
            with pytest.raises(error, match=named):
                await call()
        for bad_id, error in ((7, TypeError), ("", ValueError), ("Ship:nope", UnknownRecord)):
            with pytest.raises(error, match="snapshot_id|checkpoint_id|no snapshot"):
                async with p.record_run(bad_id):  # type: ignore[arg-type]
                    raise AssertionError("a refused record_run runs no body")
        with pytest.raises(CheckpointInvalid) as foreign:
            await p.snapshot_node(cart, Elsewhere())
        assert foreign.value.field == "node" and "not a node of this graph" in str(foreign.value)
        with pytest.raises(TypeError, match="graph"):
            p.set_graph_types("carts")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="graph 'order'.* set up for a graph of Close"):
            p.set_graph_types(GRAPH)  # one instance, one graph's types
        p.set_graph_types(CARTS)  # the same graph again, as every Graph.iter call does

    asyncio.run(go())
    (after,) = history(store_url, run_id)
    assert (after.id, after.status) == (start.id, "created")
    # No claim was left behind: another instance continues the run at once.
    assert asyncio.run(finish(carts(store_url, run_id), world)) == "shipped 100"
