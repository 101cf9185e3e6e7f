"""Outside probes of `RemitStatePersistence`, round 6: objects a run hands out again.

A node that returns a shared `End` (a module constant) on a fork of a run that
ended with it; the answer of a pause given again to a fork of that pause. On
SQLite, PostgreSQL and Redis.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot

from remit_core import ResumeConflict
from remit_pydantic_graph import RemitStatePersistence

LEASE = 1.0


def make(url: str, run_id: str, graph: Graph[Any, Any, Any], **kw: Any) -> Any:
    p: RemitStatePersistence[Any, Any] = RemitStatePersistence(
        url, run_id, **{"lease": LEASE, **kw}
    )
    p.set_graph_types(graph)
    return p


async def finish(p: Any, graph: Graph[Any, Any, Any]) -> Any:
    async with graph.iter_from_persistence(p) as run:
        async for _ in run:
            pass
    assert run.result is not None
    return run.result.output


# -- a shared End, returned again on a fork ----------------------------------------------------


@dataclass
class Count:
    n: int = 0


#: One End object for every run (a module constant): its snapshot id is set once.
DONE: End[int] = End(7)


@dataclass
class Add(BaseNode[Count, None, int]):
    async def run(self, ctx: GraphRunContext[Count]) -> Close:
        ctx.state.n += 1
        return Close()


@dataclass
class Close(BaseNode[Count, None, int]):
    async def run(self, ctx: GraphRunContext[Count]) -> End[int]:
        return DONE


COUNTING = Graph(nodes=(Add, Close), name="counting")


def test_a_fork_that_returns_the_shared_end_its_main_line_ended_with_ends(
    store_url: str, run_id: str
) -> None:
    async def go() -> None:
        assert (
            await COUNTING.run(Add(), state=Count(), persistence=make(store_url, run_id, COUNTING))
        ).output == 7
        main = await make(store_url, run_id, COUNTING).load_all()
        close = main[1]
        assert isinstance(close, NodeSnapshot) and isinstance(close.node, Close)

        fork = await make(store_url, run_id, COUNTING).fork(close.id, "again")
        assert await finish(fork, COUNTING) == 7

        line = await make(store_url, run_id, COUNTING, fork_token="again").load_all()
        assert isinstance(line[-1], EndSnapshot) and line[-1].result.data == 7
        assert line[-1].id != main[-1].id
        assert [s.status for s in line if isinstance(s, NodeSnapshot)] == ["success", "success"]
        assert await make(store_url, run_id, COUNTING).load_all() == main

    asyncio.run(go())


# -- the answer of a pause, given again to a fork of that pause ---------------------------------


@dataclass
class Ticket:
    approved_by: str | None = None
    rounds: int = 0


@dataclass
class Ask(BaseNode[Ticket, None, str]):
    """The pause: drivers stop before it; the answer comes as `Approve(name)`."""

    async def run(self, ctx: GraphRunContext[Ticket]) -> Approve:
        raise AssertionError("the pause never runs")


@dataclass
class Approve(BaseNode[Ticket, None, str]):
    name: str

    async def run(self, ctx: GraphRunContext[Ticket]) -> Ask | End[str]:
        ctx.state.approved_by = self.name
        ctx.state.rounds += 1
        return Ask() if ctx.state.rounds < 2 else End(self.name)


ASKING = Graph(nodes=(Ask, Approve), name="asking")


async def to_pause(p: Any) -> None:
    async with ASKING.iter_from_persistence(p) as run:
        async for node in run:
            if isinstance(node, Ask):
                return


@pytest.mark.parametrize("answer_from", ["the same object", "the main line's history"])
def test_a_fork_of_an_answered_pause_takes_the_same_answer(
    store_url: str, run_id: str, answer_from: str
) -> None:
    async def go() -> None:
        await ASKING.initialize(Ask(), make(store_url, run_id, ASKING), state=Ticket())
        first = (await make(store_url, run_id, ASKING).load_all())[0]
        answer = Approve("alice")
        await make(store_url, run_id, ASKING).resume(answer)
        await to_pause(make(store_url, run_id, ASKING))
        main = await make(store_url, run_id, ASKING).load_all()

        # The fork of the first pause has its own pause (L3): the answer main took is
        # a new answer there, and its replay reaches the same state (P3).
        fork = await make(store_url, run_id, ASKING).fork(first.id, "replay")
        assert await fork.paused() is not None
        again = answer if answer_from == "the same object" else main[1].node
        await fork.resume(again)
        await to_pause(make(store_url, run_id, ASKING, fork_token="replay"))
        line = await make(store_url, run_id, ASKING, fork_token="replay").load_all()
        assert [type(s.node).__name__ for s in line] == ["Ask", "Approve", "Ask"]
        assert line[-1].state == main[-1].state == Ticket("alice", 1)
        assert await make(store_url, run_id, ASKING).load_all() == main

    asyncio.run(go())


def test_an_answer_on_a_forks_shared_history_is_still_refused_there(
    store_url: str, run_id: str
) -> None:
    async def go() -> None:
        await ASKING.initialize(Ask(), make(store_url, run_id, ASKING), state=Ticket())
        answer = Approve("alice")
        await make(store_url, run_id, ASKING).resume(answer)
        await to_pause(make(store_url, run_id, ASKING))
        second = (await make(store_url, run_id, ASKING).load_all())[-1]

        # Forked after the answer was taken: it is part of the fork's own history, so
        # sent again (a client's retry) it is refused there, as on the main line.
        fork = await make(store_url, run_id, ASKING).fork(second.id, "later")
        with pytest.raises(ResumeConflict, match="taken already"):
            await fork.resume(answer)
        with pytest.raises(ResumeConflict, match="taken already"):
            await make(store_url, run_id, ASKING).resume(answer)

        # Answered once on the fork, the same answer sent again to the fork is refused.
        bob = Approve("bob")
        await fork.resume(bob)
        with pytest.raises(ResumeConflict):
            await make(store_url, run_id, ASKING, fork_token="later").resume(bob)
        assert await finish(make(store_url, run_id, ASKING, fork_token="later"), ASKING) == "bob"
        assert await make(store_url, run_id, ASKING).paused() is not None

    asyncio.run(go())
