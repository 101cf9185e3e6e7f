"""Outside probes of `RemitStatePersistence`, round 12: two graphs sharing one store and
one run id space, nodes cancelled around their effects and continued by the same
instance, and several runs driven at once in one event loop, on SQLite, PostgreSQL and
Redis.

- P4: a graph read another graph's run by its head node alone. A run whose head is a
  node both graphs have by name (a `Start`) was continued by the other graph: it ran
  its own nodes on that run and wrote them into it, and the run's own graph could not
  read it any more (`VersionMismatch` at the intruder's node). `fork()` made a branch
  there too, and a run that had ended was read by the other graph as ended (`load_next`
  None, so `iter_from_persistence` failed with a bare `GraphRuntimeError`). Each
  snapshot records its graph's nodes now; under the same workflow version, a graph
  that lacks some of them and has nodes they lack refuses it (`VersionMismatch`
  naming them), while a graph that only gained a node (a new version rolled out
  beside the old) reads the runs of the one before, and the old one reads its own.
- P1 / P2 (documents): a node cancelled while its effect is in flight, or after it,
  is given back; the same instance continues the run, the effect is applied once and
  every stored state is the state its node left (a state object mutated in place).
- P2 / isolation (documents): eight runs driven at once in one event loop on one URL,
  and on one shared `Remit`, each apply their effect once under their own key.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import test_pydantic_graph_persistence as order
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import World, drive, fresh, persistence, statuses

from remit_core import Remit, VersionMismatch, arun_effect
from remit_core.conformance.world import current_run
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- two graphs in one store: a node of the same name ----------------------------------------


@dataclass
class Start(BaseNode[order.Order, World, str]):
    """The intake graph's first node: of the same name as the order graph's `Start`."""

    async def run(self, ctx: GraphRunContext[order.Order, World]) -> Note:
        ctx.deps.enter("intake.start")
        ctx.state["log"].append("intake")
        return Note()


@dataclass
class Note(BaseNode[order.Order, World, str]):
    async def run(self, ctx: GraphRunContext[order.Order, World]) -> End[str]:
        ctx.deps.enter("intake.note")
        return End("noted")


INTAKE = Graph(nodes=(Start, Note), name="intake")


def intake(url: str, run_id: str) -> RemitStatePersistence[order.Order, str]:
    p: RemitStatePersistence[order.Order, str] = RemitStatePersistence(url, run_id, lease=LEASE)
    p.set_graph_types(INTAKE)
    return p


async def finish_intake(p: RemitStatePersistence[order.Order, str]) -> Any:
    async with INTAKE.iter_from_persistence(p, deps=None) as run:
        async for _ in run:
            pass
    return run.result.output if run.result else None


def test_another_graph_with_a_node_of_the_same_name_does_not_take_a_run_over(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: the order graph's run, initialized at its `Start`, is read by the intake graph
    (whose first node is also called `Start`): continuing it, reading it and forking it
    raise `VersionMismatch` naming the nodes the intake graph lacks; no intake node runs,
    nothing is written, the fork token stays unused, and the order graph still runs its
    own run to its pause."""

    async def init() -> str:
        p = persistence(store_url, run_id)
        await order.GRAPH.initialize(order.Start(), p, state=fresh())
        (first,) = await p.load_all()
        return first.id

    first = asyncio.run(init())

    def refused(call: Any) -> VersionMismatch:
        with pytest.raises(VersionMismatch) as caught:
            asyncio.run(call)
        assert caught.value.run_id == run_id and caught.value.checkpoint_id == first
        assert "Ask" in str(caught.value) and "Pay" in str(caught.value)
        return caught.value

    refused(finish_intake(intake(store_url, run_id)))
    refused(intake(store_url, run_id).load_all())
    refused(INTAKE.run(Start(), state=fresh(), deps=world, persistence=intake(store_url, run_id)))
    refused(intake(store_url, run_id).fork(first, "intake-fork"))

    store = persistence(store_url, run_id).remit
    assert store.fork_branch(run_id, "intake-fork") is None  # the token is unused
    assert not any(name.startswith("intake") for name in world.entered())
    history = asyncio.run(persistence(store_url, run_id).load_all())
    assert [s.id for s in history] == [first] and statuses(history) == ["created"]
    assert asyncio.run(drive(persistence(store_url, run_id), world)) == "paused"
    assert world.entered() == {"start": 1}


