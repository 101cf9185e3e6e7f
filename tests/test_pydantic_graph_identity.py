"""Who a claim, a stored node, an answer and a snapshot belong to, against the real
pydantic-graph 1.x on SQLite, PostgreSQL and Redis.

- A claim belongs to the `RemitStatePersistence` instance that took it, whichever
  asyncio task or event loop drives each step.
- A stored snapshot is read only by a graph that has its node.
- An answer goes to one pause: a retried answer is refused by the next pause.
- A node that returns itself gets a snapshot of its own each time it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph, GraphRun
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import (
    GRAPH,
    Answer,
    Ask,
    Order,
    Pay,
    Start,
    World,
    drive,
    fresh,
    persistence,
    to_pause,
)

from remit_core import ResumeConflict, VersionMismatch, arun_effect, policy
from remit_pydantic_graph import RemitStatePersistence

#: Long enough that a claim left behind shows as `ResumeConflict`, not as a wait.
LONG_LEASE = 30.0


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- P5 / L1: a claim belongs to the instance, not to the task that took it -----------------

Run = GraphRun[Order, World, str]
Step = Callable[[Run, Any], Awaitable[Any]]


async def _next(run: Run, node: Any) -> Any:
    return await run.next(node)


async def _in_created_task(run: Run, node: Any) -> Any:
    return await asyncio.create_task(_next(run, node))


async def _under_wait_for(run: Run, node: Any) -> Any:
    return await asyncio.wait_for(_next(run, node), 30)


def _each_step_in_its_own_task(
    p: RemitStatePersistence[Order, str], world: World, step: Step
) -> Any:
    """Load the run in one task, then run each node from another one (each
    `run_until_complete` is a task of its own), until the pause or the end."""
    loop = asyncio.new_event_loop()
    try:
        context = GRAPH.iter_from_persistence(p, deps=world)
        run = loop.run_until_complete(context.__aenter__())
        node = run.next_node
        while not isinstance(node, (Ask, End)):
            node = loop.run_until_complete(step(run, node))
        loop.run_until_complete(context.__aexit__(None, None, None))
    finally:
        loop.close()
    return "paused" if isinstance(node, Ask) else node.data


@pytest.mark.parametrize(
    "step", [_next, _in_created_task, _under_wait_for], ids=["loop", "task", "wait_for"]
)
def test_a_run_is_driven_from_any_task_of_its_instance(
    store_url: str, run_id: str, world: World, step: Step
) -> None:
    """The instance that loaded a node runs it, from whichever task drives the step; no
    claim is left behind: another instance answers at once, and the run ends free."""
    p = persistence(store_url, run_id, lease=LONG_LEASE)
    asyncio.run(GRAPH.initialize(Start(), p, state=fresh()))
    assert _each_step_in_its_own_task(p, world, step) == "paused"
    asyncio.run(persistence(store_url, run_id, lease=LONG_LEASE).resume(Answer("ann")))
    assert _each_step_in_its_own_task(p, world, step) == "paid 100"
    assert world.sink.counts() == {"charge": 1}
    assert world.entered() == {"start": 1, "answer": 1, "pay": 1, "pay.after_effect": 1, "done": 1}
    claim = p.remit.store.get_claim(run_id, "main")
    assert policy.decide_claim(claim, "another process", p.remit.clock()) == "grant_new"


# -- P4: a stored snapshot is read only by a graph that has its node --------------------------


@dataclass
class Lone(BaseNode[Order, World, str]):
    async def run(self, ctx: GraphRunContext[Order, World]) -> End[str]:
        return End("lone")


@dataclass
class Other(BaseNode[Order, World, str]):
    async def run(self, ctx: GraphRunContext[Order, World]) -> Lone:
        return Lone()


@pytest.mark.parametrize("nodes", [(Lone,), (Lone, Other)], ids=["one node", "two nodes"])
def test_a_snapshot_of_another_graphs_node_is_refused(
    store_url: str, run_id: str, world: World, nodes: tuple[type[BaseNode[Order, World, str]], ...]
) -> None:
    """A run paused at `Ask` read by a graph without `Ask` (also one whose only node
    would accept its fields) raises `VersionMismatch` naming the stored node and the
    graph's ones; nothing is loaded or run."""
    asyncio.run(to_pause(store_url, run_id, world))
    graph = Graph(nodes=nodes, name="lone")

    async def read(call: Callable[[RemitStatePersistence[Order, str]], Awaitable[Any]]) -> None:
        p: RemitStatePersistence[Order, str] = RemitStatePersistence(store_url, run_id, lease=1.0)
        p.set_graph_types(graph)
        with pytest.raises(VersionMismatch) as refused:
            await call(p)
        assert "Ask" in str(refused.value) and "Lone" in str(refused.value)
        assert refused.value.run_id == run_id and refused.value.checkpoint_id is not None

    asyncio.run(read(lambda p: p.load_all()))
    asyncio.run(read(lambda p: p.load_next()))
    assert asyncio.run(persistence(store_url, run_id).paused()) is not None  # still paused at Ask


# -- P5: an answer goes to one pause, also in a graph that pauses at one node again ----------


@dataclass
class Question(BaseNode[Order, World, str]):
    """A pause the run comes back to: each `Reply` asks again, until two were given."""

    async def run(self, ctx: GraphRunContext[Order, World]) -> Reply:
        raise AssertionError("the pause never runs")


@dataclass
class Reply(BaseNode[Order, World, str]):
    value: str

    async def run(self, ctx: GraphRunContext[Order, World]) -> Question | End[str]:
        ctx.state["log"].append(self.value)
        return Question() if len(ctx.state["log"]) < 2 else End(",".join(ctx.state["log"]))


LOOPING = Graph(nodes=(Question, Reply), name="looping")


