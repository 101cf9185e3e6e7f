"""Outside probes of `RemitStatePersistence`, round 20; on SQLite, PostgreSQL and Redis, in
real forked processes where the item is about them.

- L3 / P3: a fork made with a token (running an old snapshot again with
  `graph.iter(old.node, ...)`, or starting a node on a run that has a head) first took the
  claim of the line it left. While that line's driver ran a node (its claim heartbeated),
  the fork got `ResumeConflict`, saying to retry once a lease expires that never would; and
  a fork in progress held the other line's resumers off. A fork is now made from a read and
  claimed on its own branch only.
- P5 / errors: the paused node itself, filled in and sent back as its answer (a pause that
  may lead to itself), got `ResumeConflict` saying the answer "was taken already": a client
  that takes that as "answered by someone else" dropped the answer while the run stayed
  paused. It is a `ValueError` now, saying to build a new node; nothing is stored.
- P4 / errors: a value that holds itself (a list appended to itself, a state in its own
  field) was refused at a path 31 steps deep (`state.items.0.0.0...`), naming no value the
  user has. It is refused where the cycle closes (`state.items.0`), naming what it holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph_parts import persistence, shape

from remit_core import CheckpointInvalid
from remit_core.conformance.processes import fork, reap


def fresh_run() -> str:
    return f"pg20-{uuid.uuid4().hex}"


# -- a fork is not held off by the line it leaves --------------------------------------------


@dataclass
class Tally:
    steps: list[str]


@dataclass
class Hand:
    """Pipes a driver's `Hold` node signals on (it is inside) and waits on (go on)."""

    inside: int
    go: int


@dataclass
class Begin(BaseNode[Tally, Hand | None, str]):
    async def run(self, ctx: GraphRunContext[Tally, Hand | None]) -> Hold:
        ctx.state.steps.append("begin")
        return Hold()


@dataclass
class Hold(BaseNode[Tally, Hand | None, str]):
    async def run(self, ctx: GraphRunContext[Tally, Hand | None]) -> End[str]:
        ctx.state.steps.append("hold")
        if ctx.deps is not None:  # the main line's driver: stay inside until told
            os.write(ctx.deps.inside, b"i")
            os.read(ctx.deps.go, 1)
        return End("+".join(ctx.state.steps))


HOLDING = Graph(nodes=(Begin, Hold), name="holding")


def test_a_fork_is_made_while_the_line_it_leaves_runs_a_node(url: str) -> None:
    run_id = fresh_run()
    inside_r, inside_w = os.pipe()
    go_r, go_w = os.pipe()

    def driver() -> str:
        p = persistence(url, run_id, HOLDING)
        hand = Hand(inside_w, go_r)
        return asyncio.run(HOLDING.run(Begin(), state=Tally([]), deps=hand, persistence=p)).output

    process = fork(driver)
    os.close(inside_w)
    try:
        assert os.read(inside_r, 1) == b"i", "the driver died before it ran Hold"
        main = persistence(url, run_id, HOLDING)
        assert shape(asyncio.run(main.load_all())) == [("Begin", "success"), ("Hold", "running")]

        async def replay() -> tuple[str, str]:
            # Time travel as a user does it: run the old snapshot again, with a token.
            again = persistence(url, run_id, HOLDING, fork_token="again")
            old = (await again.load_all())[0]
            async with HOLDING.iter(old.node, state=old.state, persistence=again) as run:
                async for _ in run:
                    pass
            assert run.result is not None
            # A new node started with a token forks the run from its head node.
            anew = persistence(url, run_id, HOLDING, fork_token="anew")
            result = await HOLDING.run(Hold(), state=Tally(["anew"]), persistence=anew)
            return run.result.output, result.output

        assert asyncio.run(replay()) == ("begin+hold", "anew+hold")
        os.write(go_w, b"g")
        done = process.wait(60)
    finally:
        reap([process])
        for end in (inside_r, go_r, go_w):
            os.close(end)
    assert done.ok and done.value == "begin+hold", done.summary()
    assert shape(asyncio.run(main.load_all())) == [
        ("Begin", "success"),
        ("Hold", "success"),
        ("End", "end"),
    ]
    forked = asyncio.run(persistence(url, run_id, HOLDING, fork_token="again").load_all())
    assert shape(forked) == [("Begin", "success"), ("Hold", "success"), ("End", "end")]
    started = asyncio.run(persistence(url, run_id, HOLDING, fork_token="anew").load_all())
    assert shape(started) == [
        ("Begin", "success"),
        ("Hold", "created"),
        ("Hold", "success"),
        ("End", "end"),
    ]


