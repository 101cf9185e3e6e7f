"""Outside probes of `RemitStatePersistence`, round 25: the persistence API as user code
calls it (`Graph.run`, `iter`, `initialize`, `iter_from_persistence`, and the interface's
methods called directly by a custom driver); on SQLite, PostgreSQL and Redis.

Faults found:

- One instance given a second graph whose nodes have the first's names but are other
  classes (a graph built again by a factory, a module reloaded), or whose state type is
  another, kept the first graph's types: `iter_from_persistence` of the second graph ran
  the first graph's node code on the stored run, and the second graph's own nodes were
  refused as "X is not this graph's X (X)". `set_graph_types` now raises `ValueError`
  naming what differs, as it does for a graph of other node names.
- A custom driver's second `record_run` of the node it had just run (refused with
  `GraphNodeStatusError`, as pydantic-graph's own persistences refuse it) made the
  instance forget that node: its next `snapshot_node` was refused as a fork
  (`ForkWithoutIntent`), and the node's result was lost, to be run again. The refused
  call now leaves the instance as it was, and the next node is stored.
- A state that the node's own background task still changed after the node returned
  was read by the worker thread that stores the snapshot while the event loop changed
  it: the snapshot was refused with `CheckpointInvalid` ("... would read back as ...")
  and the node marked `error`, though every value in it was storable. The state is now
  copied as the call is made (as `FullStatePersistence` copies it), and that copy is
  what is checked and stored.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.exceptions import GraphNodeStatusError
from pydantic_graph.graph import Graph
from test_pydantic_graph_persistence import (
    Ask,
    Start,
    World,
    fresh,
    persistence,
)

from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- one instance, a second graph with the first's node names -----------------------------


@dataclass
class Tally:
    seen: list[str] = field(default_factory=list)


def tally_graph(tag: str) -> tuple[Graph[Tally, None, str], type[BaseNode[Tally, None, str]]]:
    """A graph of `Begin -> Hold -> End`, built anew (other classes of the same names)."""

    @dataclass
    class Hold(BaseNode[Tally, None, str]):
        async def run(self, ctx: GraphRunContext[Tally]) -> End[str]:
            ctx.state.seen.append(f"hold by {tag}")
            return End(tag)

    @dataclass
    class Begin(BaseNode[Tally, None, str]):
        async def run(self, ctx: GraphRunContext[Tally]) -> Hold:
            ctx.state.seen.append(f"begin by {tag}")
            return Hold()

    Begin.run.__annotations__["return"] = Hold
    return Graph(nodes=(Begin, Hold), name=tag), Begin


@dataclass
class OtherTally:
    seen: list[str] = field(default_factory=list)
    extra: int = 0


def test_a_second_graph_of_the_same_node_names_is_refused_naming_what_differs(
    url: str, run_id: str
) -> None:
    """P4: an instance set up for one graph, handed a graph whose nodes have the same names
    but are other classes, raises `ValueError` saying so, before anything is read or
    written: it never runs the first graph's node code under the second graph. A graph of
    the same classes (built again from them) is the same graph; one of the same classes
    with another state type is refused too."""
    first, begin = tally_graph("first")
    second, _ = tally_graph("second")

    async def go() -> None:
        p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, run_id)
        async with first.iter(begin(), state=Tally(), persistence=p) as run:
            await run.next()  # Begin ran; Hold is the run's head
        with pytest.raises(ValueError, match="other classes") as refused:
            async with second.iter_from_persistence(p) as run:
                async for _ in run:
                    pass
        assert "Begin" in str(refused.value) and "Hold" in str(refused.value)
        line = await p.load_all()
        assert [type(s.node).__name__ for s in line] == ["Begin", "Hold"]
        assert line[-1].status == "created" and line[-1].state.seen == ["begin by first"]
        # The same classes in another Graph object are the same graph; it goes on.
        again = Graph(nodes=tuple(first.get_nodes()), name="first again")
        async with again.iter_from_persistence(p) as run:
            async for _ in run:
                pass
        assert run.result is not None and run.result.output == "first"
        assert run.state.seen == ["begin by first", "hold by first"]
        retyped = Graph(nodes=tuple(first.get_nodes()), state_type=OtherTally)
        with pytest.raises(ValueError, match="state type"):
            p.set_graph_types(retyped)

    asyncio.run(go())


# -- a custom driver's refused second record_run -------------------------------------------


def test_a_refused_second_record_run_leaves_the_node_to_its_driver(
    url: str, run_id: str, world: World
) -> None:
    """P1: a custom driver runs a node with `record_run`, calls `record_run` for it a
    second time by mistake (`GraphNodeStatusError`, as pydantic-graph's own persistences
    raise), then stores the node that follows with `snapshot_node`: it is stored, and
    the node that ran is not handed out to run again."""

    async def go() -> None:
        p = persistence(url, run_id)
        start = Start()
        state = fresh()
        await p.snapshot_node(state, start)
        async with p.record_run(start.get_snapshot_id()):
            state["log"].append("start")
        with pytest.raises(GraphNodeStatusError, match="success"):
            async with p.record_run(start.get_snapshot_id()):
                raise AssertionError("a node that ran does not run again")
        await p.snapshot_node(state, Ask())
        line = await p.load_all()
        assert [(type(s.node).__name__, s.status) for s in line] == [
            ("Start", "success"),
            ("Ask", "created"),
        ]
        other = persistence(url, run_id)
        loaded = await other.load_next()
        assert loaded is not None and isinstance(loaded.node, Ask)
        assert loaded.state["log"] == ["start"]
        other.release()

    asyncio.run(go())


# -- a state its node's background task still changes ----------------------------------------


@dataclass
class Progress:
    ticks: list[int] = field(default_factory=list)
    cells: list[dict[str, int]] = field(default_factory=lambda: [{"n": i} for i in range(20_000)])


BACKGROUND: list[asyncio.Task[None]] = []


@dataclass
class Spawn(BaseNode[Progress, None, int]):
    """Leaves a task behind that keeps changing the state after the node returned."""

    async def run(self, ctx: GraphRunContext[Progress]) -> Finish:
        async def tick() -> None:
            i = 0
            while True:
                i += 1
                ctx.state.ticks.append(i)
                ctx.state.cells[i % len(ctx.state.cells)]["n"] += 1
                if len(ctx.state.ticks) > 50:
                    ctx.state.ticks.clear()
                await asyncio.sleep(0)

        BACKGROUND.append(asyncio.create_task(tick()))
        return Finish()


@dataclass
class Finish(BaseNode[Progress, None, int]):
    async def run(self, ctx: GraphRunContext[Progress]) -> End[int]:
        for task in BACKGROUND:
            task.cancel()
        return End(len(ctx.state.cells))


TICKING = Graph(nodes=(Spawn, Finish), name="ticking")


def test_a_state_changed_by_a_task_after_its_node_returned_is_stored_as_it_was(
    url: str, run_id: str
) -> None:
    """P4: a node leaves behind a task that keeps changing the run's state while the next
    snapshot is stored. The snapshot holds the state as it was when the node returned
    (as `FullStatePersistence`'s copy does): it is not refused, the node is not marked
    `error`, and the run ends."""

    async def go() -> None:
        for attempt in range(3):
            BACKGROUND.clear()
            p: RemitStatePersistence[Any, Any] = RemitStatePersistence(url, f"{run_id}-{attempt}")
            try:
                result = await TICKING.run(Spawn(), state=Progress(), persistence=p)
            finally:
                for task in BACKGROUND:
                    task.cancel()
            assert result.output == 20_000
            line = await p.load_all()
            assert [(type(s.node).__name__, s.status) for s in line[:2]] == [
                ("Spawn", "success"),
                ("Finish", "success"),
            ]
            assert len(line) == 3 and line[-1].kind == "end"

    asyncio.run(go())
