"""Outside probes of `RemitStatePersistence`, round 23; on SQLite, PostgreSQL and Redis.

- Behaves worse than the framework: each `load_next()` of a node stored another `pending`
  entry in its status log, also when it was `pending` already. Workers polling a paused
  run (`iter_from_persistence`, stop at the pause, give it back) grew that log by one
  entry a poll, and every read of the snapshot reads the whole log: on SQLite a
  `load_next()` took 2 ms at the first poll and 22 ms at the 1500th, and kept growing. A
  node already `pending` is handed out again without a new entry.
- Errors: a graph whose nodes do not declare the run-end type (`BaseNode[State]`, one
  returning `End[int]`) or the state type (`BaseNode`) has it inferred as None by
  pydantic-graph, whose in-memory runs never check it. Its `End` (after the last node
  ran) or its first state was refused as "expected none, got int 42", naming no way
  out. The refusal now says the graph's type is None, where pydantic-graph takes it
  from, and how to declare it.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core import CheckpointInvalid


def fresh_run() -> str:
    return f"pg23-{uuid.uuid4().hex}"


# -- a pause polled by many workers ----------------------------------------------------------


@dataclass
class Desk:
    entered: list[str] = field(default_factory=list)


@dataclass
class Wait(BaseNode[Desk, None, int]):
    """A node workers poll: each loads it, finds it is not theirs to run yet, gives it back."""

    async def run(self, ctx: GraphRunContext[Desk]) -> End[int]:
        ctx.state.entered.append("wait")
        return End(len(ctx.state.entered))


DESK = Graph(nodes=(Wait,))


def test_a_node_loaded_by_many_polls_keeps_one_pending_entry(url: str) -> None:
    run_id = fresh_run()
    polls = 30

    async def go() -> None:
        await DESK.initialize(Wait(), persistence(url, run_id, DESK), state=Desk())
        for _ in range(polls):
            worker = persistence(url, run_id, DESK)
            async with DESK.iter_from_persistence(worker) as run:
                assert isinstance(run.next_node, Wait)  # not ours to run yet
            worker.release()
        line = await persistence(url, run_id, DESK).load_all()
        assert shape(line) == [("Wait", "pending")]
        log = persistence(url, run_id, DESK).remit.writes(run_id, line[0].id)
        assert len(log) == 1, f"{len(log)} status entries after {polls} polls"
        # The node is still handed out, and runs once.
        result = None
        async with DESK.iter_from_persistence(persistence(url, run_id, DESK)) as run:
            async for node in run:
                if isinstance(node, End):
                    result = node.data
        assert result == 1
        assert shape(await persistence(url, run_id, DESK).load_all()) == [
            ("Wait", "success"),
            ("End", "end"),
        ]

    asyncio.run(go())


# -- a graph whose types pydantic-graph inferred as None -------------------------------------


@dataclass
class Tally:
    n: int = 0


@dataclass
class Count(BaseNode[Tally]):
    """Declares the state only: pydantic-graph infers the run-end type as None."""

    async def run(self, ctx: GraphRunContext[Tally]) -> End[int]:
        ctx.state.n += 1
        return End(42)


@dataclass
class Bare(BaseNode):  # type: ignore[type-arg]
    """Declares nothing: pydantic-graph infers the state type as None."""

    async def run(self, ctx: GraphRunContext) -> End[None]:  # type: ignore[type-arg]
        return End(None)


COUNT = Graph(nodes=(Count,))
BARE = Graph(nodes=(Bare,))


def test_an_end_of_a_graph_that_declares_no_run_end_type_says_how_to_declare_it(
    url: str,
) -> None:
    run_id = fresh_run()
    assert asyncio.run(COUNT.run(Count(), state=Tally())).output == 42  # in memory: unchecked
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(COUNT.run(Count(), state=Tally(), persistence=persistence(url, run_id, COUNT)))
    assert refused.value.field == "result.data"
    message = str(refused.value)
    assert "run-end type is None" in message and "run_end_type=" in message
    assert "BaseNode[State, Deps, RunEnd]" in message
    line = asyncio.run(persistence(url, run_id, COUNT).load_all())
    assert shape(line) == [("Count", "error")]  # nothing after it; it may run again


def test_a_state_of_a_graph_that_declares_no_state_type_says_how_to_declare_it(
    url: str,
) -> None:
    run_id = fresh_run()
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(BARE.run(Bare(), state=Tally(), persistence=persistence(url, run_id, BARE)))
    assert refused.value.field == "state"
    message = str(refused.value)
    assert "state type is None" in message and "state_type=" in message
    assert asyncio.run(persistence(url, run_id, BARE).load_all()) == []


def test_a_declared_type_is_refused_without_the_hint(url: str) -> None:
    """The hint is for a type that is None only: a value of another declared type is
    refused as before."""

    @dataclass
    class Wrong(BaseNode[Tally, None, int]):
        async def run(self, ctx: GraphRunContext[Tally]) -> End[int]:
            return End("forty-two")  # type: ignore[arg-type]

    graph = Graph(nodes=(Wrong,))
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(
            graph.run(Wrong(), state=Tally(), persistence=persistence(url, fresh_run(), graph))
        )
    assert refused.value.field == "result.data" and "is None" not in str(refused.value)
