"""Outside probes of `RemitStatePersistence`: manual driving (`initialize`, `iter`,
`iter_from_persistence`, `run` mixed on one run), node and state types, and
pydantic-graph's builder `Graph`; on SQLite, PostgreSQL and Redis.

Faults found:

- A builder graph (`GraphBuilder(...).build()`, which has no persistence interface)
  handed to `set_graph_types` raised a `TypeError` whose message was the graph's whole
  mermaid diagram, and did not say that the builder API cannot be persisted. It now
  names the builder `Graph` and says to use a `BaseNode` graph
  (`pydantic_graph.graph.Graph`).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphBuilder, GraphRunContext, StepContext
from pydantic_graph.exceptions import GraphRuntimeError
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import Answer, World, drive, persistence, to_pause
from test_pydantic_graph_probes14 import raced

from remit_core import ResumeConflict
from remit_pydantic_graph import RemitStatePersistence


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- the builder API ----------------------------------------------------------------------


@dataclass
class Tally:
    seen: list[str] = field(default_factory=list)


@dataclass
class Count(BaseNode[Tally, None, int]):
    async def run(self, ctx: GraphRunContext[Tally]) -> End[int]:
        ctx.state.seen.append("count")
        return End(len(ctx.state.seen))


COUNT = Graph(nodes=(Count,))


def builder_graph() -> Any:
    """A graph of pydantic-graph's builder API: one step, no persistence interface."""
    builder = GraphBuilder(state_type=Tally, output_type=int)

    @builder.step
    async def count(ctx: StepContext[Tally, None, None]) -> int:
        ctx.state.seen.append("count")
        return len(ctx.state.seen)

    builder.add(builder.edge_from(builder.start_node).to(count))
    builder.add(builder.edge_from(count).to(builder.end_node))
    return builder.build()


def test_a_builder_graph_is_refused_saying_it_cannot_be_persisted(
    store_url: str, run_id: str
) -> None:
    """A user moving to the builder API (`GraphBuilder`) gets a clear error, never a run
    that silently stores nothing: its `Graph.run` takes no persistence, and
    `set_graph_types` refuses its graph in one line naming the builder `Graph` and the
    `BaseNode` graph to use instead. Nothing is written for the run."""
    graph = builder_graph()
    p: RemitStatePersistence[Tally, int] = RemitStatePersistence(store_url, run_id)
    with pytest.raises(TypeError, match="persistence"):
        asyncio.run(graph.run(state=Tally(), persistence=p))
    with pytest.raises(TypeError) as refused:
        p.set_graph_types(graph)
    message = str(refused.value)
    assert "\n" not in message, message
    assert "pydantic_graph.graph_builder.Graph" in message, message
    assert "BaseNode" in message and "pydantic_graph.graph.Graph" in message, message
    # The instance is still usable with a BaseNode graph, and nothing was stored.
    p.set_graph_types(COUNT)
    assert asyncio.run(p.load_all()) == []
    result = asyncio.run(COUNT.run(Count(), state=Tally(), persistence=p))
    assert result.output == 1


# -- processes racing to continue one run, the first to reach the effect killed ----------


def keep_continuing(url: str, run_id: str, world: World) -> str:
    """Continue the run with `iter_from_persistence` until it has ended: a worker that
    lost the race (`ResumeConflict`) or found the node held by a dead process tries
    again. Returns the run's result."""
    while True:
        try:
            done = asyncio.run(drive(persistence(url, run_id), world))
        except (ResumeConflict, GraphRuntimeError):
            done = None
        line = asyncio.run(persistence(url, run_id).load_all())
        if line and isinstance(line[-1], EndSnapshot):
            assert done in (None, line[-1].result.data)
            return str(line[-1].result.data)
        time.sleep(0.05)


def test_processes_racing_to_continue_a_run_whose_winner_is_killed_after_its_effect(
    store_url: str, run_id: str, world: World
) -> None:
    """P5/P2/L1/P6: an answered run is continued by three processes at once with
    `graph.iter_from_persistence`. The first to apply the charge is SIGKILLed right after
    it, holding the run; the others keep trying, and one takes the run over once the dead
    claim's lease runs out. The charge is applied once, `Answer` is not run again, and
    the run ends as an uninterrupted one does."""
    asyncio.run(to_pause(store_url, run_id, world))
    asyncio.run(persistence(store_url, run_id).resume(Answer("ann")))

    def kill_first_payer(node: str) -> None:
        if node == "pay.after_effect" and world.entered().get(node) == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    racer = World(world.folder, on_enter=kill_first_payer)
    outcomes = raced([lambda: keep_continuing(store_url, run_id, racer)] * 3)
    assert sorted(o.status for o in outcomes) == ["killed", "ok", "ok"], outcomes
    assert {o.value for o in outcomes if o.ok} == {"paid 100"}
    line = asyncio.run(persistence(store_url, run_id).load_all())
    assert [type(s.node).__name__ for s in line if isinstance(s, NodeSnapshot)] == [
        "Start",
        "Ask",
        "Answer",
        "Pay",
        "Done",
    ]
    assert line[-1].state["approved_by"] == "ann" and line[-1].state["log"] == [
        "start",
        "answer",
        "pay",
        "done",
    ]
    assert world.sink.counts() == {"charge": 1}
    entered = world.entered()
    assert entered["answer"] == 1 and entered["done"] == 1 and entered["pay"] == 2


@dataclass
class Clock:
    at: datetime.datetime | None = None


@dataclass
class StampRepeatedHour(BaseNode[Clock, None, str]):
    async def run(self, ctx: GraphRunContext[Clock]) -> End[str]:
        ctx.state.at = datetime.datetime(2021, 11, 7, 1, 30, fold=1)
        return End("stamped")


def test_a_naive_datetime_of_the_repeated_hour_is_refused_not_moved_an_hour(url: str) -> None:
    """P4: the second 01:30 of a night clocks go back (`fold=1`, what `fromtimestamp`
    gives then) is written by pydantic as its ISO form, which keeps no fold: it would read
    back as the first 01:30, an hour early, and `==` of naive values ignores the fold. The
    snapshot is refused naming the field, and nothing of it is stored."""
    from remit_core import CheckpointInvalid

    graph = Graph(nodes=[StampRepeatedHour])
    p = RemitStatePersistence(url, run_id=f"fold-{time.time_ns()}")
    with pytest.raises(CheckpointInvalid, match="state.at") as err:
        asyncio.run(graph.run(StampRepeatedHour(), state=Clock(), persistence=p))
    assert "fold=1" in str(err.value)
    assert all(not isinstance(s, EndSnapshot) for s in asyncio.run(p.load_all()))