def test_a_graph_does_not_read_another_graphs_ended_run_as_its_own(
    store_url: str, run_id: str, world: World
) -> None:
    """P4: the intake graph's ended run, read by the order graph (which has a `Start`
    too, not `Note`), is refused with `VersionMismatch` naming `Note`, not taken for an
    ended run of its own (`load_next` None, a bare `GraphRuntimeError`)."""
    done = asyncio.run(
        INTAKE.run(Start(), state=fresh(), deps=world, persistence=intake(store_url, run_id))
    )
    assert done.output == "noted"

    async def continued() -> Any:
        return await drive(persistence(store_url, run_id), world)

    for call in (
        continued(),
        persistence(store_url, run_id).load_next(),
        drive(persistence(store_url, run_id), world, order.Start()),
    ):
        try:
            asyncio.run(call)
        except VersionMismatch as exc:
            assert "Note" in str(exc) and exc.run_id == run_id
        except GraphRuntimeError as exc:
            pytest.fail(f"read as an ended run of the order graph: {exc}")
        else:
            pytest.fail("the order graph read the intake graph's run")
    history = asyncio.run(intake(store_url, run_id).load_all())
    assert [type(s.node).__name__ for s in history] == ["Start", "Note", "End"]
    assert isinstance(history[-1], EndSnapshot) and history[-1].result.data == "noted"
    assert "start" not in world.entered()


GRAPH_PLUS = Graph(
    nodes=(order.Start, order.Ask, order.Answer, order.Pay, order.Done, Note), name="order+"
)


def test_a_graph_that_gained_a_node_continues_the_runs_of_the_one_before(
    store_url: str, run_id: str, world: World
) -> None:
    """A graph of the order graph's nodes and one more (a new version that added a node,
    under the same workflow version) answers and finishes the order graph's paused run:
    the refusals above are for another graph, not for a version that added a node. The
    old graph reads the run the new one ended."""
    asyncio.run(order.to_pause(store_url, run_id, world))

    async def finish() -> Any:
        p: RemitStatePersistence[order.Order, str] = RemitStatePersistence(
            store_url, run_id, lease=LEASE
        )
        p.set_graph_types(GRAPH_PLUS)
        await p.resume(order.Answer("ann"))
        async with GRAPH_PLUS.iter_from_persistence(p, deps=world) as run:
            async for _ in run:
                pass
        return run.result.output if run.result else None

    assert asyncio.run(finish()) == "paid 100"
    history = asyncio.run(persistence(store_url, run_id).load_all())  # the old graph reads it
    assert isinstance(history[-1], EndSnapshot) and history[-1].state["approved_by"] == "ann"
    assert world.sink.counts() == {"charge": 1}


# -- a node cancelled around its effect, continued by the same instance ----------------------


@dataclass
class Tally:
    """A state the nodes change in place."""

    n: int = 0
    seen: list[str] = field(default_factory=list)


TCtx = GraphRunContext[Tally, World]


@dataclass
class One(BaseNode[Tally, World, int]):
    async def run(self, ctx: TCtx) -> Two:
        ctx.deps.enter("one")
        ctx.state.n += 1
        ctx.state.seen.append("one")
        return Two()


#: Where `Two` waits to be cancelled ("apply": inside its effect, "after": past it).
hold_at: dict[str, asyncio.Event] = {}


@dataclass
class Two(BaseNode[Tally, World, int]):
    async def run(self, ctx: TCtx) -> Three:
        ctx.deps.enter("two")
        ctx.state.n += 10
        ctx.state.seen.append("two")
        sink = ctx.deps.sink

        async def apply(key: str) -> str:
            ctx.deps.journal.record("apply", key)
            if "apply" in hold_at:
                hold_at.pop("apply").set()
                await asyncio.sleep(120)  # the call to the outside world, in flight
            return sink.apply("charge", key)

        await arun_effect("charge", apply, reconcile=sink.reconcile)
        if "after" in hold_at:
            hold_at.pop("after").set()
            await asyncio.sleep(120)
        return Three()