def looping(store_url: str, run_id: str) -> RemitStatePersistence[Order, str]:
    p: RemitStatePersistence[Order, str] = RemitStatePersistence(store_url, run_id, lease=1.0)
    p.set_graph_types(LOOPING)
    return p


async def to_question(p: RemitStatePersistence[Order, str]) -> Any:
    """Continue the answered run until it pauses at `Question` again, or ends."""
    async with LOOPING.iter_from_persistence(p) as run:
        async for step in run:
            if isinstance(step, Question):
                return "paused"
    return run.result.output if run.result else None


def test_a_retried_answer_is_refused_by_the_next_pause(store_url: str, run_id: str) -> None:
    """P5: an answer sent again after it was taken (a client retrying) is not taken by
    the next pause at the same node: with the pause's id, or as the same node object, it
    raises `ResumeConflict`, stores nothing, and the run waits for its own answer."""

    async def go() -> Any:
        p = looping(store_url, run_id)
        await LOOPING.initialize(Question(), p, state=fresh())
        first = await p.paused()
        assert first is not None
        await p.resume(Reply("a"), pause_id=first.id)
        assert await to_question(p) == "paused"
        with pytest.raises(ResumeConflict, match=first.id):
            await looping(store_url, run_id).resume(Reply("a"), pause_id=first.id)
        second = await p.paused()
        assert second is not None and second.id != first.id
        answer = Reply("b")
        await p.resume(answer, pause_id=second.id)
        with pytest.raises(ResumeConflict):  # the same answer again: it was taken
            await p.resume(answer)
        return await to_question(p)

    assert asyncio.run(go()) == "a,b"
    history = asyncio.run(looping(store_url, run_id).load_all())
    assert [type(s.node).__name__ for s in history if isinstance(s, NodeSnapshot)] == [
        "Question",
        "Reply",
        "Question",
        "Reply",
    ]


def test_an_answer_for_another_pause_id_is_refused(store_url: str, run_id: str) -> None:
    """`pause_id` that is not the run's pause (unknown, or not paused) stores nothing."""

    async def go() -> None:
        p = looping(store_url, run_id)
        await LOOPING.initialize(Question(), p, state=fresh())
        with pytest.raises(ResumeConflict, match="Question:nope"):
            await p.resume(Reply("a"), pause_id="Question:nope")
        assert await p.paused() is not None

    asyncio.run(go())


# -- a node that returns itself -------------------------------------------------------------


@dataclass
class Count(BaseNode[Order, World, int]):
    """Runs again (returning itself) until it ran three times; one effect per run."""

    async def run(self, ctx: GraphRunContext[Order, World]) -> Count | End[int]:
        sink = ctx.deps.sink

        async def apply(key: str) -> str:
            return sink.apply("tick", key)

        await arun_effect("tick", apply, reconcile=sink.reconcile)
        ctx.state["log"].append("count")
        return self if len(ctx.state["log"]) < 3 else End(len(ctx.state["log"]))


COUNTING = Graph(nodes=(Count,), name="counting")


def test_a_node_that_returns_itself_runs_again_as_a_new_snapshot(
    store_url: str, run_id: str, world: World
) -> None:
    """Returning `self` is the node's next run: a snapshot with an id of its own (its
    effects keyed by it, so each run applies its own once), as with the default
    in-memory persistence; the run reaches its end."""

    async def go() -> Any:
        p: RemitStatePersistence[Order, int] = RemitStatePersistence(store_url, run_id, lease=1.0)
        result = await COUNTING.run(Count(), state=fresh(), deps=world, persistence=p)
        return result.output, await p.load_all()

    output, history = asyncio.run(go())
    assert output == 3
    assert len({s.id for s in history}) == 4 and isinstance(history[-1], EndSnapshot)
    assert [s.status for s in history[:-1]] == ["success"] * 3
    assert world.sink.counts() == {"tick": 3}


# -- P5: a driver whose next node another resumer ran ---------------------------------------


def test_a_driver_whose_next_node_another_resumer_ran_gets_resume_conflict(
    store_url: str, run_id: str, world: World
) -> None:
    """Between two nodes a driver holds no claim, so another resumer may take the run on
    and run its next node. The driver then gets `ResumeConflict`, as a racing resumer
    does, whether it stored that node or loaded it: never `ForkWithoutIntent`, whose
    advice (a fork token) would run the node, and its effects, a second time."""

    async def go() -> list[BaseException]:
        refused: list[BaseException] = []
        p = await to_pause(store_url, run_id, world)
        await p.resume(Answer("ann"))
        driver = persistence(store_url, run_id)
        async with GRAPH.iter_from_persistence(driver, deps=world) as run:
            pay = await run.next()  # Answer ran; Pay is stored as the next node
            assert isinstance(pay, Pay)
            assert await drive(persistence(store_url, run_id), world) == "paid 100"
            with pytest.raises(ResumeConflict) as taken:
                await run.next(pay)
            refused.append(taken.value)
        again = f"{run_id}-loaded"
        p = await to_pause(store_url, again, world)
        await p.resume(Answer("bob"))
        loader = persistence(store_url, again)
        async with GRAPH.iter_from_persistence(loader, deps=world) as run:
            loader.release()  # its claim lapses (a lease run out): another resumer goes on
            assert await drive(persistence(store_url, again), world) == "paid 100"
            with pytest.raises(ResumeConflict) as taken:
                await run.next()
            refused.append(taken.value)
        return refused

    refused = asyncio.run(go())
    assert all("another resumer" in str(e) for e in refused), refused
    assert world.entered() == {"start": 2, "answer": 2, "pay": 2, "pay.after_effect": 2, "done": 2}
    assert world.sink.counts() == {"charge": 2}