# -- the paused node sent back as its own answer -------------------------------------------


@dataclass
class Open(BaseNode[Tally, None, str]):
    async def run(self, ctx: GraphRunContext[Tally]) -> Ask:
        return Ask("ship it?")


@dataclass
class Ask(BaseNode[Tally, None, str]):
    """A pause that is answered by filling it in: it leads to itself, or to the end."""

    question: str
    reply: str | None = None

    async def run(self, ctx: GraphRunContext[Tally]) -> Ask | End[str]:
        if self.reply is None:
            raise RuntimeError("Ask waits for a reply: answer with resume(Ask(..., reply=...))")
        ctx.state.steps.append(self.reply)
        return End(self.reply)


ASKING = Graph(nodes=(Open, Ask), name="asking")


def test_the_paused_node_sent_back_as_its_answer_is_a_value_error(url: str) -> None:
    run_id = fresh_run()

    async def scenario() -> tuple[Exception, str, str]:
        p = persistence(url, run_id, ASKING)
        async with ASKING.iter(Open(), state=Tally([]), persistence=p) as run:
            async for node in run:
                if isinstance(node, Ask):
                    break
        pause = await persistence(url, run_id, ASKING).paused()
        assert pause is not None
        pause.node.reply = "yes"  # filled in, and sent back as the answer
        client = persistence(url, run_id, ASKING)
        try:
            await client.resume(pause.node, pause_id=pause.id)
        except Exception as exc:  # a ResumeConflict here says the pause is answered
            refused = exc
        else:
            raise AssertionError("the pause itself was taken as its own answer")
        still = await client.paused()
        assert still is not None and still.id == pause.id
        await client.resume(dataclasses.replace(pause.node), pause_id=pause.id)
        async with ASKING.iter_from_persistence(client) as run:
            async for _ in run:
                pass
        assert run.result is not None
        return refused, run.result.output, still.id

    refused, output, pause_id = asyncio.run(scenario())
    assert type(refused) is ValueError, repr(refused)
    assert pause_id in str(refused) and "the pause itself" in str(refused)
    assert "still paused" in str(refused)
    assert output == "yes"


# -- a value that holds itself -----------------------------------------------------------------


@dataclass
class Loose:
    items: list[Any] = field(default_factory=list)
    other: Any = None


@dataclass
class Tangle(BaseNode[Loose, None, int]):
    how: str = ""

    async def run(self, ctx: GraphRunContext[Loose]) -> End[int]:
        if self.how == "list":
            ctx.state.items.append(ctx.state.items)
        if self.how == "state":
            ctx.state.other = ctx.state
        if self.how == "dict":
            ring: dict[str, Any] = {}
            ring["next"] = {"back": ring}
            ctx.state.other = ring
        return End(1)


TANGLING = Graph(nodes=(Tangle,), name="tangling")


@pytest.mark.parametrize(
    ("how", "field_", "holder"),
    [
        ("list", "state.items.0", "state.items"),
        ("state", "state.other", "state"),
        ("dict", "state.other.next.back", "state.other"),
    ],
)
def test_a_value_that_holds_itself_is_refused_where_the_cycle_closes(
    url: str, how: str, field_: str, holder: str
) -> None:
    run_id = fresh_run()
    p = persistence(url, run_id, TANGLING)
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(TANGLING.run(Tangle(how), state=Loose(), persistence=p))
    assert refused.value.field == field_, str(refused.value)
    assert f"is {holder} itself" in str(refused.value) and "circular" in str(refused.value)
    assert shape(asyncio.run(p.load_all())) == [("Tangle", "error")]
