"""Outside probes of `RemitStatePersistence`, round 21; on SQLite, PostgreSQL and Redis.

- P1 / P5: a copy of an instance (`copy.copy`, `copy.deepcopy`) shared the original's
  claim and loaded node: driving one run from both, the copy ran the node the original
  was running (the node ran twice), and the original then failed with a bare
  `AssertionError`. A copy is now another resumer of the same run, with a claim of its
  own, and gets `ResumeConflict`; pickling one raises a `TypeError` saying what to do.
- Errors: `record_run("")` and `record_run(None)` named the bad argument `checkpoint_id`,
  which pydantic-graph's interface has not; they name `snapshot_id` now.
- Errors: `resume()` with a node the pause does not lead to said the pause "leads only
  to" its node successors, also for a pause that may end the run; it says "or End" now.
"""

from __future__ import annotations

import asyncio
import copy
import pickle
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest
from pydantic_graph import BaseNode, Edge, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_pydantic_graph import RemitStatePersistence


def fresh_run() -> str:
    return f"pg21-{uuid.uuid4().hex}"


# -- a copy of an instance is a resumer of its own -------------------------------------------


@dataclass
class Book:
    entered: list[str] = field(default_factory=list)


@dataclass
class Gate:
    """Events the node `Work` sets (it is inside) and waits on (go on), on its first entry,
    and its entries (deps are not stored: they count every run of it)."""

    inside: asyncio.Event
    go: asyncio.Event
    entries: list[str] = field(default_factory=list)


@dataclass
class Open(BaseNode[Book, Gate, int]):
    async def run(self, ctx: GraphRunContext[Book, Gate]) -> Work:
        ctx.state.entered.append("open")
        return Work()


@dataclass
class Work(BaseNode[Book, Gate, int]):
    async def run(self, ctx: GraphRunContext[Book, Gate]) -> End[int]:
        ctx.state.entered.append("work")
        ctx.deps.entries.append("work")
        if not ctx.deps.inside.is_set():
            ctx.deps.inside.set()
            await ctx.deps.go.wait()
        return End(len(ctx.state.entered))


copy_graph = Graph(nodes=(Open, Work))


async def drive(p: RemitStatePersistence[Any, Any], gate: Gate) -> str:
    try:
        async with copy_graph.iter_from_persistence(p, deps=gate) as run:
            async for _ in run:
                pass
    except Exception as exc:
        return type(exc).__name__
    return "done"


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_a_copy_of_an_instance_is_a_resumer_of_its_own(
    url: str, copier: Callable[[Any], Any]
) -> None:
    async def scenario() -> tuple[list[str], list[str], list[tuple[str, str]]]:
        run_id = fresh_run()
        gate = Gate(asyncio.Event(), asyncio.Event())
        p = persistence(url, run_id, copy_graph)
        async with copy_graph.iter(Open(), state=Book(), deps=gate, persistence=p) as run:
            async for node in run:
                if isinstance(node, Work):
                    break  # stopped before Work: stored, nothing held
        other = copier(p)

        async def second() -> str:
            await gate.inside.wait()  # the original runs Work now
            try:
                return await drive(other, gate)
            finally:
                gate.go.set()

        results = await asyncio.gather(drive(p, gate), second())
        line = await other.load_all()  # the copy reads the run with the original's types
        return list(results), gate.entries, shape(line)

    results, worked, line = asyncio.run(scenario())
    assert results == ["done", "ResumeConflict"]
    assert worked == ["work"]
    assert line == [("Open", "success"), ("Work", "success"), ("End", "end")]


def test_a_pickled_instance_says_to_make_one_in_the_other_process(url: str) -> None:
    p = persistence(url, fresh_run(), copy_graph)
    with pytest.raises(TypeError, match=r"cannot be pickled.*same url and run_id"):
        pickle.dumps(p)


# -- record_run names its own argument ---------------------------------------------------------


@pytest.mark.parametrize(("bad", "error"), [("", ValueError), (None, TypeError)])
def test_record_run_of_a_bad_snapshot_id_names_snapshot_id(
    url: str, bad: object, error: type[Exception]
) -> None:
    async def scenario() -> tuple[str, list[tuple[str, str]], list[tuple[str, str]], int]:
        gate = Gate(asyncio.Event(), asyncio.Event())
        gate.inside.set()
        p = persistence(url, fresh_run(), copy_graph)
        async with copy_graph.iter(Open(), state=Book(), deps=gate, persistence=p) as run:
            async for node in run:
                if isinstance(node, Work):
                    break
        before = shape(await p.load_all())
        with pytest.raises(error) as refused:
            async with p.record_run(bad):  # type: ignore[arg-type]
                pass
        after = shape(await p.load_all())
        async with copy_graph.iter_from_persistence(p, deps=gate) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return str(refused.value), before, after, run.result.output

    message, before, after, output = asyncio.run(scenario())
    assert message.startswith("snapshot_id must")
    assert before == after == [("Open", "success"), ("Work", "created")]
    assert output == 2


# -- resume() says a pause may also end the run --------------------------------------------------


@dataclass
class Ask(BaseNode[Book, None, str]):
    async def run(
        self, ctx: GraphRunContext[Book]
    ) -> Annotated[Yes, Edge(label="yes")] | Annotated[End[str], Edge(label="no")]:
        raise RuntimeError("answered with persistence.resume(Yes())")


@dataclass
class Yes(BaseNode[Book, None, str]):
    async def run(self, ctx: GraphRunContext[Book]) -> End[str]:
        return End("yes")


@dataclass
class Elsewhere(BaseNode[Book, None, str]):
    async def run(self, ctx: GraphRunContext[Book]) -> Ask:
        return Ask()


ask_graph = Graph(nodes=(Elsewhere, Ask, Yes))


def test_a_wrong_answer_to_a_pause_that_may_end_says_so(url: str) -> None:
    async def scenario() -> tuple[str, str | None]:
        run_id = fresh_run()
        p = persistence(url, run_id, ask_graph)
        async with ask_graph.iter(Elsewhere(), state=Book(), persistence=p) as run:
            async for node in run:
                if isinstance(node, Ask):
                    break
        answering = persistence(url, run_id, ask_graph)
        with pytest.raises(ValueError) as refused:
            await answering.resume(Elsewhere())
        paused = await answering.paused()
        await answering.resume(Yes())
        async with ask_graph.iter_from_persistence(answering) as run:
            async for _ in run:
                pass
        assert paused is not None and isinstance(paused.node, Ask)
        return str(refused.value), None if run.result is None else run.result.output

    message, output = asyncio.run(scenario())
    assert "leads only to Yes or End" in message
    assert "still paused" in message
    assert output == "yes"
