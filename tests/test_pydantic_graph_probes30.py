"""Outside probes of `RemitStatePersistence`, round 30: generic models built without their
parameters in a run's state, nodes and `End`; and the persistence interface driven by
hand (`load_next`, `record_run`, `snapshot_node`, `snapshot_end`, as a custom driver
calls them) by racing processes, one SIGKILLed in its node; on SQLite, PostgreSQL and
Redis, in real forked processes where the item is about them.

Faults found:

- P4 / errors: a generic model built without its parameters (`Box(items=[...])`, where
  the field declares `Box[Item]`; a node that builds it, or a node field, or an `End`'s
  result) was refused at the wrong place with pydantic's noise: at `node`, "Unable to
  extract tag using discriminator", for one in the state or a node field, and at
  `<root>`, "expected NodeSnapshot, got EndSnapshot", for an `End`'s. pydantic writes
  such a model without a warning inside its own model's dump, so no field-by-field check
  found it, and only the whole snapshot's dump warned, first of its unions. It is
  refused at the model's path (`state.box`, `node.box`, `result.data`), saying it is
  not the class its field declares and to build it as `Box[Item](...)`.

What held: a discriminated union of look-alike models, nested generics, constrained
and normalizing `Annotated` fields (refused where they would read back as another
value), and hand-driven steps raced by processes (one takes each node, the others get
`ResumeConflict` and run nothing; a winner killed in its node is taken over after its
lease, its effect applied once).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Generic, Literal, TypeVar

import pytest
from pydantic import BaseModel, Field
from pydantic_graph import BaseNode, End, GraphRunContext
from pydantic_graph.graph import Graph
from pydantic_graph.persistence import EndSnapshot, NodeSnapshot
from test_pydantic_graph_persistence import (
    Answer,
    Done,
    Pay,
    World,
    persistence,
    to_pause,
)
from test_pydantic_graph_probes14 import raced

from remit_core import CheckpointInvalid, ResumeConflict
from remit_pydantic_graph import RemitStatePersistence

T = TypeVar("T")


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


# -- generic models built without their parameters ----------------------------------------


class Item(BaseModel):
    kind: Literal["item"] = "item"
    name: str


class Other(BaseModel):
    kind: Literal["other"] = "other"
    name: str


class Box(BaseModel, Generic[T]):
    items: list[T] = []


class Shelf(BaseModel):
    box: Box[Item] = Box[Item]()
    nested: Box[Box[Item]] = Box[Box[Item]]()
    things: list[Annotated[Item | Other, Field(discriminator="kind")]] = []
    count: Annotated[int, Field(ge=0)] = 0


@dataclass
class Fill(BaseNode[Shelf, None, Box[Item]]):
    """Leaves in the state what `how` says, then hands on to `Check` (or ends)."""

    how: str = "typed"

    async def run(self, ctx: GraphRunContext[Shelf]) -> Check | End[Box[Item]]:
        item = Item(name="a")
        if self.how == "bare-state":
            ctx.state.box = Box(items=[item])  # the field declares Box[Item]
        elif self.how == "bare-node":
            return Check(box=Box(items=[item]))
        elif self.how == "bare-end":
            return End(Box(items=[item]))
        else:
            ctx.state.box = Box[Item](items=[item])
            ctx.state.nested = Box[Box[Item]](items=[Box[Item](items=[item])])
            ctx.state.things = [Item(name="a"), Other(name="a")]
        return Check()


@dataclass
class Check(BaseNode[Shelf, None, Box[Item]]):
    box: Box[Item] = field(default_factory=Box[Item])

    async def run(self, ctx: GraphRunContext[Shelf]) -> End[Box[Item]]:
        return End(Box[Item](items=[*ctx.state.box.items, *self.box.items]))


SHELF = Graph(nodes=(Fill, Check))


@pytest.mark.parametrize(
    ("how", "where"),
    [("bare-state", "state.box"), ("bare-node", "node.box"), ("bare-end", "result.data")],
)
def test_a_generic_model_built_without_its_parameters_is_refused_at_its_path(
    url: str, run_id: str, how: str, where: str
) -> None:
    """P4 / errors: `Box(...)` where the graph declares `Box[Item]` is another class, which
    pydantic writes without a warning in its own model's dump and with one in a
    snapshot's. It is refused at its path, saying so and how to build it, never at the
    snapshot's root as an `EndSnapshot` that should have been a `NodeSnapshot`. The node
    that left it is marked `error`, nothing after it is stored, and the run goes on once
    its node leaves a typed value."""
    p: RemitStatePersistence[Shelf, Box[Item]] = RemitStatePersistence(url, run_id)
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(SHELF.run(Fill(how=how), state=Shelf(), persistence=p))
    err = refused.value
    assert err.field == where, err
    message = str(err)
    assert "NodeSnapshot" not in message and "EndSnapshot" not in message, message
    assert "Box[Item](...)" in message, message
    line = asyncio.run(p.load_all())
    assert [(type(s.node).__name__, s.status) for s in line if isinstance(s, NodeSnapshot)] == [
        ("Fill", "error")
    ]
    assert not any(isinstance(s, EndSnapshot) for s in line)


def test_look_alike_unions_and_nested_generics_read_back_as_themselves(
    url: str, run_id: str
) -> None:
    """P4: a discriminated union of models of the same fields, and a generic model inside
    a generic model, built with their parameters, are stored and read back as the very
    classes the run held; an `Annotated` bound is kept (a negative count is refused at
    `state.count`, the head unchanged)."""
    p: RemitStatePersistence[Shelf, Box[Item]] = RemitStatePersistence(url, run_id)
    result = asyncio.run(SHELF.run(Fill(), state=Shelf(), persistence=p))
    assert result.output == Box[Item](items=[Item(name="a")])
    line = asyncio.run(p.load_all())
    end = line[-1]
    assert isinstance(end, EndSnapshot)
    assert [type(t) for t in end.state.things] == [Item, Other]
    assert type(end.state.nested.items[0]) is Box[Item]
    assert type(end.result.data) is Box[Item]

    @dataclass
    class Spoil(BaseNode[Shelf, None, Box[Item]]):
        async def run(self, ctx: GraphRunContext[Shelf]) -> End[Box[Item]]:
            ctx.state.count = -1
            return End(Box[Item]())

    spoiled = f"{run_id}-spoiled"
    q: RemitStatePersistence[Shelf, Box[Item]] = RemitStatePersistence(url, spoiled)
    with pytest.raises(CheckpointInvalid) as refused:
        asyncio.run(Graph(nodes=(Spoil,)).run(Spoil(), state=Shelf(), persistence=q))
    assert refused.value.field == "state.count"
    assert [s.status for s in asyncio.run(q.load_all())] == ["error"]


# -- the interface driven by hand, raced by processes ---------------------------------------


async def hand_step(p: RemitStatePersistence[Any, str], world: World) -> str:
    """One step as a custom driver takes it: load the next node, run it under
    `record_run`, store what follows. The name of the node it ran."""
    snapshot = await p.load_next()
    assert snapshot is not None, "no node to run"
    async with p.record_run(snapshot.id):
        following = await snapshot.node.run(GraphRunContext(state=snapshot.state, deps=world))
    if isinstance(following, End):
        await p.snapshot_end(snapshot.state, following)
    else:
        await p.snapshot_node(snapshot.state, following)
    return type(snapshot.node).__name__


def test_hand_driven_steps_raced_by_processes_run_each_node_once(
    url: str, run_id: str, world: World
) -> None:
    """P5 / L1 / P2 / P1: four processes take an answered pause's next step by hand at
    once: `Answer` is run by one of them, and each node at most once (a driver holds no
    claim between nodes, so another racer may take the node after it); the others get
    `ResumeConflict` and run nothing. On a second run, `Answer` stepped, three processes
    race the `Pay` step; the one that applies the charge is SIGKILLed right after, holding
    the run, and the others get `ResumeConflict` (or, past its lease, take `Pay` over).
    A later hand step takes `Pay` over under the same snapshot id, the charge is not
    applied again, and `Done` ends the run: each node stored once, in order, `success`."""
    asyncio.run(to_pause(url, run_id, world))
    asyncio.run(persistence(url, run_id).resume(Answer("ann")))

    def step() -> str:
        return asyncio.run(hand_step(persistence(url, run_id), world))

    outcomes = raced([step] * 4)
    ran = [o.value for o in outcomes if o.ok]
    assert "Answer" in ran and len(ran) == len(set(ran)), outcomes
    assert all(o.raised("ResumeConflict") for o in outcomes if not o.ok), outcomes
    entered = world.entered()
    assert entered.get("answer") == 1 and entered.get("pay", 0) == ran.count("Pay"), entered

    paid = f"{run_id}-paid"
    asyncio.run(to_pause(url, paid, world))
    asyncio.run(persistence(url, paid).resume(Answer("bob")))
    assert asyncio.run(hand_step(persistence(url, paid), world)) == "Answer"
    charges = world.sink.counts().get("charge", 0)
    pays = world.entered().get("pay", 0)

    def kill_after_charge(node: str) -> None:
        if node == "pay.after_effect":
            os.kill(os.getpid(), signal.SIGKILL)

    payer = World(world.folder, on_enter=kill_after_charge)
    outcomes = raced([lambda: asyncio.run(hand_step(persistence(url, paid), payer))] * 3)
    assert [o.status for o in outcomes].count("killed") == 1, outcomes
    assert all(o.raised("ResumeConflict") for o in outcomes if o.status == "error"), outcomes
    took_over = [o.value for o in outcomes if o.ok]  # a racer that came past the lease
    assert took_over in ([], ["Pay"]), outcomes
    assert world.sink.counts()["charge"] == charges + 1

    async def recover() -> list[str]:
        ran: list[str] = []
        while not ran or ran[-1] != Done.__name__:
            try:
                ran.append(await hand_step(persistence(url, paid), world))
            except ResumeConflict:  # the dead payer's lease has not run out yet
                await asyncio.sleep(0.1)
        return ran

    assert asyncio.run(recover()) == [*([] if took_over else [Pay.__name__]), Done.__name__]
    line = asyncio.run(persistence(url, paid).load_all())
    nodes = [(type(s.node).__name__, s.status) for s in line if isinstance(s, NodeSnapshot)]
    assert nodes == [
        ("Start", "success"),
        ("Ask", "created"),
        ("Answer", "success"),
        ("Pay", "success"),
        ("Done", "success"),
    ]
    end = line[-1]
    assert isinstance(end, EndSnapshot) and end.result.data == "paid 100"
    assert end.state["approved_by"] == "bob"
    assert end.state["log"] == ["start", "answer", "pay", "done"]
    assert world.sink.counts()["charge"] == charges + 1
    assert world.entered()["pay"] == pays + 2