@dataclass
class Three(BaseNode[Tally, World, int]):
    async def run(self, ctx: TCtx) -> End[int]:
        ctx.deps.enter("three")
        ctx.state.n += 100
        ctx.state.seen.append("three")
        return End(ctx.state.n)


TALLY = Graph(nodes=(One, Two, Three), name="tally")


def tally(url: str, run_id: str, remit: Remit | None = None) -> RemitStatePersistence[Tally, int]:
    p: RemitStatePersistence[Tally, int] = RemitStatePersistence(
        remit if remit is not None else url, run_id, lease=30.0
    )
    p.set_graph_types(TALLY)
    return p


@pytest.mark.parametrize("where", ["apply", "after"])
def test_a_node_cancelled_around_its_effect_is_continued_by_the_same_instance(
    store_url: str, run_id: str, world: World, where: str
) -> None:
    """P1/P2: `Two` is cancelled while its effect's call is in flight, or after the effect
    was applied. The node is given back at once (a 30 s lease: no wait), the same instance
    continues the run with `iter_from_persistence`: `One` is not run again, the effect is
    applied once, and every stored state is the state its node left, not the state the
    cancelled node had half changed in memory."""

    async def go() -> tuple[list[Any], Any]:
        p = tally(store_url, run_id)
        held = hold_at[where] = asyncio.Event()
        task = asyncio.create_task(TALLY.run(One(), state=Tally(), deps=world, persistence=p))
        await asyncio.wait_for(held.wait(), 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        before = await p.load_all()
        async with TALLY.iter_from_persistence(p, deps=world) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == 111
        return before, await tally(store_url, run_id).load_all()

    try:
        before, after = asyncio.run(go())
    finally:
        hold_at.clear()
    assert statuses(before) == ["success", "created"]
    assert [s.state for s in before] == [Tally(), Tally(1, ["one"])]
    assert statuses(after) == ["success", "success", "success", "end"]
    assert [s.state.n for s in after] == [0, 1, 11, 111]
    assert after[-1].state.seen == ["one", "two", "three"]
    assert world.entered() == {"one": 1, "two": 2, "three": 1}
    assert world.sink.counts() == {"charge": 1}
    (key,) = {e.name for e in world.journal.entries() if e.kind == "apply"}
    assert [e.kind for e in world.journal.entries()].count("apply") == (
        2 if where == "apply" else 1
    )
    assert world.sink.happened(key)


# -- several runs at once in one event loop -------------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["url", "one-remit"])
def test_runs_driven_at_once_in_one_event_loop_keep_to_themselves(
    store_url: str, world: World, shared: bool
) -> None:
    """Isolation / P2: eight runs of one graph driven at once in one event loop, each
    with its own instance on one store URL (or on one `Remit` they share): each ends
    with its own states, each applies its effect once, under a key of its own."""
    run_ids = [f"conc-{i}-{uuid.uuid4().hex}" for i in range(8)]

    async def go() -> list[Any]:
        remit = Remit(store_url) if shared else None

        async def one(run_id: str) -> Any:
            current_run.set(run_id)
            result = await TALLY.run(
                One(), state=Tally(), deps=world, persistence=tally(store_url, run_id, remit)
            )
            return result.output

        return list(await asyncio.wait_for(asyncio.gather(*map(one, run_ids)), 120))

    assert asyncio.run(go()) == [111] * 8
    for run_id in run_ids:
        history = asyncio.run(tally(store_url, run_id).load_all())
        assert statuses(history) == ["success", "success", "success", "end"]
        assert [s.state.n for s in history] == [0, 1, 11, 111]
        assert all(isinstance(s, NodeSnapshot) for s in history[:-1])
        assert world.sink.counts(run=run_id) == {"charge": 1}
        assert world.journal.entered(run=run_id) == {"one": 1, "two": 1, "three": 1}
    keys = [key for _, key, _ in world.sink.applications()]
    assert len(keys) == len(set(keys)) == 8
